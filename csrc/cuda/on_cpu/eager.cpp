// The CPU-executed copy of csrc/cuda/eager.cu (see ../common.cuh).
#include "../eager.cu"
