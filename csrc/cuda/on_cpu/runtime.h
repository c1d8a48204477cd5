// The CPU execution layer: the CUDA constructs the kernels in csrc/cuda use, for the host C++
// compiler, so that the same kernel source runs on CPU tensors (tests, CI) and on a GPU (nvcc).
//
// Model. A grid is a list of blocks; a block's CUDA threads run as
//   - fibres (default): one ucontext per CUDA thread, all on the OS thread that runs the block;
//     a barrier switches to the next fibre. Blocks run in parallel over at::parallel_for.
//   - OS threads (FUSEDRES_HOST_THREADS, the ThreadSanitizer build): one std::thread per CUDA
//     thread, barriers on a mutex + condition variable; blocks run one after the other.
// `__shared__` is per-block storage: `static thread_local` with fibres (every fibre of a block
// is on one OS thread, and that OS thread runs one block at a time), `static` with OS threads
// (blocks are serial). The layer finds every such variable in the module's symbol table (the
// function-local statics of namespace fusedres::cuda_on_cpu: template instantiations included) and
// fills them with 0xff bytes before every block, as it does the dynamic shared memory (a
// per-block buffer, fusedres_dynamic_shared): a kernel that reads shared memory it did not write
// in this block reads NaN / -1, never the previous block's values. `__launch_bounds__` is checked by
// FUSEDRES_LAUNCH_BOUNDS in the kernel body (a launch with more threads fails), dynamic shared
// memory above 48 KiB needs cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes) as on
// a GPU, and never passes the 163 KiB of an sm_80 block (the stricter of the two targets).
// mma.sync, ldmatrix and cp.async (../mma.cuh) are emulated per lane in the PTX ISA's layouts.
// Warp shuffles and votes meet in a per-warp exchange keyed by the lane mask: a lane outside
// its own mask, a mask naming lanes that have exited or do not exist, or lanes that disagree
// on the mask (a deadlock) raise an error (on a GPU: undefined behaviour); reading a lane
// outside the mask gives all bits set (NaN, -1), as CUDA leaves that value undefined. Atomics
// are std::atomic_ref. The WMMA fragment API is emulated whole-tile (on_cpu/wmma.h).
//
// Errors inside a kernel (layer checks, __trap) end the block; the launch then throws a
// c10::Error naming the kernel, as a checked launch on a GPU would.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include <tuple>
#include <type_traits>
#include <utility>

// ----------------------------------------------------------------------------- keywords

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
// Checked in the kernel body instead (FUSEDRES_LAUNCH_BOUNDS): a prefix cannot carry the value.
#define __launch_bounds__(...)
#define __constant__ static const
// Static __shared__ variables: found in the symbol table and poisoned before each block
// (runtime.cpp, static_shared); a kernel may declare no other function-local static.
#if defined(FUSEDRES_HOST_THREADS)
#define __shared__ static
#else
#define __shared__ static thread_local
#endif

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

// Streams do not exist on the host: every launch is synchronous.
struct fusedres_on_cpu_stream;
using cudaStream_t = fusedres_on_cpu_stream*;

constexpr int warpSize = 32;

