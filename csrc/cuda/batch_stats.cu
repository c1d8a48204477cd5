// Per-channel batch mean and biased variance over (N, H, W): fusedres_cuda::batch_stats.
//
// The same contract as the CPU backend (csrc/cpu/batch_stats.cpp, fusedres/ops.py): x (N, C,
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
#include "common.cuh"

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
constexpr int kRowsPerBlock = 8;     // NHWC block: 32 channels x 8 rows
constexpr int64_t kTargetPerBlock = kThreads * 16;  // values a split aims at
constexpr int64_t kMaxPerBlock = int64_t(1) << 22;  // keeps float counts exact
constexpr int64_t kMaxSplits = 256;

// (count, mean, M2) of channel c over values [begin, end) of its N*HW values (NCHW). The split
// starts at plane n0, offset hw0; within it the offsets fit 32 bits (hw0 + per_split < 2^32),
// so the per-value plane index is a 32-bit division (inline, no 64-bit division routine).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    stats_nchw_kernel(const scalar_t* __restrict__ x, int64_t C, int64_t HW, int64_t per_split,
                      int64_t total, acc_t<scalar_t>* __restrict__ partial) {
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
}

// NHWC: rows of C contiguous values; threadIdx.x picks the channel (32 consecutive channels,
// coalesced), threadIdx.y strides over the split's rows.
template <typename scalar_t>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    stats_nhwc_kernel(const scalar_t* __restrict__ x, int64_t C, int64_t rows_per_split,
                      int64_t rows, acc_t<scalar_t>* __restrict__ partial) {
  FUSEDRES_LAUNCH_BOUNDS(32 * kRowsPerBlock);
  using A = acc_t<scalar_t>;
  __shared__ A s_n[kRowsPerBlock][32], s_mean[kRowsPerBlock][32], s_m2[kRowsPerBlock][32];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t split = blockIdx.y;
  const int64_t begin = split * rows_per_split;
  const int64_t end = begin + rows_per_split < rows ? begin + rows_per_split : rows;
  Moments<A> m{A(0), A(0), A(0)};
  if (c < C) {
    const A shift = stats_shift(static_cast<A>(x[c]));
    for (int64_t r = begin + threadIdx.y; r < end; r += kRowsPerBlock) {
      m.add(static_cast<A>(x[r * C + c]) - shift);
    }
  }
  s_n[threadIdx.y][threadIdx.x] = m.n;
  s_mean[threadIdx.y][threadIdx.x] = m.mean;
  s_m2[threadIdx.y][threadIdx.x] = m.m2;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int r = 1; r < kRowsPerBlock; ++r) {
      m.merge(s_n[r][threadIdx.x], s_mean[r][threadIdx.x], s_m2[r][threadIdx.x]);
    }
    A* out = partial + (c * gridDim.y + split) * 3;
    out[0] = m.n;
    out[1] = m.mean;
    out[2] = m.m2;
  }
}

// One warp per channel: merge the channel's splits in double, write mean (the shift, the
// channel's first value x[c * shift_stride], added back) and biased variance.
template <typename scalar_t, typename A>
__global__ void __launch_bounds__(256)
    stats_finalize_kernel(const scalar_t* __restrict__ x, int64_t shift_stride,
                          const A* __restrict__ partial, int64_t C, int64_t splits,
                          A* __restrict__ mean, A* __restrict__ var) {
  FUSEDRES_LAUNCH_BOUNDS(256);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (c >= C) return;  // a whole warp leaves together (blockDim.x == 32)
  Moments<double> m{0.0, 0.0, 0.0};
  for (int64_t s = threadIdx.x; s < splits; s += 32) {
    const A* p = partial + (c * splits + s) * 3;
    m.merge(static_cast<double>(p[0]), static_cast<double>(p[1]), static_cast<double>(p[2]));
  }
  m.warp_merge();
  if (threadIdx.x == 0) {
    const double shift = static_cast<double>(stats_shift(static_cast<A>(x[c * shift_stride])));
    mean[c] = static_cast<A>(shift + m.mean);
    var[c] = static_cast<A>(m.m2 / m.n);
  }
}

int64_t num_splits(int64_t values) {
  int64_t splits = std::min(kMaxSplits, std::max<int64_t>(1, ceil_div(values, kTargetPerBlock)));
  return std::max(splits, ceil_div(values, kMaxPerBlock));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> batch_stats(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 4, "fusedres_cuda.batch_stats: x must be 4-D (N, C, H, W), got ",
              x_in.dim(), "-D");
  check_device(x_in, "batch_stats", "x");
  TORCH_CHECK(at::isFloatingType(x_in.scalar_type()),
              "fusedres_cuda.batch_stats: x must be float32, float16, bfloat16 or float64, got ",
              x_in.scalar_type());
  DeviceGuard guard(x_in.device());
  const bool nhwc = suggests_channels_last(x_in);
  const at::Tensor x = x_in.contiguous(nhwc ? at::MemoryFormat::ChannelsLast
                                            : at::MemoryFormat::Contiguous);
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  TORCH_CHECK(HW < (int64_t(1) << 31), "fusedres_cuda.batch_stats: H * W must be below 2^31, got ",
              HW);
  const int64_t values = N * HW;
  const auto acc_type = at::toOpMathType(x.scalar_type());
  at::Tensor mean = at::empty({C}, x.options().dtype(acc_type));
  at::Tensor var = at::empty({C}, x.options().dtype(acc_type));
  if (C == 0) return {mean, var};
  if (values == 0) {  // as the CPU kernel: no values, mean 0 and variance nan
    mean.zero_();
    var.fill_(std::numeric_limits<double>::quiet_NaN());
    return {mean, var};
  }
  const cudaStream_t stream = current_stream();
  const int64_t splits = num_splits(nhwc ? ceil_div(values, kRowsPerBlock) * kRowsPerBlock
                                         : values);
  at::Tensor partial = at::empty({C, splits, 3}, x.options().dtype(acc_type));
  FUSEDRES_DISPATCH_FLOATING(x.scalar_type(), "fusedres_cuda.batch_stats", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    A* pp = partial.mutable_data_ptr<A>();
    if (nhwc) {
      const int64_t rows_per_split = ceil_div(values, splits);
      const dim3 grid(static_cast<unsigned>(ceil_div(C, 32)), static_cast<unsigned>(splits));
      FUSEDRES_LAUNCH(grid, dim3(32, kRowsPerBlock), 0, stream, stats_nhwc_kernel<scalar_t>)(
          xp, C, rows_per_split, values, pp);
    } else {
      const int64_t per_split = ceil_div(values, splits);
      const dim3 grid(static_cast<unsigned>(C), static_cast<unsigned>(splits));
      FUSEDRES_LAUNCH(grid, dim3(kThreads), 0, stream, stats_nchw_kernel<scalar_t>)(
          xp, C, HW, per_split, values, pp);
    }
    FUSEDRES_CHECK_LAUNCH();
    const dim3 block(32, 8);
    FUSEDRES_LAUNCH(dim3(static_cast<unsigned>(ceil_div(C, 8))), block, 0, stream,
                    stats_finalize_kernel<scalar_t, A>)(
        xp, nhwc ? 1 : HW, pp, C, splits, mean.mutable_data_ptr<A>(), var.mutable_data_ptr<A>());
    FUSEDRES_CHECK_LAUNCH();
  });
  return {mean, var};
}

}  // namespace fusedres::FUSEDRES_CUDA_NS

FUSEDRES_CUDA_LIBRARY_IMPL(m) { m.impl("batch_stats", &fusedres::FUSEDRES_CUDA_NS::batch_stats); }
