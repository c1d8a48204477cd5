// The ops' argument contract, one checker for every C++ copy of the ops (csrc/cpu, csrc/cuda
// compiled by nvcc and by the host compiler): the C++ side of fusedres/ops/checks.py's op checks
// (check_op_args), which the Python namespaces (fusedres::, fusedres_triton::) run. Every op
// calls one entry point below first, before it reads or writes anything:
//   check_unit_args      bn_relu_conv2d, _genstats, eager_unit (and eager_unit_with_shortcut)
//   check_backward_args  bn_relu_conv2d_backward (and _backward_add)
//   check_pair_args      bn_relu_conv2d_pair, eager_pair; _pair_backward adds its gradients
//   check_prepare_args   prepare_batch_norm
//   check_stats_input    batch_stats
//   check_module_args    module_unit
// and a backward's output_mask, check_output_mask.
// Each error names the op and the argument and says what was expected:
// "<namespace>.<op>: <argument>: expected ..., got ...".
//
// Why every argument, in every op: the kernels index with what they are given. A per-channel
// vector shorter than C is read past its end (a (1,) bn_weight once gave 2.4e27), a stride of 0
// divides by zero (SIGFPE in conv_out_size), a one-element geometry list is read at index 1, an
// int64 mean is converted to float without a word, padding -1 or dilation 0 index outside x.
// Host-only code, plain C++ (nvcc compiles it as host code of the .cu files).
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/List.h>
#include <ATen/OpMathType.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>

#include "common.h"

namespace fusedres {

// An optional tensor argument that was given (not None, not an undefined tensor).
inline bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// float16, bfloat16, float32, float64: the dtypes the ops take (fusedres.ops.checks._FLOAT).
inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

inline bool is_16bit_float(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// The dtype of the BatchNorm statistics and parameters for x of dtype t (opdefs.stats_dtype).
inline at::ScalarType stats_dtype(at::ScalarType t) { return at::toOpMathType(t); }

namespace checks {

using OptTensor = std::optional<at::Tensor>;

// The kernels index a padded row or column (H + 2 * padding) and a dilated kernel's extent
// (dilation * (k - 1) + 1) in 32-bit integers (csrc/cuda's ConvGeom, kernels/): each, and every
// geometry value, is below 2^31. The same bound keeps conv_out_size's int64 arithmetic exact.
constexpr int64_t kIndexLimit = int64_t(1) << 31;

// x: a 4-D (N, C, H, W) tensor of a float dtype on the device type the kernels run on.
inline void check_x(const char* op, const at::Tensor& x, c10::DeviceType device_type,
                    const char* name = "x") {
  TORCH_CHECK_VALUE(x.defined(), op, ": ", name, ": expected a tensor, got an undefined one");
  TORCH_CHECK_VALUE(x.dim() == 4, op, ": ", name, ": expected a 4-D (N, C, H, W) tensor, got shape ",
              x.sizes());
  TORCH_CHECK_VALUE(x.device().type() == device_type, op, ": ", name, ": expected a ",
              c10::DeviceTypeName(device_type), " tensor, got device ", x.device());
  TORCH_CHECK_TYPE(is_float_dtype(x.scalar_type()), op, ": ", name,
              ": expected float16, bfloat16, float32 or float64, got ", x.scalar_type());
}

// Required tensor arguments given: the dispatcher passes None for a Tensor as an undefined
// tensor, which an autograd node reads (its device) before the kernel's checks run.
inline void check_defined(const char* op,
                          std::initializer_list<std::pair<const char*, const at::Tensor*>> args) {
  for (const auto& [name, t] : args) {
    TORCH_CHECK_VALUE(t->defined(), op, ": ", name, ": expected a tensor, got None");
  }
}

inline void check_device(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& x) {
  TORCH_CHECK_VALUE(t.device() == x.device(), op, ": ", name, ": expected device ", x.device(),
              " (the device of x), got ", t.device());
}

// A 1-D (n,) tensor on x's device; of dtype `dtype`, or of any float dtype when `dtype` is
// Undefined. `what` says what the n values are.
inline void check_vector(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& x, int64_t n, const char* what,
                         at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, ": expected a tensor, got an undefined one");
  check_device(op, name, t, x);
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, op, ": ", name, ": expected shape (", n, ",) (",
              what, "), got ", t.sizes());
  if (dtype == at::ScalarType::Undefined) {
    TORCH_CHECK_TYPE(is_float_dtype(t.scalar_type()), op, ": ", name,
                ": expected a floating-point tensor, got ", t.scalar_type());
  } else {
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, ": expected dtype ", dtype, ", got ",
                t.scalar_type());
  }
}

