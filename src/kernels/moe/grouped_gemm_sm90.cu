// Hopper (sm_90a) grouped GEMM of the MoE layer: out = a w[e]^T over every expert's row segment,
// one persistent launch, TMA loads into an mbarrier ring, wgmma products, warp specialisation.
//
// A CTA is one producer warpgroup (one warp issues the TMA copies) and two consumer warpgroups;
// a tile is kTokenRows rows of `a` against kWeightRows rows of the expert's weights, over K in
// 64-wide steps (one 128-byte swizzle row). Two shapes (notes/moe.md):
//   - many rows per expert (compute-bound): 128 token rows (64 per consumer) x 256 weight rows,
//     wgmma A = the token tile, B = the weight tile, 3 stages of 48 KB; each consumer's output rows
//     leave through a shared-memory tile and TMA stores that overlap its next tile's products;
//   - few rows per expert (decode; weight-bandwidth-bound): the product is swapped, C^T = W a^T,
//     wgmma A = 128 weight rows (64 per consumer), B = a token tile of 16 / 32 / 64 rows (wgmma's
//     N), 8 stages, so each touched expert's weights stream once with little wasted work.
// Both operands are K-major (a [rows, K], w [E, N, K]), the layout wgmma reads without transposes.
// Segments come from expert_offsets on the device (grouped_tiles.cuh): any alignment; rows of a
// tile beyond its expert's segment are computed from whatever rows follow and never stored.
// The SwiGLU epilogue reads the gate and up rows of the same output columns in one tile (two TMA
// boxes per step) so that silu(g) * u is formed in registers (swapped: through shared memory,
// the gate rows being one consumer's and the up rows the other's).
// Gathered rows (a_row_index: moe_permute's permuted_token, so fused_moe needs no permuted copy of
// x): a's tile cannot be one TMA box, and a box per row would be request-bound (the copy engine
// serves about one box per 50 ns per SM: 128 rows a stage would take 6 us where the products take
// ~0.7), so the producer warpgroup's four warps copy it with 16-byte cp.async (GatheredRows).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/once_per_device.h"
#include "kernels/common/cp_async.cuh"
#include "kernels/common/tensor_map_encode.h"
#include "kernels/moe/grouped_gemm_params.h"
#include "kernels/common/pack_half2.cuh"
#include "kernels/common/tma_sm90.cuh"
#include "kernels/common/warp_uniform.cuh"
#include "kernels/common/wgmma_sm90.cuh"
#include "kernels/moe/swiglu.cuh"
#include "kernels/moe/grouped_tiles.cuh"
#include "tessera/error.h"

