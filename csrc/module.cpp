// fusedres._C: a Python module with no Python API of its own. Importing it runs the static
// TORCH_LIBRARY registrations below and in csrc/cpu, csrc/cuda; the ops are then reached as
// torch.ops.fusedres_cpu.* and torch.ops.fusedres_cuda.* (fusedres/backends/*.py).
#include <Python.h>
#include <torch/library.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "fusedres compiled kernels", -1, nullptr};
  return PyModule_Create(&module_def);
}
}

// One schema per op, the same as fusedres/ops.py (the public ops route to these by backend).
#define FUSEDRES_DEFINE_OPS(m)                                                                \
  m.def("batch_stats(Tensor x) -> (Tensor, Tensor)");                                         \
  m.def(                                                                                      \
      "bn_relu_conv2d(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, "             \
      "Tensor? bn_bias, Tensor mean, Tensor invstd, Tensor? residual, SymInt[2] stride, "     \
      "SymInt[2] padding, SymInt[2] dilation) -> Tensor");                                    \
  m.def(                                                                                      \
      "bn_relu_conv2d_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? bn_weight, " \
      "Tensor? bn_bias, Tensor mean, Tensor invstd, SymInt[2] stride, SymInt[2] padding, "    \
      "SymInt[2] dilation, bool batch_stats, bool[5] output_mask) -> "                        \
      "(Tensor, Tensor, Tensor, Tensor, Tensor)");

TORCH_LIBRARY(fusedres_cpu, m) { FUSEDRES_DEFINE_OPS(m) }
TORCH_LIBRARY(fusedres_cuda, m) {
  FUSEDRES_DEFINE_OPS(m)
  // The forward with its output's per-channel (mean, biased var): the conv epilogue reduces them.
  m.def(
      "bn_relu_conv2d_genstats(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, "
      "Tensor? bn_bias, Tensor mean, Tensor invstd, Tensor? residual, SymInt[2] stride, "
      "SymInt[2] padding, SymInt[2] dilation) -> (Tensor, Tensor, Tensor)");
}
