// ThreadSanitizer cases of the fused unit's kernels (bn_relu_conv2d.cu,
// bn_relu_conv2d_backward.cu): small shapes (one or a few blocks per kernel: every CUDA thread is
// an OS thread here), FMA and WMMA tiles, both layouts, strided taps, both backward strategies
// and a split weight-gradient reduction; results against ATen in float64.
#include <cstdlib>

#include "cases.h"

namespace {

using fusedres_tsan::expect_close;
namespace k = fusedres::cuda_on_cpu;

struct Unit {
  at::Tensor x, w, bias, gamma, beta, mean, invstd, res;
  std::vector<int64_t> s, p, d;
};

// c = 17 input channels: two K-steps per tap on the FMA tiles (BK = 16 channels), and the weight
// gradient's reduction runs over several 16- or 32-pixel K-steps, so the barriers between K-steps
// are exercised, not only those between taps.
// c = 40 (a multiple of 8, channels-last, 16-bit: the mma.sync forward): two 32-channel K chunks
// per tap, the second partial, through the 3-stage cp.async pipeline. With co = 16 too (and a
// channels-last grad_out) the backward's weight gradient is the mma.sync kernel's: the 48 output
// pixels (2 x 4 x 6) are two 32-pixel K chunks, the second partial.
Unit make_unit(at::ScalarType dt, bool channels_last, std::vector<int64_t> s, int64_t c = 17,
               int64_t co = 6) {
  const auto fmt = channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const auto sdt = dt == at::kDouble ? at::kDouble : at::kFloat;
  Unit u;
  u.s = s;
  u.p = {1, 0};
  u.d = {1, 1};
  u.x = (at::randn({2, c, 7, 6}, at::kDouble) * 2 + 0.5).to(dt).contiguous(fmt);
  u.w = (at::randn({co, c, 3, 1}, at::kDouble) * 0.3).to(dt).contiguous(fmt);
  u.bias = at::randn({co}, at::kDouble).to(dt);
  u.gamma = (at::rand({c}, at::kDouble) + 0.5).to(sdt);
  u.beta = at::randn({c}, at::kDouble).to(sdt);
  u.mean = (at::randn({c}, at::kDouble) * 0.3 + 0.5).to(sdt);
  u.invstd = (at::rand({c}, at::kDouble) * 0.5 + 0.3).to(sdt);
  const int64_t ho = (7 + 2 - 3) / s[0] + 1, wo = (6 - 1) / s[1] + 1;
  u.res = at::randn({2, co, ho, wo}, at::kDouble).to(dt).contiguous(fmt);
  return u;
}

// Stochastic depth's per-sample factor for the two samples: one dropped, one kept (1 / 0.8).
at::Tensor branch_scale() { return at::tensor({0.0, 1.25}, at::kDouble); }

c10::SymIntArrayRef sym(const std::vector<int64_t>& v) { return c10::fromIntArrayRefSlow(v); }

at::Tensor z64(const Unit& u) {
  const auto v = [](const at::Tensor& t) { return t.to(at::kDouble).view({1, -1, 1, 1}); };
  const at::Tensor scale = v(u.gamma) * v(u.invstd);
  return u.x.to(at::kDouble) * scale + (v(u.beta) - v(u.mean) * scale);
}

void check_forward(at::ScalarType dt, bool channels_last, double tol, int64_t c = 17,
                   int64_t co = 6) {
  const Unit u = make_unit(dt, channels_last, {2, 1}, c, co);
  auto [y, mean, var] = k::bn_relu_conv2d_genstats(u.x, u.w, u.bias, u.gamma, u.beta, u.mean,
                                                   u.invstd, u.res, sym(u.s), sym(u.p),
                                                   sym(u.d), /*batch_stats=*/false,
                                                   branch_scale());
  const at::Tensor want = at::convolution(z64(u).relu().to(dt).to(at::kDouble),
                                          u.w.to(at::kDouble), u.bias.to(at::kDouble), u.s, u.p,
                                          u.d, false, {0, 0}, 1) *
                              branch_scale().view({-1, 1, 1, 1}) +
                          u.res.to(at::kDouble);
  expect_close(y, want, tol, tol, "bn_relu_conv2d y");
  auto [var64, mean64] = at::var_mean(y.to(at::kDouble), {0, 2, 3}, 0, false);
  expect_close(mean, mean64, 1e-5, 1e-5, "genstats mean");
  expect_close(var, var64, 1e-5, 1e-5, "genstats var");
}

// wgrad_tol > 0: grad_weight is checked against the product of the operands as the 16-bit
// sequence rounds them (a = relu(scale * x + shift) from the float32 affine, rounded to dt; and
// s[n] * dy in dt), to wgrad_tol relative (the float32 accumulation and the output's rounding)
// plus twice one operand rounding's worth, max |s dy| * max |a| * eps(dt), absolute: the
// kernel's float32 z and the reference's may still round an activation the other way
// (fused multiply-add or not). Without the operands rounded, a bfloat16 grad_weight moves by
// ~0.2 on these shapes; the data are new random numbers at every run of the driver.
// strategy "store": grad_weight and grad_bias left out, so that the data gradient's epilogue
// reduces the BatchNorm sums; split: the weight gradient's forced split (0: the rule).
void check_backward(at::ScalarType dt, bool channels_last, const char* strategy, int64_t split,
                    double tol, int64_t c = 17, int64_t co = 6, double wgrad_tol = 0) {
  const bool store = std::string(strategy) == "store";
  k::host_wgrad_split() = split;
  const Unit u = make_unit(dt, channels_last, {2, 1}, c, co);
  const at::Tensor z = z64(u), a = z.relu();
  const at::Tensor w64 = u.w.to(at::kDouble);
  const at::Tensor y = at::convolution(a, w64, {}, u.s, u.p, u.d, false, {0, 0}, 1);
  // grad_out in x's layout, as autograd hands it for a channels-last y.
  const at::Tensor gy = at::randn(y.sizes(), at::kDouble)
                            .to(dt)
                            .contiguous(channels_last ? at::MemoryFormat::ChannelsLast
                                                      : at::MemoryFormat::Contiguous);
  auto [gx, gw, gb, gg, gbeta] = k::bn_relu_conv2d_backward(
      gy, u.x, u.w, u.gamma, u.beta, u.mean, u.invstd, sym(u.s), sym(u.p), sym(u.d), true,
      {true, !store, !store, true, true}, branch_scale());
  k::host_wgrad_split() = 0;
  const at::Tensor gy_branch = gy.to(at::kDouble) * branch_scale().view({-1, 1, 1, 1});
  auto [da, dw, db] = at::convolution_backward(gy_branch, a, w64, {{co}}, u.s, u.p,
                                               u.d, false, {0, 0}, 1, {true, true, true});
  const at::Tensor dz = da * (z > 0);
  const auto v = [](const at::Tensor& t) { return t.to(at::kDouble).view({1, -1, 1, 1}); };
  const at::Tensor xhat = (u.x.to(at::kDouble) - v(u.mean)) * v(u.invstd);
  const at::Tensor sum_dz = dz.sum({0, 2, 3}), sum_dzx = (dz * xhat).sum({0, 2, 3});
  const double m = static_cast<double>(u.x.numel() / u.x.size(1));
  const at::Tensor dx = v(u.gamma) * v(u.invstd) *
                        (dz - v(sum_dz) / m - xhat * v(sum_dzx) / m);
  expect_close(gx, dx, tol, tol, "grad_x");
  if (store) {
    // no weight gradient
  } else if (wgrad_tol > 0) {
    const auto v32 = [](const at::Tensor& t) { return t.to(at::kFloat).view({1, -1, 1, 1}); };
    const at::Tensor scale32 = v32(u.gamma) * v32(u.invstd);
    const at::Tensor shift32 = v32(u.beta) - v32(u.mean) * scale32;
    const at::Tensor a_r = (u.x.to(at::kFloat) * scale32 + shift32).relu().to(dt).to(at::kDouble);
    const at::Tensor gy_r = gy_branch.to(dt).to(at::kDouble);
    const at::Tensor dw_r = std::get<1>(at::convolution_backward(
        gy_r, a_r, w64, {{co}}, u.s, u.p, u.d, false, {0, 0}, 1, {false, true, false}));
    const double eps = dt == at::kHalf ? 0x1p-10 : 0x1p-7;
    const double flip =
        2 * gy_r.abs().max().item<double>() * a_r.abs().max().item<double>() * eps;
    expect_close(gw, dw_r, wgrad_tol + flip, wgrad_tol, "grad_weight (16-bit operands)");
  } else {
    expect_close(gw, dw, tol, tol, "grad_weight");
  }
  if (!store) expect_close(gb, db, tol, tol, "grad_bias");
  expect_close(gg, sum_dzx, tol, tol, "grad_bn_weight");
  expect_close(gbeta, sum_dz, tol, tol, "grad_bn_bias");
}

}  // namespace

