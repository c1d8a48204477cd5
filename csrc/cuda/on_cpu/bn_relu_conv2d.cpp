// The CPU-executed copy of csrc/cuda/bn_relu_conv2d.cu (see ../common.cuh).
#include <utility>

#include "../bn_relu_conv2d.cu"

// Test hook, host copy only (tests/test_cuda_kernels.py): the index helpers every fused kernel
// uses (conv_tiles.cuh: a GEMM row -> (n, h, w) -> element offset), on int64 rows, so that
// offsets past 2^31 are checked without a tensor of that size.
namespace fusedres::cuda_on_cpu {
namespace {

at::Tensor pixel_offsets(const at::Tensor& rows, int64_t height, int64_t width,
                         at::IntArrayRef sizes, at::IntArrayRef strides, int64_t channel) {
  TORCH_CHECK(sizes.size() == 4 && strides.size() == 4,
              "pixel_offsets: sizes and strides must have 4 entries");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1,
              "pixel_offsets: rows must be a 1-D int64 tensor");
  const Dims4 d{sizes[0], sizes[1], sizes[2], sizes[3],
                strides[0], strides[1], strides[2], strides[3]};
  const at::Tensor r = rows.contiguous();
  at::Tensor out = at::empty_like(r);
  const int64_t* rp = r.const_data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.numel(); ++i) {
    const Pixel p = pixel_of(rp[i], height, width);
    op[i] = d.offset(p.n, channel, p.h, p.w);
  }
  return out;
}

}  // namespace
}  // namespace fusedres::cuda_on_cpu

TORCH_LIBRARY(fusedres_cuda_testing, m) {
  m.def("pixel_offsets(Tensor rows, int height, int width, int[] sizes, int[] strides, "
        "int channel) -> Tensor");
  m.impl("pixel_offsets", c10::DispatchKey::CPU, &fusedres::cuda_on_cpu::pixel_offsets);
}

// Which mma.sync forward tile (its rows: 64 MmaFwdSmall, 128 MmaFwdTall) the forward launches for
// M output pixels and Co output channels, by forward_mma_rows, for inputs that take the mma.sync
// path. set_sm_count: the SM count the host copy's tile and split rules size for (132 until
// set; returns the previous count), so that a test runs either tile or a split on small shapes;
// set_sm_major: the compute capability's major number they size for (9 until set).
TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  m.def("forward_mma_rows(int M, int Co) -> int");
  m.impl("forward_mma_rows",
         [](int64_t M, int64_t Co) { return fusedres::cuda_on_cpu::forward_mma_rows(M, Co); });
  // The forward's and data gradient's tile columns for n output-side channels (16, 32: the thin
  // tiles; 64) and K chunk for k reduced channels (16, 32), by mma_cols and mma_depth.
  m.def("mma_cols(int n) -> int");
  m.impl("mma_cols", [](int64_t n) { return fusedres::cuda_on_cpu::mma_cols(n); });
  m.def("mma_depth(int n, int k) -> int");
  m.impl("mma_depth", [](int64_t n, int64_t k) { return fusedres::cuda_on_cpu::mma_depth(n, k); });
  m.def("set_sm_major(int major) -> int");
  m.impl("set_sm_major", [](int64_t major) {
    TORCH_CHECK(major > 0, "set_sm_major: expected a positive compute capability, got ", major);
    return std::exchange(fusedres::cuda_on_cpu::host_sm_major(), major);
  });
  m.def("set_sm_count(int sms) -> int");
  m.impl("set_sm_count", [](int64_t sms) {
    TORCH_CHECK(sms > 0, "set_sm_count: expected a positive count, got ", sms);
    return std::exchange(fusedres::cuda_on_cpu::host_sm_count(), sms);
  });
}

// The BatchNorm affine the native forward and weight gradient launch (conv_tiles.cuh's
// bn_affine): [scale, shift]; with `half`, also the rows each block of the CUTLASS forward
// writes for itself (common.cuh's block_affine16, run by `blocks` blocks of `threads` threads):
// the 16-bit scale and shift, (blocks, C) each.
namespace fusedres::cuda_on_cpu {
namespace {

template <typename H>
__global__ void __launch_bounds__(1024) block_affine16_kernel(BnVectors<float> v, H* out) {
  FUSEDRES_LAUNCH_BOUNDS(1024);
  block_affine16(v, out + static_cast<int64_t>(blockIdx.x) * 2 * v.C);
}

std::vector<at::Tensor> bn_affine_hook(const std::optional<at::Tensor>& w,
                                       const std::optional<at::Tensor>& b, const at::Tensor& mean,
                                       const at::Tensor& invstd,
                                       std::optional<at::ScalarType> half, int64_t blocks,
                                       int64_t threads) {
  if (half.has_value()) {
    TORCH_CHECK(*half == at::kHalf || *half == at::kBFloat16,
                "bn_affine: half: expected float16 or bfloat16, got ", *half);
    TORCH_CHECK(mean.scalar_type() == at::kFloat, "bn_affine: 16-bit copies of a ",
                mean.scalar_type(), " affine are not defined (float32 statistics only)");
    TORCH_CHECK(blocks >= 1 && threads >= 1 && threads <= 1024,
                "bn_affine: blocks: expected 1 or more, threads: 1 to 1024, got ", blocks, ", ",
                threads);
  }
  const Affine a = bn_affine(w, b, mean, invstd);
  std::vector<at::Tensor> out{a.scale, a.shift};
  if (!half.has_value()) return out;
  const int64_t C = mean.numel();
  at::Tensor rows = at::empty({blocks, 2, C}, mean.options().dtype(*half));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(*half, "bn_affine_hook", [&] {
    FUSEDRES_LAUNCH(dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(threads)), 0,
                    current_stream(), block_affine16_kernel<scalar_t>)(
        bn_vectors<float>(w, b, mean, invstd), rows.data_ptr<scalar_t>());
    FUSEDRES_CHECK_LAUNCH();
  });
  out.insert(out.end(), {rows.select(1, 0), rows.select(1, 1)});
  return out;
}

}  // namespace
}  // namespace fusedres::cuda_on_cpu

TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  m.def("bn_affine(Tensor? bn_weight, Tensor? bn_bias, Tensor mean, Tensor invstd, "
        "ScalarType? half=None, int blocks=1, int threads=64) -> Tensor[]");
  m.impl("bn_affine", c10::DispatchKey::CPU, &fusedres::cuda_on_cpu::bn_affine_hook);
}
