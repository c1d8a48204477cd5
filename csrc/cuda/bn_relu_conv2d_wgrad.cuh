// The weight gradient of the fused unit's backward (bn_relu_conv2d_backward.cu, the algorithm of
// kernels/bn_relu_conv2d_wgrad.py): dW = sum over pixels of dy * relu(scale * x + shift) shifted
// by the tap, dbias = sum dy, and with SUMS the BatchNorm sums (G1, G2 contracted with W) in the
// same pass. Kernels: wgrad_kernel (WMMA / FMA), wgrad_mma_kernel (mma.sync); the split of the
// reduction (pick_split) and the launcher (launch_wgrad). Included by bn_relu_conv2d_backward.cu
// only (one translation unit: the kernels keep its anonymous namespace, so their names and the
// tables keyed on that file, csrc/cuda/COMPILE.md and benchmarks/GPU_MODEL.md, are unchanged).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>

#include "conv_tiles.cuh"
#include "mma.cuh"
#include "mma_tiles.cuh"
#include "ops.h"

namespace fusedres::FUSEDRES_CUDA_NS {
namespace {

// Resident blocks per SM promised to ptxas by the WMMA / FMA weight gradient (see
// kDgradMinBlocks in bn_relu_conv2d_dgrad.cuh for why): with the thread count alone ptxas gave
// the float16 weight gradient 128 registers on sm_80 and a 4-byte spill. It takes up to 168
// without the BatchNorm sums (3 blocks of 128 threads) and up to 254 with them (1: no cap), where
// a 128 cap spilled 0.5 KiB. No spills now (csrc/cuda/COMPILE.md), for one resident block fewer
// (the float16 weight gradient 3, was 4).
template <typename T, bool SUMS>
constexpr int kWgradMinBlocks = SUMS ? 1 : (T::THREADS >= 256 ? 2 : 3);

// Per-channel BatchNorm quantities the SUMS variant of the weight gradient reads.
template <typename A>
struct BnSums {
  const A* mean;
  const A* invstd;
  const A* gamma;  // the BatchNorm weight (1 without one)
  const A* beta;   // the BatchNorm bias (0 without one)
  const void* weight;  // the conv weight (W), contracted with G1 and G2
  A* part_dz;      // (split * Co blocks * taps, C) partials of sum dz
  A* part_dzx;     // and of sum dz * xhat
};

// The weight gradient's epilogue, shared by the WMMA and the mma.sync kernel, on the block's
// BM x BN tile in shared memory: rows co0 + m; column n is the flat (tap, input channel) index
// f = f0 + n, tap f / Cin and channel f % Cin, while f < f_end (the WMMA kernel's columns are
// channels c0 + n of one tap t: f0 = t * Cin + c0, f_end = (t + 1) * Cin; the mma.sync
// kernel's run on across taps: f0 = blockIdx.y * BN, f_end = taps * Cin). Cs holds sum dy * a
// (plain) or G1 = sum dy * m (SUMS), and store_g2() overwrites it with G2 = sum dy * m * xhat
// (SUMS; called between barriers). Writes the split's partial (part_dw) or the weight gradient
// itself, and with SUMS the (co block, tap, split) rows of the sums' partials. The caller
// synchronises after filling Cs.
template <typename W, int BM, int BN, int LD, int THREADS, bool SUMS, typename StoreG2>
__device__ __forceinline__ void wgrad_store(acc_t<W> (*Cs)[LD], StoreG2&& store_g2,
                                            W* __restrict__ gw, acc_t<W>* __restrict__ part_dw,
                                            const BnSums<acc_t<W>>& bs, const Dims4& gwd,
                                            const Dims4& wd, const ConvGeom& g, int64_t co0,
                                            int64_t f0, int64_t f_end, int64_t Co,
                                            int64_t Cin, int tid) {
  using C = acc_t<W>;
  const int taps = g.kh * g.kw;
  // Column n's tap t and channel c; false past f_end.
  const auto column = [&](int n, int& t, int64_t& c) {
    const int64_t f = f0 + n;
    t = static_cast<int>(f / Cin);
    c = f - t * Cin;
    return f < f_end;
  };
  // Consecutive threads along C: the contiguous dimension of a channels_last weight, and the
  // partials' row.
  constexpr int kPerThread = (BM * BN + THREADS - 1) / THREADS;
  C dw_part[SUMS ? kPerThread : 1];
  if constexpr (SUMS) {
    // dW = gamma * G2 + beta * G1; sum dz = sum over (co, tap) of W * G1, sum dz xhat of W * G2.
    // G1 first: its beta * G1 share kept in registers, its contraction with W per column.
    const W* wt = static_cast<const W*>(bs.weight);
    const int64_t row0 = (static_cast<int64_t>(blockIdx.z) * gridDim.x + blockIdx.x) * taps;
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int e = tid + r * THREADS;
      const int n = e % BN, m = e / BN;
      int t;
      int64_t c;
      dw_part[r] = (e < BM * BN && column(n, t, c)) ? bs.beta[c] * Cs[m][n] : C(0);
    }
    // Column n's contraction with W over the block's output channels, into `part`'s row of
    // its tap.
    const auto contract = [&](C* part) {
      for (int n = tid; n < BN; n += THREADS) {
        int t;
        int64_t c;
        if (!column(n, t, c)) continue;
        const int i = t / g.kw, j = t % g.kw;
        C s = C(0);
        for (int m = 0; m < BM && co0 + m < Co; ++m) {
          s += static_cast<C>(wt[wd.offset(co0 + m, c, i, j)]) * Cs[m][n];
        }
        part[(row0 + t) * Cin + c] = s;
      }
    };
    contract(bs.part_dz);
    __syncthreads();
    store_g2();
    __syncthreads();
    contract(bs.part_dzx);
  }
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int e = tid + r * THREADS;
    const int n = e % BN, m = e / BN;
    const int64_t co = co0 + m;
    int t;
    int64_t c;
    if (e >= BM * BN || co >= Co || !column(n, t, c)) continue;
    C v = Cs[m][n];
    if constexpr (SUMS) v = bs.gamma[c] * v + dw_part[r];
    if (part_dw != nullptr) {
      part_dw[((blockIdx.z * Co + co) * taps + t) * Cin + c] = v;
    } else {
      gw[gwd.offset(co, c, t / g.kw, t % g.kw)] = static_cast<W>(v);
    }
  }
}