FUSEDRES_TSAN_CASE(unit_forward_fma) {
  check_forward(at::kFloat, false, 1e-5);
  check_forward(at::kDouble, true, 1e-12);
}

FUSEDRES_TSAN_CASE(unit_forward_wmma) { check_forward(at::kBFloat16, true, 3e-2); }

// Co = 6: the thin 16-column tile (32 deep over C = 40, 16 deep over C = 16).
FUSEDRES_TSAN_CASE(unit_forward_mma) {
  check_forward(at::kHalf, true, 2e-2, 40);
  check_forward(at::kBFloat16, true, 3e-2, 16);
}

// The mma.sync forward's 128-row tile (MmaFwdTall, chosen on one SM: these shapes pick the
// 64-row one on 132): 4 warps of 32 x 64, the 84 output rows one partial tile, Co = 40 one
// partial 64-column tile.
FUSEDRES_TSAN_CASE(unit_forward_mma_tall) {
  k::host_sm_count() = 1;
  check_forward(at::kBFloat16, true, 3e-2, 40, 40);
  k::host_sm_count() = 132;
}

FUSEDRES_TSAN_CASE(unit_backward_sums) { check_backward(at::kFloat, false, "sums", 1, 1e-5); }

FUSEDRES_TSAN_CASE(unit_backward_store) { check_backward(at::kFloat, true, "store", 0, 1e-5); }

