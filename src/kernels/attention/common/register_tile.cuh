// A warp's accumulator tile of 16 rows x kCols fp32 values in registers, and the row operations
// the online softmax is written in (ThunderKittens' rt_fl with row_max / exp2 / mul_row).
//
// The layout is that of the mma.sync m16n8 accumulator and of one warp's 16 rows of a wgmma
// m64nN accumulator, so one tile type serves both families: lane l (g = l / 4, t = l % 4) holds
// rows g and g + 8, and in every 8-column block j the columns 8j + 2t and 8j + 2t + 1:
//   v[j][0], v[j][1]: row g      v[j][2], v[j][3]: row g + 8
// A full row is spread over the 4 lanes of a quad (same g), so row reductions end with two
// shuffles. The row index r in {0, 1} below names this lane's two rows (g and g + 8).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/attention/common/log2_math.cuh"
#include "kernels/common/pack_half2.cuh"

namespace tessera::kernels {

template <int kColsT>
struct AccTile {
  static constexpr int kCols = kColsT;
  static constexpr int kBlocks = kCols / 8;  // 8-column blocks
  static_assert(kCols % 8 == 0, "whole 8-column blocks");
  float v[kBlocks][4];

  // Column within the tile of element (block j, element e) for lane t = lane % 4.
  __device__ static int col(int j, int e, int t) { return 8 * j + 2 * t + (e & 1); }
  // Row within the warp's 16 rows of element e for lane g = lane / 4.
  __device__ static int row(int e, int g) { return g + (e < 2 ? 0 : 8); }
};

template <int kCols>
__device__ __forceinline__ void fill(AccTile<kCols>& tile, float x) {
#pragma unroll
  for (int j = 0; j < AccTile<kCols>::kBlocks; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) tile.v[j][e] = x;
}

// f(value, r, j, e) for every element (r: this lane's row 0 or 1).
template <int kCols, typename F>
__device__ __forceinline__ void for_each(AccTile<kCols>& tile, F f) {
#pragma unroll
  for (int j = 0; j < AccTile<kCols>::kBlocks; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(tile.v[j][e], e / 2, j, e);
}

// The maximum over the quad of lanes that shares a row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// op over leaf(0) .. leaf(kN - 1) as a balanced tree (kN a power of two), fully unrolled.
template <int kN, typename Leaf, typename Op>
__device__ __forceinline__ float tree_reduce(Leaf leaf, Op op) {
  static_assert(kN > 0 && (kN & (kN - 1)) == 0, "a power of two");
  if constexpr (kN == 1) {
    return leaf(0);
  } else {
    return op(tree_reduce<kN / 2>(leaf, op), tree_reduce<kN / 2>([&](int j) { return leaf(j + kN / 2); }, op));
  }
}

// max(m, max of row r) over whole rows (reduced over the quad), the blocks taken in column order.
template <int kCols>
__device__ __forceinline__ float row_max(const AccTile<kCols>& tile, int r, float m) {
#pragma unroll
  for (int j = 0; j < AccTile<kCols>::kBlocks; ++j) m = fmaxf(m, fmaxf(tile.v[j][2 * r], tile.v[j][2 * r + 1]));
  return quad_max(m);
}

// row_max with the blocks reduced as a balanced tree: a dependency chain of log2(kBlocks) instead
// of kBlocks maxima (prefill_portable.md v10).
template <int kCols>
__device__ __forceinline__ float row_max_tree(const AccTile<kCols>& tile, int r, float m) {
  auto lane_max = [&](int j) { return fmaxf(tile.v[j][2 * r], tile.v[j][2 * r + 1]); };
  m = fmaxf(m, tree_reduce<AccTile<kCols>::kBlocks>(lane_max, [](float a, float b) { return fmaxf(a, b); }));
  return quad_max(m);
}

// m[r] = max(m[r], max of row r): whole rows (reduced over the quad).
template <int kCols>
__device__ __forceinline__ void row_max(const AccTile<kCols>& tile, float (&m)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) m[r] = row_max(tile, r, m[r]);
}

// s[r] += sum of this lane's elements of row r (a partial sum: quad_sum completes it).
template <int kCols>
__device__ __forceinline__ void row_sum_partial(const AccTile<kCols>& tile, float (&s)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float x = 0.f;
#pragma unroll
    for (int j = 0; j < AccTile<kCols>::kBlocks; ++j) x += tile.v[j][2 * r] + tile.v[j][2 * r + 1];
    s[r] += x;
  }
}