template <typename X, typename W, typename T, bool SUMS>
__global__ void __launch_bounds__(T::THREADS, kWgradMinBlocks<T, SUMS>)
    wgrad_kernel(const W* __restrict__ dy, const X* __restrict__ x,
                 const acc_t<X>* __restrict__ scale, const acc_t<X>* __restrict__ shift,
                 W* __restrict__ gw, acc_t<W>* __restrict__ part_dw,
                 acc_t<W>* __restrict__ part_db, BnSums<acc_t<X>> bs,
                 const acc_t<W>* __restrict__ branch_scale, Dims4 dyd, Dims4 xd, Dims4 gwd,
                 Dims4 wd, ConvGeom g, int64_t k_steps_per_split) {
  FUSEDRES_LAUNCH_BOUNDS(T::THREADS, kWgradMinBlocks<T, SUMS>);
  using A = acc_t<X>;
  using C = acc_t<W>;
  static_assert(std::is_same_v<A, C>, "x and weight must share an accumulator type");
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, THREADS = T::THREADS;
  __shared__ __align__(32) W As[BK][BM + T::APAD];  // dy: (pixels) x (Co slice)
  // a (plain), or the ReLU mask m (SUMS): (pixels) x (C slice)
  __shared__ __align__(32) W Bs[BK][BN + T::BPAD];
  __shared__ __align__(32) W B2s[SUMS ? BK : 1][BN + T::BPAD];  // SUMS: m * xhat
  __shared__ __align__(32) C Cs[BM][BN + T::CPAD];
  __shared__ int64_t pix_dy[BK];  // offset of dy[n, 0, oh, ow], -1 past the pixels
  __shared__ int64_t pix_x[BK];   // offset of x[n, 0, ih, iw] at this tap, -1 outside the image
  __shared__ C pix_s[BK];         // the pixel's branch scale (with one)

  const int tid = threadIdx.x;
  const int taps = g.kh * g.kw;
  const int t = blockIdx.y % taps;
  const int i = t / g.kw, j = t % g.kw;
  const int64_t co0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y / taps) * BN;
  const int64_t Co = dyd.c, Cin = xd.c;
  const int64_t M = dyd.n * dyd.h * dyd.w;
  const bool bias_block = part_db != nullptr && blockIdx.y == 0;
  C db = C(0);
  Accum<W, T> acc;   // plain: sum dy * a; SUMS: G1 = sum dy * m
  Accum<W, T> acc2;  // SUMS: G2 = sum dy * m * xhat
  acc.zero();
  if constexpr (SUMS) acc2.zero();
  const bool dy_channels_fast = dyd.sc == 1, x_channels_fast = xd.sc == 1;
  const int64_t k_begin = static_cast<int64_t>(blockIdx.z) * k_steps_per_split * BK;
  const int64_t k_end = k_begin + k_steps_per_split * BK < M ? k_begin + k_steps_per_split * BK : M;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += BK) {
    for (int k = tid; k < BK; k += THREADS) {
      int64_t ody = -1, ox = -1;
      C sn = C(0);
      if (k0 + k < k_end) {
        const Pixel p = pixel_of(k0 + k, dyd.h, dyd.w);
        ody = dyd.offset(p.n, 0, p.h, p.w);
        if (branch_scale != nullptr) sn = branch_scale[p.n];
        const int64_t ih = int64_t(p.h) * g.sh - g.ph + int64_t(i) * g.dh;
        const int64_t iw = int64_t(p.w) * g.sw - g.pw + int64_t(j) * g.dw;
        if (ih >= 0 && ih < xd.h && iw >= 0 && iw < xd.w) ox = xd.offset(p.n, 0, ih, iw);
      }
      pix_dy[k] = ody;
      pix_x[k] = ox;
      pix_s[k] = sn;
    }
    __syncthreads();
    for (int e = tid; e < BM * BK; e += THREADS) {
      const int m = dy_channels_fast ? e % BM : e / BK;
      const int k = dy_channels_fast ? e / BM : e % BK;
      const int64_t co = co0 + m;
      W v = (pix_dy[k] >= 0 && co < Co) ? dy[pix_dy[k] + co * dyd.sc] : static_cast<W>(0.0f);
      // The conv branch's gradient s[n] * dy, rounded to W as the unfused product would be.
      if (branch_scale != nullptr) v = static_cast<W>(static_cast<C>(v) * pix_s[k]);
      As[k][m] = v;
    }
    for (int e = tid; e < BN * BK; e += THREADS) {
      const int n = x_channels_fast ? e % BN : e / BK;
      const int k = x_channels_fast ? e / BN : e % BK;
      const int64_t c = c0 + n;
      if constexpr (SUMS) {
        A on = A(0), xhat = A(0);
        if (pix_x[k] >= 0 && c < Cin) {
          const A xv = static_cast<A>(x[pix_x[k] + c * xd.sc]);
          // The gradient passes unless z <= 0 (NaN passes, as torch's ReLU backward).
          on = xv * scale[c] + shift[c] <= A(0) ? A(0) : A(1);
          xhat = on * ((xv - bs.mean[c]) * bs.invstd[c]);
        }
        Bs[k][n] = static_cast<W>(on);
        B2s[k][n] = static_cast<W>(xhat);
      } else {
        A a = A(0);
        if (pix_x[k] >= 0 && c < Cin) a = bn_relu(static_cast<A>(x[pix_x[k] + c * xd.sc]), scale[c], shift[c]);
        Bs[k][n] = static_cast<W>(a);
      }
    }
    __syncthreads();
    if (bias_block) {
      for (int m = tid; m < BM; m += THREADS)
        for (int k = 0; k < BK; ++k) db += static_cast<C>(As[k][m]);
    }
    acc.mma(As, Bs, tid);
    if constexpr (SUMS) acc2.mma(As, B2s, tid);
    __syncthreads();
  }
  if (bias_block) {
    for (int m = tid; m < BM; m += THREADS) {
      if (co0 + m < Co) part_db[blockIdx.z * Co + co0 + m] = db;
    }
  }
  acc.store(Cs, tid);
  __syncthreads();
  wgrad_store<W, BM, BN, BN + T::CPAD, THREADS, SUMS>(
      Cs, [&] { acc2.store(Cs, tid); }, gw, part_dw, bs, gwd, wd, g, co0, t * Cin + c0,
      (t + 1) * Cin, Co, Cin, tid);
}

// ----------------------------------------------------------------------------- tensor-core path

