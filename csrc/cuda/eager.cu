// The cuda backend's eager routes (../eager.h, shared with csrc/cpu): the fused unit and the pair
// as C++ autograd nodes (fusedres_cuda::eager_unit, eager_pair: EagerCudaUnit, EagerCudaPair)
// and a BNReLUConv2d module's forward in one call (fusedres_cuda::module_unit: prepare_batch_norm,
// then EagerCudaUnit). No kernels here: the nodes call this copy's op functions (ops.h) directly.
//
// The nodes register for this copy's device's autograd key (FUSEDRES_CUDA_AUTOGRAD_KEY:
// AutogradCUDA under nvcc, AutogradCPU in the host copy), so that with both extensions loaded each
// copy's nodes take its own tensors. module_unit registers there too and for the device key
// (inference mode skips the autograd keys).
#include "../eager.h"  // before common.cuh: plain C++, outside the host layer's macros
#include "common.cuh"
#include "ops.h"

namespace fusedres::FUSEDRES_CUDA_NS {
namespace {

// The pair has no kernels of its own here: two forward launches, and in backward two backward
// calls (eager::composed_pair_backward), x's and the BatchNorm parameters' gradients summed.
struct CudaKernels {
  static constexpr c10::DeviceType kDevice = kDeviceType;
  static constexpr const char* kNamespace = "fusedres_cuda";
  static bool on_device(const at::Tensor& t) { return t.device().type() == kDeviceType; }
  static bool takes_dtype(at::ScalarType dt) {
    return dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16;
  }
  static constexpr auto prepare = &prepare_batch_norm;
  static constexpr auto forward = &bn_relu_conv2d;
  static constexpr auto genstats = &bn_relu_conv2d_genstats;
  static constexpr auto backward = &bn_relu_conv2d_backward;
  static constexpr bool kPairKernels = false;
};

// The nodes' names (CppNode<...::EagerCudaUnit>) say which route built a graph.
struct EagerCudaUnit : eager::UnitNode<EagerCudaUnit, CudaKernels> {};
struct EagerCudaPair : eager::PairNode<EagerCudaPair, CudaKernels> {};

}  // namespace
}  // namespace fusedres::FUSEDRES_CUDA_NS

FUSEDRES_CUDA_LIBRARY_IMPL_AT(FUSEDRES_CUDA_AUTOGRAD_KEY, m) {
  using namespace fusedres::FUSEDRES_CUDA_NS;
  m.impl("eager_unit", &fusedres::eager::eager_unit<EagerCudaUnit>);
  m.impl("eager_pair", &fusedres::eager::eager_pair<EagerCudaPair>);
  m.impl("module_unit", &fusedres::eager::module_unit<CudaKernels, EagerCudaUnit>);
  m.impl("prepare_batch_norm", &fusedres::eager::prepare_below_autograd<CudaKernels>);
}

// Below autograd (inference mode) the eager ops run their forward alone, module_unit without a
// node (grad mode is off there).
FUSEDRES_CUDA_LIBRARY_IMPL(m) {
  using namespace fusedres::FUSEDRES_CUDA_NS;
  m.impl("eager_unit", &fusedres::eager::unit_forward<CudaKernels>);
  m.impl("eager_pair", &fusedres::eager::pair_forward<CudaKernels>);
  m.impl("module_unit", &fusedres::eager::module_unit<CudaKernels, EagerCudaUnit>);
}
