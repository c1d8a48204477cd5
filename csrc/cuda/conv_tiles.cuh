// Pieces shared by the fused unit's CUDA kernels (bn_relu_conv2d.cu, bn_relu_conv2d_backward.cu):
// element types, the 4-D index helpers (int64 offsets), the tile shapes, the operand staging that
// recomputes the activation, the two inner products (FMA micro-tiles, or WMMA m16n16k16 for 16-bit
// operands) and host helpers (dtype dispatch, arguments). Kernel code here is plain CUDA: the same
// source is compiled by nvcc and, through the execution layer of common.cuh, by the host compiler.
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "common.cuh"

namespace fusedres::FUSEDRES_CUDA_NS {

// ----------------------------------------------------------------------------- element types

template <typename T>
constexpr bool is_16bit = std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>;

// relu(scale * x + shift): a NaN stays NaN (z <= 0 is false), as torch.relu does.
template <typename A>
__device__ __forceinline__ A bn_relu(A x, A scale, A shift) {
  const A z = x * scale + shift;
  return z <= A(0) ? A(0) : z;
}

// ----------------------------------------------------------------------------- index helpers

// Sizes and element strides of a 4-D tensor; every offset is int64, so N*C*H*W (or any stride)
// past 2^31 is addressed correctly.
struct Dims4 {
  int64_t n, c, h, w;      // sizes
  int64_t sn, sc, sh, sw;  // element strides