// The weight gradient (and with SUMS the BatchNorm sums' G1, G2) of 16-bit x, grad_out and
// weight of one dtype, x and grad_out channels-last with C and Co multiples of 8: mma.sync
// m16n8k16 on operands that cp.async stages, 16 bytes a copy, through a STAGES-deep pipeline
// with one barrier per K chunk of BK = 16 output pixels. The tile is the WMMA kernel's size,
// BM = 64 output channels x BN = 64 columns, split-K over blockIdx.z in its K-steps of
// KSTEP = 32 pixels, so the partials and the host code around them are shared; but its columns
// are the flat (tap, input channel) indices blockIdx.y * BN + n of kh * kw * C, channels
// fastest, so that with C = 16 a block covers 4 taps (3 column blocks for a 3 x 3 conv where
// one a tap gave 9, each 3/4 zero columns), with C = 32 two. A 16-byte x piece (8 channels,
// C % 8 == 0) is one tap's: each thread's tap is fixed for the loop. Per chunk a thread copies
// one pixel row piece of dy (BK x BM, rows = pixels, 16 bytes = 8 output channels) and of x at
// its tap (BK x BN); the pixel indices are carried
// from chunk to chunk (no 64-bit division in the loop). (BK = 16: one m16n8k16 step a chunk
// keeps one set of fragments live; with BK = 32 the SUMS variant spilled on sm_80.) A pixel
// past the split's end zero-fills both rows; a tap outside the image zero-fills the x piece and
// clears its flag (Vs: a flag per 16-byte piece of a pixel row, whose pieces can be different
// taps'): the activation there is 0 (padding of
// a = relu(bn(x)), never of x), which the B fragments get by a select after the BatchNorm-ReLU,
// applied in float32 and rounded to W as the unfused sequence does. The 4 warps split the
// columns (warp tile 64 x 16: every x element is transformed by one warp only): per chunk
// a warp loads its A fragments (dy, m = Co, k = pixels) with 4 ldmatrix.x4.trans and its
// B fragments (x, k = pixels, n = C) with one, and issues 8 mma.sync (SUMS: 16, the mask m and
// m * xhat as two B operands). With a branch scale each thread scales the dy piece it copied,
// in shared memory between its cp.async wait and the chunk's barrier (s[n] * dy rounded to W,
// as the WMMA kernel stages them; Ps holds the pixel's factor): once per element, not once per
// warp, and outside the m16n8k16 steps. The bias gradient (the first column block): each
// thread sums the (scaled) dy pieces it copied in float32 there too, reduced after the loop.
// The pixel stepping divides by Ho and Wo by multiply-high (FastDiv).
// Shared rows are padded by 8 halves (144 bytes): the 8 rows of an ldmatrix phase fall in 8
// different 4-bank groups. Both accumulator sets go through shared memory (aliasing the drained
// pipeline) to the epilogue of both kernels (wgrad_store).
struct MmaWgrad {
  static constexpr int BM = 64, BN = 64, BK = 16, STAGES = 4, THREADS = 128;
  static constexpr int KSTEP = 32;  // the host's K-step (pixels), the unit of the split
  static constexpr int WN = 16;                        // warp tile 64 x 16, warps along N
  static constexpr int FM = BM / 16, FN = WN / 8;      // m16 tiles, n8 tiles per warp
  static constexpr int DST = BM + 8, XST = BN + 8;     // shared row lengths (halves)
  static constexpr int CLD = BN + 4;                   // the epilogue's rows (floats)
  static constexpr int ROWS_PER_PASS = THREADS / (BM / 8);  // pixel rows per copy pass
  static constexpr int PASSES = BK / ROWS_PER_PASS;         // copy passes (rows) per thread
  static constexpr int D_BYTES = STAGES * BK * DST * 2;
  static constexpr int X_BYTES = STAGES * BK * XST * 2;
  static constexpr int P_BYTES = STAGES * BK * 4;      // the pixels' branch scale
  static constexpr int PIECES = BN / 8;                // 16-byte x pieces a pixel row
  static constexpr int V_BYTES = STAGES * BK * PIECES; // the pieces' tap-inside flags
  static constexpr int PIPE_BYTES = D_BYTES + X_BYTES + P_BYTES + V_BYTES;
  static constexpr int C_BYTES = 2 * BM * CLD * 4;  // G1 (or sum dy * a) and G2
  static constexpr int SMEM = PIPE_BYTES > C_BYTES ? PIPE_BYTES : C_BYTES;
  static_assert(BM == BN, "one copy pattern for both operands: 8 threads per pixel row");
  static_assert(PASSES * ROWS_PER_PASS == BK && (BN / WN) * 32 == THREADS, "warp grid");
  static_assert(KSTEP % BK == 0 && BK % 16 == 0, "whole m16n8k16 steps, whole chunks a split");
  static_assert(D_BYTES % 128 == 0 && X_BYTES % 128 == 0, "stage buffers 128-byte aligned");
};

// Two 16-bit elements of one register (two pixels of one channel in a B fragment) through
// relu(scale * x + shift), rounded to W; an element whose tap flag is clear becomes 0.
template <typename W>
__device__ __forceinline__ uint32_t act2(uint32_t v, float s, float b, bool on0, bool on1) {
  uint16_t lo = static_cast<uint16_t>(v & 0xffffu), hi = static_cast<uint16_t>(v >> 16);
  W x0, x1;
  memcpy(&x0, &lo, 2);
  memcpy(&x1, &hi, 2);
  const W zero = static_cast<W>(0.0f);
  const W a0 = on0 ? static_cast<W>(bn_relu(static_cast<float>(x0), s, b)) : zero;
  const W a1 = on1 ? static_cast<W>(bn_relu(static_cast<float>(x1), s, b)) : zero;
  return ptx::pack2(a0, a1);
}

// SUMS: the ReLU mask m (1 where the gradient passes: z > 0 or NaN, as torch's ReLU backward)
// and m * xhat, xhat = (x - mean) * invstd rounded to W, for two pixels of one channel.
template <typename W>
__device__ __forceinline__ void mask2(uint32_t v, float s, float b, float mu, float is, bool on0,
                                      bool on1, uint32_t& m, uint32_t& mx) {
  uint16_t lo = static_cast<uint16_t>(v & 0xffffu), hi = static_cast<uint16_t>(v >> 16);
  W x0, x1;
  memcpy(&x0, &lo, 2);
  memcpy(&x1, &hi, 2);
  const float f0 = static_cast<float>(x0), f1 = static_cast<float>(x1);
  const bool p0 = on0 && !(f0 * s + b <= 0.0f), p1 = on1 && !(f1 * s + b <= 0.0f);
  const W zero = static_cast<W>(0.0f), one = static_cast<W>(1.0f);
  m = ptx::pack2(p0 ? one : zero, p1 ? one : zero);
  mx = ptx::pack2(p0 ? static_cast<W>((f0 - mu) * is) : zero,
                  p1 ? static_cast<W>((f1 - mu) * is) : zero);
}

// 16 bytes of shared memory (a thread's dy piece of a stage), for memcpy's alignment.
struct alignas(16) Piece16 {
  uint32_t u[4];
};

