// Forward of the fused unit: y = conv2d(relu(scale * x + shift), weight) + bias + residual, and
// with genstats the per-channel (mean, biased variance) of y for the next BatchNorm.
//
// Implicit GEMM (the algorithm of kernels/bn_relu_conv2d.py): rows are output pixels
// (M = N*Ho*Wo), columns output channels (Co), the reduction runs over the taps and then the
// input channels (K = kh*kw*C). A block owns a BM x BN output tile; per tap it stages BK
// channels of x for its BM pixels into shared memory as the activation: the BatchNorm affine
// and the ReLU are applied on the way, a tap outside the image stages 0 (zero padding of a,
// never of x), and a is rounded to the weight dtype, as the unfused sequence does. float32 and
// float64 accumulate on FMA micro-tiles (no TF32), float16 and bfloat16 on tensor cores (WMMA
// m16n16k16, float32 accumulators). The epilogue adds bias, multiplies by the sample's branch
// scale (stochastic depth; y = residual + s[n] * (conv + bias)) and adds the residual in the
// accumulator dtype, stores y once, and with genstats reduces each tile column to (mean, M2) of the stored
// (rounded) y over the tile's rows; the host merges the tiles with Chan's formula in float64.
#include <torch/library.h>

#include "conv_tiles.cuh"
#include "ops.h"

