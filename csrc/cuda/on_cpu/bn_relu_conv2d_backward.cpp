// The CPU-executed copy of csrc/cuda/bn_relu_conv2d_backward.cu (see ../common.cuh).
#include <cmath>
#include <utility>
#include <vector>

#include "../bn_relu_conv2d_backward.cu"

// Test hook, host copy only (tests/test_cuda_kernels.py): which weight-gradient kernel the
// backward launches for these operands ("mma": wgrad_mma_kernel, "wmma": wgrad_kernel), by the
// rule launch_wgrad applies (wgrad_uses_mma).
namespace fusedres::cuda_on_cpu {
namespace {

std::string wgrad_kernel_for(const at::Tensor& grad_out, const at::Tensor& x,
                             const at::Tensor& weight) {
  const at::Tensor go = grad_out.to(weight.scalar_type());
  return wgrad_uses_mma(go, x, weight.scalar_type()) ? "mma" : "wmma";
}

}  // namespace
}  // namespace fusedres::cuda_on_cpu

TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  m.def("wgrad_kernel_for(Tensor grad_out, Tensor x, Tensor weight) -> str");
  m.impl("wgrad_kernel_for", c10::DispatchKey::CPU,
         [](const at::Tensor& go, const at::Tensor& x, const at::Tensor& w) {
           return fusedres::cuda_on_cpu::wgrad_kernel_for(go, x, w);
         });
}

// Likewise the data gradient's kernel ("mma": dgrad_mma_kernel, "wmma": dgrad_kernel), by
// dgrad_uses_mma.
TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  m.def("dgrad_kernel_for(Tensor grad_out, Tensor x, Tensor weight) -> str");
  m.impl("dgrad_kernel_for", c10::DispatchKey::CPU,
         [](const at::Tensor& go, const at::Tensor& x, const at::Tensor& w) -> std::string {
           const at::Tensor g = go.to(w.scalar_type());
           return fusedres::cuda_on_cpu::dgrad_uses_mma(g, x, w) ? "mma" : "wmma";
         });
}

// Likewise the mma.sync data gradient's tile rows (64: MmaDgradSmall, 128: MmaDgradTall or
// MmaDgradWide) and columns (128: MmaDgradWide, else mma_cols) for `rows` pixels of the largest
// stride phase, C input channels and `phases` phases, by dgrad_mma_rows and dgrad_mma_cols; the
// taps a K chunk covers (2: MmaDgradPaired) by dgrad_mma_taps.
TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  m.def("dgrad_mma_rows(int rows, int C, int phases) -> int");
  m.impl("dgrad_mma_rows", [](int64_t rows, int64_t C, int64_t phases) {
    return fusedres::cuda_on_cpu::dgrad_mma_rows(rows, C, phases);
  });
  m.def("dgrad_mma_taps(int C, int Co, int phase_taps) -> int");
  m.impl("dgrad_mma_taps", [](int64_t C, int64_t Co, int64_t phase_taps) {
    return fusedres::cuda_on_cpu::dgrad_mma_taps(C, Co, phase_taps);
  });
  // The most taps feeding one stride phase (dgrad_phase_taps) of a kh x kw kernel over an
  // H x W input.
  m.def("dgrad_phase_taps(int[] kernel, int[] stride, int[] padding, int[] dilation, int H, "
        "int W) -> int");
  m.impl("dgrad_phase_taps", [](std::vector<int64_t> k, std::vector<int64_t> s,
                                std::vector<int64_t> p, std::vector<int64_t> d, int64_t H,
                                int64_t W) {
    TORCH_CHECK(k.size() == 2 && s.size() == 2 && p.size() == 2 && d.size() == 2,
                "dgrad_phase_taps: kernel, stride, padding and dilation: two values each");
    auto i = [](int64_t v) { return static_cast<int32_t>(v); };
    const fusedres::cuda_on_cpu::ConvGeom g{i(k[0]), i(k[1]), i(s[0]), i(s[1]),
                                             i(p[0]), i(p[1]), i(d[0]), i(d[1])};
    return fusedres::cuda_on_cpu::dgrad_phase_taps(g, H, W);
  });
  m.def("dgrad_mma_cols(int rows, int C, int phases) -> int");
  m.impl("dgrad_mma_cols", [](int64_t rows, int64_t C, int64_t phases) {
    return fusedres::cuda_on_cpu::dgrad_mma_cols(rows, C, phases);
  });
}

