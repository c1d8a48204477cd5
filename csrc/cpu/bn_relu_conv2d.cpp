// The CPU backend of the fusedres ops: batch statistics, and the fused BN-ReLU-conv2d forward and
// backward, registered for the CPU dispatch key of the fusedres_cpu namespace.
//
// Algorithm (measured against the alternatives in benchmarks/RESULTS.md): the batch is cut into
// tiles of a few samples whose activation fits in cache (tile_samples). Per tile, our kernel writes
// a = relu(scale * x + shift) into a small scratch buffer, and ATen's convolution (oneDNN for
// float32/bfloat16/float16) consumes it while it is still hot; the activation never exists at
// full size. For spatial kernels the tile is written NHWC, oneDNN's fast layout, and the output
// tile is transposed back in cache (conv_layout); 1x1 stride-1 convolutions run as batched GEMMs
// straight into the output (gemm_1x1), and a channels_last one by pixel chunks that each thread
// runs in its own cache, BN-ReLU and GEMMs single-threaded (forward_1x1_chunks, chunk_bytes).
// Backward recomputes the tile's activation, calls convolution_backward for the tile (data
// gradient and the tile's share of the weight gradient, summed in float32), and fuses the
// recomputed ReLU mask with both BatchNorm reductions into one pass over the tile's data
// gradient; a second pass applies the BatchNorm data gradient once the batch-wide sums are
// known (none in eval mode).
//
// One BN-ReLU feeding two convolutions (a pre-activation unit's projection shortcut and first
// convolution: bn_relu_conv2d_pair, bn_relu_conv2d_pair_backward, used by fusedres.ops.
// EagerCpuPair) runs the same tile loop over both: the activation tile is computed once for
// both convolutions, and in backward their data gradients are summed in cache before the one
// mask + sums pass and the one data-gradient pass over x; plain PyTorch also runs its BatchNorm-
// ReLU backward once there, where two fused units would run theirs twice.
//
// Branch scale (stochastic depth, y = residual + s[n] * conv): forward, each output tile is
// scaled while it is in cache, in the residual add when there is one (addcmul: one pass over
// the tile); backward, each grad_out tile is scaled once as it is staged for the convolution
// (into the tile buffer the layout change uses), so the data gradient, the weight and bias
// gradients and the BatchNorm sums all see s[n] * dy. No pass over a whole tensor, nothing
// saved beyond the (N,) vector.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <tuple>
#include <vector>

#include "../common.h"
#include "../eager.h"
#include "../prepare.h"
#include "kernels.h"
#include "tile.h"

