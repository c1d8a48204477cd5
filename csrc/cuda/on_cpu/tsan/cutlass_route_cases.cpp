// Sanitizer cases of what the CUTLASS route adds to the native backward kernels (the CUTLASS
// GEMMs themselves run only on a GPU): the data gradient's epilogue writing the activation a
// beside dz, and the dx launch whose blocks past dx's sum the weight gradient's partials. Run
// through the test hooks (../bn_relu_conv2d_backward.cpp), 16-bit channels-last as the route
// takes them: ThreadSanitizer sees the new stores, AddressSanitizer their bounds.
#include <ATen/core/dispatch/Dispatcher.h>

#include "cases.h"

namespace {

using fusedres_tsan::expect_close;
using Tensors = std::vector<at::Tensor>;
using Opt = std::optional<at::Tensor>;

c10::TypedOperatorHandle<Tensors(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const Opt&, const Opt&, const at::Tensor&, const at::Tensor&,
                                 c10::ArrayRef<int64_t>, c10::ArrayRef<int64_t>,
                                 c10::ArrayRef<int64_t>, bool)>
dgrad_with_activation() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fusedres_cuda_testing::dgrad_with_activation", "")
      .typed<Tensors(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&,
                     const Opt&, const at::Tensor&, const at::Tensor&, c10::ArrayRef<int64_t>,
                     c10::ArrayRef<int64_t>, c10::ArrayRef<int64_t>, bool)>();
}

c10::TypedOperatorHandle<Tensors(const at::Tensor&, const at::Tensor&, const Opt&, const Opt&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const Opt&, const at::Tensor&)>
dx_with_partials() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fusedres_cuda_testing::dx_with_partials", "")
      .typed<Tensors(const at::Tensor&, const at::Tensor&, const Opt&, const Opt&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const Opt&, const at::Tensor&)>();
}

struct Inputs {
  at::Tensor x, w, gamma, beta, mean, invstd, gy;
};

// C = 16, Co = 8 (the mma.sync data gradient: 16 columns, 16 deep), 2 x 5 x 6 pixels, stride s.
Inputs make_inputs(at::ScalarType dt, int64_t s) {
  const auto cl = at::MemoryFormat::ChannelsLast;
  Inputs in;
  in.x = (at::randn({2, 16, 5, 6}, at::kDouble) * 2 + 0.5).to(dt).contiguous(cl);
  in.w = (at::randn({8, 16, 3, 3}, at::kDouble) * 0.2).to(dt).contiguous(cl);
  in.gamma = (at::rand({16}, at::kDouble) + 0.5).to(at::kFloat);
  in.beta = at::randn({16}, at::kDouble).to(at::kFloat);
  in.mean = (at::randn({16}, at::kDouble) * 0.3 + 0.5).to(at::kFloat);
  in.invstd = (at::rand({16}, at::kDouble) * 0.5 + 0.3).to(at::kFloat);
  const int64_t ho = (5 + 2 - 3) / s + 1, wo = (6 + 2 - 3) / s + 1;
  in.gy = at::randn({2, 8, ho, wo}, at::kDouble).to(dt).contiguous(cl);
  return in;
}

void check_activation(at::ScalarType dt, int64_t s) {
  const Inputs in = make_inputs(dt, s);
  const std::vector<int64_t> st{s, s}, pad{1, 1}, dil{1, 1};
  const auto op = dgrad_with_activation();
  const Tensors with = op.call(in.gy, in.x, in.w, in.gamma, in.beta, in.mean, in.invstd, st, pad,
                               dil, true);
  const Tensors without = op.call(in.gy, in.x, in.w, in.gamma, in.beta, in.mean, in.invstd, st,
                                  pad, dil, false);
  for (int i = 0; i < 3; ++i) expect_close(with[i], without[i], 0, 0, "dz and the partials");
  const auto v = [](const at::Tensor& t) { return t.view({1, -1, 1, 1}); };
  const at::Tensor scale = in.gamma * in.invstd;
  const at::Tensor a = (in.x.to(at::kFloat) * v(scale) + v(in.beta - in.mean * scale)).relu();
  const double eps = dt == at::kHalf ? 0x1p-10 : 0x1p-7;
  expect_close(with[3], a.to(dt), 1e-6, eps, "the activation a");
}

void check_dx_partials(at::ScalarType dt) {
  const Inputs in = make_inputs(dt, 1);
  const at::Tensor m1 = at::randn({16}).to(at::kFloat), m2 = at::randn({16}).to(at::kFloat);
  const at::Tensor parts = at::randn({3, 8, 3, 3, 16}).to(at::kFloat) * 100;
  const at::Tensor dz = at::randn(in.x.sizes()).to(dt).contiguous(at::MemoryFormat::ChannelsLast);
  const auto op = dx_with_partials();
  const Tensors with = op.call(dz, in.x, in.gamma, in.beta, in.mean, in.invstd, m1, m2, parts,
                               in.w);
  const Tensors without = op.call(dz, in.x, in.gamma, in.beta, in.mean, in.invstd, m1, m2,
                                  std::nullopt, in.w);
  expect_close(with[0], without[0], 0, 0, "dx");
  const at::Tensor dw = parts.sum(0).permute({0, 3, 1, 2});
  expect_close(with[1], dw.to(dt), 0, dt == at::kHalf ? 0x1p-10 : 0x1p-7, "the weight gradient");
}

}  // namespace

FUSEDRES_TSAN_CASE(cutlass_route_dgrad_activation) {
  check_activation(at::kHalf, 1);
  check_activation(at::kBFloat16, 2);
}

FUSEDRES_TSAN_CASE(cutlass_route_dx_sums_partials) {
  check_dx_partials(at::kHalf);
  check_dx_partials(at::kBFloat16);
}
