// The layer-test ops (layer_tests.cpp), for the ThreadSanitizer driver.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace fusedres::cuda_host::layer_test {
at::Tensor block_sum(const at::Tensor& x, bool barrier);
at::Tensor warp_sum(const at::Tensor& x, int64_t mask, int64_t lanes, int64_t first_offset);
at::Tensor warp_ops();
std::tuple<at::Tensor, at::Tensor> atomics(const at::Tensor& x, int64_t threads);
at::Tensor reverse_blocks(const at::Tensor& x, int64_t threads);
at::Tensor wmma_matmul(const at::Tensor& a, const at::Tensor& b, bool tf32);
}  // namespace fusedres::cuda_host::layer_test

// mma.cuh and the layer's rules (tests/mma_kernels.cu).
namespace fusedres::cuda_host::mma_test {
at::Tensor gemm_tile(const at::Tensor& a, const at::Tensor& b, int64_t variant);
}  // namespace fusedres::cuda_host::mma_test
