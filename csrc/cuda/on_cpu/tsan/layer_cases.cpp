// ThreadSanitizer cases of the layer itself and of batch_stats.cu.
#include "../layer_tests.h"
#include "cases.h"

namespace {

using fusedres_tsan::expect_close;
namespace lt = fusedres::cuda_on_cpu::layer_test;

void check_batch_stats(at::IntArrayRef shape, at::ScalarType dtype, bool channels_last) {
  at::Tensor x = (at::randn(shape, at::kDouble) * 3 + 2).to(dtype);
  if (channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  auto [mean, var] = fusedres::cuda_on_cpu::batch_stats(x);
  auto [var64, mean64] = at::var_mean(x.to(at::kDouble), {0, 2, 3}, 0, false);
  const double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
  expect_close(mean, mean64, tol, tol, "batch_stats mean");
  expect_close(var, var64, tol, tol, "batch_stats var");
}

}  // namespace

FUSEDRES_TSAN_CASE(batch_stats_nchw) {
  check_batch_stats({3, 5, 7, 9}, at::kFloat, false);
  check_batch_stats({2, 3, 5, 3}, at::kHalf, false);
}

FUSEDRES_TSAN_CASE(batch_stats_nhwc) {
  check_batch_stats({3, 37, 5, 3}, at::kFloat, true);
  check_batch_stats({2, 5, 3, 3}, at::kBFloat16, true);
  check_batch_stats({2, 5, 3, 3}, at::kDouble, true);
}

FUSEDRES_TSAN_CASE(layer_block_sum) {
  at::Tensor x = at::arange(64, at::kFloat);
  expect_close(lt::block_sum(x, true), x.sum().reshape({1}), 0, 0, "block_sum");
}

FUSEDRES_TSAN_CASE(layer_warp_ops) {
  at::Tensor out = lt::warp_ops();
  TORCH_CHECK(out[5][0].item<int>() == 10 * 8 && out[5][1].item<int>() == (5 ^ 5) &&
                  out[2][3].item<int>() == 5 && out[6][3].item<int>() == 6 && out[0][4].item<int>() == 0x49249249 &&
                  out[9][7].item<int>() == 16 + 100,
              "warp_ops: unexpected values");
}

FUSEDRES_TSAN_CASE(layer_atomics) {
  at::Tensor x = at::ones({300}, at::kFloat);
  auto [sum, max_index] = lt::atomics(x, 64);
  TORCH_CHECK(sum.item<float>() == 300 && max_index.item<int>() == 299, "atomics");
}

FUSEDRES_TSAN_CASE(layer_dynamic_shared) {
  at::Tensor x = at::arange(96, at::kFloat);
  at::Tensor want = x.view({3, 32}).flip(1).reshape({96});
  expect_close(lt::reverse_blocks(x, 32), want, 0, 0, "reverse_blocks");
}

FUSEDRES_TSAN_CASE(layer_wmma) {
  at::Tensor a = at::randn({16, 16}), b = at::randn({16, 16});
  for (auto t : {at::kHalf, at::kBFloat16}) {
    at::Tensor ah = a.to(t), bh = b.to(t);
    expect_close(lt::wmma_matmul(ah, bh, false), at::matmul(ah.to(at::kDouble), bh.to(at::kDouble)),
                 1e-4, 1e-4, "wmma half/bf16");
  }
  at::Tensor ad = at::randn({8, 4}, at::kDouble), bd = at::randn({4, 8}, at::kDouble);
  expect_close(lt::wmma_matmul(ad, bd, false), at::matmul(ad, bd), 1e-12, 1e-12, "wmma double");
}

// Deliberately broken: the tree sum without its barriers (ThreadSanitizer must report a race).
FUSEDRES_TSAN_DEMO(racy_block_sum) {
  lt::block_sum(at::arange(64, at::kFloat), false);
}

// Deliberately broken: lanes 16-31 shuffle with mask 0xffff, which excludes them.
FUSEDRES_TSAN_DEMO(wrong_mask) {
  lt::warp_sum(at::ones({32}), 0xffff, 32, 16);
}

// mma.cuh: the GEMM tile (cp.async, ldmatrix, mma.sync) exact on small integers, and the probes.
FUSEDRES_TSAN_CASE(layer_mma_gemm) {
  namespace mt = fusedres::cuda_on_cpu::mma_test;
  for (auto t : {at::kHalf, at::kBFloat16}) {
    at::Tensor a = at::randint(-4, 5, {16, 32}).to(t), b = at::randint(-4, 5, {32, 16}).to(t);
    expect_close(mt::gemm_tile(a, b, 0), at::matmul(a.to(at::kDouble), b.to(at::kDouble)), 0, 0,
                 "mma gemm tile");
  }
  at::Tensor table = at::arange(32 * 24, at::kShort).view({32, 24});
  at::Tensor regs = mt::ldmatrix_probe(table, 4, true, 0, false);
  TORCH_CHECK(regs[5][2].item<int64_t>() == ((16 + 2) * 24 + 1) + (((16 + 3) * 24 + 1) << 16),
              "ldmatrix.x4.trans: unexpected register");
  at::Tensor src = at::arange(64, at::kByte);
  expect_close(mt::cp_async_probe(src, 16, true, 16, 0, 16, true), src.slice(0, 16, 32), 0, 0,
               "cp.async");
  at::Tensor poisoned = mt::unwritten_shared(2, true);
  TORCH_CHECK(poisoned[1].isnan().all().item<bool>(), "unwritten shared memory is not poisoned");
}

// Deliberately broken (the sanitizer build must catch it): a 16-byte cp.async from an 8-byte
// tensor reads 8 bytes past its end.
FUSEDRES_TSAN_DEMO(oob_read) {
  at::Tensor src = at::arange(8, at::kByte);
  fusedres::cuda_on_cpu::mma_test::cp_async_probe(src, 16, true, 0, 0, 16, true);
}
