// The CPU execution layer's run time: blocks, barriers, the warp exchange (see runtime.h).
#include "runtime.h"

#include <dlfcn.h>
#include <elf.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <cstdlib>
#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#if defined(FUSEDRES_HOST_THREADS)
#include <thread>
#else
#include <ATen/Parallel.h>
#include <sys/mman.h>
#include <ucontext.h>
#endif

#include "registrations.h"

namespace fusedres_on_cpu {

thread_local Thread* tls_thread = nullptr;

// The host copy's fusedres_cuda registrations (../common.cuh), run by on_cpu/module.cpp.
std::vector<Registration>& registrations() {
  static std::vector<Registration> all;
  return all;
}

namespace {

// A layer error raised in one CUDA thread (it carries the thread's coordinates).
struct DeviceError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Thrown into the other threads of a failed block so that they unwind.
struct Aborted {};

std::string hex(unsigned v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

// A warp collective in progress: the lanes of `mask` meet here. `op` is set for the .aligned
// collectives (mma.sync, ldmatrix), which every lane must reach with the same instruction.
constexpr size_t kMaxValue = 48;
struct Group {
  unsigned mask = 0, arrived = 0, read = 0, ballot = 0;
  bool complete = false;
  const char* op = nullptr;
  unsigned char values[32][kMaxValue];
};

}  // namespace


// ----------------------------------------------------------------------------- static shared

// The static __shared__ variables of the kernels: every function-local static of namespace
// fusedres::cuda_on_cpu (mangled _ZZN8fusedres11cuda_on_cpu..., or _ZZNK8fusedres11cuda_on_cpu...
// inside a const member function) in this module's symbol table,
// thread-local (STT_TLS) in the fibre build, plain statics (STT_OBJECT, writable) in the
// OS-thread build. GCC ignores section attributes on template instantiations' statics, so the
// symbol table is the one place that lists them all. Offsets are relative to a known symbol of
// this file (tls_thread, or smem_anchor), whose address locates the rest at run time.
#if defined(FUSEDRES_HOST_THREADS)
unsigned char smem_anchor[1];
#endif

namespace {

struct SharedVar {
  std::ptrdiff_t offset;  // from the anchor
  size_t size;
};

struct SharedTable {
  std::vector<SharedVar> vars;  // sorted by offset
  std::string error;            // why the table is empty, if it is
};

std::string module_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&run_grid), &info) && info.dli_fname && *info.dli_fname) {
    std::ifstream probe(info.dli_fname, std::ios::binary);
    if (probe) return info.dli_fname;
  }
  return "/proc/self/exe";
}

SharedTable read_shared_table() {
  SharedTable table;
  const std::string path = module_path();
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() < sizeof(Elf64_Ehdr)) {
    table.error = "cannot read " + path;
    return table;
  }
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(bytes.data());
  const auto* sh = reinterpret_cast<const Elf64_Shdr*>(bytes.data() + eh->e_shoff);
#if defined(FUSEDRES_HOST_THREADS)
  const unsigned char want_type = STT_OBJECT;
  const char* anchor = "_ZN15fusedres_on_cpu11smem_anchorE";
#else
  const unsigned char want_type = STT_TLS;
  const char* anchor = "_ZN15fusedres_on_cpu10tls_threadE";
