// The CPU unit's batch tiling rule (bn_relu_conv2d.cpp), declared apart from common.h so that
// csrc/module.cpp, which exports it to Python, does not compile the at::vec headers.
#pragma once

#include <cstdint>

namespace fusedres::cpu {

// Samples per batch tile of the fused unit for a batch of n samples whose activation + output
// take bytes_per_sample each, with a weight of weight_bytes; channels_last: the unit's input is
// channels_last (larger tiles: no layout transposes to keep in cache). Reads FUSEDRES_CPU_TILE_BYTES
// and at::get_num_threads() at every call. Exported to Python as
// fusedres._C.cpu_tile_samples (csrc/module.cpp) for the memory accounting.
int64_t tile_samples(int64_t n, int64_t bytes_per_sample, int64_t weight_bytes,
                     bool channels_last);

}  // namespace fusedres::cpu
