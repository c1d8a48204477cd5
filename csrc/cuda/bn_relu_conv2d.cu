// Forward of the fused unit: y = conv2d(relu(scale * x + shift), weight) + bias + residual, and
// with genstats the per-channel (mean, biased variance) of y for the next BatchNorm.
//
// Implicit GEMM (the algorithm of kernels/bn_relu_conv2d.py): rows are output pixels
// (M = N*Ho*Wo), columns output channels (Co), the reduction runs over the taps and then the
// input channels (K = kh*kw*C). A block owns a BM x BN output tile; per tap it stages BK
// channels of x for its BM pixels into shared memory as the activation: the BatchNorm affine
// and the ReLU are applied on the way, a tap outside the image stages 0 (zero padding of a,
// never of x), and a is rounded to the weight dtype, as the unfused sequence does. float32 and
// float64 accumulate on FMA micro-tiles (no TF32), float16 and bfloat16 on tensor cores (WMMA
// m16n16k16, float32 accumulators; or, for 16-bit channels-last x with C % 8 == 0, the
// mma.sync + ldmatrix + cp.async kernel further down, bn_relu_conv2d_fwd_mma_kernel). The epilogue adds bias, multiplies by the sample's branch
// scale (stochastic depth; y = residual + s[n] * (conv + bias)) and adds the residual in the
// accumulator dtype, stores y once, and with genstats reduces each tile column to (mean, M2) of the stored
// (rounded) y over the tile's rows; the host merges the tiles with Chan's formula in float64.
#include <torch/library.h>

#include <cstdlib>
#include <string>

// FUSEDRES_CUDA_KERNELS and the CUTLASS forward (plain C++: before the host layer's macros).
#include "cutlass_conv/cutlass_conv.h"
#include "conv_tiles.cuh"
#include "mma.cuh"
#include "mma_tiles.cuh"
#include "ops.h"

