// Test hooks: the CUTLASS kernels' host rules (../cutlass_conv/plan.h, the header the GPU build
// compiles) run here, so tests/test_cutlass.py holds tools/perfmodel's copy of them to the
// rules themselves (the kernels cannot run on this execution layer; their rules can).
#include <torch/library.h>

#include <vector>

#include "../cutlass_conv/plan.h"

namespace plan = fusedres::cutlass_conv::plan;

TORCH_LIBRARY_FRAGMENT(fusedres_cuda_testing, m) {
  // The forward's tile as (rows, cols) for M output pixels, Co channels, sms SMs, compute
  // capability `major`.x.
  m.def("cutlass_fprop_tile(int M, int Co, int sms, int major) -> int[]");
  m.impl("cutlass_fprop_tile", [](int64_t M, int64_t Co, int64_t sms, int64_t major) {
    const plan::Shape s = plan::shape(plan::fprop_tile(M, Co, sms, major));
    return std::vector<int64_t>{s.rows, s.cols};
  });
  // Whether the cutlass kernel set takes a kh x kw unit's weight gradient (else the native
  // "sums" backward).
  m.def("cutlass_wgrad_on(int kh, int kw) -> bool");
  m.impl("cutlass_wgrad_on",
         [](int64_t kh, int64_t kw) { return plan::wgrad_on_cutlass(kh, kw); });
  // The weight gradient's (rows, cols, split) for Co, columns = kh*kw*C, pixels = N*P*Q and
  // resident = the blocks of each weight-gradient tile (large, narrow, thin, small) the GPU
  // holds at once.
  m.def("cutlass_wgrad_plan(int Co, int columns, int pixels, int[] resident) -> int[]");
  m.impl("cutlass_wgrad_plan", [](int64_t Co, int64_t columns, int64_t pixels,
                                  std::vector<int64_t> resident) {
    TORCH_CHECK(resident.size() == 4, "cutlass_wgrad_plan: resident: expected 4 counts "
                "(large, narrow, thin, small tiles), got ", resident.size());
    const plan::WgradTile tile = plan::wgrad_tile(Co, columns);
    const plan::Shape s = plan::shape(tile);
    const int64_t split =
        plan::wgrad_split(tile, Co, columns, pixels, resident[static_cast<int64_t>(tile)]);
    return std::vector<int64_t>{s.rows, s.cols, split};
  });
}
