// The CUTLASS kernels' tile table and the weight gradient's split: plain C++ (no CUTLASS, no
// CUDA), so the CPU test extension (csrc/cuda/on_cpu/cutlass_plan.cpp) runs the very rules the
// GPU build runs and the tests hold tools/perfmodel/cuda_sass.py's copy to them.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fusedres::cutlass_conv::plan {

// A block's output tile of the implicit GEMM (rows x columns); fprop.cu and wgrad.cu
// static_assert their ConvTiles against these.
struct Shape {
  int64_t rows;
  int64_t cols;
};

// Which tile; the index into kFprop or kWgrad.
enum class FpropTile : int64_t { large = 0, tall = 1, narrow = 2, thin = 3, small = 4, slim = 5 };
enum class WgradTile : int64_t { large = 0, narrow = 1, thin = 2, small = 3 };

inline constexpr Shape kFprop[6] = {{128, 128}, {256, 64}, {128, 64},
                                    {128, 32},  {64, 64},  {128, 16}};
inline constexpr Shape kWgrad[4] = {{128, 128}, {64, 128}, {32, 64}, {64, 64}};

inline constexpr Shape shape(FpropTile t) { return kFprop[static_cast<int64_t>(t)]; }
inline constexpr Shape shape(WgradTile t) { return kWgrad[static_cast<int64_t>(t)]; }

inline constexpr int64_t tiles(Shape s, int64_t rows, int64_t cols) {
  return (rows + s.rows - 1) / s.rows * ((cols + s.cols - 1) / s.cols);
}

// The forward (GEMM M = N*P*Q pixels, N = Co) on sm_90 and newer: for Co <= 16 the 128 x 16
// tile, for Co <= 32 the 128 x 32 one, where its tiles fill every SM once; for Co <= 64 the
// 256-row tile where its tiles fill every SM at least kTallWaves times, else the 128-row one
// where they fill every SM once; for Co > 64 the 128 x 128 tile where they do; otherwise the
// small one (more blocks for small grids). The tiles as narrow as Co keep the MMAs off columns
// past Co (CIFAR's 16- and 32-channel units; the 128 x 16 one's 2 warps of 64 x 16 each issue
// about 1.5 times the instructions a K chunk of the 128 x 32 one's 4, so a block issues about
// 3/4 as much for the same 128 pixels, by the model).
// The 256 x 64 tile (8 warps of 32 x 64) is the model's pick for ImageNet's 64-channel units on
// sm_90, where the 128 x 64 one's 4 warps issue more per MMA (on sm_80 the two model alike); it
// holds one block an SM, so a grid of few waves loses more to its last one.
inline constexpr int64_t kTallWaves = 4;

// On sm_80 (`major` < 9), for Co > 32: the 64 x 64 tile. Its 4 warps of 32 x 32 issue within
// a K chunk's MMA time there (bound by the tensor cores, by the model, like the larger tiles),
// and its grid has 4 times the 128 x 128 tile's blocks, so the last wave idles less (ImageNet's
// 512@7 unit's 392 large tiles take 2 waves of 216 blocks on an A100's 108 SMs, a tenth of them
// idle; the model's figures: csrc/cuda/cutlass_conv/README.md). On sm_90 it is bound by issue.
inline FpropTile fprop_tile(int64_t M, int64_t Co, int64_t sms, int64_t major) {
  if (major < 9 && Co > shape(FpropTile::thin).cols) return FpropTile::small;
  if (Co <= shape(FpropTile::slim).cols) {
    return tiles(shape(FpropTile::slim), M, Co) >= sms ? FpropTile::slim : FpropTile::small;
  }
  if (Co <= shape(FpropTile::thin).cols) {
    return tiles(shape(FpropTile::thin), M, Co) >= sms ? FpropTile::thin : FpropTile::small;
  }
  if (Co <= shape(FpropTile::narrow).cols) {
    if (tiles(shape(FpropTile::tall), M, Co) >= kTallWaves * sms) return FpropTile::tall;
    if (tiles(shape(FpropTile::narrow), M, Co) >= sms) return FpropTile::narrow;
    return FpropTile::small;
  }
  return tiles(shape(FpropTile::large), M, Co) >= sms ? FpropTile::large : FpropTile::small;
}