namespace fusedres::FUSEDRES_CUDA_NS {
namespace {

// The per-row table of both forward kernels, for the block's BM output rows m0 .. m0 + BM - 1
// (output pixels of y, M in all): row_n[r] the sample (-1 past M), row_oh[r], row_ow[r] the
// output pixel (0 past M). The caller synchronises before reading it.
template <int BM, int THREADS>
__device__ __forceinline__ void fill_row_table(int64_t* row_n, int32_t* row_oh, int32_t* row_ow,
                                               int64_t m0, int64_t M, const Dims4& yd,
                                               int tid) {
  for (int r = tid; r < BM; r += THREADS) {
    const int64_t m = m0 + r;
    if (m < M) {
      const Pixel p = pixel_of(m, yd.h, yd.w);
      row_n[r] = p.n;
      row_oh[r] = p.h;
      row_ow[r] = p.w;
    } else {
      row_n[r] = -1;
      row_oh[r] = row_ow[r] = 0;
    }
  }
}

// The epilogue of both forward kernels, on the block's BM x BN accumulator tile in shared memory
// (Cs[m][n], rows of LD): y = (acc + bias) * branch_scale[n] + residual, stored once in the
// weight dtype; with genstats (part_mean non-null) each tile column's (mean, M2) of the stored
// (rounded) y over the tile's valid rows. row_n[m] is -1 past M.
template <typename W, int BM, int BN, int LD, int THREADS>
__device__ __forceinline__ void store_tile(
    acc_t<W> (*Cs)[LD], const int64_t* row_n, const int32_t* row_oh, const int32_t* row_ow,
    const W* __restrict__ bias, const W* __restrict__ res,
    const acc_t<W>* __restrict__ branch_scale, W* __restrict__ y,
    acc_t<W>* __restrict__ part_mean, acc_t<W>* __restrict__ part_m2, const Dims4& yd,
    const Dims4& rd, int64_t M, int64_t m0, int64_t co0, int tid) {
  using C = acc_t<W>;
  const int64_t Co = yd.c;
  // Epilogue: consecutive threads along y's contiguous dimension.
  const bool y_channels_fast = yd.sc == 1;
  const bool genstats = part_mean != nullptr;
  for (int e = tid; e < BM * BN; e += THREADS) {
    const int m = y_channels_fast ? e / BN : e % BM;
    const int n = y_channels_fast ? e % BN : e / BM;
    const int64_t co = co0 + n;
    if (row_n[m] >= 0 && co < Co) {
      C v = Cs[m][n];
      if (bias != nullptr) v += static_cast<C>(bias[co]);
      if (branch_scale != nullptr) v *= branch_scale[row_n[m]];
      if (res != nullptr) v += static_cast<C>(res[rd.offset(row_n[m], co, row_oh[m], row_ow[m])]);
      const W out = static_cast<W>(v);
      y[yd.offset(row_n[m], co, row_oh[m], row_ow[m])] = out;
      if (genstats) Cs[m][n] = static_cast<C>(out);  // statistics of y as stored
    }
  }
  if (!genstats) return;
  __syncthreads();
  // Per column: the tile's mean over its valid rows (the first `rows`), then its M2 from the
  // deviations, corrected by their sum (exact two-pass; an infinite mean stays as it is).
  const int rows = static_cast<int>(M - m0 < BM ? M - m0 : BM);
  for (int n = tid; n < BN; n += THREADS) {
    const int64_t co = co0 + n;
    if (co >= Co) continue;
    C s = C(0);
    for (int m = 0; m < rows; ++m) s += Cs[m][n];
    const C cnt = static_cast<C>(rows);
    const C mean0 = s / cnt;
    C sd = C(0), sq = C(0);
    for (int m = 0; m < rows; ++m) {
      const C d = Cs[m][n] - mean0;
      sd += d;
      sq += d * d;
    }
    part_mean[blockIdx.x * Co + co] = mean0 - mean0 == C(0) ? mean0 + sd / cnt : mean0;
    part_m2[blockIdx.x * Co + co] = sq - sd * sd / cnt;
  }
}


template <typename X, typename W, typename T>
__global__ void __launch_bounds__(T::THREADS)
    bn_relu_conv2d_fwd_kernel(const X* __restrict__ x, const W* __restrict__ w,
                              const acc_t<X>* __restrict__ scale,
                              const acc_t<X>* __restrict__ shift, const W* __restrict__ bias,
                              const W* __restrict__ res,
                              const acc_t<W>* __restrict__ branch_scale, W* __restrict__ y,
                              acc_t<W>* __restrict__ part_mean, acc_t<W>* __restrict__ part_m2,
                              Dims4 xd, Dims4 wd, Dims4 yd, Dims4 rd, ConvGeom g, int64_t M) {
  FUSEDRES_LAUNCH_BOUNDS(T::THREADS);
  using A = acc_t<X>;  // BatchNorm arithmetic
  using C = acc_t<W>;  // accumulators
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, THREADS = T::THREADS;
  __shared__ __align__(32) W As[BK][BM + T::APAD];
  __shared__ __align__(32) W Bs[BK][BN + T::BPAD];
  __shared__ __align__(32) C Cs[BM][BN + T::CPAD];
  __shared__ int64_t row_n[BM];    // sample of the tile's row, -1 past M
  __shared__ int32_t row_oh[BM];   // output pixel of the row
  __shared__ int32_t row_ow[BM];
  __shared__ int64_t tap_off[BM];  // offset of x[n, 0, ih, iw] at the current tap, -1 outside

  const int tid = threadIdx.x;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t co0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int64_t Cin = xd.c, Co = yd.c;
  fill_row_table<BM, THREADS>(row_n, row_oh, row_ow, m0, M, yd, tid);
  Accum<W, T> acc;
  acc.zero();
  // Stage along the contiguous dimension of x: channels for channels_last, pixels for NCHW.
  const bool x_channels_fast = xd.sc == 1;
  for (int t = 0; t < g.kh * g.kw; ++t) {
    const int i = t / g.kw, j = t % g.kw;
    __syncthreads();  // row_* written; the previous tap's tap_off no longer read
    for (int r = tid; r < BM; r += THREADS) {
      int64_t off = -1;
      if (row_n[r] >= 0) {
        const int64_t ih = int64_t(row_oh[r]) * g.sh - g.ph + int64_t(i) * g.dh;
        const int64_t iw = int64_t(row_ow[r]) * g.sw - g.pw + int64_t(j) * g.dw;
        if (ih >= 0 && ih < xd.h && iw >= 0 && iw < xd.w) off = xd.offset(row_n[r], 0, ih, iw);
      }
      tap_off[r] = off;
    }
    __syncthreads();
    for (int64_t c0 = 0; c0 < Cin; c0 += BK) {
      for (int e = tid; e < BM * BK; e += THREADS) {
        const int m = x_channels_fast ? e / BK : e % BM;
        const int k = x_channels_fast ? e % BK : e / BM;
        const int64_t c = c0 + k;
        const int64_t off = tap_off[m];
        A a = A(0);
        if (off >= 0 && c < Cin) a = bn_relu(static_cast<A>(x[off + c * xd.sc]), scale[c], shift[c]);
        As[k][m] = static_cast<W>(a);
      }
      for (int e = tid; e < BN * BK; e += THREADS) {
        const int k = e % BK, n = e / BK;
        const int64_t c = c0 + k, co = co0 + n;
        Bs[k][n] = (c < Cin && co < Co) ? w[wd.offset(co, c, i, j)] : static_cast<W>(0.0f);
      }
      __syncthreads();
      acc.mma(As, Bs, tid);
      __syncthreads();
    }
  }
  acc.store(Cs, tid);
  __syncthreads();
  store_tile<W, BM, BN, BN + T::CPAD, THREADS>(Cs, row_n, row_oh, row_ow, bias, res, branch_scale,
                                             y, part_mean, part_m2, yd, rd, M, m0, co0, tid);
}

// ----------------------------------------------------------------------------- tensor-core path

// The forward of 16-bit x and weight of the same dtype, x channels-last with C a multiple of 8
// (every pixel's channels in 16-byte pieces): mma.sync m16n8k16 on operands that cp.async stages
// into shared memory, 16 bytes a copy, through a STAGES-deep pipeline with one barrier per
// K chunk (BK channels of one tap). A block of 4 warps owns a BM x BN output tile (MmaFwd: 64 x 64
// of 2 x 2 warps of 32 x 32, or 128 x 64 of 4 x 1 warps of 32 x 64, or a thin tile for
// Co <= 32; forward_mma_rows, mma_cols and mma_depth pick one per shape). x
// rows are copied raw: a tap outside the image
// or a row past M is zero-filled, channels past C too. The BatchNorm affine and the ReLU are
// applied to the A fragments after ldmatrix, in float32 and rounded to the weight dtype as the
// unfused sequence does, and a fragment row whose tap is padding (or past M) is set to 0: the
// padding is of a = relu(bn(x)), never of x (the copying thread writes each row's tap flag
// beside the stage, Vs). No division in the main loop: the next chunk's tap, channel offset and
// address shift are stepped one chunk at a time, and a row's tap-(0, 0) offset is computed
// once. The weight is pre-packed (host) as a row-major (kh*kw*C, Co8) matrix, Co8 = Co rounded
// up to 8 with zero columns: row tap*C + c. Shared rows are padded by 8 halves (A: 80 bytes,
// B: 144 bytes in the 64 x 32 tiles; 48 or 80 in the thin ones), so the 8 row addresses of each
// ldmatrix phase fall in 8 different 4-bank groups. The accumulators go through shared memory
// (aliasing the drained pipeline) to the epilogue shared with the other path (store_tile).
template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int BK_ = 32>
struct MmaFwd {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = 3;
  static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, THREADS = 32 * WARPS_M * WARPS_N;
  // Resident blocks per SM promised to ptxas (__launch_bounds__' second argument): without it
  // ptxas gave the 64 x 64 tile 96 registers and a 4-byte spill on sm_90; 4 blocks (128
  // registers) keep it at 0, 3 (170) the 128 x 64 tile's 159 registers on sm_80.
  static constexpr int MIN_BLOCKS = BM == 64 ? 4 : 3;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // warp tile
  static constexpr int FM = WM / 16, FN = WN / 8;      // m16 tiles, n8 tiles per warp
  static constexpr int AST = BK + 8, BST = BN + 8, CLD = BN + 4;  // shared row lengths
  static constexpr int A_COPIES = BM * BK / 8 / THREADS;           // 16-byte copies per thread
  // A thin tile has fewer 16-byte pieces of B per chunk than threads: the first ones copy them.
  static constexpr int B_PIECES = BK * BN / 8;
  static constexpr int B_COPIES = (B_PIECES + THREADS - 1) / THREADS;
  static constexpr int A_BYTES = STAGES * BM * AST * 2;
  static constexpr int B_BYTES = STAGES * BK * BST * 2;
  static constexpr int S_BYTES = STAGES * 2 * BK * 4;  // scale and shift of the chunk's channels
  static constexpr int V_BYTES = STAGES * BM;          // the rows' tap flags
  static constexpr int PIPE_BYTES = A_BYTES + B_BYTES + S_BYTES + V_BYTES;
  static constexpr int C_BYTES = BM * CLD * 4;
  static constexpr int SMEM = PIPE_BYTES > C_BYTES ? PIPE_BYTES : C_BYTES;
  static_assert(A_COPIES * THREADS * 8 == BM * BK &&
                    (B_COPIES * THREADS == B_PIECES || B_PIECES < THREADS),
                "the 16-byte copies do not divide among the threads");
  static_assert(WM * WARPS_M == BM && WN * WARPS_N == BN && FM * 16 == WM && FN % 2 == 0,
                "warp grid");
  static_assert(2 * BK / 4 <= THREADS, "one thread per 16 bytes of scale and shift");
  static_assert(A_BYTES % 128 == 0 && B_BYTES % 128 == 0, "stage buffers 128-byte aligned");
  static_assert(SMEM + BM * 16 <= 48 * 1024, "static shared memory (with the row tables)");
};
// The two tile configurations (forward_mma_rows picks one per shape): 64 x 64 tiles of 4 warps
// of 32 x 32 (2 x 2: every A row is loaded and transformed by 2 warps), and 128 x 64 tiles of 4
// warps of 32 x 64 (4 x 1: each warp owns its A rows, so every A element is transformed once,
// and each A fragment feeds 8 mma's instead of 4; twice the multiply-adds per barrier).
using MmaFwdSmall = MmaFwd<64, 64, 2, 2>;
using MmaFwdTall = MmaFwd<128, 64, 4, 1>;
// For Co <= 32 a 64-column tile spends half or three quarters of its mma's on zero-filled
// columns, and for C <= 16 a 32-deep chunk half of them on zero-filled K (CIFAR's 16-channel
// units are bound by them on the A100: benchmarks/GPU_MODEL.md): the thin tiles, 64 or 128 rows
// x 16 or 32 columns of 4 x 1 warps (mma_cols), 16 deep where C and Co are both at most
// 16 (mma_depth). Each element's sum takes the same m16n8k16 steps with data in the
// same order (a 32-deep chunk over 16 channels adds a step of zeros).
template <int BM, int BN, int BK>
using MmaFwdThin = MmaFwd<BM, BN, 4, 1, BK>;

// Two 16-bit values of one register through relu(scale * x + shift), rounded back to W.
template <typename W>
__device__ __forceinline__ uint32_t bn_relu2(uint32_t v, float s0, float b0, float s1,
                                             float b1) {
  uint16_t lo = static_cast<uint16_t>(v & 0xffffu), hi = static_cast<uint16_t>(v >> 16);
  W xl, xh;
  memcpy(&xl, &lo, 2);
  memcpy(&xh, &hi, 2);
  const W al = static_cast<W>(bn_relu(static_cast<float>(xl), s0, b0));
  const W ah = static_cast<W>(bn_relu(static_cast<float>(xh), s1, b1));
  return ptx::pack2(al, ah);
}

// The BatchNorm-ReLU on a warp's A fragments of K offset kk: fa[i][r] holds rows g + 8 (r % 2)
// of tile i, channels kk + 8 (r / 2) + t2, + 1 (g = lane / 4, t2 = 2 (lane % 4)); ss: the
// stage's scale (ss[0]) and shift (ss[1]) per channel; a row whose tap flag (valid) is clear
// becomes 0 (padding of a, never of x).
template <typename W, int FM, int BK>
__device__ __forceinline__ void bn_relu_frags(uint32_t (&fa)[FM][4], const float (*ss)[BK],
                                              const bool (&valid)[FM][2], int kk, int t2) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int k = kk + 8 * (r / 2) + t2;
    const float s0 = ss[0][k], s1 = ss[0][k + 1];
    const float b0 = ss[1][k], b1 = ss[1][k + 1];
#pragma unroll
    for (int i = 0; i < FM; ++i) {
      fa[i][r] = valid[i][r % 2] ? bn_relu2<W>(fa[i][r], s0, b0, s1, b1) : 0u;
    }
  }
}

