// Backward of the fused unit (shared/design.md), recomputing the activation from x:
//
//   da = conv_transpose(dy, W);  dz = da * [scale * x + shift > 0]
//   dgamma = sum dz * xhat;  dbeta = sum dz;  dx = scale * (dz - mean(dz) - xhat * mean(dz xhat))
//   dW = sum over pixels of dy * relu(scale * x + shift) (shifted by the tap);  dbias = sum dy
//
// Three kernels, the algorithm of kernels/bn_relu_conv2d_{dgrad,wgrad}.py ("store" strategy):
// * dgrad: implicit-GEMM transposed convolution, one stride phase per blockIdx.z (the input
//   pixels with ih % sh, iw % sw fixed), so a tap feeds all rows of a block or none and a strided
//   convolution skips the taps that do not. Its epilogue loads x, recomputes the ReLU mask, and
//   reduces per channel sum dz and sum dz * xhat over the tile (partials per tile, reduced in
//   float64 by bn_sums); it writes dz into the x gradient, in x's dtype (training), dx =
//   scale * dz (eval), or nothing (only the BatchNorm parameter gradients wanted).
// * wgrad: implicit GEMM per tap (rows Co, columns C, reduction over the output pixels), the
//   activation recomputed while x is staged into shared memory, the reduction split over
//   blockIdx.z (split-K, partials summed by wgrad_partials_sum) when it is long against the
//   tile count;
//   the first column block of the first tap also sums dy for the bias gradient.
// * dx: elementwise, in place over dz: dx = scale * (dz - sum_dz / M - xhat * sum_dzxhat / M).
//
// One kernel family a file, as the Triton files are: bn_relu_conv2d_dgrad.cuh (dgrad and dx,
// launch_dgrad, launch_dx), bn_relu_conv2d_wgrad.cuh (wgrad, pick_split, launch_wgrad); this file
// holds the op (its plan, the two strategies, the finish) and is their one translation unit.
//
// Branch scale (stochastic depth, y = residual + s[n] * conv): the conv branch's gradient is
// s[n] * dy. dgrad's rows are input pixels of one sample, so it scales its accumulator row in
// the epilogue (s[n] * conv_transpose(dy) = conv_transpose(s[n] * dy)); wgrad reduces over the
// pixels of all samples, so it scales each dy value as it stages it (with the sample's factor
// kept per staged pixel in shared memory), and its bias sum sees the scaled values.
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

// FUSEDRES_CUDA_KERNELS and the CUTLASS weight gradient (plain C++: before the host layer's
// macros).
#include "cutlass_conv/cutlass_conv.h"
#include "cutlass_conv/plan.h"
#include "bn_relu_conv2d_dgrad.cuh"
#include "bn_relu_conv2d_wgrad.cuh"
#include "conv_tiles.cuh"
#include "mma.cuh"
#include "ops.h"

