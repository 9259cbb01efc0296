// The mask band (mask.cuh) applied to a warp's accumulator tile of S (register_tile.cuh): keys
// outside a row's band at -inf. Every family masks through this one function.
//
// Branch-free on purpose: each of the lane's two rows turns the band into its key range once,
// and each element is then two compares and a select. MaskBand::visible per element compiled
// into a branch and a convergence barrier per element; in the Hopper hd128 1K causal kernel that
// code held 26% of the warp samples (ncu source counters, notes/prefill_hopper.md v7).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/attention/common/mask.cuh"
#include "kernels/attention/common/register_tile.cuh"

namespace tessera::kernels {

// The tile's columns are keys [n0, n0 + kCols) and lane = the lane in the warp; query_row(tile_row,
// r) is the query row of this lane's row r (tile row tile_row = g or g + 8 of its 16 rows).
template <int kCols, typename QueryRow>
__device__ __forceinline__ void mask_outside_band_of(AccTile<kCols>& s, const MaskBand& band, int n0, int lane,
                                                     QueryRow query_row) {
  const int g = lane / 4, t = lane % 4;
  // Row r's visible keys, relative to this lane's first column of block 0 (n0 + 2t).
  int begin[2], end[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = query_row(AccTile<kCols>::row(2 * r, g), r);
    begin[r] = band.key_begin(row) - n0 - 2 * t;
    end[r] = band.key_end(row) - n0 - 2 * t;
  }
  for_each(s, [&](float& x, int r, int j, int e) {
    const int c = 8 * j + (e & 1);  // AccTile::col(j, e, t) - 2t: a constant
    x = (c >= begin[r]) & (c < end[r]) ? x : -INFINITY;
  });
}

// The tile's 16 rows are tile rows [row0, row0 + 16), tile row r being the request's query row
// r >> row_shift (packed GQA: 2^row_shift heads a token).
template <int kCols>
__device__ __forceinline__ void mask_outside_band(AccTile<kCols>& s, const MaskBand& band, int row0, int n0, int lane,
                                                  int row_shift = 0) {
  mask_outside_band_of(s, band, n0, lane, [&](int tile_row, int) { return (row0 + tile_row) >> row_shift; });
}

// The lane's two rows (g and g + 8) are the query rows rows[0] and rows[1]: any mapping (the decode
// kernel's rows are query tokens x GQA heads of any group size).
template <int kCols>
__device__ __forceinline__ void mask_outside_band(AccTile<kCols>& s, const MaskBand& band, const int (&rows)[2], int n0,
                                                  int lane) {
  mask_outside_band_of(s, band, n0, lane, [&](int, int r) { return rows[r]; });
}

}  // namespace tessera::kernels