  __host__ __device__ int64_t offset(int64_t in, int64_t ic, int64_t ih, int64_t iw) const {
    return in * sn + ic * sc + ih * sh + iw * sw;
  }
};

inline Dims4 dims_of(const at::Tensor& t) {
  return {t.size(0), t.size(1), t.size(2), t.size(3),
          t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// Row index of an implicit GEMM (one output or input pixel) split into (n, h, w) of an
// (N, *, H, W) map: the row count N*H*W may pass 2^31.
struct Pixel {
  int64_t n;
  int32_t h, w;
};

__host__ __device__ inline Pixel pixel_of(int64_t row, int64_t height, int64_t width) {
  const int64_t hw = height * width;
  const int64_t n = row / hw;
  const int64_t r = row - n * hw;
  return {n, static_cast<int32_t>(r / width), static_cast<int32_t>(r % width)};
}

// Division by a divisor d (1 <= d < 2^31) fixed for a launch, of dividends 0 <= n < 2^31, as a
// multiply-high and a shift (Granlund and Montgomery 1994, the form of CUTLASS's FastDivmod):
// with l = ceil(log2 d), p = 31 + l and m = ceil(2^p / d) (< 2^32), n / d = (n * m) >> p
// exactly; d = 1 is taken apart (m would need 2^32). For the main loops, where a division by a
// runtime value costs ~20 instructions.
struct FastDiv {
  uint32_t d, m, s;  // divisor, multiplier, shift (p - 32)
  __host__ __device__ explicit FastDiv(int32_t divisor) : d(static_cast<uint32_t>(divisor)) {
    uint32_t l = 0;
    while ((uint32_t{1} << l) < d) ++l;
    const uint32_t p = 31 + l;
    m = d == 1 ? 0u : static_cast<uint32_t>(((uint64_t{1} << p) + d - 1) / d);
    s = d == 1 ? 0u : p - 32;
  }
  __host__ __device__ int32_t div(int32_t n) const {
    const uint32_t hi = static_cast<uint32_t>((uint64_t{static_cast<uint32_t>(n)} * m) >> 32);
    return static_cast<int32_t>(d == 1 ? static_cast<uint32_t>(n) : hi >> s);
  }
};

// Convolution geometry (kernel taps, stride, padding, dilation) in the forward's terms.
struct ConvGeom {
  int32_t kh, kw, sh, sw, ph, pw, dh, dw;
};

// Smallest non-negative residue: the stride-phase tests take it of negative operands too.
__host__ __device__ inline int32_t mod_pos(int32_t a, int32_t m) {
  const int32_t r = a % m;
  return r < 0 ? r + m : r;
}

// ----------------------------------------------------------------------------- tile shapes

// A GEMM tile of BM x BN outputs reduced BK at a time by THREADS threads. FMA tiles: each
// thread owns a TM x TN micro-tile (rows strided by BM / TM, columns by BN / TN). WMMA tiles:
// warps of 32 own WM x WN sub-tiles of 16 x 16 fragments. Operand tiles in shared memory are
// k-major, As[BK][BM + APAD] and Bs[BK][BN + BPAD]: a column-major A and a row-major B for the
// fragments (ldm a multiple of 8 halves, every fragment pointer 32-byte aligned), and
// conflict-free broadcasts for the micro-tiles.
template <int BM_, int BN_, int BK_, int THREADS_, bool WMMA_>
struct Tile {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, THREADS = THREADS_;
  static constexpr bool WMMA = WMMA_;
  static constexpr int APAD = WMMA ? 8 : 4;
  static constexpr int BPAD = WMMA ? 8 : 4;
  static constexpr int CPAD = 4;
  // FMA micro-tile
  static constexpr int TN = 4;
  static constexpr int TM = BM * BN / (THREADS * TN);
  static constexpr int COLS = BN / TN;  // threads along N
  static constexpr int ROWS = BM / TM;  // threads along M
  // WMMA warp grid
  static constexpr int WARPS = THREADS / 32;
  static constexpr int WARPS_N = (BN / 16) >= 2 && WARPS >= 2 ? 2 : 1;
  static constexpr int WARPS_M = WARPS / WARPS_N;
  static constexpr int FM = BM / 16 / WARPS_M;  // fragments per warp along M
  static constexpr int FN = BN / 16 / WARPS_N;  // and along N
  static_assert(WMMA || (TM >= 1 && ROWS * TM == BM && COLS * TN == BN &&
                         ROWS * COLS == THREADS), "FMA tile does not divide among the threads");
  static_assert(!WMMA || (FM >= 1 && FN >= 1 && FM * 16 * WARPS_M == BM &&
                          FN * 16 * WARPS_N == BN && BK % 16 == 0),
                "WMMA tile does not divide among the warps");
};

// The tiles each kernel launches with, by operand type: float32 and float64 on FMA (no TF32:
// float32 products stay exact as on the other backends), 16-bit types on tensor cores.
template <typename W>
struct TilesFor {
  using Fwd = Tile<64, 64, 16, 256, false>;
};
template <>
struct TilesFor<double> {
  using Fwd = Tile<32, 32, 16, 128, false>;
};
template <>
struct TilesFor<at::Half> {
  using Fwd = Tile<64, 64, 32, 128, true>;
};
template <>
struct TilesFor<at::BFloat16> {
  using Fwd = Tile<64, 64, 32, 128, true>;
};

// The WMMA / FMA tile (rows, columns, depth) for weight dtype wt: the forward's and the data
// gradient's kernels launch with the same one (TilesFor<W>::Fwd).
inline std::array<int64_t, 3> wmma_tile(at::ScalarType wt) {
  const auto of = [](auto w) {
    using T = typename TilesFor<decltype(w)>::Fwd;
    return std::array<int64_t, 3>{T::BM, T::BN, T::BK};
  };
  switch (wt) {
    case at::kDouble: return of(double{});
    case at::kHalf: return of(at::Half{});
    case at::kBFloat16: return of(at::BFloat16{});
    default: return of(float{});
  }
}

// f(tile) with an mma.sync kernel family's tile of `rows` x `cols` x `depth` (the forward's:
// MmaFwdThin, MmaFwdTall, MmaFwdSmall; the data gradient's: MmaDgrad...): Thin<rows, cols,
// depth> for 16 or 32 columns, else Tall (128 rows) or Small (64); the columns and depth as
// mma_cols and mma_depth (mma_tiles.cuh) choose them. `who` names the caller in the error.
template <template <int, int, int> class Thin, typename Tall, typename Small, typename F>
void with_mma_tile(const char* who, int64_t rows, int64_t cols, int64_t depth, F&& f) {
  TORCH_CHECK(rows == Tall::BM || rows == Small::BM, who, ": no mma.sync tile of ", rows,
              " rows");
  constexpr int R = Tall::BM, r = Small::BM;
  const bool tall = rows == R;
  if (cols == 16 && depth == 16) {
    tall ? f(Thin<R, 16, 16>{}) : f(Thin<r, 16, 16>{});
  } else if (cols == 16) {
    tall ? f(Thin<R, 16, 32>{}) : f(Thin<r, 16, 32>{});
  } else if (cols == 32) {
    tall ? f(Thin<R, 32, 32>{}) : f(Thin<r, 32, 32>{});
  } else {
    tall ? f(Tall{}) : f(Small{});
  }
}

// ----------------------------------------------------------------------------- inner products

// Registers of one thread for a Tile: the FMA micro-tile accumulators, or WMMA fragments.
template <typename W, typename T, bool WMMA = T::WMMA>
struct Accum;

template <typename W, typename T>
struct Accum<W, T, false> {
  using A = acc_t<W>;
  A v[T::TM][T::TN];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < T::TM; ++i)
#pragma unroll
      for (int j = 0; j < T::TN; ++j) v[i][j] = A(0);
  }

  // acc += As^T Bs over the BK slice (As[k][m], Bs[k][n] in shared memory).
  __device__ __forceinline__ void mma(const W (*As)[T::BM + T::APAD],
                                     const W (*Bs)[T::BN + T::BPAD], int tid) {
    const int tx = tid % T::COLS, ty = tid / T::COLS;
#pragma unroll 4
    for (int k = 0; k < T::BK; ++k) {
      A a[T::TM], b[T::TN];
#pragma unroll
      for (int i = 0; i < T::TM; ++i) a[i] = static_cast<A>(As[k][ty + i * T::ROWS]);
#pragma unroll
      for (int j = 0; j < T::TN; ++j) b[j] = static_cast<A>(Bs[k][tx + j * T::COLS]);
#pragma unroll
      for (int i = 0; i < T::TM; ++i)
#pragma unroll
        for (int j = 0; j < T::TN; ++j) v[i][j] += a[i] * b[j];
    }
  }

  // The accumulators into Cs[BM][BN + CPAD] (row-major).
  __device__ __forceinline__ void store(A (*Cs)[T::BN + T::CPAD], int tid) const {
    const int tx = tid % T::COLS, ty = tid / T::COLS;
#pragma unroll
    for (int i = 0; i < T::TM; ++i)
#pragma unroll
      for (int j = 0; j < T::TN; ++j) Cs[ty + i * T::ROWS][tx + j * T::COLS] = v[i][j];
  }
};

template <typename W, typename T>
struct Accum<W, T, true> {
  using A = float;
  using E = native_t<W>;
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> c[T::FM][T::FN];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < T::FM; ++i)
#pragma unroll
      for (int j = 0; j < T::FN; ++j) nvcuda::wmma::fill_fragment(c[i][j], 0.0f);
  }

  __device__ __forceinline__ void mma(const W (*As)[T::BM + T::APAD],
                                      const W (*Bs)[T::BN + T::BPAD], int tid) {
    using namespace nvcuda;
    const int warp = tid / 32;
    const int wm = (warp / T::WARPS_N) * T::FM * 16, wn = (warp % T::WARPS_N) * T::FN * 16;
#pragma unroll
    for (int k = 0; k < T::BK; k += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::col_major> fa[T::FM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::row_major> fb[T::FN];
#pragma unroll
      for (int i = 0; i < T::FM; ++i) {
        wmma::load_matrix_sync(fa[i], reinterpret_cast<const E*>(&As[k][wm + 16 * i]),
                               T::BM + T::APAD);
      }
#pragma unroll
      for (int j = 0; j < T::FN; ++j) {
        wmma::load_matrix_sync(fb[j], reinterpret_cast<const E*>(&Bs[k][wn + 16 * j]),
                               T::BN + T::BPAD);
      }
#pragma unroll
      for (int i = 0; i < T::FM; ++i)
#pragma unroll
        for (int j = 0; j < T::FN; ++j) wmma::mma_sync(c[i][j], fa[i], fb[j], c[i][j]);
    }
  }

  __device__ __forceinline__ void store(float (*Cs)[T::BN + T::CPAD], int tid) const {
    using namespace nvcuda;
    const int warp = tid / 32;
    const int wm = (warp / T::WARPS_N) * T::FM * 16, wn = (warp % T::WARPS_N) * T::FN * 16;
#pragma unroll
    for (int i = 0; i < T::FM; ++i)
#pragma unroll
      for (int j = 0; j < T::FN; ++j) {
        wmma::store_matrix_sync(&Cs[wm + 16 * i][wn + 16 * j], c[i][j], T::BN + T::CPAD,
                                wmma::mem_row_major);
      }
  }
};

