// The data gradient of the fused unit's backward (bn_relu_conv2d_backward.cu, the algorithm of
// kernels/bn_relu_conv2d_dgrad.py): da = conv_transpose(dy, W), recomputing the ReLU mask from x
// in the epilogue, with the BatchNorm sums' partials; and the dx pass that finishes it in the
// "store" strategy. Kernels: dgrad_kernel (WMMA / FMA), dgrad_mma_kernel (mma.sync), dx_kernel;
// their launchers: launch_dgrad, launch_dx. Included by bn_relu_conv2d_backward.cu only (one
// translation unit: the kernels keep its anonymous namespace, so their names and the tables
// keyed on that file, csrc/cuda/COMPILE.md and benchmarks/GPU_MODEL.md, are unchanged).
#pragma once

#include <cstdlib>
#include <string>
#include <type_traits>

#include "bn_relu_conv2d_wgrad.cuh"  // wgrad_mma_operands: the operands both mma.sync kernels take
#include "conv_tiles.cuh"
#include "mma.cuh"
#include "mma_tiles.cuh"
#include "ops.h"

namespace fusedres::FUSEDRES_CUDA_NS {
namespace {

// What the data-gradient epilogue writes: dz into the x gradient's buffer, rounded to its dtype
// as plain PyTorch's ReLU backward rounds it (then the dx pass, in place), dx, or nothing (sums
// only). The sums are reduced from the unrounded dz.
enum DgradWrite : int { kWriteNothing = 0, kWriteDz = 1, kWriteDx = 2 };

// The data gradient's epilogue, shared by the WMMA and the mma.sync kernel, on the block's
// BM x BN tile of da (Cs; rows: the phase's input pixels row_n / row_ih / row_iw, -1 past its
// pixels; columns c0 + n): loads x, recomputes the ReLU mask, writes dz or dx to gx (or nothing), and
// reduces per channel sum dz and sum dz * xhat over the tile into its partials' row `row` (Ds holds
// dz * xhat). With `act` (x's dtype and strides) it also writes the activation
// a = relu(scale * x + shift) there, rounded once from float32 as the native forward's operand
// is (the CUTLASS forward's rounds scale and shift to 16 bits first: a few units in the last
// place apart where scale * x and shift cancel): the
// CUTLASS weight gradient's B operand (a plain convolution weight gradient of a; the BatchNorm-
// ReLU in its main loop cost it 1.3-1.8 times the issue, by the model). Every input pixel is in one
// stride phase's rows, so every element of a is written. The caller synchronises after filling
// Cs.
template <typename X, int BM, int BN, int LD, int THREADS>
__device__ __forceinline__ void dgrad_store(
    acc_t<X> (*Cs)[LD], acc_t<X> (*Ds)[LD], const int64_t* row_n, const int32_t* row_ih,
    const int32_t* row_iw, const X* __restrict__ x, const acc_t<X>* __restrict__ bn_w,
    const acc_t<X>* __restrict__ bn_b, const acc_t<X>* __restrict__ mean,
    const acc_t<X>* __restrict__ invstd, X* __restrict__ gx, acc_t<X>* __restrict__ part_dz,
    acc_t<X>* __restrict__ part_dzx, const acc_t<X>* __restrict__ m1,
    const acc_t<X>* __restrict__ m2, const acc_t<X>* __restrict__ branch_scale,
    X* __restrict__ act, const Dims4& xd, const Dims4& gd, int64_t c0, int write, int64_t row,
    int tid) {
  using A = acc_t<X>;
  const int64_t Cin = xd.c;
  const bool stats = part_dz != nullptr;
  const bool x_channels_fast = xd.sc == 1;
  for (int e = tid; e < BM * BN; e += THREADS) {
    const int m = x_channels_fast ? e / BN : e % BM;
    const int n = x_channels_fast ? e % BN : e / BM;
    const int64_t c = c0 + n;
    A dz = A(0), dzx = A(0);
    if (row_n[m] >= 0 && c < Cin) {
      const int64_t xo = xd.offset(row_n[m], c, row_ih[m], row_iw[m]);
      const A xv = static_cast<A>(x[xo]);
      // da of the row's sample: s[n] * conv_transpose(dy) with a branch scale.
      const A da = branch_scale != nullptr ? Cs[m][n] * branch_scale[row_n[m]] : Cs[m][n];
      // The gradient passes unless z <= 0 (a NaN z passes it, as torch's ReLU backward does).
      const ChannelAffine<A> f = channel_affine(bn_w != nullptr ? bn_w + c : nullptr,
                                                bn_b != nullptr ? bn_b + c : nullptr, mean[c],
                                                invstd[c]);
      const A a = bn_relu(xv, f.scale, f.shift);
      dz = a == A(0) ? A(0) : da;
      if (act != nullptr) act[xo] = static_cast<X>(a);
      const A xhat = (xv - mean[c]) * invstd[c];
      dzx = dz * xhat;
      const int64_t go = gd.offset(row_n[m], c, row_ih[m], row_iw[m]);
      if (write == kWriteDz) gx[go] = static_cast<X>(dz);
      // dx: training (the sums known before this pass: m1 = mean dz, m2 = mean dz xhat) or eval.
      if (write == kWriteDx) {
        gx[go] = static_cast<X>(m1 != nullptr ? f.scale * (dz - m1[c] - xhat * m2[c])
                                              : f.scale * dz);
      }
    }
    if (stats) {
      Cs[m][n] = dz;
      Ds[m][n] = dzx;
    }
  }
  if (!stats) return;
  __syncthreads();
  for (int q = tid; q < 2 * BN; q += THREADS) {
    const int n = q % BN;
    const int64_t c = c0 + n;
    if (c >= Cin) continue;
    A s = A(0);
    if (q < BN) {
      for (int m = 0; m < BM; ++m) s += Cs[m][n];
      part_dz[row * Cin + c] = s;
    } else {
      for (int m = 0; m < BM; ++m) s += Ds[m][n];
      part_dzx[row * Cin + c] = s;
    }
  }
}

// Resident blocks per SM promised to ptxas (__launch_bounds__' second argument) by the WMMA /
// FMA kernels (this one and wgrad_kernel, bn_relu_conv2d_wgrad.cuh). With the thread count alone
// ptxas capped them low and spilled (sm_90: the 16-bit data gradient at 96 registers, 8-12 bytes;
// the float32 one at 80, 4 bytes). The data gradient fits 128 registers (4 blocks of 128
// threads, 2 of 256). No spills now (csrc/cuda/COMPILE.md), for one resident block fewer: the
// 16-bit data gradient 4 blocks on sm_90 (5 before), the float32 one 2 (3, also on sm_80, where
// it had not spilled). These kernels run where the mma.sync ones do not (float32, float64,
// 16-bit tensors that are not channels_last or not 8-channel aligned, kernels of more than 64
// taps).
template <typename T>
constexpr int kDgradMinBlocks = T::THREADS >= 256 ? 2 : 4;

// The block's rows: the phase (pa, pb)'s input pixels m0 + r on its HP x WP grid (Mp in all):
// row_n[r] the sample (-1 past Mp), row_ih[r], row_iw[r] the input pixel (0 past Mp). The caller
// synchronises before reading them.
template <int BM, int THREADS>
__device__ __forceinline__ void fill_phase_rows(int64_t* row_n, int32_t* row_ih, int32_t* row_iw,
                                                int64_t m0, int64_t Mp, int64_t HP, int64_t WP,
                                                int pa, int pb, const ConvGeom& g, int tid) {
  for (int r = tid; r < BM; r += THREADS) {
    const int64_t m = m0 + r;
    if (m < Mp) {
      const Pixel p = pixel_of(m, HP, WP);
      row_n[r] = p.n;
      row_ih[r] = pa + g.sh * p.h;
      row_iw[r] = pb + g.sw * p.w;
    } else {
      row_n[r] = -1;
      row_ih[r] = row_iw[r] = 0;
    }
  }
}

template <typename X, typename W, typename T>
__global__ void __launch_bounds__(T::THREADS, kDgradMinBlocks<T>)
    dgrad_kernel(const W* __restrict__ dy, const W* __restrict__ w, const X* __restrict__ x,
                 const acc_t<X>* __restrict__ bn_w, const acc_t<X>* __restrict__ bn_b,
                 const acc_t<X>* __restrict__ mean, const acc_t<X>* __restrict__ invstd,
                 X* __restrict__ gx, acc_t<X>* __restrict__ part_dz,
                 acc_t<X>* __restrict__ part_dzx,
                 const acc_t<X>* __restrict__ m1, const acc_t<X>* __restrict__ m2,
                 const acc_t<X>* __restrict__ branch_scale, X* __restrict__ act, Dims4 dyd,
                 Dims4 wd, Dims4 xd, Dims4 gd, ConvGeom g, int write) {
  FUSEDRES_LAUNCH_BOUNDS(T::THREADS, kDgradMinBlocks<T>);
  using A = acc_t<X>;
  static_assert(std::is_same_v<A, acc_t<W>>, "x and weight must share an accumulator type");
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, THREADS = T::THREADS;
  __shared__ __align__(32) W As[BK][BM + T::APAD];  // dy: (Co slice) x (pixels)
  __shared__ __align__(32) W Bs[BK][BN + T::BPAD];  // W: (Co slice) x (C slice)
  __shared__ __align__(32) A Cs[BM][BN + T::CPAD];  // da, then dz
  __shared__ __align__(32) A Ds[BM][BN + T::CPAD];  // dz * xhat
  __shared__ int64_t row_n[BM];  // sample of the row, -1 past the phase's pixels
  __shared__ int32_t row_ih[BM];
  __shared__ int32_t row_iw[BM];
  __shared__ int64_t tap_off[BM];  // offset of dy[n, 0, oh, ow] feeding the row, -1 if none

  // The stride phase of this block and its pixel grid (HP x WP pixels per sample).
  const int phases_w = static_cast<int>(xd.w < g.sw ? xd.w : g.sw);
  const int pa = blockIdx.z / phases_w, pb = blockIdx.z % phases_w;
  const int64_t HP = (xd.h - pa + g.sh - 1) / g.sh, WP = (xd.w - pb + g.sw - 1) / g.sw;
  const int64_t Mp = xd.n * HP * WP;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  if (m0 >= Mp) return;  // the phase has fewer pixels than the largest one (partials stay 0)
  const int tid = threadIdx.x;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int64_t Cin = xd.c, Co = dyd.c;
  fill_phase_rows<BM, THREADS>(row_n, row_ih, row_iw, m0, Mp, HP, WP, pa, pb, g, tid);
  Accum<W, T> acc;
  acc.zero();
  const bool dy_channels_fast = dyd.sc == 1;
  for (int t = 0; t < g.kh * g.kw; ++t) {
    const int i = t / g.kw, j = t % g.kw;
    // (ih + ph - i*dh) must be a multiple of the stride: the same for every row of the phase.
    if (mod_pos(pa + g.ph - i * g.dh, g.sh) != 0 || mod_pos(pb + g.pw - j * g.dw, g.sw) != 0) {
      continue;
    }
    __syncthreads();
    for (int r = tid; r < BM; r += THREADS) {
      int64_t off = -1;
      if (row_n[r] >= 0) {
        const int64_t oh_s = int64_t(row_ih[r]) + g.ph - int64_t(i) * g.dh;
        const int64_t ow_s = int64_t(row_iw[r]) + g.pw - int64_t(j) * g.dw;
        if (oh_s >= 0 && ow_s >= 0) {
          const int64_t oh = oh_s / g.sh, ow = ow_s / g.sw;
          if (oh < dyd.h && ow < dyd.w) off = dyd.offset(row_n[r], 0, oh, ow);
        }
      }
      tap_off[r] = off;
    }
    __syncthreads();
    for (int64_t k0 = 0; k0 < Co; k0 += BK) {
      for (int e = tid; e < BM * BK; e += THREADS) {
        const int m = dy_channels_fast ? e / BK : e % BM;
        const int k = dy_channels_fast ? e % BK : e / BM;
        const int64_t co = k0 + k;
        const int64_t off = tap_off[m];
        As[k][m] = (off >= 0 && co < Co) ? dy[off + co * dyd.sc] : static_cast<W>(0.0f);
      }
      for (int e = tid; e < BN * BK; e += THREADS) {
        const int n = e % BN, k = e / BN;
        const int64_t co = k0 + k, c = c0 + n;
        Bs[k][n] = (co < Co && c < Cin) ? w[wd.offset(co, c, i, j)] : static_cast<W>(0.0f);
      }
      __syncthreads();
      acc.mma(As, Bs, tid);
      __syncthreads();
    }
  }
  acc.store(Cs, tid);
  __syncthreads();
  dgrad_store<X, BM, BN, BN + T::CPAD, THREADS>(Cs, Ds, row_n, row_ih, row_iw, x, bn_w, bn_b,
                                                mean, invstd, gx, part_dz, part_dzx, m1, m2,
                                                branch_scale, act, xd, gd, c0, write,
                                                static_cast<int64_t>(blockIdx.z) * gridDim.x +
                                                    blockIdx.x,
                                                tid);
}

// ----------------------------------------------------------------------------- tensor-core dgrad

// The data gradient of 16-bit x, grad_out and weight of one dtype, x and grad_out channels-last
// with C and Co multiples of 8: the WMMA kernel's grid (one stride phase per blockIdx.z, BM
// input pixels x BN input channels a block) and epilogue (dgrad_store), its main loop mma.sync
// m16n8k16 on operands that cp.async stages, 16 bytes a copy, through a STAGES-deep pipeline
// with one barrier per K chunk (BK output channels of one tap, or 16 of each of two: TAPS). The
// K chunks run over the taps
// that feed the phase (tap_list with each tap's shift, built once per block) and the output
// channels; the next chunk's tap, channel offset and address shift are stepped one chunk at a
// time (no division in the main loop), and a row's base offset is computed once. A (dy rows,
// pixels x Co): a row's output pixel at tap (i, j) is (h + di, w + dj) on the phase grid
// (di = (pa + ph - i dh) / sh, exact for a tap of the phase), a row outside dy zero-filled,
// as are rows past the phase's pixels. B: the weight with C contiguous (DgradWeight: element
// (tap, co, c) at tap * wl.tap + co * wl.co + c): a channels-last weight in place (KRSC), any
// other packed (host) as row-major (taps*Co, C), so a chunk is BK rows of 16-byte pieces. No
// transform on the fragments: the ReLU mask and the branch scale are applied in the epilogue.
// 4 warps; shared rows padded by 8 halves as in the forward. A thin tile (BN = 16 or 32 for C <= 32, BK = 16
// for Co <= 16 too) has fewer 16-byte pieces of B per chunk than threads: the first B_PIECES
// threads copy one each.
template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int BK_ = 32, int TAPS_ = 1>
struct MmaDgrad {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = 3;
  // Taps a K chunk covers: 1, or 2 (BK = 32 for Co <= 16: each tap's 16 output channels in
  // one half of the chunk, zero-filled past Co; the K steps are those of two 16-deep chunks).
  static constexpr int TAPS = TAPS_, KT = BK / TAPS;
  static_assert(TAPS == 1 || (TAPS == 2 && BK == 32), "a chunk of one tap, or two of 16");
  static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
  static constexpr int FM = WM / 16, FN = WN / 8;
  static constexpr int AST = BK + 8, BST = BN + 8, CLD = BN + 4;
  static constexpr int A_COPIES = BM * BK / 8 / THREADS;
  static constexpr int B_PIECES = BK * BN / 8;
  static constexpr int B_COPIES = (B_PIECES + THREADS - 1) / THREADS;
  static constexpr int MAX_TAPS = 64;  // kh * kw of the kernels it takes
  // The epilogue runs on EM rows at a time (BM / EM passes, each with its own partials' row),
  // so the 128 x 64 tile's da / dz and dz * xhat fit in the static 48 KiB beside the pipeline
  // (the 128 x 128 one's take dynamic shared memory: DYNAMIC).
  static constexpr int EM = 64, PASSES = BM / EM;
  static constexpr int A_BYTES = STAGES * BM * AST * 2;
  static constexpr int B_BYTES = STAGES * BK * BST * 2;
  static constexpr int PIPE_BYTES = A_BYTES + B_BYTES;
  static constexpr int C_BYTES = 2 * EM * CLD * 4;  // da / dz and dz * xhat
  static constexpr int SMEM = PIPE_BYTES > C_BYTES ? PIPE_BYTES : C_BYTES;
  // The pipeline and epilogue buffers: static shared memory where they fit beside the row and
  // tap tables in the static 48 KiB, else dynamic (the launch opts in past 48 KiB: the wide
  // tile's 66 KiB).
  static constexpr int TABLE_BYTES = BM * 16 + 3 * MAX_TAPS * 4 + 4;
  static constexpr bool DYNAMIC = SMEM + TABLE_BYTES > 48 * 1024;
  static constexpr int DYNAMIC_SMEM = DYNAMIC ? SMEM : 0;
  static_assert(A_COPIES * THREADS * 8 == BM * BK &&
                    (B_COPIES * THREADS == B_PIECES || B_PIECES < THREADS),
                "the 16-byte copies do not divide among the threads");
  static_assert(WM * WARPS_M == BM && WN * WARPS_N == BN && FM * 16 == WM && FN % 2 == 0,
                "warp grid");
  static_assert(PASSES * EM == BM && EM % WM == 0, "a warp's rows in one epilogue pass");
  static_assert(A_BYTES % 128 == 0 && B_BYTES % 128 == 0, "stage buffers 128-byte aligned");
  static_assert(SMEM + TABLE_BYTES <= 163 * 1024, "shared memory within sm_80's per-block limit");
};
// The tile configurations (dgrad_mma_rows picks the rows per shape, dgrad_mma_cols the columns,
// mma_depth the K chunk, dgrad_mma_taps the taps a chunk covers): 64 x 64 of 2 x 2 warps of
// 32 x 32, and 128 x 64 of 4 x 1
// warps of 32 x 64 (each ldmatrix feeds twice the mma's, twice the multiply-adds per barrier).
// For C <= 32 a 64-column tile spends half or three quarters of its mma's on zero-filled
// columns, and for Co <= 16 a 32-deep chunk half of them on zero-filled K (CIFAR's 16-channel
// units are bound by them on the A100: benchmarks/GPU_MODEL.md): the thin tiles, 64 or 128
// rows x 16 or 32 columns of 4 x 1 warps, 16 deep where C and Co are both at most 16. Each
// element's sum takes the same m16n8k16 steps in the same order in every tile.
using MmaDgradSmall = MmaDgrad<64, 64, 2, 2>;
using MmaDgradTall = MmaDgrad<128, 64, 4, 1>;
// For C > 64 on sm_90: 128 x 128 of 2 x 2 warps of 64 x 64. A warp's K chunk issues 64 mma's
// where the tall tile's issues 32, for 8 16-byte copies a thread where the tall tile's takes 6
// (the copies' addressing and bounds tests are most of the tall tile's issue): the tall tile is
// bound by issue on sm_90, whose tensor cores take an m16n8k16 in half an A100's clocks
// (benchmarks/GPU_MODEL.md). Its buffers take 66 KiB of dynamic shared memory.
using MmaDgradWide = MmaDgrad<128, 128, 2, 2>;
// cuda_aot: dgrad_mma_kernel<*, MmaDgrad<128, 128, 2, 2, 32, 1> > dynamic_smem=67584
static_assert(MmaDgradWide::DYNAMIC && MmaDgradWide::DYNAMIC_SMEM == 67584 &&
                  !MmaDgradTall::DYNAMIC && !MmaDgradSmall::DYNAMIC,
              "the cuda_aot line above states the wide tile's dynamic shared memory, the only one");
template <int BM, int BN, int BK>
using MmaDgradThin = MmaDgrad<BM, BN, 4, 1, BK>;
// For C <= 16 and Co <= 16 with more than one tap, on sm_90: 16 columns, K chunks of two taps'
// 16 channels (32 deep). Most of a 16-deep chunk's issue is a fixed cost a chunk (the copies'
// addressing, the barrier, the pipeline's bookkeeping: benchmarks/GPU_MODEL.md's main-loop
// rows), so two taps a chunk, half the chunks, issue less for the same mma's. Each element's
// sum takes the 16-deep tiles' m16n8k16 steps in their order.
template <int BM>
using MmaDgradPaired = MmaDgrad<BM, 16, 4, 1, 32, 2>;

// The taps that feed phase (pa, pb), by one thread: (ih + ph - i dh) a multiple of sh for every
// row, with the shift (di, dj) from a row's phase-grid pixel to its output pixel at that tap
// (exact). The caller synchronises before reading them.
__device__ __forceinline__ void build_tap_list(int32_t* tap_list, int32_t* tap_di,
                                               int32_t* tap_dj, int32_t& tap_count, int pa,
                                               int pb, const ConvGeom& g) {
  int n = 0;
  for (int t = 0; t < g.kh * g.kw; ++t) {
    const int ti = t / g.kw, tj = t % g.kw;
    if (mod_pos(pa + g.ph - ti * g.dh, g.sh) == 0 && mod_pos(pb + g.pw - tj * g.dw, g.sw) == 0) {
      tap_list[n] = t;
      tap_di[n] = (pa + g.ph - ti * g.dh) / g.sh;
      tap_dj[n] = (pb + g.pw - tj * g.dw) / g.sw;
      ++n;
    }
  }
  tap_count = n;
}

// Where the mma.sync data gradient finds weight element (tap, co, c): at tap * wl.tap +
// co * wl.co + c (wl: these strides).
struct WeightRows {
  int64_t tap, co;
};

// A copied dy row's source: the element offset of dy[n, 0, h, w] at its phase-grid pixel (n, h,
// w) and (h, w); a tap (di, dj) moves it to the output pixel (h + di, w + dj), the same shift for
// every row. A row past the phase's pixels has h = kDgradOutside, outside dy at every tap.
struct DgradSrc {
  int64_t off;
  int32_t h, w;
};
constexpr int32_t kDgradOutside = -(1 << 30);
// A row past the phase (h = kDgradOutside) meets a paired chunk's missing tap (di the same):
// the sum must stay an int32.
static_assert(2LL * kDgradOutside >= INT32_MIN, "the sentinels' sum fits an int32");

// The paired-tap data gradient's next K chunk (MmaDgradPaired: two taps a chunk, Co <= KT = 16),
// stepped one chunk at a time, and its copies into a stage (the caller commits): tap slot t's
// 16 output channels fill K rows t * KT on; slot 1's di is kDgradOutside where the phase's last
// chunk has one tap only (its rows zero-filled). Each 8-channel piece lies in one slot. (The
// one-tap kernels step their chunk in the kernel's own lambdas: as members of a struct, their
// main loops issued more a chunk on sm_90.)
template <typename W, typename T>
struct DgradPairs {
  static constexpr int BK = T::BK, KT = T::KT, THREADS = T::THREADS;
  const W* __restrict__ dy;
  const W* __restrict__ wp;
  WeightRows wl;
  int64_t sh, sw;  // dy's row and pixel strides
  uint32_t Ho, Wo;  // dy's height and width
  const int32_t *tap_list, *tap_di, *tap_dj;
  int32_t tap_count, Co32, Cin32;
  int64_t c0;
  int tid;
  int32_t tl = 0, di[2] = {}, dj[2] = {};
  int64_t toff[2] = {}, krow[2] = {};