template <typename W, typename T>
__global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
    bn_relu_conv2d_fwd_mma_kernel(const W* __restrict__ x, const W* __restrict__ wp,
                                  const float* __restrict__ scale,
                                  const float* __restrict__ shift, const W* __restrict__ bias,
                                  const W* __restrict__ res,
                                  const float* __restrict__ branch_scale, W* __restrict__ y,
                                  float* __restrict__ part_mean, float* __restrict__ part_m2,
                                  Dims4 xd, Dims4 yd, Dims4 rd, ConvGeom g, int64_t M,
                                  int64_t co8) {
  FUSEDRES_LAUNCH_BOUNDS(T::THREADS, T::MIN_BLOCKS);
  using E = native_t<W>;
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, STAGES = T::STAGES, THREADS = T::THREADS;
  __shared__ __align__(128) unsigned char smem[T::SMEM];
  __shared__ int64_t row_n[BM];  // sample of the tile's row, -1 past M
  __shared__ int32_t row_oh[BM];
  __shared__ int32_t row_ow[BM];
  auto* As = reinterpret_cast<uint16_t(*)[BM][T::AST]>(smem);
  auto* Bs = reinterpret_cast<uint16_t(*)[BK][T::BST]>(smem + T::A_BYTES);
  auto* Ss = reinterpret_cast<float(*)[2][BK]>(smem + T::A_BYTES + T::B_BYTES);
  auto* Vs = reinterpret_cast<uint8_t(*)[BM]>(smem + T::A_BYTES + T::B_BYTES + T::S_BYTES);
  auto* Cs = reinterpret_cast<float(*)[T::CLD]>(smem);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t co0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int64_t Cin = xd.c;
  // A copied row's source at tap (0, 0): the element offset of x[n, 0, ih, iw] and the input
  // pixel ih = oh * sh - ph, iw = ow * sw - pw; a row past M has ih = kOutside, outside the
  // image at every tap. A tap (i, j) moves it by (i * dh, j * dw), the same for every row.
  struct Src {
    int64_t off;
    int32_t ih, iw;
  };
  constexpr int32_t kOutside = -(1 << 30);
  const auto src_of = [&](int r) {
    const int64_t m = m0 + r;
    if (m >= M) return Src{0, kOutside, 0};
    const Pixel p = pixel_of(m, yd.h, yd.w);
    const int32_t ih = p.h * g.sh - g.ph, iw = p.w * g.sw - g.pw;
    return Src{p.n * xd.sn + int64_t(ih) * xd.sh + int64_t(iw) * xd.sw, ih, iw};
  };
  fill_row_table<BM, THREADS>(row_n, row_oh, row_ow, m0, M, yd, tid);
  // The rows this thread copies (copy e = tid + q * THREADS: row e / (BK / 8)).
  Src a_src[T::A_COPIES];
#pragma unroll
  for (int q = 0; q < T::A_COPIES; ++q) a_src[q] = src_of((tid + q * THREADS) / (BK / 8));
  const int wm = (warp / T::WARPS_N) * T::WM, wn = (warp % T::WARPS_N) * T::WN;

  const int32_t Cin32 = static_cast<int32_t>(Cin);
  const int chunks = g.kh * g.kw * static_cast<int>((Cin + BK - 1) / BK);
  const uint32_t H = static_cast<uint32_t>(xd.h), Wd = static_cast<uint32_t>(xd.w);
  // The next chunk to copy, stepped one chunk at a time (no division in the loop): its channel
  // offset c0 in the tap, the tap's column tj, its input-pixel shift (dih, diw) and element
  // offset toff, and the packed weight's first row for the tap (tap * C).
  struct Next {
    int32_t c0, tj, dih, diw;
    int64_t toff, krow;
  } nx{0, 0, 0, 0, 0, 0};
  const auto step = [&] {
    nx.c0 += BK;
    if (nx.c0 < Cin32) return;
    nx.c0 = 0;
    nx.krow += Cin;
    if (++nx.tj < g.kw) {
      nx.diw += g.dw;
    } else {
      nx.tj = 0;
      nx.diw = 0;
      nx.dih += g.dh;
    }
    nx.toff = int64_t(nx.dih) * xd.sh + int64_t(nx.diw) * xd.sw;
  };
  // Issue the copies of chunk nx into stage st (the caller commits): x rows raw (zero-filled
  // where the tap is outside the image, past M or past C), each row's tap flag into Vs (the
  // thread copying its first 16 bytes), the weight rows, the channels' scale and shift.
  const auto load = [&](int st) {
#pragma unroll
    for (int q = 0; q < T::A_COPIES; ++q) {
      const int e = tid + q * THREADS, r = e / (BK / 8), k = (e % (BK / 8)) * 8;
      const bool in = static_cast<uint32_t>(a_src[q].ih + nx.dih) < H &&
                      static_cast<uint32_t>(a_src[q].iw + nx.diw) < Wd;
      const bool ok = in && nx.c0 + k < Cin32;
      ptx::cp_async_cg16(&As[st][r][k], ok ? x + (a_src[q].off + nx.toff + nx.c0 + k) : x,
                         ok ? 16 : 0);
      if (k == 0) Vs[st][r] = in ? 1 : 0;
    }
    stage_b<T>(Bs[st], tid, wp, [&](int r, int n) -> const W* {
      return nx.c0 + r < Cin32 && co0 + n < co8 ? wp + (nx.krow + nx.c0 + r) * co8 + co0 + n
                                                : nullptr;
    });
    if (tid < 2 * BK / 4) {
      const int which = tid / (BK / 4), k = (tid % (BK / 4)) * 4;
      const float* v = which == 0 ? scale : shift;
      const bool ok = nx.c0 + k < Cin32;
      ptx::cp_async_cg16(&Ss[st][which][k], ok ? v + nx.c0 + k : v, ok ? 16 : 0);
    }
  };

  float acc[T::FM][T::FN][4];
  zero_acc(acc);

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < chunks) {
      load(st);
      step();
    }
    ptx::cp_async_commit();
  }
  const int lr = (lane % 8) + 8 * ((lane / 8) % 2), lc = 8 * (lane / 16);
  const int t2 = 2 * (lane % 4);
  int st = 0, next_st = STAGES - 1;  // the stages of chunk kc and of chunk kc + STAGES - 1
  for (int kc = 0; kc < chunks; ++kc) {
    // Chunk kc has landed (at most STAGES - 2 younger groups in flight), and every warp is done
    // with chunk kc - 1, whose stage the copies of chunk kc + STAGES - 1 now overwrite (its tap
    // flags, written by plain stores, are published by the same barrier).
    ptx::cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (kc + STAGES - 1 < chunks) {
      load(next_st);
      step();
    }
    ptx::cp_async_commit();

    // The tap flags of this lane's fragment rows: tile i, half h (rows g and g + 8).
    bool valid[T::FM][2];
#pragma unroll
    for (int i = 0; i < T::FM; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) valid[i][h] = Vs[st][wm + 16 * i + 8 * h + lane / 4] != 0;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t fa[T::FM][4], fb[T::FN / 2][4];
      load_frags(fa, fb, As[st], Bs[st], wm, wn, kk, lr, lc);
      bn_relu_frags<W>(fa, Ss[st], valid, kk, t2);
      mma_tiles<E>(acc, fa, fb);
    }
    st = st + 1 == STAGES ? 0 : st + 1;
    next_st = next_st + 1 == STAGES ? 0 : next_st + 1;
  }
  // Drain the (empty) trailing groups; every warp is done with the stages before Cs reuses them.
  ptx::cp_async_wait<0>();
  __syncthreads();
  store_acc(Cs, acc, wm, wn, lane);
  __syncthreads();
  store_tile<W, BM, BN, T::CLD, THREADS>(Cs, row_n, row_oh, row_ow, bias, res, branch_scale, y,
                                         part_mean, part_m2, yd, rd, M, m0, co0, tid);
}