// ----------------------------------------------------------------------------- host helpers

inline std::vector<int64_t> ints(c10::SymIntArrayRef v) {
  return C10_AS_INTARRAYREF_SLOW(v).vec();
}

// Streaming multiprocessors of the current device (tile choice, split-K sizing); the host copy
// sizes its grids as for a GPU of host_sm_count() SMs, so it runs the same decomposition.
inline int64_t sm_count() {
#if defined(__CUDACC__)
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
#else
  return host_sm_count();
#endif
}

// The current GPU's compute capability's major number (the host copy: its knob, 9 by default).
inline int64_t sm_major() {
#if defined(__CUDACC__)
  return at::cuda::getCurrentDeviceProperties()->major;
#else
  return host_sm_major();
#endif
}

// Storage type pairs (x, weight) the kernels are built for: equal types, and float32 with a
// 16-bit type either way (autocast: BatchNorm input in float32, convolution in the autocast
// dtype; or 16-bit activations with float32 weights).
template <typename X, typename W>
constexpr bool supported_pair =
    std::is_same_v<X, W> || (std::is_same_v<X, float> && is_16bit<W>) ||
    (is_16bit<X> && std::is_same_v<W, float>);

// Calls f(X{}, W{}) with the storage types of x and weight (AT_DISPATCH over both).
template <typename F>
void dispatch_x_w(const char* name, at::ScalarType xt, at::ScalarType wt, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xt, "fusedres_cuda_x", [&] {
    using X = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, wt, "fusedres_cuda_w", [&] {
      using W = scalar_t;
      if constexpr (supported_pair<X, W>) {
        f(X{}, W{});
      } else {
        TORCH_CHECK(false, name, ": x of dtype ", xt, " with weight of dtype ", wt,
                    " is not supported (equal dtypes, or float32 with float16/bfloat16)");
      }
    });
  });
}

