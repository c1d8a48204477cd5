// The fused unit's weight gradient on CUTLASS: dW = sum over output pixels of grad_out (x) a at
// each tap, a = relu(scale * x + shift), as CUTLASS's implicit-GEMM wgrad (M = Co, N = kh*kw*C,
// K = N*P*Q pixels) over the activation a that the native data gradient's epilogue wrote
// (../bn_relu_conv2d_dgrad.cuh: the backward runs it first). A plain convolution weight
// gradient: CUTLASS's mainloop-fusion wgrad, which applied the BatchNorm-ReLU to x as it went
// from shared memory to the tensor cores, issued 1.3-1.8 times the instructions a K chunk of each
// tile (every x element transformed once per tap it feeds), and the kernel was issue-bound;
// writing a costs the data gradient one store of x's size. Padding is CUTLASS's zero fill: a's
// padding, as the fused unit defines it.
// Accumulated in float32; the pixels split over blockIdx.z (parallel split-K: each slice writes
// its own float32 partial dW; the caller's dx launch, or a launch of its own, adds them in slice
// order, so the result does not depend on which block finishes first, and rounds the sum to the
// weight's dtype and layout: PartialsSum in ../bn_relu_conv2d_wgrad.cuh).
#include "common.cuh"
#include "plan.h"

#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/conv/kernel/default_conv2d_wgrad.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

namespace fusedres::cutlass_conv {
namespace {

// Four tiles, picked by plan::wgrad_tile: 128 x 128 of 8 warps of 64 x 32 (Co > 64; with 4
// warps of 64 x 64 ptxas spilled on sm_90), 64 x 128 of 4 warps of 32 x 64 (Co 33..64: no
// half-empty tile), 32 x 64 of 2 warps of 32 x 32 (Co <= 32), 64 x 64 of 4 warps of 32 x 32
// (kh * kw * C <= 64 columns).
using WgradLarge = ConvTile<128, 128, 64, 32, 4, Launch<256, 65536>>;
using WgradNarrow = ConvTile<64, 128, 32, 64, 4, Launch<128, 49152>>;
using WgradThin = ConvTile<32, 64, 32, 32, 4, Launch<64, 24576>>;
using WgradSmall = ConvTile<64, 64, 32, 32, 4, Launch<128, 32768>>;
static_assert(matches<WgradLarge>(plan::shape(plan::WgradTile::large)) &&
                  matches<WgradNarrow>(plan::shape(plan::WgradTile::narrow)) &&
                  matches<WgradThin>(plan::shape(plan::WgradTile::thin)) &&
                  matches<WgradSmall>(plan::shape(plan::WgradTile::small)),
              "the tiles are plan.h's");

// One weight-gradient configuration: the operands' element type and the tile; float32 output.
template <typename E, typename T>
struct Wgrad {
  using Tile = T;
  using Epilogue = cutlass::epilogue::thread::LinearCombination<float, 4, float, float>;
  using Conv = typename cutlass::conv::kernel::DefaultConv2dWgrad<
      E, cutlass::layout::TensorNHWC, E, cutlass::layout::TensorNHWC, float,
      cutlass::layout::TensorNHWC, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      typename Tile::Block, typename Tile::Warp, cutlass::gemm::GemmShape<16, 8, 16>, Epilogue,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, Tile::kStages,
      cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized>::Kernel;
  using Op = cutlass::conv::device::ImplicitGemmConvolution<Conv>;
  using Prologue = NoPrologue;

