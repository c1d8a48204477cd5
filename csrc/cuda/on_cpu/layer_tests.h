// The layer-test ops (layer_tests.cpp), for the ThreadSanitizer driver.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace fusedres::cuda_on_cpu::layer_test {
at::Tensor block_sum(const at::Tensor& x, bool barrier);
at::Tensor warp_sum(const at::Tensor& x, int64_t mask, int64_t lanes, int64_t first_offset);
at::Tensor warp_ops();
std::tuple<at::Tensor, at::Tensor> atomics(const at::Tensor& x, int64_t threads);
at::Tensor reverse_blocks(const at::Tensor& x, int64_t threads);
at::Tensor wmma_matmul(const at::Tensor& a, const at::Tensor& b, bool tf32);
}  // namespace fusedres::cuda_on_cpu::layer_test

// mma.cuh and the layer's rules (tests/mma_kernels.cu).
namespace fusedres::cuda_on_cpu::mma_test {
at::Tensor gemm_tile(const at::Tensor& a, const at::Tensor& b, int64_t variant);
at::Tensor ldmatrix_probe(const at::Tensor& table, int64_t num, bool trans, int64_t offset,
                          bool from_global);
at::Tensor cp_async_probe(const at::Tensor& src, int64_t bytes, bool cg, int64_t src_offset,
                          int64_t dst_offset, int64_t src_size, bool wait);
at::Tensor unwritten_shared(int64_t blocks, bool planted);
at::Tensor bounded(int64_t threads);
at::Tensor dynamic_smem(int64_t bytes, bool opt_in);
at::Tensor divergent_collective(int64_t mode);
}  // namespace fusedres::cuda_on_cpu::mma_test
