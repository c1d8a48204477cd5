// fusedres._C_cuda_on_cpu, the test extension (built with FUSEDRES_BUILD_TEST_EXT=1: `make test`,
// `make tsan`, CI; never by `pip install .`): the CUDA kernels of csrc/cuda compiled by the host
// compiler through the CPU execution layer (runtime.cpp), registered as the CPU kernels of
// fusedres_cuda, plus the layer's own test ops (fusedres_cuda_layer_test, layer_tests.cpp) and
// the kernels' test hooks (fusedres_cuda_testing). It links against libtorch only, not against
// fusedres._C. fusedres/backends/cuda.py imports it (FUSEDRES_CUDA_ON_CPU=1) after
// fusedres.ops._extension has defined the fusedres_cuda schemas.
#include <Python.h>
#include <torch/library.h>

#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "registrations.h"

extern "C" {
PyMODINIT_FUNC PyInit__C_cuda_on_cpu(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C_cuda_on_cpu",
      "fusedres test extension: csrc/cuda executed on CPU (fusedres_cuda ops, CPU key)", -1,
      nullptr};
  // The dispatcher checks each function against the schema already defined and throws on a
  // mismatch; the libraries are then destroyed, which undoes the registrations made before it.
  // One library per dispatch key (a library registers for its own key only).
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  if (libraries.empty()) {
    try {
      std::vector<std::unique_ptr<torch::Library>> libs;
      std::vector<c10::DispatchKey> keys;
      for (const auto& reg : fusedres_on_cpu::registrations()) {
        size_t i = 0;
        while (i < keys.size() && keys[i] != reg.key) ++i;
        if (i == keys.size()) {
          keys.push_back(reg.key);
          libs.push_back(std::make_unique<torch::Library>(
              torch::Library::IMPL, "fusedres_cuda", reg.key, __FILE__, __LINE__));
        }
        reg.fn(*libs[i]);
      }
      libraries = std::move(libs);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      PyErr_SetString(PyExc_ImportError,
                      ("fusedres._C_cuda_on_cpu: registering the fusedres_cuda kernels failed (an "
                       "extension built from other sources? rebuild it): " +
                       what.substr(0, what.find("\nException raised from")))
                          .c_str());
      return nullptr;
    }
  }
  return PyModule_Create(&module_def);
}
}
