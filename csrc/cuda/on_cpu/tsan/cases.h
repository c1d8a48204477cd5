// The ThreadSanitizer driver's registry of cases (driver.cpp). A case runs kernels of the host
// copy (built with FUSEDRES_HOST_THREADS: one OS thread per CUDA thread) on small shapes and
// checks their results; ThreadSanitizer watches every access. Add a case in any .cpp file of
// this folder:
//
//   #include "cases.h"
//   FUSEDRES_TSAN_CASE(my_kernel_small) {
//     at::Tensor x = at::randn({2, 3, 5, 7});
//     auto y = fusedres::cuda_on_cpu::my_op(x);            // declared in csrc/cuda/ops.h
//     fusedres_tsan::expect_close(y, reference(x), 1e-5, 1e-5, "my_op");
//   }
//
// FUSEDRES_TSAN_DEMO registers a deliberately broken case (a race, a wrong mask) that `all`
// skips: tests run it by name to prove the sanitizer and the layer catch it.
#pragma once

#include "../../common.cuh"
#include "../../ops.h"

#include <string>
#include <vector>

namespace fusedres_tsan {

struct Case {
  const char* name;
  void (*run)();
  bool in_all;
};

std::vector<Case>& registry();

struct Register {
  Register(const char* name, void (*run)(), bool in_all) {
    registry().push_back({name, run, in_all});
  }
};

// Throws a c10::Error naming `what` when got and want differ beyond atol + rtol * |want|.
void expect_close(const at::Tensor& got, const at::Tensor& want, double atol, double rtol,
                  const std::string& what);

}  // namespace fusedres_tsan

#define FUSEDRES_TSAN_REGISTER(name, in_all)                                    \
  static void fusedres_tsan_case_##name();                                      \
  static ::fusedres_tsan::Register fusedres_tsan_register_##name(#name,         \
      fusedres_tsan_case_##name, in_all);                                       \
  static void fusedres_tsan_case_##name()

#define FUSEDRES_TSAN_CASE(name) FUSEDRES_TSAN_REGISTER(name, true)
#define FUSEDRES_TSAN_DEMO(name) FUSEDRES_TSAN_REGISTER(name, false)
