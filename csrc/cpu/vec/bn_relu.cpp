// Elementwise kernels of the fused unit: the BN-ReLU applied to a batch tile, the first
// backward pass (ReLU mask recomputed from x, BN reductions) and the second (the BN data
// gradient). NCHW tensors are walked plane by plane with per-channel scalars, NHWC tensors row
// by row with the channels in the vector lanes; both use at::vec and at::parallel_for.
#include <ATen/record_function.h>

#include "vec.h"

namespace fusedres::cpu::CPU_CAPABILITY {
namespace {

constexpr int64_t kGrainElems = 16384;  // elements per parallel task, at least

template <typename T>
const T* cptr(const at::Tensor& t) {
  return t.const_data_ptr<T>();
}

// Streaming (non-temporal) store of a whole vector to p, aligned to the vector's size: the line
// is written without being read first. The ReLU-mask pass writes dz this way when dz is too
// large to stay in cache for the data-gradient pass anyway: with ordinary stores each dz line is
// first read from memory (a read the pass does not need) and the stores queue behind those
// reads. Measured (2 threads, the channels_last backward of a 64-channel 32x32 unit at N=128,
// 33.5 MB of dz): 1x1 10.9 -> 8.5 ms a call, 3x3 21.2 -> 18.5 ms; NCHW the same either way.
template <typename A>
inline void store_nt(A* p, const Vectorized<A>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) {
    _mm512_stream_ps(p, v);
    return;
  } else if constexpr (std::is_same_v<A, double>) {
    _mm512_stream_pd(p, v);
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) {
    _mm256_stream_ps(p, v);
    return;
  } else if constexpr (std::is_same_v<A, double>) {
    _mm256_stream_pd(p, v);
    return;
  }
#endif
  v.store(p);
}

// Orders this thread's streaming stores before what follows (the end of a parallel task).
inline void fence_nt() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// Whether whole-vector stores into rows of `row` elements from base p can all stream: p aligned
// to the vector's size and rows a whole number of vectors.
template <typename A>
bool can_stream(const A* p, int64_t row) {
  constexpr int64_t bytes = sizeof(Vectorized<A>);
  return p != nullptr && reinterpret_cast<uintptr_t>(p) % bytes == 0 &&
         row % static_cast<int64_t>(Vectorized<A>::size()) == 0;
}

// Calls f(X{}, W{}) for the storage types of x and of the other operand when both share an
// acc type; returns false (nothing called) otherwise.
template <typename F>
bool dispatch_pair(at::ScalarType xt, at::ScalarType wt, F&& f) {
  using at::BFloat16;
  using at::Half;
  if (xt == at::kFloat && wt == at::kFloat) return f(float{}, float{}), true;
  if (xt == at::kDouble && wt == at::kDouble) return f(double{}, double{}), true;
  if (xt == at::kBFloat16 && wt == at::kBFloat16) return f(BFloat16{}, BFloat16{}), true;
  if (xt == at::kHalf && wt == at::kHalf) return f(Half{}, Half{}), true;
  if (xt == at::kFloat && wt == at::kBFloat16) return f(float{}, BFloat16{}), true;
  if (xt == at::kFloat && wt == at::kHalf) return f(float{}, Half{}), true;
  if (xt == at::kBFloat16 && wt == at::kFloat) return f(BFloat16{}, float{}), true;
  if (xt == at::kHalf && wt == at::kFloat) return f(Half{}, float{}), true;
  return false;
}

// Calls f(std::integral_constant<int, NV>{}) when an NHWC row of C values is NV <= 8 whole
// vectors of Vectorized<A>; returns false (nothing called) otherwise. Such rows are walked with
// the per-channel vectors and the sums in registers: in memory, each row waited on the previous
// row's store of the same sums, and with 16 float channels (one vector a row) that chain, not
// the loads, set the speed (the first backward pass over a 64x16x16x16 tensor, 2 threads:
// 44 -> 14 us; the BN-ReLU 29 -> 18 us, its per-channel vectors no longer reloaded a row).
template <typename A, typename F>
bool with_row_vectors(int64_t C, F&& f) {
  constexpr int64_t L = Vectorized<A>::size();
  return C > 0 && C % L == 0 && with_vector_count(C / L, std::forward<F>(f));
}

// ----------------------------------------------------------------------------- forward

// NCHW x -> NHWC a: a block of 16 channels x 16 positions is activated row by row (channels)
// into a small buffer, then transposed into a's rows (positions) with at::vec::transpose_mxn.
template <typename X, typename W>
void bn_relu_to_nhwc_impl(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                          at::Tensor& a) {
  using A = acc_t<X>;
  using V = Vectorized<A>;
  constexpr int64_t L = V::size();
  constexpr int64_t B = 16;  // block edge; L divides it for float (16) and double (8)
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  const X* xp = cptr<X>(x);
  W* ap = a.data_ptr<W>();
  const A* sp = cptr<A>(scale);
  const A* tp = cptr<A>(shift);
  const int64_t hw_blocks = (HW + B - 1) / B;
  const V zero(0);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / (B * C));
  at::parallel_for(0, N * hw_blocks, grain, [&](int64_t b, int64_t e) {
    alignas(64) W buf[B * B];
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t n = blk / hw_blocks, p0 = (blk % hw_blocks) * B;
      const int64_t np = std::min(B, HW - p0);
      for (int64_t c0 = 0; c0 < C; c0 += B) {
        const int64_t nc = std::min(B, C - c0);
        for (int64_t c = 0; c < nc; ++c) {
          const A s = sp[c0 + c], t = tp[c0 + c];
          const X* xr = xp + (n * C + c0 + c) * HW + p0;
          W* br = buf + c * B;
          int64_t i = 0;
          if (np == B) {
            const V sv(s), tv(t);
            for (; i < B; i += L) {
              VecIO<W>::store(br + i, at::vec::clamp_min(
                                          at::vec::fmadd(VecIO<X>::load(xr + i), sv, tv), zero));
            }
          }
          for (; i < np; ++i) br[i] = static_cast<W>(std::max(static_cast<A>(xr[i]) * s + t, A(0)));
        }
        at::vec::transpose_mxn<W>(buf, B, ap + (n * HW + p0) * C + c0, C, static_cast<int>(nc),
                                  static_cast<int>(np));
      }
    }
  });
}