namespace fusedres_on_cpu {

struct Block;

// A cp.async copy issued and not yet complete: the source bytes (read at issue), performed at
// the cp.async.wait_group that covers its group.
struct AsyncCopy {
  void* dst;
  unsigned char data[16];
  unsigned bytes;     // cp-size: 4, 8 or 16
  unsigned group;     // commit groups before it (the group it will belong to)
};

// One CUDA thread.
struct Thread {
  uint3 idx;
  unsigned linear;  // x + y * bx + z * bx * by
  unsigned lane, warp;
  Block* block;
  std::vector<AsyncCopy> async;  // issued cp.async copies, oldest first
  unsigned committed = 0;        // cp.async.commit_group executed so far
};

// The block being run (blockIdx, blockDim, gridDim of its grid).
struct BlockInfo {
  uint3 idx;
  dim3 dim, grid;
  void* dynamic_smem;
  size_t dynamic_smem_bytes;
};

// Set for each CUDA thread while it runs (updated at every fibre switch).
extern thread_local Thread* tls_thread;
BlockInfo& block_info(const Thread& t);

inline Thread& self() { return *tls_thread; }

// Layer errors: end the block, reported by the launch.
[[noreturn]] void device_error(const std::string& what);

// Barriers and the warp exchange (runtime.cpp).
void syncthreads();
int syncthreads_count(int pred);
int syncthreads_or(int pred);
int syncthreads_and(int pred);
// Collective of the lanes in `mask`: each lane contributes `size` bytes (at most 16) and `pred`;
// a lane with src >= 0 receives the bytes of lane `src`; `ballot` receives the mask of lanes
// whose pred was true. `op` names the intrinsic in errors.
void warp_exchange(const char* op, unsigned mask, const void* value, size_t size, int src,
                   void* out, bool pred, unsigned* ballot);
unsigned active_mask();
// A warp-wide collective of the `.aligned` kind (mma.sync, ldmatrix): every lane of the warp
// takes part with the same `op` (a lane that has exited, or lanes at different aligned
// collectives, is an error); each contributes `size` bytes (at most 48) and receives the 32
// lanes' contributions in all[lane * size].
void warp_aligned(const char* op, const void* value, size_t size, void* all);
// Whether [p, p + bytes) lies in the running block's shared memory (static or dynamic).
bool in_shared(const void* p, size_t bytes);
// The bound of __launch_bounds__(bound), checked against the block's threads.
void check_launch_bounds(const char* kernel, long bound);

// mma.sync, ldmatrix and cp.async per the PTX ISA (on_cpu/mma.cpp; the interface is ../mma.cuh).
void mma_m16n8k16(bool bf16, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                  const float (&c)[4]);
void ldmatrix(int num, bool trans, uint32_t* r, const void* row);
void cp_async(const char* op, void* dst, const void* src, unsigned cp_size, int src_size);
void cp_async_commit();
void cp_async_wait(unsigned n);

// ----------------------------------------------------------------------------- launch

// Launches run_grid has checked since the process started, and whether it then runs them
// (false: a stub, for measuring the host's own work around the kernels). Test hooks:
// fusedres_cuda_layer_test::launches and ::stub_launches (layer_tests.cpp).
std::atomic<int64_t>& launch_count();
std::atomic<bool>& launch_stub();

// Runs `body(thread)` for every thread of every block, unless launch_stub(); throws c10::Error
// on a layer error.
// `fn` identifies the kernel for its cudaFuncSetAttribute settings.
void run_grid(const char* kernel, const void* fn, dim3 grid, dim3 block, size_t smem,
              void (*body)(void* ctx), void* ctx);
// cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes).
bool set_max_dynamic_smem(const void* fn, long bytes);

// The per-block shared-memory limits the layer enforces (CUDA C Programming Guide, compute
// capabilities 8.0 and 9.0): 48 KiB without opt-in; with it 163 KiB on sm_80 (227 KiB on sm_90;
// the kernels are built for both, so the smaller holds).
constexpr size_t kDefaultSmem = 48 * 1024;
constexpr size_t kMaxSmemOptIn = 163 * 1024;

template <typename... P>
struct Launch {
  void (*fn)(P...);
  const char* name;
  dim3 grid, block;
  size_t smem;

  template <typename... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "FUSEDRES_LAUNCH: wrong number of arguments");
    // Kernel parameters are copied, as a launch copies them to the device.
    struct Ctx {
      void (*fn)(P...);
      std::tuple<std::decay_t<P>...> args;
    } ctx{fn, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
    run_grid(name, reinterpret_cast<const void*>(fn), grid, block, smem, [](void* c) {
      auto* ctx = static_cast<Ctx*>(c);
      std::apply(ctx->fn, ctx->args);
    }, &ctx);
  }
};

template <typename... P>
Launch<P...> launch(void (*fn)(P...), const char* name, dim3 grid, dim3 block, size_t smem,
                    cudaStream_t /*stream*/) {
  return Launch<P...>{fn, name, grid, block, smem};
}

}  // namespace fusedres_on_cpu

