// What the CUTLASS kernel files share: the bfloat16 form of CUTLASS's forward scale-bias-ReLU
// operand transform, the problem description, the tile type, the kernel, its occupancy and its
// launch (the tile table and the split are plan.h's).
//
// CUTLASS's mainloop-fusion forward (conv/kernel/default_conv2d_fprop_fusion.h) transforms the
// activation operand in registers, between the shared-memory load and the mma:
// a = relu(scale * x + shift), per channel. Padding is of a, not of x: the operand's
// out-of-image elements arrive as the 16-bit pattern 0x7eff (cp.async's fill,
// cutlass::arch::OOB_NAN_F16) and the transform writes 0 for them. CUTLASS ships the
// transform for float16 only (fma.rn.f16x2.relu); the bfloat16 one below is this project's:
// the same structure on fma.rn.relu.bf16x2 (sm_80 and newer), selected by partial
// specialisation on the fragments' element type. The fill's pattern is a finite bfloat16
// (about 1.69e38), so an x element of exactly that value reads as padding: a value no
// normalised activation takes. (The weight gradient reads a itself: wgrad.cu.)
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <utility>

#include "cutlass/arch/memory_sm80.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/warp/scale_bias_relu_transform.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/numeric_types.h"

#include "../common.cuh"  // allow_dynamic_smem
#include "cutlass_conv.h"
#include "plan.h"

namespace cutlass::conv::warp {

// Forward: two channels of one row per 32-bit register (C even, so a pair is in or out of the
// image together), scale and shift of the pair's channels in ScaleBiasOperand's two registers.
template <int kActivations, int kScaleBias>
struct FpropScaleBiasReluTransform<Array<bfloat16_t, kActivations>,
                                   Array<bfloat16_t, kScaleBias>> {
  using FragmentActivations = Array<bfloat16_t, kActivations>;
  using FragmentScaleBias = Array<bfloat16_t, kScaleBias>;
  static constexpr bool kFusedresBf16 = true;
  static int const kPairsPerScaleBias = 2;  // two k-pairs of the m16n8k16 A fragment
  static int const kCols = 2;

  CUTLASS_DEVICE
  static void transform(uint32_t& pair, uint32_t scale, uint32_t shift) {
    uint32_t a = pair;
    asm volatile(
        "{\n\t"
        " .reg .pred p;\n\t"
        " .reg .b32 t;\n\t"
        " setp.eq.u32 p, %1, %4;\n\t"
        " fma.rn.relu.bf16x2 t, %2, %1, %3;\n\t"
        " selp.b32 %0, 0, t, p;\n\t"
        "}\n"
        : "=r"(pair)
        : "r"(a), "r"(scale), "r"(shift), "n"(cutlass::arch::OOB_NAN_F16x2));
  }

  CUTLASS_DEVICE
  void operator()(FragmentActivations& activations, FragmentScaleBias const& scale_bias) {
    uint32_t* a = reinterpret_cast<uint32_t*>(&activations);
    uint32_t const* sb = reinterpret_cast<uint32_t const*>(&scale_bias);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kActivations / 2; ++i) {
      const int j = (i / kPairsPerScaleBias) % kCols;  // the pair's scale/shift registers
      transform(a[i], sb[2 * j], sb[2 * j + 1]);
    }
  }
};

}  // namespace cutlass::conv::warp

