// fusedres._C, the product extension: the CPU kernels (csrc/cpu) and, when built with nvcc
// (FUSEDRES_BUILD_CUDA), the CUDA kernels (csrc/cuda). Importing it runs their static
// TORCH_LIBRARY_IMPL registrations for fusedres_cpu (CPU) and fusedres_cuda (CUDA). The ops'
// schemas are not defined here: fusedres/ops/_extension.py defines the namespaces from
// fusedres/ops/opdefs.py (SCHEMAS) after this module is imported, and the dispatcher then checks
// every C++ function registered here against its schema.
//
// Its one Python function, cpu_tile_samples, gives Python (fusedres/memory/accounting.py) the CPU
// kernels' tile rule instead of a copy of it.
#include <Python.h>

#include <cstdint>
#include <exception>

#include "cpu/tile.h"

namespace {

// cpu_tile_samples(n, bytes_per_sample, weight_bytes, channels_last=False) -> int
PyObject* cpu_tile_samples(PyObject* /*self*/, PyObject* args) {
  long long n = 0, bytes_per_sample = 0, weight_bytes = 0;
  int channels_last = 0;
  if (!PyArg_ParseTuple(args, "LLL|p:cpu_tile_samples", &n, &bytes_per_sample, &weight_bytes,
                        &channels_last)) {
    return nullptr;
  }
  try {
    return PyLong_FromLongLong(
        fusedres::cpu::tile_samples(n, bytes_per_sample, weight_bytes, channels_last != 0));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef methods[] = {
    {"cpu_tile_samples", cpu_tile_samples, METH_VARARGS,
     "cpu_tile_samples(n, bytes_per_sample, weight_bytes, channels_last=False) -> int\n\n"
     "Samples per batch tile of the cpu backend's fused unit (csrc/cpu/bn_relu_conv2d.cpp) for\n"
     "a batch of n samples of bytes_per_sample bytes (activation + output) each and a weight of\n"
     "weight_bytes; channels_last: the unit's input is channels_last. Reads FUSEDRES_CPU_TILE_BYTES, FUSEDRES_CPU_TILE_WEIGHT_X and torch's\n"
     "thread count now."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "fusedres compiled kernels (csrc/cpu, csrc/cuda)", -1, methods};
  return PyModule_Create(&module_def);
}
}
