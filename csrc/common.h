// Rules shared by every C++ copy of the fused unit (csrc/cpu, csrc/cuda compiled by nvcc and by
// the host compiler): the C++ side of fusedres/ops/opdefs.py's conv_out_size and out_memory_format.
// Host-only code, plain C++ (nvcc compiles it as host code of the .cu files).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace fusedres {

// One spatial dimension of a convolution's output (nn.Conv2d's formula).
inline int64_t conv_out_size(int64_t size, int64_t k, int64_t s, int64_t p, int64_t d) {
  return (size + 2 * p - d * (k - 1) - 1) / s + 1;
}

// A tensor "suggests" channels_last when it is channels_last-dense and not also plain-contiguous
// (size-1 dimensions make both hold): the test conv2d uses for its output's layout.
inline bool suggests_channels_last(const at::Tensor& t) {
  return t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast) && !t.is_contiguous();
}

// Layout of the fused op's output: channels_last when x or the weight suggests it. The fake
// kernels use opdefs.out_memory_format, so the two must agree (opcheck compares the strides).
inline at::MemoryFormat out_memory_format(const at::Tensor& x, const at::Tensor& weight) {
  return suggests_channels_last(x) || suggests_channels_last(weight)
             ? at::MemoryFormat::ChannelsLast
             : at::MemoryFormat::Contiguous;
}

}  // namespace fusedres
