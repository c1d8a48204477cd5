// Kernels that test ../../mma.cuh and the layer's strictness (tests/test_cuda_mma.py, the
// sanitizer drivers): a GEMM tile on mma.sync + ldmatrix + two-stage cp.async, each with a
// planted-bug variant, and probes of the rules the layer enforces. They only need mma.cuh, so
// nvcc compiles this file alone for sm_80 and sm_90 in seconds (the test of that compile).
#include "../../mma.cuh"

#ifndef FUSEDRES_CUDA_NS
#define FUSEDRES_CUDA_NS cuda
#endif

namespace fusedres::FUSEDRES_CUDA_NS::mma_test {

namespace ptx = fusedres::ptx;

// GEMM tile variants: the right kernel, and two bugs a rewrite can make.
enum GemmVariant : int {
  kGemmRight = 0,
  kGemmWrongLayout = 1,  // assumes a[1] = A[g][2t+8..] and a[2] = A[g+8][2t..] (swapped)
  kGemmMissingWait = 2,  // consumes the first stage before cp.async.wait_group
};

constexpr int kPad = 8;  // halves of padding per shared row: rows stay 16-byte aligned

// One warp: c (16 x 16, float) = a (16 x 32, row-major) * b (32 x 16, row-major). Two stages of
// 16 along K, each staged by cp.async (one 16-byte chunk per lane per operand), A fragments by
// ldmatrix.x4, B fragments by ldmatrix.x4.trans (both n8 tiles), two mma.m16n8k16 per stage.
template <typename T>
__global__ void __launch_bounds__(32) gemm_tile_kernel(const T* a, const T* b, float* c,
                                                       int variant) {
  FUSEDRES_LAUNCH_BOUNDS(32);
  __shared__ __align__(16) T As[2][16][16 + kPad];
  __shared__ __align__(16) T Bs[2][16][16 + kPad];
  const int lane = threadIdx.x;
  for (int s = 0; s < 2; ++s) {
    // Lane l copies row l / 2, halves 8 (l % 2) .. + 7 of the stage's A and B slices.
    const int r = lane / 2, h = 8 * (lane % 2);
    ptx::cp_async_cg16(&As[s][r][h], a + r * 32 + 16 * s + h);
    ptx::cp_async_ca<16>(&Bs[s][r][h], b + (16 * s + r) * 16 + h);
    ptx::cp_async_commit();
  }
  float acc[2][4] = {};
  for (int s = 0; s < 2; ++s) {
    if (s == 0 && variant != kGemmMissingWait) ptx::cp_async_wait<1>();
    if (s == 1) ptx::cp_async_wait<0>();
    __syncwarp();
    uint32_t fa[4], fb[4];
    // A: matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
    const int m = lane / 8, row = lane % 8;
    ptx::ldmatrix<4>(fa, &As[s][row + 8 * (m % 2)][8 * (m / 2)]);
    // B (k x n, row-major): matrices (k 0-7, n 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
    ptx::ldmatrix<4, true>(fb, &Bs[s][row + 8 * (m % 2)][8 * (m / 2)]);
    if (variant == kGemmWrongLayout) {
      const uint32_t t = fa[1];
      fa[1] = fa[2];
      fa[2] = t;
    }
    for (int j = 0; j < 2; ++j) {
      const uint32_t frag_b[2] = {fb[2 * j], fb[2 * j + 1]};
      float d[4];
      ptx::mma_m16n8k16<T>(d, fa, frag_b, acc[j]);
      for (int i = 0; i < 4; ++i) acc[j][i] = d[i];
    }
    __syncwarp();
  }
  if (variant == kGemmMissingWait) ptx::cp_async_wait<0>();
  const int g = lane / 4, t = lane % 4;
  for (int j = 0; j < 2; ++j) {
    for (int i = 0; i < 4; ++i) {
      c[(g + 8 * (i / 2)) * 16 + 8 * j + 2 * t + (i % 2)] = acc[j][i];
    }
  }
}

// One warp: ldmatrix.x<NUM>(.trans) of a 32 x 24 table of 16-bit indices (value r * 24 + c, in
// shared memory, or from the global table when `from_global`), lane l giving the row
// address of row l, shifted by `offset` halves. out[lane][i] = register i.
template <int NUM, bool TRANS>
__global__ void __launch_bounds__(32) ldmatrix_kernel(const uint16_t* table, uint32_t* out,
                                                      int offset, bool from_global) {
  FUSEDRES_LAUNCH_BOUNDS(32);
  __shared__ __align__(16) uint16_t s[32][24];
  const int lane = threadIdx.x;
  for (int c = 0; c < 24; ++c) s[lane][c] = table[lane * 24 + c];
  __syncwarp();
  uint32_t r[NUM];
  const uint16_t* row = from_global ? table + lane * 24 + offset : &s[lane][offset];
  ptx::ldmatrix<NUM, TRANS>(r, row);
  for (int i = 0; i < NUM; ++i) out[lane * 4 + i] = r[i];
}

// One thread: a cp.async of `bytes` (4, 8, 16; `cg` for .cg) from src + src_offset bytes to a
// shared buffer + dst_offset bytes, src-size `src_size`; committed, then waited for only if
// `wait`. out (16 bytes) = the destination as the thread reads it next; then a wait, so that the
// thread never returns with a copy in flight.
template <int BYTES>
__global__ void cp_async_kernel(const unsigned char* src, unsigned char* out, bool cg,
                                int src_offset, int dst_offset, int src_size, bool wait) {
  __shared__ __align__(16) unsigned char s[64];
  for (int i = 0; i < 64; ++i) s[i] = 0;
  if (cg) {
    ptx::cp_async_cg16(s + dst_offset, src + src_offset, src_size);
  } else {
    ptx::cp_async_ca<BYTES>(s + dst_offset, src + src_offset, src_size);
  }
  ptx::cp_async_commit();
  if (wait) ptx::cp_async_wait<0>();
  for (int i = 0; i < 16; ++i) out[i] = s[dst_offset + i];
  ptx::cp_async_wait<0>();
}

// Each block: threads store their index into shared memory only in block 0 (when `planted`; in
// every block otherwise), then every block reads it back: out[block][thread].
__global__ void __launch_bounds__(32) unwritten_shared_kernel(float* out, bool planted) {
  FUSEDRES_LAUNCH_BOUNDS(32);
  __shared__ float s[32];
  if (!planted || blockIdx.x == 0) s[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[blockIdx.x * 32 + threadIdx.x] = s[31 - threadIdx.x];
}

// Declared for at most 64 threads per block: out[i] = i.
__global__ void __launch_bounds__(64) bounded_kernel(int* out) {
  FUSEDRES_LAUNCH_BOUNDS(64);
  out[threadIdx.x] = threadIdx.x;
}

// Uses its whole dynamic shared memory (`bytes`): the last thread writes and reads its end.
template <int TAG>
__global__ void dynamic_smem_kernel(float* out, int bytes) {
#if defined(__CUDACC__)
  extern __shared__ __align__(16) float mma_test_dynamic_smem[];
  float* s = mma_test_dynamic_smem;
#else
  float* s = fusedres_dynamic_shared<float>();
#endif
  const int n = bytes / 4;
  s[n - 1 - threadIdx.x] = 1.0f + threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = s[n - 1 - threadIdx.x];
}

// Collectives that do not meet: mode 1, lanes 16-31 load 2 matrices while lanes 0-15 load 4;
// mode 2, lane 31 returns before the warp's mma.sync.
__global__ void __launch_bounds__(32) divergent_collective_kernel(float* out, int mode) {
  FUSEDRES_LAUNCH_BOUNDS(32);
  __shared__ __align__(16) uint16_t s[32][8];
  const int lane = threadIdx.x;
  for (int c = 0; c < 8; ++c) s[lane][c] = 0;
  __syncwarp();
  if (mode == 1) {
    uint32_t r4[4], r2[2];
    if (lane < 16) {
      ptx::ldmatrix<4>(r4, &s[lane][0]);
    } else {
      ptx::ldmatrix<2>(r2, &s[lane][0]);
    }
  } else {
    if (lane == 31) return;
    const uint32_t fa[4] = {0, 0, 0, 0}, fb[2] = {0, 0};
    const float fc[4] = {0, 0, 0, 0};
    float d[4];
    ptx::mma_m16n8k16<__half>(d, fa, fb, fc);
    out[lane] = d[0];
  }
}

}  // namespace fusedres::FUSEDRES_CUDA_NS::mma_test

#if defined(__CUDACC__)
// The instantiations the host tests launch, so that nvcc's compile of this file alone puts every
// primitive's PTX through ptxas.
namespace fusedres::FUSEDRES_CUDA_NS::mma_test {
template __global__ void gemm_tile_kernel<__half>(const __half*, const __half*, float*, int);
template __global__ void gemm_tile_kernel<__nv_bfloat16>(const __nv_bfloat16*,
                                                         const __nv_bfloat16*, float*, int);
template __global__ void ldmatrix_kernel<1, false>(const uint16_t*, uint32_t*, int, bool);
template __global__ void ldmatrix_kernel<1, true>(const uint16_t*, uint32_t*, int, bool);
template __global__ void ldmatrix_kernel<2, false>(const uint16_t*, uint32_t*, int, bool);
template __global__ void ldmatrix_kernel<2, true>(const uint16_t*, uint32_t*, int, bool);
template __global__ void ldmatrix_kernel<4, false>(const uint16_t*, uint32_t*, int, bool);
template __global__ void ldmatrix_kernel<4, true>(const uint16_t*, uint32_t*, int, bool);
template __global__ void cp_async_kernel<4>(const unsigned char*, unsigned char*, bool, int, int,
                                            int, bool);
template __global__ void cp_async_kernel<8>(const unsigned char*, unsigned char*, bool, int, int,
                                            int, bool);
template __global__ void cp_async_kernel<16>(const unsigned char*, unsigned char*, bool, int, int,
                                             int, bool);
template __global__ void dynamic_smem_kernel<0>(float*, int);
}  // namespace fusedres::FUSEDRES_CUDA_NS::mma_test
#endif
