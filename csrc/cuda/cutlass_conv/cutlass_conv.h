// The cuda backend's CUTLASS kernels (FUSEDRES_CUDA_KERNELS=cutlass): the fused unit's forward
// and weight gradient as CUTLASS implicit-GEMM convolutions with the BatchNorm-ReLU applied to
// the activation operand in the main loop (csrc/cuda/cutlass_conv/README.md).
//
// Included by the op files of both copies of csrc/cuda: kernel_set() is compiled everywhere (a
// request the copy cannot honour is an error naming the variable, raised before the op touches
// anything); the launchers exist only in the nvcc product build with nvidia-cutlass's headers
// (FUSEDRES_WITH_CUTLASS, set by setup.py), never in the CPU execution layer's copy, which
// cannot run CUTLASS's PTX.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <optional>
#include <string>

namespace fusedres::cutlass_conv {

enum class KernelSet { native, cutlass };

// FUSEDRES_CUDA_KERNELS (fusedres/settings.py), read at every call of the cuda backend's ops:
// native (unset: the default) or cutlass. With cutlass, the inputs the CUTLASS kernels take
// (can_run_*) run on them and every other input on the native kernels.
inline KernelSet kernel_set(const char* op) {
  const char* raw = std::getenv("FUSEDRES_CUDA_KERNELS");
  if (raw == nullptr) return KernelSet::native;
  // As fusedres.settings parses a choice: the ends' whitespace stripped, any case.
  std::string v(raw);
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!v.empty() && space(v.back())) v.pop_back();
  v.erase(0, std::min(v.size(), static_cast<size_t>(std::find_if_not(v.begin(), v.end(), space) -
                                                      v.begin())));
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v.empty() || v == "native") return KernelSet::native;
  TORCH_CHECK(v == "cutlass", op, ": FUSEDRES_CUDA_KERNELS: expected one of native, cutlass, got '",
              raw, "'");
#if defined(FUSEDRES_WITH_CUTLASS)
  return KernelSet::cutlass;
#elif defined(__CUDACC__)
  TORCH_CHECK(false, op,
              ": FUSEDRES_CUDA_KERNELS=cutlass, but fusedres._C was built without the CUTLASS "
              "kernels (nvidia-cutlass's headers were not found when it was built: pip install "
              "nvidia-cutlass, or set CUTLASS_PATH, then rebuild); unset it for the native "
              "kernels");
#else
  TORCH_CHECK(false, op,
              ": FUSEDRES_CUDA_KERNELS=cutlass: the CUTLASS kernels run only on a GPU; the CPU "
              "execution layer (fusedres._C_cuda_on_cpu) runs the native kernels: unset it or "
              "set native");
#endif
  return KernelSet::native;
}

#if defined(FUSEDRES_WITH_CUTLASS)

// The convolution's geometry: stride, padding, dilation as the op checked them.
struct ConvArgs {
  std::array<int64_t, 2> stride, padding, dilation;
};

// Whether the CUTLASS forward takes these operands: float16 or bfloat16 x, weight, residual and
// output y of one dtype, x, residual and y channels-last and 16-byte aligned, C and Co multiples
// of 8, sizes within CUTLASS's int extents, a problem CUTLASS's kernel implements (filter up to
// 32 x 32); no conv bias or branch scale (the caller's part of the test).
bool can_run_fprop(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* residual,
                   const at::Tensor& y, const ConvArgs& conv);
// y = conv2d(relu(scale * x + shift), weight) (+ residual), y preallocated channels-last in
// x's dtype; scale = bn_weight * invstd and shift = bn_bias - mean * scale, per channel, from
// the op's float32 vectors (bn_weight and bn_bias may be absent), as bn_affine computes them,
// rounded to x's dtype by each block of the launch for its own main loop (block_affine16).
void fprop(const at::Tensor& x, const at::Tensor& weight,
           const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
           const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor* residual,
           at::Tensor& y, const ConvArgs& conv);

// Whether the CUTLASS weight gradient takes these operands (as can_run_fprop, for grad_out too).
bool can_run_wgrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                   const ConvArgs& conv);

// CUTLASS kernel launches in this process so far.
int64_t launches();
// The weight gradient, sum over pixels of grad_out * a at each tap, a = relu(scale * x + shift)
// as the native data gradient's epilogue writes it (x's dtype, sizes and layout: the operands
// can_run_wgrad took for x), accumulated in float32 over `split` slices of the pixels (parallel
// split-K): the slices' partials, float32 (split, Co, kh, kw, C) for the weight (Co, C, kh, kw).
// The caller sums them into the weight's gradient (PartialsSum: blocks of the dx launch, or a
// launch of their own, that add the slices in an order the split fixes and round once to the
// weight's dtype and layout).
at::Tensor wgrad(const at::Tensor& grad_out, const at::Tensor& a, const at::Tensor& weight,
                 const ConvArgs& conv);

#endif

}  // namespace fusedres::cutlass_conv