// A per-channel vector of x in the statistics dtype (mean, invstd, bn_weight, bn_bias).
inline void check_channel_vector(const char* op, const char* name, const at::Tensor& t,
                                 const at::Tensor& x) {
  check_vector(op, name, t, x, x.size(1), "one value per channel of x",
               stats_dtype(x.scalar_type()));
}

// A tensor of exactly `shape` on x's device; of dtype `dtype`, or any float dtype (Undefined).
inline void check_shaped(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& x, at::IntArrayRef shape, const char* what,
                         at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, ": expected a tensor, got an undefined one");
  check_device(op, name, t, x);
  TORCH_CHECK_VALUE(t.sizes() == shape, op, ": ", name, ": expected shape ", shape, " (", what,
              "), got ", t.sizes());
  if (dtype == at::ScalarType::Undefined) {
    TORCH_CHECK_TYPE(is_float_dtype(t.scalar_type()), op, ": ", name,
                ": expected a floating-point tensor, got ", t.scalar_type());
  } else {
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, ": expected dtype ", dtype, ", got ",
                t.scalar_type());
  }
}

// A geometry list (stride, padding, dilation): two values (the schema's SymInt[2]; the
// dispatcher passes a list of any length), each at least `minimum` and below 2^31.
inline std::array<int64_t, 2> check_pair(const char* op, const char* name,
                                         c10::SymIntArrayRef list, int64_t minimum) {
  TORCH_CHECK_VALUE(list.size() == 2, op, ": ", name, ": expected a list of 2 ints, got ",
              list.size(), " values");
  std::array<int64_t, 2> v{};
  for (size_t i = 0; i < 2; ++i) {
    const auto value = list[i].maybe_as_int();
    TORCH_CHECK_VALUE(value.has_value(), op, ": ", name, ": expected concrete ints, got ", list[i]);
    v[i] = *value;
  }
  TORCH_CHECK_VALUE(v[0] >= minimum && v[1] >= minimum && v[0] < kIndexLimit && v[1] < kIndexLimit, op,
              ": ", name, ": expected values in [", minimum, ", 2^31), got [", v[0], ", ", v[1],
              "]");
  return v;
}

// A convolution's checked geometry and output shape.
struct Conv {
  std::array<int64_t, 2> stride, padding, dilation;
  std::array<int64_t, 4> out;  // (N, Co, Ho, Wo)
};

// The weight's dtype against x's: one the kernels pair with x's (equal, or float32 with a 16-bit
// float either way: autocast's pairs).
inline void check_weight_dtype(const char* op, const char* name, const at::Tensor& weight,
                               const at::Tensor& x) {
  const at::ScalarType xt = x.scalar_type(), wt = weight.scalar_type();
  TORCH_CHECK_TYPE(is_float_dtype(wt) &&
                  (wt == xt || (xt == at::kFloat && is_16bit_float(wt)) ||
                   (is_16bit_float(xt) && wt == at::kFloat)),
              op, ": ", name, ": expected dtype ", xt,
              " (x's; or float32 with a 16-bit float either way), got ", wt);
}

