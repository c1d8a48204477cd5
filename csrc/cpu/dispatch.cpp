// Run-time dispatch of the CPU kernels (the rules: capability.h): the capability tables, the
// choice, and the functions of kernels.h, each forwarding to the chosen copy. Compiled once,
// for the compiler's default target, like the rest of csrc/ outside csrc/cpu/vec/.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

#include "capability.h"
#include "kernels.h"

namespace fusedres::cpu {

// The copies setup.py compiled (it defines FUSEDRES_CPU_HAS_<NAME> for each one above the
// baseline, which is always built).
namespace fusedres_baseline {
extern const KernelTable kernel_table;
}
#if defined(FUSEDRES_CPU_HAS_AVX2)
namespace fusedres_avx2 {
extern const KernelTable kernel_table;
}
#endif
#if defined(FUSEDRES_CPU_HAS_AVX512)
namespace fusedres_avx512 {
extern const KernelTable kernel_table;
}
#endif

namespace {

// Every value FUSEDRES_CPU_CAPABILITY takes (fusedres/settings.py declares the same choices).
const char* const kChoices[] = {"auto", "baseline", "avx2", "avx512"};

struct Capability {
  std::string name;
  const KernelTable* table;
  std::vector<std::string> features;
};

// The built copies, lowest first (capability.h lists their features).
const std::vector<Capability>& capabilities() {
  static const std::vector<Capability> all = [] {
    std::vector<Capability> v;
#if defined(__x86_64__) || defined(_M_X64)
    const std::vector<std::string> base = {"sse3", "ssse3", "sse4.1", "sse4.2", "popcnt"};
    std::vector<std::string> avx2 = base, avx512;
    avx2.insert(avx2.end(), {"avx", "avx2", "fma", "f16c", "bmi", "bmi2"});
    avx512 = avx2;
    avx512.insert(avx512.end(), {"avx512f", "avx512bw", "avx512dq", "avx512vl"});
    v.push_back({"baseline", &fusedres_baseline::kernel_table, base});
#if defined(FUSEDRES_CPU_HAS_AVX2)
    v.push_back({"avx2", &fusedres_avx2::kernel_table, avx2});
#endif
#if defined(FUSEDRES_CPU_HAS_AVX512)
    v.push_back({"avx512", &fusedres_avx512::kernel_table, avx512});
#endif
#else
    v.push_back({"baseline", &fusedres_baseline::kernel_table, {}});
#endif
    return v;
  }();
  return all;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out.empty() ? "(none)" : out;
}

std::vector<std::string> missing_features(const Capability& c,
                                          const std::vector<std::string>& features) {
  std::vector<std::string> out;
  for (const auto& f : c.features) {
    if (std::find(features.begin(), features.end(), f) == features.end()) out.push_back(f);
  }
  return out;
}

// As fusedres/settings.py parses a choice: surrounding blanks dropped, case ignored.
std::string normalised(const std::string& raw) {
  const auto blank = [](unsigned char ch) { return std::isspace(ch) != 0; };
  auto b = std::find_if_not(raw.begin(), raw.end(), blank);
  auto e = std::find_if_not(raw.rbegin(), raw.rend(), blank).base();
  std::string out(b, b < e ? e : b);
  for (char& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return out;
}

const Capability* find(const std::string& name) {
  for (const auto& c : capabilities()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

struct Choice {
  const KernelTable* table = nullptr;
  std::string name, error;
};

const Choice& choice() {
  static const Choice made = [] {
    Choice c;
    const char* pin = std::getenv("FUSEDRES_CPU_CAPABILITY");
    try {
      c.name = choose_capability(pin ? pin : "", cpu_features());
      c.table = find(c.name)->table;
    } catch (const std::invalid_argument& e) {
      c.error = e.what();
    }
    return c;
  }();
  return made;
}

const KernelTable& kernels() {
  const Choice& c = choice();
  TORCH_CHECK(c.table != nullptr, "fusedres cpu kernels: ", c.error);
  return *c.table;
}

}  // namespace

std::vector<CapabilityInfo> built_capabilities() {
  std::vector<CapabilityInfo> out;
  for (const auto& c : capabilities()) out.push_back({c.name, c.features});
  return out;
}

std::vector<std::string> cpu_features() {
  std::vector<std::string> out;
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  // __builtin_cpu_supports takes a string literal only: one line a feature.
#define FUSEDRES_FEATURE(name) \
  if (__builtin_cpu_supports(name)) out.push_back(name)
  FUSEDRES_FEATURE("sse3");
  FUSEDRES_FEATURE("ssse3");
  FUSEDRES_FEATURE("sse4.1");
  FUSEDRES_FEATURE("sse4.2");
  FUSEDRES_FEATURE("popcnt");
  FUSEDRES_FEATURE("avx");
  FUSEDRES_FEATURE("avx2");
  FUSEDRES_FEATURE("fma");
  FUSEDRES_FEATURE("f16c");
  FUSEDRES_FEATURE("bmi");
  FUSEDRES_FEATURE("bmi2");
  FUSEDRES_FEATURE("avx512f");
  FUSEDRES_FEATURE("avx512bw");
  FUSEDRES_FEATURE("avx512dq");
  FUSEDRES_FEATURE("avx512vl");
#undef FUSEDRES_FEATURE
#endif
  return out;
}

std::string choose_capability(const std::string& pin, const std::vector<std::string>& features) {
  const std::string want = normalised(pin);
  const auto& all = capabilities();
  std::vector<std::string> runs, built;
  for (const auto& c : all) {
    built.push_back(c.name);
    if (missing_features(c, features).empty()) runs.push_back(c.name);
  }
  if (want.empty() || want == "auto") {
    if (runs.empty()) {
      throw std::invalid_argument(
          "this CPU lacks " + join(missing_features(all.front(), features)) +
          ", which the lowest capability of fusedres._C's CPU kernels (baseline: x86-64-v2) "
          "needs");
    }
    return runs.back();
  }
  if (std::none_of(std::begin(kChoices), std::end(kChoices),
                   [&](const char* c) { return want == c; })) {
    std::string choices;
    for (const char* c : kChoices) choices += (choices.empty() ? "" : ", ") + std::string(c);
    throw std::invalid_argument("FUSEDRES_CPU_CAPABILITY: expected one of " + choices +
                                ", got '" + pin + "'");
  }
  const Capability* c = find(want);
  if (c == nullptr) {
    throw std::invalid_argument("FUSEDRES_CPU_CAPABILITY=" + want + ": this fusedres._C has no " +
                                want + " kernels (built: " + join(built) +
                                "); unset the variable, or set auto, for the best it has");
  }
  const auto lacking = missing_features(*c, features);
  if (!lacking.empty()) {
    throw std::invalid_argument("FUSEDRES_CPU_CAPABILITY=" + want + ": this CPU lacks " +
                                join(lacking) + " (it runs: " + join(runs) +
                                "); unset the variable, or set auto, for the best it runs");
  }
  return want;
}

const std::string& capability_in_use() {
  const Choice& c = choice();
  if (c.table == nullptr) throw std::runtime_error(c.error);
  return c.name;
}

// ------------------------------------------------------------------ kernels.h, forwarded

std::tuple<at::Tensor, at::Tensor> batch_stats_kernel(const at::Tensor& x, Layout layout) {
  return kernels().batch_stats(x, layout);
}

RowStats::RowStats(int64_t C, int64_t threads, at::ScalarType dtype)
    : impl_(kernels().row_stats(C, threads, dtype)) {}

RowStats::~RowStats() = default;

void bn_relu_kernel(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                    at::Tensor& a, Layout x_layout, Layout a_layout) {
  kernels().bn_relu(x, scale, shift, a, x_layout, a_layout);
}

void bn_relu_backward_reduce_kernel(const at::Tensor& da, const at::Tensor& x,
                                    const at::Tensor& scale, const at::Tensor& shift,
                                    const at::Tensor& mean, const at::Tensor& out_scale,
                                    at::Tensor& sums, at::Tensor* dz_out, Layout layout,
                                    Layout da_layout, bool stream_dz) {
  // The kernel indexes sums by at::get_thread_num() in its parallel_for: a row for every thread,
  // or one where the caller is already in a parallel region (the kernel then runs as thread 0).
  const int64_t rows = at::in_parallel_region() ? 1 : at::get_num_threads();
  TORCH_INTERNAL_ASSERT(sums.dim() == 3 && sums.size(0) >= rows, "backward_reduce: sums has ",
                        sums.size(0), " thread rows, the kernel may run on ", rows);
  kernels().backward_reduce(da, x, scale, shift, mean, out_scale, sums, dz_out, layout, da_layout,
                            stream_dz);
}

void bn_backward_apply_kernel(const at::Tensor& dz, const at::Tensor& x, const at::Tensor& mean,
                              const at::Tensor& k1, const at::Tensor& k2, const at::Tensor& k3,
                              at::Tensor& gx, Layout layout, const at::Tensor* add) {
  kernels().backward_apply(dz, x, mean, k1, k2, k3, gx, layout, add);
}

void transpose_layout_kernel(const at::Tensor& src, at::Tensor& dst, Layout src_layout,
                             const at::Tensor* add) {
  kernels().transpose_layout(src, dst, src_layout, add);
}

}  // namespace fusedres::cpu