// The block's columns' channel parameters (scale, shift; with SUMS mean, invstd), 0 past the
// last tap: read from shared memory at each use rather than held in registers across the loop.
// Column n is channel (f0 + n) % Cin. The caller synchronises before reading them.
template <bool SUMS>
__device__ __forceinline__ void wgrad_mma_channels(float (*Cp)[MmaWgrad::BN], int64_t f0,
                                                   int64_t f_end, int64_t Cin,
                                                   const float* __restrict__ scale,
                                                   const float* __restrict__ shift,
                                                   const BnSums<float>& bs, int tid) {
  for (int n = tid; n < MmaWgrad::BN; n += MmaWgrad::THREADS) {
    const bool ok = f0 + n < f_end;
    const int64_t c = (f0 + n) % Cin;
    Cp[0][n] = ok ? scale[c] : 0.0f;
    Cp[1][n] = ok ? shift[c] : 0.0f;
    if constexpr (SUMS) {
      Cp[2][n] = ok ? bs.mean[c] : 0.0f;
      Cp[3][n] = ok ? bs.invstd[c] : 0.0f;
    }
  }
}

// This thread's dy pieces of a landed stage (16 bytes: 8 output channels of one pixel row, at
// column col): multiplied by the pixel's branch scale (ps, rounded to W: s[n] * dy as the
// unfused sequence rounds it) in place when `scaled`, once for every warp that reads them, and
// added to its bias sums db (s[n] * dy summed over the pixels, float32). Before the barrier that
// publishes the stage.
template <typename W>
__device__ __forceinline__ void wgrad_mma_scale_dy(uint16_t (*ds)[MmaWgrad::DST],
                                                   const float* ps, float (&db)[8], bool scaled,
                                                   int tid, int col) {
  using T = MmaWgrad;
#pragma unroll
  for (int q = 0; q < T::PASSES; ++q) {
    const int r = tid / (T::BM / 8) + T::ROWS_PER_PASS * q;
    // 16-byte aligned (a cp.async destination): one 128-bit access each way.
    Piece16* piece = reinterpret_cast<Piece16*>(&ds[r][col]);
    W v[8];
    memcpy(v, piece, 16);
    const float sp = scaled ? ps[r] : 1.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (scaled) v[e] = static_cast<W>(static_cast<float>(v[e]) * sp);
      db[e] += static_cast<float>(v[e]);
    }
    if (scaled) memcpy(piece, v, 16);
  }
}

// One 16-deep K step of a warp on a landed stage (ds: dy, xs: x, vs: the pieces' tap flags) at
// pixel offset kk: A fragments (dy, m = Co, k = pixels) by 4 ldmatrix.x4.trans, B fragments
// (x, k = pixels, n = C: the warp's columns wn ...) by one, through the BatchNorm-ReLU (plain:
// act2) or into the mask m and m * xhat (SUMS: mask2) with the channel parameters Cp, then
// acc += dy * a (plain) or acc += dy * m, acc2 += dy * m * xhat (SUMS). The lane's rows and
// columns in the x4 loads: lr, lc (B, x), ar, ac (A, dy); t2 = 2 (lane % 4).
template <typename W, bool SUMS>
__device__ __forceinline__ void wgrad_mma_step(
    float (&acc)[MmaWgrad::FM][MmaWgrad::FN][4],
    float (&acc2)[SUMS ? MmaWgrad::FM : 1][SUMS ? MmaWgrad::FN : 1][4],
    const uint16_t (*ds)[MmaWgrad::DST], const uint16_t (*xs)[MmaWgrad::XST],
    const uint8_t (*vs)[MmaWgrad::PIECES], const float (*Cp)[MmaWgrad::BN], int kk, int wn,
    int lane, int lr, int lc, int ar, int ac, int t2) {
  using T = MmaWgrad;
  using E = native_t<W>;
  // a[i][r]: output channels 16 i + lane / 4 + 8 (r % 2), pixels kk + 8 (r / 2) + t2, + 1;
  // fb[r]: pixels kk + 8 (r % 2) + t2, + 1, channel wn + 8 (r / 2) + lane / 4.
  uint32_t fa[T::FM][4], fb[4];
#pragma unroll
  for (int i = 0; i < T::FM; ++i) {
    ptx::ldmatrix<4, true>(fa[i], &ds[kk + ar][16 * i + ac]);
  }
  ptx::ldmatrix<4, true>(fb, &xs[kk + lr][wn + lc]);
  // The tap-inside flags of the lane's pixels in its two pieces (columns wn + 8 jj ...).
  bool on[2][2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      on[h][jj][0] = vs[kk + 8 * h + t2][wn / 8 + jj] != 0;
      on[h][jj][1] = vs[kk + 8 * h + t2 + 1][wn / 8 + jj] != 0;
    }
  uint32_t b1[4], b2[SUMS ? 4 : 1];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int n = wn + 8 * (r / 2) + lane / 4, h = r % 2;
    const bool on0 = on[h][r / 2][0], on1 = on[h][r / 2][1];
    if constexpr (SUMS) {
      mask2<W>(fb[r], Cp[0][n], Cp[1][n], Cp[2][n], Cp[3][n], on0, on1, b1[r], b2[r]);
    } else {
      b1[r] = act2<W>(fb[r], Cp[0][n], Cp[1][n], on0, on1);
    }
  }
#pragma unroll
  for (int i = 0; i < T::FM; ++i)
#pragma unroll
    for (int j = 0; j < T::FN; ++j) {
      const uint32_t b[2] = {b1[2 * j], b1[2 * j + 1]};
      float d[4];
      ptx::mma_m16n8k16<E>(d, fa[i], b, acc[i][j]);
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = d[r];
      if constexpr (SUMS) {
        const uint32_t bx[2] = {b2[2 * j], b2[2 * j + 1]};
        ptx::mma_m16n8k16<E>(d, fa[i], bx, acc2[i][j]);
#pragma unroll
        for (int r = 0; r < 4; ++r) acc2[i][j][r] = d[r];
      }
    }
}

// The bias gradient's partials of the block's output channels co0 + m (split blockIdx.z): lanes
// l, l + 8, l + 16, l + 24 of a warp hold the same channels' sums db over different pixels;
// then the four warps' through shared memory (Bsum, apart from the aliased stages). Every thread
// of the block calls it (shuffles and a barrier).
__device__ __forceinline__ void wgrad_mma_bias(float (*Bsum)[MmaWgrad::BM], const float (&db)[8],
                                               float* __restrict__ part_db, int64_t co0,
                                               int64_t Co, int col, int tid) {
  using T = MmaWgrad;
  const int lane = tid % 32, warp = tid / 32;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float v = db[e];
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    if (lane < 8) Bsum[warp][col + e] = v;
  }
  __syncthreads();
  for (int m = tid; m < T::BM; m += T::THREADS) {
    float v = 0.0f;
    for (int w = 0; w < T::THREADS / 32; ++w) v += Bsum[w][m];
    if (co0 + m < Co) part_db[blockIdx.z * Co + co0 + m] = v;
  }
}