  __device__ __forceinline__ void set_tap() {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const bool has = tl + t < tap_count;
      di[t] = has ? tap_di[tl + t] : kDgradOutside;
      dj[t] = has ? tap_dj[tl + t] : 0;
      toff[t] = int64_t(di[t]) * sh + int64_t(dj[t]) * sw;
      krow[t] = has ? int64_t(tap_list[tl + t]) * wl.tap : 0;
    }
  }
  __device__ __forceinline__ void step() {
    tl += 2;
    if (tl < tap_count) set_tap();
  }
  __device__ __forceinline__ void load(uint16_t (*As)[T::AST], uint16_t (*Bs)[T::BST],
                                       const DgradSrc (&a_src)[T::A_COPIES]) const {
#pragma unroll
    for (int q = 0; q < T::A_COPIES; ++q) {
      const int e = tid + q * THREADS, r = e / (BK / 8), k = (e % (BK / 8)) * 8;
      // The slot by selects, not an index: a per-thread index into the arrays put them in
      // local memory.
      const bool t = k >= KT;
      const int kk = k % KT;
      const bool ok = static_cast<uint32_t>(a_src[q].h + (t ? di[1] : di[0])) < Ho &&
                      static_cast<uint32_t>(a_src[q].w + (t ? dj[1] : dj[0])) < Wo && kk < Co32;
      ptx::cp_async_cg16(&As[r][k], ok ? dy + (a_src[q].off + (t ? toff[1] : toff[0]) + kk) : dy,
                         ok ? 16 : 0);
    }
    stage_b<T>(Bs, tid, wp, [&](int r, int n) -> const W* {
      const bool t = r >= KT;
      const int rr = r % KT;
      return (t ? di[1] : di[0]) != kDgradOutside && rr < Co32 && c0 + n < Cin32
                 ? wp + (t ? krow[1] : krow[0]) + rr * wl.co + c0 + n
                 : nullptr;
    });
  }
};

template <typename W, typename T>
__global__ void __launch_bounds__(T::THREADS)
    dgrad_mma_kernel(const W* __restrict__ dy, const W* __restrict__ wp, WeightRows wl,
                     const W* __restrict__ x,
                     const float* __restrict__ bn_w, const float* __restrict__ bn_b,
                     const float* __restrict__ mean, const float* __restrict__ invstd,
                     W* __restrict__ gx, float* __restrict__ part_dz,
                     float* __restrict__ part_dzx,
                     const float* __restrict__ m1, const float* __restrict__ m2,
                     const float* __restrict__ branch_scale, W* __restrict__ act, Dims4 dyd,
                     Dims4 xd, Dims4 gd, ConvGeom g, int write) {
  FUSEDRES_LAUNCH_BOUNDS(T::THREADS);
  using E = native_t<W>;
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, STAGES = T::STAGES, THREADS = T::THREADS;
  __shared__ __align__(128) unsigned char smem_static[T::DYNAMIC ? 16 : T::SMEM];
  unsigned char* smem = smem_static;
  if constexpr (T::DYNAMIC) smem = fusedres_dynamic_shared<unsigned char>();
  __shared__ int64_t row_n[BM];
  __shared__ int32_t row_ih[BM];
  __shared__ int32_t row_iw[BM];
  __shared__ int32_t tap_list[T::MAX_TAPS];
  __shared__ int32_t tap_di[T::MAX_TAPS];  // the tap's output-pixel shift on the phase grid
  __shared__ int32_t tap_dj[T::MAX_TAPS];
  __shared__ int32_t tap_count;
  auto* As = reinterpret_cast<uint16_t(*)[BM][T::AST]>(smem);
  auto* Bs = reinterpret_cast<uint16_t(*)[BK][T::BST]>(smem + T::A_BYTES);
  auto* Cs = reinterpret_cast<float(*)[T::CLD]>(smem);
  auto* Ds = reinterpret_cast<float(*)[T::CLD]>(smem + T::EM * T::CLD * 4);

  const int phases_w = static_cast<int>(xd.w < g.sw ? xd.w : g.sw);
  const int pa = blockIdx.z / phases_w, pb = blockIdx.z % phases_w;
  const int64_t HP = (xd.h - pa + g.sh - 1) / g.sh, WP = (xd.w - pb + g.sw - 1) / g.sw;
  const int64_t Mp = xd.n * HP * WP;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  if (m0 >= Mp) return;  // the phase has fewer pixels than the largest one (partials stay 0)
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int64_t Cin = xd.c, Co = dyd.c;
  fill_phase_rows<BM, THREADS>(row_n, row_ih, row_iw, m0, Mp, HP, WP, pa, pb, g, tid);
  if (tid == 0) build_tap_list(tap_list, tap_di, tap_dj, tap_count, pa, pb, g);
  DgradSrc a_src[T::A_COPIES];  // the rows this thread copies
#pragma unroll
  for (int q = 0; q < T::A_COPIES; ++q) {
    const int64_t m = m0 + (tid + q * THREADS) / (BK / 8);
    if (m < Mp) {
      const Pixel p = pixel_of(m, HP, WP);
      a_src[q] = DgradSrc{p.n * dyd.sn + int64_t(p.h) * dyd.sh + int64_t(p.w) * dyd.sw, p.h, p.w};
    } else {
      a_src[q] = DgradSrc{0, kDgradOutside, 0};
    }
  }
  __syncthreads();  // tap_list, tap_di, tap_dj, tap_count
  const int32_t Co32 = static_cast<int32_t>(Co), Cin32 = static_cast<int32_t>(Cin);
  // Paired taps: one chunk per two taps (Co <= KT, checked by the host).
  const int chunks = T::TAPS == 1 ? tap_count * static_cast<int>((Co + BK - 1) / BK)
                                  : (tap_count + T::TAPS - 1) / T::TAPS;
  const uint32_t Ho = static_cast<uint32_t>(dyd.h), Wo = static_cast<uint32_t>(dyd.w);
  // The next chunk to copy, stepped one chunk at a time (no division in the loop): its output
  // channel offset k0 in the tap, the tap's place in tap_list, its shift (di, dj) and dy element
  // offset toff, and the weight's offset of the tap (tap * wl.tap). Paired taps: `pairs`, which
  // only the paired tile has.
  struct Next {
    int32_t k0, tl, di, dj;
    int64_t toff, krow;
  } nx{0, 0, 0, 0, 0, 0};
  struct OneTap {};
  auto pairs = [&] {
    if constexpr (T::TAPS == 2) {
      return DgradPairs<W, T>{dy,     wp,     wl,        dyd.sh, dyd.sw, Ho,  Wo, tap_list,
                              tap_di, tap_dj, tap_count, Co32,   Cin32,  c0, tid};
    } else {
      return OneTap{};
    }
  }();
  const auto set_tap = [&] {
    nx.di = tap_di[nx.tl];
    nx.dj = tap_dj[nx.tl];
    nx.toff = int64_t(nx.di) * dyd.sh + int64_t(nx.dj) * dyd.sw;
    nx.krow = int64_t(tap_list[nx.tl]) * wl.tap;
  };
  if (chunks > 0) {
    if constexpr (T::TAPS == 2) {
      pairs.set_tap();
    } else {
      set_tap();
    }
  }
  const auto step = [&] {
    if constexpr (T::TAPS == 2) return pairs.step();
    nx.k0 += BK;
    if (nx.k0 < Co32) return;
    nx.k0 = 0;
    if (++nx.tl < tap_count) set_tap();
  };
  const auto load = [&](int st) {
    if constexpr (T::TAPS == 2) return pairs.load(As[st], Bs[st], a_src);
#pragma unroll
    for (int q = 0; q < T::A_COPIES; ++q) {
      const int e = tid + q * THREADS, r = e / (BK / 8), k = (e % (BK / 8)) * 8;
      const bool ok = static_cast<uint32_t>(a_src[q].h + nx.di) < Ho &&
                      static_cast<uint32_t>(a_src[q].w + nx.dj) < Wo && nx.k0 + k < Co32;
      ptx::cp_async_cg16(&As[st][r][k], ok ? dy + (a_src[q].off + nx.toff + nx.k0 + k) : dy,
                         ok ? 16 : 0);
    }
    stage_b<T>(Bs[st], tid, wp, [&](int r, int n) -> const W* {
      return nx.k0 + r < Co32 && c0 + n < Cin32 ? wp + nx.krow + (nx.k0 + r) * wl.co + c0 + n
                                                : nullptr;
    });
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
  const int wm = (warp / T::WARPS_N) * T::WM, wn = (warp % T::WARPS_N) * T::WN;
  const int lr = (lane % 8) + 8 * ((lane / 8) % 2), lc = 8 * (lane / 16);
  int st = 0, next_st = STAGES - 1;  // the stages of chunk kc and of chunk kc + STAGES - 1
  for (int kc = 0; kc < chunks; ++kc) {
    ptx::cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (kc + STAGES - 1 < chunks) {
      load(next_st);
      step();
    }
    ptx::cp_async_commit();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t fa[T::FM][4], fb[T::FN / 2][4];
      load_frags(fa, fb, As[st], Bs[st], wm, wn, kk, lr, lc);
      mma_tiles<E>(acc, fa, fb);
    }
    st = st + 1 == STAGES ? 0 : st + 1;
    next_st = next_st + 1 == STAGES ? 0 : next_st + 1;
  }
  ptx::cp_async_wait<0>();
  // The epilogue, EM rows a pass (the partials' row of pass p: PASSES rows per block).
  const int64_t prow = (static_cast<int64_t>(blockIdx.z) * gridDim.x + blockIdx.x) * T::PASSES;
#pragma unroll
  for (int pass = 0; pass < T::PASSES; ++pass) {
    // Every warp is done with the pipeline (pass 0) or the previous pass's Cs and Ds.
    __syncthreads();
    if (wm / T::EM == pass) store_acc(Cs, acc, wm - pass * T::EM, wn, lane);
    __syncthreads();
    const int o = pass * T::EM;
    dgrad_store<W, T::EM, BN, T::CLD, THREADS>(Cs, Ds, row_n + o, row_ih + o, row_iw + o, x,
                                               bn_w, bn_b, mean, invstd, gx, part_dz, part_dzx,
                                               m1, m2, branch_scale, act, xd, gd, c0,
                                               write, prow + pass, tid);
  }
}

// In place over the data gradient, which holds dz (in x's dtype): dx = scale * (dz - m1 -
// xhat * m2), m1 = sum dz / M, m2 = sum dz xhat / M (per channel), on the first dx_blocks
// blocks; for 16-bit x the blocks past them sum the CUTLASS weight gradient's partials (`dw`,
// of a weight of x's dtype; n = 0 and no such blocks otherwise), which wait on nothing the dx
// pass writes: one launch for both. (Other dtypes never take them: with the branch compiled in,
// ptxas spilled 16 B in the float64 kernel on sm_90.) The branch costs the 16-bit kernels
// registers: 40, 6 blocks an SM on sm_80 and sm_90 (with a thread per dW element looping over
// every slice they held 8 on sm_90; capped at 7 blocks, ptxas spilled there): a DRAM-bound
// pass, on the native route too.
template <typename X>
__global__ void __launch_bounds__(256)
    dx_kernel(X* __restrict__ gx, const X* __restrict__ x,
              const acc_t<X>* __restrict__ bn_w, const acc_t<X>* __restrict__ mean,
              const acc_t<X>* __restrict__ invstd, const acc_t<X>* __restrict__ m1,
              const acc_t<X>* __restrict__ m2, Dims4 xd, Dims4 gd, int64_t dx_blocks,
              PartialsSum<partials_t<X>, X> dw) {
  FUSEDRES_LAUNCH_BOUNDS(256);
  using A = acc_t<X>;
  if constexpr (is_16bit<X>) {
    if (static_cast<int64_t>(blockIdx.x) >= dx_blocks) {
      dw.run(static_cast<int64_t>(blockIdx.x) - dx_blocks,
             static_cast<int64_t>(gridDim.x) - dx_blocks);
      return;
    }
  }
  const int64_t total = xd.n * xd.c * xd.h * xd.w;
  const bool channels_fast = gd.sc == 1;
  const int64_t step = dx_blocks * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += step) {
    int64_t n, c, h, w;
    if (channels_fast) {
      c = e % xd.c;
      const int64_t p = e / xd.c;
      w = p % xd.w;
      h = (p / xd.w) % xd.h;
      n = p / (xd.w * xd.h);
    } else {
      w = e % xd.w;
      h = (e / xd.w) % xd.h;
      c = (e / (xd.w * xd.h)) % xd.c;
      n = e / (xd.w * xd.h * xd.c);
    }
    const int64_t go = gd.offset(n, c, h, w);
    const A xhat = (static_cast<A>(x[xd.offset(n, c, h, w)]) - mean[c]) * invstd[c];
    const A s = channel_affine(bn_w != nullptr ? bn_w + c : nullptr, static_cast<const A*>(nullptr),
                               mean[c], invstd[c]).scale;
    gx[go] = static_cast<X>(s * (static_cast<A>(gx[go]) - m1[c] - xhat * m2[c]));
  }
}