FUSEDRES_TSAN_CASE(unit_backward_split) { check_backward(at::kFloat, true, "sums", 2, 1e-5); }

FUSEDRES_TSAN_CASE(unit_backward_wmma) { check_backward(at::kHalf, true, "sums", 2, 2e-2); }

// The mma.sync weight and data gradients (16-bit, channels-last x and grad_out, C = 40,
// Co = 16; the data gradient's two stride phases, its K chunks over the taps that feed each),
// with the BatchNorm sums (unsplit: every K chunk through the pipeline) and without (the store
// strategy, split in two); grad_weight against the rounded operands' product (float16: 1e-3, bfloat16:
// 8e-3, about two of the output's roundings). The other outputs to 1e-1 for bfloat16: its
// rounding of the activation alone moves them by up to ~0.2 here.
FUSEDRES_TSAN_CASE(unit_backward_wgrad_mma) {
  check_backward(at::kHalf, true, "sums", 1, 2e-2, 40, 16, 1e-3);
  check_backward(at::kBFloat16, true, "sums", 2, 1e-1, 40, 16, 8e-3);
  check_backward(at::kBFloat16, true, "store", 0, 1e-1, 40, 16);
}

// The mma.sync data gradient's 128-row tile (MmaDgradTall, chosen on one SM), its epilogue in
// two 64-row passes: the store strategy takes the BatchNorm sums from its partials.
FUSEDRES_TSAN_CASE(unit_backward_dgrad_mma_tall) {
  k::host_sm_count() = 1;
  check_backward(at::kHalf, true, "store", 0, 2e-2, 40, 16);
  k::host_sm_count() = 132;
}

// The mma.sync data gradient's wide tile (MmaDgradWide, 128 x 128 of 2 x 2 warps of 64 x 64:
// sm_90's for C > 64, chosen on one SM at the knob's default sm_90), its buffers in dynamic
// shared memory past the 48 KiB opt-in; C = 72 one partial column tile, in the store strategy
// and the sums one.
FUSEDRES_TSAN_CASE(unit_backward_dgrad_mma_wide) {
  k::host_sm_count() = 1;
  check_backward(at::kHalf, true, "store", 0, 2e-2, 72, 16);
  check_backward(at::kBFloat16, true, "sums", 1, 1e-1, 72, 16);
  k::host_sm_count() = 132;
}

// The thin data-gradient tiles (C <= 32): 16 columns (C = 16: fewer 16-byte pieces of the
// weight per chunk than threads, the first ones copy them; with Co = 16 two taps a K chunk,
// MmaDgradPaired, the stride-2 phases' last chunks of one tap) and 32 (C = 24: a partial column
// tile), in the store strategy (the sums from its partials) and the sums one.
FUSEDRES_TSAN_CASE(unit_backward_dgrad_mma_thin) {
  check_backward(at::kHalf, true, "store", 0, 2e-2, 16, 16);
  check_backward(at::kBFloat16, true, "sums", 1, 1e-1, 24, 16);
}