#endif
  // A function-local static's name: _ZZ, then the function's nested name, N, with K for a
  // const member function (PartialsSum::run's group_sums).
  const char* prefixes[] = {"_ZZN8fusedres11cuda_on_cpu", "_ZZNK8fusedres11cuda_on_cpu"};
  bool have_anchor = false;
  Elf64_Addr anchor_value = 0;
  std::vector<std::pair<Elf64_Addr, size_t>> found;
  for (int i = 0; i < eh->e_shnum; ++i) {
    if (sh[i].sh_type != SHT_SYMTAB) continue;
    const auto* syms = reinterpret_cast<const Elf64_Sym*>(bytes.data() + sh[i].sh_offset);
    const char* names = bytes.data() + sh[sh[i].sh_link].sh_offset;
    const size_t n = sh[i].sh_size / sizeof(Elf64_Sym);
    for (size_t j = 0; j < n; ++j) {
      const Elf64_Sym& sym = syms[j];
      if (sym.st_shndx == SHN_UNDEF || sym.st_shndx >= eh->e_shnum) continue;
      const char* name = names + sym.st_name;
      if (std::strcmp(name, anchor) == 0) {
        have_anchor = true;
        anchor_value = sym.st_value;
        continue;
      }
      if (ELF64_ST_TYPE(sym.st_info) != want_type || sym.st_size == 0) continue;
      if (std::none_of(std::begin(prefixes), std::end(prefixes), [&](const char* prefix) {
            return std::strncmp(name, prefix, std::strlen(prefix)) == 0;
          })) {
        continue;
      }
      if (!(sh[sym.st_shndx].sh_flags & SHF_WRITE)) continue;  // __func__ and other constants
      found.emplace_back(sym.st_value, sym.st_size);
    }
  }
  if (!have_anchor) {
    table.error = "no symbol table in " + path + " (stripped?)";
    return table;
  }
  std::sort(found.begin(), found.end());
  found.erase(std::unique(found.begin(), found.end()), found.end());
  for (const auto& [value, size] : found) {
    table.vars.push_back({static_cast<std::ptrdiff_t>(value - anchor_value), size});
  }
  return table;
}

const SharedTable& shared_table() {
  static const SharedTable table = read_shared_table();
  return table;
}

// Address of the anchor symbol for the calling OS thread.
unsigned char* anchor_address() {
#if defined(FUSEDRES_HOST_THREADS)
  return smem_anchor;
#else
  return reinterpret_cast<unsigned char*>(&tls_thread);
#endif
}

// Fills the static shared memory that the calling OS thread's blocks see with 0xff bytes.
void poison_static_shared() {
  const SharedTable& t = shared_table();
  TORCH_CHECK(t.error.empty(), "fusedres cuda host layer: cannot find the kernels' static "
              "__shared__ variables: ", t.error);
  unsigned char* base = anchor_address();
  for (const SharedVar& v : t.vars) std::memset(base + v.offset, 0xff, v.size);
}

bool in_static_shared(const void* p, size_t bytes) {
  const auto* c = static_cast<const unsigned char*>(p);
  const std::ptrdiff_t off = c - anchor_address();
  const auto& vars = shared_table().vars;
  auto it = std::upper_bound(vars.begin(), vars.end(), off,
                             [](std::ptrdiff_t o, const SharedVar& v) { return o < v.offset; });
  if (it == vars.begin()) return false;
  --it;
  return off >= it->offset &&
         off + static_cast<std::ptrdiff_t>(bytes) <= it->offset + static_cast<std::ptrdiff_t>(it->size);
}

}  // namespace

size_t static_shared_bytes() {
  size_t total = 0;
  for (const auto& v : shared_table().vars) total += v.size;
  return total;
}

struct Block {
  BlockInfo info;
  unsigned nthreads = 0;
  std::vector<Thread> threads;
  unsigned live = 0;             // threads that have not exited
  unsigned arrived = 0;          // at the block barrier, this generation
  uint64_t generation = 0;       // barrier releases so far
  int reduce = 0, reduced = 0;   // __syncthreads_count/or/and: running and released values
  unsigned released = 0;         // threads that met at the last released barrier
  std::vector<unsigned> exists;  // per warp: the lanes that are threads of the block
  std::vector<unsigned> exited;  // per warp: lanes that have returned
  std::vector<std::list<Group>> groups;  // per warp: collectives in progress
  uint64_t events = 0;           // arrivals, releases and exits (progress, for deadlocks)
  bool failed = false;
  std::exception_ptr error;
#if defined(FUSEDRES_HOST_THREADS)
  std::mutex mu;
  std::condition_variable cv;
#endif
};

BlockInfo& block_info(const Thread& t) { return t.block->info; }

