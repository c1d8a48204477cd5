// Kernels that test the CPU execution layer itself (tests/test_cuda_on_cpu.py, the TSan driver):
// the constructs it emulates, and the mistakes it must catch (a missing barrier, a wrong lane
// mask). Written like any kernel in csrc/cuda (they also compile with nvcc), but registered for
// the host copy only, as the fusedres_cuda_layer_test ops (csrc/cuda/on_cpu/layer_tests.cpp).
#include "../../common.cuh"

namespace fusedres::FUSEDRES_CUDA_NS::layer_test {

constexpr int kBlock = 64;

// Tree sum of 64 values in shared memory. barrier = false drops the __syncthreads: a data race
// between a thread's read of s[i + stride] and the write of the thread that owns it.
__global__ void block_sum_kernel(const float* x, float* out, bool barrier) {
  __shared__ float s[kBlock];
  s[threadIdx.x] = x[threadIdx.x];
  if (barrier) __syncthreads();
  for (int stride = kBlock / 2; stride > 0; stride /= 2) {
    if (static_cast<int>(threadIdx.x) < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    if (barrier) __syncthreads();
  }
  if (threadIdx.x == 0) *out = s[0];
}

// Lanes below `lanes` sum their values with __shfl_down_sync(mask, ., first_offset ... 1); the
// others return at once. out[lane] = the lane's partial sum.
__global__ void warp_sum_kernel(const float* x, float* out, unsigned mask, int lanes,
                                int first_offset) {
  if (static_cast<int>(threadIdx.x) >= lanes) return;
  float v = x[threadIdx.x];
  for (int offset = first_offset; offset > 0; offset /= 2) {
    v += __shfl_down_sync(mask, v, offset);
  }
  out[threadIdx.x] = v;
}

// One warp: every shuffle and vote, 8 results per lane (tests compute the expected values).
__global__ void warp_ops_kernel(int* out) {
  const int l = threadIdx.x;
  const unsigned full = 0xffffffffu;
  int* o = out + l * 8;
  o[0] = __shfl_sync(full, l * 10, (l + 3) % 32);
  o[1] = __shfl_xor_sync(full, l, 5);
  o[2] = __shfl_up_sync(full, l, 3);
  o[3] = __shfl_down_sync(full, l, 3, 8);
  o[4] = static_cast<int>(__ballot_sync(full, l % 3 == 0));
  o[5] = __any_sync(full, l == 7);
  o[6] = __all_sync(full, l < 31);
  o[7] = __syncthreads_count(l % 2) + 100 * __syncthreads_and(l >= 0) +
         1000 * __syncthreads_or(l == 40);
}

// Every thread of every block adds its value to *sum and takes the max of its index.
__global__ void atomics_kernel(const float* x, int64_t n, float* sum, int* max_index) {
  const int64_t i = global_thread_x();
  if (i < n) {
    atomicAdd(sum, x[i]);
    atomicMax(max_index, static_cast<int>(i));
  }
}

// Each block reverses its blockDim.x values through dynamic shared memory.
__global__ void reverse_kernel(const float* x, float* out) {
  float* s = fusedres_dynamic_shared<float>();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x;
  s[threadIdx.x] = x[base + threadIdx.x];
  __syncthreads();
  out[base + threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

// One warp: c = a (M x K, row-major) * b (K x N, row-major) with WMMA fragments, through shared
// memory, as the convolution kernels use them.
template <typename T, typename Frag, int M, int N, int K, typename Acc>
__global__ void wmma_kernel(const T* a, const T* b, Acc* c) {
  namespace wmma = nvcuda::wmma;
  __shared__ __align__(32) T sa[M * K];
  __shared__ __align__(32) T sb[K * N];
  __shared__ __align__(32) Acc sc[M * N];
  for (int i = threadIdx.x; i < M * K; i += 32) sa[i] = a[i];
  for (int i = threadIdx.x; i < K * N; i += 32) sb[i] = b[i];
  __syncwarp();
  wmma::fragment<wmma::matrix_a, M, N, K, Frag, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, M, N, K, Frag, wmma::row_major> fb;
  wmma::fragment<wmma::accumulator, M, N, K, Acc> fc;
  wmma::fill_fragment(fc, Acc(0));
  wmma::load_matrix_sync(fa, sa, K);
  wmma::load_matrix_sync(fb, sb, N);
  wmma::mma_sync(fc, fa, fb, fc);
  wmma::store_matrix_sync(sc, fc, N, wmma::mem_row_major);
  __syncwarp();
  for (int i = threadIdx.x; i < M * N; i += 32) c[i] = sc[i];
}

}  // namespace fusedres::FUSEDRES_CUDA_NS::layer_test