// ----------------------------------------------------------------------------- host

// The mma.sync data gradient's requirements (dgrad_mma_kernel): those of the weight gradient's
// (wgrad_mma_operands: 16-bit x, grad_out and weight of one dtype, channels-last with C and Co
// multiples of 8, 16-byte aligned) and at most MmaDgrad::MAX_TAPS taps.
bool dgrad_uses_mma(const at::Tensor& go, const at::Tensor& x, const at::Tensor& weight) {
  if (!wgrad_mma_operands(go, x, weight.scalar_type())) return false;
  return weight.size(2) * weight.size(3) <= MmaDgradSmall::MAX_TAPS;
}

static_assert(MmaDgradTall::BN == 64 && MmaDgradTall::BK == 32,
              "mma_cols and mma_depth (mma_tiles.cuh) end at the 64 x 32 tile");

// The mma.sync data gradient's tile rows for `rows` input pixels of the largest stride phase,
// C input channels and `phases` phases: 128 when its tiles fill every SM at least once
// (cdiv(rows, 128) * cdiv(C, mma_cols(C)) * phases >= the SM count), else 64.
// tools/perfmodel/cuda_sass.py (dgrad_mma_rows) prices the same rule.
int64_t dgrad_mma_rows(int64_t rows, int64_t C, int64_t phases) {
  return ceil_div(rows, MmaDgradTall::BM) * ceil_div(C, mma_cols(C)) * phases >= sm_count()
             ? MmaDgradTall::BM
             : MmaDgradSmall::BM;
}