[[noreturn]] void device_error(const std::string& what) {
  const Thread& t = self();
  const BlockInfo& b = t.block->info;
  std::ostringstream s;
  s << "block (" << b.idx.x << ", " << b.idx.y << ", " << b.idx.z << ") thread (" << t.idx.x
    << ", " << t.idx.y << ", " << t.idx.z << "): " << what;
  throw DeviceError(s.str());
}

namespace {

// Records the block's first error; the other threads unwind at their next wait.
void fail(Block& b, std::exception_ptr e) {
  if (!b.failed) {
    b.failed = true;
    b.error = e;
  }
  b.events++;
}

// ----------------------------------------------------------------------------- scheduling

#if defined(FUSEDRES_HOST_THREADS)

using Lock = std::unique_lock<std::mutex>;
Lock lock(Block& b) { return Lock(b.mu); }
void notify(Block& b) {
  b.events++;
  b.cv.notify_all();
}
constexpr auto kDeadlock = std::chrono::seconds(120);

template <typename Pred>
void wait(Block& b, Lock& lk, const char* where, Pred ready) {
  while (!ready()) {
    if (b.failed) throw Aborted{};
    const uint64_t seen = b.events;
    if (b.cv.wait_for(lk, kDeadlock) == std::cv_status::timeout && b.events == seen &&
        !ready() && !b.failed) {
      device_error(std::string("no progress for 120 s waiting at ") + where +
                   ": deadlock (a barrier or warp collective that not every thread reaches)");
    }
  }
}

#else  // fibres

struct NoLock {};
using Lock = NoLock;
Lock lock(Block&) { return {}; }
void notify(Block& b) { b.events++; }

constexpr size_t kDefaultStack = 256 << 10;

size_t stack_bytes() { return kDefaultStack; }

// A saved execution context and the switch between two. On x86-64 a 20-instruction switch of
// the callee-saved registers (ucontext's swapcontext makes a sigprocmask system call per switch,
// ~10x slower); elsewhere ucontext.
#if defined(__x86_64__)
extern "C" void fusedres_on_cpu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl fusedres_on_cpu_switch
    .hidden fusedres_on_cpu_switch
    .type fusedres_on_cpu_switch, @function
fusedres_on_cpu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fusedres_on_cpu_switch, .-fusedres_on_cpu_switch
)");

