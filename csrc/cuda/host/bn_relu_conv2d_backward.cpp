// The CPU-executed copy of csrc/cuda/bn_relu_conv2d_backward.cu (see ../common.cuh).
#include "../bn_relu_conv2d_backward.cu"