// The tensor-core path's requirements on x (beyond 16-bit x and weight of one dtype): channels
// contiguous, C a multiple of 8 and every pixel at a multiple of 8 elements (16-byte cp.async
// sources), the data and the BatchNorm affine 16-byte aligned.
inline bool use_mma_forward(const at::Tensor& x, const Affine& bn) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return x.stride(1) == 1 && x.size(1) % 8 == 0 && x.stride(0) % 8 == 0 &&
         x.stride(2) % 8 == 0 && x.stride(3) % 8 == 0 && aligned(x.const_data_ptr()) &&
         aligned(bn.scale.const_data_ptr()) && aligned(bn.shift.const_data_ptr());
}

// The weight packed for the tensor-core path: (Co, C, kh, kw) -> row-major (kh*kw*C, Co8),
// row (i*kw + j)*C + c, Co8 = Co rounded up to 8 (zero columns).
inline at::Tensor pack_weight(const at::Tensor& weight) {
  const int64_t Co = weight.size(0), K = weight.size(1) * weight.size(2) * weight.size(3);
  at::Tensor wp = weight.permute({2, 3, 1, 0}).reshape({K, Co});
  const int64_t co8 = ceil_div(Co, 8) * 8;
  if (co8 != Co) wp = at::constant_pad_nd(wp, {0, co8 - Co});
  wp = wp.contiguous();
  // A weight whose permuted view is already contiguous comes back as that view, whose storage
  // offset may leave it off the 16-byte boundary the copies need: a fresh allocation is on it.
  if (reinterpret_cast<uintptr_t>(wp.const_data_ptr()) % 16 != 0) wp = wp.clone();
  return wp;
}