template <typename X, typename W>
void bn_relu_impl(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                  at::Tensor& a, Layout layout) {
  using A = acc_t<X>;
  using V = Vectorized<A>;
  constexpr int64_t L = V::size();
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  const X* xp = cptr<X>(x);
  W* ap = a.data_ptr<W>();
  const A* sp = cptr<A>(scale);
  const A* tp = cptr<A>(shift);
  const V zero(0);
  if (layout == Layout::NCHW) {
    at::parallel_for(0, N * C, std::max<int64_t>(1, kGrainElems / HW), [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p) {
        const A s = sp[p % C], t = tp[p % C];
        const V sv(s), tv(t);
        const X* xr = xp + p * HW;
        W* ar = ap + p * HW;
        int64_t i = 0;
        for (; i + L <= HW; i += L) {
          VecIO<W>::store(ar + i, at::vec::clamp_min(at::vec::fmadd(VecIO<X>::load(xr + i), sv, tv),
                                                     zero));
        }
        for (; i < HW; ++i) ar[i] = static_cast<W>(std::max(static_cast<A>(xr[i]) * s + t, A(0)));
      }
    });
  } else {
    const int64_t grain = std::max<int64_t>(1, kGrainElems / C);
    if (with_row_vectors<A>(C, [&](auto nv) {
          constexpr int NV = decltype(nv)::value;
          at::parallel_for(0, N * HW, grain, [&](int64_t b, int64_t e) {
            V sv[NV], tv[NV];
            for (int j = 0; j < NV; ++j) {
              sv[j] = V::loadu(sp + j * L);
              tv[j] = V::loadu(tp + j * L);
            }
            for (int64_t r = b; r < e; ++r) {
              const X* xr = xp + r * C;
              W* ar = ap + r * C;
              for (int j = 0; j < NV; ++j) {
                VecIO<W>::store(ar + j * L, at::vec::clamp_min(
                                                at::vec::fmadd(VecIO<X>::load(xr + j * L), sv[j],
                                                               tv[j]),
                                                zero));
              }
            }
          });
        })) {
      return;
    }
    at::parallel_for(0, N * HW, grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const X* xr = xp + r * C;
        W* ar = ap + r * C;
        int64_t c = 0;
        for (; c + L <= C; c += L) {
          VecIO<W>::store(ar + c, at::vec::clamp_min(at::vec::fmadd(VecIO<X>::load(xr + c),
                                                                    V::loadu(sp + c),
                                                                    V::loadu(tp + c)),
                                                     zero));
        }
        for (; c < C; ++c) {
          ar[c] = static_cast<W>(std::max(static_cast<A>(xr[c]) * sp[c] + tp[c], A(0)));
        }
      }
    });
  }
}

