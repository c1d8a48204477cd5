// Per-channel batch mean and biased variance over (N, H, W): fusedres_cuda::batch_stats.
//
// The same contract as the CPU backend (csrc/cpu/batch_stats.cpp, fusedres/ops/__init__.py): x (N, C,
// H, W) in float32, float16, bfloat16 or float64, NCHW or channels_last; returns (mean, var),
// shape (C,), float32 (float64 for float64 input). Two kernels:
//   1. partials: each block reduces one split of one channel (NCHW) or of 32 channels (NHWC)
//      with Welford updates per thread and Chan merges across threads (warp shuffles, then
//      shared memory), writing (count, mean, M2) per (channel, split) in the accumulate type;
//   2. finalize: one warp per channel merges its splits in double and writes mean and M2 / n.
// Values are shifted by the channel's first value before they are accumulated (the shifted-data
// algorithm): float Welford updates then see deviations, not a large offset, and x = 1000 +
// noise keeps its variance's digits. A first value that is inf or NaN is no shift (0), so it
// does not poison the other values; an infinite mean stays infinite (Moments), as PyTorch's sum
// gives. Offsets are int64 throughout.
//
// fusedres_cuda::prepare_batch_norm (nn.BatchNorm2d's preparation, the schema of
// fusedres_cpu::prepare_batch_norm) reuses the partials kernel and replaces the finalize by one
// that also writes invstd and updates the running statistics in place: a training step's
// BatchNorm is these two launches; with a producer's statistics, or in eval, one launch.
#include <torch/csrc/autograd/variable.h>

#include <optional>

#include "../prepare.h"  // before common.cuh: plain C++, outside the host layer's macros
#include "cutlass_conv/cutlass_conv.h"  // FUSEDRES_CUDA_KERNELS, read by every op (plain C++)
#include "common.cuh"
#include "ops.h"

namespace fusedres::FUSEDRES_CUDA_NS {

// The shift of the shifted-data algorithm: the channel's first value when finite, else 0
// (v - v is 0 only for finite v; no math-library call, the same on nvcc and the host layer).
template <typename A>
__device__ __forceinline__ A stats_shift(A v) {
  return v - v == A(0) ? v : A(0);
}
namespace {

constexpr int kThreads = 256;        // NCHW block: 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int64_t kTargetPerBlock = kThreads * 16;  // values a split aims at
constexpr int64_t kMaxPerBlock = int64_t(1) << 22;  // keeps float counts exact
constexpr int64_t kMaxSplits = 256;

// num_batches_tracked += 1 (prepare_batch_norm in training; null otherwise), by the grid's
// first thread: the finalize launched after this kernel reads the count, and no thread of this
// grid does. Last in the kernels: at their start it held a register through the main loop
// (stats_nhwc_kernel on sm_80: 32 -> 36, one resident block fewer).
__device__ __forceinline__ void count_batch(int64_t* tracked) {
  if (tracked != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 &&
      threadIdx.y == 0) {
    *tracked += 1;
  }
}

// (count, mean, M2) of channel c over values [begin, end) of its N*HW values (NCHW). The split
// starts at plane n0, offset hw0; within it the offsets fit 32 bits (hw0 + per_split < 2^32),
// so the per-value plane index is a 32-bit division (inline, no 64-bit division routine).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    stats_nchw_kernel(const scalar_t* __restrict__ x, int64_t C, int64_t HW, int64_t per_split,
                      int64_t total, acc_t<scalar_t>* __restrict__ partial,
                      int64_t* __restrict__ tracked) {
  FUSEDRES_LAUNCH_BOUNDS(kThreads);
  using A = acc_t<scalar_t>;
  __shared__ A warp_n[kWarps], warp_mean[kWarps], warp_m2[kWarps];
  const int64_t c = blockIdx.x;
  const int64_t split = blockIdx.y;
  const int64_t begin = split * per_split;
  const int64_t end = begin + per_split < total ? begin + per_split : total;
  const int64_t n0 = begin / HW;
  const uint32_t hw0 = static_cast<uint32_t>(begin - n0 * HW);
  const uint32_t hw32 = static_cast<uint32_t>(HW);
  const uint32_t count = static_cast<uint32_t>(end - begin);
  const scalar_t* base = x + (n0 * C + c) * HW;
  const A shift = stats_shift(static_cast<A>(x[c * HW]));
  Moments<A> m{A(0), A(0), A(0)};
  for (uint32_t k = threadIdx.x; k < count; k += kThreads) {
    const uint32_t q = (hw0 + k) / hw32;  // planes past n0
    const uint32_t hw = hw0 + k - q * hw32;
    m.add(static_cast<A>(base[static_cast<int64_t>(q) * C * HW + hw]) - shift);
  }
  m.warp_merge();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_n[warp] = m.n;
    warp_mean[warp] = m.mean;
    warp_m2[warp] = m.m2;
  }
  __syncthreads();
  if (warp == 0) {
    Moments<A> b{A(0), A(0), A(0)};
    if (lane < kWarps) b = Moments<A>{warp_n[lane], warp_mean[lane], warp_m2[lane]};
    b.warp_merge();
    if (lane == 0) {
      A* out = partial + (c * gridDim.y + split) * 3;
      out[0] = b.n;
      out[1] = b.mean;
      out[2] = b.m2;
    }
  }
  count_batch(tracked);
}