namespace tessera::kernels::moe {
namespace {
using namespace tessera::kernels::sm90;

template <bool kSwapT, int kTokenRowsT, int kWeightRowsT, int kStagesT, GemmEpilogue kEpilogueT,
          bool kStoreViaSmemT, bool kGatherT>
struct GemmSm90Config {
  static constexpr bool kSwap = kSwapT;             // wgmma's A operand is the weight tile
  static constexpr bool kGather = kGatherT;         // a's rows through a_row_index (cp.async)
  // Not swapped: a consumer's 64 full rows go out through shared memory and TMA stores that run
  // on while it starts the next tile (partial row tiles: straight from registers).
  static constexpr bool kStoreViaSmem = kStoreViaSmemT;
  static_assert(!kStoreViaSmem || !kSwap, "the swapped shape stores from registers");
  static constexpr int kTokenRows = kTokenRowsT;    // rows of `a` per tile
  static constexpr int kWeightRows = kWeightRowsT;  // rows of w per tile (gate + up with SwiGLU)
  static constexpr int kStages = kStagesT;
  static constexpr bool kSwiGLU = kEpilogueT == GemmEpilogue::kSwiGLU;
  static constexpr int kBlockK = 64;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kARows = kSwap ? kWeightRows : kTokenRows;  // 64 per consumer warpgroup
  static constexpr int kAccCols = kSwap ? kTokenRows : kWeightRows;  // wgmma's N
  static constexpr int kOutCols = kSwiGLU ? kWeightRows / 2 : kWeightRows;  // output columns per tile
  static constexpr int kWeightBoxRows = kSwiGLU ? kWeightRows / 2 : kWeightRows;  // one box, or gate and up
  static_assert(kARows == 64 * kConsumers, "each consumer warpgroup owns 64 rows of wgmma's A");
  static_assert(kWeightBoxRows <= 256 && kTokenRows <= 256, "a TMA box is at most 256 rows");
  static_assert(!kSwap || !kSwiGLU || kWeightBoxRows == 64, "swapped SwiGLU: one consumer's gate rows, the other's up rows");
  static constexpr int kProducerRegisters = 40;  // (the gathering warps too, without spills: GatheredRows)
  static constexpr int kConsumerRegisters = 232;
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * 128 * kConsumers <= 65536, "register file");
};

template <typename T, typename C>
struct GemmSm90Smem {
  using XTile = Sw128Tile<T, C::kTokenRows, C::kBlockK>;  // rows of a
  using WTile = Sw128Tile<T, C::kWeightRows, C::kBlockK>;  // rows of w
  using Tiles = GroupedTiles<C::kTokenRows, C::kThreads>;
  using OutTile = Sw128Tile<T, 64, C::kOutCols>;  // one consumer's rows of the output tile
  static constexpr int kStageBytes = XTile::kBytes + WTile::kBytes;
  static constexpr int kTmaBytes = C::kGather ? WTile::kBytes : kStageBytes;  // what TMA brings a stage
  static constexpr int kOutOffset = C::kStages * kStageBytes;
  static constexpr int kOutBytes = C::kStoreViaSmem ? C::kConsumers * OutTile::kBytes : 0;
  // Swapped SwiGLU: the up consumer's accumulators for the gate consumer (padded rows: fewer bank
  // conflicts).
  static constexpr int kExchangeStride = C::kTokenRows + 4;
  static constexpr int kExchangeBytes = C::kSwap && C::kSwiGLU ? 64 * kExchangeStride * 4 : 0;
  static constexpr int kExchangeOffset = kOutOffset + kOutBytes;
  static constexpr int kBarrierOffset = kExchangeOffset + kExchangeBytes;
  struct Barriers {
    Mbarrier full[C::kStages], empty[C::kStages];
  };
  static constexpr int kTilesOffset = kBarrierOffset + int(sizeof(Barriers));
  static constexpr int kScanOffset = kTilesOffset + Tiles::kSmemBytes;
  static constexpr int kAlignment = 1024;  // of the swizzled tiles
  static constexpr int kBytes = kScanOffset + int(sizeof(typename Tiles::Scan::TempStorage)) + kAlignment;
  static_assert(kBytes <= 227 * 1024, "shared memory of one sm_90 block");

  unsigned char* base;
  __device__ explicit GemmSm90Smem(unsigned char* raw)
      : base(reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + kAlignment - 1) &
                                              ~uintptr_t(kAlignment - 1))) {}
  __device__ XTile x(int stage) const { return XTile{base + stage * kStageBytes}; }
  __device__ WTile w(int stage) const { return WTile{base + stage * kStageBytes + XTile::kBytes}; }
  __device__ OutTile out(int consumer) const { return OutTile{base + kOutOffset + consumer * OutTile::kBytes}; }
  __device__ float* exchange() const { return reinterpret_cast<float*>(base + kExchangeOffset); }
  __device__ Barriers& barriers() const { return *reinterpret_cast<Barriers*>(base + kBarrierOffset); }
  __device__ int* tiles() const { return reinterpret_cast<int*>(base + kTilesOffset); }
  __device__ typename Tiles::Scan::TempStorage& scan() const {
    return *reinterpret_cast<typename Tiles::Scan::TempStorage*>(base + kScanOffset);
  }
};