// ----------------------------------------------------------------------------- backward 1

// The first backward pass over NHWC rows [r0, r1) of NV vectors each (C = NV lanes-widths), the
// per-channel vectors and the sums in registers; the block's sums of dz and dz * (x - mean) per
// channel out in s1, s2 (C values each). One row at a time: unlike the statistics' sums
// (batch_stats.cpp), a row here has enough work to cover the sums' latency (partial sums over
// 4 rows measured slower: 17.8 against 14.3 us for a 64x16x16x16 tensor, 43.7 against 23.2
// writing dz, 2 threads).
template <typename X, typename W, int NV>
void reduce_rows_regs(const X* xp, const W* dp, acc_t<X>* zp, int64_t r0, int64_t r1,
                      const acc_t<X>* sp, const acc_t<X>* tp, const acc_t<X>* mp,
                      const acc_t<X>* op, bool nt, acc_t<X>* s1, acc_t<X>* s2) {
  using A = acc_t<X>;
  using V = Vectorized<A>;
  constexpr int64_t L = V::size();
  constexpr int64_t C = NV * L;
  const V zero(0);
  V sv[NV], tv[NV], mv[NV], ov[NV], a1[NV], a2[NV];
  for (int j = 0; j < NV; ++j) {
    ov[j] = V::loadu(op + j * L);
    sv[j] = V::loadu(sp + j * L);
    tv[j] = V::loadu(tp + j * L);
    mv[j] = V::loadu(mp + j * L);
    a1[j] = a2[j] = zero;
  }
  for (int64_t r = r0; r < r1; ++r) {
    const X* xr = xp + r * C;
    const W* dr = dp + r * C;
    for (int j = 0; j < NV; ++j) {
      const V xv = VecIO<X>::load(xr + j * L);
      const V z = at::vec::fmadd(xv, sv[j], tv[j]);
      const V dz = V::blendv(zero, VecIO<W>::load(dr + j * L), z > zero);
      a1[j] += dz;
      a2[j] = at::vec::fmadd(dz, xv - mv[j], a2[j]);
      if (zp) {
        A* zr = zp + r * C + j * L;
        if (nt) {
          store_nt(zr, dz * ov[j]);
        } else {
          (dz * ov[j]).store(zr);
        }
      }
    }
  }
  for (int j = 0; j < NV; ++j) {
    a1[j].store(s1 + j * L);
    a2[j].store(s2 + j * L);
  }
}