  // One block: CUTLASS's kernel object, called as cutlass::Kernel<> calls it.
  CUTLASS_DEVICE static void run(const typename Conv::Params& params,
                                 typename Conv::SharedStorage& storage, NoPrologue) {
    Conv op;
    op(params, storage);
  }
};

// Calls f with the tile's configuration type (Wgrad<E, tile>) and the tile.
template <typename E, typename F>
void with_tile(plan::WgradTile tile, F&& f) {
  switch (tile) {
    case plan::WgradTile::large: return f(Wgrad<E, WgradLarge>{}, WgradLarge{});
    case plan::WgradTile::narrow: return f(Wgrad<E, WgradNarrow>{}, WgradNarrow{});
    case plan::WgradTile::thin: return f(Wgrad<E, WgradThin>{}, WgradThin{});
    case plan::WgradTile::small: return f(Wgrad<E, WgradSmall>{}, WgradSmall{});
  }
}

struct WgradPlan {
  plan::WgradTile tile;
  int split;  // 0: the tile's kernel is not resident on this GPU (run native)
};

// The tile (plan::wgrad_tile) and the split of the pixels (plan::wgrad_split, with the tile's
// kernel's resident blocks on this GPU; tools/perfmodel/cuda_sass.cutlass_wgrad_plan is the
// model's copy, held to plan.h by tests/test_cutlass.py).
template <typename E>
WgradPlan wgrad_plan(int64_t Co, int64_t columns, int64_t pixels) {
  const plan::WgradTile tile = plan::wgrad_tile(Co, columns);
  int64_t resident = 0;
  with_tile<E>(tile, [&](auto config, auto) { resident = resident_blocks<decltype(config)>(); });
  if (resident == 0) return {tile, 0};
  return {tile, static_cast<int>(plan::wgrad_split(tile, Co, columns, pixels, resident))};
}

// dW's float32 partials (split, Co, kh, kw, C): each slice's to its own (Co, kh, kw, C) block
// (CUTLASS's parallel split-K offsets D by the slice; with split 1 the one block is dW).
template <typename T, typename Tile>
at::Tensor run(const at::Tensor& go, const at::Tensor& a, int64_t Co, int64_t kh, int64_t kw,
               const ConvArgs& c, int split) {
  using E = typename Element<T>::type;
  using K = Wgrad<E, Tile>;
  auto i = [](int64_t v) { return static_cast<int>(v); };
  const int64_t C = a.size(1);
  const auto p = cutlass::conv::Conv2dProblemSize(
      i(a.size(0)), i(a.size(2)), i(a.size(3)), i(C), i(Co), i(kh), i(kw), i(go.size(2)),
      i(go.size(3)), i(c.padding[0]), i(c.padding[1]), i(c.stride[0]), i(c.stride[1]),
      i(c.dilation[0]), i(c.dilation[1]), cutlass::conv::Mode::kCrossCorrelation, split);
  auto nhwc = [&](const at::Tensor& t) {
    return cutlass::TensorRef<E, cutlass::layout::TensorNHWC>(
        reinterpret_cast<E*>(const_cast<void*>(t.const_data_ptr())),
        cutlass::layout::TensorNHWC::packed({i(t.size(0)), i(t.size(2)), i(t.size(3)), i(t.size(1))}));
  };
  const at::Tensor parts = at::empty({split, Co, kh, kw, C}, a.options().dtype(at::kFloat));
  const cutlass::TensorRef<float, cutlass::layout::TensorNHWC> out(
      parts.data_ptr<float>(), cutlass::layout::TensorNHWC::packed({i(Co), i(kh), i(kw), i(C)}));
  typename K::Op::Arguments args(p, nhwc(go), nhwc(a), out, out, {1.0f, 0.0f},
                                 split > 1 ? cutlass::conv::SplitKMode::kParallel
                                           : cutlass::conv::SplitKMode::kSerial);
  launch<K>(args, [](dim3) { return NoPrologue{}; });
  return parts;
}

}  // namespace

bool can_run_wgrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                   const ConvArgs& conv) {
  if (!(operands_ok(x, weight) && nhwc16(grad_out, x.scalar_type()) &&
        grad_out.numel() <= std::numeric_limits<int>::max())) {
    return false;
  }
  const int64_t Co = weight.size(0), C = weight.size(1), kh = weight.size(2), kw = weight.size(3);
  const int64_t pixels = grad_out.size(0) * grad_out.size(2) * grad_out.size(3);
  bool ok = false;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "fusedres_cuda_cutlass_wgrad", [&] {
    using E = typename Element<scalar_t>::type;
    const WgradPlan plan = wgrad_plan<E>(Co, kh * kw * C, pixels);
    if (plan.split == 0) return;
    const auto p = problem(x, weight, grad_out.size(2), grad_out.size(3), conv, plan.split);
    with_tile<E>(plan.tile, [&](auto config, auto) { ok = implementable<decltype(config)>(p); });
  });
  return ok;
}

at::Tensor wgrad(const at::Tensor& grad_out, const at::Tensor& a, const at::Tensor& weight,
                 const ConvArgs& conv) {
  TORCH_CHECK(operands_ok(a, weight),
              "fusedres_cuda (CUTLASS): the weight gradient's activation must be 16-bit "
              "channels-last like x (can_run_wgrad)");
  const int64_t Co = weight.size(0), C = weight.size(1), kh = weight.size(2), kw = weight.size(3);
  const int64_t pixels = grad_out.size(0) * grad_out.size(2) * grad_out.size(3);
  at::Tensor parts;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(a.scalar_type(), "fusedres_cuda_cutlass_wgrad", [&] {
    using E = typename Element<scalar_t>::type;
    const WgradPlan plan = wgrad_plan<E>(Co, kh * kw * C, pixels);
    TORCH_CHECK(plan.split > 0, "fusedres_cuda (CUTLASS): the weight gradient's kernel is not "
                "resident on this GPU (can_run_wgrad says so first)");
    with_tile<E>(plan.tile, [&](auto, auto tile) {
      parts = run<scalar_t, decltype(tile)>(grad_out, a, Co, kh, kw, conv, plan.split);
    });
  });
  return parts;
}

}  // namespace fusedres::cutlass_conv