struct GemmSm90Params {
  GroupedGemmParams base;
  CUtensorMap x_map;  // a: dims (K, rows), box 64 x kTokenRows
  CUtensorMap w_map;  // w: dims (K, N, E), box 64 x kWeightBoxRows x 1
  CUtensorMap out_map;  // out: dims (output columns, rows), box 64 x 64 (kStoreViaSmem only)
  int n_tiles;        // column tiles per expert
  int k_blocks;       // 64-wide K steps
};

// Gathered rows of a (C::kGather): the producer warpgroup's 128 threads copy a tile's K step,
// kTokenRows rows of 128 bytes, into Sw128Tile's layout, each row by kThreadsPerRow threads (2 for
// 64 and 128 rows, so a warp instruction reads 16 rows' 32-byte sectors; 4 for 32, 8 for 16) and
// each thread kRowsPerThread rows (2 for 128, else 1). Chunk c of row r sits at r x 128 +
// (c ^ r % 8) x 16 of the 1024-byte aligned tile. The rows are looked up once per tile; rows past
// the segment (the next expert's, never stored), indices outside [0, a_rows) and K past k are
// zero-filled by the copies themselves (no source bytes), so they read nothing. The copies land
// on the stage's full barrier through one cp.async.mbarrier.arrive.noinc a thread; they write
// through the generic proxy, so the consumers fence before their wgmma reads; and they refill a
// stage whose last reader was wgmma, which the consumers released after its completion (wgmma
// completion orders its reads before later generic writes, as in GatheredKVSm90).
template <typename T, typename C>
struct GatheredRows {
  static constexpr int kThreads = 128;
  static constexpr int kThreadsPerRow = C::kTokenRows >= 64 ? 2 : kThreads / C::kTokenRows;
  static constexpr int kRowsPerThread = C::kTokenRows * kThreadsPerRow / kThreads;
  static constexpr int kChunksPerRow = C::kBlockK / 8 / kThreadsPerRow;  // this thread's 16-byte chunks of a row
  static constexpr int kRowStride = kThreads / kThreadsPerRow;
  static_assert(kRowsPerThread * kRowStride == C::kTokenRows && kChunksPerRow >= 1, "the tile's rows and chunks");
  // This thread's rows of a, or -1: zeros. (Indices, and addresses formed per K step by one
  // XOR a copy: with per-row pointers and per-copy addresses held, the producer's 40 registers
  // spilled 8-40 bytes.)
  int index[kRowsPerThread];
  int chunk0;

  __device__ GatheredRows(const GemmSm90Params& p, const GroupedTile& t, int thread) : chunk0(thread % kThreadsPerRow) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = t.row0 + thread / kThreadsPerRow + kRowStride * i;
      const int at = row < t.row_end ? p.base.a_row_index[row] : -1;
      index[i] = at >= 0 && at < p.base.a_rows ? at : -1;
    }
  }
  __device__ void copy(const GemmSm90Params& p, const typename GemmSm90Smem<T, C>::XTile& tile, int k0, int thread) const {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = thread / kThreadsPerRow + kRowStride * i;
      // chunk0 < kThreadsPerRow (a power of two) and chunk j's offset is a multiple of it: c =
      // chunk0 | kThreadsPerRow j, so (c ^ row % 8) x 16 = row's swizzle ^ chunk0 x 16 ^ an immediate.
      const uint32_t dst = (smem_u32(tile.base) + row * 128 + (row % 8) * 16) ^ (chunk0 * 16);
      const T* src = static_cast<const T*>(p.base.a) + int64_t(max(index[i], 0)) * p.base.a_stride + k0 + 8 * chunk0;
#pragma unroll
      for (int j = 0; j < kChunksPerRow; ++j) {
        const int c = chunk0 + kThreadsPerRow * j;
        const bool valid = index[i] >= 0 && k0 + 8 * c < p.base.k;  // k % 8 == 0: chunks wholly in or out
        // Invalid: no source bytes, the address only has to be a legal one (a's base).
        cp_async_16(dst ^ (kThreadsPerRow * j * 16), valid ? src + 8 * kThreadsPerRow * j : p.base.a, valid);
      }
    }
  }
};

