// fusedres_cuda_layer_test: the layer-test kernels (tests/layer_kernels.cu) as CPU ops, for
// tests/test_cuda_on_cpu.py and the ThreadSanitizer driver (tsan/driver.cpp).
#include "layer_tests.h"

#include "tests/layer_kernels.cu"
#include "tests/mma_kernels.cu"

namespace fusedres::cuda_on_cpu::layer_test {

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

}  // namespace fusedres::cuda_on_cpu::layer_test

namespace fusedres::cuda_on_cpu::mma_test {

at::Tensor gemm_tile(const at::Tensor& a, const at::Tensor& b, int64_t variant) {
  TORCH_CHECK(a.sizes() == at::IntArrayRef({16, 32}) && b.sizes() == at::IntArrayRef({32, 16}) &&
                  a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type(),
              "fusedres_cuda_layer_test.mma_gemm: a (16, 32) and b (32, 16), contiguous, one "
              "dtype");
  at::Tensor c = at::empty({16, 16}, a.options().dtype(at::kFloat));
  const int v = static_cast<int>(variant);
  if (a.scalar_type() == at::kHalf) {
    FUSEDRES_LAUNCH(dim3(1), dim3(32), 0, nullptr, gemm_tile_kernel<__half>)(
        reinterpret_cast<const __half*>(a.const_data_ptr()),
        reinterpret_cast<const __half*>(b.const_data_ptr()), c.mutable_data_ptr<float>(), v);
  } else {
    TORCH_CHECK(a.scalar_type() == at::kBFloat16, "mma_gemm: float16 or bfloat16");
    FUSEDRES_LAUNCH(dim3(1), dim3(32), 0, nullptr, gemm_tile_kernel<__nv_bfloat16>)(
        reinterpret_cast<const __nv_bfloat16*>(a.const_data_ptr()),
        reinterpret_cast<const __nv_bfloat16*>(b.const_data_ptr()), c.mutable_data_ptr<float>(),
        v);
  }
  return c;
}

// (32, 4) int64: the registers ldmatrix.x<num>(.trans) gives each lane (unsigned 32-bit values).
at::Tensor ldmatrix_probe(const at::Tensor& table, int64_t num, bool trans, int64_t offset,
                          bool from_global) {
  TORCH_CHECK(table.scalar_type() == at::kShort && table.is_contiguous() &&
                  table.sizes() == at::IntArrayRef({32, 24}),
              "ldmatrix_probe: table must be a contiguous (32, 24) int16 tensor");
  at::Tensor out = at::zeros({32, 4}, at::kInt);
  const auto* t = reinterpret_cast<const uint16_t*>(table.const_data_ptr());
  auto* o = reinterpret_cast<uint32_t*>(out.mutable_data_ptr<int>());
  const int off = static_cast<int>(offset);
  auto run = [&](auto kernel) {
    FUSEDRES_LAUNCH(dim3(1), dim3(32), 0, nullptr, kernel)(t, o, off, from_global);
  };
  if (num == 1) trans ? run(ldmatrix_kernel<1, true>) : run(ldmatrix_kernel<1, false>);
  else if (num == 2) trans ? run(ldmatrix_kernel<2, true>) : run(ldmatrix_kernel<2, false>);
  else if (num == 4) trans ? run(ldmatrix_kernel<4, true>) : run(ldmatrix_kernel<4, false>);
  else TORCH_CHECK(false, "ldmatrix_probe: num must be 1, 2 or 4");
  return out.to(at::kLong).bitwise_and(0xffffffffLL);
}

// (16,) uint8: the shared destination as the thread reads it after the copy (see the kernel).
at::Tensor cp_async_probe(const at::Tensor& src, int64_t bytes, bool cg, int64_t src_offset,
                          int64_t dst_offset, int64_t src_size, bool wait) {
  TORCH_CHECK(src.scalar_type() == at::kByte && src.is_contiguous() && dst_offset >= 0 &&
                  dst_offset + 16 <= 64,
              "cp_async_probe: src must be contiguous uint8, dst_offset in [0, 48]");
  at::Tensor out = at::zeros({16}, at::kByte);
  const auto* p = src.const_data_ptr<uint8_t>();
  auto* o = out.mutable_data_ptr<uint8_t>();
  const int so = static_cast<int>(src_offset), d = static_cast<int>(dst_offset);
  const int ss = static_cast<int>(src_size);
  if (bytes == 4) {
    FUSEDRES_LAUNCH(dim3(1), dim3(1), 0, nullptr, cp_async_kernel<4>)(p, o, cg, so, d, ss, wait);
  } else if (bytes == 8) {
    FUSEDRES_LAUNCH(dim3(1), dim3(1), 0, nullptr, cp_async_kernel<8>)(p, o, cg, so, d, ss, wait);
  } else {
    TORCH_CHECK(bytes == 16, "cp_async_probe: bytes must be 4, 8 or 16");
    FUSEDRES_LAUNCH(dim3(1), dim3(1), 0, nullptr, cp_async_kernel<16>)(p, o, cg, so, d, ss, wait);
  }
  return out;
}

at::Tensor unwritten_shared(int64_t blocks, bool planted) {
  at::Tensor out = at::zeros({blocks, 32}, at::kFloat);
  FUSEDRES_LAUNCH(dim3(static_cast<unsigned>(blocks)), dim3(32), 0, nullptr,
                  unwritten_shared_kernel)(out.mutable_data_ptr<float>(), planted);
  return out;
}

at::Tensor bounded(int64_t threads) {
  at::Tensor out = at::full({threads}, -1, at::kInt);
  FUSEDRES_LAUNCH(dim3(1), dim3(static_cast<unsigned>(threads)), 0, nullptr, bounded_kernel)(
      out.mutable_data_ptr<int>());
  return out;
}

// Launches a kernel with `bytes` of dynamic shared memory; with opt_in after
// cudaFuncSetAttribute(MaxDynamicSharedMemorySize, bytes), whose status comes back in out[32]
// (0 cudaSuccess, 1 cudaErrorInvalidValue). A separate instantiation per opt_in, so that the
// setting of one test does not carry into the other.
at::Tensor dynamic_smem(int64_t bytes, bool opt_in) {
  at::Tensor out = at::full({33}, -1.0f, at::kFloat);
  float* o = out.mutable_data_ptr<float>();
  const int b = static_cast<int>(bytes);
  if (opt_in) {
    const cudaError_t status = cudaFuncSetAttribute(
        dynamic_smem_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, b);
    o[32] = static_cast<float>(status);
    FUSEDRES_LAUNCH(dim3(1), dim3(32), static_cast<size_t>(bytes), nullptr,
                    dynamic_smem_kernel<1>)(o, b);
  } else {
    FUSEDRES_LAUNCH(dim3(1), dim3(32), static_cast<size_t>(bytes), nullptr,
                    dynamic_smem_kernel<0>)(o, b);
  }
  return out;
}

at::Tensor divergent_collective(int64_t mode) {
  at::Tensor out = at::zeros({32}, at::kFloat);
  FUSEDRES_LAUNCH(dim3(1), dim3(32), 0, nullptr, divergent_collective_kernel)(
      out.mutable_data_ptr<float>(), static_cast<int>(mode));
  return out;
}

}  // namespace fusedres::cuda_on_cpu::mma_test

