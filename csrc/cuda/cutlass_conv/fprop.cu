// The fused unit's forward on CUTLASS: y = conv2d(relu(scale * x + shift), weight) (+ residual)
// as an implicit-GEMM fprop (M = N*P*Q output pixels, N = Co, K = kh*kw*C) whose main loop
// applies the BatchNorm-ReLU to the A operand (x) in registers (common.cuh), and whose epilogue
// adds the residual (beta = 1 with the residual as the source; beta = 0 reads no source).
#include "common.cuh"
#include "plan.h"

#include <atomic>
#include <limits>

#include "cutlass/conv/device/implicit_gemm_convolution_fusion.h"
#include "cutlass/conv/kernel/default_conv2d_fprop_fusion.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

namespace fusedres::cutlass_conv {
namespace {

// Six tiles, 16-byte accesses, cp.async multistage (the sm_80 kernels; sm_90 runs them too),
// picked by plan::fprop_tile: 128 x 128 of 4 warps of 64 x 64 (Co > 64); for Co <= 64 (no
// half-empty tile) 256 x 64 of 8 warps of 32 x 64 (with 4 warps of 64 x 64 ptxas spilled 16 B
// on sm_90) or 128 x 64 of 4 warps of 64 x 32; for Co <= 32, 128 x 32 of 4 warps of 32 x 32;
// for Co <= 16, 128 x 16 of 2 warps of 64 x 16 (BK = 16 is not a tile CUTLASS's fused main
// loop takes: it needs two warp-level MMA steps a stage); each where its tiles fill the SMs;
// else 64 x 64 of 4 warps of 32 x 32 (more blocks for small grids).
using FpropLarge = ConvTile<128, 128, 64, 64, 4, Launch<128, 66048>>;
using FpropTall = ConvTile<256, 64, 32, 64, 4, Launch<256, 82432>>;
using FpropNarrow = ConvTile<128, 64, 64, 32, 4, Launch<128, 49664>>;
using FpropThin = ConvTile<128, 32, 32, 32, 4, Launch<128, 41472>>;
using FpropSmall = ConvTile<64, 64, 32, 32, 4, Launch<128, 33280>>;
using FpropSlim = ConvTile<128, 16, 64, 16, 4, Launch<64, 37376>>;
static_assert(matches<FpropLarge>(plan::shape(plan::FpropTile::large)) &&
                  matches<FpropTall>(plan::shape(plan::FpropTile::tall)) &&
                  matches<FpropNarrow>(plan::shape(plan::FpropTile::narrow)) &&
                  matches<FpropThin>(plan::shape(plan::FpropTile::thin)) &&
                  matches<FpropSmall>(plan::shape(plan::FpropTile::small)) &&
                  matches<FpropSlim>(plan::shape(plan::FpropTile::slim)),
              "the tiles are plan.h's");

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
  launch<K>(args);
}

// Calls f with the tile (an empty object of its ConvTile type).
template <typename F>
void with_tile(plan::FpropTile tile, F&& f) {
  switch (tile) {
    case plan::FpropTile::large: return f(FpropLarge{});
    case plan::FpropTile::tall: return f(FpropTall{});
    case plan::FpropTile::narrow: return f(FpropNarrow{});
    case plan::FpropTile::thin: return f(FpropThin{});
    case plan::FpropTile::small: return f(FpropSmall{});
    case plan::FpropTile::slim: return f(FpropSlim{});
  }
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
  const plan::FpropTile tile =
      plan::fprop_tile(y.size(0) * y.size(2) * y.size(3), weight.size(0), sm_count(), sm_major());
  bool ok = false;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "fusedres_cuda_cutlass_fprop", [&] {
    using E = typename Element<scalar_t>::type;
    with_tile(tile, [&](auto t) { ok = implementable<Fprop<E, decltype(t)>>(p); });
  });
  return ok;
}

void fprop(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& s,
           const at::Tensor& b, const at::Tensor* residual, at::Tensor& y,
           const ConvArgs& conv) {
  TORCH_CHECK(nhwc16(y, x.scalar_type()), "fusedres_cuda (CUTLASS): y must be channels-last");
  check_scale_shift(s, b, x);
  // The filter as KRSC: weight's channels-last layout ((Co, C, kh, kw) with C fastest), read by
  // 16-byte accesses: contiguous() returns the weight itself where it is already channels-last
  // (every 1x1 weight), which may be a view at any offset, so an unaligned one is copied.
  at::Tensor wk = weight.contiguous(at::MemoryFormat::ChannelsLast);
  if (!aligned16(wk.const_data_ptr())) wk = wk.clone(at::MemoryFormat::ChannelsLast);
  const plan::FpropTile tile =
      plan::fprop_tile(y.size(0) * y.size(2) * y.size(3), weight.size(0), sm_count(), sm_major());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "fusedres_cuda_cutlass_fprop", [&] {
    with_tile(tile, [&](auto t) { run<scalar_t, decltype(t)>(x, wk, s, b, residual, y, conv); });
  });
}

}  // namespace fusedres::cutlass_conv