// 4 resident blocks promised to ptxas without SUMS (up to 128 registers: without it ptxas gave
// the float16 kernel 96 and an 8-byte spill on sm_90), 2 with SUMS (up to 255: 229 on sm_80).
template <typename W, bool SUMS>
__global__ void __launch_bounds__(MmaWgrad::THREADS, SUMS ? 2 : 4)
    wgrad_mma_kernel(const W* __restrict__ dy, const W* __restrict__ x,
                     const float* __restrict__ scale, const float* __restrict__ shift,
                     W* __restrict__ gw, float* __restrict__ part_dw,
                     float* __restrict__ part_db, BnSums<float> bs,
                     const float* __restrict__ branch_scale, Dims4 dyd, Dims4 xd, Dims4 gwd,
                     Dims4 wd, ConvGeom g, int64_t k_steps_per_split) {
  FUSEDRES_LAUNCH_BOUNDS(MmaWgrad::THREADS, SUMS ? 2 : 4);
  using T = MmaWgrad;
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, STAGES = T::STAGES, THREADS = T::THREADS;
  __shared__ __align__(128) unsigned char smem[T::SMEM];
  auto* Ds = reinterpret_cast<uint16_t(*)[BK][T::DST]>(smem);
  auto* Xs = reinterpret_cast<uint16_t(*)[BK][T::XST]>(smem + T::D_BYTES);
  auto* Ps = reinterpret_cast<float(*)[BK]>(smem + T::D_BYTES + T::X_BYTES);
  auto* Vs = reinterpret_cast<uint8_t(*)[BK][T::PIECES]>(smem + T::D_BYTES + T::X_BYTES +
                                                         T::P_BYTES);
  auto* Cs = reinterpret_cast<float(*)[T::CLD]>(smem);
  auto* C2s = reinterpret_cast<float(*)[T::CLD]>(smem + BM * T::CLD * 4);  // SUMS: G2
  // The block's channels' scale, shift (and with SUMS mean, invstd): read from shared memory at
  // each use rather than held in registers across the loop.
  __shared__ float Cp[SUMS ? 4 : 2][BN];
  __shared__ float Bsum[T::THREADS / 32][BM];  // the bias sums' per-warp partials

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int taps = g.kh * g.kw;
  const int64_t co0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t Co = dyd.c, Cin = xd.c;
  // The block's columns: the flat (tap, input channel) indices f0 + n of taps * Cin, channels
  // fastest; a tile runs on across taps where C is not a multiple of BN.
  const int64_t f0 = static_cast<int64_t>(blockIdx.y) * BN, f_end = taps * Cin;
  const int64_t M = dyd.n * dyd.h * dyd.w;
  const int64_t k_begin = static_cast<int64_t>(blockIdx.z) * k_steps_per_split * T::KSTEP;
  const int64_t k_end = k_begin + k_steps_per_split * T::KSTEP < M
                            ? k_begin + k_steps_per_split * T::KSTEP
                            : M;
  const int chunks = static_cast<int>((k_end - k_begin + BK - 1) / BK);
  const bool bias_block = part_db != nullptr && blockIdx.y == 0;

  // The copies: thread tid moves the 16 bytes at column (tid % 8) * 8 of pixel rows
  // tid / 8 + ROWS_PER_PASS * q, for dy and for x; the pixel (n, oh, ow) of each is carried.
  // Its x piece (8 channels: C % 8 == 0, so one tap's) is channels xc ... of tap (ti, tj).
  const int col = (tid % (BM / 8)) * 8;
  const bool x_col = f0 + col < f_end;
  const int xt = static_cast<int>((f0 + col) / Cin);
  const int64_t xc = f0 + col - xt * Cin;
  const int ti = xt / g.kw, tj = xt % g.kw;
  int64_t pix[T::PASSES];  // the row's pixel index
  int64_t pn[T::PASSES];
  int32_t poh[T::PASSES], pow_[T::PASSES];
#pragma unroll
  for (int q = 0; q < T::PASSES; ++q) {
    pix[q] = k_begin + tid / (BM / 8) + T::ROWS_PER_PASS * q;
    const Pixel p = pixel_of(pix[q] < M ? pix[q] : 0, dyd.h, dyd.w);
    pn[q] = p.n;
    poh[q] = p.h;
    pow_[q] = p.w;
  }
  const int32_t Ho = static_cast<int32_t>(dyd.h), Wo = static_cast<int32_t>(dyd.w);
  const FastDiv div_ho(Ho), div_wo(Wo);
  // Issue the copies of the next chunk into stage st (the caller commits), then step the
  // pixels by BK.
  const auto load = [&](int st) {
#pragma unroll
    for (int q = 0; q < T::PASSES; ++q) {
      const int r = tid / (BM / 8) + T::ROWS_PER_PASS * q;
      const bool live = pix[q] < k_end;
      const int64_t ih = int64_t(poh[q]) * g.sh - g.ph + int64_t(ti) * g.dh;
      const int64_t iw = int64_t(pow_[q]) * g.sw - g.pw + int64_t(tj) * g.dw;
      const bool inside = live && ih >= 0 && ih < xd.h && iw >= 0 && iw < xd.w;
      const bool dy_ok = live && co0 + col < Co;
      ptx::cp_async_cg16(&Ds[st][r][col],
                         dy_ok ? dy + dyd.offset(pn[q], co0 + col, poh[q], pow_[q]) : dy,
                         dy_ok ? 16 : 0);
      const bool x_ok = inside && x_col;
      ptx::cp_async_cg16(&Xs[st][r][col], x_ok ? x + xd.offset(pn[q], xc, ih, iw) : x,
                         x_ok ? 16 : 0);
      Vs[st][r][col / 8] = inside ? 1 : 0;
      if (col == 0) Ps[st][r] = live && branch_scale != nullptr ? branch_scale[pn[q]] : 0.0f;
      // Next chunk: the pixel BK further on (divisions by multiply-high, FastDiv).
      pix[q] += BK;
      int32_t w = pow_[q] + BK;
      if (w >= Wo) {
        const int32_t dh = div_wo.div(w);
        int32_t h = poh[q] + dh;
        w -= dh * Wo;
        if (h >= Ho) {
          const int32_t dn = div_ho.div(h);
          pn[q] += dn;
          h -= dn * Ho;
        }
        poh[q] = h;
      }
      pow_[q] = w;
    }
  };

  // The columns' channel parameters; the main loop's first barrier publishes them.
  wgrad_mma_channels<SUMS>(Cp, f0, f_end, Cin, scale, shift, bs, tid);
  // This lane's B-fragment columns: wn + 8 jj + lane / 4 (jj = 0, 1) of the block's.
  const int wn = warp * T::WN;

  float acc[T::FM][T::FN][4];
  float acc2[SUMS ? T::FM : 1][SUMS ? T::FN : 1][4];
  zero_acc(acc);
  if constexpr (SUMS) zero_acc(acc2);
  float db[8] = {};  // bias sums of output channels co0 + col + e over this thread's pixels
  const bool scaled = branch_scale != nullptr;

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < chunks) load(st);
    ptx::cp_async_commit();
  }
  const int lr = (lane % 8) + 8 * ((lane / 8) % 2), lc = 8 * (lane / 16);  // B (x) rows
  const int ar = (lane % 8) + 8 * (lane / 16), ac = 8 * ((lane / 8) % 2);  // A (dy) rows
  const int t2 = 2 * (lane % 4);
  // The prologue's pixel factors (Ps) are read by other threads before the loop's first barrier.
  __syncthreads();
  for (int kc = 0; kc < chunks; ++kc) {
    const int st = kc % STAGES;
    // This thread's copies of chunk kc have landed: its dy pieces scaled and summed for the bias
    // before the barrier publishes them (Ps[st]: written STAGES - 1 chunks ago, a barrier since).
    ptx::cp_async_wait<STAGES - 2>();
    if (scaled || bias_block) wgrad_mma_scale_dy<W>(Ds[st], Ps[st], db, scaled, tid, col);
    // Chunk kc is in place for every warp, and every warp is done with chunk kc - 1, whose stage
    // the copies of chunk kc + STAGES - 1 now overwrite.
    __syncthreads();
    if (kc + STAGES - 1 < chunks) load((kc + STAGES - 1) % STAGES);
    ptx::cp_async_commit();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wgrad_mma_step<W, SUMS>(acc, acc2, Ds[st], Xs[st], Vs[st], Cp, kk, wn, lane, lr, lc, ar,
                              ac, t2);
    }
  }
  // Drain the (empty) trailing groups; every warp is done with the stages before Cs reuses them.
  ptx::cp_async_wait<0>();
  __syncthreads();
  if (bias_block) wgrad_mma_bias(Bsum, db, part_db, co0, Co, col, tid);
  // Both accumulator sets go to shared memory at once (no registers held through the epilogue).
  store_acc(Cs, acc, 0, wn, lane);
  if constexpr (SUMS) store_acc(C2s, acc2, 0, wn, lane);
  __syncthreads();
  wgrad_store<W, BM, BN, T::CLD, THREADS, SUMS>(
      Cs,
      [&] {
        for (int e = tid; e < BM * BN; e += THREADS) Cs[e / BN][e % BN] = C2s[e / BN][e % BN];
      },
      gw, part_dw, bs, gwd, wd, g, co0, f0, f_end, Co, Cin, tid);
}

