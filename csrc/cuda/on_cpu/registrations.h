// The host copy's fusedres_cuda registrations: every FUSEDRES_CUDA_LIBRARY_IMPL block of the
// kernel files (../common.cuh) adds its function here as the test extension's shared objects
// load; on_cpu/module.cpp runs them from its PyInit, one torch::Library per dispatch key (CPU for
// the kernels, AutogradCPU for the eager routes' autograd nodes).
#pragma once

#include <c10/core/DispatchKey.h>

#include <vector>

namespace torch {
class Library;
}

namespace fusedres_on_cpu {

struct Registration {
  c10::DispatchKey key;
  void (*fn)(torch::Library&);
};

// Every registration of the host copy, in load order (runtime.cpp).
std::vector<Registration>& registrations();

inline bool add_registration(c10::DispatchKey key, void (*fn)(torch::Library&)) {
  registrations().push_back({key, fn});
  return true;
}

}  // namespace fusedres_on_cpu