// NHWC: rows of C contiguous values, in the column reductions' blocks (common.cuh: threadIdx.x
// one of kColumnCols consecutive channels, threadIdx.y one of kColumnLanes row lanes over the
// split's rows). The lanes' moments are merged by Chan's formula, not added, so this kernel
// keeps its own lane loop rather than column_lanes_sum's.
template <typename scalar_t>
__global__ void __launch_bounds__(kColumnCols * kColumnLanes)
    stats_nhwc_kernel(const scalar_t* __restrict__ x, int64_t C, int64_t rows_per_split,
                      int64_t rows, acc_t<scalar_t>* __restrict__ partial,
                      int64_t* __restrict__ tracked) {
  FUSEDRES_LAUNCH_BOUNDS(kColumnCols * kColumnLanes);
  using A = acc_t<scalar_t>;
  __shared__ A s_n[kColumnLanes][kColumnCols], s_mean[kColumnLanes][kColumnCols],
      s_m2[kColumnLanes][kColumnCols];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnCols + threadIdx.x;
  const int64_t split = blockIdx.y;
  const int64_t begin = split * rows_per_split;
  const int64_t end = begin + rows_per_split < rows ? begin + rows_per_split : rows;
  Moments<A> m{A(0), A(0), A(0)};
  if (c < C) {
    const A shift = stats_shift(static_cast<A>(x[c]));
    for (int64_t r = begin + threadIdx.y; r < end; r += kColumnLanes) {
      m.add(static_cast<A>(x[r * C + c]) - shift);
    }
  }
  s_n[threadIdx.y][threadIdx.x] = m.n;
  s_mean[threadIdx.y][threadIdx.x] = m.mean;
  s_m2[threadIdx.y][threadIdx.x] = m.m2;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int r = 1; r < kColumnLanes; ++r) {
      m.merge(s_n[r][threadIdx.x], s_mean[r][threadIdx.x], s_m2[r][threadIdx.x]);
    }
    A* out = partial + (c * gridDim.y + split) * 3;
    out[0] = m.n;
    out[1] = m.mean;
    out[2] = m.m2;
  }
  count_batch(tracked);
}

