// Per-channel batch mean and biased variance (training-mode BatchNorm statistics).
//
// Each chunk (a run of one NCHW plane, or a block of NHWC rows) is reduced twice while it is in
// cache: its mean in acc-dtype vector lanes, then the sum of deviations d = x - mean and of d^2
// (the first corrects the mean's rounding, the second is the chunk's M2). Chunks are merged in
// double with Chan's formula, per thread and then across threads. No E[x^2] - E[x]^2
// cancellation anywhere: x = 1000 + noise keeps full relative precision in the variance.
#include <cmath>
#include <limits>

#include "vec.h"

namespace fusedres::cpu::CPU_CAPABILITY {
namespace {

constexpr int64_t kChunk = 8192;  // elements per chunk: 32 KiB of float, an L1-sized run

// Clamps rounding below zero away but keeps nan (std::max(0.0, nan) would return 0).
inline double nonneg(double v) { return v < 0 ? 0.0 : v; }

struct Moments {
  double n = 0, mean = 0, m2 = 0;
  void merge(double nb, double mean_b, double m2_b) {
    if (nb == 0) return;
    const double total = n + nb;
    if (!std::isfinite(mean) || !std::isfinite(mean_b)) {
      // inf/nan inputs: the mean is the sum's (inf, or nan for inf - inf), the variance nan.
      mean = n == 0 ? mean_b : mean + mean_b;
      m2 = std::numeric_limits<double>::quiet_NaN();
      n = total;
      return;
    }
    const double delta = mean_b - mean;
    mean += delta * nb / total;
    m2 += m2_b + delta * delta * n * nb / total;
    n = total;
  }
};

// Moments of `runs` contiguous runs of `len` values, p[k * stride + i] (one plane chunk, or one
// channel's planes of several samples).
template <typename T>
void run_moments(const T* p, int64_t runs, int64_t stride, int64_t len, double& mean_out,
                 double& m2_out) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr int64_t W = V::size();
  V s0(0), s1(0), s2(0), s3(0);
  A sum = 0;
  for (int64_t k = 0; k < runs; ++k) {
    const T* q = p + k * stride;
    int64_t i = 0;
    for (; i + 4 * W <= len; i += 4 * W) {
      s0 += VecIO<T>::load(q + i);
      s1 += VecIO<T>::load(q + i + W);
      s2 += VecIO<T>::load(q + i + 2 * W);
      s3 += VecIO<T>::load(q + i + 3 * W);
    }
    for (; i + W <= len; i += W) s0 += VecIO<T>::load(q + i);
    for (; i < len; ++i) sum += static_cast<A>(q[i]);
  }
  sum += at::vec::vec_reduce_all<A>([](V a, V b) { return a + b; }, (s0 + s1) + (s2 + s3));
  const int64_t n = runs * len;
  const A m = sum / static_cast<A>(n);
  if (!std::isfinite(static_cast<double>(m))) {
    mean_out = m;
    m2_out = std::numeric_limits<double>::quiet_NaN();
    return;
  }