// Likewise the weight gradient's split of its reduction, by pick_split on `sms` SMs
// (kernels/traffic.cuda_wgrad_split must agree).
TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  m.def("wgrad_split(int tiles, int Co, int C, int taps, int M, int bk, int sms, "
        "int operand_bytes, int acc_bytes) -> int");
  m.impl("wgrad_split", [](int64_t tiles, int64_t co, int64_t c, int64_t taps, int64_t m,
                           int64_t bk, int64_t sms, int64_t operand_bytes, int64_t acc_bytes) {
    return fusedres::cuda_on_cpu::pick_split(tiles, co, c, taps, m, bk, sms, operand_bytes,
                                           acc_bytes);
  });
  // 1: every mma.sync data gradient one tap a K chunk (no paired taps); 0: the rule. Returns
  // the previous setting.
  m.def("set_dgrad_taps(int taps) -> int");
  m.impl("set_dgrad_taps", [](int64_t taps) {
    TORCH_CHECK(taps == 0 || taps == 1, "set_dgrad_taps: expected 0 (the rule) or 1, got ", taps);
    return std::exchange(fusedres::cuda_on_cpu::host_dgrad_taps(), taps);
  });
  // The split every weight gradient then runs (clamped to its K-steps; 0: the rule); returns
  // the previous one.
  m.def("set_wgrad_split(int split) -> int");
  m.impl("set_wgrad_split", [](int64_t split) {
    TORCH_CHECK(split >= 0, "set_wgrad_split: expected 0 or more, got ", split);
    return std::exchange(fusedres::cuda_on_cpu::host_wgrad_split(), split);
  });
}

// The weight gradient's partials summed into the weight's dtype and layout by the launch both
// weight gradients end with (wgrad_partials_sum): parts (split, Co, kh, kw, C) in the weight's
// accumulator dtype; returns a tensor like weight (its memory format kept). blocks: at most
// that many blocks (0: one per 32 elements), each then looping over several.
TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  m.def("wgrad_partials_sum(Tensor parts, Tensor weight, int blocks=0) -> Tensor");
  m.impl("wgrad_partials_sum", c10::DispatchKey::CPU,
         [](const at::Tensor& parts, const at::Tensor& weight, int64_t blocks) {
           TORCH_CHECK(blocks >= 0, "wgrad_partials_sum: blocks: expected 0 or more, got ",
                       blocks);
           at::Tensor gw = at::empty_like(weight);
           fusedres::cuda_on_cpu::wgrad_partials_sum(parts, gw, blocks);
           return gw;
         });
}

// The BatchNorm sums' reduction both backward plans end with (bn_sums): from (rows, C) partials
// of sum dz and sum dz * xhat, [dbeta, dgamma, mean dz, mean dz * xhat] in `stats`'s dtype (the
// means: the sums times inv_m); sms: the SM count its slicing sizes for.
TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  m.def("bn_sums(Tensor part_dz, Tensor part_dzx, float inv_m, ScalarType stats) -> Tensor[]");
  m.impl("bn_sums", c10::DispatchKey::CPU,
         [](const at::Tensor& pdz, const at::Tensor& pdzx, double inv_m, at::ScalarType stats) {
           TORCH_CHECK(pdz.dim() == 2 && pdz.sizes() == pdzx.sizes() && pdz.is_contiguous() &&
                           pdzx.is_contiguous() && pdz.scalar_type() == pdzx.scalar_type(),
                       "bn_sums: expected two contiguous (rows, C) partials of one dtype");
           const auto opts = pdz.options().dtype(stats);
           at::Tensor gbeta = at::empty({pdz.size(1)}, opts), gg = at::empty_like(gbeta);
           auto [m1, m2] =
               fusedres::cuda_on_cpu::bn_sums(pdz, pdzx, inv_m, &gbeta, &gg, true, opts);
           return std::vector<at::Tensor>{gbeta, gg, m1, m2};
         });
}