// The weight against x: 4-D (Co, C, kh, kw) on x's device, a kernel of at least 1x1 (its dtype:
// check_weight_dtype). Then the geometry and the output's spatial size, which must be positive.
inline Conv check_conv(const char* op, const at::Tensor& x, const at::Tensor& weight,
                       c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
                       c10::SymIntArrayRef dilation, const char* w_name = "weight",
                       const char* s_name = "stride", const char* p_name = "padding",
                       const char* d_name = "dilation") {
  TORCH_CHECK_VALUE(weight.defined(), op, ": ", w_name, ": expected a tensor, got an undefined one");
  check_device(op, w_name, weight, x);
  TORCH_CHECK_VALUE(weight.dim() == 4 && weight.size(1) == x.size(1), op, ": ", w_name,
              ": expected shape (out_channels, ", x.size(1), ", kh, kw) to match the ", x.size(1),
              " channels of x, got ", weight.sizes());
  TORCH_CHECK_VALUE(weight.size(2) >= 1 && weight.size(3) >= 1, op, ": ", w_name,
              ": expected a kernel of at least 1x1, got ", weight.sizes());
  TORCH_CHECK_VALUE(weight.size(0) >= 1, op, ": ", w_name,
              ": expected at least one output channel (as conv2d), got ", weight.sizes());
  Conv c;
  c.stride = check_pair(op, s_name, stride, 1);
  c.padding = check_pair(op, p_name, padding, 0);
  c.dilation = check_pair(op, d_name, dilation, 1);
  int64_t out_hw[2];
  for (int i = 0; i < 2; ++i) {
    const int64_t size = x.size(2 + i), k = weight.size(2 + i);
    TORCH_CHECK_VALUE(size + 2 * c.padding[i] < kIndexLimit, op, ": ", p_name, ": x's ",
                i == 0 ? "height" : "width", " ", size, " padded by ", c.padding[i],
                " on both sides reaches 2^31 (the kernels index it in 32 bits)");
    TORCH_CHECK_VALUE(c.dilation[i] * (k - 1) + 1 < kIndexLimit, op, ": ", d_name, ": a kernel of ", k,
                " taps dilated by ", c.dilation[i],
                " spans 2^31 or more (the kernels index it in 32 bits)");
    out_hw[i] = conv_out_size(size, k, c.stride[i], c.padding[i], c.dilation[i]);
  }
  TORCH_CHECK_VALUE(out_hw[0] > 0 && out_hw[1] > 0, op, ": x: spatial size (", x.size(2), ", ",
              x.size(3), ") is too small for a ", weight.size(2), "x", weight.size(3),
              " kernel with padding (", c.padding[0], ", ", c.padding[1], ") and dilation (",
              c.dilation[0], ", ", c.dilation[1], ")");
  c.out = {x.size(0), weight.size(0), out_hw[0], out_hw[1]};
  return c;
}

inline void check_bias(const char* op, const char* name, const OptTensor& bias,
                       const at::Tensor& x, const at::Tensor& weight) {
  if (present(bias)) {
    check_vector(op, name, *bias, x, weight.size(0), "one value per output channel",
                 weight.scalar_type());
  }
}

inline void check_bn_params(const char* op, const at::Tensor& x, const OptTensor& bn_weight,
                            const OptTensor& bn_bias, const at::Tensor& mean,
                            const at::Tensor& invstd) {
  if (present(bn_weight)) check_channel_vector(op, "bn_weight", *bn_weight, x);
  if (present(bn_bias)) check_channel_vector(op, "bn_bias", *bn_bias, x);
  check_channel_vector(op, "mean", mean, x);
  check_channel_vector(op, "invstd", invstd, x);
}

inline void check_branch_scale(const char* op, const OptTensor& branch_scale,
                               const at::Tensor& x) {
  if (present(branch_scale)) {
    check_vector(op, "branch_scale", *branch_scale, x, x.size(0), "one factor per sample of x",
                 at::ScalarType::Undefined);
  }
}