struct NoGatheredRows {
  __device__ NoGatheredRows(const GemmSm90Params&, const GroupedTile&, int) {}
};

// The producer: every tile's K steps; warp 0 issues a's box and w's box (or gate and up boxes) per
// stage by TMA, or with gathered rows w's boxes while all four warps copy a's rows.
template <typename T, typename C>
__device__ void gemm_producer(const GemmSm90Params& p, const GemmSm90Smem<T, C>& smem,
                              const typename GemmSm90Smem<T, C>::Tiles& tiles) {
  using Smem = GemmSm90Smem<T, C>;
  const int thread = threadIdx.x, lane = thread % 32;
  const bool issuer = thread == 0;
  auto& bar = smem.barriers();
  RingPosition<C::kStages> ring;
  if (issuer) {
    if constexpr (!C::kGather) prefetch_tensor_map(&p.x_map);
    prefetch_tensor_map(&p.w_map);
  }
  if (thread < 32) {
    GroupedTiles<C::kTokenRows, C::kThreads>::check_offsets(p.base.offsets, p.base.rows, p.base.num_experts, lane);
  }
  const int half_n = p.base.n / 2;
  for (int id = blockIdx.x; id < tiles.count(); id += gridDim.x) {
    const GroupedTile t = tiles.at(id);
    [[maybe_unused]] const std::conditional_t<C::kGather, GatheredRows<T, C>, NoGatheredRows> rows(p, t, thread);
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      const int s = ring.stage;
      bar.empty[s].wait(ring.phase ^ 1);
      Mbarrier* full = &bar.full[s];
      const int k0 = kb * C::kBlockK;
      if (issuer) {
        full->arrive_expect_tx(Smem::kTmaBytes);
        if constexpr (!C::kGather) tma_load_2d(&p.x_map, full, smem.x(s).base, k0, t.row0);
        tma_load_3d(&p.w_map, full, smem.w(s).base, k0, t.col0, t.expert);
        if constexpr (C::kSwiGLU) {
          tma_load_3d(&p.w_map, full, smem.w(s).base + C::kWeightBoxRows * 128, k0, half_n + t.col0, t.expert);
        }
      }
      if constexpr (C::kGather) {
        rows.copy(p, smem.x(s), k0, thread);
        full->arrive_after_copies();
      }
      __syncwarp();
      ring.advance();
    }
  }
}

// A consumer warpgroup: its 64 rows of wgmma's A against all of B, over the K steps, then the
// epilogue from registers.
template <typename T, typename C>
struct GemmConsumer {
  using Smem = GemmSm90Smem<T, C>;
  const GemmSm90Params& p;
  const Smem& smem;
  const int consumer;  // 0 or 1
  const int warp, lane;
  RingPosition<C::kStages> ring;

  __device__ GemmConsumer(const GemmSm90Params& p_, const Smem& smem_, int consumer_)
      : p(p_), smem(smem_), consumer(consumer_), warp(threadIdx.x / 32 % 4), lane(threadIdx.x % 32) {}