// The data gradient as the CUTLASS weight gradient's route runs it (backward_store with
// cutlass_wgrad: batch statistics, dz into the x gradient, the BatchNorm sums' partials), with
// the activation a written beside them (`with_act`) or not: [dz, part_dz, part_dzx, a], a
// filled with NaN before the launch (empty without `with_act`), so a test sees every element
// the epilogue wrote and that writing a changes nothing else.
TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  m.def("dgrad_with_activation(Tensor grad_out, Tensor x, Tensor weight, Tensor? bn_weight, "
        "Tensor? bn_bias, Tensor mean, Tensor invstd, int[2] stride, int[2] padding, "
        "int[2] dilation, bool with_act) -> Tensor[]");
  m.impl("dgrad_with_activation", c10::DispatchKey::CPU,
         [](const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
            const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
            const at::Tensor& mean_in, const at::Tensor& invstd_in, at::IntArrayRef stride_,
            at::IntArrayRef padding_, at::IntArrayRef dilation_, bool with_act) {
           namespace k = fusedres::cuda_on_cpu;
           const std::array<int64_t, 2> stride{stride_[0], stride_[1]},
               padding{padding_[0], padding_[1]}, dilation{dilation_[0], dilation_[1]};
           const at::Tensor go = grad_out.to(weight.scalar_type());
           const at::Tensor mean = mean_in.contiguous(), invstd = invstd_in.contiguous();
           const k::AffineInputs bn = k::affine_inputs(bn_weight, bn_bias);
           const k::ConvGeom g = k::geom_of(weight, stride, padding, dilation);
           const k::StridePhases sp = k::stride_phases(x, stride);
           k::BackwardPasses p{"dgrad_with_activation", go, x, weight, mean, invstd, bn, g,
                               nullptr, sp.phases, sp.rows};
           const k::DgradTiles& t = p.dgrad_tiles();
           at::Tensor pdz = at::zeros({p.phases * t.row_tiles * t.parts_per_tile, x.size(1)},
                                      mean.options());
           at::Tensor pdzx = at::zeros_like(pdz);
           at::Tensor dz = at::empty_like(x);
           at::Tensor act = with_act ? at::full_like(x, NAN) : x.new_empty({0});
           p.dgrad(&dz, &pdz, &pdzx, nullptr, nullptr, k::kWriteDz, with_act ? &act : nullptr);
           return std::vector<at::Tensor>{dz, pdz, pdzx, act};
         });
}

// The dx pass as the CUTLASS weight gradient's route launches it: dx in place over dz (a copy of
// `dz`) and, with `parts` (the GEMM's (split, Co, kh, kw, C) float32 partials), the weight's
// gradient summed from them by the same launch; [dx, gw], gw like `weight` and NaN where the
// launch did not write it.
TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  m.def("dx_with_partials(Tensor dz, Tensor x, Tensor? bn_weight, Tensor? bn_bias, Tensor mean, "
        "Tensor invstd, Tensor m1, Tensor m2, Tensor? parts, Tensor weight) -> Tensor[]");
  m.impl("dx_with_partials", c10::DispatchKey::CPU,
         [](const at::Tensor& dz, const at::Tensor& x, const std::optional<at::Tensor>& bn_weight,
            const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean,
            const at::Tensor& invstd, const at::Tensor& m1, const at::Tensor& m2,
            const std::optional<at::Tensor>& parts, const at::Tensor& weight) {
           namespace k = fusedres::cuda_on_cpu;
           TORCH_CHECK(dz.sizes() == x.sizes() && dz.scalar_type() == x.scalar_type(),
                       "dx_with_partials: dz must be like x");
           const k::AffineInputs bn = k::affine_inputs(bn_weight, bn_bias);
           at::Tensor gx = dz.clone();
           at::Tensor gw = at::full_like(weight, NAN);
           FUSEDRES_DISPATCH_FLOATING(x.scalar_type(), "dx_with_partials", [&] {
             k::launch_dx<scalar_t>(gx, x, bn, mean, invstd, m1, m2,
                                    parts.has_value() ? &*parts : nullptr, &gw);
           });
           return std::vector<at::Tensor>{gx, gw};
         });
}