struct Context {
  void* sp = nullptr;
  // A fresh context that runs entry() (which must never return) on [stack, stack + size).
  void start(void* stack, size_t size, void (*entry)()) {
    auto top = (reinterpret_cast<std::uintptr_t>(stack) + size) & ~std::uintptr_t(15);
    auto* slot = reinterpret_cast<std::uint64_t*>(top);
    slot[-1] = 0;                                          // entry's return address: none
    slot[-2] = reinterpret_cast<std::uint64_t>(entry);     // popped by ret
    for (int i = 3; i <= 8; ++i) slot[-i] = 0;             // rbp, rbx, r12-r15
    std::uint32_t csr[2];
    asm volatile("stmxcsr %0" : "=m"(csr[0]));
    asm volatile("fnstcw %0" : "=m"(csr[1]));
    std::memcpy(&slot[-9], csr, 8);
    sp = &slot[-9];
  }
};
inline void switch_context(Context& from, Context& to) { fusedres_on_cpu_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
  void start(void* stack, size_t size, void (*entry)()) {
    getcontext(&uc);
    uc.uc_stack.ss_sp = stack;
    uc.uc_stack.ss_size = size;
    uc.uc_link = nullptr;
    makecontext(&uc, entry, 0);
  }
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

struct Fiber {
  Context ctx;
  void* stack = nullptr;
  bool done = true;
  const char* waiting_at = nullptr;
};

// One per OS thread that runs blocks: the fibres' stacks are kept for the next block.
struct Worker {
  Context sched;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  Block* block = nullptr;
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  ~Worker() {
    for (Fiber& f : fibers) {
      if (f.stack) munmap(f.stack, stack_bytes());
    }
  }
  void reserve(unsigned n) {
    if (fibers.size() >= n) return;
    fibers.resize(n);
    for (Fiber& f : fibers) {
      if (f.stack) continue;
      void* p = mmap(nullptr, stack_bytes(), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
      TORCH_CHECK(p != MAP_FAILED, "fusedres cuda host layer: cannot map a fibre stack");
      mprotect(p, 4096, PROT_NONE);  // guard page: an overflow faults instead of corrupting
      f.stack = p;
    }
  }
};

thread_local Worker tls_worker;

template <typename Pred>
void wait(Block& b, Lock&, const char* where, Pred ready) {
  Worker& w = tls_worker;
  while (!ready()) {
    if (b.failed) throw Aborted{};
    w.current->waiting_at = where;
    switch_context(w.current->ctx, w.sched);
    w.current->waiting_at = nullptr;
  }
}

#endif

// Every live thread has arrived at __syncthreads: release them (a new generation) with the
// barrier's reduction (__syncthreads_count/and/or). Called with the block's lock held.
void release_barrier(Block& b) {
  b.released = b.arrived;
  b.arrived = 0;
  b.reduced = b.reduce;
  b.reduce = 0;
  b.generation++;
  notify(b);
}

// A thread returned from the kernel: the barrier and the warp collectives stop counting it.
void thread_exit(Block& b, Thread& t) {
  b.live--;
  b.exited[t.warp] |= 1u << t.lane;
  b.events++;
  if (b.arrived > 0 && b.arrived == b.live) release_barrier(b);
  for (const Group& g : b.groups[t.warp]) {
    if (!g.complete && (g.mask >> t.lane & 1u) && !(g.arrived >> t.lane & 1u) && !b.failed) {
      try {
        device_error("returned while lanes " + hex(g.arrived) + " of its warp wait for it in a "
                     "collective with mask " + hex(g.mask));
      } catch (...) {
        fail(b, std::current_exception());
      }
      notify(b);
    }
  }
}

void run_thread(Block& b, Thread& t, void (*body)(void*), void* ctx) {
  tls_thread = &t;
  try {
    body(ctx);
    if (!t.async.empty()) {
      device_error("returned with " + std::to_string(t.async.size()) + " cp.async copies that "
                   "no cp.async.wait_group completed (their data never lands)");
    }
  } catch (const Aborted&) {
  } catch (...) {
    [[maybe_unused]] Lock lk = lock(b);
    fail(b, std::current_exception());
    notify(b);
  }
  [[maybe_unused]] Lock lk = lock(b);
  thread_exit(b, t);
}

void init_block(Block& b, dim3 grid, dim3 block, uint3 idx, void* smem, size_t smem_bytes) {
  b.info = BlockInfo{idx, block, grid, smem, smem_bytes};
  b.nthreads = block.x * block.y * block.z;
  b.threads.resize(b.nthreads);
  const unsigned warps = (b.nthreads + 31) / 32;
  b.exists.assign(warps, 0);
  b.exited.assign(warps, 0);
  b.groups.assign(warps, {});
  for (unsigned i = 0; i < b.nthreads; ++i) {
    Thread& t = b.threads[i];
    t.idx = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
    t.linear = i;
    t.lane = i % 32;
    t.warp = i / 32;
    t.block = &b;
    b.exists[t.warp] |= 1u << t.lane;
  }
  b.live = b.nthreads;
}

uint3 block_index(dim3 grid, int64_t i) {
  return uint3{static_cast<unsigned>(i % grid.x), static_cast<unsigned>((i / grid.x) % grid.y),
               static_cast<unsigned>(i / (int64_t(grid.x) * grid.y))};
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using SmemBuffer = std::unique_ptr<unsigned char, AlignedFree>;

SmemBuffer alloc_smem(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t rounded = (bytes + 127) / 128 * 128;
  return SmemBuffer(static_cast<unsigned char*>(std::aligned_alloc(128, rounded)));
}

#if !defined(FUSEDRES_HOST_THREADS)
void fiber_entry() {
  Worker& w = tls_worker;
  Block& b = *w.block;
  Thread& t = b.threads[w.current - w.fibers.data()];
  run_thread(b, t, w.body, w.ctx);
  w.current->done = true;
  switch_context(w.current->ctx, w.sched);  // never resumed
  std::abort();
}
#endif

// Runs one block to completion; rethrows its first error.
void run_block(dim3 grid, dim3 block, uint3 idx, void* smem, size_t smem_bytes,
               void (*body)(void*), void* ctx) {
  Block b;
  // Shared memory not written in this block reads as NaN (-1 for integers), not as the values
  // of the block that ran before.
  if (smem_bytes) std::memset(smem, 0xff, smem_bytes);
  poison_static_shared();
  init_block(b, grid, block, idx, smem, smem_bytes);
#if defined(FUSEDRES_HOST_THREADS)
  std::vector<std::thread> threads;
  threads.reserve(b.nthreads);
  for (unsigned i = 0; i < b.nthreads; ++i) {
    threads.emplace_back([&b, i, body, ctx] { run_thread(b, b.threads[i], body, ctx); });
  }
  for (std::thread& th : threads) th.join();
#else
  Worker& w = tls_worker;
  w.reserve(b.nthreads);
  w.block = &b;
  w.body = body;
  w.ctx = ctx;
  for (unsigned i = 0; i < b.nthreads; ++i) {
    Fiber& f = w.fibers[i];
    f.ctx.start(f.stack, stack_bytes(), fiber_entry);
    f.done = false;
  }
  unsigned remaining = b.nthreads;
  while (remaining > 0) {
    const uint64_t events = b.events;
    const unsigned before = remaining;
    for (unsigned i = 0; i < b.nthreads; ++i) {
      Fiber& f = w.fibers[i];
      if (f.done) continue;
      w.current = &f;
      tls_thread = &b.threads[i];
      switch_context(w.sched, f.ctx);
      if (f.done) remaining--;
    }
    if (remaining > 0 && remaining == before && events == b.events && !b.failed) {
      // Every live thread waits and none arrived anywhere: nothing can ever release them.
      std::ostringstream where;
      for (unsigned i = 0; i < b.nthreads; ++i) {
        if (!w.fibers[i].done && w.fibers[i].waiting_at) {
          where << " thread " << i << " at " << w.fibers[i].waiting_at << ";";
        }
      }
      w.current = &w.fibers[0];
      tls_thread = &b.threads[0];
      try {
        throw DeviceError("deadlock: every live thread waits at a barrier or warp collective "
                          "that the others never reach:" + where.str());
      } catch (...) {
        fail(b, std::current_exception());
      }
    }
  }
  w.block = nullptr;
  w.current = nullptr;
#endif
  tls_thread = nullptr;
  if (b.error) std::rethrow_exception(b.error);
}

}  // namespace

// ----------------------------------------------------------------------------- barriers

namespace {
// Returns the number of threads whose pred was non-zero, and in `met` how many met.
int barrier(int pred, unsigned* met = nullptr) {
  Block& b = *self().block;
  [[maybe_unused]] Lock lk = lock(b);
  b.reduce += pred;
  b.arrived++;
  b.events++;
  const uint64_t gen = b.generation;
  if (b.arrived == b.live) {
    release_barrier(b);
  } else {
    wait(b, lk, "__syncthreads", [&] { return b.generation != gen; });
  }
  if (met) *met = b.released;
  return b.reduced;
}
}  // namespace

void syncthreads() { barrier(0); }
int syncthreads_count(int pred) { return barrier(pred != 0); }
int syncthreads_or(int pred) { return barrier(pred != 0) != 0; }
int syncthreads_and(int pred) {
  unsigned met = 0;
  const int count = barrier(pred != 0, &met);
  return count == static_cast<int>(met);
}

unsigned active_mask() {
  Thread& t = self();
  Block& b = *t.block;
  [[maybe_unused]] Lock lk = lock(b);
  return b.exists[t.warp] & ~b.exited[t.warp];
}

namespace {
void exchange(const char* op, unsigned mask, const void* value, size_t size, int src, void* out,
              bool pred, unsigned* ballot, bool aligned, void* all);
}  // namespace

void warp_exchange(const char* op, unsigned mask, const void* value, size_t size, int src,
                   void* out, bool pred, unsigned* ballot) {
  exchange(op, mask, value, size, src, out, pred, ballot, false, nullptr);
}

void warp_aligned(const char* op, const void* value, size_t size, void* all) {
  if (size > kMaxValue) device_error(std::string(op) + ": too many bytes per lane");
  exchange(op, 0xffffffffu, value, size, -1, nullptr, false, nullptr, true, all);
}

bool in_shared(const void* p, size_t bytes) {
  const BlockInfo& b = self().block->info;
  const auto* c = static_cast<const unsigned char*>(p);
  const auto* d = static_cast<const unsigned char*>(b.dynamic_smem);
  if (d != nullptr && c >= d && c + bytes <= d + b.dynamic_smem_bytes) return true;
  return in_static_shared(p, bytes);
}

void check_launch_bounds(const char* kernel, long bound) {
  const BlockInfo& b = self().block->info;
  const long threads = long(b.dim.x) * b.dim.y * b.dim.z;
  if (threads > bound) {
    device_error(std::string(kernel) + " is declared __launch_bounds__(" + std::to_string(bound) +
                 ") but launched with " + std::to_string(threads) + " threads per block (on a "
                 "GPU: cudaErrorInvalidValue, too many resources requested for launch)");
  }
}

namespace {
void exchange(const char* op, unsigned mask, const void* value, size_t size, int src, void* out,
              bool pred, unsigned* ballot, bool aligned, void* all) {
  Thread& t = self();
  Block& b = *t.block;
  const unsigned bit = 1u << t.lane;
  if (!(mask & bit)) {
    device_error(std::string(op) + ": lane " + std::to_string(t.lane) +
                 " is not in its mask " + hex(mask));
  }
  [[maybe_unused]] Lock lk = lock(b);
  if (mask & ~b.exists[t.warp]) {
    device_error(std::string(op) + ": mask " + hex(mask) + " names lanes " +
                 hex(mask & ~b.exists[t.warp]) + " that are not threads of the block");
  }
  if (mask & b.exited[t.warp]) {
    device_error(std::string(op) + ": mask " + hex(mask) + " names lanes " +
                 hex(mask & b.exited[t.warp]) + " that have returned");
  }
  std::list<Group>& groups = b.groups[t.warp];
  Group* g = nullptr;
  for (Group& x : groups) {
    if (!x.complete && x.mask == mask && !(x.arrived & bit)) {
      g = &x;
      break;
    }
  }
  if (g == nullptr) {
    groups.emplace_back();
    g = &groups.back();
    g->mask = mask;
    g->op = aligned ? op : nullptr;
  } else if ((aligned || g->op) && (!aligned || !g->op || std::strcmp(g->op, op) != 0)) {
    device_error(std::string(op) + ": lanes " + hex(g->arrived) + " of the warp wait in " +
                 (g->op ? g->op : "another warp collective") + ": every lane must execute the "
                 "same .aligned instruction");
  }
  if (size) std::memcpy(g->values[t.lane], value, size);
  if (pred) g->ballot |= bit;
  g->arrived |= bit;
  b.events++;
  if (g->arrived == mask) {
    g->complete = true;
    notify(b);
  } else {
    wait(b, lk, op, [g] { return g->complete; });
  }
  if (src >= 0) {
    if (src < 32 && (mask >> src & 1u)) {
      std::memcpy(out, g->values[src], size);
    } else {
      // CUDA: reading a lane that does not take part gives an undefined value. Here all bits
      // set: NaN for floating point, -1 for integers, so that using it shows.
      std::memset(out, 0xff, size);
    }
  }
  if (ballot) *ballot = g->ballot;
  if (all) {
    for (int l = 0; l < 32; ++l) {
      std::memcpy(static_cast<unsigned char*>(all) + l * size, g->values[l], size);
    }
  }
  g->read |= bit;
  if (g->read == mask) {
    for (auto it = groups.begin(); it != groups.end(); ++it) {
      if (&*it == g) {
        groups.erase(it);
        break;
      }
    }
  }
}

}  // namespace

// ----------------------------------------------------------------------------- launch

namespace {
std::mutex attr_mu;
std::unordered_map<const void*, long>& max_dynamic_smem() {
  static std::unordered_map<const void*, long> m;
  return m;
}
}  // namespace

bool set_max_dynamic_smem(const void* fn, long bytes) {
  if (bytes < 0 || static_cast<size_t>(bytes) > kMaxSmemOptIn) return false;
  std::lock_guard<std::mutex> lk(attr_mu);
  max_dynamic_smem()[fn] = bytes;
  return true;
}

std::atomic<int64_t>& launch_count() {
  static std::atomic<int64_t> count{0};
  return count;
}

std::atomic<bool>& launch_stub() {
  static std::atomic<bool> stub{false};
  return stub;
}

void run_grid(const char* kernel, const void* fn, dim3 grid, dim3 block, size_t smem,
              void (*body)(void*), void* ctx) {
  const int64_t threads = int64_t(block.x) * block.y * block.z;
  TORCH_CHECK(threads >= 1 && threads <= 1024 && block.z <= 64,
              "fusedres cuda host layer: launch of ", kernel, ": block (", block.x, ", ",
              block.y, ", ", block.z, ") is not a valid CUDA block (1 to 1024 threads, z <= 64)");
  TORCH_CHECK(grid.x >= 1 && grid.y >= 1 && grid.z >= 1 && grid.y <= 65535 && grid.z <= 65535,
              "fusedres cuda host layer: launch of ", kernel, ": grid (", grid.x, ", ", grid.y,
              ", ", grid.z, ") is not a valid CUDA grid");
  TORCH_CHECK(smem <= kMaxSmemOptIn, "fusedres cuda host layer: launch of ", kernel, ": ", smem,
              " bytes of dynamic shared memory exceed the ", kMaxSmemOptIn, " bytes (163 KiB) "
              "a block may have on sm_80");
  if (smem > kDefaultSmem) {
    long allowed = 0;
    {
      std::lock_guard<std::mutex> lk(attr_mu);
      auto it = max_dynamic_smem().find(fn);
      if (it != max_dynamic_smem().end()) allowed = it->second;
    }
    TORCH_CHECK(static_cast<long>(smem) <= allowed, "fusedres cuda host layer: launch of ",
                kernel, ": ", smem, " bytes of dynamic shared memory exceed the 48 KiB default "
                "without the opt-in (cudaFuncSetAttribute(kernel, "
                "cudaFuncAttributeMaxDynamicSharedMemorySize, ", smem, ") allows ", allowed,
                " bytes): on a GPU the launch fails");
  }
  const int64_t blocks = int64_t(grid.x) * grid.y * grid.z;
  launch_count().fetch_add(1, std::memory_order_relaxed);
  if (launch_stub().load(std::memory_order_relaxed)) return;  // checked, counted, not run
  try {
#if defined(FUSEDRES_HOST_THREADS)
    SmemBuffer buffer = alloc_smem(smem);
    for (int64_t i = 0; i < blocks; ++i) {
      run_block(grid, block, block_index(grid, i), buffer.get(), smem, body, ctx);
    }
#else
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      SmemBuffer buffer = alloc_smem(smem);
      for (int64_t i = begin; i < end; ++i) {
        run_block(grid, block, block_index(grid, i), buffer.get(), smem, body, ctx);
      }
    });
#endif
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fusedres cuda host layer: kernel ", kernel, " failed: ", e.what());
  }
}

}  // namespace fusedres_on_cpu