  __device__ void mainloop(AccTile<C::kAccCols>& acc) {
    auto& bar = smem.barriers();
    const int k_blocks = p.k_blocks;
    int previous = -1;
    for (int kb = 0; kb < k_blocks; ++kb) {
      const int s = ring.stage;
      bar.full[s].wait(ring.phase);
      // Gathered rows came through the generic proxy (cp.async): ordered before wgmma's reads.
      if constexpr (C::kGather) fence_async_shared();
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < C::kBlockK / 16; ++k) {
        uint64_t a_desc, b_desc;
        if constexpr (C::kSwap) {
          a_desc = smem.w(s).k_major(64 * consumer, k);
          b_desc = smem.x(s).k_major(0, k);
        } else {
          a_desc = smem.x(s).k_major(64 * consumer, k);
          b_desc = smem.w(s).k_major(0, k);
        }
        wgmma_ss<T, C::kAccCols, gmma::Major::K>(a_desc, b_desc, acc, kb > 0 || k > 0);
      }
      wgmma_commit();
      // The previous step's products are done once at most this one is in flight: its stage
      // goes back to the producer.
      wgmma_wait<1>();
      if (previous >= 0) bar.empty[previous].arrive_if(lane == 0);
      previous = s;
      ring.advance();
    }
    wgmma_wait<0>();
    fence_registers(acc);
    bar.empty[previous].arrive_if(lane == 0);
  }

  // A tile none of whose rows are this warpgroup's: its stages are released unread, and the other
  // consumer has the tensor cores alone (see the caller for when).
  __device__ void skip_tile() {
    auto& bar = smem.barriers();
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      bar.full[ring.stage].wait(ring.phase);
      bar.empty[ring.stage].arrive_if(lane == 0);
      ring.advance();
    }
  }

  // Not swapped: this lane's rows are token rows, its columns weight rows.
  __device__ void store(const AccTile<C::kAccCols>& acc, const GroupedTile& t) const {
    T* out = static_cast<T*>(p.base.out);
    const int g = lane / 4, q = lane % 4;
    const int out_cols = C::kSwiGLU ? p.base.n / 2 : p.base.n;
    constexpr int kBlocks = AccTile<C::kAccCols>::kBlocks;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = t.row0 + 64 * consumer + 16 * warp + g + 8 * r;
      if (row >= t.row_end) continue;
      T* out_row = out + int64_t(row) * p.base.out_stride;
      if constexpr (C::kSwiGLU) {
#pragma unroll
        for (int j = 0; j < kBlocks / 2; ++j) {
          const int col = t.col0 + 8 * j + 2 * q;
          if (col >= out_cols) continue;
          const float g0 = acc.v[j][2 * r], g1 = acc.v[j][2 * r + 1];
          const float u0 = acc.v[j + kBlocks / 2][2 * r], u1 = acc.v[j + kBlocks / 2][2 * r + 1];
          *reinterpret_cast<uint32_t*>(out_row + col) = pack_half2<T>(swiglu(g0, u0), swiglu(g1, u1));
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBlocks; ++j) {
          const int col = t.col0 + 8 * j + 2 * q;
          if (col >= out_cols) continue;
          *reinterpret_cast<uint32_t*>(out_row + col) = pack_half2<T>(acc.v[j][2 * r], acc.v[j][2 * r + 1]);
        }
      }
    }
  }

  // Not swapped, this consumer's 64 rows all inside the segment: the rows go into its output
  // tile in shared memory (the 128-byte swizzle the map names: 16-byte chunk (col / 8) ^ (row % 8)
  // of the row, so the 8 row groups of a warp's 4-byte writes hit 32 different banks), then one
  // thread stores it with TMA, which runs on while the consumer starts its next tile.
  __device__ void store_via_smem(const AccTile<C::kAccCols>& acc, const GroupedTile& t) const {
    const typename Smem::OutTile tile = smem.out(consumer);
    const bool leader = threadIdx.x % 128 == 0;
    const int barrier = 3 + consumer;  // 1 and 2: the swapped shape's exchange
    bulk_wait_read_if<0>(leader);      // this consumer's previous tile has left the buffer
    named_barrier_sync(barrier, 128);
    const int g = lane / 4, q = lane % 4;
    constexpr int kBlocks = AccTile<C::kAccCols>::kBlocks;
    constexpr int kOutBlocks = C::kSwiGLU ? kBlocks / 2 : kBlocks;  // 8-column blocks of output
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * warp + g + 8 * r;  // row % 8 == g
#pragma unroll
      for (int j = 0; j < kOutBlocks; ++j) {
        uint32_t packed;
        if constexpr (C::kSwiGLU) {
          packed = pack_half2<T>(swiglu(acc.v[j][2 * r], acc.v[j + kBlocks / 2][2 * r]),
                                 swiglu(acc.v[j][2 * r + 1], acc.v[j + kBlocks / 2][2 * r + 1]));
        } else {
          packed = pack_half2<T>(acc.v[j][2 * r], acc.v[j][2 * r + 1]);
        }
        unsigned char* chunk = tile.block(j / 8) + row * 128 + (((j % 8) ^ g) * 16) + 4 * q;
        *reinterpret_cast<uint32_t*>(chunk) = packed;
      }
    }
    fence_async_shared();
    named_barrier_sync(barrier, 128);