static_assert(MmaFwdTall::BN == 64 && MmaFwdTall::BK == 32,
              "mma_cols and mma_depth (mma_tiles.cuh) end at the 64 x 32 tile");

// The mma.sync forward's tile rows for M output pixels and Co output channels: 128 when its
// tiles fill every SM at least once (cdiv(M, 128) * cdiv(Co, mma_cols(Co)) >= the SM
// count), else 64 (twice the blocks for small grids). tools/perfmodel/cuda_sass.py
// (forward_mma_rows) prices the same rule.
inline int64_t forward_mma_rows(int64_t M, int64_t Co) {
  return ceil_div(M, MmaFwdTall::BM) * ceil_div(Co, mma_cols(Co)) >= sm_count()
             ? MmaFwdTall::BM
             : MmaFwdSmall::BM;
}

template <typename W, typename T>
void launch_forward_mma(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                        const Affine& bn, const at::Tensor* residual, const at::Tensor* bscale,
                        at::Tensor& y, at::Tensor* part_mean, at::Tensor* part_m2,
                        const ConvGeom& g, int64_t M) {
  const at::Tensor wp = pack_weight(weight);
  const dim3 grid(static_cast<unsigned>(ceil_div(M, T::BM)),
                  static_cast<unsigned>(ceil_div(weight.size(0), T::BN)));
  const Dims4 rd = residual != nullptr ? dims_of(*residual) : Dims4{};
  FUSEDRES_LAUNCH(grid, dim3(T::THREADS), 0, current_stream(),
                  bn_relu_conv2d_fwd_mma_kernel<W, T>)(
      x.const_data_ptr<W>(), wp.const_data_ptr<W>(), bn.scale.const_data_ptr<float>(),
      bn.shift.const_data_ptr<float>(), bias != nullptr ? bias->const_data_ptr<W>() : nullptr,
      residual != nullptr ? residual->const_data_ptr<W>() : nullptr,
      bscale != nullptr ? bscale->const_data_ptr<float>() : nullptr, y.data_ptr<W>(),
      part_mean != nullptr ? part_mean->data_ptr<float>() : nullptr,
      part_m2 != nullptr ? part_m2->data_ptr<float>() : nullptr, dims_of(x), dims_of(y), rd, g,
      M, wp.size(1));
  FUSEDRES_CHECK_LAUNCH();
}

