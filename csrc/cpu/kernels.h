// The CPU backend's elementwise kernels as the rest of csrc/cpu calls them (bn_relu_conv2d.cpp). Their code lives in csrc/cpu/vec/, which
// setup.py compiles once per CPU capability (baseline x86-64-v2, AVX2, AVX-512: cpu_capabilities()
// there), each copy in its own namespace fusedres::cpu::fusedres_<capability>; the functions
// declared here (csrc/cpu/dispatch.cpp) forward every call to the copy chosen when fusedres._C
// was loaded (csrc/cpu/capability.h). No at::vec here: the translation units that include this
// header are compiled for the compiler's default target only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <tuple>

namespace fusedres::cpu {

// Memory layout the kernels walk: NCHW planes or NHWC rows. Any other strides are made
// contiguous by the caller first.
enum class Layout { NCHW, NHWC };

inline at::MemoryFormat memory_format(Layout layout) {
  return layout == Layout::NHWC ? at::MemoryFormat::ChannelsLast
                                : at::MemoryFormat::Contiguous;
}

// True when t is dense in `layout` (size-1 dimensions make both layouts hold).
inline bool dense_in(const at::Tensor& t, Layout layout) {
  return t.is_contiguous(memory_format(layout));
}

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
  // What each capability's copy implements (csrc/cpu/vec/batch_stats.cpp).
  struct Impl {
    virtual ~Impl() = default;
    virtual void add(const at::Tensor& rows, int64_t tid) = 0;
    virtual std::tuple<at::Tensor, at::Tensor> finish(const at::TensorOptions& opts) const = 0;
  };

  RowStats(int64_t C, int64_t threads, at::ScalarType dtype);
  ~RowStats();
  RowStats(const RowStats&) = delete;
  RowStats& operator=(const RowStats&) = delete;
  void add(const at::Tensor& rows, int64_t tid) { impl_->add(rows, tid); }
  std::tuple<at::Tensor, at::Tensor> finish(const at::TensorOptions& opts) const {
    return impl_->finish(opts);
  }

 private:
  std::unique_ptr<Impl> impl_;
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
// sums: (num_threads, 2, C) double, accumulated into, row t by thread t of the kernel's
// parallel_for: called inside a parallel region (it then runs serially, as thread 0), one row
// is enough; outside one, at::get_num_threads() rows are needed (checked).
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

// One capability's copy of the kernels above (csrc/cpu/vec/): what csrc/cpu/dispatch.cpp
// forwards to. Each copy defines one, constant-initialised: loading the extension runs none of
// a copy's code, whose instructions the CPU may lack.
struct KernelTable {
  decltype(&batch_stats_kernel) batch_stats;
  RowStats::Impl* (*row_stats)(int64_t C, int64_t threads, at::ScalarType dtype);
  decltype(&bn_relu_kernel) bn_relu;
  decltype(&bn_relu_backward_reduce_kernel) backward_reduce;
  decltype(&bn_backward_apply_kernel) backward_apply;
  decltype(&transpose_layout_kernel) transpose_layout;
};

}  // namespace fusedres::cpu