#pragma unroll
    for (int b = 0; b < C::kOutCols / 64; ++b) {
      tma_store_2d_if(leader, &p.out_map, tile.block(b), t.col0 + 64 * b, t.row0 + 64 * consumer);
    }
    bulk_commit_if(leader);
  }

  // Before the CTA exits: its stores have left shared memory and been written.
  __device__ void finish_stores() const {
    if constexpr (C::kStoreViaSmem) bulk_wait_all_if<0>(threadIdx.x % 128 == 0);
  }

  // Swapped: this lane's rows are weight rows (output columns), its columns token rows.
  __device__ void store_swapped(const AccTile<C::kAccCols>& acc, const GroupedTile& t) const {
    T* out = static_cast<T*>(p.base.out);
    const int g = lane / 4, q = lane % 4;
    constexpr int kBlocks = AccTile<C::kAccCols>::kBlocks;
    if constexpr (C::kSwiGLU) {
      // Consumer 1 holds the up rows: they go through shared memory to consumer 0, which holds
      // the gate rows of the same columns. Both consumers pass the same two barrier instructions
      // (1: the up rows are written; 2: consumer 0 has read them, the buffer is free again): with
      // each consumer's barriers in its own branch, compute-sanitizer synccheck reported every
      // warp "divergent" at barrier 1 (bar.sync is .aligned; notes/reliability.md).
      float* exchange = smem.exchange();
      constexpr int kStride = Smem::kExchangeStride;
      if (consumer == 1) {
#pragma unroll
        for (int j = 0; j < kBlocks; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) exchange[(16 * warp + g + 8 * (e / 2)) * kStride + 8 * j + 2 * q + (e & 1)] = acc.v[j][e];
      }
      named_barrier_sync(1, 256);
      if (consumer == 0) {
        const int out_cols = p.base.n / 2;
#pragma unroll
        for (int j = 0; j < kBlocks; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int local_col = 16 * warp + g + 8 * (e / 2);
            const int tok = 8 * j + 2 * q + (e & 1);
            const float u = exchange[local_col * kStride + tok];
            const int row = t.row0 + tok, col = t.col0 + local_col;
            if (row < t.row_end && col < out_cols) out[int64_t(row) * p.base.out_stride + col] = round_half<T>(swiglu(acc.v[j][e], u));
          }
        }
      }
      named_barrier_sync(2, 256);
    } else {
#pragma unroll
      for (int j = 0; j < kBlocks; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = t.col0 + 64 * consumer + 16 * warp + g + 8 * (e / 2);
          const int row = t.row0 + 8 * j + 2 * q + (e & 1);
          if (row < t.row_end && col < p.base.n) out[int64_t(row) * p.base.out_stride + col] = round_half<T>(acc.v[j][e]);
        }
      }
    }
  }

};

