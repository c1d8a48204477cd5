// The one header every kernel in csrc/cuda includes.
//
// Under nvcc it brings the CUDA runtime, fp16/bf16 and WMMA headers; compiled by the host C++
// compiler it brings the CPU execution layer (on_cpu/runtime.h) that provides the same names, so
// a kernel body is the same text in both builds (no #ifdef in kernels). The two builds live in
// different namespaces (FUSEDRES_CUDA_NS: fusedres::cuda, fusedres::cuda_on_cpu), register their
// ops for different dispatch keys (CUDA, CPU) of the fusedres_cuda library, and link into
// different extensions: fusedres._C (the product) and fusedres._C_cuda_on_cpu (the test
// extension, on_cpu/module.cpp).
//
// A kernel file looks like:
//   #include "common.cuh"
//   namespace fusedres::FUSEDRES_CUDA_NS {
//   template <typename scalar_t> __global__ void my_kernel(const scalar_t* x, int64_t n) {...}
//   at::Tensor my_op(const at::Tensor& x) {
//     checks::check_x("fusedres_cuda.my_op", x, kDeviceType);  // every argument (../checks.h)
//     DeviceGuard guard(x);
//     FUSEDRES_DISPATCH_FLOATING(x.scalar_type(), "my_op", [&] {
//       FUSEDRES_LAUNCH(grid, block, smem_bytes, current_stream(), my_kernel<scalar_t>)(
//           x.const_data_ptr<scalar_t>(), x.numel());
//       FUSEDRES_CHECK_LAUNCH();
//     });
//   }
//   }  // namespace fusedres::FUSEDRES_CUDA_NS
//   FUSEDRES_CUDA_LIBRARY_IMPL(m) { m.impl("my_op", &fusedres::FUSEDRES_CUDA_NS::my_op); }
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

// conv_out_size, suggests_channels_last, out_memory_format: the rules csrc/cpu shares; the ops'
// argument checks (checks.h), csrc/cpu's too.
#include "../checks.h"
#include "../common.h"

#if defined(__CUDACC__)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>
#else
// Last: its keyword and built-in macros (threadIdx, __shared__, ...) stay out of ATen's headers.
#include "on_cpu/runtime.h"
#endif

// mma.sync, ldmatrix, cp.async (fusedres::ptx): inline PTX under nvcc, emulated by on_cpu/.
#include "mma.cuh"

#if defined(__CUDACC__)

#define FUSEDRES_CUDA_NS cuda
#define FUSEDRES_CUDA_KEY CUDA
// kernel<<<grid, block, smem, stream>>>(args...); the kernel last, so that template arguments
// with commas need no parentheses: FUSEDRES_LAUNCH(g, b, 0, s, k<float, 128>)(args...).
#define FUSEDRES_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
// After every launch: a launch error becomes a c10::Error here, not at the next sync.
#define FUSEDRES_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()
// FUSEDRES_LAUNCH_BOUNDS (mma.cuh under nvcc: nothing, the GPU's launch enforces
// __launch_bounds__; on_cpu/runtime.h on the CPU: the layer's check).

// The block's dynamic shared memory (the launch's `smem` bytes), 128-byte aligned. One extern
// array for every kernel and type, as nvcc requires.
template <typename T>
__device__ __forceinline__ T* fusedres_dynamic_shared() {
  extern __shared__ __align__(128) unsigned char fusedres_smem[];
  return reinterpret_cast<T*>(fusedres_smem);
}

#else

#define FUSEDRES_CUDA_NS cuda_on_cpu
#define FUSEDRES_CUDA_KEY CPU
// The host layer throws c10::Error from the launch itself.
#define FUSEDRES_CHECK_LAUNCH() ((void)0)

#endif