namespace fusedres::FUSEDRES_CUDA_NS {
namespace {

// ----------------------------------------------------------------------------- host

ConvGeom geom_of(const at::Tensor& weight, const std::array<int64_t, 2>& s,
                 const std::array<int64_t, 2>& p, const std::array<int64_t, 2>& d) {
  return {static_cast<int32_t>(weight.size(2)), static_cast<int32_t>(weight.size(3)),
          static_cast<int32_t>(s[0]), static_cast<int32_t>(s[1]), static_cast<int32_t>(p[0]),
          static_cast<int32_t>(p[1]), static_cast<int32_t>(d[0]), static_cast<int32_t>(d[1])};
}

// The data gradient's stride phases of x (one per blockIdx.z) and the input pixels of the
// largest one.
struct StridePhases {
  int64_t phases, rows;
};

inline StridePhases stride_phases(const at::Tensor& x, const std::array<int64_t, 2>& s) {
  const int64_t H = x.size(2), W = x.size(3);
  return {std::min(s[0], H) * std::min(s[1], W), x.size(0) * ceil_div(H, s[0]) * ceil_div(W, s[1])};
}

// The five gradients (grad_x, grad_weight, grad_bias, grad_bn_weight, grad_bn_bias) with the
// metadata of ops.backward_empty_outputs: an empty tensor where output_mask leaves one out.
struct Grads {
  at::Tensor gx, gw, gb, gg, gbeta;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tuple() const {
    return {gx, gw, gb, gg, gbeta};
  }
};

// What one call computes: output_mask, and what it needs (da: the data gradient's GEMM, for
// grad_x or the BatchNorm sums; sums: the BatchNorm sums, for the BatchNorm parameters' gradients
// or grad_x with batch statistics).
struct Wants {
  bool x, w, b, g, beta, da, sums;
};

// One call's operands and its two GEMM passes. The data gradient's kernel and tiles are decided
// where it first runs (dgrad_uses_mma, dgrad_mma_rows).
struct BackwardPasses {
  const char* op;
  const at::Tensor& go;
  const at::Tensor& x;
  const at::Tensor& weight;
  const at::Tensor& mean;
  const at::Tensor& invstd;
  // The BatchNorm weight and bias: the data gradient and the dx pass compute each channel's
  // scale and shift from them (channel_affine); the native weight gradient reads bn_affine's
  // vectors, launched the first time it asks (affine()).
  const AffineInputs& bn;
  const ConvGeom& g;
  const at::Tensor* bsp;  // the branch scale in the accumulator dtype, or none
  int64_t phases;         // the stride phases (one per blockIdx.z of the data gradient)
  int64_t phase_rows;     // the input pixels of the largest phase
  std::optional<DgradTiles> tiles{};
  std::optional<Affine> vectors{};
  // The weight gradient on CUTLASS (cutlass_conv/wgrad.cu): "store" only, no branch scale,
  // over the activation the data gradient's epilogue writes (so the data gradient runs first).
  bool cutlass_wgrad = false;
  std::array<int64_t, 2> stride{}, padding{}, dilation{};

  const Affine& affine() {
    if (!vectors.has_value()) vectors = bn_affine(bn.w, bn.b, mean, invstd);  // undefined: none
    return *vectors;
  }

  const DgradTiles& dgrad_tiles() {
    if (!tiles.has_value()) {
      DgradTiles d{dgrad_uses_mma(go, x, weight), 0, 0, 0, 0, 1};
      const std::array<int64_t, 3> wmma = wmma_tile(weight.scalar_type());
      d.rows = d.mma ? dgrad_mma_rows(phase_rows, x.size(1), phases) : wmma[0];
      d.cols = d.mma ? dgrad_mma_cols(phase_rows, x.size(1), phases) : wmma[1];
      d.taps = d.mma ? dgrad_mma_taps(x.size(1), go.size(1),
                                      dgrad_phase_taps(g, x.size(2), x.size(3)))
                     : 1;
      d.depth = d.mma ? mma_depth(x.size(1), go.size(1)) * d.taps : wmma[2];
      d.row_tiles = ceil_div(phase_rows, d.rows);
      if (d.mma) d.parts_per_tile = d.rows / MmaDgradSmall::EM;
      tiles = d;
    }
    return *tiles;
  }

  // act: where to write a = relu(scale * x + shift) as well (x's dtype and strides), or none.
  void dgrad(at::Tensor* gx, at::Tensor* part_dz, at::Tensor* part_dzx, const at::Tensor* m1,
             const at::Tensor* m2, int write, at::Tensor* act = nullptr) {
    dispatch_x_w(op, x.scalar_type(), weight.scalar_type(), [&](auto xt, auto wt) {
      launch_dgrad<decltype(xt), decltype(wt)>(go, x, weight, bn, mean, invstd, gx, part_dz,
                                               part_dzx, m1, m2, bsp, act, write, g, phases,
                                               dgrad_tiles());
    });
  }

  // The CUTLASS weight gradient of the activation `a` the data gradient wrote: its float32
  // partials (split, Co, kh, kw, C), which the caller sums into the weight's gradient (in the
  // dx launch where there is one); the bias gradient.
  at::Tensor wgrad_of(const at::Tensor& a, at::Tensor* gb) {
#if defined(FUSEDRES_WITH_CUTLASS)
    TORCH_CHECK(cutlass_wgrad && bsp == nullptr, op, ": the CUTLASS weight gradient runs the "
                "\"store\" plan without a branch scale");
    at::Tensor parts = cutlass_conv::wgrad(go, a, weight, {stride, padding, dilation});
    if (gb != nullptr) gb->copy_(go.sum({0, 2, 3}, false, at::kFloat));
    return parts;
#else
    (void)a, (void)gb;
    TORCH_CHECK(false, op, ": built without the CUTLASS kernels");
    return {};
#endif
  }