template <typename T, typename C>
__global__ void __launch_bounds__(C::kThreads, 1) grouped_gemm_sm90_kernel(const __grid_constant__ GemmSm90Params p) {
  extern __shared__ unsigned char raw_smem[];
  using Smem = GemmSm90Smem<T, C>;
  const Smem smem(raw_smem);
  if (threadIdx.x == 0) {
    auto& bar = smem.barriers();
    for (int s = 0; s < C::kStages; ++s) {
      bar.full[s].init(C::kGather ? 1 + 128 : 1);  // the TMA issuer, and each copying thread's noinc arrival
      bar.empty[s].init(4 * C::kConsumers);  // one arrival per consumer warp
    }
    Mbarrier::fence_init();
  }
  typename Smem::Tiles tiles(smem.tiles(), p.base.num_experts, p.n_tiles, C::kOutCols);
  tiles.build(p.base.offsets, p.base.rows, smem.scan());  // ends with __syncthreads

  const int warpgroup = warp_uniform(int(threadIdx.x / 128));
  if (warpgroup == 0) {
    warpgroup_registers_decrease<C::kProducerRegisters>();
    if (C::kGather || threadIdx.x < 32) gemm_producer<T, C>(p, smem, tiles);
  } else {
    warpgroup_registers_increase<C::kConsumerRegisters>();
    GemmConsumer<T, C> consumer(p, smem, warpgroup - 1);
    const int count = warp_uniform(tiles.count());
    for (int id = blockIdx.x; id < count; id += gridDim.x) {
      GroupedTile t = tiles.at(id);
      t.expert = warp_uniform(t.expert);
      t.row0 = warp_uniform(t.row0);
      t.row_end = warp_uniform(t.row_end);
      t.col0 = warp_uniform(t.col0);
      t.row_tiles = warp_uniform(t.row_tiles);
      // Not swapped, each consumer owns 64 of the tile's token rows; a segment of <= 64 rows leaves
      // consumer 1 nothing, and it skips the products (Qwen3 T1024 up, ~64 rows an expert: +22%
      // over the swapped 64-row tiles). Only where the tile is the whole segment: the last tile of
      // a longer segment runs beside its sibling row tiles on other SMs, which read the same weight
      // tile from L2 in step with it; finishing early breaks that step and their weight reads go to
      // DRAM (measured: skipping there cost 21% on DeepSeek-V3 T8192 up, 6% down, 11% Mixtral
      // T1024 up; notes/moe.md).
      if (!C::kSwap && t.row_tiles == 1 && t.row0 + 64 * (warpgroup - 1) >= t.row_end) {
        consumer.skip_tile();
        continue;
      }
      AccTile<C::kAccCols> acc;
      consumer.mainloop(acc);
      if constexpr (C::kSwap) {
        consumer.store_swapped(acc, t);
      } else if (C::kStoreViaSmem && t.row0 + 64 * warpgroup <= t.row_end) {
        consumer.store_via_smem(acc, t);
      } else {
        consumer.store(acc, t);
      }
    }
    consumer.finish_stores();
  }
}

template <typename T, typename C>
void launch_config(const GroupedGemmParams& base, int num_sms, cudaStream_t stream) {
  using Smem = GemmSm90Smem<T, C>;
  GemmSm90Params p;
  p.base = base;
  p.k_blocks = (base.k + C::kBlockK - 1) / C::kBlockK;
  p.n_tiles = ((C::kSwiGLU ? base.n / 2 : base.n) + C::kOutCols - 1) / C::kOutCols;
  const DType dtype = base.dtype;
  if constexpr (!C::kGather) {
    const uint64_t dims[2] = {uint64_t(base.k), uint64_t(std::max<int64_t>(base.rows, 1))};
    const uint64_t strides[1] = {uint64_t(base.rows <= 1 ? base.k : base.a_stride) * 2};
    const uint32_t box[2] = {C::kBlockK, C::kTokenRows};
    p.x_map = sm90::encode_tensor_map_16bit("a", "row stride " + std::to_string(base.a_stride) + " elements", dtype, 2,
                                            base.a, dims, strides, box);
  }
  {
    const uint64_t dims[3] = {uint64_t(base.k), uint64_t(base.n), uint64_t(base.num_experts)};
    const int64_t expert_stride = base.num_experts == 1 ? int64_t(base.n) * base.w_stride_row : base.w_stride_expert;
    const uint64_t strides[2] = {uint64_t(base.w_stride_row) * 2, uint64_t(expert_stride) * 2};
    const uint32_t box[3] = {C::kBlockK, C::kWeightBoxRows, 1};
    p.w_map = sm90::encode_tensor_map_16bit(
        "weights",
        "row stride " + std::to_string(base.w_stride_row) + ", expert stride " + std::to_string(base.w_stride_expert) +
            " elements",
        dtype, 3, base.w, dims, strides, box);
  }
  if constexpr (C::kStoreViaSmem) {
    const int64_t out_cols = C::kSwiGLU ? base.n / 2 : base.n;
    const uint64_t dims[2] = {uint64_t(out_cols), uint64_t(std::max<int64_t>(base.rows, 1))};
    const uint64_t strides[1] = {uint64_t(base.rows <= 1 ? out_cols : base.out_stride) * 2};
    const uint32_t box[2] = {64, 64};
    p.out_map = sm90::encode_tensor_map_16bit("out", "row stride " + std::to_string(base.out_stride) + " elements",
                                              dtype, 2, base.out, dims, strides, box);
  }
  auto kernel = grouped_gemm_sm90_kernel<T, C>;
  static tessera::detail::OncePerDevice smem_limit_raised;
  smem_limit_raised([&] {
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Smem::kBytes));
  });
  kernel<<<num_sms, C::kThreads, Smem::kBytes, stream>>>(p);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