// Its tile columns: on sm_90 and newer, 128 (MmaDgradWide) for C > 64 where those tiles fill
// every SM at least once (cdiv(rows, 128) * cdiv(C, 128) * phases >= the SM count: then the rows
// are 128 too), else mma_cols(C). On sm_80 the tall tile already keeps the tensor cores busy
// (its K chunk issues within the chunk's MMA time there) and the wide tile's fewer, larger
// blocks only change how the last wave falls, worse as often as better; on sm_90 the tall
// tile is bound by issue (benchmarks/GPU_MODEL.md). tools/perfmodel/cuda_sass.py
// (dgrad_mma_cols) prices the same rule.
int64_t dgrad_mma_cols(int64_t rows, int64_t C, int64_t phases) {
  constexpr int64_t R = MmaDgradWide::BM, W = MmaDgradWide::BN;
  return sm_major() >= 9 && C > MmaDgradTall::BN &&
                 ceil_div(rows, R) * ceil_div(C, W) * phases >= sm_count()
             ? W
             : mma_cols(C);
}
static_assert(MmaDgradWide::BM == MmaDgradTall::BM && MmaDgradWide::BK == MmaDgradTall::BK &&
                  MmaDgradWide::PASSES == MmaDgradTall::PASSES,
              "the wide tile is the tall tile's rows, K chunk and partials' rows, twice as wide");

