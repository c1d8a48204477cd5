// The CPU execution layer's mma.sync, ldmatrix and cp.async (interface: ../mma.cuh, which gives
// the PTX ISA's fragment layouts these functions implement lane by lane).
#include "runtime.h"

#include <cstring>
#include <sstream>

namespace fusedres_on_cpu {

namespace {

std::string address(const void* p) {
  std::ostringstream s;
  s << p;
  return s.str();
}

template <typename T>
float operand(uint16_t bits) {
  T v;
  std::memcpy(&v, &bits, 2);
  return static_cast<float>(v);
}

uint16_t half_of(uint32_t reg, int which) {
  return static_cast<uint16_t>(which ? reg >> 16 : reg & 0xffffu);
}

struct MmaLane {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
};

}  // namespace

// Every lane's fragments meet in the warp; each lane then computes its own four elements of D
// from the elements the layout puts in the other lanes' registers.
void mma_m16n8k16(bool bf16, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                  const float (&c)[4]) {
  MmaLane mine{};
  std::memcpy(mine.a, a, sizeof(mine.a));
  std::memcpy(mine.b, b, sizeof(mine.b));
  std::memcpy(mine.c, c, sizeof(mine.c));
  MmaLane all[32];
  warp_aligned(bf16 ? "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
                    : "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
               &mine, sizeof(MmaLane), all);
  auto value = [bf16](uint32_t reg, int which) {
    const uint16_t bits = half_of(reg, which);
    return bf16 ? operand<c10::BFloat16>(bits) : operand<c10::Half>(bits);
  };
  // A[row][k]: lane (row % 8) * 4 + (k % 8) / 2, element i = k % 2 + 2 (row >= 8) + 4 (k >= 8).
  auto A = [&](int row, int k) {
    const int i = (k % 2) + 2 * (row >= 8) + 4 * (k >= 8);
    return value(all[(row % 8) * 4 + (k % 8) / 2].a[i / 2], i % 2);
  };
  // B[k][n]: lane n * 4 + (k % 8) / 2, element i = k % 2 + 2 (k >= 8).
  auto B = [&](int k, int n) {
    const int i = (k % 2) + 2 * (k >= 8);
    return value(all[n * 4 + (k % 8) / 2].b[i / 2], i % 2);
  };
  const int lane = static_cast<int>(self().lane);
  const int g = lane / 4, t = lane % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >= 2), col = 2 * t + (i % 2);
    float acc = c[i];
    // Products of 16-bit operands are exact in float32; the sum runs in k order.
    for (int k = 0; k < 16; ++k) acc = std::fma(A(row, k), B(k, col), acc);
    out[i] = acc;
  }
  std::memcpy(d, out, sizeof(out));
}

void ldmatrix(int num, bool trans, uint32_t* r, const void* row) {
  const char* op = num == 1 ? (trans ? "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16"
                                     : "ldmatrix.sync.aligned.m8n8.x1.shared.b16")
                 : num == 2 ? (trans ? "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16"
                                     : "ldmatrix.sync.aligned.m8n8.x2.shared.b16")
                            : (trans ? "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
                                     : "ldmatrix.sync.aligned.m8n8.x4.shared.b16");
  const unsigned char* rows[32];
  const auto* mine = static_cast<const unsigned char*>(row);
  warp_aligned(op, &mine, sizeof(mine), rows);
  // Only lanes 0 .. 8 num - 1 give row addresses; every lane checks them all, so the error
  // does not depend on which lane runs first.
  for (int l = 0; l < 8 * num; ++l) {
    if (reinterpret_cast<std::uintptr_t>(rows[l]) % 16 != 0) {
      device_error(std::string(op) + ": the row address of lane " + std::to_string(l) + " (" +
                   address(rows[l]) + ") is not 16-byte aligned");
    }
    if (!in_shared(rows[l], 16)) {
      device_error(std::string(op) + ": the row address of lane " + std::to_string(l) + " (" +
                   address(rows[l]) + ") is not 16 bytes of the block's shared memory");
    }
  }
  const int lane = static_cast<int>(self().lane);
  auto element = [&](int m, int r_, int c_) {
    uint16_t v;
    std::memcpy(&v, rows[8 * m + r_] + 2 * c_, 2);
    return static_cast<uint32_t>(v);
  };
  for (int m = 0; m < num; ++m) {
    const int a = lane / 4, b = 2 * (lane % 4);
    const uint32_t lo = trans ? element(m, b, a) : element(m, a, b);
    const uint32_t hi = trans ? element(m, b + 1, a) : element(m, a, b + 1);
    r[m] = lo | (hi << 16);
  }
}

void cp_async(const char* op, void* dst, const void* src, unsigned cp_size, int src_size) {
  Thread& t = self();
  const std::string name = std::string(op) + ".shared.global (" + std::to_string(cp_size) + " B)";
  if (cp_size != 4 && cp_size != 8 && cp_size != 16) {
    device_error(name + ": the copy size must be 4, 8 or 16 bytes");
  }
  if (src_size < 0 || static_cast<unsigned>(src_size) > cp_size) {
    device_error(name + ": src-size " + std::to_string(src_size) + " is outside [0, " +
                 std::to_string(cp_size) + "]");
  }
  if (reinterpret_cast<std::uintptr_t>(dst) % cp_size != 0) {
    device_error(name + ": the shared destination " + address(dst) + " is not " +
                 std::to_string(cp_size) + "-byte aligned");
  }
  if (reinterpret_cast<std::uintptr_t>(src) % cp_size != 0) {
    device_error(name + ": the global source " + address(src) + " is not " +
                 std::to_string(cp_size) + "-byte aligned");
  }
  if (!in_shared(dst, cp_size)) {
    device_error(name + ": the destination " + address(dst) + " is not " +
                 std::to_string(cp_size) + " bytes of the block's shared memory");
  }
  AsyncCopy copy{};
  copy.dst = dst;
  copy.bytes = cp_size;
  copy.group = t.committed;
  // The source is read now (a sanitizer sees an out-of-bounds read here); the zero fill past
  // src-size is part of the copy.
  if (src_size > 0) std::memcpy(copy.data, src, static_cast<size_t>(src_size));
  // Until the wait, the destination holds garbage: the copy is in flight.
  std::memset(dst, 0xff, cp_size);
  t.async.push_back(copy);
}

void cp_async_commit() { self().committed++; }

void cp_async_wait(unsigned n) {
  Thread& t = self();
  // Complete the copies of every committed group but the n newest; copies not yet committed
  // to a group are not waited for (PTX: cp.async.wait_group covers committed groups only).
  const unsigned done_below = t.committed > n ? t.committed - n : 0;
  size_t kept = 0;
  for (size_t i = 0; i < t.async.size(); ++i) {
    AsyncCopy& c = t.async[i];
    if (c.group < done_below) {
      std::memcpy(c.dst, c.data, c.bytes);
    } else {
      t.async[kept++] = c;
    }
  }
  t.async.resize(kept);
}

}  // namespace fusedres_on_cpu