// Per-channel BatchNorm affine in the statistics dtype: bn(x) = scale * x + shift (the vectors
// the native forward and weight gradient read; channel_affine, common.cuh, computes each).
struct Affine {
  at::Tensor scale, shift;
};

// The BatchNorm weight and bias as the kernels that compute channel_affine read them:
// contiguous (C,) vectors of the statistics dtype, or undefined where the op has none.
struct AffineInputs {
  at::Tensor w, b;
};

inline AffineInputs affine_inputs(const std::optional<at::Tensor>& bn_weight,
                                  const std::optional<at::Tensor>& bn_bias) {
  auto vec = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() ? t->contiguous() : at::Tensor();
  };
  return {vec(bn_weight), vec(bn_bias)};
}

template <typename A>
inline const A* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<A>() : nullptr;
}

// Every channel's channel_affine, so the kernels read the values of the portable rule bit for
// bit. One launch where the ATen ops were three; vectors at any stride (the ops take views).
template <typename A>
__global__ void __launch_bounds__(256)
    bn_affine_kernel(BnVectors<A> v, A* __restrict__ scale, A* __restrict__ shift) {
  FUSEDRES_LAUNCH_BOUNDS(256);
  // Not unrolled: a grid-stride loop of a few trips, which nvcc unrolled 4 times after a 64-bit
  // division for the trip count (a subroutine call, 8 B spilled around it on sm_80).
#pragma unroll 1
  for (int64_t c = global_thread_x(); c < v.C; c += grid_stride_x()) {
    const ChannelAffine<A> f = v.at(c);
    scale[c] = f.scale;
    shift[c] = f.shift;
  }
}

inline Affine bn_affine(const std::optional<at::Tensor>& bn_weight,
                        const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean,
                        const at::Tensor& invstd) {
  // The ops check the vectors first (checks.h): C values each, of the statistics dtype.
  const int64_t C = mean.numel();
  Affine a{at::empty({C}, mean.options()), at::empty({C}, mean.options())};
  if (C == 0) return a;
  AT_DISPATCH_FLOATING_TYPES(mean.scalar_type(), "fusedres_cuda_bn_affine", [&] {
    using A = scalar_t;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(C, 256), 1024));
    FUSEDRES_LAUNCH(dim3(blocks), dim3(256), 0, current_stream(), bn_affine_kernel<A>)(
        bn_vectors<A>(bn_weight, bn_bias, mean, invstd), a.scale.data_ptr<A>(),
        a.shift.data_ptr<A>());
    FUSEDRES_CHECK_LAUNCH();
  });
  return a;
}

// The branch scale (stochastic depth's per-sample factor; checked by the op: checks.h) as a
// contiguous (N,) tensor in the accumulator dtype of the weight (float64 for float64, else
// float32); undefined without one.
inline at::Tensor branch_scale_acc(const std::optional<at::Tensor>& branch_scale,
                                   const at::Tensor& weight) {
  if (!present(branch_scale)) return {};
  const auto acc = weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return branch_scale->to(acc).contiguous();
}

}  // namespace fusedres::FUSEDRES_CUDA_NS