namespace fusedres::cpu {

namespace {

// Bytes of (activation + conv output) per tile, set by measurement (RESULTS.md), with the C
// allocator keeping freed memory (fusedres.memory.allocator.keep_freed_memory: the trainer's and the
// benchmarks' default on CPU). Larger tiles mean fewer oneDNN calls (each builds its primitive:
// tens of microseconds), fewer per-tile weight gradients to sum and, when several tiles, fewer
// output copies into y; smaller ones keep a tile in cache.
// NCHW units: 4 MiB per thread. Their tiles are transposed to NHWC and back around the
// convolution; 1 MiB per thread (half a core's L2, the rule until 2026-11-24, chosen when every
// large buffer was a fresh mmap) ran the 3x3 units of 32-256 channels at N=64, 16x16 at
// 0.98-1.0x plain PyTorch's NCHW unit, 4 MiB 0.85-0.98x, 16 MiB the same (2 threads).
// channels_last units: 16 MiB per thread, and 32 MiB at least. They have no transposes to keep
// in cache; with 4 MiB per thread the 3x3 units of 160-256 channels ran 1.01-1.04x plain
// PyTorch's channels_last unit, one tile 0.98-1.00x (2 threads). On 1 thread, 16 MiB split
// those units in two tiles (an output copy into y and a weight-gradient reorder each): one tile
// ran 1-4% faster (fused / plain, thread CPU time: C=256 s1 0.996 -> 0.982, C=256 s1 +res
// 1.061 -> 1.048, C=192 s1 +res 0.991 -> 0.968, C=256 s2 0.962 -> 0.917; N=64, 16x16).
// (The channels_last 1x1 route runs by pixel chunks.)
int64_t tile_bytes(bool channels_last) {
  // Read at every call so that benchmarks can sweep it; 0 or less means one tile.
  if (const char* env = std::getenv("FUSEDRES_CPU_TILE_BYTES")) return std::atoll(env);
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  return channels_last ? std::max<int64_t>(threads, 2) * (int64_t(16) << 20)
                       : threads * (int64_t(4) << 20);
}

}  // namespace

// Samples per tile: as many as fit the budget (at least one), balanced across tiles. Every
// tile re-reads the weights and, in backward, adds a full weight gradient, so the budget grows
// to 4x the weight bytes: weight-heavy layers (ResNet-50's last stages) run in few tiles.
// (8 and 16 measured no better, RESULTS.md).
int64_t tile_samples(int64_t n, int64_t bytes_per_sample, int64_t weight_bytes,
                     bool channels_last) {
  int64_t budget = tile_bytes(channels_last);
  if (budget <= 0 || n <= 0) return std::max<int64_t>(n, 1);
  budget = std::max<int64_t>(budget, 4 * weight_bytes);
  const int64_t nb = std::clamp<int64_t>(budget / std::max<int64_t>(bytes_per_sample, 1), 1, n);
  const int64_t tiles = (n + nb - 1) / nb;
  return (n + tiles - 1) / tiles;
}

namespace {

int64_t weight_bytes(const at::Tensor& weight) {
  return weight.numel() * weight.element_size();
}

std::vector<int64_t> ints(c10::SymIntArrayRef v) { return C10_AS_INTARRAYREF_SLOW(v).vec(); }

Layout layout_of(const at::Tensor& x) {
  return suggests_channels_last(x) ? Layout::NHWC : Layout::NCHW;
}

// Layout of the activation tile that the convolution consumes. oneDNN's spatial (kh*kw > 1)
// convolutions are 1.2-1.5x faster on NHWC than on NCHW here, which pays for transposing the
// tiles of an NCHW unit (activation, output, grad_out, data gradient) in cache when the output
// is small against the input (stride 2: a quarter) or the channels few (oneDNN's NCHW kernels
// are slow under 48 channels: 24 channels ran 0.95x plain NCHW against 0.80x on NHWC tiles);
// at stride 1 and 48 or more channels the NCHW convolution (oneDNN's own reorders inside) is
// faster than the two whole-output transposes (the sweep's NCHW units, 2 threads, fused / plain:
// C=64 s1 0.967 -> 0.942, C=256 s1 1.036 -> 1.001; RESULTS.md). 1x1 convolutions on
// cache-sized NCHW tiles are as fast, and there the transposes are pure cost. float64 runs ATen's
// native kernels in x's layout.
Layout conv_layout(const at::Tensor& weight, Layout x_layout, int64_t spatial, bool strided) {
  if (weight.scalar_type() == at::kDouble) return x_layout;
  // Spatial kernels on maps of at least 8x8; at 7x7 (ResNet-50's last stage) the NCHW kernels
  // are as fast and the transposes of a whole batch are not.
  if (weight.size(2) * weight.size(3) == 1 || spatial < 64) return x_layout;
  return strided || weight.size(1) < 48 ? Layout::NHWC : x_layout;
}

// A 1x1, stride-1, unpadded convolution is a GEMM, run by ATen's BLAS instead of oneDNN's
// convolution (float32 and float64 only: the weight gradient accumulates in one dtype):
// - NCHW tiles: one GEMM per sample, y[n] (Co x HW) = W (Co x C) @ a[n] (C x HW), batched
//   GEMMs straight into y's slice (no output tile to copy) and the weight gradient added into
//   one float32 accumulator (addbmm). On maps of at least 8x8 that is 1.1-2x faster than
//   oneDNN's 1x1 convolution of the same tiles; on 7x7 maps (ResNet-50's last stage) it is
//   slower (RESULTS.md).
// - channels_last tiles: one GEMM for the whole tile, y (len*H*W x Co) = a (len*H*W x C) @ W^T,
//   the residual added by the GEMM itself (beta = 1), the data gradient go @ W and the weight
//   gradient go^T @ a added into the accumulator; backward 1.2-2x faster than oneDNN's on the
//   CIFAR bottlenecks' 1x1 convolutions (RESULTS.md), forward about the same, at every size.
// - channels_last tiles, stride > 1 (a projection shortcut; a bottleneck's strided 1x1): the
//   same GEMMs on the pixels the convolution reads, the tile's strided rows copied out
//   (strided_rows), and the data gradient added into those pixels of the tile's
//   (strided_pixels).
//   oneDNN's strided 1x1 backward writes a whole-tile data gradient, 3/4 zeros at stride 2,
//   that is then added to the other convolution's, and returns a weight gradient that ATen
//   copies into the weight's layout per tile (RESULTS.md, "Strided 1x1 convolutions as GEMMs").
//   Only beside another convolution of the same activation (strided_beside_dense): alone (a
//   unit's strided 1x1, the stacked shortcut and conv1 of a bottleneck strided on conv1) the
//   data gradient would be a tile of zeros and the scattered rows, and oneDNN measured as fast
//   or faster (CIFAR ResNet-164's strided units 0.624 / 0.566 of plain by oneDNN, 0.637 / 0.589
//   by GEMM).
// - NCHW tiles, stride > 1 (StridedCols), under the same rule: the same GEMMs channel-major,
//   the read pixels copied out as a (C, len*Ho*Wo) matrix (strided_cols), one GEMM for the
//   tile (not one per sample: ResNet-50's last stage has 49 output pixels a sample), its
//   (Co, len*Ho*Wo) output copied into y's samples. 1 thread, NCHW, fused / plain with the
//   route and oneDNN's: ResNet-50's strided first units 0.60 / 0.75, 0.84 / 0.93, 0.92 / 1.01
//   (RESULTS.md). Beside NHWC tiles (a 3x3 of NCHW tensors) oneDNN's convolution of the tile,
//   as fast or faster (ResNet-20's 16-32 /2 unit: 0.72 by columns against 0.69).
enum class Gemm1x1 { None, PerSample, Whole, Strided, StridedCols };

bool is_strided(Gemm1x1 g) { return g == Gemm1x1::Strided || g == Gemm1x1::StridedCols; }

// The route of a convolution gemm_1x1 put on the GEMMs, given its output (forward) or grad_out
// (backward) t: t dense in the tiles' layout, except for the strided GEMMs on NCHW tiles
// (StridedCols), which read and write t in any layout.
Gemm1x1 gemm_for(Gemm1x1 gemm, const at::Tensor& t, Layout a_layout) {
  if (gemm == Gemm1x1::Strided && a_layout == Layout::NCHW) return Gemm1x1::StridedCols;
  return gemm != Gemm1x1::None && !dense_in(t, a_layout) ? Gemm1x1::None : gemm;
}

// The strided GEMMs of one activation's convolutions `gemms` where another one is not strided
// (its data gradient is the tile the strided ones add into); otherwise oneDNN's convolutions.
void strided_beside_dense(std::vector<Gemm1x1>& gemms) {
  bool dense = false;
  for (const Gemm1x1 g : gemms) dense = dense || !is_strided(g);
  if (dense) return;
  for (Gemm1x1& g : gemms) g = Gemm1x1::None;
}

Gemm1x1 gemm_1x1(const at::Tensor& weight, const std::vector<int64_t>& stride,
                 const std::vector<int64_t>& padding, Layout a_layout, int64_t spatial) {
  const auto dt = weight.scalar_type();
  if (!(weight.size(2) == 1 && weight.size(3) == 1 && padding[0] == 0 && padding[1] == 0 &&
        (dt == at::kFloat || dt == at::kDouble))) {
    return Gemm1x1::None;
  }
  if (stride[0] > 1 || stride[1] > 1) return Gemm1x1::Strided;
  if (a_layout == Layout::NHWC) return Gemm1x1::Whole;
  return spatial >= 64 ? Gemm1x1::PerSample : Gemm1x1::None;
}

// The channels_last route's weight gradient of a widening 1x1 convolution (C < Co) is
// accumulated as gw^T (C x Co) += a^T @ go rather than gw (Co x C) += go^T @ a: the same sum,
// and BLAS runs it faster with the narrower side as the output's rows (measured, 2 threads,
// N=128, the tiles' GEMMs, ms, gw / gw^T: 16 -> 64 @32 2.48 / 1.90, 32 -> 128 @16 1.57 / 1.29,
// 64 -> 256 @8 1.19 / 1.00; narrowing convolutions the other way round: 64 -> 16 @32 1.84 /
// 2.48, 256 -> 64 @8 0.98 / 1.18).
bool gw_t_for(Gemm1x1 gemm, const at::Tensor& weight) {
  if (gemm != Gemm1x1::Whole && !is_strided(gemm)) return false;
  return weight.size(1) < weight.size(0);
}

std::vector<int64_t> out_shape(const at::Tensor& x, const at::Tensor& w,
                               const std::vector<int64_t>& s, const std::vector<int64_t>& p,
                               const std::vector<int64_t>& d) {
  return {x.size(0), w.size(0), conv_out_size(x.size(2), w.size(2), s[0], p[0], d[0]),
          conv_out_size(x.size(3), w.size(3), s[1], p[1], d[1])};
}

// The device type the ops' arguments are checked against (checks.h).
constexpr c10::DeviceType kCpu = c10::DeviceType::CPU;

// Per-channel affine of the BatchNorm in the acc dtype of x: bn(x) = scale * x + shift. The four
// vectors are rows of one (4, C) tensor filled by one loop: a unit's fixed cost is a few dozen
// small ATen calls, which a small unit (C = 16 at 16x16) feels.
struct Affine {
  at::Tensor scale, shift, mean, invstd;
};

Affine affine(const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
              const at::Tensor& mean, const at::Tensor& invstd, at::ScalarType acc) {
  const int64_t C = mean.numel();
  const at::Tensor m = mean.to(acc).contiguous(), is = invstd.to(acc).contiguous();
  at::Tensor g, b;
  if (bn_weight.has_value()) g = bn_weight->to(acc).contiguous();
  if (bn_bias.has_value()) b = bn_bias->to(acc).contiguous();
  at::Tensor rows = at::empty({4, C}, mean.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES(acc, "affine", [&] {
    const scalar_t *mp = m.const_data_ptr<scalar_t>(), *ip = is.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.defined() ? g.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* bp = b.defined() ? b.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* r = rows.data_ptr<scalar_t>();
    for (int64_t c = 0; c < C; ++c) {
      const scalar_t scale = gp ? gp[c] * ip[c] : ip[c];
      r[c] = scale;
      r[C + c] = (bp ? bp[c] : scalar_t(0)) - mp[c] * scale;
      r[2 * C + c] = mp[c];
      r[3 * C + c] = ip[c];
    }
  });
  return {rows[0], rows[1], rows[2], rows[3]};
}

// The branch scale as an (N, 1, 1, 1) tensor in the conv's accumulator dtype (float32 for half
// weights; undefined without one): multiplied into tiles of y and grad_out in that dtype and
// rounded once, as the cuda and triton epilogues do. Checked by the op (checks.h).
at::Tensor branch_factor(const std::optional<at::Tensor>& branch_scale,
                         const at::Tensor& weight) {
  if (!present(branch_scale)) return {};
  return branch_scale->to(at::toOpMathType(weight.scalar_type())).contiguous().view({-1, 1, 1, 1});
}

// A forward tile's epilogue with a branch scale, in place while the tile is in cache:
// ys = rs + s * ys (ys holds conv + bias; rs undefined: no residual).
void scale_tile(at::Tensor& ys, const at::Tensor& s, const at::Tensor& rs) {
  if (rs.defined()) {
    at::addcmul_out(ys, rs, ys, s);
  } else {
    ys.mul_(s);
  }
}

// ----------------------------------------------------------------------------- pixel chunks

// A channels_last 1x1 unit (the GEMM route: one convolution, or a pair's two, with weights no
// larger than a chunk) runs in chunks of pixel rows, each thread its own: the thread computes the
// chunk's activation into a buffer of its own, small enough to stay in its L2, and runs the chunk's
// GEMMs on it single-threaded (BLAS called inside a parallel region), instead of every thread
// writing its share of a batch tile's activation (MBs, past L2) for a two-thread GEMM to read back.
// Backward the same per chunk: the activation recomputed, the weight gradient added into the
// thread's accumulator, the chunk's data gradient computed into a second buffer and consumed there
// by the ReLU-mask + sums pass. No parallel region per tile and kernel, no activation or
// data-gradient tile through memory. chunk_bytes: bytes of (activation + output) rows per chunk.
// Measured (2 threads, N=128, fused op fwd / bwd
// ms, batch tiles -> 256 KiB chunks, RESULTS.md): 64 -> 16 @32 5.32 / 10.71 -> 4.40 / 8.56, 16 ->
// 64 @32 with residual 6.30 / 7.82 -> 5.58 / 5.85, 128 -> 32 @16 2.86 / 6.63 -> 2.74 / 4.68; 128
// KiB to 512 KiB within a few percent of each other, 1 MiB and up slower; ResNet-164's training
// step 0.92x (0.90x with the statistics of y reduced in the chunks too: RowStats).
constexpr int64_t chunk_bytes() { return int64_t(256) << 10; }

// Calls into oneDNN from inside the chunks' parallel region are not safe (its weight-gradient
// convolution, tried so, spins forever in a barrier of threads that never come): the chunks
// run only while ATen's float32 GEMMs go to BLAS, i.e. no reduced-precision oneDNN matmul
// (torch.backends.mkldnn.matmul.fp32_precision / torch.set_float32_matmul_precision).
bool fp32_gemm_is_blas() {
  const auto& ctx = at::globalContext();
  for (const auto& [backend, op] : {std::pair{at::Float32Backend::GENERIC, at::Float32Op::ALL},
                                    std::pair{at::Float32Backend::MKLDNN, at::Float32Op::ALL},
                                    std::pair{at::Float32Backend::MKLDNN, at::Float32Op::MATMUL}}) {
    const at::Float32Precision p = ctx.float32Precision(backend, op);
    if (p == at::Float32Precision::TF32 || p == at::Float32Precision::BF16) return false;
  }
  return true;
}

// Pixel rows per chunk for rows of `row_bytes` and convolutions of `weight_bytes` in all; 0:
// batch tiles instead. Chunks only while the weights are no larger than a chunk: each chunk's
// GEMMs read all of them, and a chunk of wide rows is few rows (ResNet-50's 2048 -> 512 1x1 at
// 256 KiB: 25 rows a GEMM; its unit ran 1.29x plain PyTorch so, 0.95x by batch tiles).
int64_t chunk_rows(int64_t pixels, int64_t row_bytes, int64_t weight_bytes) {
  const int64_t budget = chunk_bytes();
  if (pixels <= 0 || weight_bytes > budget || !fp32_gemm_is_blas()) return 0;
  return std::clamp<int64_t>(budget / std::max<int64_t>(row_bytes, 1), 16, pixels);
}

// Pixel rows [first, first + rows) of a dense NHWC tensor as an NHWC (rows, C, 1, 1) view.
at::Tensor pixel_rows(const at::Tensor& t, int64_t first, int64_t rows) {
  const int64_t C = t.size(1);
  return t.as_strided({rows, C, 1, 1}, {C, 1, C, C}, t.storage_offset() + first * C);
}

// Thread `tid`'s buffer of `rows` pixel rows of C values in `buf` (threads x rc x C, flat), as
// an NHWC (rows, C, 1, 1) tensor.
at::Tensor thread_rows(const at::Tensor& buf, int64_t tid, int64_t rc, int64_t rows, int64_t C) {
  return buf.narrow(0, tid * rc * C, rows * C).view({rows, C, 1, 1});
}

// The pixels of a tile t (len, C, H, W) that a strided 1x1 convolution with output (Ho, Wo)
// reads (or writes the data gradient of), as a (len, C, Ho, Wo) view in t's layout.
at::Tensor strided_pixels_nchw(const at::Tensor& t, const std::vector<int64_t>& stride,
                               int64_t Ho, int64_t Wo) {
  return t.slice(2, 0, (Ho - 1) * stride[0] + 1, stride[0])
      .slice(3, 0, (Wo - 1) * stride[1] + 1, stride[1]);
}

// The same pixels of an NHWC tile, as a (len, Ho, Wo, C) view.
at::Tensor strided_pixels(const at::Tensor& t, const std::vector<int64_t>& stride, int64_t Ho,
                          int64_t Wo) {
  return strided_pixels_nchw(t, stride, Ho, Wo).permute({0, 2, 3, 1});
}

// An NCHW tile t (len, C, H, W) as the (C, len*Ho*Wo) matrix of a strided 1x1 convolution's
// read pixels (Ho = H, Wo = W at stride 1), channel-major, copied into buf: the GEMM's operand
// for the whole tile at once (one GEMM of len*Ho*Wo columns where per-sample GEMMs would have
// Ho*Wo, 49 on ResNet-50's last stage).
at::Tensor strided_cols(const at::Tensor& t, const std::vector<int64_t>& stride, int64_t Ho,
                        int64_t Wo, const at::Tensor& buf) {
  const int64_t len = t.size(0), C = t.size(1);
  at::Tensor cols = buf.narrow(0, 0, C * len * Ho * Wo);
  cols.view({C, len, Ho, Wo}).copy_(strided_pixels_nchw(t, stride, Ho, Wo).transpose(0, 1));
  return cols.view({C, len * Ho * Wo});
}

// Those pixels of the tile a, copied into buf as the rows of a (len*Ho*Wo, C) matrix.
at::Tensor strided_rows(const at::Tensor& a, const std::vector<int64_t>& stride, int64_t Ho,
                        int64_t Wo, const at::Tensor& buf) {
  const int64_t len = a.size(0), C = a.size(1);
  at::Tensor rows = buf.narrow(0, 0, len * Ho * Wo * C);
  rows.view({len, Ho, Wo, C}).copy_(strided_pixels(a, stride, Ho, Wo));
  return rows.view({len * Ho * Wo, C});
}

// ----------------------------------------------------------------------------- ops

std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x_in) {
  checks::check_stats_input("fusedres_cpu.batch_stats", x_in, kCpu);
  const Layout layout = layout_of(x_in);
  return batch_stats_kernel(x_in.contiguous(memory_format(layout)), layout);
}

// rm = rm * (1 - f) + mean * f, rv = rv * (1 - f) + (var * bessel) * f and invstd = 1 / sqrt(var
// + eps), element by element, with every product, sum and scalar rounded to T as ATen's
// rm.mul_(1 - f).add_(mean * f), var * bessel, var + eps and at::rsqrt round them (their CPU
// kernels, vectorised or not, compute exactly these IEEE operations; `volatile` keeps the compiler
// from contracting a product and a sum into one FMA, which rounds once): the same bits.
template <typename T>
void update_running_stats(T* rm, T* rv, const T* mean, const T* var, T* invstd, int64_t C,
                          double momentum, double bessel, double eps) {
  const T keep = static_cast<T>(1 - momentum), take = static_cast<T>(momentum);
  const T b = static_cast<T>(bessel), e = static_cast<T>(eps);
  for (int64_t c = 0; c < C; ++c) {
    volatile T unbiased = var[c] * b;
    volatile T old_m = rm[c] * keep, new_m = mean[c] * take;
    volatile T old_v = rv[c] * keep, new_v = unbiased * take;
    rm[c] = old_m + new_m;
    rv[c] = old_v + new_v;
    volatile T shifted = var[c] + e;
    invstd[c] = T(1) / std::sqrt(static_cast<T>(shifted));
  }
}

// nn.BatchNorm2d's statistics and running-stats update in one call (fusedres.functional.
// prepare_batch_norm on eager CPU tensors): (mean, invstd) in the statistics dtype. In training
// (or without running statistics) the batch's, from `mean`/`var` when given (a producer's
// statistics of x) or one pass over x, the running statistics updated in place; in eval the
// running statistics'. The update is the Python rule's sequence of ATen ops (same kernels, same
// roundings); one call instead of ~10 from Python: ~20 us a BatchNorm (RESULTS.md). Every
// argument is checked before anything is written (check_prepare_args); an empty batch stays in
// Python. Outputs never alias an input (a given mean is copied).
std::tuple<at::Tensor, at::Tensor> prepare_batch_norm(
    const at::Tensor& x, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& num_batches_tracked, bool training,
    std::optional<double> momentum, double eps, const std::optional<at::Tensor>& mean_in,
    const std::optional<at::Tensor>& var_in) {
  checks::check_prepare_args("fusedres_cpu.prepare_batch_norm", kCpu, x, running_mean,
                             running_var, num_batches_tracked, training, momentum, eps, mean_in,
                             var_in);
  const bool tracked = present(running_mean);
  const at::ScalarType sdt = at::toOpMathType(x.scalar_type());
  if (!training && tracked) return eval_stats_aten(*running_mean, *running_var, sdt, eps);
  at::Tensor mean, var;
  if (present(mean_in)) {
    mean = mean_in->clone();
    var = *var_in;
  } else {
    std::tie(mean, var) = batch_stats(x);
  }
  if (training && tracked) {
    const int64_t count = x.numel() / x.size(1);
    at::Tensor rm = *running_mean, rv = *running_var;
    const at::ScalarType st = rm.scalar_type();
    if (momentum.has_value() && (st == at::kFloat || st == at::kDouble) &&
        rv.scalar_type() == st && mean.scalar_type() == st && var.scalar_type() == st &&
        rm.is_contiguous() && rv.is_contiguous() && mean.is_contiguous() &&
        var.is_contiguous()) {
      // update_running_stats_aten in one loop (~10 ATen calls fewer), each product and sum
      // rounded as those calls round them; the invstd too (var + eps, then 1 / sqrt, as
      // at::rsqrt).
      if (present(num_batches_tracked)) num_batches_tracked->add_(1);
      const double bessel = static_cast<double>(count) / static_cast<double>(count - 1);
      at::Tensor invstd = at::empty_like(var);
      // Counted as the in-place ops would count them.
      torch::autograd::impl::bump_version(rm);
      torch::autograd::impl::bump_version(rv);
      AT_DISPATCH_FLOATING_TYPES(st, "running_stats", [&] {
        update_running_stats(rm.data_ptr<scalar_t>(), rv.data_ptr<scalar_t>(),
                             mean.const_data_ptr<scalar_t>(), var.const_data_ptr<scalar_t>(),
                             invstd.data_ptr<scalar_t>(), mean.numel(), *momentum, bessel, eps);
      });
      return {mean, invstd};
    }
    update_running_stats_aten(rm, rv, num_batches_tracked, mean, var, momentum, count);
  }
  return {mean, at::rsqrt(var + eps)};
}

// One convolution of a BN-ReLU's activation tiles: its weight, geometry and branch factor.
struct ConvSpec {
  ConvSpec(const at::Tensor& weight, c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
           c10::SymIntArrayRef dilation, at::Tensor bs = {})
      : weight(weight), stride(ints(stride)), padding(ints(padding)), dilation(ints(dilation)),
        bs(std::move(bs)) {}
  at::Tensor weight;
  std::vector<int64_t> stride, padding, dilation;
  at::Tensor bs;  // branch_factor(...) or undefined
};

// A convolution in a forward pass: bias and residual in; its output y out (allocated by
// forward_convs).
struct ConvFwd : ConvSpec {
  std::optional<at::Tensor> bias, residual;
  at::Tensor y;
};

// The forward of a channels_last 1x1 unit by pixel chunks (chunk_bytes says why): per chunk,
// in the thread that owns it, a = relu(scale * x + shift) into the thread's buffer, then for
// each convolution (two for a pair) y = a @ W^T (+ residual, added by the GEMM) (+ bias) into
// y's rows.
// With `stats` (one convolution), each finished chunk of y is also reduced into y's per-channel
// moments while it is in cache (the genstats op's statistics without a pass over y).
void forward_1x1_chunks(const at::Tensor& x, std::vector<ConvFwd>& convs,
                        const std::vector<at::Tensor>& ws, const Affine& bn, int64_t rc,
                        RowStats* stats = nullptr) {
  const int64_t C = x.size(1), R = x.size(0) * x.size(2) * x.size(3);
  const int64_t chunks = (R + rc - 1) / rc;
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  const at::Tensor buf = at::empty({threads * rc * C}, convs.front().weight.options());
  std::vector<at::Tensor> wts, y2s, r2s;
  for (size_t i = 0; i < convs.size(); ++i) {
    const ConvFwd& c = convs[i];
    const int64_t Co = c.weight.size(0);
    wts.push_back(ws[i].view({Co, C}).t());
    y2s.push_back(c.y.permute({0, 2, 3, 1}).view({R, Co}));
    r2s.push_back(c.residual.has_value() ? c.residual->permute({0, 2, 3, 1}).view({R, Co})
                                         : at::Tensor());
  }
  // ATen ops called in the parallel region run on OpenMP threads: they get the caller's
  // thread-local state (dispatch keys below autograd, grad mode) as the caller's thread has it.
  const at::ThreadLocalState tls;
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    const at::ThreadLocalStateGuard tls_guard(tls);
    const int64_t tid = at::get_thread_num();
    for (int64_t k = b; k < e; ++k) {
      const int64_t r0 = k * rc, len = std::min(rc, R - r0);
      at::Tensor a = thread_rows(buf, tid, rc, len, C);
      bn_relu_kernel(pixel_rows(x, r0, len), bn.scale, bn.shift, a, Layout::NHWC, Layout::NHWC);
      const at::Tensor a2 = a.view({len, C});
      for (size_t i = 0; i < convs.size(); ++i) {
        at::Tensor yc = y2s[i].narrow(0, r0, len);
        if (r2s[i].defined()) {
          at::addmm_out(yc, r2s[i].narrow(0, r0, len), a2, wts[i]);
        } else {
          at::mm_out(yc, a2, wts[i]);
        }
        if (convs[i].bias.has_value()) yc.add_(*convs[i].bias);
        if (stats) stats->add(yc, tid);
      }
    }
  });
}

