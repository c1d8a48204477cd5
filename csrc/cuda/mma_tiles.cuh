// A warp's tile of m16n8k16 accumulators, shared by the mma.sync kernels (the forward's, the data
// and weight gradients'): zeroed, fed one 16-deep K step from shared memory, written back to
// shared memory for the epilogue. acc[i][j] is the m16n8 tile of rows 16 i, columns 8 j of the
// warp's tile; its element r is row lane / 4 + 8 (r / 2), column 2 (lane % 4) + (r % 2)
// (mma.cuh's C/D layout). Plain CUDA, compiled by nvcc and by the host compiler (mma.cuh).
#pragma once

#include <cstdint>

#include "mma.cuh"

namespace fusedres::FUSEDRES_CUDA_NS {

template <int FM, int FN>
__device__ __forceinline__ void zero_acc(float (&acc)[FM][FN][4]) {
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;
}

// The A fragments of rows wm + 16 i (ldmatrix.x4 of the row-major As) and the B fragments of
// columns wn + 16 j (ldmatrix.x4.trans of the row-major Bs: n8 tiles 2 j and 2 j + 1; FB = FN / 2)
// at K offset kk; lr, lc: this lane's row and column in an x4 load.
template <int FM, int FB, int AST, int BST>
__device__ __forceinline__ void load_frags(uint32_t (&fa)[FM][4], uint32_t (&fb)[FB][4],
                                           const uint16_t (*As)[AST], const uint16_t (*Bs)[BST],
                                           int wm, int wn, int kk, int lr, int lc) {
#pragma unroll
  for (int i = 0; i < FM; ++i) ptx::ldmatrix<4>(fa[i], &As[wm + 16 * i + lr][kk + lc]);
#pragma unroll
  for (int j = 0; j < FB; ++j) {
    ptx::ldmatrix<4, true>(fb[j], &Bs[kk + lr][wn + 16 * j + lc]);
  }
}

// acc[i][j] += A tile i x B tile j for every (i, j), B as load_frags gives it.
template <typename E, int FM, int FN>
__device__ __forceinline__ void mma_tiles(float (&acc)[FM][FN][4], const uint32_t (&fa)[FM][4],
                                          const uint32_t (&fb)[FN / 2][4]) {
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j) {
      const uint32_t b[2] = {fb[j / 2][2 * (j % 2)], fb[j / 2][2 * (j % 2) + 1]};
      float d[4];
      ptx::mma_m16n8k16<E>(d, fa[i], b, acc[i][j]);
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = d[r];
    }
}

// The accumulators into shared rows of LD floats, the warp's tile at (row0, col0).
template <int FM, int FN, int LD>
__device__ __forceinline__ void store_acc(float (*dst)[LD], const float (&acc)[FM][FN][4],
                                          int row0, int col0, int lane) {
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        dst[row0 + 16 * i + lane / 4 + 8 * (r / 2)][col0 + 8 * j + 2 * (lane % 4) + r % 2] =
            acc[i][j][r];
      }
}

// Stage a BK x BN chunk of the B operand (rows of 16-byte pieces) into Bs by cp.async: piece
// e = tid + q * THREADS is row e / (BN / 8), columns (e % (BN / 8)) * 8 on; src(r, n) gives its
// source, or nullptr for zeros (then `base`, a valid address, is read for 0 bytes). A thin tile
// has fewer pieces than threads (B_PIECES < THREADS): the first B_PIECES threads copy one each.
template <typename T, typename W, typename Src>
__device__ __forceinline__ void stage_b(uint16_t (*Bs)[T::BST], int tid, const W* base,
                                        Src&& src) {
#pragma unroll
  for (int q = 0; q < T::B_COPIES; ++q) {
    const int e = tid + q * T::THREADS, r = e / (T::BN / 8), n = (e % (T::BN / 8)) * 8;
    if (T::B_PIECES < T::THREADS && e >= T::B_PIECES) break;
    const W* p = src(r, n);
    ptx::cp_async_cg16(&Bs[r][n], p != nullptr ? p : base, p != nullptr ? 16 : 0);
  }
}

// The mma.sync forward's and data gradient's tile columns for n channels on the output side (the
// forward's Co, the data gradient's C): the narrowest of 16, 32 and 64 that holds n, else 64;
// and their K chunk for k reduced channels (the forward's C, the data gradient's Co): 16 where
// the tile is 16 columns and k <= 16 (a 32-deep chunk would be half zeros), else 32.
// tools/perfmodel/cuda_sass.py (mma_cols, mma_depth) prices the same rules.
inline int64_t mma_cols(int64_t n) { return n <= 16 ? 16 : n <= 32 ? 32 : 64; }
inline int64_t mma_depth(int64_t n, int64_t k) { return mma_cols(n) == 16 && k <= 16 ? 16 : 32; }

}  // namespace fusedres::FUSEDRES_CUDA_NS