  const V mv(m);
  V d0(0), d1(0), q0(0), q1(0);
  double sd = 0, sq = 0;
  for (int64_t k = 0; k < runs; ++k) {
    const T* q = p + k * stride;
    int64_t i = 0;
    for (; i + 2 * W <= len; i += 2 * W) {
      V a = VecIO<T>::load(q + i) - mv;
      V b = VecIO<T>::load(q + i + W) - mv;
      d0 += a;
      d1 += b;
      q0 = at::vec::fmadd(a, a, q0);
      q1 = at::vec::fmadd(b, b, q1);
    }
    for (; i + W <= len; i += W) {
      V a = VecIO<T>::load(q + i) - mv;
      d0 += a;
      q0 = at::vec::fmadd(a, a, q0);
    }
    for (; i < len; ++i) {
      const double d = static_cast<double>(static_cast<A>(q[i]) - m);
      sd += d;
      sq += d * d;
    }
  }
  auto add = [](V a, V b) { return a + b; };
  sd += at::vec::vec_reduce_all<A>(add, d0 + d1);
  sq += at::vec::vec_reduce_all<A>(add, q0 + q1);
  mean_out = static_cast<double>(m) + sd / n;
  m2_out = nonneg(sq - sd * sd / n);
}

// NCHW: planes of at least a chunk are reduced chunk by chunk; smaller planes by channel, the
// planes of up to a chunk's worth of samples at a time (one merge a chunk: with one a plane,
// 64-value planes spent more on the merges than on the sums; 64x64x8x8, 2 threads: 55 -> 17 us).
template <typename T>
void stats_nchw(const T* x, int64_t N, int64_t C, int64_t HW, std::vector<Moments>& acc) {
  if (HW >= kChunk) {
    const int64_t planes = N * C;
    at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
      Moments* mine = acc.data() + at::get_thread_num() * C;
      for (int64_t p = begin; p < end; ++p) {
        const T* plane = x + p * HW;
        Moments& m = mine[p % C];
        for (int64_t s = 0; s < HW; s += kChunk) {
          const int64_t len = std::min(kChunk, HW - s);
          double mean, m2;
          run_moments(plane + s, 1, 0, len, mean, m2);
          m.merge(static_cast<double>(len), mean, m2);
        }
      }
    });
    return;
  }
  const int64_t per = std::max<int64_t>(1, kChunk / std::max<int64_t>(HW, 1));  // samples a chunk
  const int64_t groups = (N + per - 1) / per;
  at::parallel_for(0, C * groups, 4, [&](int64_t begin, int64_t end) {
    Moments* mine = acc.data() + at::get_thread_num() * C;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t / groups, n0 = (t % groups) * per;
      const int64_t runs = std::min(per, N - n0);
      double mean, m2;
      run_moments(x + (n0 * C + c) * HW, runs, C * HW, HW, mean, m2);
      mine[c].merge(static_cast<double>(runs * HW), mean, m2);
    }
  });
}

// Merges a block of n rows into mine[0..C): per channel its mean estimate, the sum of the
// deviations from it (which corrects its rounding) and of their squares.
template <typename A>
void merge_block(Moments* mine, int64_t C, double n, const A* mean, const A* sd, const A* sq) {
  for (int64_t c = 0; c < C; ++c) {
    const double m = mean[c], s = sd[c];
    if (!std::isfinite(m)) {
      mine[c].merge(n, m, std::numeric_limits<double>::quiet_NaN());
    } else {
      mine[c].merge(n, m + s / n, nonneg(static_cast<double>(sq[c]) - s * s / n));
    }
  }
}

// NHWC: rows of C contiguous values; a block of `rows` rows is reduced per channel with the
// channels in the vector lanes. Rows [r0, r1) of x, merged into mine[0..C); mean, sd, sq:
// scratch of C values.
template <typename T>
void nhwc_block(const T* x, int64_t r0, int64_t r1, int64_t C, Moments* mine,
                std::vector<acc_t<T>>& mean, std::vector<acc_t<T>>& sd,
                std::vector<acc_t<T>>& sq) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr int64_t W = V::size();
  const A inv = A(1) / static_cast<A>(r1 - r0);
  std::fill(mean.begin(), mean.end(), A(0));
  std::fill(sd.begin(), sd.end(), A(0));
  std::fill(sq.begin(), sq.end(), A(0));
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + r * C;
    int64_t c = 0;
    for (; c + W <= C; c += W) (V::loadu(&mean[c]) + VecIO<T>::load(row + c)).store(&mean[c]);
    for (; c < C; ++c) mean[c] += static_cast<A>(row[c]);
  }
  for (int64_t c = 0; c < C; ++c) mean[c] *= inv;
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + r * C;
    int64_t c = 0;
    for (; c + W <= C; c += W) {
      V d = VecIO<T>::load(row + c) - V::loadu(&mean[c]);
      (V::loadu(&sd[c]) + d).store(&sd[c]);
      at::vec::fmadd(d, d, V::loadu(&sq[c])).store(&sq[c]);
    }
    for (; c < C; ++c) {
      const A d = static_cast<A>(row[c]) - mean[c];
      sd[c] += d;
      sq[c] += d * d;
    }
  }
  merge_block(mine, C, static_cast<double>(r1 - r0), mean.data(), sd.data(), sq.data());
}