template <typename X, typename W>
void backward_reduce_impl(const at::Tensor& da, const at::Tensor& x, const at::Tensor& scale,
                          const at::Tensor& shift, const at::Tensor& mean,
                          const at::Tensor& out_scale, at::Tensor& sums, at::Tensor* dz_out,
                          Layout layout, bool stream) {
  using A = acc_t<X>;
  using V = Vectorized<A>;
  constexpr int64_t L = V::size();
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  const X* xp = cptr<X>(x);
  const W* dp = cptr<W>(da);
  const A* sp = cptr<A>(scale);
  const A* tp = cptr<A>(shift);
  const A* mp = cptr<A>(mean);
  const A* op = cptr<A>(out_scale);
  A* zp = dz_out ? dz_out->data_ptr<A>() : nullptr;
  double* acc = sums.data_ptr<double>();
  const V zero(0);
  auto add = [](V u, V v) { return u + v; };

  if (layout == Layout::NCHW) {
    const bool nt = stream && can_stream(zp, HW);
    at::parallel_for(0, N * C, std::max<int64_t>(1, kGrainElems / HW), [&](int64_t b, int64_t e) {
      double* mine = acc + at::get_thread_num() * 2 * C;
      for (int64_t p = b; p < e; ++p) {
        const int64_t c = p % C;
        const A s = sp[c], t = tp[c], m = mp[c], os = op[c];
        const V sv(s), tv(t), mv(m), osv(os);
        const X* xr = xp + p * HW;
        const W* dr = dp + p * HW;
        A* zr = zp ? zp + p * HW : nullptr;
        V s1(0), s2(0);
        int64_t i = 0;
        for (; i + L <= HW; i += L) {
          const V xv = VecIO<X>::load(xr + i);
          const V z = at::vec::fmadd(xv, sv, tv);
          const V dz = V::blendv(zero, VecIO<W>::load(dr + i), z > zero);
          s1 += dz;
          s2 = at::vec::fmadd(dz, xv - mv, s2);
          if (nt) {
            store_nt(zr + i, dz * osv);
          } else if (zr) {
            (dz * osv).store(zr + i);
          }
        }
        A t1 = at::vec::vec_reduce_all<A>(add, s1);
        A t2 = at::vec::vec_reduce_all<A>(add, s2);
        for (; i < HW; ++i) {
          const A xv = static_cast<A>(xr[i]);
          const A dz = xv * s + t > A(0) ? static_cast<A>(dr[i]) : A(0);
          t1 += dz;
          t2 += dz * (xv - m);
          if (zr) zr[i] = dz * os;
        }
        mine[c] += t1;
        mine[C + c] += t2;
      }
      if (nt) fence_nt();
    });
  } else {
    // Rows are summed in acc-dtype lanes over blocks of at most kRows rows, then added to the
    // thread's double row.
    constexpr int64_t kRows = 256;
    const int64_t R = N * HW;
    const int64_t blocks = (R + kRows - 1) / kRows;
    const int64_t grain = std::max<int64_t>(1, kGrainElems / (kRows * C));
    const bool nt = stream && can_stream(zp, C);
    at::parallel_for(0, blocks, grain, [&](int64_t b, int64_t e) {
      double* mine = acc + at::get_thread_num() * 2 * C;
      std::vector<A> s1(C), s2(C);
      if (with_row_vectors<A>(C, [&](auto nv) {
            for (int64_t blk = b; blk < e; ++blk) {
              reduce_rows_regs<X, W, decltype(nv)::value>(
                  xp, dp, zp, blk * kRows, std::min(R, (blk + 1) * kRows), sp, tp, mp, op, nt,
                  s1.data(), s2.data());
              for (int64_t c = 0; c < C; ++c) {
                mine[c] += s1[c];
                mine[C + c] += s2[c];
              }
            }
          })) {
        if (nt) fence_nt();
        return;
      }
      for (int64_t blk = b; blk < e; ++blk) {
        std::fill(s1.begin(), s1.end(), A(0));
        std::fill(s2.begin(), s2.end(), A(0));
        const int64_t r1 = std::min(R, (blk + 1) * kRows);
        for (int64_t r = blk * kRows; r < r1; ++r) {
          const X* xr = xp + r * C;
          const W* dr = dp + r * C;
          A* zr = zp ? zp + r * C : nullptr;
          int64_t c = 0;
          for (; c + L <= C; c += L) {
            const V xv = VecIO<X>::load(xr + c);
            const V z = at::vec::fmadd(xv, V::loadu(sp + c), V::loadu(tp + c));
            const V dz = V::blendv(zero, VecIO<W>::load(dr + c), z > zero);
            (V::loadu(&s1[c]) + dz).store(&s1[c]);
            at::vec::fmadd(dz, xv - V::loadu(mp + c), V::loadu(&s2[c])).store(&s2[c]);
            if (nt) {
              store_nt(zr + c, dz * V::loadu(op + c));
            } else if (zr) {
              (dz * V::loadu(op + c)).store(zr + c);
            }
          }
          for (; c < C; ++c) {
            const A xv = static_cast<A>(xr[c]);
            const A dz = xv * sp[c] + tp[c] > A(0) ? static_cast<A>(dr[c]) : A(0);
            s1[c] += dz;
            s2[c] += dz * (xv - mp[c]);
            if (zr) zr[c] = dz * op[c];
          }
        }
        for (int64_t c = 0; c < C; ++c) {
          mine[c] += s1[c];
          mine[C + c] += s2[c];
        }
      }
      if (nt) fence_nt();
    });
  }
}