// ----------------------------------------------------------------------------- host

// Split of the weight gradient's reduction over the pixels: the count with the least estimated
// time, in K-steps of one block (integers, so that kernels/traffic.cuda_pick_split, the
// performance model's copy, computes the same split):
//   waves of kResident blocks an SM (ceil(blocks / (sms * kResident))), each as long as
//   kResident blocks' K-steps (the SM's issue is shared by its resident blocks), a block's
//   K-steps being its share of the split plus 2 (prologue and epilogue);
//   split, + the partials: a Co * C * kh * kw tile of `acc_bytes` a split, written and read,
//   at a K-step per MiB (a K-step of a 64 x 64 block is ~0.4 us on an A100 or H100, the time
//   the GPU moves ~1 MiB), and the reduction's launch (8 K-steps).
// Splits up to 8 an SM are tried; ties go to the smaller. The partials' bytes (written and
// read) are capped at half the operands' (`operand_bytes`, the dy and x the pass reads), the
// Triton rule's cap (kernels/bn_relu_conv2d_wgrad.pick_split), which keeps a step's DRAM bytes
// under half the plain sequence's (tests/test_traffic_model.py); it costs time where the grid
// is small.
// The rule it replaces (two waves for one resident block an SM, >= 4 K-steps a split,
// partials <= 1/8 of the operands) left a nearly empty last wave (ImageNet 64@56 on an H100:
// 270 blocks for 264 slots) or a grid just past the SMs (ImageNet 256@14: 144 blocks, unsplit,
// on 132: 12 SMs with two, the rest idle half the pass).
// `tiles`: the blocks of one split (the WMMA kernel's cdiv(Co, 64) * cdiv(C, 64) * taps, the
// mma.sync kernel's cdiv(Co, 64) * cdiv(taps * C, 64)).
constexpr int64_t kResident = 2;
int64_t pick_split(int64_t tiles, int64_t co, int64_t c, int64_t taps, int64_t m, int64_t bk,
                   int64_t sms, int64_t operand_bytes, int64_t acc_bytes) {
  const int64_t k_steps = ceil_div(m, bk);
  const int64_t limit = std::min<int64_t>(k_steps, 65535);  // grid.z limit
  int64_t split = 1;
  constexpr int64_t kMiB = int64_t(1) << 20;
  const int64_t partial = 2 * co * c * taps * acc_bytes;  // bytes a split, written and read
  const int64_t cap = std::max<int64_t>(1, operand_bytes / (2 * partial));
  int64_t best = -1;
#if defined(__CUDACC__)
  constexpr bool forced = false;
#else
  const bool forced = host_wgrad_split() > 0;
  if (forced) split = host_wgrad_split();
#endif
  for (int64_t s = 1; !forced && s <= std::min({limit, 8 * sms, cap}); ++s) {
    const int64_t steps = ceil_div(k_steps, s);
    if (ceil_div(k_steps, steps) != s) continue;  // the same blocks as a smaller split
    const int64_t waves = ceil_div(tiles * s, sms * kResident);
    int64_t cost = waves * kResident * (steps + 2) * kMiB;
    if (s > 1) cost += s * partial + 8 * kMiB;
    if (best < 0 || cost < best) {
      best = cost;
      split = s;
    }
  }
  split = std::clamp<int64_t>(split, 1, limit);
  return ceil_div(k_steps, ceil_div(k_steps, split));  // no empty split
}

// The BatchNorm backward sums from the weight-gradient pass (its SUMS variant).
struct SumsArgs {
  at::Tensor gamma, beta, mean, invstd, weight;  // (C,) in the statistics dtype; the conv weight
  at::Tensor part_dz, part_dzx;  // out: the sums' partials, (rows, C) (bn_sums reduces them)
};