// kernel<<<grid, block, smem, stream>>>(args...) on a GPU; the grid on the CPU here. The kernel
// comes last so that template arguments with commas need no parentheses.
#define FUSEDRES_LAUNCH(grid, block, smem, stream, ...) \
  ::fusedres_on_cpu::launch(__VA_ARGS__, #__VA_ARGS__, grid, block, smem, stream)

// ----------------------------------------------------------------------------- built-ins

#define threadIdx (::fusedres_on_cpu::self().idx)
#define blockIdx (::fusedres_on_cpu::block_info(::fusedres_on_cpu::self()).idx)
#define blockDim (::fusedres_on_cpu::block_info(::fusedres_on_cpu::self()).dim)
#define gridDim (::fusedres_on_cpu::block_info(::fusedres_on_cpu::self()).grid)

inline void __syncthreads() { fusedres_on_cpu::syncthreads(); }
inline int __syncthreads_count(int p) { return fusedres_on_cpu::syncthreads_count(p); }
inline int __syncthreads_or(int p) { return fusedres_on_cpu::syncthreads_or(p); }
inline int __syncthreads_and(int p) { return fusedres_on_cpu::syncthreads_and(p); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  fusedres_on_cpu::warp_exchange("__syncwarp", mask, nullptr, 0, -1, nullptr, false, nullptr);
}
inline unsigned __activemask() { return fusedres_on_cpu::active_mask(); }
// __launch_bounds__(N) on the host: the first statement of a bounded kernel,
//   __global__ void __launch_bounds__(256) k(...) { FUSEDRES_LAUNCH_BOUNDS(256); ... }
// (nothing under nvcc, whose launch enforces the attribute itself).
#define FUSEDRES_LAUNCH_BOUNDS(...) \
  ::fusedres_on_cpu::check_launch_bounds(__func__, fusedres_on_cpu_first_arg(__VA_ARGS__))
constexpr long fusedres_on_cpu_first_arg(long bound, long = 0, long = 0) { return bound; }

// cudaFuncSetAttribute: the one attribute the layer models (the dynamic shared-memory opt-in).
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};
template <typename F>
cudaError_t cudaFuncSetAttribute(F* fn, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  return fusedres_on_cpu::set_max_dynamic_smem(reinterpret_cast<const void*>(fn), value)
             ? cudaSuccess
             : cudaErrorInvalidValue;
}
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "invalid argument";
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
[[noreturn]] inline void __trap() { fusedres_on_cpu::device_error("__trap() called"); }

namespace fusedres_on_cpu {
template <typename T>
T shfl(const char* op, unsigned mask, T var, int src) {
  static_assert(sizeof(T) <= 16 && std::is_trivially_copyable_v<T>,
                "warp shuffles move trivially copyable values of at most 16 bytes");
  T out;
  warp_exchange(op, mask, &var, sizeof(T), src, &out, false, nullptr);
  return out;
}
// Source lane of a shuffle within segments of `width` lanes (CUDA's rules: shfl_up/down that
// leave the segment return the lane's own value).
inline int segment_base(int width) { return static_cast<int>(self().lane) & ~(width - 1); }
}  // namespace fusedres_on_cpu

template <typename T>
T __shfl_sync(unsigned mask, T var, int src, int width = warpSize) {
  const int base = fusedres_on_cpu::segment_base(width);
  return fusedres_on_cpu::shfl("__shfl_sync", mask, var, base + (src & (width - 1)));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  const int lane = static_cast<int>(fusedres_on_cpu::self().lane);
  const int base = fusedres_on_cpu::segment_base(width);
  const int src = lane + static_cast<int>(delta);
  return fusedres_on_cpu::shfl("__shfl_down_sync", mask, var, src < base + width ? src : lane);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  const int lane = static_cast<int>(fusedres_on_cpu::self().lane);
  const int base = fusedres_on_cpu::segment_base(width);
  const int src = lane - static_cast<int>(delta);
  return fusedres_on_cpu::shfl("__shfl_up_sync", mask, var, src >= base ? src : lane);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  const int lane = static_cast<int>(fusedres_on_cpu::self().lane);
  const int base = fusedres_on_cpu::segment_base(width);
  const int src = lane ^ lane_mask;
  return fusedres_on_cpu::shfl("__shfl_xor_sync", mask, var, src < base + width ? src : lane);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  unsigned out = 0;
  fusedres_on_cpu::warp_exchange("__ballot_sync", mask, nullptr, 0, -1, nullptr, pred != 0, &out);
  return out;
}
inline int __any_sync(unsigned mask, int pred) {
  unsigned out = 0;
  fusedres_on_cpu::warp_exchange("__any_sync", mask, nullptr, 0, -1, nullptr, pred != 0, &out);
  return out != 0;
}
inline int __all_sync(unsigned mask, int pred) {
  unsigned out = 0;
  fusedres_on_cpu::warp_exchange("__all_sync", mask, nullptr, 0, -1, nullptr, pred != 0, &out);
  return out == mask;
}

