// at::vec set-up for one CPU capability, and the helpers the kernels of this folder share. Each
// .cpp here is compiled once per capability by setup.py (cpu_capability_builds), with that
// capability's -m flags and FUSEDRES_VEC_<NAME> defined; everything it defines goes into the
// namespace fusedres::cpu::fusedres_<name> (CPU_CAPABILITY), and csrc/cpu/dispatch.cpp calls
// the copy the CPU runs through its KernelTable (kernels.h).
//
// at::vec picks its implementation from the CPU_CAPABILITY_* macros that ATen's own build
// defines per translation unit; an extension defines them itself. CPU_CAPABILITY also names
// at::vec's inline namespace: ours, so that these inline functions never collide with
// libtorch's copies. Functions that the copies share by name (ATen's and the standard
// library's inline functions, instantiated in every copy) are kept from the first object the
// linker sees, which setup.py makes the baseline's; tests/test_cpu_capability.py checks that no
// code outside a capability's own namespace uses AVX registers.
#pragma once

#if defined(FUSEDRES_VEC_AVX512)
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
      defined(__AVX512DQ__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "FUSEDRES_VEC_AVX512 needs -mavx512f -mavx512bw -mavx512dq -mavx512vl and AVX2's flags"
#endif
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY fusedres_avx512
#elif defined(FUSEDRES_VEC_AVX2)
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "FUSEDRES_VEC_AVX2 needs -mavx2 -mfma -mf16c"
#endif
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY fusedres_avx2
#elif defined(FUSEDRES_VEC_BASELINE)
#define CPU_CAPABILITY fusedres_baseline
#else
#error "csrc/cpu/vec/ is compiled once per CPU capability by setup.py, with FUSEDRES_VEC_<NAME>"
#endif

// GCC 12 reports false -Wmaybe-uninitialized in its own AVX-512 intrinsics headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wunknown-pragmas"

// ATen's parts these kernels use, not <ATen/ATen.h>: each file here is compiled three times, and
// ATen.h's every-op headers took half the parse time.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../kernels.h"

namespace fusedres::cpu::CPU_CAPABILITY {

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

// This capability's copies of the kernels of kernels.h (their rules are stated there), declared
// here so that a kernel's recursive calls stay in its own copy.
std::tuple<at::Tensor, at::Tensor> batch_stats_kernel(const at::Tensor& x, Layout layout);
RowStats::Impl* make_row_stats(int64_t C, int64_t threads, at::ScalarType dtype);
void bn_relu_kernel(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                    at::Tensor& a, Layout x_layout, Layout a_layout);
void bn_relu_backward_reduce_kernel(const at::Tensor& da, const at::Tensor& x,
                                    const at::Tensor& scale, const at::Tensor& shift,
                                    const at::Tensor& mean, const at::Tensor& out_scale,
                                    at::Tensor& sums, at::Tensor* dz_out, Layout layout,
                                    Layout da_layout, bool stream_dz);
void bn_backward_apply_kernel(const at::Tensor& dz, const at::Tensor& x, const at::Tensor& mean,
                              const at::Tensor& k1, const at::Tensor& k2, const at::Tensor& k3,
                              at::Tensor& gx, Layout layout, const at::Tensor* add);
void transpose_layout_kernel(const at::Tensor& src, at::Tensor& dst, Layout src_layout,
                             const at::Tensor* add);

// The table csrc/cpu/dispatch.cpp reads (defined in bn_relu.cpp).
extern const KernelTable kernel_table;

}  // namespace fusedres::cpu::CPU_CAPABILITY