// NCHW x with an NHWC da (the data gradient of an NHWC convolution tile), float only: blocks of
// 16 positions x 16 channels of da are transposed into an L1 buffer and meet x's contiguous
// runs there, so da is never written out in x's layout. Sums run in float lanes per channel
// over one sample (as the NCHW walk sums one plane) and are then added to the double rows.
void backward_reduce_da_nhwc_impl(const at::Tensor& da, const at::Tensor& x,
                                  const at::Tensor& scale, const at::Tensor& shift,
                                  const at::Tensor& mean, const at::Tensor& out_scale,
                                  at::Tensor& sums, at::Tensor* dz_out) {
  using V = Vectorized<float>;
  constexpr int64_t L = V::size();
  constexpr int64_t B = 16;  // block edge; L (16 or 8) divides it
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  const float* xp = cptr<float>(x);
  const float* dp = cptr<float>(da);
  const float* sp = cptr<float>(scale);
  const float* tp = cptr<float>(shift);
  const float* mp = cptr<float>(mean);
  const float* op = cptr<float>(out_scale);
  float* zp = dz_out ? dz_out->data_ptr<float>() : nullptr;
  double* acc = sums.data_ptr<double>();
  const int64_t hw_blocks = (HW + B - 1) / B;
  const int64_t grain = std::max<int64_t>(1, kGrainElems / (B * C));
  const V zero(0);
  auto add = [](V u, V v) { return u + v; };
  at::parallel_for(0, N * hw_blocks, grain, [&](int64_t b, int64_t e) {
    double* mine = acc + at::get_thread_num() * 2 * C;
    std::vector<float> lanes(2 * C * L, 0.f);  // per channel: L lanes of sum(dz), of sum(dz*xm)
    float* s1 = lanes.data();
    float* s2 = lanes.data() + C * L;
    auto flush = [&] {
      for (int64_t c = 0; c < C; ++c) {
        mine[c] += at::vec::vec_reduce_all<float>(add, V::loadu(s1 + c * L));
        mine[C + c] += at::vec::vec_reduce_all<float>(add, V::loadu(s2 + c * L));
      }
      std::fill(lanes.begin(), lanes.end(), 0.f);
    };
    alignas(64) float buf[B * B];
    int64_t cur = b / hw_blocks;
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t n = blk / hw_blocks, p0 = (blk % hw_blocks) * B;
      const int64_t np = std::min(B, HW - p0);
      if (n != cur) {
        flush();
        cur = n;
      }
      for (int64_t c0 = 0; c0 < C; c0 += B) {
        const int64_t nc = std::min(B, C - c0);
        at::vec::transpose_mxn<float>(dp + (n * HW + p0) * C + c0, C, buf, B,
                                      static_cast<int>(np), static_cast<int>(nc));
        for (int64_t j = 0; j < nc; ++j) {
          const int64_t c = c0 + j;
          const V sv(sp[c]), tv(tp[c]), mv(mp[c]), osv(op[c]);
          const float* xr = xp + (n * C + c) * HW + p0;
          const float* dr = buf + j * B;
          float* zr = zp ? zp + (n * C + c) * HW + p0 : nullptr;
          V a1 = V::loadu(s1 + c * L), a2 = V::loadu(s2 + c * L);
          for (int64_t i = 0; i < np; i += L) {
            // Tails load zeros: x = 0 and da = 0 give dz = 0, which adds nothing.
            const int64_t cnt = std::min(L, np - i);
            const V xv = V::loadu(xr + i, cnt);
            const V z = at::vec::fmadd(xv, sv, tv);
            const V dz = V::blendv(zero, V::loadu(dr + i, cnt), z > zero);
            a1 += dz;
            a2 = at::vec::fmadd(dz, xv - mv, a2);
            if (zr) (dz * osv).store(zr + i, cnt);
          }
          a1.store(s1 + c * L);
          a2.store(s2 + c * L);
        }
      }
    }
    flush();
  });
}

// ----------------------------------------------------------------------------- backward 2

