// Shared pieces of the CPU kernels: at::vec set-up, typed vector load/store, layout helpers and
// the declarations of the elementwise kernels (bn_relu.cpp, batch_stats.cpp).
#pragma once

// at::vec picks its implementation from CPU_CAPABILITY_* macros that ATen's own build defines per
// translation unit; an extension has to define them itself. setup.py compiles with -march=native
// (FUSEDRES_CPU_NATIVE=1), so the compiler's target macros say what the instructions allow. The
// namespace is ours so that these inline functions never collide with libtorch's own copies.
#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY fusedres_avx512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY fusedres_avx2
#else
#define CPU_CAPABILITY fusedres_default
#endif
#endif

// GCC 12 reports false -Wmaybe-uninitialized in its own AVX-512 intrinsics headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wunknown-pragmas"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

// conv_out_size, suggests_channels_last, out_memory_format: the rules csrc/cuda shares.
#include "../common.h"
#include "tile.h"

namespace fusedres::cpu {

using at::vec::Vectorized;

// Arithmetic type of the normalisation for storage type T (float for the half types).
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Acc<T>::type;

// Load Vectorized<acc_t<T>>::size() values of T as acc_t<T>; store one acc vector as T.
template <typename T>
struct VecIO;

template <>
struct VecIO<float> {
  static Vectorized<float> load(const float* p) { return Vectorized<float>::loadu(p); }
  static void store(float* p, Vectorized<float> v) { v.store(p); }
};

template <>
struct VecIO<double> {
  static Vectorized<double> load(const double* p) { return Vectorized<double>::loadu(p); }
  static void store(double* p, Vectorized<double> v) { v.store(p); }
};

template <>
struct VecIO<at::BFloat16> {
  static Vectorized<float> load(const at::BFloat16* p) {
    Vectorized<float> out;
    at::vec::load_fp32_from_bf16(p, out);
    return out;
  }
  static void store(at::BFloat16* p, Vectorized<float> v) {
    at::vec::convert_float_bfloat16(v, v).store(p, Vectorized<float>::size());
  }
};

template <>
struct VecIO<at::Half> {
  static Vectorized<float> load(const at::Half* p) {
    Vectorized<float> out;
    at::vec::load_fp32_from_fp16(p, out);
    return out;
  }
  static void store(at::Half* p, Vectorized<float> v) {
    at::vec::convert_float_half(v, v).store(p, Vectorized<float>::size());
  }
};

// Memory layout the kernels walk: NCHW planes or NHWC rows. Any other strides are made
// contiguous by the caller first.
enum class Layout { NCHW, NHWC };

inline at::MemoryFormat memory_format(Layout layout) {
  return layout == Layout::NHWC ? at::MemoryFormat::ChannelsLast
                                : at::MemoryFormat::Contiguous;
}

// An NHWC walk puts channels in the vector lanes, one row (C values) at a time; when C is not a
// multiple of the lane count L each row ends in a scalar tail, and a ReLU mask there is a
// branch that mispredicts half the time (24 channels: the first backward pass ran at 2.4 ns a
// value, 8x the vector rate). Such tensors are walked instead as rows of P = lcm(C, L) values
// (P / C pixels) with the per-channel vectors repeated to length P: every vector is full. The
// rows left over (fewer than P / C) run the ordinary walk. Up to P = 1024: beyond, the tail
// is a small share of a row.
struct Periods {
  int64_t P = 0;     // values per period row; 0: walk as usual
  int64_t rows = 0;  // period rows (rows * P values)
  int64_t rest = 0;  // pixels left over, walked as ordinary rows of C
};

inline Periods nhwc_periods(const at::Tensor& x) {
  const int64_t C = x.size(1), pixels = x.size(0) * x.size(2) * x.size(3);
  const int64_t L = at::toOpMathType(x.scalar_type()) == at::kDouble
                        ? static_cast<int64_t>(Vectorized<double>::size())
                        : static_cast<int64_t>(Vectorized<float>::size());
  Periods out;
  if (C <= 0 || C % L == 0) return out;
  const int64_t P = C / std::gcd(C, L) * L;
  const int64_t per = P / C;  // pixels per period row
  if (P > 1024 || pixels < per) return out;
  out.P = P;
  out.rows = pixels / per;
  out.rest = pixels - out.rows * per;
  return out;
}

// Calls f(std::integral_constant<int, NV>{}) for a count NV of vectors from 1 to 8 (the NHWC
// walks that keep a row's per-channel vectors and sums in registers, unrolled per count:
// bn_relu.cpp, batch_stats.cpp); returns false, nothing called, for any other count.
template <typename F>
bool with_vector_count(int64_t nv, F&& f) {
  switch (nv) {
    case 1: return f(std::integral_constant<int, 1>{}), true;
    case 2: return f(std::integral_constant<int, 2>{}), true;
    case 3: return f(std::integral_constant<int, 3>{}), true;
    case 4: return f(std::integral_constant<int, 4>{}), true;
    case 5: return f(std::integral_constant<int, 5>{}), true;
    case 6: return f(std::integral_constant<int, 6>{}), true;
    case 7: return f(std::integral_constant<int, 7>{}), true;
    case 8: return f(std::integral_constant<int, 8>{}), true;
    default: return false;
  }
}

// ----------------------------------------------------------------------------- kernels

// Per-channel mean and biased variance over (N, H, W), returned in the stats dtype. Chunks are
// reduced two-pass (mean, then squared deviations from the chunk mean) while they sit in cache
// and merged with Chan's formula in double: accurate for large offsets and millions of values.
std::tuple<at::Tensor, at::Tensor> batch_stats_kernel(const at::Tensor& x, Layout layout);

// The same statistics gathered piece by piece: add() merges the moments of a dense (R, C) block
// of rows (pixels of an NHWC tensor) into thread tid's accumulator, serially (called by the
// thread that owns tid inside a parallel region); finish() gives (mean, biased var) in the
// stats dtype of `dtype`, as batch_stats_kernel does for the whole tensor.
class RowStats {
 public:
  RowStats(int64_t C, int64_t threads, at::ScalarType dtype);
  ~RowStats();
  RowStats(const RowStats&) = delete;
  RowStats& operator=(const RowStats&) = delete;
  void add(const at::Tensor& rows, int64_t tid);
  std::tuple<at::Tensor, at::Tensor> finish(const at::TensorOptions& opts) const;