// The most taps that feed one stride phase of the data gradient (a phase's K chunks run over
// its taps only: 2 x 2 or 3 x 3 kernels at their own stride feed every phase one).
int64_t dgrad_phase_taps(const ConvGeom& g, int64_t H, int64_t W) {
  int64_t most = 0;
  for (int32_t pa = 0; pa < std::min<int64_t>(g.sh, H); ++pa) {
    for (int32_t pb = 0; pb < std::min<int64_t>(g.sw, W); ++pb) {
      int64_t rows = 0, cols = 0;
      for (int32_t i = 0; i < g.kh; ++i) rows += mod_pos(pa + g.ph - i * g.dh, g.sh) == 0;
      for (int32_t j = 0; j < g.kw; ++j) cols += mod_pos(pb + g.pw - j * g.dw, g.sw) == 0;
      most = std::max(most, rows * cols);
    }
  }
  return most;
}

// Taps a K chunk of the mma.sync data gradient covers: on sm_90 and newer, 2 (MmaDgradPaired:
// 32-deep chunks of two taps' 16 output channels) where its tile is 16 columns and 16 deep (C
// and Co at most 16) and some stride phase has more than one tap (`phase_taps`:
// dgrad_phase_taps), else 1. On sm_80 the one-tap kernel there is bound by DRAM, not issue, by
// the model, and ptxas gives the paired one more registers (fewer resident blocks).
// tools/perfmodel/cuda_sass.py (dgrad_mma_taps) prices the same rule.
int64_t dgrad_mma_taps(int64_t C, int64_t Co, int64_t phase_taps) {
#if !defined(__CUDACC__)
  if (host_dgrad_taps() == 1) return 1;  // the host copy's test knob
#endif
  return sm_major() >= 9 && mma_cols(C) == 16 && mma_depth(C, Co) == 16 && phase_taps > 1 ? 2
                                                                                         : 1;
}