// Channel c's mean (the shift, the channel's first value x[c * shift_stride], added back) and
// biased variance from its splits' partials, merged in double by one warp: every lane ends with
// them. The finalize kernels share it, so that prepare_batch_norm's statistics are batch_stats's
// bit for bit.
template <typename scalar_t, typename A>
__device__ __forceinline__ void merge_splits(const scalar_t* __restrict__ x, int64_t shift_stride,
                                             const A* __restrict__ partial, int64_t c,
                                             int64_t splits, A& mean, A& var) {
  Moments<double> m{0.0, 0.0, 0.0};
  for (int64_t s = threadIdx.x; s < splits; s += 32) {
    const A* p = partial + (c * splits + s) * 3;
    m.merge(static_cast<double>(p[0]), static_cast<double>(p[1]), static_cast<double>(p[2]));
  }
  m.warp_merge();
  const double shift = static_cast<double>(stats_shift(static_cast<A>(x[c * shift_stride])));
  mean = static_cast<A>(shift + m.mean);
  var = static_cast<A>(m.m2 / m.n);
}

// One warp per channel: merge the channel's splits, write mean and biased variance.
template <typename scalar_t, typename A>
__global__ void __launch_bounds__(256)
    stats_finalize_kernel(const scalar_t* __restrict__ x, int64_t shift_stride,
                          const A* __restrict__ partial, int64_t C, int64_t splits,
                          A* __restrict__ mean, A* __restrict__ var) {
  FUSEDRES_LAUNCH_BOUNDS(256);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (c >= C) return;  // a whole warp leaves together (blockDim.x == 32)
  A m, v;
  merge_splits(x, shift_stride, partial, c, splits, m, v);
  if (threadIdx.x == 0) {
    mean[c] = m;
    var[c] = v;
  }
}

int64_t num_splits(int64_t values) {
  int64_t splits = std::min(kMaxSplits, std::max<int64_t>(1, ceil_div(values, kTargetPerBlock)));
  return std::max(splits, ceil_div(values, kMaxPerBlock));
}

// x as the kernels read it (NCHW or NHWC dense) and its statistics pass's split.
struct StatsPass {
  at::Tensor x;
  bool nhwc;
  int64_t C, HW, values, splits;
};

StatsPass stats_pass(const char* op, const at::Tensor& x_in) {
  const bool nhwc = suggests_channels_last(x_in);
  StatsPass p;
  p.x = x_in.contiguous(nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  p.nhwc = nhwc;
  p.C = p.x.size(1);
  p.HW = p.x.size(2) * p.x.size(3);
  TORCH_CHECK(p.HW < (int64_t(1) << 31), op, ": H * W must be below 2^31, got ", p.HW);
  p.values = p.x.size(0) * p.HW;
  p.splits = num_splits(nhwc ? ceil_div(p.values, kColumnLanes) * kColumnLanes : p.values);
  return p;
}

// The partials kernel of pass p into partial (C, splits, 3); with `tracked`, the kernel also
// counts num_batches_tracked.
template <typename scalar_t>
void launch_partials(const StatsPass& p, acc_t<scalar_t>* partial, int64_t* tracked,
                     cudaStream_t stream) {
  const scalar_t* xp = p.x.const_data_ptr<scalar_t>();
  if (p.nhwc) {
    const int64_t rows_per_split = ceil_div(p.values, p.splits);
    const dim3 grid(static_cast<unsigned>(ceil_div(p.C, kColumnCols)),
                    static_cast<unsigned>(p.splits));
    FUSEDRES_LAUNCH(grid, dim3(kColumnCols, kColumnLanes), 0, stream,
                    stats_nhwc_kernel<scalar_t>)(
        xp, p.C, rows_per_split, p.values, partial, tracked);
  } else {
    const int64_t per_split = ceil_div(p.values, p.splits);
    const dim3 grid(static_cast<unsigned>(p.C), static_cast<unsigned>(p.splits));
    FUSEDRES_LAUNCH(grid, dim3(kThreads), 0, stream, stats_nchw_kernel<scalar_t>)(
        xp, p.C, p.HW, per_split, p.values, partial, tracked);
  }
  FUSEDRES_CHECK_LAUNCH();
}

// The finalize kernels' grid: one warp per channel, 8 channels a block.
constexpr int kFinalizeWarps = 8;

}  // namespace