// The kernel file's registrations for fusedres_cuda (schemas: fusedres/ops/opdefs.py), for CUDA or
// CPU; one per kernel file and key. nvcc's copy registers as fusedres._C loads
// (TORCH_LIBRARY_IMPL), and fusedres.ops._extension defines the schemas after that import. The host
// copy, in the test extension fusedres._C_cuda_on_cpu that is imported after the schemas exist,
// registers from its PyInit inside a try block (on_cpu/module.cpp): a C++ signature that differs
// from its schema becomes an ImportError there, where a static registration would abort the
// process inside the loader.
// FUSEDRES_CUDA_LIBRARY_IMPL_AT(KEY, m) registers for another key: FUSEDRES_CUDA_AUTOGRAD_KEY,
// the autograd key of this copy's device (AutogradCUDA, AutogradCPU), where the eager routes'
// autograd nodes go (eager.cu). A key of the copy's own device, not the Autograd alias: with
// both extensions loaded (a GPU machine running the host copy's tests) each copy's nodes take
// its own device's tensors, and neither registration overrides the other.
#if defined(__CUDACC__)
#define FUSEDRES_CUDA_AUTOGRAD_KEY AutogradCUDA
#define FUSEDRES_CUDA_LIBRARY_IMPL_AT(KEY, m) TORCH_LIBRARY_IMPL(fusedres_cuda, KEY, m)
#else
#define FUSEDRES_CUDA_AUTOGRAD_KEY AutogradCPU
#include "on_cpu/registrations.h"
#define FUSEDRES_CUDA_LIBRARY_IMPL_AT(KEY, m)                                          \
  static void C10_CONCATENATE(fusedres_register_, __LINE__)(torch::Library&);          \
  [[maybe_unused]] static const bool C10_CONCATENATE(fusedres_registered_, __LINE__) = \
      fusedres_on_cpu::add_registration(c10::DispatchKey::KEY,                          \
                                      &C10_CONCATENATE(fusedres_register_, __LINE__)); \
  static void C10_CONCATENATE(fusedres_register_, __LINE__)(torch::Library & m)
#endif
#define FUSEDRES_CUDA_LIBRARY_IMPL(m) FUSEDRES_CUDA_LIBRARY_IMPL_AT(FUSEDRES_CUDA_KEY, m)

// float, double, half, bfloat16 (scalar_t = float, double, at::Half, at::BFloat16).
#define FUSEDRES_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

namespace fusedres::FUSEDRES_CUDA_NS {

#if !defined(__CUDACC__)
// The host copy's test knobs, one instance across its files (set by tests/test_cuda_kernels.py
// through fusedres_cuda_testing.set_sm_count / set_sm_major / set_wgrad_split, and by the
// sanitizer drivers): the SM count and compute capability the tile and split rules size for (an
// H100's 132 and 9, so that the host copy runs the GPU's decomposition), the data gradient's
// taps a K chunk held to one (set_dgrad_taps: the paired tile against the one-tap one), and a
// forced split of the weight gradient's reduction (0: the rule).
// Namespace-scope variables, not function-local statics: the sanitizer build's __shared__ is
// `static`, and the layer fills every function-local static of this namespace with 0xff before
// each block (on_cpu/runtime.h), which had set both knobs to -1 after the first launch there.
inline int64_t host_sm_count_value = 132;
inline int64_t host_sm_major_value = 9;  // the H100's compute capability, 9.0
inline int64_t host_wgrad_split_value = 0;
inline int64_t host_dgrad_taps_value = 0;  // 0: the rule; 1: one tap a K chunk
inline int64_t& host_sm_count() { return host_sm_count_value; }
inline int64_t& host_sm_major() { return host_sm_major_value; }
inline int64_t& host_dgrad_taps() { return host_dgrad_taps_value; }
inline int64_t& host_wgrad_split() { return host_wgrad_split_value; }
#endif

// The device type this copy of the kernels runs on.
#if defined(__CUDACC__)
constexpr c10::DeviceType kDeviceType = c10::DeviceType::CUDA;
using DeviceGuard = c10::cuda::CUDAGuard;
inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream(); }
#else
constexpr c10::DeviceType kDeviceType = c10::DeviceType::CPU;
// No devices to switch between on the host; the same call sites compile.
struct DeviceGuard {
  explicit DeviceGuard(const at::Device&) {}
};
inline cudaStream_t current_stream() { return nullptr; }
#endif

// Arithmetic type for storage type T: float for half, bfloat16 and float; double for double.
template <typename T>
using acc_t = at::opmath_type<T>;

// The CUDA native type of a storage type, for WMMA fragments: __half, __nv_bfloat16, float,
// double (on the host __half is c10::Half, so the mapping is the identity there).
template <typename T>
struct native {
  using type = T;
};
template <>
struct native<at::Half> {
  using type = __half;
};
template <>
struct native<at::BFloat16> {
  using type = __nv_bfloat16;
};
template <typename T>
using native_t = typename native<T>::type;

// ----------------------------------------------------------------------------- indexing