// The data gradient's tiling for one call: which kernel (mma: dgrad_mma_kernel), its tile rows
// and columns, the row tiles of the largest stride phase (the grid's x), and the partials' rows
// per tile (their columns are C's whatever the tile's width).
struct DgradTiles {
  bool mma;
  int64_t rows, cols, depth, row_tiles, parts_per_tile;
  int64_t taps = 1;  // taps a K chunk covers (2: MmaDgradPaired)
};

// The weight as the mma.sync data gradient reads it: C contiguous in 16-byte pieces, element
// (tap, co, c) at tap * rows.tap + co * rows.co + c, on a 16-byte boundary. A channels-last
// weight ((Co, C, kh, kw), C fastest: KRSC, what a channels-last model holds, and every
// contiguous 1x1 weight) is read in place: tap stride C, co stride kh*kw*C. Any other is
// packed as row-major (kh*kw*Co, C), row (i*kw + j)*Co + co: one copy launch per call.
struct DgradWeight {
  at::Tensor w;
  WeightRows rows;
};

inline DgradWeight dgrad_weight(const at::Tensor& weight) {
  const int64_t Co = weight.size(0), C = weight.size(1), taps = weight.size(2) * weight.size(3);
  const auto aligned = [](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  };
  if (weight.is_contiguous(at::MemoryFormat::ChannelsLast) && aligned(weight)) {
    return {weight, WeightRows{C, taps * C}};
  }
  at::Tensor wp = weight.permute({2, 3, 0, 1}).reshape({taps * Co, C}).contiguous();
  // A contiguous permuted view comes back as itself, possibly off the 16-byte boundary.
  if (!aligned(wp)) wp = wp.clone();
  return {wp, WeightRows{Co * C, C}};
}