// A tile of a 1x1 convolution on NCHW: one batched GEMM over its samples.
void tile_per_sample(ConvFwd& c, const at::Tensor& w, const at::Tensor& a, int64_t n0,
                     int64_t len, int64_t C, int64_t H, int64_t W) {
  const int64_t Co = c.weight.size(0);
  const std::optional<at::Tensor>& bias = c.bias;
  const std::optional<at::Tensor>& residual = c.residual;
  at::Tensor& y = c.y;
  at::Tensor ys = y.narrow(0, n0, len);
  at::Tensor y3 = ys.view({len, Co, H * W});
  at::bmm_out(y3, w.view({1, Co, C}).expand({len, Co, C}), a.view({len, C, H * W}));
  if (bias.has_value()) ys.add_(bias->view({1, Co, 1, 1}));
  if (c.bs.defined()) {
    scale_tile(ys, c.bs.narrow(0, n0, len),
               residual.has_value() ? residual->narrow(0, n0, len) : at::Tensor());
  } else if (residual.has_value()) {
    ys.add_(residual->narrow(0, n0, len));
  }
}

// A tile of a strided 1x1 convolution on NCHW tiles: one GEMM over its read pixels.
void tile_strided_cols(ConvFwd& c, const at::Tensor& w, const at::Tensor& a, int64_t n0,
                       int64_t len, int64_t C, at::Tensor& rows_buf, at::Tensor& out_buf) {
  const int64_t Co = c.weight.size(0);
  const std::optional<at::Tensor>& bias = c.bias;
  const std::optional<at::Tensor>& residual = c.residual;
  at::Tensor& y = c.y;
  // One GEMM for the tile, (Co, P) = W (Co, C) @ its read pixels (C, P), P = len*Ho*Wo,
  // the bias added by the GEMM, then copied into y's samples (the residual added on the
  // way).
  at::Tensor ys = y.narrow(0, n0, len);
  const int64_t Ho = y.size(2), Wo = y.size(3), P = len * Ho * Wo;
  at::Tensor out = out_buf.narrow(0, 0, Co * P).view({Co, P});
  const at::Tensor cols = strided_cols(a, c.stride, Ho, Wo, rows_buf);
  if (bias.has_value()) {
    at::addmm_out(out, bias->view({Co, 1}), w.view({Co, C}), cols);
  } else {
    at::mm_out(out, w.view({Co, C}), cols);
  }
  const at::Tensor out4 = out.view({Co, len, Ho, Wo}).transpose(0, 1);
  const at::Tensor rs = residual.has_value() ? residual->narrow(0, n0, len) : at::Tensor();
  if (c.bs.defined()) {
    ys.copy_(out4);
    scale_tile(ys, c.bs.narrow(0, n0, len), rs);
  } else if (rs.defined()) {
    at::add_out(ys, rs, out4);
  } else {
    ys.copy_(out4);
  }
}