template <typename X>
void backward_apply_impl(const at::Tensor& dz, const at::Tensor& x, const at::Tensor& mean,
                         const at::Tensor& k1, const at::Tensor& k2, const at::Tensor& k3,
                         at::Tensor& gx, Layout layout, const at::Tensor* add) {
  using A = acc_t<X>;
  using V = Vectorized<A>;
  constexpr int64_t L = V::size();
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  const X* xp = cptr<X>(x);
  const A* zp = cptr<A>(dz);
  const X* qp = add ? cptr<X>(*add) : nullptr;
  X* gp = gx.data_ptr<X>();
  const A *mp = cptr<A>(mean), *ap = cptr<A>(k1), *bp = cptr<A>(k2), *cp = cptr<A>(k3);
  if (layout == Layout::NCHW) {
    at::parallel_for(0, N * C, std::max<int64_t>(1, kGrainElems / HW), [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p) {
        const int64_t c = p % C;
        const A m = mp[c], a1 = ap[c], a2 = bp[c], a3 = cp[c];
        const V mv(m), v1(a1), v2(a2), v3(a3);
        const X* xr = xp + p * HW;
        const A* zr = zp + p * HW;
        const X* qr = qp ? qp + p * HW : nullptr;
        X* gr = gp + p * HW;
        int64_t i = 0;
        for (; i + L <= HW; i += L) {
          V r = at::vec::fmadd(V::loadu(zr + i), v1,
                               at::vec::fmadd(VecIO<X>::load(xr + i) - mv, v2, v3));
          if (qr) r = r + VecIO<X>::load(qr + i);
          VecIO<X>::store(gr + i, r);
        }
        for (; i < HW; ++i) {
          A r = zr[i] * a1 + (static_cast<A>(xr[i]) - m) * a2 + a3;
          if (qr) r += static_cast<A>(qr[i]);
          gr[i] = static_cast<X>(r);
        }
      }
    });
  } else {
    const int64_t grain = std::max<int64_t>(1, kGrainElems / C);
    if (with_row_vectors<A>(C, [&](auto nv) {
          constexpr int NV = decltype(nv)::value;
          at::parallel_for(0, N * HW, grain, [&](int64_t b, int64_t e) {
            V mv[NV], v1[NV], v2[NV], v3[NV];
            for (int j = 0; j < NV; ++j) {
              mv[j] = V::loadu(mp + j * L);
              v1[j] = V::loadu(ap + j * L);
              v2[j] = V::loadu(bp + j * L);
              v3[j] = V::loadu(cp + j * L);
            }
            for (int64_t r = b; r < e; ++r) {
              const X* xr = xp + r * C;
              const A* zr = zp + r * C;
              X* gr = gp + r * C;
              for (int j = 0; j < NV; ++j) {
                V v = at::vec::fmadd(V::loadu(zr + j * L), v1[j],
                                     at::vec::fmadd(VecIO<X>::load(xr + j * L) - mv[j], v2[j],
                                                    v3[j]));
                if (qp) v = v + VecIO<X>::load(qp + r * C + j * L);
                VecIO<X>::store(gr + j * L, v);
              }
            }
          });
        })) {
      return;
    }
    at::parallel_for(0, N * HW, grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const X* xr = xp + r * C;
        const A* zr = zp + r * C;
        const X* qr = qp ? qp + r * C : nullptr;
        X* gr = gp + r * C;
        int64_t c = 0;
        for (; c + L <= C; c += L) {
          const V t = at::vec::fmadd(VecIO<X>::load(xr + c) - V::loadu(mp + c), V::loadu(bp + c),
                                     V::loadu(cp + c));
          V v = at::vec::fmadd(V::loadu(zr + c), V::loadu(ap + c), t);
          if (qr) v = v + VecIO<X>::load(qr + c);
          VecIO<X>::store(gr + c, v);
        }
        for (; c < C; ++c) {
          A v = zr[c] * ap[c] + (static_cast<A>(xr[c]) - mp[c]) * bp[c] + cp[c];
          if (qr) v += static_cast<A>(qr[c]);
          gr[c] = static_cast<X>(v);
        }
      }
    });
  }
}

// ----------------------------------------------------------------------------- transposes

// Per sample, src is an R x Q matrix (row stride Q) and dst its Q x R transpose; plus `add`
// (laid out as dst) when given, added to each block of dst while it is in L1.
template <typename T>
void transpose_impl(const T* src, T* dst, int64_t N, int64_t R, int64_t Q, const T* add) {
  constexpr int64_t B = 16;
  const int64_t row_blocks = (R + B - 1) / B;
  const int64_t grain = std::max<int64_t>(1, kGrainElems / (B * Q));
  at::parallel_for(0, N * row_blocks, grain, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t n = blk / row_blocks, r0 = (blk % row_blocks) * B;
      const int rows = static_cast<int>(std::min(B, R - r0));
      const T* s = src + n * R * Q + r0 * Q;
      T* d = dst + n * R * Q + r0;
      for (int64_t q0 = 0; q0 < Q; q0 += B) {
        const int64_t cols = std::min(B, Q - q0);
        at::vec::transpose_mxn<T>(s + q0, Q, d + q0 * R, R, rows, static_cast<int>(cols));
        if (!add) continue;
        const T* a = add + n * R * Q + r0 + q0 * R;
        T* dq = d + q0 * R;
        for (int64_t j = 0; j < cols; ++j) {
          for (int64_t i = 0; i < rows; i += Vectorized<T>::size()) {
            const int64_t cnt = std::min<int64_t>(Vectorized<T>::size(), rows - i);
            (Vectorized<T>::loadu(dq + j * R + i, cnt) + Vectorized<T>::loadu(a + j * R + i, cnt))
                .store(dq + j * R + i, cnt);
          }
        }
      }
    }
  });
}


// ----------------------------------------------------------------------------- NHWC periods

// Rows [first, first + rows) of length len of a dense NHWC tensor t (counted from its start in
// values), as an NHWC (rows, len, 1, 1) view.
at::Tensor rows_view(const at::Tensor& t, int64_t first, int64_t rows, int64_t len) {
  return t.as_strided({rows, len, 1, 1}, {len, 1, len, len}, t.storage_offset() + first);
}

