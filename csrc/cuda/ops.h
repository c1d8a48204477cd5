// The op functions of the kernel files in csrc/cuda, for C++ callers of one copy (the
// ThreadSanitizer driver calls the host copy, fusedres::cuda_host). Include after common.cuh.
// Each kernel file adds its op here; the ops are registered in that file.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace fusedres::FUSEDRES_CUDA_NS {

// batch_stats.cu: per-channel (mean, biased var) of x over (N, H, W), float32 (float64 for
// float64 x).
std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x);

}  // namespace fusedres::FUSEDRES_CUDA_NS