// The fused unit's forward (bn_relu_conv2d's schema): every argument. Returns the geometry and
// the output's shape.
inline Conv check_unit_args(const char* op, c10::DeviceType device_type, const at::Tensor& x,
                            const at::Tensor& weight, const OptTensor& bias,
                            const OptTensor& bn_weight, const OptTensor& bn_bias,
                            const at::Tensor& mean, const at::Tensor& invstd,
                            const OptTensor& residual, c10::SymIntArrayRef stride,
                            c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                            const OptTensor& branch_scale) {
  check_x(op, x, device_type);
  const Conv c = check_conv(op, x, weight, stride, padding, dilation);
  check_weight_dtype(op, "weight", weight, x);
  check_bias(op, "bias", bias, x, weight);
  check_bn_params(op, x, bn_weight, bn_bias, mean, invstd);
  if (present(residual)) {
    check_shaped(op, "residual", *residual, x, c.out, "the convolution's output",
                 weight.scalar_type());
  }
  check_branch_scale(op, branch_scale, x);
  return c;
}

// The fused unit's backward (bn_relu_conv2d_backward's schema): every argument but output_mask
// (check_output_mask, where the op takes it from the dispatcher). grad_out: any float dtype (the kernels read it
// in the weight's).
inline Conv check_backward_args(const char* op, c10::DeviceType device_type,
                                const at::Tensor& grad_out, const at::Tensor& x,
                                const at::Tensor& weight, const OptTensor& bn_weight,
                                const OptTensor& bn_bias, const at::Tensor& mean,
                                const at::Tensor& invstd, c10::SymIntArrayRef stride,
                                c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                                const OptTensor& branch_scale) {
  check_x(op, x, device_type);
  const Conv c = check_conv(op, x, weight, stride, padding, dilation);
  check_weight_dtype(op, "weight", weight, x);
  check_bn_params(op, x, bn_weight, bn_bias, mean, invstd);
  check_shaped(op, "grad_out", grad_out, x, c.out, "the convolution's output",
               at::ScalarType::Undefined);
  check_branch_scale(op, branch_scale, x);
  return c;
}

// Two convolutions of one BN-ReLU (bn_relu_conv2d_pair's and eager_pair's schemas): x, both
// convolutions (the second's arguments named weight2, bias2, stride2, padding2, dilation2; the
// same dtype as the first's), the BatchNorm parameters and statistics.
inline std::array<Conv, 2> check_pair_args(
    const char* op, c10::DeviceType device_type, const at::Tensor& x, const at::Tensor& weight,
    const OptTensor& bias, const at::Tensor& weight2, const OptTensor& bias2,
    const OptTensor& bn_weight, const OptTensor& bn_bias, const at::Tensor& mean,
    const at::Tensor& invstd, c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation, c10::SymIntArrayRef stride2, c10::SymIntArrayRef padding2,
    c10::SymIntArrayRef dilation2) {
  check_x(op, x, device_type);
  const Conv c = check_conv(op, x, weight, stride, padding, dilation);
  const Conv c2 = check_conv(op, x, weight2, stride2, padding2, dilation2, "weight2", "stride2",
                             "padding2", "dilation2");
  check_weight_dtype(op, "weight", weight, x);
  TORCH_CHECK_TYPE(weight2.scalar_type() == weight.scalar_type(), op,
              ": weight2: expected dtype ", weight.scalar_type(), " (weight's), got ",
              weight2.scalar_type());
  check_bias(op, "bias", bias, x, weight);
  check_bias(op, "bias2", bias2, x, weight2);
  check_bn_params(op, x, bn_weight, bn_bias, mean, invstd);
  return {c, c2};
}

// A backward's bool[5] output_mask (x, weight, bias, bn_weight, bn_bias). The ops register a
// kernel that takes it as a c10::List and converts here: a std::array<bool, 5> argument makes
// the dispatcher refuse another length without naming the argument.
inline std::array<bool, 5> check_output_mask(const char* op, const c10::List<bool>& mask) {
  TORCH_CHECK_VALUE(mask.size() == 5, op,
              ": output_mask: expected a list of 5 bools (x, weight, bias, bn_weight, bn_bias), "
              "got ", mask.size(), " values");
  return {mask[0], mask[1], mask[2], mask[3], mask[4]};
}