template <typename X, typename W>
void launch_dgrad(const at::Tensor& go, const at::Tensor& x, const at::Tensor& weight,
                  const AffineInputs& bn, const at::Tensor& mean, const at::Tensor& invstd,
                  at::Tensor* gx, at::Tensor* part_dz, at::Tensor* part_dzx,
                  const at::Tensor* m1, const at::Tensor* m2, const at::Tensor* bscale,
                  at::Tensor* act, int write, const ConvGeom& g, int64_t phases,
                  const DgradTiles& dt) {
  using T = typename TilesFor<W>::Fwd;
  using A = acc_t<X>;
  // The grid: the largest phase's row tiles x the column tiles x the phases. The partials have
  // one layout for every kernel and tile (a row per 64 pixels of a row tile, C columns).
  const auto grid = [&](int64_t cols) {
    return dim3(static_cast<unsigned>(dt.row_tiles),
                static_cast<unsigned>(ceil_div(x.size(1), cols)), static_cast<unsigned>(phases));
  };
  const at::Tensor& out = gx != nullptr ? *gx : x;
  // The epilogue writes a at x's offsets.
  TORCH_CHECK(act == nullptr || (act->scalar_type() == x.scalar_type() &&
                                 act->sizes() == x.sizes() && act->strides() == x.strides()),
              "launch_dgrad: the activation's buffer must have x's dtype, sizes and strides");
  if constexpr (is_16bit<W> && std::is_same_v<X, W>) {
    if (dt.mma) {
      const DgradWeight wd = dgrad_weight(weight);
      const auto run = [&](auto tile) {
        using TM = decltype(tile);
        TORCH_CHECK(dt.rows == TM::BM && dt.cols == TM::BN && dt.depth == TM::BK &&
                        dt.taps == TM::TAPS && dt.parts_per_tile == TM::PASSES,
                    "launch_dgrad: the tile plan does not match the kernel");
        if constexpr (TM::DYNAMIC) {
          const cudaError_t e =
              allow_dynamic_smem<dgrad_mma_kernel<W, TM>>(TM::DYNAMIC_SMEM, x.device().index());
          TORCH_CHECK(e == cudaSuccess, "launch_dgrad: the wide tile's ", TM::DYNAMIC_SMEM,
                      " bytes of dynamic shared memory were refused (cudaFuncSetAttribute)");
        }
        FUSEDRES_LAUNCH(grid(TM::BN), dim3(TM::THREADS), TM::DYNAMIC_SMEM, current_stream(),
                        dgrad_mma_kernel<W, TM>)(
          go.const_data_ptr<W>(), wd.w.const_data_ptr<W>(), wd.rows, x.const_data_ptr<X>(),
          data_or_null<A>(bn.w), data_or_null<A>(bn.b), mean.const_data_ptr<A>(),
          invstd.const_data_ptr<A>(), gx != nullptr ? gx->data_ptr<X>() : nullptr,
          part_dz != nullptr ? part_dz->data_ptr<A>() : nullptr,
          part_dzx != nullptr ? part_dzx->data_ptr<A>() : nullptr,
          m1 != nullptr ? m1->const_data_ptr<A>() : nullptr,
          m2 != nullptr ? m2->const_data_ptr<A>() : nullptr,
          bscale != nullptr ? bscale->const_data_ptr<A>() : nullptr,
          act != nullptr ? act->data_ptr<X>() : nullptr, dims_of(go), dims_of(x), dims_of(out), g,
          write);
        FUSEDRES_CHECK_LAUNCH();
      };
      if (dt.cols == MmaDgradWide::BN) {
        run(MmaDgradWide{});
      } else if (dt.taps == 2) {
        TORCH_CHECK(go.size(1) <= MmaDgradPaired<64>::KT,
                    "launch_dgrad: paired taps take at most 16 output channels");
        dt.rows == MmaDgradTall::BM ? run(MmaDgradPaired<MmaDgradTall::BM>{})
                                    : run(MmaDgradPaired<MmaDgradSmall::BM>{});
      } else {
        with_mma_tile<MmaDgradThin, MmaDgradTall, MmaDgradSmall>("launch_dgrad", dt.rows, dt.cols,
                                                                 dt.depth, run);
      }
      return;
    }
  }
  TORCH_CHECK(dt.rows == T::BM && dt.cols == T::BN && dt.depth == T::BK && dt.parts_per_tile == 1,
              "launch_dgrad: the tile plan does not match the WMMA / FMA kernel");
  FUSEDRES_LAUNCH(grid(T::BN), dim3(T::THREADS), 0, current_stream(), dgrad_kernel<X, W, T>)(
      go.const_data_ptr<W>(), weight.const_data_ptr<W>(), x.const_data_ptr<X>(),
      data_or_null<A>(bn.w), data_or_null<A>(bn.b), mean.const_data_ptr<A>(),
      invstd.const_data_ptr<A>(), gx != nullptr ? gx->data_ptr<X>() : nullptr,
      part_dz != nullptr ? part_dz->data_ptr<A>() : nullptr,
      part_dzx != nullptr ? part_dzx->data_ptr<A>() : nullptr,
      m1 != nullptr ? m1->const_data_ptr<A>() : nullptr,
      m2 != nullptr ? m2->const_data_ptr<A>() : nullptr,
      bscale != nullptr ? bscale->const_data_ptr<A>() : nullptr,
      act != nullptr ? act->data_ptr<X>() : nullptr, dims_of(go), dims_of(weight), dims_of(x),
      dims_of(out), g, write);
  FUSEDRES_CHECK_LAUNCH();
}