// bm: the tile rows forward_rows chose (the genstats partials have one row per tile).
template <typename X, typename W>
void launch_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                    const Affine& bn, const at::Tensor* residual, const at::Tensor* bscale,
                    at::Tensor& y,
                    at::Tensor* part_mean, at::Tensor* part_m2, const ConvGeom& g, int64_t M,
                    int64_t bm) {
  using T = typename TilesFor<W>::Fwd;
  using A = acc_t<X>;
  using C = acc_t<W>;
  if constexpr (is_16bit<W> && std::is_same_v<X, W>) {
    if (use_mma_forward(x, bn)) {
      const int64_t Cin = x.size(1), Co = weight.size(0);
      with_mma_tile<MmaFwdThin, MmaFwdTall, MmaFwdSmall>(
          "launch_forward", bm, mma_cols(Co), mma_depth(Co, Cin), [&](auto tile) {
        launch_forward_mma<W, decltype(tile)>(x, weight, bias, bn, residual, bscale, y,
                                              part_mean, part_m2, g, M);
      });
      return;
    }
  }
  TORCH_CHECK(bm == T::BM, "launch_forward: the FMA / WMMA tile has ", T::BM, " rows, not ", bm);
  const dim3 grid(static_cast<unsigned>(ceil_div(M, T::BM)),
                  static_cast<unsigned>(ceil_div(weight.size(0), T::BN)));
  const Dims4 rd = residual != nullptr ? dims_of(*residual) : Dims4{};
  FUSEDRES_LAUNCH(grid, dim3(T::THREADS), 0, current_stream(),
                  bn_relu_conv2d_fwd_kernel<X, W, T>)(
      x.const_data_ptr<X>(), weight.const_data_ptr<W>(), bn.scale.const_data_ptr<A>(),
      bn.shift.const_data_ptr<A>(), bias != nullptr ? bias->const_data_ptr<W>() : nullptr,
      residual != nullptr ? residual->const_data_ptr<W>() : nullptr,
      bscale != nullptr ? bscale->const_data_ptr<C>() : nullptr, y.data_ptr<W>(),
      part_mean != nullptr ? part_mean->data_ptr<C>() : nullptr,
      part_m2 != nullptr ? part_m2->data_ptr<C>() : nullptr, dims_of(x), dims_of(weight),
      dims_of(y), rd, g, M);
  FUSEDRES_CHECK_LAUNCH();
}