  void wgrad(at::Tensor& gw, at::Tensor* gb, SumsArgs* sums) {
    dispatch_x_w(op, x.scalar_type(), weight.scalar_type(), [&](auto xt, auto wt) {
      launch_wgrad<decltype(xt), decltype(wt)>(go, x, affine(), gw, gb, sums, bsp, g);
    });
  }
};

// The BatchNorm backward's per-channel sums, sum dz and sum dz * xhat, from the kernels' partials
// ((rows, C) each, float32 or float64) reduced in float64, and what the op makes of them: dbeta,
// dgamma, and dx's terms mean dz, mean dz * xhat (the sums times 1 / M) in the statistics dtype.
// One launch where ATen's were twelve (a cast, a fill and a sum per partial, two copies, a
// multiply and a cast per term), or two for long partials, in the column reductions' blocks
// (common.cuh: kColumnCols channels x kColumnLanes row lanes, column_lanes_sum; the same bits
// every run). Up to kSumsOneBlockRows rows a block column reduces them all and writes the
// results; past that, blockIdx.y slices the rows (a column of blocks would stream them from one
// SM), each slice's float64 sums go to a workspace and a second launch adds the slices in order.
constexpr int64_t kSumsOneBlockRows = 2048;

template <typename A>
struct SumsOut {
  A* gbeta;  // sum dz, or none
  A* gg;     // sum dz * xhat, or none
  A* m1;     // mean dz and mean dz * xhat, or none
  A* m2;
  double inv_m;

  __device__ void write(int64_t c, double dz, double dzx) const {
    if (gbeta != nullptr) gbeta[c] = static_cast<A>(dz);
    if (gg != nullptr) gg[c] = static_cast<A>(dzx);
    if (m1 != nullptr) {
      m1[c] = static_cast<A>(dz * inv_m);
      m2[c] = static_cast<A>(dzx * inv_m);
    }
  }
};

template <typename P, typename A>
__global__ void __launch_bounds__(kColumnCols * kColumnLanes)
    bn_sums_kernel(const P* __restrict__ pdz, const P* __restrict__ pdzx, int64_t rows, int64_t C,
                   int64_t per_slice, double* __restrict__ slices, SumsOut<A> out) {
  FUSEDRES_LAUNCH_BOUNDS(kColumnCols * kColumnLanes);
  __shared__ double lanes[2][kColumnLanes][kColumnCols];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnCols + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * per_slice;
  const int64_t r1 = std::min(rows, r0 + per_slice);
  double v[2] = {0.0, 0.0};  // sum dz, sum dz * xhat
  if (c < C) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColumnLanes) {
      v[0] += static_cast<double>(pdz[r * C + c]);
      v[1] += static_cast<double>(pdzx[r * C + c]);
    }
  }
  column_lanes_sum(lanes, v);
  if (threadIdx.y != 0 || c >= C) return;
  if (slices == nullptr) {
    out.write(c, v[0], v[1]);
  } else {
    slices[(2 * static_cast<int64_t>(blockIdx.y)) * C + c] = v[0];
    slices[(2 * static_cast<int64_t>(blockIdx.y) + 1) * C + c] = v[1];
  }
}

template <typename A>
__global__ void __launch_bounds__(256)
    bn_sums_merge_kernel(const double* __restrict__ slices, int64_t n_slices, int64_t C,
                         SumsOut<A> out) {
  FUSEDRES_LAUNCH_BOUNDS(256);
  for (int64_t c = global_thread_x(); c < C; c += grid_stride_x()) {
    double dz = slices[c], dzx = slices[C + c];
    for (int64_t k = 1; k < n_slices; ++k) {
      dz += slices[2 * k * C + c];
      dzx += slices[(2 * k + 1) * C + c];
    }
    out.write(c, dz, dzx);
  }
}

// The blockIdx.y slices of `rows` partial rows for C channels: one up to kSumsOneBlockRows,
// else enough for two blocks an SM, at most cdiv(rows, 1024) of them.
inline int64_t sums_slices(int64_t rows, int64_t C) {
  if (rows <= kSumsOneBlockRows) return 1;
  const int64_t want = ceil_div(2 * sm_count(), ceil_div(C, kColumnCols));
  const int64_t per = ceil_div(rows, std::clamp<int64_t>(want, 1, ceil_div(rows, 1024)));
  return ceil_div(rows, per);
}