namespace fusedres::cutlass_conv {

using ::fusedres::FUSEDRES_CUDA_NS::BnVectors;
using ::fusedres::FUSEDRES_CUDA_NS::bn_vectors;

// The CUTLASS element type of a 16-bit ATen dtype.
template <typename T> struct Element;
template <> struct Element<at::Half> { using type = cutlass::half_t; };
template <> struct Element<at::BFloat16> { using type = cutlass::bfloat16_t; };
// And back: the ATen dtype of a CUTLASS element type (the forward's prologue rounds as ATen).
template <typename E> struct Aten;
template <> struct Aten<cutlass::half_t> { using type = at::Half; };
template <> struct Aten<cutlass::bfloat16_t> { using type = at::BFloat16; };

// Whether a transform class is this project's bfloat16 one (a static_assert in fprop.cu
// checks that every bfloat16 instantiation takes it and no float16 one does).
template <typename T, typename = void>
struct OwnTransform : std::false_type {};
template <typename T>
struct OwnTransform<T, std::void_t<decltype(T::kFusedresBf16)>> : std::true_type {};

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// An operand the kernels read or write: 16-bit, channels-last (NHWC in memory), 16-byte aligned.
inline bool nhwc16(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype && t.dim() == 4 &&
         t.is_contiguous(at::MemoryFormat::ChannelsLast) && aligned16(t.const_data_ptr());
}

// The common test of can_run_fprop and can_run_wgrad: 16-bit, C and Co multiples of 8 (the
// 16-byte accesses; the transforms' channel pairs), channels-last, and sizes CUTLASS's int
// extents hold (N * H * W * C below 2^31).
inline bool operands_ok(const at::Tensor& x, const at::Tensor& weight) {
  const auto dt = x.scalar_type();
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  return (dt == at::kHalf || dt == at::kBFloat16) && weight.scalar_type() == dt &&
         x.numel() <= kIntMax && weight.numel() <= kIntMax &&
         x.size(1) % 8 == 0 && weight.size(0) % 8 == 0 && weight.size(1) == x.size(1) &&
         nhwc16(x, dt);
}

// The implicit GEMM's problem (NHWC x, KRSC filter, NPQK output), cross-correlation as
// torch.nn.functional.conv2d; split_k slices of the reduction.
inline cutlass::conv::Conv2dProblemSize problem(const at::Tensor& x, const at::Tensor& weight,
                                                int64_t P, int64_t Q, const ConvArgs& c,
                                                int split_k) {
  auto i = [](int64_t v) { return static_cast<int>(v); };
  return cutlass::conv::Conv2dProblemSize(
      i(x.size(0)), i(x.size(2)), i(x.size(3)), i(x.size(1)), i(weight.size(0)), i(weight.size(2)),
      i(weight.size(3)), i(P), i(Q), i(c.padding[0]), i(c.padding[1]), i(c.stride[0]),
      i(c.stride[1]), i(c.dilation[0]), i(c.dilation[1]), cutlass::conv::Mode::kCrossCorrelation,
      split_k);
}

inline int sm_count() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

inline int sm_major() { return at::cuda::getCurrentDeviceProperties()->major; }

inline void check(cutlass::Status status, const char* what) {
  TORCH_CHECK(status == cutlass::Status::kSuccess, "fusedres_cuda (CUTLASS): ", what, ": ",
              cutlass::cutlassGetStatusString(status));
}

// A kernel's block size and dynamic shared memory as template arguments, so that the compile
// table (tools/cuda_aot) reads them from the kernel's name: the kernel has no __launch_bounds__
// (with one, ptxas spilled 16 bytes in both bfloat16 weight-gradient kernels; CUTLASS's own
// launches have none either). launch() pins both to CUTLASS's kThreadCount and SharedStorage
// with static_asserts (a CUTLASS release that changes them fails to compile).
template <int kThreadsArg, int kSmemArg>
struct Launch {
  static constexpr int kThreads = kThreadsArg;
  static constexpr int kSmem = kSmemArg;
};

// sm_80's largest dynamic shared memory per block (163 KiB; sm_90's is 227 KiB).
constexpr int kMaxSmemSm80 = 163 * 1024;

// A tile of the table: BM x BN outputs a block, warps of WM x WN, BK = 32, STAGES cp.async stages.
template <int BM, int BN, int WM, int WN, int STAGES, typename L>
struct ConvTile {
  static constexpr int kRows = BM;
  static constexpr int kCols = BN;
  using Block = cutlass::gemm::GemmShape<BM, BN, 32>;
  using Warp = cutlass::gemm::GemmShape<WM, WN, 32>;
  static constexpr int kStages = STAGES;
  static constexpr int kThreads = L::kThreads;
  static constexpr int kSmem = L::kSmem;
  static_assert(kThreads == BM / WM * (BN / WN) * 32, "one warp per warp tile");
  static_assert(kSmem <= kMaxSmemSm80, "shared memory within sm_80's per-block limit");
};

// Whether tile T is plan.h's shape `s` (the host rules size grids with plan.h's shapes).
template <typename T>
constexpr bool matches(plan::Shape s) {
  return T::kRows == s.rows && T::kCols == s.cols;
}

// The kernel's second argument: nothing (the weight gradient: Config::run is CUTLASS's kernel
// object), or (the forward, BlockAffine) what its blocks compute their scale and shift from.
struct NoPrologue {};

// The forward's: the op's float32 BatchNorm vectors and a scratch of (blocks, 2, C) values of
// H (x's 16-bit dtype as ATen names it: the rounding tests/test_cuda_kernels.py holds), a row
// per block (fprop.cu's Fprop::run).
template <typename H>
struct BlockAffine {
  BnVectors<float> v;
  H* scratch;
};

// The kernel every configuration runs, under this project's name for the configuration (the
// compile table, the performance model, a profiler's trace): Config::run, one block's work.
template <typename Config>
__global__ void
    cutlass_conv_kernel(typename Config::Conv::Params params, typename Config::Prologue pro) {
  extern __shared__ __align__(128) unsigned char cutlass_conv_smem[];
  Config::run(params,
              *reinterpret_cast<typename Config::Conv::SharedStorage*>(cutlass_conv_smem), pro);
}

// Whether CUTLASS's kernel of ``Config`` takes ``p`` (its iterators' own limits: filter size up
// to 32 x 32, the accesses' alignment, grid extents): asked before the launch, so that a problem
// it refuses runs on the native kernels instead of failing.
template <typename Config>
bool implementable(const cutlass::conv::Conv2dProblemSize& p) {
  typename Config::Op::Arguments args;
  args.problem_size = p;
  return Config::Op::can_implement(args) == cutlass::Status::kSuccess;
}

// Lets Config's kernel take its dynamic shared memory past the default 48 KiB, once per device
// (allow_dynamic_smem in ../common.cuh, as the native wide data-gradient tile does): not a driver
// call on the host path of every CUTLASS launch.
template <typename Config>
cudaError_t allow_smem() {
  constexpr int smem = Config::Tile::kSmem;
  if constexpr (smem >= 48 * 1024) {
    return ::fusedres::FUSEDRES_CUDA_NS::allow_dynamic_smem<cutlass_conv_kernel<Config>>(
        smem, c10::cuda::current_device());
  }
  return cudaSuccess;
}

// Blocks of Config's kernel the current GPU holds at once: CUDA's occupancy for its block size
// and shared memory, times the SMs; asked once per device (plan::wgrad_split sizes its grid
// with it). 0 where CUDA cannot say or the kernel fits no SM: the caller then runs native.
template <typename Config>
int64_t resident_blocks() {
  constexpr int kDevices = 64;
  static std::atomic<int> per_sm[kDevices];  // zero: not asked yet (or not resident)
  const int device = c10::cuda::current_device();
  int n = device < kDevices ? per_sm[device].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    cudaError_t e = allow_smem<Config>();
    if (e == cudaSuccess) {
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, cutlass_conv_kernel<Config>,
                                                        Config::Tile::kThreads,
                                                        Config::Tile::kSmem);
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it for the native kernels that run instead
      return 0;
    }
    if (device < kDevices) per_sm[device].store(n, std::memory_order_relaxed);
  }
  return static_cast<int64_t>(n) * sm_count();
}