// A tile of a 1x1 convolution on channels_last tiles (strided: its read pixels copied out).
void tile_pixel_rows(ConvFwd& c, const at::Tensor& w, const at::Tensor& a, int64_t n0,
                     int64_t len, int64_t C, Gemm1x1 gemm, at::Tensor& rows_buf) {
  const int64_t Co = c.weight.size(0);
  const std::optional<at::Tensor>& bias = c.bias;
  const std::optional<at::Tensor>& residual = c.residual;
  at::Tensor& y = c.y;
  // Rows of a channels_last tile are pixels: (P, C) @ (C, Co) into y's P rows, P the
  // tile's output pixels (a strided convolution's read pixels copied out).
  at::Tensor ys = y.narrow(0, n0, len);
  const int64_t P = len * y.size(2) * y.size(3);
  at::Tensor y2 = ys.permute({0, 2, 3, 1}).view({P, Co});
  const at::Tensor a2 =
      gemm == Gemm1x1::Strided
          ? strided_rows(a, c.stride, y.size(2), y.size(3), rows_buf)
          : a.permute({0, 2, 3, 1}).view({P, C});
  const at::Tensor wt = w.view({Co, C}).t();
  at::Tensor rs = residual.has_value() ? residual->narrow(0, n0, len) : at::Tensor();
  if (c.bs.defined()) {  // y = rs + s * (a @ W^T + bias): the GEMM, then the epilogue
    at::mm_out(y2, a2, wt);
    if (bias.has_value()) y2.add_(*bias);
    scale_tile(ys, c.bs.narrow(0, n0, len), rs);
    return;
  }
  if (rs.defined() && rs.scalar_type() == y.scalar_type() && dense_in(rs, Layout::NHWC)) {
    at::addmm_out(y2, rs.permute({0, 2, 3, 1}).view({P, Co}), a2, wt);
    rs = at::Tensor();
  } else {
    at::mm_out(y2, a2, wt);
  }
  if (bias.has_value()) y2.add_(*bias);
  if (rs.defined()) ys.add_(rs);
}

// A tile of any other convolution: ATen's, then into y's layout (the residual added on the
// way); one tile already in y's layout becomes y.
void tile_convolution(ConvFwd& c, const at::Tensor& w, const at::Tensor& a, int64_t n0,
                      int64_t len, int64_t N, int64_t nb, Layout layout, Layout a_layout) {
  const std::optional<at::Tensor>& bias = c.bias;
  const std::optional<at::Tensor>& residual = c.residual;
  at::Tensor& y = c.y;
  at::Tensor yt = at::convolution(a, w, bias, c.stride, c.padding, c.dilation, false,
                                  {0, 0}, 1);
  if (c.bs.defined()) yt.mul_(c.bs.narrow(0, n0, len));  // in cache, before its residual
  if (nb >= N && yt.strides() == y.strides()) {  // one tile, already in y's layout
    if (residual.has_value()) yt.add_(*residual);
    y = yt;
    return;
  }
  at::Tensor ys = y.narrow(0, n0, len);
  if (a_layout != layout && dense_in(yt, a_layout) && dense_in(ys, layout)) {
    // NHWC tile back to NCHW y in cache, the residual added on the way when it lies as y.
    const at::Tensor rs = residual.has_value() ? residual->narrow(0, n0, len) : at::Tensor();
    const bool fuse = rs.defined() && rs.scalar_type() == ys.scalar_type() && dense_in(rs, layout);
    transpose_layout_kernel(yt, ys, a_layout, fuse ? &rs : nullptr);
    if (rs.defined() && !fuse) ys.add_(rs);
  } else if (residual.has_value()) {
    at::add_out(ys, yt, residual->narrow(0, n0, len));
  } else {
    ys.copy_(yt);
  }
}

// The pixel-chunk route (forward_1x1_chunks) when every convolution is a channels_last GEMM
// (one, or a pair's two), no branch scale, each residual as y; false when it does not apply.
bool forward_by_chunks(const at::Tensor& x, std::vector<ConvFwd>& convs,
                       const std::vector<at::Tensor>& ws, const std::vector<Gemm1x1>& gemms,
                       const Affine& bn, Layout layout,
                       std::optional<std::tuple<at::Tensor, at::Tensor>>* stats_out) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const at::Tensor& weight0 = convs.front().weight;
  bool chunkable = layout == Layout::NHWC;
  int64_t row_values = C, weight_values = 0;
  for (size_t i = 0; i < convs.size(); ++i) {
    const ConvFwd& c = convs[i];
    weight_values += c.weight.numel();
    chunkable = chunkable && gemms[i] == Gemm1x1::Whole && !c.bs.defined() &&
                (!c.residual.has_value() ||
                 (c.residual->scalar_type() == c.y.scalar_type() &&
                  dense_in(*c.residual, Layout::NHWC)));
    row_values += c.weight.size(0);
  }
  const int64_t elt = weight0.element_size();
  const int64_t rc =
      chunkable ? chunk_rows(N * H * W, row_values * elt, weight_values * elt) : 0;
  if (rc > 0) {
    if (stats_out && convs.size() == 1) {
      const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
      RowStats stats(convs[0].weight.size(0), threads, convs[0].y.scalar_type());
      forward_1x1_chunks(x, convs, ws, bn, rc, &stats);
      *stats_out = stats.finish(x.options());
    } else {
      forward_1x1_chunks(x, convs, ws, bn, rc);
    }
    return true;
  }
  return false;
}

// The forward of one BN-ReLU feeding the convolutions `convs` (one for the fused unit; two for a
// pre-activation unit's projection shortcut and first convolution, bn_relu_conv2d_pair): per
// tile the activation is computed once and every convolution reads it in cache.
// With stats_out (one convolution): when the pixel-chunk route runs, y's per-channel (mean,
// biased var) reduced chunk by chunk land there; otherwise it is left empty.
void forward_convs(const at::Tensor& x_in, std::vector<ConvFwd>& convs,
                   const std::optional<at::Tensor>& bn_weight,
                   const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean,
                   const at::Tensor& invstd,
                   std::optional<std::tuple<at::Tensor, at::Tensor>>* stats_out = nullptr) {
  const Layout layout = layout_of(x_in);
  const at::MemoryFormat fmt = memory_format(layout);
  const at::Tensor x = x_in.contiguous(fmt);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const at::Tensor& weight0 = convs.front().weight;
  int64_t out_per_sample = 0, wbytes = 0;
  bool empty = false;
  Layout a_layout = layout;
  for (ConvFwd& c : convs) {
    const auto shape = out_shape(x, c.weight, c.stride, c.padding, c.dilation);
    c.y = at::empty(shape, c.weight.options().memory_format(out_memory_format(x_in, c.weight)));
    empty = empty || c.y.numel() == 0;
    out_per_sample += shape[1] * shape[2] * shape[3];
    wbytes += weight_bytes(c.weight);
    if (conv_layout(c.weight, layout, H * W, c.stride[0] * c.stride[1] > 1) == Layout::NHWC) {
      a_layout = Layout::NHWC;
    }
  }
  if (empty) return;

  const Affine bn = affine(bn_weight, bn_bias, mean, invstd, at::toOpMathType(x.scalar_type()));
  const at::MemoryFormat a_fmt = memory_format(a_layout);
  std::vector<at::Tensor> ws;
  std::vector<Gemm1x1> gemms;
  for (const ConvFwd& c : convs) {
    ws.push_back(c.weight.contiguous(a_fmt));
    gemms.push_back(gemm_for(gemm_1x1(c.weight, c.stride, c.padding, a_layout, H * W), c.y,
                             a_layout));
  }
  strided_beside_dense(gemms);
  if (forward_by_chunks(x, convs, ws, gemms, bn, layout, stats_out)) return;
  const int64_t nb = tile_samples(N, (C * H * W + out_per_sample) * weight0.element_size(),
                                  wbytes, layout == Layout::NHWC);
  at::Tensor a_buf = at::empty({nb, C, H, W}, weight0.options().memory_format(a_fmt));
  // The strided GEMMs' pixels of a tile; on NCHW tiles, their (Co, len*Ho*Wo) outputs too.
  std::vector<at::Tensor> rows_bufs(convs.size()), out_bufs(convs.size());
  for (size_t i = 0; i < convs.size(); ++i) {
    if (is_strided(gemms[i])) {
      const int64_t pixels = nb * convs[i].y.size(2) * convs[i].y.size(3);
      rows_bufs[i] = at::empty({pixels * C}, weight0.options());
      if (gemms[i] == Gemm1x1::StridedCols) {
        out_bufs[i] = at::empty({pixels * convs[i].weight.size(0)}, weight0.options());
      }
    }
  }
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t len = std::min(nb, N - n0);
    at::Tensor a = a_buf.narrow(0, 0, len);
    bn_relu_kernel(x.narrow(0, n0, len), bn.scale, bn.shift, a, layout, a_layout);
    for (size_t i = 0; i < convs.size(); ++i) {
      ConvFwd& c = convs[i];
      if (gemms[i] == Gemm1x1::PerSample) {
        tile_per_sample(c, ws[i], a, n0, len, C, H, W);
      } else if (gemms[i] == Gemm1x1::StridedCols) {
        tile_strided_cols(c, ws[i], a, n0, len, C, rows_bufs[i], out_bufs[i]);
      } else if (gemms[i] == Gemm1x1::Whole || gemms[i] == Gemm1x1::Strided) {
        tile_pixel_rows(c, ws[i], a, n0, len, C, gemms[i], rows_bufs[i]);
      } else {
        tile_convolution(c, ws[i], a, n0, len, N, nb, layout, a_layout);
      }
    }
  }
}

// The fused unit's forward (op: its name in errors); with stats_out, as forward_convs fills it.
at::Tensor unit_forward(const char* op, const at::Tensor& x_in, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& bn_weight,
                        const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean,
                        const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
                        c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
                        c10::SymIntArrayRef dilation,
                        const std::optional<at::Tensor>& branch_scale,
                        std::optional<std::tuple<at::Tensor, at::Tensor>>* stats_out) {
  checks::check_unit_args(op, kCpu, x_in, weight, bias, bn_weight, bn_bias, mean, invstd,
                          residual, stride, padding, dilation, branch_scale);
  std::vector<ConvFwd> convs{ConvFwd{
      {weight, stride, padding, dilation, branch_factor(branch_scale, weight)},
      bias,
      residual}};
  forward_convs(x_in, convs, bn_weight, bn_bias, mean, invstd, stats_out);
  return convs[0].y;
}

