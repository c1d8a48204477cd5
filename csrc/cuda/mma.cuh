// Tensor-core and asynchronous-copy primitives of sm_80+: mma.sync m16n8k16 (float16 / bfloat16
// operands, float32 accumulators), ldmatrix (x1, x2, x4, with and without .trans) and cp.async
// (16-byte .cg, 4/8/16-byte .ca, the zero-fill src-size form, commit_group, wait_group).
//
// One header for both compilers. Under nvcc each call is one inline PTX instruction (syntax and
// layouts of the PTX ISA 8.7, NVIDIA, 2025: "Matrix Fragments for mma.m16n8k16 with floating
// point type", "Warp-level matrix load instruction: ldmatrix", "cp.async",
// "cp.async.commit_group", "cp.async.wait_group"; ptxas turns them into HMMA.16816.F32[.BF16],
// LDSM.16.M88[T].{1,2,4}, LDGSTS[.BYPASS][.ZFILL], LDGDEPBAR and DEPBAR on sm_80 and sm_90,
// which tests/test_cuda_mma.py checks in the SASS). Compiled by the host compiler the calls go to the CPU execution layer
// (on_cpu/mma.cpp), which emulates them per lane with the fragment layouts the ISA documents, so
// a kernel that assumes another layout computes a wrong answer on the CPU as it would on a GPU:
//
//   mma.m16n8k16 (groupID g = lane / 4, threadID_in_group t = lane % 4):
//     A (16 x 16, row): a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//                       a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//     B (16 x 8, col):  b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//     C, D (16 x 8):    c[0], c[1] = C[g][2t, 2t+1]   c[2], c[3] = C[g+8][2t, 2t+1]
//   (the lower 16 bits of a register hold the element with the smaller index).
//   ldmatrix .m8n8 .b16: lanes 8i..8i+7 give the addresses of the 8 rows (16 bytes each, 16-byte
//     aligned, in shared memory) of matrix i; lane l receives in r[i] the elements
//     (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of matrix i, or with .trans the elements
//     (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
//
// The emulation enforces what the hardware requires or leaves undefined: mma.sync and ldmatrix
// are .aligned warp collectives (all 32 lanes, the same instruction; a lane that has exited or
// waits elsewhere is an error); ldmatrix rows must be 16-byte aligned shared memory; cp.async
// needs a shared destination and source and destination aligned to the copy size (4, 8, 16;
// .cg only 16), src-size <= cp-size; and its data is not visible before the cp.async.wait_group
// that covers its group: until then the destination holds 0xff bytes (NaN), so a missing wait
// gives a wrong answer here. A thread that returns with copies no wait completed is an error.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
// The host layer checks __launch_bounds__ at this statement (on_cpu/runtime.h); a GPU's launch
// enforces the attribute itself.
#ifndef FUSEDRES_LAUNCH_BOUNDS
#define FUSEDRES_LAUNCH_BOUNDS(...) ((void)0)
#endif
#else
#include "on_cpu/runtime.h"
#endif

namespace fusedres::ptx {

// Two 16-bit values in one 32-bit register: lo in bits 0-15 (the smaller index), hi above.
template <typename T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi) {
  static_assert(sizeof(T) == 2, "pack2 packs 16-bit values");
  uint16_t l, h;
  memcpy(&l, &lo, 2);
  memcpy(&h, &hi, 2);
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

#if defined(__CUDACC__)

// ----------------------------------------------------------------------------- nvcc: PTX

// d = a * b + c on one m16n8k16 tile; T = __half or __nv_bfloat16 (the operands' type).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2], const float (&c)[4]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "mma_m16n8k16: float16 or bfloat16 operands");
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// NUM (1, 2, 4) 8x8 matrices of 16-bit elements; `row` is this lane's row address.
template <int NUM, bool TRANS = false>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[NUM], const void* row) {
  static_assert(NUM == 1 || NUM == 2 || NUM == 4, "ldmatrix loads 1, 2 or 4 matrices");
  const uint32_t addr = smem_address(row);
  if constexpr (NUM == 1 && !TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(addr));
  } else if constexpr (NUM == 1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(addr));
  } else if constexpr (NUM == 2 && !TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
  } else if constexpr (NUM == 2) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
  } else if constexpr (!TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  }
}

// 16 bytes global -> shared, cached in L2 only; the bytes past src_bytes (0..16) are zeros.
__device__ __forceinline__ void cp_async_cg16(void* smem, const void* gmem, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}

// BYTES (4, 8, 16) global -> shared through L1; the bytes past src_bytes are zeros.
template <int BYTES>
__device__ __forceinline__ void cp_async_ca(void* smem, const void* gmem, int src_bytes = BYTES) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async.ca copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "n"(BYTES), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#else

// ----------------------------------------------------------------------------- host: emulated

template <typename T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                         const float (&c)[4]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "mma_m16n8k16: float16 or bfloat16 operands");
  fusedres_on_cpu::mma_m16n8k16(std::is_same_v<T, __nv_bfloat16>, d, a, b, c);
}

template <int NUM, bool TRANS = false>
inline void ldmatrix(uint32_t (&r)[NUM], const void* row) {
  static_assert(NUM == 1 || NUM == 2 || NUM == 4, "ldmatrix loads 1, 2 or 4 matrices");
  fusedres_on_cpu::ldmatrix(NUM, TRANS, r, row);
}

inline void cp_async_cg16(void* smem, const void* gmem, int src_bytes = 16) {
  fusedres_on_cpu::cp_async("cp.async.cg", smem, gmem, 16, src_bytes);
}

template <int BYTES>
inline void cp_async_ca(void* smem, const void* gmem, int src_bytes = BYTES) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async.ca copies 4, 8 or 16 bytes");
  fusedres_on_cpu::cp_async("cp.async.ca", smem, gmem, BYTES, src_bytes);
}

inline void cp_async_commit() { fusedres_on_cpu::cp_async_commit(); }

template <int N>
inline void cp_async_wait() {
  static_assert(N >= 0, "cp.async.wait_group N >= 0");
  fusedres_on_cpu::cp_async_wait(N);
}

#endif

}  // namespace fusedres::ptx