// CUTLASS launches in this process (fprop.cu holds it): fusedres._C.cutlass_launches(), read by
// `fusedres selftest` to show that a cuda:cutlass row ran a CUTLASS kernel, not a fallback.
std::atomic<int64_t>& launch_counter();

// One launch on the current stream: CUTLASS's own checks of the problem (can_implement), the
// parameters, the kernel. One slice, or parallel split-K (each slice writes its own partial
// through the output's pointer, a slice apart): no workspace either way. prologue(grid): the
// kernel's Config::Prologue argument for that grid.
template <typename Config, typename MakePrologue>
void launch(const typename Config::Op::Arguments& args, MakePrologue&& prologue) {
  using Conv = typename Config::Conv;
  using Op = typename Config::Op;
  static_assert(sizeof(typename Conv::SharedStorage) == Config::Tile::kSmem,
                "the tile's Launch states CUTLASS's SharedStorage");
  static_assert(Conv::kThreadCount == Config::Tile::kThreads,
                "the tile's Launch states CUTLASS's block size");
  check(Op::can_implement(args), "can_implement");
  TORCH_CHECK(args.problem_size.split_k_slices == 1 ||
                  args.split_k_mode == cutlass::conv::SplitKMode::kParallel,
              "fusedres_cuda (CUTLASS): a split reduction runs as parallel split-K");
  const typename Conv::Params params(args, /*semaphore=*/nullptr);
  const dim3 grid = typename Conv::ThreadblockSwizzle().get_grid_shape(params.grid_tiled_shape);
  const typename Config::Prologue pro = prologue(grid);
  constexpr int smem = Config::Tile::kSmem;
  C10_CUDA_CHECK(allow_smem<Config>());
  cutlass_conv_kernel<Config><<<grid, Config::Tile::kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      params, pro);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_counter().fetch_add(1, std::memory_order_relaxed);
}

}  // namespace fusedres::cutlass_conv