at::Tensor bn_relu_conv2d(const at::Tensor& x_in, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& bn_weight,
                          const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean,
                          const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
                          c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
                          c10::SymIntArrayRef dilation, bool /*batch_stats*/,
                          const std::optional<at::Tensor>& branch_scale) {
  return unit_forward("fusedres_cpu.bn_relu_conv2d", x_in, weight, bias, bn_weight, bn_bias,
                      mean, invstd, residual, stride, padding, dilation, branch_scale, nullptr);
}

// Two convolutions of one BN-ReLU (a pre-activation unit's projection shortcut and first
// convolution, no residual, no branch scale): the activation computed once per tile for both;
// with stats2, the second output's per-channel (mean, biased var) as genstats gives them.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_relu_conv2d_pair(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, c10::SymIntArrayRef stride2,
    c10::SymIntArrayRef padding2, c10::SymIntArrayRef dilation2, bool stats2) {
  checks::check_pair_args("fusedres_cpu.bn_relu_conv2d_pair", kCpu, x, weight, bias, weight2,
                          bias2, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
                          stride2, padding2, dilation2);
  std::vector<ConvFwd> convs{ConvFwd{{weight, stride, padding, dilation}, bias, std::nullopt},
                             ConvFwd{{weight2, stride2, padding2, dilation2}, bias2, std::nullopt}};
  forward_convs(x, convs, bn_weight, bn_bias, mean, invstd);
  at::Tensor m, v;
  if (stats2) {
    std::tie(m, v) = batch_stats(convs[1].y);
  } else {
    m = mean.new_empty({0});
    v = mean.new_empty({0});
  }
  return {convs[0].y, convs[1].y, m, v};
}

// The forward, then y's per-channel (mean, biased var) in the statistics dtype: what the next
// BatchNorm of a training step needs. On the pixel-chunk route each chunk of y is reduced while
// it is in cache (RowStats); otherwise a second pass over y (batch_stats: the cuda copy reduces
// them in the convolution's epilogue).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_relu_conv2d_genstats(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& residual,
    c10::SymIntArrayRef stride, c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
    bool /*stats_of_batch*/, const std::optional<at::Tensor>& branch_scale) {
  std::optional<std::tuple<at::Tensor, at::Tensor>> stats;
  at::Tensor y = unit_forward("fusedres_cpu.bn_relu_conv2d_genstats", x, weight, bias, bn_weight,
                              bn_bias, mean, invstd, residual, stride, padding, dilation,
                              branch_scale, &stats);
  auto [y_mean, y_var] = stats.has_value() ? *stats : batch_stats(y);
  return {std::move(y), std::move(y_mean), std::move(y_var)};
}

// A convolution in a backward pass: its incoming gradient and which of its gradients are wanted
// in; those gradients out (allocated by backward_convs).
struct ConvGrad : ConvSpec {
  at::Tensor grad_out;
  bool want_w = false, want_b = false;
  at::Tensor gw, gb;
};

// Per convolution of a backward pass: grad_out in the weight's dtype, the weight in the tile's
// layout, the GEMM route, the accumulators and tile buffers.
struct ConvBwdWork {
  at::Tensor go, w, gw_acc, gb_acc, gemm_da_buf, go_buf;
  // The strided GEMMs: the tile's read pixels, their gradient; StridedCols: grad_out's tile as
  // (Co, len*Ho*Wo) too.
  at::Tensor rows_buf, drows_buf, go_cols_buf;
  at::ScalarType wacc;
  Gemm1x1 gemm;
  // channels_last GEMM route, fewer input than output channels: the weight gradient is
  // accumulated transposed, gw^T (C x Co) += a^T @ go (gw_t_for says why).
  bool gw_t = false;
};

// What every phase of backward_convs reads: x in the layout it is walked in, its BN-ReLU, the
// activation tiles' layout, size and buffer, and where the BatchNorm's backward goes (dz and
// the threads' sums).
struct BwdPass {
  at::Tensor x;
  Layout layout, a_layout;
  at::MemoryFormat fmt, a_fmt;
  int64_t N, C, H, W;
  at::ScalarType acc;
  Affine bn;
  bool need_da, want_x, stream_dz;
  at::Tensor dz, out_scale, sums;
  int64_t nb = 0;
  at::Tensor a_buf;
};

// The plan: per convolution its grad_out, weight, GEMM route, accumulators and tile buffers;
// the tile size (P.nb) and the activation tiles' buffer (P.a_buf).
std::vector<ConvBwdWork> plan_backward(BwdPass& P, const std::vector<ConvGrad>& convs,
                                       const at::Tensor& x_in) {
  const int64_t C = P.C, H = P.H, W = P.W;
  const Layout layout = P.layout, a_layout = P.a_layout;
  const at::Tensor& weight0 = convs.front().weight;
  std::vector<ConvBwdWork> work(convs.size());
  int64_t go_per_sample = 0, wbytes = 0;
  for (size_t i = 0; i < convs.size(); ++i) {
    const ConvGrad& c = convs[i];
    ConvBwdWork& k = work[i];
    k.go = c.grad_out.to(c.weight.scalar_type());
    if (!k.go.is_contiguous() && !k.go.is_contiguous(at::MemoryFormat::ChannelsLast)) {
      k.go = k.go.contiguous(out_memory_format(x_in, c.weight));
    }
    k.wacc = at::toOpMathType(c.weight.scalar_type());
    if (c.want_b) k.gb_acc = at::zeros({c.weight.size(0)}, c.weight.options().dtype(k.wacc));
    k.w = c.weight.contiguous(P.a_fmt);
    go_per_sample += k.go[0].numel();
    wbytes += weight_bytes(c.weight);
  }
  const int64_t nb = tile_samples(P.N, (C * H * W + go_per_sample) * weight0.element_size(),
                                  wbytes, layout == Layout::NHWC);
  P.nb = nb;
  P.a_buf = at::empty({nb, C, H, W}, weight0.options().memory_format(P.a_fmt));
  for (size_t i = 0; i < convs.size(); ++i) {
    const ConvGrad& c = convs[i];
    ConvBwdWork& k = work[i];
    k.gemm = gemm_for(gemm_1x1(c.weight, c.stride, c.padding, a_layout, H * W), k.go, a_layout);
  }
  {
    std::vector<Gemm1x1> gemms;
    for (const ConvBwdWork& k : work) gemms.push_back(k.gemm);
    strided_beside_dense(gemms);
    for (size_t i = 0; i < convs.size(); ++i) work[i].gemm = gemms[i];
  }
  for (size_t i = 0; i < convs.size(); ++i) {
    const ConvGrad& c = convs[i];
    ConvBwdWork& k = work[i];
    if (k.gemm != Gemm1x1::None && c.want_w) {
      k.gw_t = gw_t_for(k.gemm, c.weight);
      k.gw_acc = k.gw_t ? at::zeros({C, c.weight.size(0)}, c.weight.options().dtype(k.wacc))
                        : at::zeros(c.weight.sizes(), c.weight.options().dtype(k.wacc));
    }
    if (k.gemm != Gemm1x1::None && !is_strided(k.gemm) && P.need_da) {
      k.gemm_da_buf = at::empty({nb, C, H, W}, c.weight.options().memory_format(P.a_fmt));
    }
    if (is_strided(k.gemm)) {
      const int64_t rows_numel = nb * k.go.size(2) * k.go.size(3) * C;
      k.rows_buf = at::empty({rows_numel}, c.weight.options());
      if (P.need_da) k.drows_buf = at::empty({rows_numel}, c.weight.options());
      if (k.gemm == Gemm1x1::StridedCols) {
        k.go_cols_buf = at::empty({rows_numel / C * k.go.size(1)}, c.weight.options());
      }
    }
    // Tile buffers for the layout changes around an NHWC convolution of NCHW tensors; the
    // scaled grad_out tiles.
    if (a_layout != layout || c.bs.defined()) {
      k.go_buf = at::empty({nb, k.go.size(1), k.go.size(2), k.go.size(3)},
                           k.go.options().memory_format(P.a_fmt));
    }
  }
  return work;
}

// A channels_last 1x1 unit (every convolution on the GEMM route: one, or a pair's two) runs by
// pixel chunks instead of batch tiles (chunk_bytes says why): the rows of a chunk, else 0.
int64_t backward_chunk_rows(const BwdPass& P, const std::vector<ConvGrad>& convs,
                            const std::vector<ConvBwdWork>& work) {
  bool chunkable = P.layout == Layout::NHWC && P.need_da && P.x.scalar_type() == P.acc;
  int64_t row_values = P.C, weight_values = 0;
  for (size_t i = 0; i < convs.size(); ++i) {
    chunkable = chunkable && work[i].gemm == Gemm1x1::Whole && !convs[i].bs.defined() &&
                dense_in(work[i].go, Layout::NHWC);
    row_values += convs[i].weight.size(0);
    weight_values += convs[i].weight.numel();
  }
  const int64_t elt = convs.front().weight.element_size();
  return chunkable ? chunk_rows(P.N * P.H * P.W, row_values * elt, weight_values * elt) : 0;
}

