// fusedres._C, the product extension: the CPU kernels (csrc/cpu) and, when built with nvcc
// (FUSEDRES_BUILD_CUDA), the CUDA kernels (csrc/cuda). Importing it runs their static
// TORCH_LIBRARY_IMPL registrations for fusedres_cpu (CPU) and fusedres_cuda (CUDA). The ops'
// schemas are not defined here: fusedres/ops/_extension.py defines the namespaces from
// fusedres/ops/opdefs.py (SCHEMAS) after this module is imported, and the dispatcher then checks
// every C++ function registered here against its schema.
//
// Its Python functions give Python the CPU kernels' own rules instead of copies of them:
// cpu_tile_samples, the tile rule (fusedres/memory/accounting.py), and the CPU capability the
// kernels run with and how it was chosen (csrc/cpu/capability.h; fusedres.cpu_capability).
#include <Python.h>

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/capability.h"
#include "cpu/tile.h"

// Declared here, outside the file's anonymous namespace: inside it the name would declare a
// second, internal fusedres::cutlass_conv that nothing defines.
#if defined(FUSEDRES_WITH_CUTLASS)
namespace fusedres::cutlass_conv {
int64_t launches();  // csrc/cuda/cutlass_conv/fprop.cu
}
#endif

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

PyObject* str_list(const std::vector<std::string>& items) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(items.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < items.size(); ++i) {
    PyObject* s = PyUnicode_FromString(items[i].c_str());
    if (s == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SetItem(list, static_cast<Py_ssize_t>(i), s);  // steals s (the limited API)
  }
  return list;
}

// cpu_capability() -> str
PyObject* cpu_capability(PyObject* /*self*/, PyObject* /*args*/) {
  try {
    return PyUnicode_FromString(fusedres::cpu::capability_in_use().c_str());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// cpu_capabilities() -> list[tuple[str, list[str]]]
PyObject* cpu_capabilities(PyObject* /*self*/, PyObject* /*args*/) {
  const auto built = fusedres::cpu::built_capabilities();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(built.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < built.size(); ++i) {
    PyObject* features = str_list(built[i].features);
    PyObject* item = features ? Py_BuildValue("(sN)", built[i].name.c_str(), features) : nullptr;
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SetItem(list, static_cast<Py_ssize_t>(i), item);  // steals item
  }
  return list;
}

// cpu_features() -> list[str]
PyObject* cpu_features(PyObject* /*self*/, PyObject* /*args*/) {
  return str_list(fusedres::cpu::cpu_features());
}

// choose_cpu_capability(pin, features) -> str
PyObject* choose_cpu_capability(PyObject* /*self*/, PyObject* args) {
  const char* pin = nullptr;
  PyObject* seq = nullptr;
  if (!PyArg_ParseTuple(args, "sO:choose_cpu_capability", &pin, &seq)) return nullptr;
  // Python's stable ABI only (setup.py builds this module with Py_LIMITED_API): no
  // PySequence_Fast_* macros.
  const Py_ssize_t n = PySequence_Size(seq);
  if (n < 0) return nullptr;
  std::vector<std::string> features;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_GetItem(seq, i);  // new references, both
    PyObject* utf8 = item ? PyUnicode_AsUTF8String(item) : nullptr;  // (AsUTF8: 3.13's API)
    const char* f = utf8 ? PyBytes_AsString(utf8) : nullptr;
    if (f != nullptr) features.emplace_back(f);
    Py_XDECREF(utf8);
    Py_XDECREF(item);
    if (f == nullptr) return nullptr;
  }
  try {
    return PyUnicode_FromString(fusedres::cpu::choose_capability(pin, features).c_str());
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

// cuda_kernel_sets() -> list[str]
PyObject* cuda_kernel_sets(PyObject* /*self*/, PyObject* /*args*/) {
#if defined(FUSEDRES_WITH_CUTLASS)
  return str_list({"native", "cutlass"});
#else
  return str_list({"native"});
#endif
}

// cutlass_launches() -> int
PyObject* cutlass_launches(PyObject* /*self*/, PyObject* /*args*/) {
#if defined(FUSEDRES_WITH_CUTLASS)
  return PyLong_FromLongLong(fusedres::cutlass_conv::launches());
#else
  return PyLong_FromLongLong(0);
#endif
}

PyMethodDef methods[] = {
    {"cpu_tile_samples", cpu_tile_samples, METH_VARARGS,
     "cpu_tile_samples(n, bytes_per_sample, weight_bytes, channels_last=False) -> int\n\n"
     "Samples per batch tile of the cpu backend's fused unit (csrc/cpu/bn_relu_conv2d.cpp) for\n"
     "a batch of n samples of bytes_per_sample bytes (activation + output) each and a weight of\n"
     "weight_bytes; channels_last: the unit's input is channels_last. Reads FUSEDRES_CPU_TILE_BYTES and torch's\n"
     "thread count now."},
    {"cpu_capability", cpu_capability, METH_NOARGS,
     "cpu_capability() -> str\n\n"
     "The CPU capability the cpu backend's kernels run with (baseline, avx2 or avx512), chosen\n"
     "when this module was loaded: FUSEDRES_CPU_CAPABILITY's, or the best this CPU supports.\n"
     "RuntimeError (why) when the variable names one this CPU or this build lacks."},
    {"cpu_capabilities", cpu_capabilities, METH_NOARGS,
     "cpu_capabilities() -> list[(name, features)]\n\n"
     "The capabilities compiled into this module, lowest first, each with the CPU features it\n"
     "needs (__builtin_cpu_supports's names; setup.py compiles it with -m<feature> for each)."},
    {"cpu_features", cpu_features, METH_NOARGS,
     "cpu_features() -> list[str]\n\n"
     "This CPU's features among those the capabilities need."},
    {"choose_cpu_capability", choose_cpu_capability, METH_VARARGS,
     "choose_cpu_capability(pin, features) -> str\n\n"
     "The rule cpu_capability() applies, for a pin (FUSEDRES_CPU_CAPABILITY's value; '' or\n"
     "'auto': the best) and a CPU with the given features; ValueError saying why none."},
    {"cuda_kernel_sets", cuda_kernel_sets, METH_NOARGS,
     "cuda_kernel_sets() -> list[str]\n\n"
     "The values of FUSEDRES_CUDA_KERNELS this build's cuda backend honours: 'native', and\n"
     "'cutlass' where it was built with the CUTLASS kernels (csrc/cuda/cutlass_conv)."},
    {"cutlass_launches", cutlass_launches, METH_NOARGS,
     "cutlass_launches() -> int\n\n"
     "The CUTLASS kernels (csrc/cuda/cutlass_conv) launched in this process so far: 0 in a build\n"
     "without them. `fusedres selftest` reads it to show that a cuda:cutlass case ran one."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  // The capability is chosen (FUSEDRES_CPU_CAPABILITY read) now, at load; an error is kept and
  // raised by cpu_capability() and by every kernel call.
  try {
    fusedres::cpu::capability_in_use();
  } catch (const std::exception&) {
  }
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "fusedres compiled kernels (csrc/cpu, csrc/cuda)", -1, methods};
  return PyModule_Create(&module_def);
}
}
