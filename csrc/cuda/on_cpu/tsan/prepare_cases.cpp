// ThreadSanitizer cases of prepare_batch_norm (batch_stats.cu): the partials kernel counting
// num_batches_tracked and the finalize kernel reading that count (momentum None), the
// given-statistics kernel's one-block count (every thread reads it before the barrier, one
// writes it after) and the eval kernel; results against ATen in float64, the count exactly.
#include "cases.h"

namespace {

using fusedres_tsan::expect_close;
namespace k = fusedres::cuda_on_cpu;

// rm <- rm (1 - f) + mean f, rv <- rv (1 - f) + var M / (M - 1) f, in float64.
void expect_update(const at::Tensor& rm, const at::Tensor& rv, const at::Tensor& rm0,
                   const at::Tensor& rv0, const at::Tensor& mean, const at::Tensor& var,
                   double f, double m, double tol) {
  const auto d = [](const at::Tensor& t) { return t.to(at::kDouble); };
  expect_close(rm, d(rm0) * (1 - f) + d(mean) * f, tol, tol, "running_mean");
  expect_close(rv, d(rv0) * (1 - f) + d(var) * (m / (m - 1)) * f, tol, tol, "running_var");
}

// c: past one 8-warp finalize block (NCHW: one partials block a channel, of 256 OS threads
// here), and past one 32-channel NHWC partials block.
void check_train(at::ScalarType dt, bool channels_last, std::optional<double> momentum,
                 int64_t c) {
  const at::Tensor x = (at::randn({3, c, 5, 4}, at::kDouble) * 2 + 1)
                           .to(dt)
                           .contiguous(channels_last ? at::MemoryFormat::ChannelsLast
                                                     : at::MemoryFormat::Contiguous);
  const auto sdt = dt == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor rm0 = at::randn({c}, at::kDouble).to(sdt);
  const at::Tensor rv0 = (at::rand({c}, at::kDouble) + 0.5).to(sdt);
  at::Tensor rm = rm0.clone(), rv = rv0.clone(), nbt = at::full({}, 3, at::kLong);
  auto [mean, invstd] = k::prepare_batch_norm(x, rm, rv, nbt, true, momentum, 1e-3,
                                              std::nullopt, std::nullopt);
  TORCH_CHECK(nbt.item<int64_t>() == 4, "num_batches_tracked: ", nbt.item<int64_t>());
  auto [var64, mean64] = at::var_mean(x.to(at::kDouble), {0, 2, 3}, 0, false);
  const double tol = dt == at::kDouble ? 1e-12 : 1e-5;
  expect_close(mean, mean64, tol, tol, "mean");
  expect_close(invstd, (var64 + 1e-3).rsqrt(), tol, tol, "invstd");
  expect_update(rm, rv, rm0, rv0, mean64, var64, momentum.value_or(0.25), 60, tol);
}

}  // namespace

FUSEDRES_TSAN_CASE(prepare_train) {
  check_train(at::kFloat, false, 0.1, 9);
  check_train(at::kHalf, true, std::nullopt, 37);
  check_train(at::kDouble, true, std::nullopt, 37);
}

FUSEDRES_TSAN_CASE(prepare_given_and_eval) {
  const int64_t c = 300;  // more channels than the one counting block's threads
  const at::Tensor x = at::randn({2, c, 3, 3});
  auto [var, mean] = at::var_mean(x, {0, 2, 3}, 0, false);
  const at::Tensor rm0 = at::randn({c}), rv0 = at::rand({c}) + 0.5;
  at::Tensor rm = rm0.clone(), rv = rv0.clone(), nbt = at::full({}, 1, at::kLong);
  auto [m, invstd] = k::prepare_batch_norm(x, rm, rv, nbt, true, std::nullopt, 1e-5, mean, var);
  TORCH_CHECK(nbt.item<int64_t>() == 2, "num_batches_tracked: ", nbt.item<int64_t>());
  expect_close(m, mean, 0, 0, "given mean");
  expect_close(invstd, (var.to(at::kDouble) + 1e-5).rsqrt(), 1e-6, 1e-6, "invstd");
  expect_update(rm, rv, rm0, rv0, mean, var, 0.5, 18, 1e-6);
  auto [em, einv] = k::prepare_batch_norm(x, rm, rv, nbt, false, 0.1, 1e-5, std::nullopt,
                                          std::nullopt);
  TORCH_CHECK(nbt.item<int64_t>() == 2, "eval counted num_batches_tracked");
  expect_close(em, rm, 0, 0, "eval mean");
  expect_close(einv, (rv.to(at::kDouble) + 1e-5).rsqrt(), 1e-6, 1e-6, "eval invstd");
}