std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x_in) {
  checks::check_stats_input("fusedres_cuda.batch_stats", x_in, kDeviceType);
  // Every op reads FUSEDRES_CUDA_KERNELS (SyncBatchNorm's route takes these statistics, then
  // updates the running ones, before the unit runs).
  cutlass_conv::kernel_set("fusedres_cuda.batch_stats");
  DeviceGuard guard(x_in.device());
  const StatsPass p = stats_pass("fusedres_cuda.batch_stats", x_in);
  const auto acc_type = at::toOpMathType(p.x.scalar_type());
  at::Tensor mean = at::empty({p.C}, p.x.options().dtype(acc_type));
  at::Tensor var = at::empty({p.C}, p.x.options().dtype(acc_type));
  if (p.C == 0) return {mean, var};
  if (p.values == 0) {  // as the CPU kernel: no values, NaN mean and variance (docs/api.md)
    mean.fill_(std::numeric_limits<double>::quiet_NaN());
    var.fill_(std::numeric_limits<double>::quiet_NaN());
    return {mean, var};
  }
  const cudaStream_t stream = current_stream();
  at::Tensor partial = at::empty({p.C, p.splits, 3}, p.x.options().dtype(acc_type));
  FUSEDRES_DISPATCH_FLOATING(p.x.scalar_type(), "fusedres_cuda.batch_stats", [&] {
    using A = acc_t<scalar_t>;
    A* pp = partial.mutable_data_ptr<A>();
    launch_partials<scalar_t>(p, pp, nullptr, stream);
    const dim3 block(32, kFinalizeWarps);
    FUSEDRES_LAUNCH(dim3(static_cast<unsigned>(ceil_div(p.C, kFinalizeWarps))), block, 0, stream,
                    stats_finalize_kernel<scalar_t, A>)(
        p.x.const_data_ptr<scalar_t>(), p.nhwc ? 1 : p.HW, pp, p.C, p.splits,
        mean.mutable_data_ptr<A>(), var.mutable_data_ptr<A>());
    FUSEDRES_CHECK_LAUNCH();
  });
  return {mean, var};
}

// ----------------------------------------------------------------------------- prepare