// The pixel-chunk route: per chunk of `rc` rows, in the thread that owns it, the activation,
// each convolution's weight and bias gradients into the thread's accumulators, their data
// gradients summed in cache, then the BatchNorm's mask and sums (dz when wanted).
void backward_by_chunks(const BwdPass& P, const std::vector<ConvGrad>& convs,
                        std::vector<ConvBwdWork>& work, int64_t rc) {
  const at::Tensor& x = P.x;
  const int64_t C = P.C;
  const at::Tensor& weight0 = convs.front().weight;
  const Affine& bn = P.bn;
  const int64_t R = P.N * P.H * P.W;
  const int64_t chunks = (R + rc - 1) / rc;
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  const at::Tensor a_rows = at::empty({threads * rc * C}, weight0.options());
  const at::Tensor da_rows = at::empty({threads * rc * C}, weight0.options());
  // Per convolution: grad_out's rows, the weight as (Co, C), and one weight-gradient
  // accumulator a thread, laid out as gw_acc (gw^T when gw_t), one bias-gradient one.
  struct Rows {
    at::Tensor go2, wm, gw_parts, gb_parts;
    int64_t gw_r = 0, gw_c = 0;
  };
  std::vector<Rows> rows(convs.size());
  for (size_t i = 0; i < convs.size(); ++i) {
    const ConvGrad& c = convs[i];
    const ConvBwdWork& k = work[i];
    const int64_t Co = c.weight.size(0);
    Rows& r = rows[i];
    r.go2 = k.go.permute({0, 2, 3, 1}).view({R, Co});
    r.wm = k.w.view({Co, C});
    r.gw_r = k.gw_t ? C : Co;
    r.gw_c = k.gw_t ? Co : C;
    const at::TensorOptions acc_opts = weight0.options().dtype(k.wacc);
    if (c.want_w) r.gw_parts = at::zeros({threads, r.gw_r, r.gw_c}, acc_opts);
    if (c.want_b) r.gb_parts = at::zeros({threads, Co}, acc_opts);
  }
  const at::ThreadLocalState tls;  // as in forward_1x1_chunks
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    const at::ThreadLocalStateGuard tls_guard(tls);
    const int64_t tid = at::get_thread_num();
    // Inside a parallel region the kernels below run serially and index their sums by thread
    // 0: give them this thread's row. A single chunk runs outside one (parallel_for calls the
    // body directly), and there the kernels open their own region over every thread: they
    // need all the rows (given one, the NHWC period walk's sums, sized by it, overflowed).
    at::Tensor sums_t = at::in_parallel_region() ? P.sums.narrow(0, tid, 1) : P.sums;
    for (int64_t j = b; j < e; ++j) {
      const int64_t r0 = j * rc, len = std::min(rc, R - r0);
      const at::Tensor xc = pixel_rows(x, r0, len);
      at::Tensor a = thread_rows(a_rows, tid, rc, len, C);
      bn_relu_kernel(xc, bn.scale, bn.shift, a, Layout::NHWC, Layout::NHWC);
      const at::Tensor a2 = a.view({len, C});
      at::Tensor da = thread_rows(da_rows, tid, rc, len, C);
      at::Tensor da2 = da.view({len, C});
      for (size_t i = 0; i < convs.size(); ++i) {
        const ConvGrad& c = convs[i];
        const Rows& r = rows[i];
        const at::Tensor goc = r.go2.narrow(0, r0, len);
        if (c.want_w && work[i].gw_t) {
          r.gw_parts[tid].addmm_(a2.t(), goc);
        } else if (c.want_w) {
          r.gw_parts[tid].addmm_(goc.t(), a2);
        }
        if (c.want_b) r.gb_parts[tid].add_(goc.sum(0, false, work[i].wacc));
        if (i == 0) {
          at::mm_out(da2, goc, r.wm);
        } else {
          da2.addmm_(goc, r.wm);  // the convolutions' data gradients summed in cache
        }
      }
      at::Tensor dzc = P.want_x ? pixel_rows(P.dz, r0, len) : at::Tensor();
      bn_relu_backward_reduce_kernel(da, xc, bn.scale, bn.shift, bn.mean, P.out_scale, sums_t,
                                     P.want_x ? &dzc : nullptr, Layout::NHWC, Layout::NHWC,
                                     P.stream_dz);
    }
  });
  for (size_t i = 0; i < convs.size(); ++i) {
    const Rows& r = rows[i];
    if (convs[i].want_w) work[i].gw_acc.view({r.gw_r, r.gw_c}).copy_(r.gw_parts.sum(0));
    if (convs[i].want_b) work[i].gb_acc.copy_(r.gb_parts.sum(0));
  }
}

// Convolution c's grad_out tile as its route reads it: in the tiles' layout (the GEMM on NCHW
// tiles reads any), scaled by the branch factor, staged once per tile for every use.
at::Tensor grad_out_tile(const BwdPass& P, const ConvGrad& c, ConvBwdWork& k, int64_t n0,
                         int64_t len) {
  at::Tensor got = k.go.narrow(0, n0, len);
  const bool by_cols = k.gemm == Gemm1x1::StridedCols;  // reads got in any layout
  if (P.a_layout != P.layout && dense_in(got, P.layout) && !by_cols) {
    at::Tensor t = k.go_buf.narrow(0, 0, len);
    transpose_layout_kernel(got, t, P.layout);
    if (c.bs.defined()) t.mul_(c.bs.narrow(0, n0, len));  // in cache, just transposed
    got = t;
  } else if (c.bs.defined()) {
    // The conv branch's gradient s[n] * dy, staged once per tile for every use below.
    at::Tensor t = k.go_buf.narrow(0, 0, len);
    at::mul_out(t, got, c.bs.narrow(0, n0, len));
    got = t;
  } else if (!by_cols) {
    got = got.contiguous(P.a_fmt);
  }
  return got;
}

// A tile of a strided 1x1 convolution on NCHW tiles: the forward's GEMM transposed, grad_out's
// tile and the read pixels as (Co, P) and (C, P) matrices, P = len*Ho*Wo, one GEMM each; its
// data gradient added into the pixels it read of `da`.
void backward_tile_cols(const BwdPass& P, const ConvGrad& c, ConvBwdWork& k,
                        const at::Tensor& got, const at::Tensor& a, const at::Tensor& da,
                        int64_t len) {
  const int64_t C = P.C, Co = c.weight.size(0);
  const int64_t Ho = got.size(2), Wo = got.size(3), Pn = len * Ho * Wo;
  at::Tensor go2 = k.go_cols_buf.narrow(0, 0, Co * Pn).view({Co, Pn});
  go2.view({Co, len, Ho, Wo}).copy_(got.transpose(0, 1));
  const at::Tensor cols = strided_cols(a, c.stride, Ho, Wo, k.rows_buf);
  const at::Tensor wm = k.w.view({Co, C});
  if (P.need_da) {
    at::Tensor d2 = k.drows_buf.narrow(0, 0, C * Pn).view({C, Pn});
    at::mm_out(d2, wm.t(), go2);
    TORCH_INTERNAL_ASSERT(da.defined(), "fusedres_cpu: a strided GEMM alone");
    strided_pixels_nchw(da, c.stride, Ho, Wo).add_(d2.view({C, len, Ho, Wo}).transpose(0, 1));
  }
  if (c.want_w && k.gw_t) {
    k.gw_acc.addmm_(cols, go2.t());
  } else if (c.want_w) {
    k.gw_acc.view({Co, C}).addmm_(go2, cols.t());
  }
}

// A tile of a 1x1 convolution on channels_last tiles (strided: its read pixels copied out):
// its data gradient, or undefined when a strided one added it into the pixels it read of `da`.
at::Tensor backward_tile_rows(const BwdPass& P, const ConvGrad& c, ConvBwdWork& k,
                              const at::Tensor& got, const at::Tensor& a, const at::Tensor& da,
                              int64_t len) {
  const int64_t C = P.C, Co = c.weight.size(0);
  const bool strided = k.gemm == Gemm1x1::Strided;
  const int64_t Ho = got.size(2), Wo = got.size(3), Pn = len * Ho * Wo;
  const at::Tensor go2 = got.permute({0, 2, 3, 1}).view({Pn, Co});
  const at::Tensor a2 = strided ? strided_rows(a, c.stride, Ho, Wo, k.rows_buf)
                                : a.permute({0, 2, 3, 1}).view({Pn, C});
  const at::Tensor wm = k.w.view({Co, C});
  at::Tensor dai;
  if (P.need_da && strided) {
    at::Tensor d2 = k.drows_buf.narrow(0, 0, Pn * C).view({Pn, C});
    at::mm_out(d2, go2, wm);
    // strided_beside_dense: an unstrided convolution ran first (order) and wrote da.
    TORCH_INTERNAL_ASSERT(da.defined(), "fusedres_cpu: a strided GEMM alone");
    strided_pixels(da, c.stride, Ho, Wo).add_(d2.view({len, Ho, Wo, C}));
  } else if (P.need_da) {
    dai = k.gemm_da_buf.narrow(0, 0, len);
    at::Tensor da2 = dai.permute({0, 2, 3, 1}).view({Pn, C});
    at::mm_out(da2, go2, wm);
  }
  if (c.want_w && k.gw_t) {
    k.gw_acc.addmm_(a2.t(), go2);
  } else if (c.want_w) {
    k.gw_acc.view({Co, C}).addmm_(go2.t(), a2);
  }
  return dai;
}

// A tile of a 1x1 convolution on NCHW tiles: batched GEMMs over its samples; its data gradient.
at::Tensor backward_tile_per_sample(const BwdPass& P, const ConvGrad& c, ConvBwdWork& k,
                                    const at::Tensor& got, const at::Tensor& a, int64_t len) {
  const int64_t C = P.C, Co = c.weight.size(0), HW = P.H * P.W;
  const at::Tensor got3 = got.reshape({len, Co, HW}), a3 = a.view({len, C, HW});
  at::Tensor dai;
  if (P.need_da) {
    dai = k.gemm_da_buf.narrow(0, 0, len);
    at::Tensor da3 = dai.view({len, C, HW});
    at::bmm_out(da3, k.w.view({1, Co, C}).transpose(1, 2).expand({len, C, Co}), got3);
  }
  if (c.want_w) k.gw_acc.view({Co, C}).addbmm_(got3, a3.transpose(1, 2));
  return dai;
}