// The operands both mma.sync backward kernels take: x and grad_out of the weight's 16-bit
// dtype, both with channels contiguous, C and Co multiples of 8 and every pixel at a multiple
// of 8 elements (16-byte cp.async sources), their data 16-byte aligned.
bool wgrad_mma_operands(const at::Tensor& go, const at::Tensor& x, at::ScalarType wt) {
  if (!(wt == at::kHalf || wt == at::kBFloat16) || x.scalar_type() != wt ||
      go.scalar_type() != wt) {
    return false;
  }
  const auto fits = [](const at::Tensor& t) {
    return t.stride(1) == 1 && t.size(1) % 8 == 0 && t.stride(0) % 8 == 0 &&
           t.stride(2) % 8 == 0 && t.stride(3) % 8 == 0 &&
           reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  };
  return fits(x) && fits(go);
}

// The mma.sync weight gradient (wgrad_mma_kernel) for those operands; every other input takes
// the WMMA kernel.
bool wgrad_uses_mma(const at::Tensor& go, const at::Tensor& x, at::ScalarType wt) {
  return wgrad_mma_operands(go, x, wt);
}

// The weight gradient from its partials, (split, Co, kh, kw, C) in the accumulator dtype P (the
// native kernels' split reduction and the CUTLASS weight gradient's slices alike), rounded once
// to the weight's dtype W and written at gw's strides ((Co, C, kh, kw) whatever its memory
// format). A block of kThreads takes kCols consecutive dW elements at a time (a lane each) and
// splits the slices over its kGroups warps: warp g adds slices g, g + kGroups, ... in slice
// order, then the warps' sums are added in warp order. The order depends on the split alone
// (the same bits whatever the launch) and each thread makes cdiv(split, kGroups) loads, a warp's
// 32 consecutive elements each: with a thread per element looping over every slice, a small dW
// (CIFAR's 16-channel 3 x 3: 2,304 elements, 9 blocks) made `split` loads a thread one after
// another, 256 at plan.h's cap. One launch where ATen's were two (the sum over the slices, then the
// permuted copy); on the CUTLASS route, blocks of the dx launch where the backward has a dx
// pass (dx_kernel, bn_relu_conv2d_dgrad.cuh), else this launch. Writes follow gw's strides
// (scattered for an NCHW weight, a small tensor next to the partials). n = 0: nothing to sum.
template <typename P, typename W>
struct PartialsSum {
  static constexpr int kCols = 32, kGroups = 8, kThreads = kCols * kGroups;
  const P* parts;
  int64_t split, n, kh, kw, cin;
  W* gw;
  Dims4 gd;

  // Column blocks of kCols elements.
  __host__ __device__ int64_t column_blocks() const { return (n + kCols - 1) / kCols; }

  // Column blocks first, first + step, ... by a block of kThreads threads (every thread calls:
  // the loop is the block's, with barriers). Element indices in 32 bits (partials_sum checks
  // n): with 64-bit divisions of the weight's index the dx launch that runs this took 48
  // registers a thread on sm_80, 8 more.
  __device__ void run(int64_t first, int64_t step) const {
    __shared__ P group_sums[kGroups][kCols];
    const int lane = static_cast<int>(threadIdx.x) % kCols;
    const int group = static_cast<int>(threadIdx.x) / kCols;
    const uint32_t taps = static_cast<uint32_t>(kh * kw), width = static_cast<uint32_t>(kw);
    const uint32_t channels = static_cast<uint32_t>(cin);
    for (int64_t b = first; b < column_blocks(); b += step) {
      const uint32_t i = static_cast<uint32_t>(b) * kCols + lane;
      P acc = P(0);
      if (i < n && group < split) {
        const P* p = parts + group * n + i;
        acc = *p;
        for (int64_t k = group + kGroups; k < split; k += kGroups) acc += *(p += kGroups * n);
      }
      group_sums[group][lane] = acc;
      __syncthreads();
      if (group == 0 && i < n) {
        for (int g = 1; g < kGroups && g < split; ++g) acc += group_sums[g][lane];
        const uint32_t c = i % channels, t = i / channels;
        gw[gd.offset(t / taps, c, t / width % (taps / width), t % width)] = static_cast<W>(acc);
      }
      __syncthreads();  // group_sums is rewritten by the next column block
    }
  }
};

template <typename P, typename W>
__global__ void __launch_bounds__(PartialsSum<P, W>::kThreads)
    wgrad_partials_sum_kernel(PartialsSum<P, W> sum) {
  FUSEDRES_LAUNCH_BOUNDS(PartialsSum<P, W>::kThreads);
  sum.run(blockIdx.x, gridDim.x);
}

// The weight gradient's accumulator dtype: float64 for a float64 weight, else float32.
template <typename W>
using partials_t = std::conditional_t<std::is_same_v<W, double>, double, float>;

// parts: contiguous (split, Co, kh, kw, C) of float32 (float64 for a float64 weight); gw: the
// weight's gradient (Co, C, kh, kw), overwritten by the launch that takes the result.
template <typename W>
PartialsSum<partials_t<W>, W> partials_sum(const at::Tensor& parts, at::Tensor& gw) {
  using P = partials_t<W>;
  const int64_t Co = gw.size(0), cin = gw.size(1), kh = gw.size(2), kw = gw.size(3);
  TORCH_CHECK(gw.scalar_type() == c10::CppTypeToScalarType<W>::value && parts.dim() == 5 &&
                  parts.size(0) >= 1 && parts.size(1) == Co && parts.size(2) == kh &&
                  parts.size(3) == kw && parts.size(4) == cin && parts.is_contiguous() &&
                  parts.scalar_type() == c10::CppTypeToScalarType<P>::value,
              "fusedres_cuda: wgrad_partials_sum: parts must be contiguous (split >= 1, ", Co,
              ", ", kh, ", ", kw, ", ", cin, ") of the weight's accumulator dtype, got ",
              parts.sizes(), " ", parts.scalar_type());
  TORCH_CHECK(Co * cin * kh * kw <= std::numeric_limits<int32_t>::max(),
              "fusedres_cuda: wgrad_partials_sum: a weight of 2^31 elements or more (", Co,
              " x ", cin, " x ", kh, " x ", kw, ") is not supported");
  return {parts.const_data_ptr<P>(), parts.size(0), Co * cin * kh * kw, kh, kw, cin,
          gw.data_ptr<W>(), dims_of(gw)};
}

// The blocks the partials' sum takes (PartialsSum::kThreads each), one launch or the dx
// launch's share: a column block each, at most `most` (0: CUDA's grid limit; fewer make each
// block loop over several, as the grid limit does past 2^21 dW elements; the tests' hook).
template <typename P, typename W>
int64_t partials_sum_blocks(const PartialsSum<P, W>& sum, int64_t most = 0) {
  return std::min<int64_t>(sum.column_blocks(), most > 0 ? std::min<int64_t>(most, 65535) : 65535);
}

