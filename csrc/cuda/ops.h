// The op functions of the kernel files in csrc/cuda, for C++ callers of one copy (the
// ThreadSanitizer driver calls the host copy, fusedres::cuda_on_cpu). Include after common.cuh.
// Each kernel file adds its op here; the ops are registered in that file.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

namespace fusedres::FUSEDRES_CUDA_NS {

// batch_stats.cu: per-channel (mean, biased var) of x over (N, H, W), float32 (float64 for
// float64 x).
std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x);
// batch_stats.cu: nn.BatchNorm2d's statistics and running-statistics update, (mean, invstd) in
// the statistics dtype (the schema of fusedres_cpu::prepare_batch_norm).
std::tuple<at::Tensor, at::Tensor> prepare_batch_norm(
    const at::Tensor& x, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& num_batches_tracked, bool training,
    std::optional<double> momentum, double eps, const std::optional<at::Tensor>& mean,
    const std::optional<at::Tensor>& var);

// bn_relu_conv2d.cu: the fused unit's forward, y = conv2d(relu(scale * x + shift), weight) +
// bias + residual (scale, shift from bn_weight, bn_bias, mean, invstd); with branch_scale (N,),
// y = residual + branch_scale[n] * (conv + bias) (stochastic depth), and the backward's conv
// branch sees branch_scale[n] * grad_out[n]; genstats also returns
// y's per-channel (mean, biased var) in the statistics dtype. batch_stats (whether mean and
// invstd are this batch's) is in the schema for the backward's sake; the forward ignores it.
// Every signature here is the schema of fusedres/ops/opdefs.py (SCHEMAS): the dispatcher rejects a
// registration that differs (fusedres.ops._extension reports it).
at::Tensor bn_relu_conv2d(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& bn_weight,
                          const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean,
                          const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
                          c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
                          c10::SymIntArrayRef dilation, bool batch_stats,
                          const std::optional<at::Tensor>& branch_scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_relu_conv2d_genstats(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
    c10::SymIntArrayRef stride, c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
    bool batch_stats, const std::optional<at::Tensor>& branch_scale);

// bn_relu_conv2d_backward.cu: (grad_x, grad_weight, grad_bias, grad_bn_weight, grad_bn_bias);
// an output whose output_mask entry is false is empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_relu_conv2d_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool batch_stats,
    std::array<bool, 5> output_mask, const std::optional<at::Tensor>& branch_scale);

}  // namespace fusedres::FUSEDRES_CUDA_NS
