// nn.BatchNorm2d's preparation (fusedres.functional.prepare_batch_norm) as every backend's
// prepare_batch_norm op shares it (its argument checks are checks.h's check_prepare_args): the
// running-statistics update in ATen ops (the Python rule's exact sequence), which a backend runs
// where its own kernels do not take the tensors (a dtype or layout they were not built for).
// Host-only code, plain C++ (nvcc compiles it as host code of the .cu files).
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/ScalarOps.h>

#include <cstdint>
#include <optional>

#include "checks.h"

namespace fusedres {

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