inline void wgrad_partials_sum(const at::Tensor& parts, at::Tensor& gw, int64_t most_blocks = 0) {
  FUSEDRES_DISPATCH_FLOATING(gw.scalar_type(), "fusedres_cuda_wgrad_partials_sum", [&] {
    using W = scalar_t;
    const PartialsSum<partials_t<W>, W> sum = partials_sum<W>(parts, gw);
    if (sum.n == 0) return;
    FUSEDRES_LAUNCH(dim3(static_cast<unsigned>(partials_sum_blocks(sum, most_blocks))),
                    dim3(sum.kThreads), 0,
                    current_stream(), wgrad_partials_sum_kernel<partials_t<W>, W>)(sum);
    FUSEDRES_CHECK_LAUNCH();
  });
}

template <typename X, typename W>
void launch_wgrad(const at::Tensor& go, const at::Tensor& x, const Affine& bn, at::Tensor& gw,
                  at::Tensor* gb, SumsArgs* sums, const at::Tensor* bscale, const ConvGeom& g) {
  using T = typename TilesFor<W>::Fwd;
  using A = acc_t<X>;
  using C = acc_t<W>;
  const int64_t Co = gw.size(0), Cin = x.size(1), taps = int64_t(g.kh) * g.kw;
  const int64_t M = go.size(0) * go.size(2) * go.size(3);
  // The mma.sync kernel's columns run on across taps (cdiv(taps * C, 64) column blocks), the
  // WMMA kernel's are one tap's (cdiv(C, 64) * taps): the same partials either way.
  bool mma = false;
  if constexpr (is_16bit<W> && std::is_same_v<X, W>) {
    mma = wgrad_uses_mma(go, x, gw.scalar_type());
  }
  const int64_t co_blocks = ceil_div(Co, T::BM);
  const int64_t col_blocks = mma ? ceil_div(taps * Cin, T::BN) : ceil_div(Cin, T::BN) * taps;
  const int64_t split =
      pick_split(co_blocks * col_blocks, Co, Cin, taps, M, T::BK, sm_count(),
                 M * (Cin * int64_t(sizeof(X)) + Co * int64_t(sizeof(W))), sizeof(C));
  const int64_t steps = ceil_div(ceil_div(M, T::BK), split);
  constexpr at::ScalarType acc_type = c10::CppTypeToScalarType<C>::value;
  const auto acc_opts = gw.options().dtype(acc_type);
  at::Tensor part_dw;  // unsplit: the blocks write the weight gradient itself
  if (split > 1) {
    part_dw = at::empty({split, Co, taps, Cin}, acc_opts);
  }
  at::Tensor part_db = gb != nullptr ? at::empty({split, Co}, acc_opts) : at::Tensor();
  const dim3 grid(static_cast<unsigned>(co_blocks), static_cast<unsigned>(col_blocks),
                  static_cast<unsigned>(split));
  BnSums<A> bs{};
  at::Tensor part_dz, part_dzx;
  if (sums != nullptr) {
    part_dz = at::empty({split * co_blocks * taps, Cin}, acc_opts);
    part_dzx = at::empty_like(part_dz);
    bs = {sums->mean.const_data_ptr<A>(), sums->invstd.const_data_ptr<A>(),
          sums->gamma.const_data_ptr<A>(), sums->beta.const_data_ptr<A>(),
          sums->weight.const_data_ptr<W>(), part_dz.data_ptr<A>(), part_dzx.data_ptr<A>()};
  }
  const W* gop = go.const_data_ptr<W>();
  const X* xp = x.const_data_ptr<X>();
  const A* sc = bn.scale.const_data_ptr<A>();
  const A* sh = bn.shift.const_data_ptr<A>();
  C* pdw = part_dw.defined() ? part_dw.data_ptr<C>() : nullptr;
  C* pdb = gb != nullptr ? part_db.data_ptr<C>() : nullptr;
  const Dims4 wd = sums != nullptr ? dims_of(sums->weight) : Dims4{};
  const C* bsp = bscale != nullptr ? bscale->const_data_ptr<C>() : nullptr;
  bool launched = false;
  if constexpr (is_16bit<W> && std::is_same_v<X, W>) {
    // One set of partials for both kernels (the grids differ in their column blocks).
    static_assert(MmaWgrad::BM == T::BM && MmaWgrad::BN == T::BN && MmaWgrad::KSTEP == T::BK,
                  "the mma.sync weight gradient shares the WMMA kernel's tile and K-step");
    if (mma) {
      if (sums != nullptr) {
        FUSEDRES_LAUNCH(grid, dim3(MmaWgrad::THREADS), 0, current_stream(),
                        wgrad_mma_kernel<W, true>)(gop, xp, sc, sh, gw.data_ptr<W>(), pdw, pdb,
                                                   bs, bsp, dims_of(go), dims_of(x),
                                                   dims_of(gw), wd, g, steps);
      } else {
        FUSEDRES_LAUNCH(grid, dim3(MmaWgrad::THREADS), 0, current_stream(),
                        wgrad_mma_kernel<W, false>)(gop, xp, sc, sh, gw.data_ptr<W>(), pdw, pdb,
                                                    bs, bsp, dims_of(go), dims_of(x),
                                                    dims_of(gw), wd, g, steps);
      }
      launched = true;
    }
  }
  if (!launched && sums != nullptr) {
    FUSEDRES_LAUNCH(grid, dim3(T::THREADS), 0, current_stream(), wgrad_kernel<X, W, T, true>)(
        gop, xp, sc, sh, gw.data_ptr<W>(), pdw, pdb, bs, bsp, dims_of(go), dims_of(x),
        dims_of(gw), wd, g, steps);
  } else if (!launched) {
    FUSEDRES_LAUNCH(grid, dim3(T::THREADS), 0, current_stream(), wgrad_kernel<X, W, T, false>)(
        gop, xp, sc, sh, gw.data_ptr<W>(), pdw, pdb, bs, bsp, dims_of(go), dims_of(x),
        dims_of(gw), wd, g, steps);
  }
  FUSEDRES_CHECK_LAUNCH();
  if (part_dw.defined()) {
    wgrad_partials_sum(part_dw.view({split, Co, g.kh, g.kw, Cin}), gw);
  }
  if (gb != nullptr) gb->copy_(part_db.sum(0));
  if (sums != nullptr) {
    sums->part_dz = part_dz;
    sums->part_dzx = part_dzx;
  }
}

}  // namespace
}  // namespace fusedres::FUSEDRES_CUDA_NS
