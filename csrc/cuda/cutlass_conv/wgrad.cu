// The fused unit's weight gradient on CUTLASS: dW = sum over output pixels of grad_out (x) a,
// a = relu(scale * x + shift) at each tap, as an implicit-GEMM wgrad (M = Co, N = kh*kw*C,
// K = N*P*Q pixels) whose main loop applies the BatchNorm-ReLU to the B operand (x) in registers
// (common.cuh). Accumulated in float32, the reduction split over blockIdx.z (serial split-K: the
// slices add into the float32 output in slice order, behind a semaphore per tile, so the sum's
// order is fixed), then rounded to the weight's dtype and layout.
#include "common.cuh"

#include "cutlass/conv/device/implicit_gemm_convolution_fusion.h"
#include "cutlass/conv/kernel/default_conv2d_wgrad_fusion.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

namespace fusedres::cutlass_conv {
namespace {

// Three tiles (the table: wgrad_plan): 128 x 128 of 8 warps of 64 x 32 (Co > 64; with 4 warps
// of 64 x 64 ptxas spilled on sm_90), 64 x 128 of 4 warps of 32 x 64 (Co 33..64: no half-empty
// tile), 64 x 64 of 4 warps of 32 x 32 (Co <= 32, or kh * kw * C <= 64 columns).
using WgradLarge = ConvTile<128, 128, 64, 32, 4, Launch<256, 65536>>;
using WgradNarrow = ConvTile<64, 128, 32, 64, 4, Launch<128, 49152>>;
using WgradSmall = ConvTile<64, 64, 32, 32, 4, Launch<128, 32768>>;

// One weight-gradient configuration: the operands' element type and the tile; float32 output.
template <typename E, typename T>
struct Wgrad {
  using Tile = T;
  using Epilogue = cutlass::epilogue::thread::LinearCombination<float, 4, float, float>;
  using Conv = typename cutlass::conv::kernel::DefaultConv2dWgradFusion<
      E, cutlass::layout::TensorNHWC, E, cutlass::layout::TensorNHWC, E,
      cutlass::layout::RowMajor, float, cutlass::layout::TensorNHWC, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, typename Tile::Block,
      typename Tile::Warp, cutlass::gemm::GemmShape<16, 8, 16>, Epilogue,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, Tile::kStages,
      cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized>::Kernel;
  using Op = cutlass::conv::device::ImplicitGemmConvolutionFusion<Conv>;
  using Transform = cutlass::conv::warp::WgradScaleBiasReluTransform<
      typename Conv::Mma::Operator::TransformedFragmentB,
      typename Conv::Mma::IteratorScaleBias::Fragment>;
  static_assert(OwnTransform<Transform>::value == std::is_same_v<E, cutlass::bfloat16_t>,
                "the bfloat16 weight gradient takes this project's transform, float16 CUTLASS's");
};

// The pixels split so that about two blocks per SM run, each slice at least kMinSlicePixels
// pixels (64 K-steps of 32), at most kMaxSlices (the slices' epilogues run one after another).
// The tiles and the cap are the model's choice: of the candidates it priced on the 22 units of
// benchmarks/GPU_MODEL.md (64 x 128 for every Co <= 64 or never; caps 16, 32, 64), this table
// had the lowest worst-case and summed weight-gradient time (tools/perfmodel: MODELED).
constexpr int64_t kMinSlicePixels = 2048;
constexpr int64_t kMaxSlices = 32;

enum class WgradPick { large, narrow, small };

struct WgradPlan {
  WgradPick tile;
  int split;
};

// The table (tools/perfmodel/cuda_sass.cutlass_wgrad_plan is its copy).
WgradPlan wgrad_plan(int64_t Co, int64_t columns, int64_t pixels, int64_t sms) {
  const WgradPick tile = columns <= WgradSmall::kCols || Co <= 32 ? WgradPick::small
                         : Co <= WgradNarrow::kRows               ? WgradPick::narrow
                                                                  : WgradPick::large;
  const int64_t bm = tile == WgradPick::large ? WgradLarge::kRows : WgradSmall::kRows;
  const int64_t bn = tile == WgradPick::small ? WgradSmall::kCols : WgradLarge::kCols;
  const int64_t t = (Co + bm - 1) / bm * ((columns + bn - 1) / bn);
  const int64_t want = (2 * sms + t - 1) / t;
  const int64_t most = std::max<int64_t>(1, std::min(kMaxSlices, pixels / kMinSlicePixels));
  return {tile, static_cast<int>(std::max<int64_t>(1, std::min(want, most)))};
}

template <typename T, typename Tile>
void run(const at::Tensor& go, const at::Tensor& x, const at::Tensor& s, const at::Tensor& b,
         at::Tensor& dw, int64_t kh, int64_t kw, const ConvArgs& c, int split) {
  using E = typename Element<T>::type;
  using K = Wgrad<E, Tile>;
  auto i = [](int64_t v) { return static_cast<int>(v); };
  // problem() reads the filter's (Co, C, kh, kw) sizes from a tensor: dw is (Co, kh, kw, C).
  const auto p = cutlass::conv::Conv2dProblemSize(
      i(x.size(0)), i(x.size(2)), i(x.size(3)), i(x.size(1)), i(go.size(1)), i(kh), i(kw),
      i(go.size(2)), i(go.size(3)), i(c.padding[0]), i(c.padding[1]), i(c.stride[0]),
      i(c.stride[1]), i(c.dilation[0]), i(c.dilation[1]), cutlass::conv::Mode::kCrossCorrelation,
      split);
  auto nhwc = [&](const at::Tensor& t) {
    return cutlass::TensorRef<E, cutlass::layout::TensorNHWC>(
        reinterpret_cast<E*>(const_cast<void*>(t.const_data_ptr())),
        cutlass::layout::TensorNHWC::packed({i(t.size(0)), i(t.size(2)), i(t.size(3)), i(t.size(1))}));
  };
  auto vec = [&](const at::Tensor& t) {
    return cutlass::TensorRef<E, cutlass::layout::RowMajor>(
        reinterpret_cast<E*>(const_cast<void*>(t.const_data_ptr())),
        cutlass::layout::RowMajor(i(t.numel())));
  };
  const cutlass::TensorRef<float, cutlass::layout::TensorNHWC> out(
      dw.data_ptr<float>(),
      cutlass::layout::TensorNHWC::packed({i(dw.size(0)), i(dw.size(1)), i(dw.size(2)), i(dw.size(3))}));
  typename K::Op::Arguments args(p, nhwc(go), nhwc(x), vec(s), vec(b), out, out, {1.0f, 0.0f},
                                 cutlass::conv::SplitKMode::kSerial);
  launch<K>(args, x);
}

}  // namespace

bool can_run_wgrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                   const ConvArgs& conv) {
  if (!(operands_ok(x, weight) && nhwc16(grad_out, x.scalar_type()) &&
        grad_out.numel() <= std::numeric_limits<int>::max())) {
    return false;
  }
  const int64_t Co = weight.size(0), C = weight.size(1), kh = weight.size(2), kw = weight.size(3);
  const WgradPlan plan = wgrad_plan(Co, kh * kw * C,
                                    grad_out.size(0) * grad_out.size(2) * grad_out.size(3),
                                    sm_count());
  const auto p = problem(x, weight, grad_out.size(2), grad_out.size(3), conv, plan.split);
  bool ok = false;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "fusedres_cuda_cutlass_wgrad", [&] {
    using E = typename Element<scalar_t>::type;
    switch (plan.tile) {
      case WgradPick::large: ok = implementable<Wgrad<E, WgradLarge>>(p); break;
      case WgradPick::narrow: ok = implementable<Wgrad<E, WgradNarrow>>(p); break;
      case WgradPick::small: ok = implementable<Wgrad<E, WgradSmall>>(p); break;
    }
  });
  return ok;
}

void wgrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& scale,
           const at::Tensor& shift, at::Tensor& gw, const ConvArgs& conv) {
  const int64_t Co = gw.size(0), C = gw.size(1), kh = gw.size(2), kw = gw.size(3);
  const auto [s, b] = scale_shift(scale, shift, x.scalar_type());
  at::Tensor dw = at::empty({Co, kh, kw, C}, x.options().dtype(at::kFloat));
  const WgradPlan plan = wgrad_plan(Co, kh * kw * C,
                                    grad_out.size(0) * grad_out.size(2) * grad_out.size(3),
                                    sm_count());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "fusedres_cuda_cutlass_wgrad", [&] {
    switch (plan.tile) {
      case WgradPick::large:
        return run<scalar_t, WgradLarge>(grad_out, x, s, b, dw, kh, kw, conv, plan.split);
      case WgradPick::narrow:
        return run<scalar_t, WgradNarrow>(grad_out, x, s, b, dw, kh, kw, conv, plan.split);
      case WgradPick::small:
        return run<scalar_t, WgradSmall>(grad_out, x, s, b, dw, kh, kw, conv, plan.split);
    }
  });
  gw.copy_(dw.permute({0, 3, 1, 2}));
}

}  // namespace fusedres::cutlass_conv