// The weight gradient (GEMM M = Co, N = kh*kw*C columns, K = N*P*Q pixels): 64 x 64 for at
// most 64 columns, 32 x 64 (2 warps) for Co <= 32, 64 x 128 for Co <= 64 (no half-empty tile),
// else 128 x 128.
inline WgradTile wgrad_tile(int64_t Co, int64_t columns) {
  if (columns <= shape(WgradTile::small).cols) return WgradTile::small;
  if (Co <= shape(WgradTile::thin).rows) return WgradTile::thin;
  return Co <= shape(WgradTile::narrow).rows ? WgradTile::narrow : WgradTile::large;
}

// Whether the cutlass kernel set takes a unit's weight gradient (with the "store" backward:
// CUTLASS's GEMM has no BatchNorm sums, so the data gradient writes dz into the x gradient and
// one more pass reads it back for dx) or leaves the unit on the native "sums" backward (the
// native weight gradient's epilogue yields the sums). For a 1 x 1 filter the step is bound by
// DRAM and the store plan's extra pass costs more than CUTLASS's faster GEMM saves; for larger
// filters the GEMMs dominate (the model prices both on every unit: benchmarks/GPU_MODEL.md).
inline bool wgrad_on_cutlass(int64_t kh, int64_t kw) { return kh * kw > 1; }

// The pixels are split into slices that run as separate blocks, each writing float32 partials
// that one reduction then adds (parallel split-K: no semaphores, no chain of epilogues waiting
// on each other, and a fixed order of addition). Each slice keeps at least kMinSlicePixels
// pixels (16 K-steps, so the pipeline's 4-stage fill stays a small part of it; at 1,024 a
// CIFAR 64-channel unit's weight gradient, 8,192 pixels on 5 tiles, ran 40 blocks on 108 or
// 132 SMs, and 512 prices its GEMM at 0.6-0.7 of that time; 256 no lower, with more partials
// to add, by the model), at most kMaxSlices slices (256: a CIFAR 16-channel 3 x 3 unit's
// weight gradient is 3 tiles, whose blocks at 64 slices ran one wave of a part-filled H100 with
// long slices; the sum spreads each element's slices over a block's 8 warps, PartialsSum), and
// the partials at most kMaxPartialBytes (a transient buffer of the backward).
inline constexpr int64_t kMinSlicePixels = 512;
inline constexpr int64_t kMaxSlices = 256;
inline constexpr int64_t kMaxPartialBytes = int64_t{64} << 20;

// The split of `pixels` over `tiles` output tiles, `resident` blocks resident on the whole GPU
// at once (occupancy x SMs), `slice_bytes` float32 partial bytes a slice: of the splits the
// limits allow, the one with the fewest waves per slice, cdiv(tiles * split, resident) / split
// (a slice's pixels shrink as 1 / split, the time as the waves), the smallest on ties.
inline int64_t wgrad_split(int64_t tiles, int64_t resident, int64_t pixels, int64_t slice_bytes) {
  tiles = std::max<int64_t>(tiles, 1);
  resident = std::max<int64_t>(resident, 1);
  const int64_t most = std::max<int64_t>(
      1, std::min({kMaxSlices, pixels / kMinSlicePixels,
                   kMaxPartialBytes / std::max<int64_t>(slice_bytes, 1)}));
  int64_t best = 1, best_waves = (tiles + resident - 1) / resident;
  for (int64_t s = 2; s <= most; ++s) {
    const int64_t waves = (tiles * s + resident - 1) / resident;
    if (waves * best < best_waves * s) {  // waves / s < best_waves / best
      best = s;
      best_waves = waves;
    }
  }
  return best;
}

// The split of a Co x columns weight gradient's `pixels` on `tile`, `resident` of its blocks on
// the GPU at once: the rule above with that tile's grid and float32 partials. What wgrad.cu runs
// and what the test extension answers (one call, so the tests check what the GPU build does).
inline int64_t wgrad_split(WgradTile tile, int64_t Co, int64_t columns, int64_t pixels,
                           int64_t resident) {
  return wgrad_split(tiles(shape(tile), Co, columns), resident, pixels,
                     Co * columns * static_cast<int64_t>(sizeof(float)));
}

}  // namespace fusedres::cutlass_conv::plan