// Offsets are int64: N*C*H*W may pass 2^31. These keep the widening explicit.
__device__ __forceinline__ int64_t global_thread_x() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride_x() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Blocks of `threads` that cover n items, capped at CUDA's grid.x limit (loops stride past it).
inline unsigned blocks_for(int64_t n, int64_t threads, int64_t cap = 2147483647) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, cap)));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Lets `Kernel` take `bytes` of dynamic shared memory past the default 48 KiB on `device`
// (cudaFuncSetAttribute): once per device and kernel, as CUDA keeps the attribute, not on every
// launch's host path (`bytes`: the kernel's one size, which a later call does not change).
// Keyed on the kernel itself (each instantiation is a function of its own); a device past the
// 64 tracked, or the CPU layer's -1, asks every time. Namespace-scope flags: the CPU layer's
// sanitizer builds poison function-local statics. The native wide data-gradient tile and the
// CUTLASS kernels (cutlass_conv/common.cuh) call it.
template <auto Kernel>
inline std::atomic<bool> dynamic_smem_allowed[64];

template <auto Kernel>
cudaError_t allow_dynamic_smem(int bytes, int64_t device) {
  const bool tracked = device >= 0 && device < 64;
  if (tracked && dynamic_smem_allowed<Kernel>[device].load(std::memory_order_relaxed)) {
    return cudaSuccess;
  }
  const cudaError_t e =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && tracked) {
    dynamic_smem_allowed<Kernel>[device].store(true, std::memory_order_relaxed);
  }
  return e;
}

// ----------------------------------------------------------------------------- statistics

// The per-channel column reductions (batch_stats's NHWC partials, genstats_merge, bn_sums) share
// one block shape: 32 consecutive channels (threadIdx.x: coalesced reads of a row) x 8 row lanes
// (threadIdx.y), lane ty taking rows ty, ty + 8, ... in order; the lanes are then combined in
// lane order through shared memory (no atomics: the same bits every run).
constexpr int kColumnCols = 32, kColumnLanes = 8;

// Adds each thread's N values over the block's row lanes, in lane order: on return every thread
// holds its column's totals in v. `lanes` is the caller's shared buffer; barriers before and
// after, so a block may call it again with the same buffer.
template <int N>
__device__ __forceinline__ void column_lanes_sum(double (&lanes)[N][kColumnLanes][kColumnCols],
                                                 double (&v)[N]) {
  __syncthreads();
  for (int k = 0; k < N; ++k) lanes[k][threadIdx.y][threadIdx.x] = v[k];
  __syncthreads();
  for (int k = 0; k < N; ++k) {
    double s = lanes[k][0][threadIdx.x];
    for (int i = 1; i < kColumnLanes; ++i) s += lanes[k][i][threadIdx.x];
    v[k] = s;
  }
  __syncthreads();
}

// Count, mean and M2 (sum of squared deviations) of a set of values; Welford updates one value,
// Chan's formula merges two sets. Non-finite values leave a non-finite mean and a nan M2.
template <typename A>
struct Moments {
  A n, mean, m2;

  // The reciprocal is an IEEE round-to-nearest intrinsic: a true division calls a subroutine
  // whose calling convention spilled registers in the NHWC statistics kernel on sm_90.
  // An infinite mean stays infinite as a sum would (inf + finite = inf, inf - inf = NaN): the
  // update mean + d / n would compute inf - inf for any later finite value and give NaN where
  // PyTorch's mean is inf. No math-library call: x - x is 0 only for finite x.
  __device__ __forceinline__ static bool is_inf(A x) { return x == x && !(x - x == A(0)); }

  __device__ __forceinline__ void add(A v) {
    n += A(1);
    const A d = v - mean;
    const bool inf_mean = is_inf(mean);
    mean = inf_mean ? (v - v == A(0) ? mean : mean + v) : mean + d * reciprocal(n);
    m2 += d * (v - mean);
  }
  __device__ __forceinline__ static float reciprocal(float v) { return __frcp_rn(v); }
  __device__ __forceinline__ static double reciprocal(double v) { return __drcp_rn(v); }

  __device__ __forceinline__ void merge(A nb, A mean_b, A m2_b) {
    if (nb == A(0)) return;
    if (n == A(0)) {
      n = nb;
      mean = mean_b;
      m2 = m2_b;
      return;
    }
    const A total = n + nb;
    const A w = nb / total;
    const A delta = mean_b - mean;
    mean = is_inf(mean) || is_inf(mean_b) ? mean + mean_b : mean + delta * w;
    m2 += m2_b + delta * delta * n * w;
    n = total;
  }