// ----------------------------------------------------------------------------- atomics

template <typename T>
T atomicAdd(T* address, T val) {
  return std::atomic_ref<T>(*address).fetch_add(val);
}
template <typename T>
T atomicSub(T* address, T val) {
  return std::atomic_ref<T>(*address).fetch_sub(val);
}
template <typename T>
T atomicExch(T* address, T val) {
  return std::atomic_ref<T>(*address).exchange(val);
}
template <typename T>
T atomicCAS(T* address, T compare, T val) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, val);
  return compare;  // the old value either way
}
template <typename T>
T atomicMax(T* address, T val) {
  std::atomic_ref<T> a(*address);
  T old = a.load();
  while (old < val && !a.compare_exchange_weak(old, val)) {
  }
  return old;
}
template <typename T>
T atomicMin(T* address, T val) {
  std::atomic_ref<T> a(*address);
  T old = a.load();
  while (val < old && !a.compare_exchange_weak(old, val)) {
  }
  return old;
}
template <typename T>
T atomicOr(T* address, T val) {
  return std::atomic_ref<T>(*address).fetch_or(val);
}
template <typename T>
T atomicAnd(T* address, T val) {
  return std::atomic_ref<T>(*address).fetch_and(val);
}

// ----------------------------------------------------------------------------- maths

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
// rsqrt as ATen's CPU kernel computes torch.rsqrt: 1 / sqrt, each correctly rounded (CUDA's
// rsqrtf is an approximation: the host copy matches the CPU tensors' ATen, not a GPU's bits).
// float stays float: rsqrt(double) on a float would round once where 1.0f / sqrtf rounds twice.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline double __drcp_rn(double x) { return 1.0 / x; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
// Separately rounded IEEE operations, which nvcc never contracts into an FMA with a
// neighbouring multiply or add. The host compiler would (-ffp-contract=fast with FMA
// instructions, -march=native): the operands and the result pass through volatile, so that
// nothing outside the call can fuse with the operation inside it.
#define FUSEDRES_HOST_RN(name, T, op)          \
  inline T name(T a, T b) {                     \
    const volatile T va = a, vb = b;            \
    const volatile T r = va op vb;              \
    return r;                                   \
  }
FUSEDRES_HOST_RN(__fadd_rn, float, +)
FUSEDRES_HOST_RN(__fsub_rn, float, -)
FUSEDRES_HOST_RN(__fmul_rn, float, *)
FUSEDRES_HOST_RN(__fdiv_rn, float, /)
FUSEDRES_HOST_RN(__dadd_rn, double, +)
FUSEDRES_HOST_RN(__dsub_rn, double, -)
FUSEDRES_HOST_RN(__dmul_rn, double, *)
FUSEDRES_HOST_RN(__ddiv_rn, double, /)
#undef FUSEDRES_HOST_RN
inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
inline int __float_as_int(float v) { return std::bit_cast<int>(v); }
inline unsigned __float_as_uint(float v) { return std::bit_cast<unsigned>(v); }
inline float __uint_as_float(unsigned v) { return std::bit_cast<float>(v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(static_cast<unsigned>(v)); }

// ----------------------------------------------------------------------------- half types

// c10's types stand in for cuda_fp16.h / cuda_bf16.h (the same bits, round-to-nearest-even).
using __half = c10::Half;
using __nv_bfloat16 = c10::BFloat16;
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return static_cast<float>(h); }

// ----------------------------------------------------------------------------- shared memory

// The block's dynamic shared memory (the launch's `smem` bytes, 128-byte aligned).
template <typename T>
inline T* fusedres_dynamic_shared() {
  return static_cast<T*>(fusedres_on_cpu::block_info(fusedres_on_cpu::self()).dynamic_smem);
}

#include "wmma.h"