// The tile rows of the kernel launch_forward runs: the mma.sync path's per-shape choice
// (forward_mma_rows), else the FMA / WMMA tile's for the weight dtype.
int64_t forward_rows(const at::Tensor& x, const at::Tensor& weight, const Affine& bn, int64_t M) {
  const at::ScalarType wt = weight.scalar_type();
  if (x.scalar_type() == wt && (wt == at::kHalf || wt == at::kBFloat16) && use_mma_forward(x, bn)) {
    return forward_mma_rows(M, weight.size(0));
  }
  return wmma_tile(wt)[0];
}

// genstats: y's per-channel mean and biased variance from the forward tiles' partials, (tiles,
// Co) means and M2s (float32, float64 for float64), tile t holding min(bm, M - t * bm) pixels:
// the mean as the counts' weighted sum of the tile means, then M2 as the tiles' M2s plus
// count * (tile mean - mean)^2 (Chan's merge), in float64, in the column reductions' blocks
// (common.cuh: kColumnCols channels x kColumnLanes row lanes, column_lanes_sum; the same bits
// every run). One launch where ATen's were fifteen (casts, an arange, a clamp, the products,
// two sums, the divisions).
template <typename P, typename S>
__global__ void __launch_bounds__(kColumnCols * kColumnLanes)
    genstats_merge_kernel(const P* __restrict__ part_mean, const P* __restrict__ part_m2,
                          int64_t tiles, int64_t Co, int64_t M, int64_t bm,
                          S* __restrict__ mean_out, S* __restrict__ var_out) {
  FUSEDRES_LAUNCH_BOUNDS(kColumnCols * kColumnLanes);
  __shared__ double lanes[1][kColumnLanes][kColumnCols];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnCols + threadIdx.x;
  const double inv_m = 1.0 / static_cast<double>(M);
  double v[1] = {0.0};
  if (c < Co) {
    for (int64_t t = threadIdx.y; t < tiles; t += kColumnLanes) {
      const double n = static_cast<double>(std::min(bm, M - t * bm));
      v[0] += n * static_cast<double>(part_mean[t * Co + c]);
    }
  }
  column_lanes_sum(lanes, v);
  const double mean = v[0] * inv_m;
  v[0] = 0.0;
  if (c < Co) {
    for (int64_t t = threadIdx.y; t < tiles; t += kColumnLanes) {
      const double n = static_cast<double>(std::min(bm, M - t * bm));
      const double d = static_cast<double>(part_mean[t * Co + c]) - mean;
      v[0] += static_cast<double>(part_m2[t * Co + c]) + n * d * d;
    }
  }
  column_lanes_sum(lanes, v);
  if (threadIdx.y != 0 || c >= Co) return;
  mean_out[c] = static_cast<S>(mean);
  var_out[c] = static_cast<S>(v[0] * inv_m);
}