// This lane's sum of row r with the blocks added as a balanced tree (a partial sum: quad_sum
// completes it).
template <int kCols>
__device__ __forceinline__ float row_sum_tree(const AccTile<kCols>& tile, int r) {
  return tree_reduce<AccTile<kCols>::kBlocks>([&](int j) { return tile.v[j][2 * r] + tile.v[j][2 * r + 1]; },
                                              [](float a, float b) { return a + b; });
}

// Row r times f[r].
template <int kCols>
__device__ __forceinline__ void mul_row(AccTile<kCols>& tile, const float (&f)[2]) {
#pragma unroll
  for (int j = 0; j < AccTile<kCols>::kBlocks; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) tile.v[j][e] *= f[e / 2];
}

// x = 2^(x * scale - offset[r]) in place: one FFMA and one EX2 per element.
template <int kCols>
__device__ __forceinline__ void exp2_row(AccTile<kCols>& tile, float scale, const float (&offset)[2]) {
#pragma unroll
  for (int j = 0; j < AccTile<kCols>::kBlocks; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) tile.v[j][e] = exp2_approx(fmaf(tile.v[j][e], scale, -offset[e / 2]));
}

// x = 2^(x * scale - offset) in place on row r only.
template <int kCols>
__device__ __forceinline__ void exp2_row(AccTile<kCols>& tile, int r, float scale, float offset) {
#pragma unroll
  for (int j = 0; j < AccTile<kCols>::kBlocks; ++j)
#pragma unroll
    for (int e = 2 * r; e < 2 * r + 2; ++e) tile.v[j][e] = exp2_approx(fmaf(tile.v[j][e], scale, -offset));
}

// exp2_row on row r, returning this lane's sum of the new values added one by one in column order
// (a partial sum: quad_sum completes it).
template <int kCols>
__device__ __forceinline__ float exp2_row_sum(AccTile<kCols>& tile, int r, float scale, float offset) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < AccTile<kCols>::kBlocks; ++j) {
#pragma unroll
    for (int e = 2 * r; e < 2 * r + 2; ++e) {
      tile.v[j][e] = exp2_approx(fmaf(tile.v[j][e], scale, -offset));
      sum += tile.v[j][e];
    }
  }
  return sum;
}

// Columns [16k, 16k + 16) of the tile in T as the A operand of an m16 x k16 product (mma.sync
// m16n8k16, or this warp's rows of wgmma's register A): the accumulator layout of two 8-column
// blocks is the A fragment's, so P goes from the S accumulators to the next product directly.
//   a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
template <typename T, int kCols>
__device__ __forceinline__ void a_fragment(const AccTile<kCols>& tile, int k, uint32_t (&a)[4]) {
  a[0] = pack_half2<T>(tile.v[2 * k][0], tile.v[2 * k][1]);
  a[1] = pack_half2<T>(tile.v[2 * k][2], tile.v[2 * k][3]);
  a[2] = pack_half2<T>(tile.v[2 * k + 1][0], tile.v[2 * k + 1][1]);
  a[3] = pack_half2<T>(tile.v[2 * k + 1][2], tile.v[2 * k + 1][3]);
}

// The whole tile as T A-operand fragments, one per 16 columns.
template <typename T, int kCols>
struct AFragments {
  static_assert(kCols % 16 == 0, "whole k16 slices");
  uint32_t a[kCols / 16][4];
};
template <typename T, int kCols>
__device__ __forceinline__ void convert(const AccTile<kCols>& tile, AFragments<T, kCols>& out) {
#pragma unroll
  for (int k = 0; k < kCols / 16; ++k) a_fragment<T>(tile, k, out.a[k]);
}

}  // namespace tessera::kernels