// pdz, pdzx: contiguous (rows, C) partials of one dtype, float32 or float64. Writes gbeta and gg
// where given ((C,) contiguous, the statistics dtype) and returns (mean dz, mean dz * xhat) in
// that dtype if `terms`, else undefined tensors.
std::pair<at::Tensor, at::Tensor> bn_sums(const at::Tensor& pdz, const at::Tensor& pdzx,
                                          double inv_m, at::Tensor* gbeta, at::Tensor* gg,
                                          bool terms, const at::TensorOptions& stats) {
  const int64_t rows = pdz.size(0), C = pdz.size(1);
  std::pair<at::Tensor, at::Tensor> m;
  if (terms) m = {at::empty({C}, stats), at::empty({C}, stats)};
  if (C == 0 || (gbeta == nullptr && gg == nullptr && !terms)) return m;
  const int64_t n_slices = sums_slices(rows, C);
  const int64_t per = ceil_div(std::max<int64_t>(rows, 1), n_slices);
  const at::Tensor slices = n_slices > 1 ? at::empty({n_slices, 2, C}, stats.dtype(at::kDouble))
                                         : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(pdz.scalar_type(), "fusedres_cuda_bn_sums", [&] {
    using P = scalar_t;
    const at::ScalarType sdt = c10::typeMetaToScalarType(stats.dtype());
    AT_DISPATCH_FLOATING_TYPES(sdt, "fusedres_cuda_bn_sums", [&] {
      using A = scalar_t;
      const SumsOut<A> out{gbeta != nullptr ? gbeta->data_ptr<A>() : nullptr,
                           gg != nullptr ? gg->data_ptr<A>() : nullptr,
                           terms ? m.first.data_ptr<A>() : nullptr,
                           terms ? m.second.data_ptr<A>() : nullptr, inv_m};
      const dim3 grid(static_cast<unsigned>(ceil_div(C, kColumnCols)),
                      static_cast<unsigned>(n_slices));
      FUSEDRES_LAUNCH(grid, dim3(kColumnCols, kColumnLanes), 0, current_stream(),
                      bn_sums_kernel<P, A>)(
          pdz.const_data_ptr<P>(), pdzx.const_data_ptr<P>(), rows, C, per,
          slices.defined() ? slices.data_ptr<double>() : nullptr, out);
      FUSEDRES_CHECK_LAUNCH();
      if (slices.defined()) {
        FUSEDRES_LAUNCH(dim3(static_cast<unsigned>(ceil_div(C, 256))), dim3(256), 0,
                        current_stream(), bn_sums_merge_kernel<A>)(
            slices.const_data_ptr<double>(), n_slices, C, out);
        FUSEDRES_CHECK_LAUNCH();
      }
    });
  });
  return m;
}

// "sums": the weight-gradient pass also yields the BatchNorm sums; dx in one more pass (the
// data gradient's epilogue: training with the sums' terms, eval dx = scale * dz).
void backward_sums(BackwardPasses& p, Grads& out, const Wants& want,
                   const std::optional<at::Tensor>& bn_weight,
                   const std::optional<at::Tensor>& bn_bias, bool batch_stats, double inv_m) {
  SumsArgs sums{bn_weight.has_value() ? bn_weight->contiguous() : at::ones_like(p.mean),
                bn_bias.has_value() ? bn_bias->contiguous() : at::zeros_like(p.mean), p.mean,
                p.invstd, p.weight, {}, {}};
  p.wgrad(out.gw, want.b ? &out.gb : nullptr, &sums);
  const bool train = batch_stats;
  const auto [m1, m2] = bn_sums(sums.part_dz, sums.part_dzx, inv_m,
                                want.beta ? &out.gbeta : nullptr, want.g ? &out.gg : nullptr,
                                want.x && train, p.mean.options());
  if (!want.x) return;
  p.dgrad(&out.gx, nullptr, nullptr, train ? &m1 : nullptr, train ? &m2 : nullptr, kWriteDx);
}