// v (C,) repeated to P values.
// (A plain loop: at::repeat costs ~20 us a call, several times a 16-channel tile's kernel.)
at::Tensor repeated(const at::Tensor& v, int64_t P) {
  const at::Tensor src = v.contiguous();
  at::Tensor out = at::empty({P}, src.options());
  const int64_t C = src.numel();
  AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "repeated", [&] {
    const scalar_t* in = src.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t j = 0; j < P; ++j) o[j] = in[j % C];
  });
  return out;
}

}  // namespace

void transpose_layout_kernel(const at::Tensor& src, at::Tensor& dst, Layout src_layout,
                             const at::Tensor* add) {
  RECORD_FUNCTION("fusedres_cpu::transpose (kernel)", c10::ArrayRef<c10::IValue>{});
  const int64_t N = src.size(0), C = src.size(1), HW = src.size(2) * src.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "transpose", [&] {
    const scalar_t* ap = add ? add->const_data_ptr<scalar_t>() : nullptr;
    if (src_layout == Layout::NHWC) {
      transpose_impl(src.const_data_ptr<scalar_t>(), dst.data_ptr<scalar_t>(), N, HW, C, ap);
    } else {
      transpose_impl(src.const_data_ptr<scalar_t>(), dst.data_ptr<scalar_t>(), N, C, HW, ap);
    }
  });
}

// The kernels' calls of themselves name this copy (CPU_CAPABILITY::): unqualified, argument-
// dependent lookup (Layout) would also find the dispatching functions of kernels.h.
void bn_relu_kernel(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                    at::Tensor& a, Layout x_layout, Layout a_layout) {
  RECORD_FUNCTION("fusedres_cpu::bn_relu (kernel)", c10::ArrayRef<c10::IValue>{});
  TORCH_INTERNAL_ASSERT(x_layout == a_layout || a_layout == Layout::NHWC);
  if (x_layout == Layout::NHWC && a_layout == Layout::NHWC) {
    const Periods pr = nhwc_periods(x);
    if (pr.P) {
      const int64_t C = x.size(1), head = pr.rows * pr.P;
      at::Tensor a_rows = rows_view(a, 0, pr.rows, pr.P);
      CPU_CAPABILITY::bn_relu_kernel(rows_view(x, 0, pr.rows, pr.P), repeated(scale, pr.P),
                                     repeated(shift, pr.P), a_rows, Layout::NHWC, Layout::NHWC);
      if (pr.rest) {
        at::Tensor a_rest = rows_view(a, head, pr.rest, C);
        CPU_CAPABILITY::bn_relu_kernel(rows_view(x, head, pr.rest, C), scale, shift, a_rest,
                                       Layout::NHWC, Layout::NHWC);
      }
      return;
    }
  }
  const bool done = dispatch_pair(x.scalar_type(), a.scalar_type(), [&](auto xv, auto wv) {
    using X = decltype(xv);
    using W = decltype(wv);
    if constexpr (std::is_same_v<acc_t<X>, acc_t<W>>) {
      if (x_layout == a_layout) {
        bn_relu_impl<X, W>(x, scale, shift, a, x_layout);
      } else {
        bn_relu_to_nhwc_impl<X, W>(x, scale, shift, a);
      }
    }
  });
  if (!done) {  // e.g. float64 x with a bfloat16 weight: compute in x's dtype, then cast
    at::Tensor tmp = at::empty(x.sizes(), x.options().memory_format(memory_format(x_layout)));
    CPU_CAPABILITY::bn_relu_kernel(x, scale, shift, tmp, x_layout, x_layout);
    a.copy_(tmp);
  }
}