// The batch-tile route: per tile the activation recomputed once; each convolution's gradients
// by its route, the data gradients summed into one tile (the strided GEMMs last, added into the
// pixels they read of the others' sum); then the BatchNorm's mask and sums over the tile.
void backward_tiles(BwdPass& P, std::vector<ConvGrad>& convs,
                    std::vector<ConvBwdWork>& work, bool all_float) {
  const at::Tensor& x = P.x;
  const Layout layout = P.layout, a_layout = P.a_layout;
  const int64_t N = P.N, C = P.C, H = P.H, W = P.W, nb = P.nb;
  const Affine& bn = P.bn;
  const at::Tensor& weight0 = convs.front().weight;
  // A float32 NHWC data gradient is read as it is by the first backward pass (no transposed
  // copy).
  at::Tensor da_buf;
  const bool da_as_is = a_layout == Layout::NHWC && layout == Layout::NCHW && all_float;
  // The strided GEMMs last: their data gradients are added into the pixels they read of the
  // others' sum.
  std::vector<size_t> order;
  for (size_t i = 0; i < convs.size(); ++i) {
    if (!is_strided(work[i].gemm)) order.push_back(i);
  }
  for (size_t i = 0; i < convs.size(); ++i) {
    if (is_strided(work[i].gemm)) order.push_back(i);
  }
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t len = std::min(nb, N - n0);
    const at::Tensor xt = x.narrow(0, n0, len);
    at::Tensor a = P.a_buf.narrow(0, 0, len);
    bn_relu_kernel(xt, bn.scale, bn.shift, a, layout, a_layout);
    at::Tensor da;  // the sum of the convolutions' data gradients for this tile
    for (const size_t i : order) {
      ConvGrad& c = convs[i];
      ConvBwdWork& k = work[i];
      const at::Tensor got = grad_out_tile(P, c, k, n0, len);
      if (c.want_b) k.gb_acc.add_(got.sum({0, 2, 3}, false, k.wacc));
      at::Tensor dai, dw;
      if (k.gemm == Gemm1x1::StridedCols) {
        backward_tile_cols(P, c, k, got, a, da, len);
      } else if (k.gemm == Gemm1x1::Whole || k.gemm == Gemm1x1::Strided) {
        dai = backward_tile_rows(P, c, k, got, a, da, len);
      } else if (k.gemm == Gemm1x1::PerSample) {
        dai = backward_tile_per_sample(P, c, k, got, a, len);
      } else {
        std::tie(dai, dw, std::ignore) = at::convolution_backward(
            got, a, k.w, std::nullopt, c.stride, c.padding, c.dilation, false, {0, 0}, 1,
            {P.need_da, c.want_w, false});
      }
      if (c.want_w && dw.defined()) {
        if (nb >= N && dw.scalar_type() == k.wacc && dw.strides() == c.gw.strides()) {
          c.gw = dw;  // one tile: its weight gradient is the result
        } else if (k.gw_acc.defined()) {
          k.gw_acc.add_(dw);
        } else {
          k.gw_acc = dw.to(k.wacc);
        }
      }
      if (P.need_da && dai.defined()) {
        if (!da.defined()) {
          da = dai;
        } else {
          da.add_(dai);  // both tiles in cache
        }
      }
    }
    if (P.need_da) {
      Layout da_layout = layout;
      if (da_as_is && dense_in(da, Layout::NHWC)) {
        da_layout = Layout::NHWC;
      } else if (a_layout != layout && dense_in(da, a_layout)) {
        if (!da_buf.defined()) da_buf = at::empty({nb, C, H, W}, weight0.options().memory_format(P.fmt));
        at::Tensor t = da_buf.narrow(0, 0, len);
        transpose_layout_kernel(da, t, a_layout);
        da = t;
      } else {
        da = da.contiguous(P.fmt);
      }
      at::Tensor dzt = P.want_x ? P.dz.narrow(0, n0, len) : at::Tensor();
      bn_relu_backward_reduce_kernel(da, xt, bn.scale, bn.shift, bn.mean, P.out_scale, P.sums,
                                     P.want_x ? &dzt : nullptr, layout, da_layout, P.stream_dz);
    }
  }
}

// The finish: one loop over C turns the threads' sums (double) into the BN parameter gradients
// and the coefficients of the data gradient dx = k1 * dz + k2 * (x - mean) + k3. Training:
// dx = scale * (dz - mean(dz) - xhat * mean(dz * xhat)), xhat = (x - mean) * invstd; eval:
// dz already holds scale * dz (k1 = 1, k2 = k3 = 0; only a cast to x's dtype is left). Then
// the data-gradient pass into gx (grad_x_add added).
void finish_bn_backward(const BwdPass& P, bool batch_stats, bool want_g, bool want_beta,
                        at::Tensor& gx, at::Tensor& gx_work, at::Tensor& gg,
                        at::Tensor& gbeta, const at::Tensor* grad_x_add) {
  const at::Tensor& x = P.x;
  const at::Tensor& sums = P.sums;
  const at::Tensor& dz = P.dz;
  const Affine& bn = P.bn;
  const int64_t N = P.N, C = P.C, H = P.H, W = P.W;
  const bool want_x = P.want_x;
  const bool apply = want_x && (batch_stats || !dz.is_same(gx_work));
  at::Tensor grads = at::empty({2, C}, sums.options());  // sum(dz), sum(dz * xhat)
  at::Tensor coef = at::empty({3, C}, x.options().dtype(P.acc));
  AT_DISPATCH_FLOATING_TYPES(P.acc, "bn_backward_coef", [&] {
    const double* sp = sums.const_data_ptr<double>();
    const int64_t threads = sums.size(0);
    const scalar_t* scale = bn.scale.const_data_ptr<scalar_t>();
    const scalar_t* inv = bn.invstd.const_data_ptr<scalar_t>();
    double* gp = grads.data_ptr<double>();
    scalar_t* k = coef.data_ptr<scalar_t>();
    const double inv_m = 1.0 / static_cast<double>(N * H * W);
    for (int64_t c = 0; c < C; ++c) {
      double sum_dz = 0, sum_dz_xm = 0;
      for (int64_t t = 0; t < threads; ++t) {
        sum_dz += sp[t * 2 * C + c];
        sum_dz_xm += sp[t * 2 * C + C + c];
      }
      const double sc = scale[c], is = inv[c];
      gp[c] = sum_dz;
      gp[C + c] = sum_dz_xm * is;
      k[c] = batch_stats ? scale[c] : scalar_t(1);
      k[C + c] = batch_stats ? static_cast<scalar_t>(-sc * is * is * sum_dz_xm * inv_m) : 0;
      k[2 * C + c] = batch_stats ? static_cast<scalar_t>(-sc * sum_dz * inv_m) : 0;
    }
  });
  if (want_g) gg.copy_(grads[1]);
  if (want_beta) gbeta.copy_(grads[0]);
  if (want_x) {
    // grad_x_add joins the data-gradient pass when it lies as x does; else it is added after.
    const bool add_in_pass = grad_x_add && apply &&
                             grad_x_add->scalar_type() == x.scalar_type() &&
                             dense_in(*grad_x_add, P.layout);
    if (apply) {
      bn_backward_apply_kernel(dz, x, bn.mean, coef[0], coef[1], coef[2], gx_work, P.layout,
                               add_in_pass ? grad_x_add : nullptr);
    }
    if (!gx_work.is_same(gx)) gx.copy_(gx_work);
    if (grad_x_add && !add_in_pass) gx.add_(*grad_x_add);
  }
}

