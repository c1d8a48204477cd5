// The ThreadSanitizer driver: runs the registered cases (cases.h) through the host copy of the
// CUDA kernels with one OS thread per CUDA thread. Built and run by `python -m tools.cuda_tsan`
// (make tsan). Usage: driver [all | list | <case>...]; exit status 1 when a case fails (and
// ThreadSanitizer's exit code, 66, when it reported anything).
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>

#include "cases.h"

namespace fusedres_tsan {

std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double atol, double rtol,
                  const std::string& what) {
  TORCH_CHECK(got.sizes() == want.sizes(), what, ": shape ", got.sizes(), " != ", want.sizes());
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const at::Tensor bad = ((g - w).abs() > atol + rtol * w.abs()) & ~(g.isnan() & w.isnan());
  TORCH_CHECK(!bad.any().item<bool>(), what, ": ", bad.sum().item<int64_t>(), " of ",
              got.numel(), " values differ; max abs error ",
              (g - w).abs().nan_to_num(0.0).max().item<double>());
}

}  // namespace fusedres_tsan

int main(int argc, char** argv) {
  at::set_num_threads(1);  // libtorch's own threads are not instrumented: keep them out
  using fusedres_tsan::registry;
  std::vector<const char*> wanted(argv + 1, argv + argc);
  if (wanted.empty()) wanted.push_back("all");
  if (wanted.size() == 1 && std::strcmp(wanted[0], "list") == 0) {
    for (const auto& c : registry()) std::printf("%s%s\n", c.name, c.in_all ? "" : " (demo)");
    return 0;
  }
  int failures = 0, ran = 0;
  for (const auto& c : registry()) {
    bool run = false;
    for (const char* w : wanted) {
      run |= (std::strcmp(w, "all") == 0 && c.in_all) || std::strcmp(w, c.name) == 0;
    }
    if (!run) continue;
    ++ran;
    const auto start = std::chrono::steady_clock::now();
    try {
      c.run();
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("ok   %s (%.1f s)\n", c.name, s);
    } catch (const std::exception& e) {
      std::printf("FAIL %s: %s\n", c.name, e.what());
      ++failures;
    }
    std::fflush(stdout);
  }
  if (ran == 0) {
    std::printf("no case matched; `list` shows them\n");
    return 2;
  }
  std::printf("%d cases, %d failed\n", ran, failures);
  return failures ? 1 : 0;
}