// The tile shape (unless forced) by an estimate of the LARGEST segment, mean + 2 sqrt(mean): under
// random routing the segments spread by about sqrt(mean), so a tile sized for the mean takes two
// tiles on most experts (Mixtral T128, 32 rows a mean: 64-row tiles +3-5% over 32; Qwen3 T1024,
// 64 a mean: the 128-row shape +22% on up over 64-row swapped tiles, even on down; measured,
// notes/moe.md). In the bandwidth-bound regime a larger tile costs little: 64-row tiles within
// 1% of 32 on the balanced 32-row case.
int token_rows_for(const GroupedGemmParams& p) {
  if (p.token_rows != 0) return p.token_rows;
  const double mean = double(p.expected_rows_per_expert);
  const double largest = mean + 2.0 * std::sqrt(mean);
  return largest <= 16 ? 16 : largest <= 32 ? 32 : largest <= 64 ? 64 : 128;
}

template <typename T, GemmEpilogue kEpilogue, bool kGather>
void launch_shape(const GroupedGemmParams& p, int num_sms, cudaStream_t stream) {
  const int rows = token_rows_for(p);
  if (rows <= 16) launch_config<T, GemmSm90Config<true, 16, 128, 8, kEpilogue, false, kGather>>(p, num_sms, stream);
  else if (rows <= 32) launch_config<T, GemmSm90Config<true, 32, 128, 8, kEpilogue, false, kGather>>(p, num_sms, stream);
  else if (rows <= 64) launch_config<T, GemmSm90Config<true, 64, 128, 8, kEpilogue, false, kGather>>(p, num_sms, stream);
  // 3 stages: the output tiles take the fourth's shared memory (TMA-store epilogue with 3 stages
  // against registers with 4, same run: +5-29% on every compute-bound case; notes/moe.md).
  else launch_config<T, GemmSm90Config<false, 128, 256, 3, kEpilogue, true, kGather>>(p, num_sms, stream);
}

template <typename T, GemmEpilogue kEpilogue>
void launch_typed(const GroupedGemmParams& p, int num_sms, cudaStream_t stream) {
  if (p.a_row_index != nullptr) launch_shape<T, kEpilogue, true>(p, num_sms, stream);
  else launch_shape<T, kEpilogue, false>(p, num_sms, stream);
}

}  // namespace

void launch_grouped_gemm_sm90(const GroupedGemmParams& p, int num_sms, cudaStream_t stream) {
  const bool with_swiglu = p.epilogue == GemmEpilogue::kSwiGLU;  // (swiglu() is the device function)
  if (p.dtype == DType::kBF16) {
    if (with_swiglu) launch_typed<__nv_bfloat16, GemmEpilogue::kSwiGLU>(p, num_sms, stream);
    else launch_typed<__nv_bfloat16, GemmEpilogue::kStore>(p, num_sms, stream);
  } else {
    if (with_swiglu) launch_typed<__half, GemmEpilogue::kSwiGLU>(p, num_sms, stream);
    else launch_typed<__half, GemmEpilogue::kStore>(p, num_sms, stream);
  }
}

}  // namespace tessera::kernels::moe