 private:
  struct Impl;
  Impl* impl_;
};

// a = relu(scale * x + shift) cast to a.dtype; x, a: the same shape, dense in x_layout and
// a_layout (the same, or NCHW x to NHWC a). scale, shift: (C,) contiguous in acc dtype of x.
void bn_relu_kernel(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                    at::Tensor& a, Layout x_layout, Layout a_layout);

// Backward, first pass over one batch tile (x and dz_out dense in `layout`, da in da_layout:
// the same, or NHWC da with NCHW x when both are float32, read through in-cache transposes):
//   dz = da * [scale * x + shift > 0]
//   sum_dz[c] += sum(dz), sum_dz_xm[c] += sum(dz * (x - mean))   (per-thread double rows)
//   when dz_out is defined: dz_out = out_scale[c] * dz (acc dtype of x)
// sums: (num_threads, 2, C) double, accumulated into.
// stream_dz: write dz with streaming stores where its rows allow (whole aligned vectors): for a
// dz too large to stay in cache until the second pass reads it.
void bn_relu_backward_reduce_kernel(const at::Tensor& da, const at::Tensor& x,
                                    const at::Tensor& scale, const at::Tensor& shift,
                                    const at::Tensor& mean, const at::Tensor& out_scale,
                                    at::Tensor& sums, at::Tensor* dz_out, Layout layout,
                                    Layout da_layout, bool stream_dz = false);

// Backward, second pass: gx = k1[c] * dz + k2[c] * (x - mean[c]) + k3[c] [+ add]; dz in acc
// dtype of x, gx in x.dtype (may alias dz when they share a dtype). `add` (x's shape, dtype and
// layout, dense): another gradient of x summed in the same pass (a residual unit's identity
// shortcut), instead of autograd's separate pass over both.
void bn_backward_apply_kernel(const at::Tensor& dz, const at::Tensor& x, const at::Tensor& mean,
                              const at::Tensor& k1, const at::Tensor& k2, const at::Tensor& k3,
                              at::Tensor& gx, Layout layout, const at::Tensor* add = nullptr);

// dst = src in the other layout (NCHW <-> NHWC), same shape and dtype, both dense; blocked
// 16 x 16 register transposes (at::vec::transpose_mxn). With `add` (dst's shape, dtype and
// layout, dense): dst = transposed src + add, added block by block while dst is in L1.
void transpose_layout_kernel(const at::Tensor& src, at::Tensor& dst, Layout src_layout,
                             const at::Tensor* add = nullptr);

// True when t is dense in `layout` (size-1 dimensions make both layouts hold).
inline bool dense_in(const at::Tensor& t, Layout layout) {
  return t.is_contiguous(memory_format(layout));
}

}  // namespace fusedres::cpu