// dw_parts, gw: the CUTLASS weight gradient's partials and the weight's gradient (x's dtype)
// they are summed into by the same launch, or none.
template <typename X>
void launch_dx(at::Tensor& gx, const at::Tensor& x, const AffineInputs& bn,
               const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& m1,
               const at::Tensor& m2, const at::Tensor* dw_parts = nullptr,
               at::Tensor* gw = nullptr) {
  using A = acc_t<X>;
  constexpr int threads = 256;
  static_assert(PartialsSum<partials_t<X>, X>::kThreads == threads,
                "the dx launch's blocks are the partials sum's: every warp of a block has slices");
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>(ceil_div(x.numel(), threads), 8 * sm_count()));
  PartialsSum<partials_t<X>, X> dw{};
  if (dw_parts != nullptr) {
    TORCH_CHECK(is_16bit<X>, "launch_dx: the dx launch sums 16-bit weight gradients only");
    dw = partials_sum<X>(*dw_parts, *gw);
  }
  const int64_t dw_blocks = dw.n > 0 ? partials_sum_blocks(dw) : 0;
  FUSEDRES_LAUNCH(dim3(static_cast<unsigned>(blocks + dw_blocks)), dim3(threads), 0,
                  current_stream(), dx_kernel<X>)(
      gx.data_ptr<X>(), x.const_data_ptr<X>(),
      data_or_null<A>(bn.w), mean.const_data_ptr<A>(), invstd.const_data_ptr<A>(),
      m1.const_data_ptr<A>(), m2.const_data_ptr<A>(), dims_of(x), dims_of(gx), blocks, dw);
  FUSEDRES_CHECK_LAUNCH();
}

}  // namespace
}  // namespace fusedres::FUSEDRES_CUDA_NS
