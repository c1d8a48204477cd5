// nn.BatchNorm2d's preparation (fusedres.functional.prepare_batch_norm) as every backend's
// prepare_batch_norm op shares it: the argument checks, and the running-statistics update in
// ATen ops (the Python rule's exact sequence), which a backend runs where its own kernels do not
// take the tensors (a dtype or layout they were not built for). Host-only code, plain C++ (nvcc
// compiles it as host code of the .cu files).
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/ScalarOps.h>
#include <c10/core/InferenceMode.h>

#include <cstdint>
#include <optional>

namespace fusedres {

// An optional tensor argument that was given (not None, not an undefined tensor).
inline bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// float16, bfloat16, float32, float64: the dtypes fusedres.functional takes (_FLOAT).
inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

namespace prepare_detail {

inline void check_vector(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& x, at::ScalarType* dtype) {
  const int64_t C = x.size(1);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == C, op, ": ", name, ": expected shape (", C,
              ",) (one value per channel of x), got ", t.sizes());
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, ": expected device ", x.device(),
              " (the device of x), got ", t.device());
  if (dtype != nullptr) {
    TORCH_CHECK(t.scalar_type() == *dtype, op, ": ", name, ": expected dtype ", *dtype,
                " (the statistics dtype of x), got ", t.scalar_type());
  } else {
    TORCH_CHECK(is_float_dtype(t.scalar_type()), op, ": ", name,
                ": expected a floating-point tensor, got ", t.scalar_type());
  }
}

// A buffer updated in place: not an inference tensor outside inference mode (the in-place op
// would refuse it after the buffers before it were written).
inline void check_writable(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(c10::InferenceMode::is_enabled() || !t.is_inference(), op, ": ", name,
              ": an inference tensor cannot be updated in place outside InferenceMode");
}

}  // namespace prepare_detail

// Every check of prepare_batch_norm's arguments (the schema of fusedres_cpu::prepare_batch_norm),
// run before anything is read or written, each error naming its argument as
// fusedres.functional.prepare_batch_norm words it. The device of x is the backend's to check.
inline void check_prepare_args(const char* op, const at::Tensor& x,
                               const std::optional<at::Tensor>& running_mean,
                               const std::optional<at::Tensor>& running_var,
                               const std::optional<at::Tensor>& num_batches_tracked,
                               bool training, std::optional<double> momentum,
                               const std::optional<at::Tensor>& mean,
                               const std::optional<at::Tensor>& var) {
  using prepare_detail::check_vector;
  using prepare_detail::check_writable;
  TORCH_CHECK(x.dim() == 4 && x.size(1) > 0 && x.numel() > 0, op,
              ": x: expected a non-empty 4-D (N, C, H, W) tensor, got shape ", x.sizes());
  TORCH_CHECK(is_float_dtype(x.scalar_type()), op,
              ": x: expected float16, bfloat16, float32 or float64, got ", x.scalar_type());
  const bool tracked = present(running_mean);
  TORCH_CHECK(tracked == present(running_var), op,
              ": running_mean, running_var: give both or neither");
  const bool update = training && tracked;
  if (tracked) {
    check_vector(op, "running_mean", *running_mean, x, nullptr);
    check_vector(op, "running_var", *running_var, x, nullptr);
  }
  if (update) {
    TORCH_CHECK(momentum.has_value() || present(num_batches_tracked), op,
                ": num_batches_tracked: required when momentum is None (cumulative moving "
                "average)");
    check_writable(op, "running_mean", *running_mean);
    check_writable(op, "running_var", *running_var);
    if (present(num_batches_tracked)) {
      TORCH_CHECK(num_batches_tracked->numel() == 1, op,
                  ": num_batches_tracked: expected one element, got shape ",
                  num_batches_tracked->sizes());
      check_writable(op, "num_batches_tracked", *num_batches_tracked);
    }
  }
  const bool use_batch = training || !tracked;
  TORCH_CHECK(!use_batch || x.numel() / x.size(1) > 1, op,
              ": x: expected more than 1 value per channel when training, got input size ",
              x.sizes());
  TORCH_CHECK(present(mean) == present(var), op, ": mean, var: give both or neither");
  if (present(mean)) {
    at::ScalarType sdt = at::toOpMathType(x.scalar_type());
    check_vector(op, "mean", *mean, x, &sdt);
    check_vector(op, "var", *var, x, &sdt);
  }
}

// The running-statistics update of a training step in ATen ops, as
// fusedres.functional._update_running_stats runs them (the same ops: the same roundings on every
// device): num_batches_tracked counted, then rm <- rm * (1 - f) + mean * f and rv <- rv * (1 - f)
// + (var * M / (M - 1)) * f, f = momentum or 1.0 / num_batches_tracked. Every dtype and layout.
// A Python float reaches Tensor.mul_ as a wrapped-number tensor (mul_.Tensor), which ATen's
// kernels take in opmath_type; C++'s mul_(Scalar) computes scalar * self instead, rounding the
// scalar to a 16-bit self's dtype first (other bits for float16 and bfloat16 running
// statistics): the wrapped tensor here too.
inline void update_running_stats_aten(at::Tensor rm, at::Tensor rv,
                                      const std::optional<at::Tensor>& num_batches_tracked,
                                      const at::Tensor& mean, const at::Tensor& var,
                                      std::optional<double> momentum, int64_t count) {
  if (present(num_batches_tracked)) num_batches_tracked->add_(1);
  const double bessel = static_cast<double>(count) / static_cast<double>(count - 1);
  const at::Tensor unbiased = var * bessel;
  if (momentum.has_value()) {
    const double f = *momentum;
    const at::Tensor keep = at::native::wrapped_scalar_tensor(1 - f);
    rm.mul_(keep).add_(mean.to(rm.scalar_type()) * f);
    rv.mul_(keep).add_(unbiased.to(rv.scalar_type()) * f);
  } else {  // cumulative average: 1 / num_batches_tracked, as a tensor (Python: 1.0 / t)
    const at::Tensor f = num_batches_tracked->to(rm.scalar_type()).reciprocal() * 1.0;
    rm.mul_(at::rsub(f, 1)).add_(mean.to(rm.scalar_type()) * f);
    rv.mul_(at::rsub(f, 1)).add_(unbiased.to(rv.scalar_type()) * f);
  }
}

// Eval-mode statistics from the running ones, in ATen ops: (mean, invstd) in the statistics
// dtype sdt, the mean a copy (no output aliases an input).
inline std::tuple<at::Tensor, at::Tensor> eval_stats_aten(const at::Tensor& running_mean,
                                                          const at::Tensor& running_var,
                                                          at::ScalarType sdt, double eps) {
  return {running_mean.to(sdt, /*non_blocking=*/false, /*copy=*/true),
          at::rsqrt(running_var.to(sdt) + eps)};
}

}  // namespace fusedres