// The backward of one BN-ReLU feeding the convolutions `convs` (one for the fused unit; two for
// a pre-activation unit's projection shortcut and first convolution, bn_relu_conv2d_pair_backward):
// per tile the activation is recomputed once, each convolution's data gradient is added into one
// tile, and one mask + sums pass and one data-gradient pass run over x, whatever the number of
// convolutions. Returns (gx, gg, gbeta) and fills each conv's gw, gb; every output has the
// metadata of ops.backward_empty_outputs (empty when not wanted). Phases: the plan
// (plan_backward), the pixel chunks or the batch tiles, the weight gradients, the finish.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_convs(
    const at::Tensor& x_in, std::vector<ConvGrad>& convs,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, bool batch_stats, bool want_x, bool want_g,
    bool want_beta, const at::Tensor* grad_x_add = nullptr) {
  const int64_t C_in = x_in.size(1);
  at::Tensor gx = want_x ? at::empty_like(x_in) : x_in.new_empty({0});
  at::Tensor gg = mean.new_empty({want_g ? C_in : 0});
  at::Tensor gbeta = mean.new_empty({want_beta ? C_in : 0});
  bool need_conv = want_x || want_g || want_beta;
  for (ConvGrad& c : convs) {
    c.gw = c.want_w ? at::empty_like(c.weight) : c.weight.new_empty({0});
    c.gb = c.weight.new_empty({c.want_b ? c.weight.size(0) : 0});
    need_conv = need_conv || c.want_w || c.want_b;
  }
  if (!need_conv) return {gx, gg, gbeta};
  if (x_in.numel() == 0) {
    // An empty batch: x's gradient is as empty as x, every sum over the batch is 0 (the public
    // op's and the portable backend's answer; the passes below would index its first sample).
    gg.zero_();
    gbeta.zero_();
    for (ConvGrad& c : convs) {
      c.gw.zero_();
      c.gb.zero_();
    }
    return {gx, gg, gbeta};
  }

  BwdPass P;
  P.need_da = want_x || want_g || want_beta;
  P.want_x = want_x;
  P.layout = layout_of(x_in);
  P.fmt = memory_format(P.layout);
  P.x = x_in.contiguous(P.fmt);
  const at::Tensor& x = P.x;
  P.N = x.size(0), P.C = x.size(1), P.H = x.size(2), P.W = x.size(3);
  P.acc = at::toOpMathType(x.scalar_type());
  P.bn = affine(bn_weight, bn_bias, mean, invstd, P.acc);

  // dz lands in the x gradient itself when it has the acc dtype and the walking layout.
  at::Tensor gx_work;
  if (want_x) {
    gx_work = gx.is_contiguous(P.fmt) ? gx : at::empty(x.sizes(), x.options().memory_format(P.fmt));
    P.dz = x.scalar_type() == P.acc ? gx_work : at::empty(x.sizes(), x.options().dtype(P.acc).memory_format(P.fmt));
  }
  // dz streams past the cache when it is too large to stay there until the data-gradient pass:
  // more than 8 MiB a thread (measured, 2 threads, channels_last backward of a 1x1 unit: 33.5
  // MB of dz 10.9 -> 8.5 ms streamed, 16.8 MB the same either way, 8.4 MB 2.0 -> 2.2 ms).
  // store_nt in bn_relu.cpp says why.
  P.stream_dz =
      want_x && P.dz.numel() * P.dz.element_size() > (int64_t(at::get_num_threads()) << 23);
  // In eval mode dx = scale * dz: the first pass writes the final value when it can.
  P.out_scale = batch_stats ? at::ones_like(P.bn.scale) : P.bn.scale;
  P.sums = at::zeros({at::get_num_threads(), 2, P.C}, x.options().dtype(at::kDouble));

  // The activation tile's layout: NHWC when any convolution's rule picks it (a 1x1 on NHWC
  // tiles is as fast as on NCHW ones: conv_layout).
  P.a_layout = P.layout;
  for (const ConvGrad& c : convs) {
    if (conv_layout(c.weight, P.layout, P.H * P.W, c.stride[0] * c.stride[1] > 1) ==
        Layout::NHWC) {
      P.a_layout = Layout::NHWC;
    }
  }
  P.a_fmt = memory_format(P.a_layout);
  std::vector<ConvBwdWork> work = plan_backward(P, convs, x_in);
  bool all_float = x.scalar_type() == at::kFloat;
  for (const ConvGrad& c : convs) all_float = all_float && c.weight.scalar_type() == at::kFloat;
  const int64_t rc = backward_chunk_rows(P, convs, work);
  if (rc > 0) {
    backward_by_chunks(P, convs, work, rc);
  } else {
    backward_tiles(P, convs, work, all_float);
  }
  for (size_t i = 0; i < convs.size(); ++i) {
    if (convs[i].want_w && work[i].gw_t) {
      convs[i].gw.copy_(work[i].gw_acc.t().view(convs[i].gw.sizes()));
    } else if (convs[i].want_w && work[i].gw_acc.defined()) {
      convs[i].gw.copy_(work[i].gw_acc);
    }
    if (convs[i].want_b) convs[i].gb.copy_(work[i].gb_acc);
  }
  if (!P.need_da) return {gx, gg, gbeta};
  finish_bn_backward(P, batch_stats, want_g, want_beta, gx, gx_work, gg, gbeta, grad_x_add);
  return {gx, gg, gbeta};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_one(
    const at::Tensor& grad_out, const at::Tensor& x_in, const at::Tensor& weight,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool batch_stats,
    std::array<bool, 5> output_mask, const std::optional<at::Tensor>& branch_scale,
    const at::Tensor* grad_x_add) {
  const auto [want_x, want_w, want_b, want_g, want_beta] = output_mask;
  std::vector<ConvGrad> convs{ConvGrad{
      {weight, stride, padding, dilation, branch_factor(branch_scale, weight)},
      grad_out,
      want_w,
      want_b}};
  auto [gx, gg, gbeta] = backward_convs(x_in, convs, bn_weight, bn_bias, mean, invstd,
                                        batch_stats, want_x, want_g, want_beta, grad_x_add);
  return {gx, convs[0].gw, convs[0].gb, gg, gbeta};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_relu_conv2d_backward(
    const at::Tensor& grad_out, const at::Tensor& x_in, const at::Tensor& weight,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool batch_stats,
    std::array<bool, 5> output_mask, const std::optional<at::Tensor>& branch_scale) {
  checks::check_backward_args("fusedres_cpu.bn_relu_conv2d_backward", kCpu, grad_out, x_in,
                              weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
                              branch_scale);
  return backward_one(grad_out, x_in, weight, bn_weight, bn_bias, mean, invstd, stride, padding,
                      dilation, batch_stats, output_mask, branch_scale, nullptr);
}

// bn_relu_conv2d_backward whose x gradient also holds grad_x_add (x's shape, a gradient of x
// from elsewhere: a pre-activation unit's identity shortcut), summed in the data-gradient pass
// instead of by autograd in a pass of its own.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bn_relu_conv2d_backward_add(
    const at::Tensor& grad_out, const at::Tensor& x_in, const at::Tensor& weight,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool batch_stats,
    std::array<bool, 5> output_mask, const std::optional<at::Tensor>& branch_scale,
    const at::Tensor& grad_x_add) {
  const char* op = "fusedres_cpu.bn_relu_conv2d_backward_add";
  checks::check_backward_args(op, kCpu, grad_out, x_in, weight, bn_weight, bn_bias, mean, invstd,
                              stride, padding, dilation, branch_scale);
  checks::check_shaped(op, "grad_x_add", grad_x_add, x_in, x_in.sizes(), "x's gradient",
                       at::ScalarType::Undefined);
  TORCH_CHECK_VALUE(output_mask[0], op,
                    ": output_mask: expected output_mask[0] (x) set: grad_x_add is added to x's "
                    "gradient");
  return backward_one(grad_out, x_in, weight, bn_weight, bn_bias, mean, invstd, stride, padding,
                      dilation, batch_stats, output_mask, branch_scale, &grad_x_add);
}

// The backward of two convolutions of one BN-ReLU (a pre-activation unit's projection shortcut
// and first convolution): one recompute of the activation per tile, one pass over x for the
// mask and sums and one for the data gradient, as plain PyTorch's single BatchNorm-ReLU
// backward; output_mask: x, both weights, both biases, bn_weight, bn_bias.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
bn_relu_conv2d_pair_backward(const at::Tensor& grad_out, const at::Tensor& grad_out2,
                             const at::Tensor& x_in, const at::Tensor& weight,
                             const at::Tensor& weight2, const std::optional<at::Tensor>& bn_weight,
                             const std::optional<at::Tensor>& bn_bias, const at::Tensor& mean,
                             const at::Tensor& invstd, c10::SymIntArrayRef stride,
                             c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                             c10::SymIntArrayRef stride2, c10::SymIntArrayRef padding2,
                             c10::SymIntArrayRef dilation2, bool batch_stats,
                             std::array<bool, 5> output_mask) {
  const char* op = "fusedres_cpu.bn_relu_conv2d_pair_backward";
  const auto convs_checked = checks::check_pair_args(
      op, kCpu, x_in, weight, std::nullopt, weight2, std::nullopt, bn_weight, bn_bias, mean,
      invstd, stride, padding, dilation, stride2, padding2, dilation2);
  checks::check_shaped(op, "grad_out", grad_out, x_in, convs_checked[0].out,
                       "the first convolution's output", at::ScalarType::Undefined);
  checks::check_shaped(op, "grad_out2", grad_out2, x_in, convs_checked[1].out,
                       "the second convolution's output", at::ScalarType::Undefined);
  const auto [want_x, want_w, want_b, want_g, want_beta] = output_mask;
  std::vector<ConvGrad> convs{
      ConvGrad{{weight, stride, padding, dilation}, grad_out, want_w, want_b},
      ConvGrad{{weight2, stride2, padding2, dilation2}, grad_out2, want_w, want_b}};
  auto [gx, gg, gbeta] = backward_convs(x_in, convs, bn_weight, bn_bias, mean, invstd,
                                        batch_stats, want_x, want_g, want_beta);
  return {gx, convs[0].gw, convs[0].gb, convs[1].gw, convs[1].gb, gg, gbeta};
}

// The backward ops' registered kernels: output_mask from the dispatcher as a c10::List, checked
// (checks::check_output_mask) and passed on as the std::array the functions above take.
using Grads5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Grads5 bn_relu_conv2d_backward_op(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool batch_stats,
    const c10::List<bool>& output_mask, const std::optional<at::Tensor>& branch_scale) {
  return bn_relu_conv2d_backward(
      grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
      batch_stats,
      checks::check_output_mask("fusedres_cpu.bn_relu_conv2d_backward", output_mask),
      branch_scale);
}

Grads5 bn_relu_conv2d_backward_add_op(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool batch_stats,
    const c10::List<bool>& output_mask, const std::optional<at::Tensor>& branch_scale,
    const at::Tensor& grad_x_add) {
  return bn_relu_conv2d_backward_add(
      grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding, dilation,
      batch_stats,
      checks::check_output_mask("fusedres_cpu.bn_relu_conv2d_backward_add", output_mask),
      branch_scale, grad_x_add);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
bn_relu_conv2d_pair_backward_op(
    const at::Tensor& grad_out, const at::Tensor& grad_out2, const at::Tensor& x,
    const at::Tensor& weight, const at::Tensor& weight2,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& mean, const at::Tensor& invstd, c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, c10::SymIntArrayRef stride2,
    c10::SymIntArrayRef padding2, c10::SymIntArrayRef dilation2, bool batch_stats,
    const c10::List<bool>& output_mask) {
  return bn_relu_conv2d_pair_backward(
      grad_out, grad_out2, x, weight, weight2, bn_weight, bn_bias, mean, invstd, stride, padding,
      dilation, stride2, padding2, dilation2, batch_stats,
      checks::check_output_mask("fusedres_cpu.bn_relu_conv2d_pair_backward", output_mask));
}

// ------------------------------------------------------------- the eager routes (../eager.h)

// The cpu backend's kernels in the shared eager layer: its C++ autograd nodes (EagerCpuUnit,
// EagerCpuPair, EagerCpuUnitWithShortcut: fusedres_cpu::eager_unit, eager_pair,
// eager_unit_with_shortcut) and a module's forward in one call
// (fusedres_cpu::module_unit), which takes float32 and float64 x.
struct CpuKernels {
  static constexpr c10::DeviceType kDevice = kCpu;
  static constexpr const char* kNamespace = "fusedres_cpu";
  static bool on_device(const at::Tensor& t) { return t.device().is_cpu(); }
  static bool takes_dtype(at::ScalarType dt) { return dt == at::kFloat || dt == at::kDouble; }
  static constexpr auto prepare = &prepare_batch_norm;
  static constexpr auto forward = &bn_relu_conv2d;
  static constexpr auto genstats = &bn_relu_conv2d_genstats;
  static constexpr auto backward = &bn_relu_conv2d_backward;
  static constexpr auto backward_add = &bn_relu_conv2d_backward_add;
  // The pair's kernels: one activation recompute for both convolutions, their data gradients
  // summed in cache before the one mask + sums pass and the one data-gradient pass over x.
  static constexpr bool kPairKernels = true;
  static constexpr auto pair_forward = &bn_relu_conv2d_pair;
  static constexpr auto pair_backward = &bn_relu_conv2d_pair_backward;
};

// The nodes' names (CppNode<...::EagerCpuUnit>) say which route built a graph.
struct EagerCpuUnit : eager::UnitNode<EagerCpuUnit, CpuKernels> {};
struct EagerCpuPair : eager::PairNode<EagerCpuPair, CpuKernels> {};
struct EagerCpuUnitWithShortcut
    : eager::ShortcutNode<EagerCpuUnitWithShortcut, CpuKernels> {};

}  // namespace
}  // namespace fusedres::cpu

TORCH_LIBRARY_IMPL(fusedres_cpu, CompositeImplicitAutograd, m) {
  using namespace fusedres::cpu;
  m.impl("module_unit", &fusedres::eager::module_unit<CpuKernels, EagerCpuUnit>);
}

TORCH_LIBRARY_IMPL(fusedres_cpu, Autograd, m) {
  using namespace fusedres::cpu;
  m.impl("eager_unit", &fusedres::eager::eager_unit<EagerCpuUnit>);
  m.impl("eager_pair", &fusedres::eager::eager_pair<EagerCpuPair>);
  m.impl("eager_unit_with_shortcut",
         &fusedres::eager::eager_unit_with_shortcut<EagerCpuUnitWithShortcut>);
  m.impl("prepare_batch_norm", &fusedres::eager::prepare_below_autograd<CpuKernels>);
}

// Below autograd (inference mode, or no autograd key) the eager ops run their forward alone.
TORCH_LIBRARY_IMPL(fusedres_cpu, CPU, m) {
  using namespace fusedres::cpu;
  m.impl("eager_unit", &fusedres::eager::unit_forward<CpuKernels>);
  m.impl("eager_pair", &fusedres::eager::pair_forward<CpuKernels>);
  m.impl("eager_unit_with_shortcut", &fusedres::eager::shortcut_forward<CpuKernels>);
  m.impl("batch_stats", &fusedres::cpu::batch_stats);
  m.impl("prepare_batch_norm", &fusedres::cpu::prepare_batch_norm);
  m.impl("bn_relu_conv2d", &fusedres::cpu::bn_relu_conv2d);
  m.impl("bn_relu_conv2d_genstats", &fusedres::cpu::bn_relu_conv2d_genstats);
  m.impl("bn_relu_conv2d_backward", &fusedres::cpu::bn_relu_conv2d_backward_op);
  m.impl("bn_relu_conv2d_backward_add", &fusedres::cpu::bn_relu_conv2d_backward_add_op);
  m.impl("bn_relu_conv2d_pair", &fusedres::cpu::bn_relu_conv2d_pair);
  m.impl("bn_relu_conv2d_pair_backward", &fusedres::cpu::bn_relu_conv2d_pair_backward_op);
}