namespace fusedres::FUSEDRES_CUDA_NS {
namespace {

template <typename X, typename W, typename T>
__global__ void __launch_bounds__(T::THREADS)
    bn_relu_conv2d_fwd_kernel(const X* __restrict__ x, const W* __restrict__ w,
                              const acc_t<X>* __restrict__ scale,
                              const acc_t<X>* __restrict__ shift, const W* __restrict__ bias,
                              const W* __restrict__ res,
                              const acc_t<W>* __restrict__ branch_scale, W* __restrict__ y,
                              acc_t<W>* __restrict__ part_mean, acc_t<W>* __restrict__ part_m2,
                              Dims4 xd, Dims4 wd, Dims4 yd, Dims4 rd, ConvGeom g, int64_t M) {
  FUSEDRES_LAUNCH_BOUNDS(T::THREADS);
  using A = acc_t<X>;  // BatchNorm arithmetic
  using C = acc_t<W>;  // accumulators
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, THREADS = T::THREADS;
  __shared__ __align__(32) W As[BK][BM + T::APAD];
  __shared__ __align__(32) W Bs[BK][BN + T::BPAD];
  __shared__ __align__(32) C Cs[BM][BN + T::CPAD];
  __shared__ int64_t row_n[BM];    // sample of the tile's row, -1 past M
  __shared__ int32_t row_oh[BM];   // output pixel of the row
  __shared__ int32_t row_ow[BM];
  __shared__ int64_t tap_off[BM];  // offset of x[n, 0, ih, iw] at the current tap, -1 outside

  const int tid = threadIdx.x;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t co0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int64_t Cin = xd.c, Co = yd.c;
  for (int r = tid; r < BM; r += THREADS) {
    const int64_t m = m0 + r;
    if (m < M) {
      const Pixel p = pixel_of(m, yd.h, yd.w);
      row_n[r] = p.n;
      row_oh[r] = p.h;
      row_ow[r] = p.w;
    } else {
      row_n[r] = -1;
      row_oh[r] = row_ow[r] = 0;
    }
  }
  Accum<W, T> acc;
  acc.zero();
  // Stage along the contiguous dimension of x: channels for channels_last, pixels for NCHW.
  const bool x_channels_fast = xd.sc == 1;
  for (int t = 0; t < g.kh * g.kw; ++t) {
    const int i = t / g.kw, j = t % g.kw;
    __syncthreads();  // row_* written; the previous tap's tap_off no longer read
    for (int r = tid; r < BM; r += THREADS) {
      int64_t off = -1;
      if (row_n[r] >= 0) {
        const int64_t ih = int64_t(row_oh[r]) * g.sh - g.ph + int64_t(i) * g.dh;
        const int64_t iw = int64_t(row_ow[r]) * g.sw - g.pw + int64_t(j) * g.dw;
        if (ih >= 0 && ih < xd.h && iw >= 0 && iw < xd.w) off = xd.offset(row_n[r], 0, ih, iw);
      }
      tap_off[r] = off;
    }
    __syncthreads();
    for (int64_t c0 = 0; c0 < Cin; c0 += BK) {
      for (int e = tid; e < BM * BK; e += THREADS) {
        const int m = x_channels_fast ? e / BK : e % BM;
        const int k = x_channels_fast ? e % BK : e / BM;
        const int64_t c = c0 + k;
        const int64_t off = tap_off[m];
        A a = A(0);
        if (off >= 0 && c < Cin) a = bn_relu(static_cast<A>(x[off + c * xd.sc]), scale[c], shift[c]);
        As[k][m] = static_cast<W>(a);
      }
      for (int e = tid; e < BN * BK; e += THREADS) {
        const int k = e % BK, n = e / BK;
        const int64_t c = c0 + k, co = co0 + n;
        Bs[k][n] = (c < Cin && co < Co) ? w[wd.offset(co, c, i, j)] : static_cast<W>(0.0f);
      }
      __syncthreads();
      acc.mma(As, Bs, tid);
      __syncthreads();
    }
  }
  acc.store(Cs, tid);
  __syncthreads();

  // Epilogue: consecutive threads along y's contiguous dimension.
  const bool y_channels_fast = yd.sc == 1;
  const bool genstats = part_mean != nullptr;
  for (int e = tid; e < BM * BN; e += THREADS) {
    const int m = y_channels_fast ? e / BN : e % BM;
    const int n = y_channels_fast ? e % BN : e / BM;
    const int64_t co = co0 + n;
    if (row_n[m] >= 0 && co < Co) {
      C v = Cs[m][n];
      if (bias != nullptr) v += static_cast<C>(bias[co]);
      if (branch_scale != nullptr) v *= branch_scale[row_n[m]];
      if (res != nullptr) v += static_cast<C>(res[rd.offset(row_n[m], co, row_oh[m], row_ow[m])]);
      const W out = static_cast<W>(v);
      y[yd.offset(row_n[m], co, row_oh[m], row_ow[m])] = out;
      if (genstats) Cs[m][n] = static_cast<C>(out);  // statistics of y as stored
    }
  }
  if (!genstats) return;
  __syncthreads();
  // Per column: the tile's mean over its valid rows (the first `rows`), then its M2 from the
  // deviations, corrected by their sum (exact two-pass; an infinite mean stays as it is).
  const int rows = static_cast<int>(M - m0 < BM ? M - m0 : BM);
  for (int n = tid; n < BN; n += THREADS) {
    const int64_t co = co0 + n;
    if (co >= Co) continue;
    C s = C(0);
    for (int m = 0; m < rows; ++m) s += Cs[m][n];
    const C cnt = static_cast<C>(rows);
    const C mean0 = s / cnt;
    C sd = C(0), sq = C(0);
    for (int m = 0; m < rows; ++m) {
      const C d = Cs[m][n] - mean0;
      sd += d;
      sq += d * d;
    }
    part_mean[blockIdx.x * Co + co] = mean0 - mean0 == C(0) ? mean0 + sd / cnt : mean0;
    part_m2[blockIdx.x * Co + co] = sq - sd * sd / cnt;
  }
}

template <typename X, typename W>
void launch_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                    const Affine& bn, const at::Tensor* residual, const at::Tensor* bscale,
                    at::Tensor& y,
                    at::Tensor* part_mean, at::Tensor* part_m2, const ConvGeom& g, int64_t M) {
  using T = typename TilesFor<W>::Fwd;
  using A = acc_t<X>;
  using C = acc_t<W>;
  const dim3 grid(static_cast<unsigned>(ceil_div(M, T::BM)),
                  static_cast<unsigned>(ceil_div(weight.size(0), T::BN)));
  const Dims4 rd = residual != nullptr ? dims_of(*residual) : Dims4{};
  FUSEDRES_LAUNCH(grid, dim3(T::THREADS), 0, current_stream(),
                  bn_relu_conv2d_fwd_kernel<X, W, T>)(
      x.const_data_ptr<X>(), weight.const_data_ptr<W>(), bn.scale.const_data_ptr<A>(),
      bn.shift.const_data_ptr<A>(), bias != nullptr ? bias->const_data_ptr<W>() : nullptr,
      residual != nullptr ? residual->const_data_ptr<W>() : nullptr,
      bscale != nullptr ? bscale->const_data_ptr<C>() : nullptr, y.data_ptr<W>(),
      part_mean != nullptr ? part_mean->data_ptr<C>() : nullptr,
      part_m2 != nullptr ? part_m2->data_ptr<C>() : nullptr, dims_of(x), dims_of(weight),
      dims_of(y), rd, g, M);
  FUSEDRES_CHECK_LAUNCH();
}

// Tile rows of the forward for the weight dtype (the genstats partials have one row per tile).
int64_t forward_tile_rows(at::ScalarType wt) {
  switch (wt) {
    case at::kDouble: return TilesFor<double>::Fwd::BM;
    case at::kHalf: return TilesFor<at::Half>::Fwd::BM;
    case at::kBFloat16: return TilesFor<at::BFloat16>::Fwd::BM;
    default: return TilesFor<float>::Fwd::BM;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
    c10::SymIntArrayRef stride_, c10::SymIntArrayRef padding_, c10::SymIntArrayRef dilation_,
    bool genstats, const std::optional<at::Tensor>& branch_scale) {
  const char* op = genstats ? "fusedres_cuda.bn_relu_conv2d_genstats" : "fusedres_cuda.bn_relu_conv2d";
  check_unit_inputs(op, x, weight, mean, invstd);
  check_bn_params(op, x, bn_weight, bn_bias);
  const auto stride = ints(stride_), padding = ints(padding_), dilation = ints(dilation_);
  const int64_t N = x.size(0), Co = weight.size(0);
  const int64_t Ho =
      conv_out_size(x.size(2), weight.size(2), stride[0], padding[0], dilation[0]);
  const int64_t Wo =
      conv_out_size(x.size(3), weight.size(3), stride[1], padding[1], dilation[1]);
  TORCH_CHECK(Ho > 0 && Wo > 0, op, ": the output would be empty (", Ho, " x ", Wo, ")");
  if (bias.has_value()) check_vector(op, "bias", *bias, x, Co, weight.scalar_type());
  if (residual.has_value()) {
    check_same_device(op, "residual", *residual, x);
    TORCH_CHECK(residual->sizes() == at::IntArrayRef({N, Co, Ho, Wo}) &&
                    residual->scalar_type() == weight.scalar_type(),
                op, ": residual must be (", N, ", ", Co, ", ", Ho, ", ", Wo, ") of dtype ",
                weight.scalar_type(), ", got ", residual->sizes(), " ", residual->scalar_type());
  }
  const DeviceGuard guard(x.device());
  // The branch scale in the accumulator dtype, one factor per sample.
  const at::Tensor bscale = branch_scale_acc(op, branch_scale, x, weight);
  at::Tensor y = at::empty({N, Co, Ho, Wo},
                           weight.options().memory_format(out_memory_format(x, weight)));
  const auto sdt = weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (y.numel() == 0 || x.size(1) == 0) {
    // Nothing to reduce: y is bias (+ residual); its statistics come from the portable rule.
    y.zero_();
    if (bias.has_value()) y.add_(bias->view({1, Co, 1, 1}));
    if (bscale.defined()) y.mul_(bscale.view({-1, 1, 1, 1}));
    if (residual.has_value()) y.add_(*residual);
    at::Tensor ys = y.to(sdt);
    return {y, ys.mean({0, 2, 3}), ys.var({0, 2, 3}, /*unbiased=*/false)};
  }
  const Affine bn = bn_affine(bn_weight, bn_bias, mean, invstd);
  const ConvGeom g{static_cast<int32_t>(weight.size(2)), static_cast<int32_t>(weight.size(3)),
                   static_cast<int32_t>(stride[0]),      static_cast<int32_t>(stride[1]),
                   static_cast<int32_t>(padding[0]),     static_cast<int32_t>(padding[1]),
                   static_cast<int32_t>(dilation[0]),    static_cast<int32_t>(dilation[1])};
  const int64_t M = N * Ho * Wo;
  const int64_t bm = forward_tile_rows(weight.scalar_type());
  const int64_t tiles = ceil_div(M, bm);
  at::Tensor part_mean, part_m2;
  if (genstats) {
    part_mean = at::empty({tiles, Co}, weight.options().dtype(sdt == at::kDouble ? at::kDouble
                                                                                 : at::kFloat));
    part_m2 = at::empty_like(part_mean);
  }
  // The kernel reads bias[co] with unit stride.
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const at::Tensor* b = bias.has_value() ? &bias_c : nullptr;
  const at::Tensor* r = residual.has_value() ? &*residual : nullptr;
  dispatch_x_w(op, x.scalar_type(), weight.scalar_type(), [&](auto xt, auto wt) {
    using X = decltype(xt);
    using W = decltype(wt);
    launch_forward<X, W>(x, weight, b, bn, r, bscale.defined() ? &bscale : nullptr, y, genstats ? &part_mean : nullptr,
                         genstats ? &part_m2 : nullptr, g, M);
  });
  if (!genstats) return {y, at::Tensor(), at::Tensor()};
  // Chan's merge of the tiles' (count, mean, M2) in float64.
  const at::Tensor counts =
      (M - at::arange(tiles, part_mean.options().dtype(at::kDouble)) * bm).clamp_max(bm).view({-1, 1});
  const at::Tensor pm = part_mean.to(at::kDouble);
  const at::Tensor gmean = (counts * pm).sum(0) / static_cast<double>(M);
  const at::Tensor gm2 = (part_m2.to(at::kDouble) + counts * (pm - gmean).square()).sum(0);
  return {y, gmean.to(sdt), (gm2 / static_cast<double>(M)).to(sdt)};
}

}  // namespace

at::Tensor bn_relu_conv2d(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& bn_weight,
                          const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean,
                          const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
                          c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
                          c10::SymIntArrayRef dilation, bool /*batch_stats*/,
                          const std::optional<at::Tensor>& branch_scale) {
  return std::get<0>(forward(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                             padding, dilation, false, branch_scale));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_relu_conv2d_genstats(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
    c10::SymIntArrayRef stride, c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
    bool /*batch_stats*/, const std::optional<at::Tensor>& branch_scale) {
  return forward(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride, padding,
                 dilation, true, branch_scale);
}

}  // namespace fusedres::FUSEDRES_CUDA_NS

FUSEDRES_CUDA_LIBRARY_IMPL(m) {
  m.impl("bn_relu_conv2d", &fusedres::FUSEDRES_CUDA_NS::bn_relu_conv2d);
  m.impl("bn_relu_conv2d_genstats", &fusedres::FUSEDRES_CUDA_NS::bn_relu_conv2d_genstats);
}