namespace {

// The running statistics a training step's prepare updates (null pointers: none), and the
// factor f of the update: momentum (keep = 1 - momentum and take = momentum, computed in double
// as Python computes them), or with `cumulative` 1 / num_batches_tracked.
template <typename R>
struct RunningUpdate {
  R* mean;
  R* var;
  bool cumulative;
  double keep, take;
  double bessel;  // M / (M - 1), M the values a channel
};

// One op of ATen's on R tensors: computed in opmath_type<R> (float for half and bfloat16) and
// rounded to R.
template <typename R>
__device__ __forceinline__ R times(R a, acc_t<R> b) {
  return static_cast<R>(mul_rn(static_cast<acc_t<R>>(a), b));
}
template <typename R>
__device__ __forceinline__ R plus(R a, R b) {
  return static_cast<R>(add_rn(static_cast<acc_t<R>>(a), static_cast<acc_t<R>>(b)));
}

// rm <- rm * (1 - f) + mean * f and rv <- rv * (1 - f) + (var * bessel) * f for channel c, bit
// for bit as fusedres.functional._update_running_stats's ATen ops compute them on R tensors
// (rm.mul_(1 - f).add_(mean.to(R) * f)): each op computes in opmath_type<R> and rounds its result
// to R, separately (add_rn, mul_rn: no FMA across two ops); mean and var * bessel (rounded to A,
// as var * (M / (M - 1)) on the statistics) are cast to R first. A Python-scalar factor reaches
// ATen's kernels in opmath_type<R>; with momentum None it is 1.0 / num_batches_tracked.to(R),
// which torch computes as reciprocal() then * 1.0 (exact) on an R tensor, and 1 - f is an R
// tensor too. `count`: num_batches_tracked after this step's increment.
template <typename A, typename R>
__device__ __forceinline__ void update_running(const RunningUpdate<R>& u, int64_t c, A mean,
                                               A var, int64_t count) {
  using O = acc_t<R>;
  O keep, take;
  if (u.cumulative) {
    const R t = static_cast<R>(static_cast<O>(count));
    const R f = static_cast<R>(div_rn(O(1), static_cast<O>(t)));
    keep = static_cast<O>(static_cast<R>(sub_rn(O(1), static_cast<O>(f))));
    take = static_cast<O>(f);
  } else {
    keep = static_cast<O>(u.keep);
    take = static_cast<O>(u.take);
  }
  const A unbiased = mul_rn(var, static_cast<A>(u.bessel));
  u.mean[c] = plus(times(u.mean[c], keep), times(static_cast<R>(mean), take));
  u.var[c] = plus(times(u.var[c], keep), times(static_cast<R>(unbiased), take));
}

// invstd = torch.rsqrt(var + eps) as ATen computes it on this device: the sum rounded to A, then
// rsqrt. ATen's CUDA kernel calls ::rsqrt (rsqrtf for float: an approximation, which the same
// call reproduces bit for bit); its CPU kernel computes 1 / sqrt, which the host layer's rsqrt
// does (on_cpu/runtime.h), so the host copy matches ATen on its CPU tensors.
template <typename A>
__device__ __forceinline__ A invstd_of(A var, double eps) {
  return rsqrt(add_rn(var, static_cast<A>(eps)));
}

// Training with a statistics pass: one warp per channel merges the partials (merge_splits, as
// batch_stats), writes mean and invstd, and updates the running statistics (up.mean non-null).
// `tracked`: num_batches_tracked, already counted by the partials kernel (read for the
// cumulative factor only).
template <typename scalar_t, typename R>
__global__ void __launch_bounds__(256)
    prepare_finalize_kernel(const scalar_t* __restrict__ x, int64_t shift_stride,
                            const acc_t<scalar_t>* __restrict__ partial, int64_t C,
                            int64_t splits, double eps, RunningUpdate<R> up,
                            const int64_t* __restrict__ tracked,
                            acc_t<scalar_t>* __restrict__ mean_out,
                            acc_t<scalar_t>* __restrict__ invstd_out) {
  FUSEDRES_LAUNCH_BOUNDS(256);
  using A = acc_t<scalar_t>;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (c >= C) return;  // a whole warp leaves together (blockDim.x == 32)
  A mean, var;
  merge_splits(x, shift_stride, partial, c, splits, mean, var);
  if (threadIdx.x == 0) {
    mean_out[c] = mean;
    invstd_out[c] = invstd_of(var, eps);
    if (up.mean != nullptr) update_running(up, c, mean, var, up.cumulative ? *tracked : 0);
  }
}

// Training with given statistics (a producer's mean and biased var of x): the mean copied,
// invstd, the running statistics updated. With `tracked` (num_batches_tracked to count: a
// one-block launch) every thread reads the count before the barrier and one writes it after.
template <typename A, typename R>
__global__ void __launch_bounds__(256)
    prepare_given_kernel(const A* __restrict__ mean_in, const A* __restrict__ var_in, int64_t C,
                         double eps, RunningUpdate<R> up, int64_t* __restrict__ tracked,
                         A* __restrict__ mean_out, A* __restrict__ invstd_out) {
  FUSEDRES_LAUNCH_BOUNDS(256);
  int64_t count = 0;
  if (tracked != nullptr) count = *tracked + 1;
  __syncthreads();
  if (tracked != nullptr && global_thread_x() == 0) *tracked = count;
  for (int64_t c = global_thread_x(); c < C; c += grid_stride_x()) {
    const A mean = mean_in[c], var = var_in[c];
    mean_out[c] = mean;
    invstd_out[c] = invstd_of(var, eps);
    if (up.mean != nullptr) update_running(up, c, mean, var, count);
  }
}

// Eval: the running statistics as (mean, invstd) in the statistics dtype (running_mean.to(A),
// torch.rsqrt(running_var.to(A) + eps)).
template <typename A, typename R>
__global__ void __launch_bounds__(256)
    prepare_eval_kernel(const R* __restrict__ rm, const R* __restrict__ rv, int64_t C,
                        double eps, A* __restrict__ mean_out, A* __restrict__ invstd_out) {
  FUSEDRES_LAUNCH_BOUNDS(256);
  for (int64_t c = global_thread_x(); c < C; c += grid_stride_x()) {
    mean_out[c] = static_cast<A>(rm[c]);
    invstd_out[c] = invstd_of(static_cast<A>(rv[c]), eps);
  }
}

// f(R{}) for running statistics of dtype rt that the kernels are built for with x of type
// scalar_t: x's dtype or the statistics dtype (nn.BatchNorm2d in x's dtype, or in float32 beside
// a 16-bit x). False, nothing run, for any other (the ATen route takes those).
template <typename scalar_t, typename F>
bool with_running_type(at::ScalarType rt, F&& f) {
  using A = acc_t<scalar_t>;
  if (rt == c10::CppTypeToScalarType<scalar_t>::value) {
    f(scalar_t{});
    return true;
  }
  if (rt == c10::CppTypeToScalarType<A>::value) {
    f(A{});
    return true;
  }
  return false;
}

// A one-element int64 counter on x's device that a kernel can count.
bool kernel_counter(const std::optional<at::Tensor>& t, const at::Tensor& x) {
  return !present(t) || (t->scalar_type() == at::kLong && t->numel() == 1 &&
                         t->device() == x.device() && t->is_contiguous());
}

}  // namespace

