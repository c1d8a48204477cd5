// The CPU-executed copy of csrc/cuda/batch_stats.cu (see ../common.cuh).
#include "../batch_stats.cu"