// batch_stats's x: a 4-D float tensor of the kernels' device type.
inline void check_stats_input(const char* op, const at::Tensor& x, c10::DeviceType device_type) {
  check_x(op, x, device_type);
}

// A buffer updated in place: not an inference tensor outside inference mode (the in-place op
// would refuse it after the buffers before it were written), no element stored twice (a
// stride-0 expanded vector: the update of one channel would overwrite another's).
inline void check_writable(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(c10::InferenceMode::is_enabled() || !t.is_inference(), op, ": ", name,
              ": an inference tensor cannot be updated in place outside InferenceMode");
  TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name,
              ": expected a tensor whose elements do not share memory (it is updated in place), "
              "got strides ", t.strides());
}

// Whether a and b may share memory: one storage and an overlap ATen cannot rule out (exact for
// dense tensors; fusedres.ops.checks._share_memory). Meta tensors have none.
inline bool may_share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.is_meta() || b.is_meta()) return false;
  if (!a.has_storage() || !b.has_storage() || !a.storage().is_alias_of(b.storage())) {
    return false;
  }
  return at::get_overlap_status(a, b) != at::MemOverlapStatus::No;
}

// The running statistics and the hyperparameters of a BatchNorm of x (prepare_batch_norm's and
// module_unit's): per-channel float vectors on x's device, both or neither; a one-element integer
// num_batches_tracked; buffers that the update writes are writable and apart; and nn.BatchNorm2d's
// refusals: eps > 0 in training (>= 0 in eval), no running statistic that requires grad while
// grad mode is on, more than one value per channel when the batch's statistics are used.
inline void check_running_stats(const char* op, const at::Tensor& x, const OptTensor& running_mean,
                                const OptTensor& running_var,
                                const OptTensor& num_batches_tracked, bool training,
                                std::optional<double> momentum, double eps) {
  const bool tracked = present(running_mean);
  TORCH_CHECK_VALUE(tracked == present(running_var), op,
              ": running_mean, running_var: give both or neither");
  if (tracked) {
    for (const auto* p : {&running_mean, &running_var}) {
      const char* name = p == &running_mean ? "running_mean" : "running_var";
      check_vector(op, name, **p, x, x.size(1), "one value per channel of x",
                   at::ScalarType::Undefined);
      TORCH_CHECK_VALUE(!(c10::GradMode::is_enabled() && (*p)->requires_grad()), op, ": ", name,
                  ": expected a buffer that does not require grad (nn.BatchNorm2d refuses one "
                  "that does while grad mode is on)");
    }
  }
  if (present(num_batches_tracked)) {
    check_device(op, "num_batches_tracked", *num_batches_tracked, x);
    TORCH_CHECK_VALUE(num_batches_tracked->numel() == 1, op,
                ": num_batches_tracked: expected one element, got shape ",
                num_batches_tracked->sizes());
    TORCH_CHECK_TYPE(at::isIntegralType(num_batches_tracked->scalar_type(), /*includeBool=*/false),
                op, ": num_batches_tracked: expected an integer tensor (a count), got ",
                num_batches_tracked->scalar_type());
  }
  if (training && tracked) {
    TORCH_CHECK_VALUE(momentum.has_value() || present(num_batches_tracked), op,
                ": num_batches_tracked: required when momentum is None (cumulative moving "
                "average)");
    check_writable(op, "running_mean", *running_mean);
    check_writable(op, "running_var", *running_var);
    TORCH_CHECK_VALUE(!may_share_memory(*running_mean, *running_var), op,
                ": running_var: expected memory of its own, got a tensor that overlaps "
                "running_mean");
  }
  if (training && present(num_batches_tracked)) {  // counted in training, tracked or not
    check_writable(op, "num_batches_tracked", *num_batches_tracked);
  }
  TORCH_CHECK_VALUE(training ? eps > 0 : eps >= 0, op, ": eps: expected a value ",
              training ? "> 0 in training" : ">= 0", " (as nn.BatchNorm2d), got ", eps);
  const int64_t per_channel = x.size(1) > 0 ? x.numel() / x.size(1) : 0;
  TORCH_CHECK_VALUE(!(training || !tracked) || per_channel != 1, op,
              ": x: expected more than 1 value per channel when training, got input size ",
              x.sizes());
}

