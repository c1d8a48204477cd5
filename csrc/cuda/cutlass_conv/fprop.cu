// The fused unit's forward on CUTLASS: y = conv2d(relu(scale * x + shift), weight) (+ residual)
// as an implicit-GEMM fprop (M = N*P*Q output pixels, N = Co, K = kh*kw*C) whose main loop
// applies the BatchNorm-ReLU to the A operand (x) in registers (common.cuh), and whose epilogue
// adds the residual (beta = 1 with the residual as the source; beta = 0 reads no source).
#include "common.cuh"

#include <atomic>
#include <limits>

#include "cutlass/conv/device/implicit_gemm_convolution_fusion.h"
#include "cutlass/conv/kernel/default_conv2d_fprop_fusion.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

namespace fusedres::cutlass_conv {
namespace {

// Three tiles of 4 warps, 16-byte accesses, cp.async multistage (the sm_80 kernels; sm_90 runs
// them too), the table fprop_tile: 128 x 128 of 64 x 64 warps (Co > 64) or 128 x 64 of 64 x 32
// warps (Co <= 64: no half-empty tile) where its tiles fill every SM once, else 64 x 64 of
// 32 x 32 warps (more blocks for small grids).
using FpropLarge = ConvTile<128, 128, 64, 64, 4, Launch<128, 66048>>;
using FpropNarrow = ConvTile<128, 64, 64, 32, 4, Launch<128, 49664>>;
using FpropSmall = ConvTile<64, 64, 32, 32, 4, Launch<128, 33280>>;

// One forward configuration: the operands' element type and the tile.
template <typename E, typename T>
struct Fprop {
  using Tile = T;
  using Epilogue = cutlass::epilogue::thread::LinearCombination<
      E, 128 / cutlass::sizeof_bits<E>::value, float, float>;
  using Conv = typename cutlass::conv::kernel::DefaultConv2dFpropFusion<
      E, cutlass::layout::TensorNHWC, E, cutlass::layout::TensorNHWC, E,
      cutlass::layout::RowMajor, E, cutlass::layout::TensorNHWC, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, typename Tile::Block,
      typename Tile::Warp, cutlass::gemm::GemmShape<16, 8, 16>, Epilogue,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, Tile::kStages,
      cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized>::Kernel;
  using Op = cutlass::conv::device::ImplicitGemmConvolutionFusion<Conv>;
  using Transform = cutlass::conv::warp::FpropScaleBiasReluTransform<
      typename Conv::Mma::Operator::TransformedFragmentA,
      typename Conv::Mma::WarpIteratorScaleBias::Fragment>;
  static_assert(OwnTransform<Transform>::value == std::is_same_v<E, cutlass::bfloat16_t>,
                "the bfloat16 forward takes this project's transform, the float16 one CUTLASS's");
};

template <typename T, typename Tile>
void run(const at::Tensor& x, const at::Tensor& wk, const at::Tensor& s, const at::Tensor& b,
         const at::Tensor* residual, at::Tensor& y, const ConvArgs& c) {
  using E = typename Element<T>::type;
  using K = Fprop<E, Tile>;
  const auto p = problem(x, wk, y.size(2), y.size(3), c, 1);
  auto ref = [](const at::Tensor& t) {
    return cutlass::TensorRef<E, cutlass::layout::TensorNHWC>(
        reinterpret_cast<E*>(const_cast<void*>(t.const_data_ptr())),
        cutlass::layout::TensorNHWC::packed({static_cast<int>(t.size(0)), static_cast<int>(t.size(2)),
                                             static_cast<int>(t.size(3)), static_cast<int>(t.size(1))}));
  };
  auto vec = [](const at::Tensor& t) {
    return cutlass::TensorRef<E, cutlass::layout::RowMajor>(
        reinterpret_cast<E*>(const_cast<void*>(t.const_data_ptr())),
        cutlass::layout::RowMajor(static_cast<int>(t.numel())));
  };
  const at::Tensor& src = residual != nullptr ? *residual : y;
  typename K::Op::Arguments args(p, ref(x), ref(wk), vec(s), vec(b), ref(src), ref(y),
                                 {1.0f, residual != nullptr ? 1.0f : 0.0f});
  launch<K>(args, x);
}

enum class FpropPick { large, narrow, small };

// The table (tools/perfmodel/cuda_sass.cutlass_fprop_tile is its copy): the 128-row tile as
// wide as Co needs where its tiles fill every SM at least once, else the small one.
FpropPick fprop_tile(int64_t M, int64_t Co, int64_t sms) {
  const bool narrow = Co <= FpropNarrow::kCols;
  const int64_t cols = narrow ? FpropNarrow::kCols : FpropLarge::kCols;
  const int64_t tiles = (M + 127) / 128 * ((Co + cols - 1) / cols);
  if (tiles < sms) return FpropPick::small;
  return narrow ? FpropPick::narrow : FpropPick::large;
}

}  // namespace

std::atomic<int64_t>& launch_counter() {
  static std::atomic<int64_t> count{0};
  return count;
}

int64_t launches() { return launch_counter().load(std::memory_order_relaxed); }

bool can_run_fprop(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* residual,
                   const at::Tensor& y, const ConvArgs& conv) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (!(operands_ok(x, weight) && nhwc16(y, x.scalar_type()) && y.numel() <= kIntMax &&
        (residual == nullptr ||
         (nhwc16(*residual, x.scalar_type()) && residual->numel() <= kIntMax)))) {
    return false;
  }
  const auto p = problem(x, weight, y.size(2), y.size(3), conv, 1);
  const FpropPick pick = fprop_tile(y.size(0) * y.size(2) * y.size(3), weight.size(0),
                                    sm_count());
  bool ok = false;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "fusedres_cuda_cutlass_fprop", [&] {
    using E = typename Element<scalar_t>::type;
    switch (pick) {
      case FpropPick::large: ok = implementable<Fprop<E, FpropLarge>>(p); break;
      case FpropPick::narrow: ok = implementable<Fprop<E, FpropNarrow>>(p); break;
      case FpropPick::small: ok = implementable<Fprop<E, FpropSmall>>(p); break;
    }
  });
  return ok;
}

void fprop(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
           const at::Tensor& shift, const at::Tensor* residual, at::Tensor& y,
           const ConvArgs& conv) {
  TORCH_CHECK(nhwc16(y, x.scalar_type()), "fusedres_cuda (CUTLASS): y must be channels-last");
  // The filter as KRSC: weight's channels-last layout ((Co, C, kh, kw) with C fastest), read by
  // 16-byte accesses: contiguous() returns the weight itself where it is already channels-last
  // (every 1x1 weight), which may be a view at any offset, so an unaligned one is copied.
  at::Tensor wk = weight.contiguous(at::MemoryFormat::ChannelsLast);
  if (!aligned16(wk.const_data_ptr())) wk = wk.clone(at::MemoryFormat::ChannelsLast);
  const auto [s, b] = scale_shift(scale, shift, x.scalar_type());
  const FpropPick pick =
      fprop_tile(y.size(0) * y.size(2) * y.size(3), weight.size(0), sm_count());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "fusedres_cuda_cutlass_fprop", [&] {
    switch (pick) {
      case FpropPick::large: return run<scalar_t, FpropLarge>(x, wk, s, b, residual, y, conv);
      case FpropPick::narrow: return run<scalar_t, FpropNarrow>(x, wk, s, b, residual, y, conv);
      case FpropPick::small: return run<scalar_t, FpropSmall>(x, wk, s, b, residual, y, conv);
    }
  });
}

}  // namespace fusedres::cutlass_conv