void bn_relu_backward_reduce_kernel(const at::Tensor& da, const at::Tensor& x,
                                    const at::Tensor& scale, const at::Tensor& shift,
                                    const at::Tensor& mean, const at::Tensor& out_scale,
                                    at::Tensor& sums, at::Tensor* dz_out, Layout layout,
                                    Layout da_layout, bool stream_dz) {
  RECORD_FUNCTION("fusedres_cpu::relu_mask_bn_sums (kernel)", c10::ArrayRef<c10::IValue>{});
  if (da_layout != layout) {
    TORCH_INTERNAL_ASSERT(layout == Layout::NCHW && da_layout == Layout::NHWC &&
                          x.scalar_type() == at::kFloat && da.scalar_type() == at::kFloat);
    backward_reduce_da_nhwc_impl(da, x, scale, shift, mean, out_scale, sums, dz_out);
    return;
  }
  if (layout == Layout::NHWC) {
    const Periods pr = nhwc_periods(x);
    if (pr.P) {
      const int64_t C = x.size(1), head = pr.rows * pr.P, threads = sums.size(0);
      at::Tensor sums_p = at::zeros({threads, 2, pr.P}, sums.options());
      at::Tensor dz_rows = dz_out ? rows_view(*dz_out, 0, pr.rows, pr.P) : at::Tensor();
      CPU_CAPABILITY::bn_relu_backward_reduce_kernel(
          rows_view(da, 0, pr.rows, pr.P), rows_view(x, 0, pr.rows, pr.P),
          repeated(scale, pr.P), repeated(shift, pr.P), repeated(mean, pr.P),
          repeated(out_scale, pr.P), sums_p, dz_out ? &dz_rows : nullptr, layout, layout,
          stream_dz);
      sums.add_(sums_p.view({threads, 2, pr.P / C, C}).sum(2));
      if (pr.rest) {
        at::Tensor dz_rest = dz_out ? rows_view(*dz_out, head, pr.rest, C) : at::Tensor();
        CPU_CAPABILITY::bn_relu_backward_reduce_kernel(
            rows_view(da, head, pr.rest, C), rows_view(x, head, pr.rest, C), scale, shift, mean,
            out_scale, sums, dz_out ? &dz_rest : nullptr, layout, layout, stream_dz);
      }
      return;
    }
  }
  const bool done = dispatch_pair(x.scalar_type(), da.scalar_type(), [&](auto xv, auto wv) {
    using X = decltype(xv);
    using W = decltype(wv);
    if constexpr (std::is_same_v<acc_t<X>, acc_t<W>>) {
      backward_reduce_impl<X, W>(da, x, scale, shift, mean, out_scale, sums, dz_out, layout,
                                 stream_dz);
    }
  });
  if (!done) {
    CPU_CAPABILITY::bn_relu_backward_reduce_kernel(da.to(x.scalar_type()), x, scale, shift, mean,
                                                   out_scale, sums, dz_out, layout, layout,
                                                   stream_dz);
  }
}

void bn_backward_apply_kernel(const at::Tensor& dz, const at::Tensor& x, const at::Tensor& mean,
                              const at::Tensor& k1, const at::Tensor& k2, const at::Tensor& k3,
                              at::Tensor& gx, Layout layout, const at::Tensor* add) {
  RECORD_FUNCTION("fusedres_cpu::bn_dx (kernel)", c10::ArrayRef<c10::IValue>{});
  TORCH_INTERNAL_ASSERT(!add || (add->scalar_type() == x.scalar_type() &&
                                 add->sizes() == x.sizes() && dense_in(*add, layout)));
  if (layout == Layout::NHWC) {
    const Periods pr = nhwc_periods(x);
    if (pr.P) {
      const int64_t C = x.size(1), head = pr.rows * pr.P;
      at::Tensor gx_rows = rows_view(gx, 0, pr.rows, pr.P);
      const at::Tensor add_rows = add ? rows_view(*add, 0, pr.rows, pr.P) : at::Tensor();
      CPU_CAPABILITY::bn_backward_apply_kernel(
          rows_view(dz, 0, pr.rows, pr.P), rows_view(x, 0, pr.rows, pr.P), repeated(mean, pr.P),
          repeated(k1, pr.P), repeated(k2, pr.P), repeated(k3, pr.P), gx_rows, layout,
          add ? &add_rows : nullptr);
      if (pr.rest) {
        at::Tensor gx_rest = rows_view(gx, head, pr.rest, C);
        const at::Tensor add_rest = add ? rows_view(*add, head, pr.rest, C) : at::Tensor();
        CPU_CAPABILITY::bn_backward_apply_kernel(rows_view(dz, head, pr.rest, C),
                                                 rows_view(x, head, pr.rest, C), mean, k1, k2, k3,
                                                 gx_rest, layout, add ? &add_rest : nullptr);
      }
      return;
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bn_bwd_apply", [&] {
    backward_apply_impl<scalar_t>(dz, x, mean, k1, k2, k3, gx, layout, add);
  });
}

// constexpr: initialised by the loader's relocations, no code of this capability run at load.
constexpr KernelTable kernel_table = {
    &batch_stats_kernel,          &make_row_stats,           &bn_relu_kernel,
    &bn_relu_backward_reduce_kernel, &bn_backward_apply_kernel, &transpose_layout_kernel,
};

}  // namespace fusedres::cpu::CPU_CAPABILITY
