// nvcuda::wmma emulated whole-tile for the CPU execution layer (included by runtime.h).
//
// A fragment's element order is unspecified in CUDA, so kernels may only load, store, fill,
// multiply-accumulate, and apply the same operation to every element. Here every lane holds the
// whole tile in row-major order (num_elements = rows * cols) and mma_sync multiplies the whole
// tile; store_matrix_sync writes every 32nd element per lane, so the lanes write disjoint
// addresses (ThreadSanitizer sees what a GPU does: other lanes read the tile only after a
// __syncwarp or __syncthreads). The pointer and leading-dimension rules of CUDA (256-bit aligned
// pointer, ldm a multiple of 16 bytes) are checked: a load that would fault on a GPU fails here.
// Supported: m16n16k16 half/bf16 with float accumulate, m16n16k8 tf32 with float accumulate,
// m8n8k4 double.
#pragma once

#include <cstdint>
#include <string>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision {
struct tf32 {};
}  // namespace precision

namespace detail {
template <typename T>
struct storage {
  using type = T;
};
template <>
struct storage<precision::tf32> {
  using type = float;
};
template <typename Use, int M, int N, int K>
struct shape;
template <int M, int N, int K>
struct shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};
template <typename Layout>
constexpr bool is_row_major() {
  return std::is_same_v<Layout, row_major>;
}

template <typename T>
void check_pointer(const char* op, const void* p, unsigned ldm) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0) {
    fusedres_on_cpu::device_error(std::string(op) + ": the pointer must be 256-bit aligned");
  }
  if ((ldm * sizeof(T)) % 16 != 0) {
    fusedres_on_cpu::device_error(std::string(op) + ": ldm = " + std::to_string(ldm) +
                                " is not a multiple of 16 bytes");
  }
}

// Tensor cores read tf32 operands as the top 19 bits of a float.
inline float tf32_bits(float v) {
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(v) & 0xffffe000u);
}
template <typename T>
inline float operand(T v) {
  return static_cast<float>(v);
}
inline double operand(double v) { return v; }
}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
 public:
  using element_type = T;
  using storage_element_type = typename detail::storage<T>::type;
  static constexpr int rows = detail::shape<Use, M, N, K>::rows;
  static constexpr int cols = detail::shape<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  storage_element_type x[num_elements];
};

template <typename Use, int M, int N, int K, typename T, typename L, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, const V& v) {
  for (int i = 0; i < f.num_elements; ++i) {
    f.x[i] = static_cast<typename fragment<Use, M, N, K, T, L>::storage_element_type>(v);
  }
}

// matrix_a / matrix_b: the layout is part of the type.
template <typename Use, int M, int N, int K, typename T, typename L, typename P>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const P* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load takes a layout_t");
  detail::check_pointer<P>("load_matrix_sync", p, ldm);
  using F = fragment<Use, M, N, K, T, L>;
  for (int r = 0; r < F::rows; ++r) {
    for (int c = 0; c < F::cols; ++c) {
      f.x[r * F::cols + c] = detail::is_row_major<L>() ? p[r * ldm + c] : p[r + c * ldm];
    }
  }
}

template <int M, int N, int K, typename T, typename P>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const P* p, unsigned ldm,
                             layout_t layout) {
  detail::check_pointer<P>("load_matrix_sync", p, ldm);
  for (int r = 0; r < M; ++r) {
    for (int c = 0; c < N; ++c) {
      f.x[r * N + c] = layout == mem_row_major ? p[r * ldm + c] : p[r + c * ldm];
    }
  }
}

template <int M, int N, int K, typename T, typename P>
inline void store_matrix_sync(P* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                              layout_t layout) {
  detail::check_pointer<P>("store_matrix_sync", p, ldm);
  const int lane = static_cast<int>(fusedres_on_cpu::self().lane);
  for (int i = lane; i < M * N; i += 32) {
    const int r = i / N, c = i % N;
    p[layout == mem_row_major ? r * ldm + c : r + c * ldm] = static_cast<P>(f.x[i]);
  }
}

// d = a * b + c over the whole tile, accumulating in the accumulator's type, k in order.
template <int M, int N, int K, typename TA, typename LA, typename TB, typename LB, typename TC>
inline void mma_sync(fragment<accumulator, M, N, K, TC>& d,
                     const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b,
                     const fragment<accumulator, M, N, K, TC>& c) {
  constexpr bool tf32 = std::is_same_v<TA, precision::tf32>;
  TC out[M * N];
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      TC acc = c.x[i * N + j];
      for (int k = 0; k < K; ++k) {
        auto av = detail::operand(a.x[i * K + k]);
        auto bv = detail::operand(b.x[k * N + j]);
        if constexpr (tf32) {
          av = detail::tf32_bits(av);
          bv = detail::tf32_bits(bv);
        }
        acc += static_cast<TC>(av) * static_cast<TC>(bv);
      }
      out[i * N + j] = acc;
    }
  }
  for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}

}  // namespace wmma
}  // namespace nvcuda

// Round to tf32 (nearest, ties away from zero), as cvt.rna.tf32.f32.
inline float __float_to_tf32(float v) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(v);
  if ((bits & 0x7f800000u) == 0x7f800000u) return v;  // inf, nan
  return std::bit_cast<float>((bits + 0x1000u) & 0xffffe000u);
}