// The bias gradient alone (no weight gradient pass): sum dy, or sum over n of s[n] * (dy[n]
// summed over the pixels) with a branch scale.
void bias_only(const BackwardPasses& p, at::Tensor& gb) {
  const auto acc = p.weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (p.bsp != nullptr) {
    gb.copy_((p.go.sum({2, 3}, false, acc) * p.bsp->view({-1, 1})).sum(0));
  } else {
    gb.copy_(p.go.sum({0, 2, 3}, false, acc));
  }
}

// "store": one GEMM each; the data-gradient epilogue reduces the sums and stores dz
// (training), then the dx pass; in eval it writes dx = scale * dz directly. With the CUTLASS
// weight gradient the data gradient runs first: its epilogue also writes the activation a, the
// weight gradient's operand (a transient buffer of x's size, freed after that GEMM), and the
// dx launch sums the GEMM's partials into the weight's gradient (else a launch of its own).
void backward_store(BackwardPasses& p, Grads& out, const Wants& want, bool batch_stats,
                    double inv_m) {
  TORCH_CHECK(!p.cutlass_wgrad || (want.w && want.da), p.op, ": the CUTLASS weight gradient "
              "reads the activation the data gradient writes: both must run");
  if (!p.cutlass_wgrad) {  // (the CUTLASS weight gradient runs after the data gradient, below)
    if (want.w) {
      p.wgrad(out.gw, want.b ? &out.gb : nullptr, nullptr);
    } else if (want.b) {
      bias_only(p, out.gb);
    }
  }
  if (!want.da) return;
  at::Tensor act = p.cutlass_wgrad ? at::empty_like(p.x) : at::Tensor();
  at::Tensor part_dz, part_dzx;
  if (want.sums) {
    // Every block writes its rows of the partials, but a stride phase with fewer pixels than
    // the largest leaves its last row tiles' blocks idle: their rows must read 0. With one
    // phase every row is written, so no launch zeroes them.
    const DgradTiles& t = p.dgrad_tiles();
    const std::array<int64_t, 2> shape{p.phases * t.row_tiles * t.parts_per_tile, p.x.size(1)};
    part_dz = at::empty(shape, p.mean.options());
    part_dzx = at::empty(shape, p.mean.options());
    if (p.phases > 1) {
      part_dz.zero_();
      part_dzx.zero_();
    }
  }
  // Training: dz into the x gradient's buffer, then dx in place there (no dz buffer of the
  // statistics dtype: that was 2x the gradient's bytes written and read again for 16-bit x).
  const int write = !want.x ? kWriteNothing : (batch_stats ? kWriteDz : kWriteDx);
  p.dgrad(want.x ? &out.gx : nullptr, want.sums ? &part_dz : nullptr,
          want.sums ? &part_dzx : nullptr, nullptr, nullptr, write,
          act.defined() ? &act : nullptr);
  at::Tensor dw_parts;  // the CUTLASS weight gradient's partials, not yet summed
  if (act.defined()) {
    dw_parts = p.wgrad_of(act, want.b ? &out.gb : nullptr);
    act = at::Tensor();  // its memory back to the allocator before the dx pass
  }
  const bool dx_pass = want.sums && want.x && batch_stats;
  if (dw_parts.defined() && !dx_pass) wgrad_partials_sum(dw_parts, out.gw);
  if (!want.sums) return;
  const auto [m1, m2] = bn_sums(part_dz, part_dzx, inv_m, want.beta ? &out.gbeta : nullptr,
                                want.g ? &out.gg : nullptr, want.x && batch_stats,
                                p.mean.options());
  if (!dx_pass) return;
  FUSEDRES_DISPATCH_FLOATING(p.x.scalar_type(), "fusedres_cuda_dx", [&] {
    launch_dx<scalar_t>(out.gx, p.x, p.bn, p.mean, p.invstd, m1, m2,
                        dw_parts.defined() ? &dw_parts : nullptr, &out.gw);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_relu_conv2d_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean_in, const at::Tensor& invstd_in, c10::SymIntArrayRef stride_,
    c10::SymIntArrayRef padding_, c10::SymIntArrayRef dilation_, bool batch_stats,
    std::array<bool, 5> output_mask, const std::optional<at::Tensor>& branch_scale) {
  const char* op = "fusedres_cuda.bn_relu_conv2d_backward";
  const checks::Conv c = checks::check_backward_args(op, kDeviceType, grad_out, x, weight,
                                                     bn_weight, bn_bias, mean_in, invstd_in,
                                                     stride_, padding_, dilation_, branch_scale);
  const auto kernels = cutlass_conv::kernel_set(op);
  const auto [want_x, want_w, want_b, want_g, want_beta] = output_mask;
  const Wants want{want_x, want_w, want_b, want_g, want_beta, want_x || want_g || want_beta,
                   want_g || want_beta || (want_x && batch_stats)};
  const auto &stride = c.stride, &padding = c.padding, &dilation = c.dilation;
  const int64_t N = x.size(0), Cin = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t Co = weight.size(0);
  const DeviceGuard guard(x.device());
  const at::Tensor bscale = branch_scale_acc(branch_scale, weight);
  Grads out{want_x ? at::empty_like(x) : x.new_empty({0}),
            want_w ? at::empty_like(weight) : weight.new_empty({0}),
            weight.new_empty({want_b ? Co : 0}), mean_in.new_empty({want_g ? Cin : 0}),
            mean_in.new_empty({want_beta ? Cin : 0})};
  if (!(want.da || want_w || want_b)) return out.tuple();
  if (x.numel() == 0 || Co == 0) {
    for (at::Tensor* t : {&out.gx, &out.gw, &out.gb, &out.gg, &out.gbeta}) t->zero_();
    return out.tuple();
  }
  const at::Tensor go = grad_out.to(weight.scalar_type());
  const at::Tensor mean = mean_in.contiguous(), invstd = invstd_in.contiguous();
  // FUSEDRES_CUDA_KERNELS=cutlass: the weight gradient on CUTLASS where it takes the operands
  // (16-bit channels-last, no branch scale) and the unit's filter is larger than 1 x 1
  // (cutlass_conv::plan::wgrad_on_cutlass), with the "store" plan (its GEMM has no BatchNorm
  // sums; the native data gradient's epilogue reduces them and writes the activation the
  // CUTLASS GEMM reads). Only where the data gradient runs (want.da: some gradient of x or of
  // the BatchNorm parameters wanted); the weight's gradient alone stays native.
  bool cutlass_wgrad = false;
  if (kernels == cutlass_conv::KernelSet::cutlass && want_w && want.da && !bscale.defined() &&
      cutlass_conv::plan::wgrad_on_cutlass(weight.size(2), weight.size(3))) {
#if defined(FUSEDRES_WITH_CUTLASS)
    cutlass_wgrad = cutlass_conv::can_run_wgrad(go, x, weight, {stride, padding, dilation});
#endif
  }
  const AffineInputs bn = affine_inputs(bn_weight, bn_bias);
  const ConvGeom g = geom_of(weight, stride, padding, dilation);
  const StridePhases sp = stride_phases(x, stride);
  BackwardPasses passes{op, go, x, weight, mean, invstd, bn, g,
                        bscale.defined() ? &bscale : nullptr, sp.phases, sp.rows};
  passes.cutlass_wgrad = cutlass_wgrad;
  passes.stride = stride, passes.padding = padding, passes.dilation = dilation;
  const double inv_m = 1.0 / static_cast<double>(N * H * W);
  // The weight gradient's pass yields the BatchNorm sums where it runs ("sums"); else the data
  // gradient's epilogue does ("store").
  if (want_w && want.sums && !passes.cutlass_wgrad) {
    backward_sums(passes, out, want, bn_weight, bn_bias, batch_stats, inv_m);
  } else {
    backward_store(passes, out, want, batch_stats, inv_m);
  }
  return out.tuple();
}

namespace {

// The registered kernel: output_mask from the dispatcher as a c10::List, checked
// (checks::check_output_mask) and passed on as the std::array the function above takes.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_op(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool batch_stats,
    const c10::List<bool>& output_mask, const std::optional<at::Tensor>& branch_scale) {
  return bn_relu_conv2d_backward(
      grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
      batch_stats,
      checks::check_output_mask("fusedres_cuda.bn_relu_conv2d_backward", output_mask),
      branch_scale);
}

}  // namespace
}  // namespace fusedres::FUSEDRES_CUDA_NS

FUSEDRES_CUDA_LIBRARY_IMPL(m) {
  m.impl("bn_relu_conv2d_backward", &fusedres::FUSEDRES_CUDA_NS::backward_op);
}
