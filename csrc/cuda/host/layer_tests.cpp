// fusedres_cuda_layer_test: the layer-test kernels (tests/layer_kernels.cu) as CPU ops, for
// tests/test_cuda_host.py and the ThreadSanitizer driver (tsan/driver.cpp).
#include "layer_tests.h"

#include "tests/layer_kernels.cu"

namespace fusedres::cuda_host::layer_test {

namespace {
void check(const at::Tensor& t, at::ScalarType dtype, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() &&
                  t.numel() == numel,
              "fusedres_cuda_layer_test: ", what, " must be a contiguous CPU ", dtype,
              " tensor of ", numel, " elements, got ", t.scalar_type(), " ", t.sizes());
}
}  // namespace

at::Tensor block_sum(const at::Tensor& x, bool barrier) {
  check(x, at::kFloat, kBlock, "x");
  at::Tensor out = at::zeros({1}, x.options());
  FUSEDRES_LAUNCH(dim3(1), dim3(kBlock), 0, nullptr, block_sum_kernel)(
      x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), barrier);
  return out;
}

at::Tensor warp_sum(const at::Tensor& x, int64_t mask, int64_t lanes, int64_t first_offset) {
  check(x, at::kFloat, 32, "x");
  at::Tensor out = at::full({32}, std::numeric_limits<float>::quiet_NaN(), x.options());
  FUSEDRES_LAUNCH(dim3(1), dim3(32), 0, nullptr, warp_sum_kernel)(
      x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), static_cast<unsigned>(mask),
      static_cast<int>(lanes), static_cast<int>(first_offset));
  return out;
}

at::Tensor warp_ops() {
  at::Tensor out = at::zeros({32, 8}, at::kInt);
  FUSEDRES_LAUNCH(dim3(1), dim3(32), 0, nullptr, warp_ops_kernel)(out.mutable_data_ptr<int>());
  return out;
}

std::tuple<at::Tensor, at::Tensor> atomics(const at::Tensor& x, int64_t threads) {
  check(x, at::kFloat, x.numel(), "x");
  at::Tensor sum = at::zeros({1}, x.options());
  at::Tensor max_index = at::full({1}, -1, x.options().dtype(at::kInt));
  FUSEDRES_LAUNCH(dim3(blocks_for(x.numel(), threads)), dim3(threads), 0, nullptr,
                  atomics_kernel)(x.const_data_ptr<float>(), x.numel(),
                                  sum.mutable_data_ptr<float>(),
                                  max_index.mutable_data_ptr<int>());
  return {sum, max_index};
}

at::Tensor reverse_blocks(const at::Tensor& x, int64_t threads) {
  TORCH_CHECK(x.numel() % threads == 0, "fusedres_cuda_layer_test.reverse_blocks: x.numel() must "
              "be a multiple of threads");
  check(x, at::kFloat, x.numel(), "x");
  at::Tensor out = at::empty_like(x);
  FUSEDRES_LAUNCH(dim3(static_cast<unsigned>(x.numel() / threads)), dim3(threads),
                  threads * sizeof(float), nullptr, reverse_kernel)(
      x.const_data_ptr<float>(), out.mutable_data_ptr<float>());
  return out;
}

at::Tensor wmma_matmul(const at::Tensor& a, const at::Tensor& b, bool tf32) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) && a.is_contiguous() &&
                  b.is_contiguous() && a.scalar_type() == b.scalar_type(),
              "fusedres_cuda_layer_test.wmma_matmul: a (M, K) and b (K, N) contiguous, one dtype");
  namespace wmma = nvcuda::wmma;
  const auto type = a.scalar_type();
  const bool is_double = type == at::kDouble;
  at::Tensor c = at::empty({a.size(0), b.size(1)}, a.options().dtype(is_double ? at::kDouble
                                                                               : at::kFloat));
  auto shape_ok = [&](int64_t m, int64_t n, int64_t k) {
    TORCH_CHECK(a.size(0) == m && b.size(1) == n && a.size(1) == k,
                "fusedres_cuda_layer_test.wmma_matmul: expected ", m, "x", k, " times ", k, "x",
                n, " for ", type);
  };
  if (type == at::kHalf) {
    shape_ok(16, 16, 16);
    FUSEDRES_LAUNCH(dim3(1), dim3(32), 0, nullptr, wmma_kernel<__half, __half, 16, 16, 16, float>)(
        reinterpret_cast<const __half*>(a.const_data_ptr()),
        reinterpret_cast<const __half*>(b.const_data_ptr()), c.mutable_data_ptr<float>());
  } else if (type == at::kBFloat16) {
    shape_ok(16, 16, 16);
    FUSEDRES_LAUNCH(dim3(1), dim3(32), 0, nullptr,
                    wmma_kernel<__nv_bfloat16, __nv_bfloat16, 16, 16, 16, float>)(
        reinterpret_cast<const __nv_bfloat16*>(a.const_data_ptr()),
        reinterpret_cast<const __nv_bfloat16*>(b.const_data_ptr()), c.mutable_data_ptr<float>());
  } else if (type == at::kFloat && tf32) {
    shape_ok(16, 16, 8);
    FUSEDRES_LAUNCH(dim3(1), dim3(32), 0, nullptr,
                    wmma_kernel<float, wmma::precision::tf32, 16, 16, 8, float>)(
        a.const_data_ptr<float>(), b.const_data_ptr<float>(), c.mutable_data_ptr<float>());
  } else if (is_double) {
    shape_ok(8, 8, 4);
    FUSEDRES_LAUNCH(dim3(1), dim3(32), 0, nullptr, wmma_kernel<double, double, 8, 8, 4, double>)(
        a.const_data_ptr<double>(), b.const_data_ptr<double>(), c.mutable_data_ptr<double>());
  } else {
    TORCH_CHECK(false, "fusedres_cuda_layer_test.wmma_matmul: half, bfloat16, float (tf32) or "
                "double, got ", type);
  }
  return c;
}

}  // namespace fusedres::cuda_host::layer_test

TORCH_LIBRARY(fusedres_cuda_layer_test, m) {
  namespace t = fusedres::cuda_host::layer_test;
  m.def("block_sum(Tensor x, bool barrier) -> Tensor", &t::block_sum);
  m.def("warp_sum(Tensor x, int mask, int lanes, int first_offset) -> Tensor", &t::warp_sum);
  m.def("warp_ops() -> Tensor", &t::warp_ops);
  m.def("atomics(Tensor x, int threads) -> (Tensor, Tensor)", &t::atomics);
  m.def("reverse_blocks(Tensor x, int threads) -> Tensor", &t::reverse_blocks);
  m.def("wmma_matmul(Tensor a, Tensor b, bool tf32) -> Tensor", &t::wmma_matmul);
}