// nn.BatchNorm2d's statistics and running-statistics update, (mean, invstd) in the statistics
// dtype: the contract of fusedres_cpu::prepare_batch_norm (fusedres.functional.
// prepare_batch_norm). Launches: training with a statistics pass, two (batch_stats's partials
// kernel, which also counts num_batches_tracked, then prepare_finalize_kernel: statistics,
// invstd and the running-statistics update); training with given statistics, one
// (prepare_given_kernel); eval, one (prepare_eval_kernel). Running statistics of another dtype
// than x's or the statistics', non-contiguous ones, or a num_batches_tracked the kernels cannot
// count take the Python rule's ATen ops instead (same values). Outputs never alias an input.
std::tuple<at::Tensor, at::Tensor> prepare_batch_norm(
    const at::Tensor& x_in, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& num_batches_tracked, bool training,
    std::optional<double> momentum, double eps, const std::optional<at::Tensor>& mean_in,
    const std::optional<at::Tensor>& var_in) {
  const char* op = "fusedres_cuda.prepare_batch_norm";
  checks::check_prepare_args(op, kDeviceType, x_in, running_mean, running_var,
                             num_batches_tracked, training, momentum, eps, mean_in, var_in);
  // A FUSEDRES_CUDA_KERNELS this copy cannot honour fails here, before the running statistics
  // are touched (module_unit prepares, then runs the unit).
  cutlass_conv::kernel_set(op);
  DeviceGuard guard(x_in.device());
  const bool tracked = present(running_mean);
  const bool use_batch = training || !tracked, update = training && tracked;
  const bool given = use_batch && present(mean_in);
  const at::ScalarType sdt = at::toOpMathType(x_in.scalar_type());
  const int64_t C = x_in.size(1);
  const cudaStream_t stream = current_stream();
  at::Tensor mean = at::empty({C}, x_in.options().dtype(sdt));
  at::Tensor invstd = at::empty_like(mean);
  // The kernels write the running statistics and the count in place: same dtype, dense.
  const at::ScalarType rt = tracked ? running_mean->scalar_type() : sdt;
  const bool kernels_take =
      !tracked || (running_var->scalar_type() == rt && running_mean->is_contiguous() &&
                   running_var->is_contiguous() &&
                   (!update || kernel_counter(num_batches_tracked, x_in)));
  // The statistics pass's layout and split, checked before anything is written.
  std::optional<StatsPass> pass;
  if (use_batch && !given) pass = stats_pass(op, x_in);
  bool done = false;
  FUSEDRES_DISPATCH_FLOATING(x_in.scalar_type(), "fusedres_cuda.prepare_batch_norm", [&] {
    using A = acc_t<scalar_t>;
    if (!kernels_take) return;
    done = with_running_type<scalar_t>(rt, [&](auto r) {
      using R = decltype(r);
      A* mp = mean.mutable_data_ptr<A>();
      A* ip = invstd.mutable_data_ptr<A>();
      if (!use_batch) {
        FUSEDRES_LAUNCH(dim3(blocks_for(C, 256)), dim3(256), 0, stream,
                        prepare_eval_kernel<A, R>)(running_mean->const_data_ptr<R>(),
                                                   running_var->const_data_ptr<R>(), C, eps, mp,
                                                   ip);
        FUSEDRES_CHECK_LAUNCH();
        return;
      }
      RunningUpdate<R> up{nullptr, nullptr, !momentum.has_value(), 0.0, 0.0, 0.0};
      int64_t* count = nullptr;
      if (update) {
        // Counted as the in-place ops count them, once each, before any kernel writes.
        torch::autograd::impl::bump_version(*running_mean);
        torch::autograd::impl::bump_version(*running_var);
        if (present(num_batches_tracked)) {
          torch::autograd::impl::bump_version(*num_batches_tracked);
          count = num_batches_tracked->mutable_data_ptr<int64_t>();
        }
        const double M = static_cast<double>(x_in.numel() / C);
        up.mean = running_mean->mutable_data_ptr<R>();
        up.var = running_var->mutable_data_ptr<R>();
        up.keep = momentum.has_value() ? 1 - *momentum : 0.0;
        up.take = momentum.value_or(0.0);
        up.bessel = M / (M - 1);
      }
      if (given) {
        const at::Tensor m = mean_in->contiguous(), v = var_in->contiguous();
        // One block when it counts: its barrier orders every read of the count before the
        // write.
        const unsigned blocks = count != nullptr ? 1 : blocks_for(C, 256);
        FUSEDRES_LAUNCH(dim3(blocks), dim3(256), 0, stream, prepare_given_kernel<A, R>)(
            m.const_data_ptr<A>(), v.const_data_ptr<A>(), C, eps, up, count, mp, ip);
        FUSEDRES_CHECK_LAUNCH();
        return;
      }
      const StatsPass& p = *pass;
      at::Tensor partial = at::empty({C, p.splits, 3}, p.x.options().dtype(sdt));
      A* pp = partial.mutable_data_ptr<A>();
      launch_partials<scalar_t>(p, pp, count, stream);
      FUSEDRES_LAUNCH(dim3(static_cast<unsigned>(ceil_div(C, kFinalizeWarps))),
                      dim3(32, kFinalizeWarps), 0, stream, prepare_finalize_kernel<scalar_t, R>)(
          p.x.const_data_ptr<scalar_t>(), p.nhwc ? 1 : p.HW, pp, C, p.splits, eps, up, count, mp,
          ip);
      FUSEDRES_CHECK_LAUNCH();
    });
  });
  if (done) return {mean, invstd};
  // The ATen route: the same statistics, the Python rule's ops.
  if (!use_batch) return eval_stats_aten(*running_mean, *running_var, sdt, eps);
  at::Tensor var;
  if (given) {
    mean = mean_in->clone();
    var = *var_in;
  } else {
    std::tie(mean, var) = batch_stats(x_in);
  }
  if (update) {
    update_running_stats_aten(*running_mean, *running_var, num_batches_tracked, mean, var,
                              momentum, x_in.numel() / C);
  }
  return {mean, at::rsqrt(var + eps)};
}

}  // namespace fusedres::FUSEDRES_CUDA_NS

FUSEDRES_CUDA_LIBRARY_IMPL(m) {
  m.impl("batch_stats", &fusedres::FUSEDRES_CUDA_NS::batch_stats);
  m.impl("prepare_batch_norm", &fusedres::FUSEDRES_CUDA_NS::prepare_batch_norm);
}