// Every check of prepare_batch_norm's arguments (fusedres/ops/opdefs.py NAMESPACE_SCHEMAS), each
// error naming its argument as fusedres.functional.prepare_batch_norm words it. An empty batch
// stays in Python (fusedres.functional.prepare_batch_norm).
inline void check_prepare_args(const char* op, c10::DeviceType device_type, const at::Tensor& x,
                               const OptTensor& running_mean, const OptTensor& running_var,
                               const OptTensor& num_batches_tracked, bool training,
                               std::optional<double> momentum, double eps,
                               const OptTensor& mean, const OptTensor& var) {
  check_x(op, x, device_type);
  TORCH_CHECK_VALUE(x.size(1) > 0 && x.numel() > 0, op,
              ": x: expected a non-empty 4-D (N, C, H, W) tensor, got shape ", x.sizes());
  check_running_stats(op, x, running_mean, running_var, num_batches_tracked, training, momentum,
                      eps);
  TORCH_CHECK_VALUE(present(mean) == present(var), op, ": mean, var: give both or neither");
  if (present(mean)) {
    const at::ScalarType sdt = stats_dtype(x.scalar_type());
    check_vector(op, "mean", *mean, x, x.size(1), "the batch mean of each channel of x", sdt);
    check_vector(op, "var", *var, x, x.size(1), "the batch variance of each channel of x", sdt);
  }
}

// module_unit's arguments (a BNReLUConv2d's forward: fusedres.functional.bn_relu_conv2d's
// contract): everything every route refuses. What a route may still take (a weight, bias or
// residual of another float dtype than x's: autocast or type promotion on the Python route; BN
// vectors of another float dtype: cast) is not refused here: module_unit leaves those to the
// Python route.
inline void check_module_args(const char* op, c10::DeviceType device_type, const at::Tensor& x,
                              const at::Tensor& weight, const OptTensor& bias,
                              const OptTensor& bn_weight, const OptTensor& bn_bias,
                              const OptTensor& running_mean, const OptTensor& running_var,
                              const OptTensor& num_batches_tracked, bool training,
                              std::optional<double> momentum, double eps,
                              const OptTensor& residual, c10::SymIntArrayRef stride,
                              c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation) {
  check_x(op, x, device_type);
  const Conv c = check_conv(op, x, weight, stride, padding, dilation);
  TORCH_CHECK_TYPE(is_float_dtype(weight.scalar_type()), op,
              ": weight: expected a floating-point tensor, got ", weight.scalar_type());
  if (present(bias)) {
    check_vector(op, "bias", *bias, x, weight.size(0), "one value per output channel",
                 at::ScalarType::Undefined);
  }
  for (const auto* p : {&bn_weight, &bn_bias}) {
    if (present(*p)) {
      check_vector(op, p == &bn_weight ? "bn_weight" : "bn_bias", **p, x, x.size(1),
                   "one value per channel of x", at::ScalarType::Undefined);
    }
  }
  check_running_stats(op, x, running_mean, running_var, num_batches_tracked, training, momentum,
                      eps);
  if (present(residual)) {
    check_shaped(op, "residual", *residual, x, c.out, "the convolution's output",
                 at::ScalarType::Undefined);
  }
}

}  // namespace checks
}  // namespace fusedres
