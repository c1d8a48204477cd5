// Which copy of the CPU kernels runs (csrc/cpu/dispatch.cpp), as ATen's DispatchStub picks its
// own: csrc/cpu/vec/ is compiled once per capability, and the best one the CPU supports is
// chosen once, when fusedres._C is loaded, unless FUSEDRES_CPU_CAPABILITY names one. Plain C++
// (no ATen): csrc/module.cpp exports these to Python.
//
// Capabilities, lowest first, each needing the features of the one before (x86-64):
//   baseline  x86-64-v2: sse3 ssse3 sse4.1 sse4.2 popcnt   (at::vec's generic code)
//   avx2      + avx avx2 fma f16c bmi bmi2                  (at::vec's AVX2 code)
//   avx512    + avx512f avx512bw avx512dq avx512vl          (at::vec's AVX-512 code)
// Elsewhere (aarch64) only baseline is built, with no feature required. Feature names are
// __builtin_cpu_supports's; setup.py compiles each copy with -m<feature> for exactly these
// (cpu_capabilities() there; tests/test_cpu_capability.py compares the two lists).
//
// A pinned capability that this CPU or this build lacks is an error, not a fallback: the pin
// is how a test or a CI run says which code it means to exercise, and a run that quietly took
// another capability would pass on code it never ran. The error reaches Python when the cpu
// backend is asked for (fusedres.backends.cpu.unavailable_reason) and from every kernel call.
#pragma once

#include <string>
#include <vector>

namespace fusedres::cpu {

struct CapabilityInfo {
  std::string name;
  std::vector<std::string> features;  // what the CPU must support to run this copy
};

// The capabilities compiled into this extension, lowest first.
std::vector<CapabilityInfo> built_capabilities();

// The features of this CPU among those any capability needs (cpuid, through
// __builtin_cpu_supports, which also checks that the OS saves the AVX and AVX-512 registers).
std::vector<std::string> cpu_features();

// The capability to run for `pin` (FUSEDRES_CPU_CAPABILITY's value; empty or "auto": the best
// one built that a CPU with `features` supports). Throws std::invalid_argument, naming the
// variable and what was expected, for an unknown value, a capability not built, one the CPU
// lacks, or a CPU below the baseline.
std::string choose_capability(const std::string& pin, const std::vector<std::string>& features);

// The capability in use: choose_capability(FUSEDRES_CPU_CAPABILITY, cpu_features()), evaluated
// once (csrc/module.cpp's initialiser calls it, so the variable is read when fusedres._C is
// loaded). Throws std::runtime_error with choose_capability's message when there is none.
const std::string& capability_in_use();

}  // namespace fusedres::cpu