// nhwc_block for rows of exactly NV vectors (C = NV lanes-widths): the sums in registers, over U
// rows at a time when a row holds few vectors. In memory (nhwc_block), each row's sum waits on
// the previous row's store of the same lanes: with one or two vectors a row (16 or 32 float
// channels) that chain, not the loads, set the speed (a 64x16x16x16 tensor: 142 us on one
// thread against 68 us for the same bytes as 64 channels).
// x: the first of the NV vectors' columns; ld: values per row; mine: their NV * W channels.
template <typename T, int NV>
void nhwc_block_regs(const T* x, int64_t ld, int64_t r0, int64_t r1, Moments* mine) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr int64_t W = V::size();
  constexpr int64_t C = NV * W;
  constexpr int U = NV >= 4 ? 1 : (4 + NV - 1) / NV;  // independent partial sums per lane
  V s[U][NV];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < NV; ++j) s[u][j] = V(0);
  int64_t r = r0;
  for (; r + U <= r1; r += U) {
    for (int u = 0; u < U; ++u)
      for (int j = 0; j < NV; ++j) s[u][j] += VecIO<T>::load(x + (r + u) * ld + j * W);
  }
  for (; r < r1; ++r)
    for (int j = 0; j < NV; ++j) s[0][j] += VecIO<T>::load(x + r * ld + j * W);
  const V inv(A(1) / static_cast<A>(r1 - r0));
  V m[NV];
  for (int j = 0; j < NV; ++j) {
    V t = s[0][j];
    for (int u = 1; u < U; ++u) t += s[u][j];
    m[j] = t * inv;
  }
  V d[U][NV], q[U][NV];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < NV; ++j) d[u][j] = q[u][j] = V(0);
  r = r0;
  for (; r + U <= r1; r += U) {
    for (int u = 0; u < U; ++u)
      for (int j = 0; j < NV; ++j) {
        const V v = VecIO<T>::load(x + (r + u) * ld + j * W) - m[j];
        d[u][j] += v;
        q[u][j] = at::vec::fmadd(v, v, q[u][j]);
      }
  }
  for (; r < r1; ++r)
    for (int j = 0; j < NV; ++j) {
      const V v = VecIO<T>::load(x + r * ld + j * W) - m[j];
      d[0][j] += v;
      q[0][j] = at::vec::fmadd(v, v, q[0][j]);
    }
  alignas(64) A mean[C], sd[C], sq[C];
  for (int j = 0; j < NV; ++j) {
    V a = d[0][j], b = q[0][j];
    for (int u = 1; u < U; ++u) {
      a += d[u][j];
      b += q[u][j];
    }
    m[j].store(mean + j * W);
    a.store(sd + j * W);
    b.store(sq + j * W);
  }
  merge_block(mine, C, static_cast<double>(r1 - r0), mean, sd, sq);
}

// Rows [r0, r1) of x (rows of C values, C a whole number of vectors) through nhwc_block_regs,
// in column groups of at most 8 vectors; false (nothing done) when C is not whole vectors.
template <typename T>
bool nhwc_block_vectors(const T* x, int64_t r0, int64_t r1, int64_t C, Moments* mine) {
  constexpr int64_t W = Vectorized<acc_t<T>>::size();
  if (C % W != 0) return false;
  for (int64_t c0 = 0; c0 < C; c0 += 8 * W) {
    const T* xc = x + c0;
    Moments* mc = mine + c0;
    with_vector_count(std::min<int64_t>(8, (C - c0) / W), [&](auto nv) {
      nhwc_block_regs<T, decltype(nv)::value>(xc, C, r0, r1, mc);
    });
  }
  return true;
}

// Rows per block: at most 256 (with few channels the lanes hold little, sums run serially);
// 256 for the register walk, whose second pass reads one column group (at most 8 vectors, 128
// KiB of float rows) from L2: with kChunk-sized blocks a 256-channel block held 32 rows and the
// Chan merges (one per channel per block) took longer than the sums.
template <typename T>
int64_t nhwc_block_rows(int64_t C) {
  if (C > 0 && C % Vectorized<acc_t<T>>::size() == 0) return 256;
  return std::clamp<int64_t>(kChunk / std::max<int64_t>(C, 1), 2, 256);
}

template <typename T>
void stats_nhwc(const T* x, int64_t R, int64_t C, std::vector<Moments>& acc) {
  const int64_t rows = nhwc_block_rows<T>(C);
  const int64_t blocks = (R + rows - 1) / rows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Moments* mine = acc.data() + at::get_thread_num() * C;
    std::vector<acc_t<T>> mean, sd, sq;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = b * rows, r1 = std::min(R, (b + 1) * rows);
      if (nhwc_block_vectors(x, r0, r1, C, mine)) continue;
      mean.resize(C);
      sd.resize(C);
      sq.resize(C);
      nhwc_block(x, r0, r1, C, mine, mean, sd, sq);
    }
  });
}

