// The tile list of a grouped GEMM, built on the device from the expert segments (no host
// synchronisation, so a launch can be captured in a CUDA graph with segment sizes that change
// between replays).
//
// Expert e owns rows [lo[e], hi[e]) (expert_offsets, or all rows of a single expert when there are
// none). The offsets are device data the host cannot check, so they are made safe here: clamped
// to [0, rows] and made non-decreasing (lo[e] is the largest clamped offset up to e, hi[e] =
// lo[e + 1]), so the segments never overlap, sum to at most `rows` and the tile count stays
// within the host's bound however the array is broken; a valid array passes unchanged. its tiles are m_tiles(e) = ceil((hi - lo) / kRows) row
// tiles times n_tiles column tiles, numbered expert by expert, row tiles fastest: CTAs that run at
// the same time share an expert's weight tile (it stays in L2 while its row tiles pass). A CTA
// builds the per-expert tile prefix in shared memory once (a block scan), then finds the expert of
// a tile id by binary search. Empty experts own no tiles.
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <cuda/functional>

#include "kernels/common/device_check.cuh"
#include "kernels/moe/grouped_gemm_params.h"

namespace tessera::kernels::moe {

struct GroupedTile {
  int expert;
  int row0, row_end;  // rows [row0, min(row0 + kRows, row_end)) of a / out
  int col0;           // first w row (output column) of the tile's column tile
  int row_tiles;      // the segment's row tiles (1: this tile is the whole segment)
};

template <int kRows, int kThreads>
struct GroupedTiles {
  static constexpr int kPerThread = (kMaxGemmExperts + kThreads - 1) / kThreads;
  // Shared memory: lo[E], hi[E], prefix[E + 1].
  static constexpr int kSmemBytes = (3 * kMaxGemmExperts + 1) * int(sizeof(int));
  using Scan = cub::BlockScan<int, kThreads>;

  int* lo;
  int* hi;
  int* prefix;
  int num_experts, n_tiles, cols_per_tile;

  __device__ GroupedTiles(int* smem, int experts, int n_tiles_, int cols_per_tile_)
      : lo(smem), hi(smem + kMaxGemmExperts), prefix(smem + 2 * kMaxGemmExperts), num_experts(experts),
        n_tiles(n_tiles_), cols_per_tile(cols_per_tile_) {}

  // Called by all kThreads threads; `scan` is the CUB scan's temporary storage. Ends with a CTA
  // barrier.
  __device__ void build(const int32_t* offsets, int64_t rows, typename Scan::TempStorage& scan) {
    auto clamp = [rows](int32_t x) { return int(x < 0 ? 0 : int64_t(x) > rows ? rows : x); };
    // lo[e] = max(clamp(offsets[0..e])): an inclusive max-scan (no offsets: one expert owning
    // every row, a dense layer such as a shared expert).
    int starts[kPerThread];
#pragma unroll
    for (int q = 0; q < kPerThread; ++q) {
      const int e = threadIdx.x * kPerThread + q;
      starts[q] = offsets != nullptr && e < num_experts ? clamp(offsets[e]) : 0;
    }
    Scan(scan).InclusiveScan(starts, starts, cuda::maximum<int>{});
    int counts[kPerThread];
#pragma unroll
    for (int q = 0; q < kPerThread; ++q) {
      const int e = threadIdx.x * kPerThread + q;
      counts[q] = 0;
      if (e < num_experts) {
        const int a = starts[q];
        const int b = offsets != nullptr ? max(a, clamp(offsets[e + 1])) : int(rows);
        lo[e] = a;
        hi[e] = b;
        counts[q] = (b - a + kRows - 1) / kRows * n_tiles;
      }
    }
    __syncthreads();  // the scan's temporary storage is reused
    int total;
    Scan(scan).ExclusiveSum(counts, counts, total);
#pragma unroll
    for (int q = 0; q < kPerThread; ++q) {
      const int e = threadIdx.x * kPerThread + q;
      if (e < num_experts) prefix[e] = counts[q];
    }
    if (threadIdx.x == 0) prefix[num_experts] = total;
    __syncthreads();
  }

  __device__ int count() const { return prefix[num_experts]; }

  // With the device checks compiled in, a broken offsets array is reported (a trap) rather than
  // made safe; called by one warp (the Hopper kernel's producer: see device_check.cuh, QUIET).
  __device__ static __forceinline__ void check_offsets(const int32_t* offsets, int64_t rows, int experts, int lane) {
    if (offsets == nullptr) return;
    for (int e = lane; e < experts; e += 32) {
      TESSERA_DEVICE_CHECK_QUIET(offsets[e] >= 0 && offsets[e] <= offsets[e + 1] && int64_t(offsets[e + 1]) <= rows,
                           "expert_offsets is not non-decreasing within [0, rows]");
    }
  }

  // Tile `id` < count(): the last expert whose prefix is <= id (empty experts share their
  // successor's prefix and are skipped by taking the last).
  __device__ GroupedTile at(int id) const {
    int first = 0, last = num_experts - 1;
    while (first < last) {
      const int mid = (first + last + 1) / 2;
      if (prefix[mid] <= id) first = mid;
      else last = mid - 1;
    }
    const int e = first;
    const int local = id - prefix[e];
    const int m_tiles = (hi[e] - lo[e] + kRows - 1) / kRows;
    const int n = local / m_tiles;
    const int m = local - n * m_tiles;
    return GroupedTile{e, lo[e] + m * kRows, hi[e], n * cols_per_tile, m_tiles};
  }
};

}  // namespace tessera::kernels::moe
