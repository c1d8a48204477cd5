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
  using Prologue = BlockAffine<typename Aten<E>::type>;

  // One block: its own row of 16-bit scale and shift (block_affine16: the channels over the
  // block's threads), a barrier (its stores before its own cp.async reads of them, CTA scope:
  // no block reads another's row or waits on another), then CUTLASS's implicit GEMM as its
  // kernel object runs a block (ImplicitGemmConvolutionFusion::operator() for one slice: run()
  // builds the problem unsplit, and its grid check refuses any other) with the scale-bias
  // iterator on that row. Spelled out rather than that operator() on a copy of the parameters
  // with the row's pointers: the copy sat in 464 B of stack, which the iterators then read in
  // the main loop.
  CUTLASS_DEVICE static void run(const typename Conv::Params& params,
                                 typename Conv::SharedStorage& storage, const Prologue& pro) {
    using Mma = typename Conv::Mma;
    const int64_t block = static_cast<int64_t>(blockIdx.x) +
                          static_cast<int64_t>(gridDim.x) *
                              (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
    auto* row = pro.scratch + block * 2 * pro.v.C;
    ::fusedres::FUSEDRES_CUDA_NS::block_affine16(pro.v, row);
    __syncthreads();
    const cutlass::gemm::GemmCoord tile =
        typename Conv::ThreadblockSwizzle().get_tile_offset(params.swizzle_log_tile);
    if (params.grid_tiled_shape.m() <= tile.m() || params.grid_tiled_shape.n() <= tile.n()) {
      return;
    }
    const int thread = threadIdx.x;
    const int warp = cutlass::canonical_warp_idx_sync();
    const int lane = threadIdx.x % 32;
    typename Mma::IteratorA a(params.iterator_A, params.problem_size, params.ptr_A, thread,
                              cutlass::MatrixCoord(tile.m() * Mma::Shape::kM, 0));
    typename Mma::IteratorB b(params.iterator_B, params.problem_size, params.ptr_B, thread,
                              cutlass::MatrixCoord(0, tile.n() * Mma::Shape::kN));
    typename Mma::IteratorScaleBias scale_bias(
        params.iterator_scale_bias, params.problem_size, reinterpret_cast<const E*>(row),
        reinterpret_cast<const E*>(row + pro.v.C), thread, cutlass::MatrixCoord(0, 0));
    Mma mma(storage.main_loop, thread, warp, lane);
    typename Mma::FragmentC acc;
    acc.clear();
    mma(params.gemm_k_iterations, acc, a, b, scale_bias, acc);
    const cutlass::MatrixCoord offset(tile.m() * Mma::Shape::kM, tile.n() * Mma::Shape::kN);
    const auto extent = Conv::ConvOutputIteratorParameter::extent(params.problem_size);
    typename Conv::Epilogue::OutputTileIterator d(params.iterator_D, params.ptr_D, extent, thread,
                                                  offset);
    typename Conv::Epilogue::OutputTileIterator c(params.iterator_C, params.ptr_C, extent, thread,
                                                  offset);
    typename Conv::Epilogue epilogue(storage.epilogue, thread, warp, lane);
    epilogue(typename Conv::EpilogueOutputOp(params.output_op), d, acc, c);
  }
  using Transform = cutlass::conv::warp::FpropScaleBiasReluTransform<
      typename Conv::Mma::Operator::TransformedFragmentA,
      typename Conv::Mma::WarpIteratorScaleBias::Fragment>;
  static_assert(OwnTransform<Transform>::value == std::is_same_v<E, cutlass::bfloat16_t>,
                "the bfloat16 forward takes this project's transform, the float16 one CUTLASS's");
};

// Each block's scale and shift rows: a (blocks, 2, C) scratch of x's dtype, one row for each of
// plan.h's tiles, checked against CUTLASS's grid before the launch (BlockAffine); rows of 4C
// bytes, C a multiple of 8, so every row and its shift half are 16-byte aligned for the
// iterator's accesses. CUTLASS's Arguments get null vectors: Fprop::run builds the scale-bias
// iterator on the block's row, and a kernel that read the parameters' pointers would fault.
template <typename T, typename Tile>
void run(const at::Tensor& x, const at::Tensor& wk, const BnVectors<float>& v,
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
  const int64_t tiles = plan::tiles(plan::Shape{Tile::kRows, Tile::kCols},
                                    y.size(0) * y.size(2) * y.size(3), y.size(1));
  at::Tensor scratch = at::empty({tiles, 2, v.C}, x.options());
  const cutlass::TensorRef<E, cutlass::layout::RowMajor> vec(
      nullptr, cutlass::layout::RowMajor(static_cast<int>(v.C)));
  const at::Tensor& src = residual != nullptr ? *residual : y;
  typename K::Op::Arguments args(p, ref(x), ref(wk), vec, vec, ref(src), ref(y),
                                 {1.0f, residual != nullptr ? 1.0f : 0.0f});
  launch<K>(args, [&](dim3 grid) {
    const int64_t blocks = static_cast<int64_t>(grid.x) * grid.y * grid.z;
    TORCH_CHECK(blocks == tiles, "fusedres_cuda (CUTLASS): the forward's grid has ", blocks,
                " blocks, its scratch rows ", tiles, " (plan.h's tile against CUTLASS's grid)");
    return typename K::Prologue{v, scratch.data_ptr<T>()};
  });
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

void fprop(const at::Tensor& x, const at::Tensor& weight,
           const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
           const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor* residual,
           at::Tensor& y, const ConvArgs& conv) {
  TORCH_CHECK(nhwc16(y, x.scalar_type()), "fusedres_cuda (CUTLASS): y must be channels-last");
  auto f32 = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == x.size(1);
  };
  TORCH_CHECK(f32(mean) && f32(invstd) && (!present(bn_weight) || f32(*bn_weight)) &&
                  (!present(bn_bias) || f32(*bn_bias)),
              "fusedres_cuda (CUTLASS): mean, invstd, bn_weight and bn_bias must be float32 (C,) "
              "vectors (the statistics of 16-bit x)");
  const BnVectors<float> v = bn_vectors<float>(bn_weight, bn_bias, mean, invstd);
  // The filter as KRSC: weight's channels-last layout ((Co, C, kh, kw) with C fastest), read by
  // 16-byte accesses: contiguous() returns the weight itself where it is already channels-last
  // (every 1x1 weight), which may be a view at any offset, so an unaligned one is copied.
  at::Tensor wk = weight.contiguous(at::MemoryFormat::ChannelsLast);
  if (!aligned16(wk.const_data_ptr())) wk = wk.clone(at::MemoryFormat::ChannelsLast);
  const plan::FpropTile tile =
      plan::fprop_tile(y.size(0) * y.size(2) * y.size(3), weight.size(0), sm_count(), sm_major());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "fusedres_cuda_cutlass_fprop", [&] {
    with_tile(tile, [&](auto t) { run<scalar_t, decltype(t)>(x, wk, v, residual, y, conv); });
  });
}

}  // namespace fusedres::cutlass_conv
