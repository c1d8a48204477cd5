// fusedres._C: a Python module with no Python API of its own. Importing it runs the static
// TORCH_LIBRARY_IMPL registrations in csrc/cpu and csrc/cuda (fusedres_cpu and fusedres_cuda).
// The ops' schemas are not defined here: fusedres/_extension.py defines the namespaces from
// fusedres/opdefs.py (SCHEMAS) after this module is imported, and the dispatcher then checks
// every C++ function registered here against its schema.
#include <Python.h>

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "fusedres compiled kernels", -1, nullptr};
  return PyModule_Create(&module_def);
}
}