  // Merged over the 32 lanes of a full warp; every lane ends with the total.
  __device__ __forceinline__ void warp_merge() {
    for (int offset = 16; offset > 0; offset /= 2) {
      const A nb = __shfl_xor_sync(0xffffffffu, n, offset);
      const A mb = __shfl_xor_sync(0xffffffffu, mean, offset);
      const A qb = __shfl_xor_sync(0xffffffffu, m2, offset);
      merge(nb, mb, qb);
    }
  }
};

// ----------------------------------------------------------------------------- rounding

// One IEEE operation rounded to nearest even, never contracted into an FMA with a neighbouring
// multiply or add (nvcc contracts a * b + c by default, rounding once): what one ATen
// elementwise op computes, for kernels that must reproduce a sequence of them bit for bit.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// ----------------------------------------------------------------------------- BatchNorm affine

// One channel's scale = bn_weight * invstd (invstd without a weight) and shift = bn_bias -
// mean * scale (-mean * scale without a bias), each operation rounded as the ATen op that
// computed it before (mul_rn, sub_rn: nvcc would contract the multiply and the subtraction into
// one FMA); w, b: the channel's weight and bias, or none. bn_affine_kernel (conv_tiles.cuh)
// writes these for the native forward and weight gradient; the data gradient and dx pass compute
// them where they read them, and each block of the CUTLASS forward for itself (block_affine16).
template <typename A>
struct ChannelAffine {
  A scale, shift;
};

template <typename A>
__device__ __forceinline__ ChannelAffine<A> channel_affine(const A* w, const A* b, A mean,
                                                           A invstd) {
  const A s = w != nullptr ? mul_rn(*w, invstd) : invstd;
  return {s, b != nullptr ? sub_rn(*b, mul_rn(mean, s)) : mul_rn(-mean, s)};
}

// The BatchNorm vectors as a kernel argument: weight and bias (or none), mean and invstd of C
// channels, each at its own stride (the ops take views).
template <typename A>
struct BnVectors {
  const A* w;
  int64_t ws;
  const A* b;
  int64_t bs;
  const A* mean;
  int64_t ms;
  const A* invstd;
  int64_t is;
  int64_t C;

  __device__ __forceinline__ ChannelAffine<A> at(int64_t c) const {
    return channel_affine(w != nullptr ? w + c * ws : nullptr, b != nullptr ? b + c * bs : nullptr,
                          mean[c * ms], invstd[c * is]);
  }
};

// The op's vectors (checked by the op: C values each, of the statistics dtype A).
template <typename A>
inline BnVectors<A> bn_vectors(const std::optional<at::Tensor>& bn_weight,
                               const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean,
                               const at::Tensor& invstd) {
  const bool w = present(bn_weight), b = present(bn_bias);
  return {w ? bn_weight->const_data_ptr<A>() : nullptr, w ? bn_weight->stride(0) : 0,
          b ? bn_bias->const_data_ptr<A>() : nullptr,   b ? bn_bias->stride(0) : 0,
          mean.const_data_ptr<A>(),                      mean.stride(0),
          invstd.const_data_ptr<A>(),                    invstd.stride(0),
          mean.numel()};
}

// Every channel's affine rounded to the 16-bit H (to nearest even, as Tensor.to), by one
// block's threads (1-D): scale to out[0, C), shift to out[C, 2C). The CUTLASS forward's
// scale-bias iterator reads 16-bit vectors from global memory; each of its blocks writes its
// own copy before its main loop (cutlass_conv/fprop.cu's Fprop::run) where a launch wrote one
// copy for all: a launch fewer a step, a few bytes a channel more for each block.
template <typename A, typename H>
__device__ __forceinline__ void block_affine16(const BnVectors<A>& v, H* __restrict__ out) {
#pragma unroll 1  // a few trips (C / threads): no trip-count division, no unrolled copies
  for (int64_t c = threadIdx.x; c < v.C; c += blockDim.x) {
    const ChannelAffine<A> f = v.at(c);
    out[c] = static_cast<H>(f.scale);
    out[v.C + c] = static_cast<H>(f.shift);
  }
}

}  // namespace fusedres::FUSEDRES_CUDA_NS