TORCH_LIBRARY(fusedres_cuda_layer_test, m) {
  namespace t = fusedres::cuda_on_cpu::layer_test;
  m.def("block_sum(Tensor x, bool barrier) -> Tensor", &t::block_sum);
  m.def("warp_sum(Tensor x, int mask, int lanes, int first_offset) -> Tensor", &t::warp_sum);
  m.def("warp_ops() -> Tensor", &t::warp_ops);
  m.def("atomics(Tensor x, int threads) -> (Tensor, Tensor)", &t::atomics);
  m.def("reverse_blocks(Tensor x, int threads) -> Tensor", &t::reverse_blocks);
  m.def("wmma_matmul(Tensor a, Tensor b, bool tf32) -> Tensor", &t::wmma_matmul);
  namespace mt = fusedres::cuda_on_cpu::mma_test;
  m.def("mma_gemm(Tensor a, Tensor b, int variant) -> Tensor", &mt::gemm_tile);
  m.def("ldmatrix_probe(Tensor table, int num, bool trans, int offset, bool from_global) -> Tensor",
        &mt::ldmatrix_probe);
  m.def("cp_async_probe(Tensor src, int bytes, bool cg, int src_offset, int dst_offset, "
        "int src_size, bool wait) -> Tensor", &mt::cp_async_probe);
  m.def("unwritten_shared(int blocks, bool planted) -> Tensor", &mt::unwritten_shared);
  m.def("bounded(int threads) -> Tensor", &mt::bounded);
  m.def("dynamic_smem(int bytes, bool opt_in) -> Tensor", &mt::dynamic_smem);
  m.def("divergent_collective(int mode) -> Tensor", &mt::divergent_collective);
  // The launches counted so far; stub_launches(on) makes later launches count without running
  // (the host cost of a route, its kernels as no-ops: benchmarks/hostcost.py). Returns the
  // previous setting.
  m.def("launches() -> int",
        [] { return static_cast<int64_t>(fusedres_on_cpu::launch_count().load()); });
  m.def("stub_launches(bool on) -> bool",
        [](bool on) { return fusedres_on_cpu::launch_stub().exchange(on); });
}