std::pair<at::Tensor, at::Tensor> genstats_merge(const at::Tensor& part_mean,
                                                 const at::Tensor& part_m2, int64_t M,
                                                 int64_t bm, at::ScalarType sdt) {
  const int64_t tiles = part_mean.size(0), Co = part_mean.size(1);
  const auto opts = part_mean.options().dtype(sdt);
  std::pair<at::Tensor, at::Tensor> out{at::empty({Co}, opts), at::empty({Co}, opts)};
  if (Co == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(part_mean.scalar_type(), "fusedres_cuda_genstats_merge", [&] {
    using P = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(sdt, "fusedres_cuda_genstats_merge", [&] {
      using S = scalar_t;
      FUSEDRES_LAUNCH(dim3(static_cast<unsigned>(ceil_div(Co, kColumnCols))),
                      dim3(kColumnCols, kColumnLanes), 0, current_stream(),
                      genstats_merge_kernel<P, S>)(
          part_mean.const_data_ptr<P>(), part_m2.const_data_ptr<P>(), tiles, Co, M, bm,
          out.first.data_ptr<S>(), out.second.data_ptr<S>());
      FUSEDRES_CHECK_LAUNCH();
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
    c10::SymIntArrayRef stride_, c10::SymIntArrayRef padding_, c10::SymIntArrayRef dilation_,
    bool genstats, const std::optional<at::Tensor>& branch_scale) {
  const char* op = genstats ? "fusedres_cuda.bn_relu_conv2d_genstats" : "fusedres_cuda.bn_relu_conv2d";
  const checks::Conv c =
      checks::check_unit_args(op, kDeviceType, x, weight, bias, bn_weight, bn_bias, mean, invstd,
                              residual, stride_, padding_, dilation_, branch_scale);
  [[maybe_unused]] const auto kernels = cutlass_conv::kernel_set(op);  // raises on a bad value
  const auto &stride = c.stride, &padding = c.padding, &dilation = c.dilation;
  const int64_t N = x.size(0), Co = weight.size(0), Ho = c.out[2], Wo = c.out[3];
  const DeviceGuard guard(x.device());
  // The branch scale in the accumulator dtype, one factor per sample.
  const at::Tensor bscale = branch_scale_acc(branch_scale, weight);
  at::Tensor y = at::empty({N, Co, Ho, Wo},
                           weight.options().memory_format(out_memory_format(x, weight)));
  const auto sdt = weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (y.numel() == 0 || x.size(1) == 0) {
    // Nothing to reduce: y is bias (+ residual); its statistics come from the portable rule.
    y.zero_();
    if (bias.has_value()) y.add_(bias->view({1, Co, 1, 1}));
    if (bscale.defined()) y.mul_(bscale.view({-1, 1, 1, 1}));
    if (residual.has_value()) y.add_(*residual);
    at::Tensor ys = y.to(sdt);
    return {y, ys.mean({0, 2, 3}), ys.var({0, 2, 3}, /*unbiased=*/false)};
  }
  // The CUTLASS forward (cutlass_conv/fprop.cu) for what it takes: no conv bias or branch scale
  // (its epilogue adds only the residual); y's statistics then come from batch_stats, one more
  // read of y. Its blocks compute the BatchNorm affine themselves (no bn_affine launch).
  const at::Tensor* r = residual.has_value() ? &*residual : nullptr;
#if defined(FUSEDRES_WITH_CUTLASS)
  if (kernels == cutlass_conv::KernelSet::cutlass && !bias.has_value() && !bscale.defined() &&
      cutlass_conv::can_run_fprop(x, weight, r, y, {stride, padding, dilation})) {
    cutlass_conv::fprop(x, weight, bn_weight, bn_bias, mean, invstd, r, y,
                        {stride, padding, dilation});
    if (!genstats) return {y, at::Tensor(), at::Tensor()};
    const auto [ymean, yvar] = batch_stats(y);
    return {y, ymean.to(sdt), yvar.to(sdt)};
  }
#endif
  const Affine bn = bn_affine(bn_weight, bn_bias, mean, invstd);
  const ConvGeom g{static_cast<int32_t>(weight.size(2)), static_cast<int32_t>(weight.size(3)),
                   static_cast<int32_t>(stride[0]),      static_cast<int32_t>(stride[1]),
                   static_cast<int32_t>(padding[0]),     static_cast<int32_t>(padding[1]),
                   static_cast<int32_t>(dilation[0]),    static_cast<int32_t>(dilation[1])};
  const int64_t M = N * Ho * Wo;
  const int64_t bm = forward_rows(x, weight, bn, M);
  const int64_t tiles = ceil_div(M, bm);
  at::Tensor part_mean, part_m2;
  if (genstats) {
    part_mean = at::empty({tiles, Co}, weight.options().dtype(sdt == at::kDouble ? at::kDouble
                                                                                 : at::kFloat));
    part_m2 = at::empty_like(part_mean);
  }
  // The kernel reads bias[co] with unit stride.
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const at::Tensor* b = bias.has_value() ? &bias_c : nullptr;
  dispatch_x_w(op, x.scalar_type(), weight.scalar_type(), [&](auto xt, auto wt) {
    using X = decltype(xt);
    using W = decltype(wt);
    launch_forward<X, W>(x, weight, b, bn, r, bscale.defined() ? &bscale : nullptr, y,
                         genstats ? &part_mean : nullptr, genstats ? &part_m2 : nullptr, g, M, bm);
  });
  if (!genstats) return {y, at::Tensor(), at::Tensor()};
  const auto [gmean, gvar] = genstats_merge(part_mean, part_m2, M, bm, sdt);
  return {y, gmean, gvar};
}

}  // namespace

at::Tensor bn_relu_conv2d(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& bn_weight,
                          const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean,
                          const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
                          c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
                          c10::SymIntArrayRef dilation, bool /*batch_stats*/,
                          const std::optional<at::Tensor>& branch_scale) {
  return std::get<0>(forward(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                             padding, dilation, false, branch_scale));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_relu_conv2d_genstats(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
    c10::SymIntArrayRef stride, c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
    bool /*batch_stats*/, const std::optional<at::Tensor>& branch_scale) {
  return forward(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
                 dilation, true, branch_scale);
}

}  // namespace fusedres::FUSEDRES_CUDA_NS

FUSEDRES_CUDA_LIBRARY_IMPL(m) {
  m.impl("bn_relu_conv2d", &fusedres::FUSEDRES_CUDA_NS::bn_relu_conv2d);
  m.impl("bn_relu_conv2d_genstats", &fusedres::FUSEDRES_CUDA_NS::bn_relu_conv2d_genstats);
}