// (mean, biased var) per channel in the stats dtype of `dtype` from per-thread moments.
std::tuple<at::Tensor, at::Tensor> finish(const std::vector<Moments>& acc, int64_t threads,
                                          int64_t C, at::ScalarType dtype,
                                          const at::TensorOptions& opts) {
  // Written in the stats dtype directly: static_cast rounds double to float as a .to() would.
  const auto stats_type = at::toOpMathType(dtype);
  at::Tensor mean = at::empty({C}, opts.dtype(stats_type));
  at::Tensor var = at::empty({C}, opts.dtype(stats_type));
  AT_DISPATCH_FLOATING_TYPES(stats_type, "batch_stats_finish", [&] {
    scalar_t* mp = mean.data_ptr<scalar_t>();
    scalar_t* vp = var.data_ptr<scalar_t>();
    for (int64_t c = 0; c < C; ++c) {
      Moments total;
      for (int64_t t = 0; t < threads; ++t) {
        const Moments& m = acc[static_cast<size_t>(t) * C + c];
        total.merge(m.n, m.mean, m.m2);
      }
      // An empty batch has neither: NaN for both, as the mean and variance of no values are
      // in PyTorch (and in the portable backend's batch_stats).
      const double nan = std::numeric_limits<double>::quiet_NaN();
      mp[c] = static_cast<scalar_t>(total.n > 0 ? total.mean : nan);
      vp[c] = static_cast<scalar_t>(total.n > 0 ? total.m2 / total.n : nan);
    }
  });
  return {mean, var};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> batch_stats_kernel(const at::Tensor& x, Layout layout) {
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  const int threads = at::get_num_threads();
  std::vector<Moments> acc(static_cast<size_t>(threads) * C);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "batch_stats", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    if (layout == Layout::NCHW) {
      stats_nchw(xp, N, C, HW, acc);
      return;
    }
    const Periods pr = nhwc_periods(x);
    if (!pr.P) {
      stats_nhwc(xp, N * HW, C, acc);
      return;
    }
    // Rows of P = lcm(C, lanes) values, then each lane's moments merged into its channel's.
    std::vector<Moments> acc_p(static_cast<size_t>(threads) * pr.P);
    stats_nhwc(xp, pr.rows, pr.P, acc_p);
    for (int t = 0; t < threads; ++t) {
      for (int64_t j = 0; j < pr.P; ++j) {
        const Moments& m = acc_p[static_cast<size_t>(t) * pr.P + j];
        acc[static_cast<size_t>(t) * C + j % C].merge(m.n, m.mean, m.m2);
      }
    }
    if (pr.rest) stats_nhwc(xp + pr.rows * pr.P, pr.rest, C, acc);
  });
  return finish(acc, threads, C, x.scalar_type(), x.options());
}

namespace {

class RowStatsImpl final : public RowStats::Impl {
 public:
  RowStatsImpl(int64_t C, int64_t threads, at::ScalarType dtype)
      : C_(C), threads_(threads), dtype_(dtype), acc_(static_cast<size_t>(threads * C)) {}

  void add(const at::Tensor& rows, int64_t tid) override {
    const int64_t R = rows.size(0);
    TORCH_INTERNAL_ASSERT(rows.dim() == 2 && rows.size(1) == C_ && rows.is_contiguous() &&
                          tid >= 0 && tid < threads_);
    Moments* mine = acc_.data() + tid * C_;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows.scalar_type(), "row_stats",
                                    [&] {
      using A = acc_t<scalar_t>;
      const scalar_t* p = rows.const_data_ptr<scalar_t>();
      const int64_t block = nhwc_block_rows<scalar_t>(C_);
      std::vector<A> mean, sd, sq;
      for (int64_t r0 = 0; r0 < R; r0 += block) {
        if (nhwc_block_vectors(p, r0, std::min(R, r0 + block), C_, mine)) continue;
        mean.resize(C_);
        sd.resize(C_);
        sq.resize(C_);
        nhwc_block(p, r0, std::min(R, r0 + block), C_, mine, mean, sd, sq);
      }
    });
  }

  std::tuple<at::Tensor, at::Tensor> finish(const at::TensorOptions& opts) const override {
    return CPU_CAPABILITY::finish(acc_, threads_, C_, dtype_, opts);
  }

 private:
  int64_t C_, threads_;
  at::ScalarType dtype_;
  std::vector<Moments> acc_;
};

}  // namespace

RowStats::Impl* make_row_stats(int64_t C, int64_t threads, at::ScalarType dtype) {
  return new RowStatsImpl(C, threads, dtype);
}

}  // namespace fusedres::cpu::CPU_CAPABILITY
