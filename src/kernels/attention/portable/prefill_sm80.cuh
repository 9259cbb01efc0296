// Portable prefill attention (sm_80+): FlashAttention-2's work split. One CTA owns 128 query rows
// of one (request, query head): 4 warps of 32 rows (hd64, hd128), or at hd256 8 warps in pairs of
// 32 rows, where a pair splits S = Q K^T by keys and O += P V by head dims. Each warp keeps its O
// accumulators and softmax statistics in registers while the CTA streams K and V tiles of 64 keys
// through shared memory (cp.async), computing S = Q K^T and O += P V with mma.sync m16n8k16. P
// stays in registers (the S accumulators are re-packed as the A operand of P V); a pair reads
// only its partner's half of P from shared memory. Loads overlap compute as in FA2: V(j) loads
// while S(j) is computed, K(j+1) while O += P V(j) is (and at hd64 / hd256 the exponentials).
// KV tiles wholly outside the mask band are never visited; only tiles that cross its edge are
// masked element by element.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "core/cuda_check.h"
#include "core/once_per_device.h"
#include "kernels/attention/common/logits.cuh"
#include "kernels/attention/common/mask.cuh"
#include "kernels/attention/common/register_tile.cuh"
#include "kernels/attention/portable/kv_source_sm80.cuh"
#include "kernels/attention/portable/row_softmax_sm80.cuh"
#include "kernels/attention/prefill_params.h"
#include "kernels/common/mma_sm80.cuh"

namespace tessera::kernels::sm80 {

// Tile shapes and load order by head dim, chosen by measurement on H200 (bf16, 16K tokens, hidden
// 2048, TFLOP/s; see notes/prefill_portable.md):
// - 32 rows per warp beat 16 at hd64 (304 vs 273) and at hd128 (316 vs 285); 32-key tiles lose at
//   hd128 (323 vs 326 at 32 rows per warp); capping registers for 3 CTAs/SM lost 5-10%.
// - hd256: 8 warps, 64-key tiles, one CTA per SM. FA2's shape (8 warps of 16 rows) waited on
//   shared memory: every warp read the whole K and V tile for its 16 rows (297 at best). Warp
//   pairs on 32 rows (each K / V fragment then serves two m16 tiles: 100 ldmatrix.x4 per 256
//   mma instead of 144) reach 322 (+7.5%, prefill_portable.md v11). K(j+1) is requested after the
//   row maxima (below); right after S(j) lost with pairs (316.7 vs 322.7), where FA2's shape had
//   preferred it (297 vs 292).
// - At hd64 the softmax's row max and sum are reduced as trees: the chain of 16 dependent adds
//   per row was exposed with two warps per scheduler (+1.1% at hd64; hd128 lost 1.3%, hd256 even).
// - Whole tiles of ragged K/V are copied with one address per thread (hd128 +10% with the
//   conditional O rescale; hd64 loses 3% with it, so it keeps the general copy). Paged tiles read
//   all their rows' offsets before issuing the copies (kv_source_sm80.cuh).
// kCompact: the shape for GPUs whose shared memory per block is too small for the default one
// (99 KB on sm_86 / sm_89; the wide hd256 tile needs 145 KB): hd256 keeps 4 warps and 32-key tiles
// (66 KB). Identical to the default at hd64 / hd128.
template <int kHeadDimT, bool kCompact = false>
struct PrefillConfig {
  static constexpr int kHeadDim = kHeadDimT;
  static constexpr bool kWide = kHeadDim == 256 && !kCompact;  // 128 x 64 hd256 tile, 8 warps
  static constexpr int kWarps = kWide ? 8 : 4;
  static constexpr int kThreads = kWarps * 32;
  // Warp pairs (kWide): two warps share 32 rows; S = Q K^T is split between them by keys, O += P V
  // by head dims, and each reads the other's half of P from shared memory. Each K and V fragment
  // read then serves two m16 tiles: 100 ldmatrix.x4 per warp and 256 mma instead of 144.
  static constexpr bool kWarpPairs = kWide;
  static constexpr int kKeyHalves = kWarpPairs ? 2 : 1;
  static constexpr int kRowGroups = kWarps / kKeyHalves;   // warps (or pairs) with their own rows
  static constexpr int kMTiles = kHeadDim <= 128 || kWarpPairs ? 2 : 1;  // m16 row tiles per warp
  static constexpr int kBlockM = 16 * kMTiles * kRowGroups;  // query rows per CTA
  static constexpr int kBlockN = kHeadDim == 256 && !kWide ? 32 : 64;  // keys per K/V tile
  static constexpr int kTileBytes = (kBlockM + 2 * kBlockN) * kHeadDim * 2;  // Q, K, V
  // Warp pairs: P (kBlockM x kBlockN) and one float per (key half, row) for the row max / sum.
  static constexpr int kExchangeBytes = kWarpPairs ? kBlockM * kBlockN * 2 + kKeyHalves * kBlockM * 4 : 0;
  static constexpr int kSmemBytes = kTileBytes + kExchangeBytes;
  // CTAs per SM the register budget is sized for (65536 / (kThreads x CTAs) registers per thread).
  static constexpr int kMinBlocksPerSM = kWide ? 1 : 2;
  static constexpr bool kRaggedFullTileCopy = kHeadDim != 64;
  // The softmax's row max and row sum as trees rather than chains (prefill_portable.md v10).
  static constexpr bool kTreeRowReductions = kHeadDim == 64;
  // K(j+1) requested between the row maxima and the exponentials rather than after the softmax,
  // so that the exponentials and O += P V form one basic block: hd64 310.5 vs 303.6, hd256 324.0
  // vs 320.1 (paged +3%); hd128 lost 1.5% (355.6 vs 360.9; prefill_portable.md v12). The compact
  // hd256 shape, timed on the H200 under a 99 KB limit: 288.0 vs 275.5 (16K causal 292.0 vs 281.7).
  static constexpr bool kExponentialsAfterKeyRequest = kHeadDim == 64 || kHeadDim == 256;
  // O rescaled on every tile, so that no branch separates the maxima from the exponentials
  // (prefill_portable.md v13): hd64 8K 317.7 vs 308.2 TFLOP/s, wide hd256 8K 330.5 vs 323.9 and
  // 16K causal 336.1 vs 329.9. hd128 (v12 order) lost 3-4% to spills with it; the compact hd256
  // shape is even with it (285.6 vs 288.0 at 8K, 292.3 vs 292.0 at 16K causal), so it keeps the branch.
  static constexpr bool kRescaleEveryTile = kHeadDim == 64 || kWide;
};

using kernels::MaskBand;

// Copies rows [row0, row0 + kRows) of one head of a ragged [rows, heads, kHeadDim] tensor into a
// swizzled shared tile; rows at or past `valid_rows` are zero-filled.
template <typename T, int kRows, int kHeadDim, int kThreads>
__device__ void load_tile_async(const SwizzledTile<T, kRows, kHeadDim>& tile, const T* head_base,
                                int64_t row_stride, int row0, int valid_rows) {
  const T* base = head_base + int64_t(row0) * row_stride;
  copy_tile_rows<T, kRows, kHeadDim, kThreads>(tile, valid_rows - row0,
                                               [&](int r) { return base + r * row_stride; });
}

// KV: RaggedKV or PagedKV of kv_source_sm80.cuh, instantiated for this tile shape.
template <typename T, typename Config, typename Logits, typename KV>
__global__ void __launch_bounds__(Config::kThreads, Config::kMinBlocksPerSM)
    prefill_sm80_kernel(const PrefillParams p) {
  constexpr int kHeadDim = Config::kHeadDim;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kThreads = Config::kThreads;
  constexpr int kMTiles = Config::kMTiles;  // m16 tiles per warp
  constexpr int kKSteps = kHeadDim / 16;    // k-steps of Q K^T

  // CTAs start roughly in grid order (x fastest). Causal: grid (heads, requests, query tiles from
  // the last), so the heaviest tiles of every (request, head) go first and the light ones fill the
  // tail (measured +10% at 2K-8K causal against heavy-first within each head). Otherwise tiles are
  // equal: grid (query tiles, requests, heads), so the CTAs running together share a head's K/V
  // in L2.
  const bool tiles_last = p.grid_tiles_last;
  const int m_tile = tiles_last ? gridDim.z - 1 - blockIdx.z : gridDim.x - 1 - blockIdx.x;
  const int request = blockIdx.y;
  const int head = tiles_last ? blockIdx.x : blockIdx.z;
  const int q_start = p.qo_indptr[request];
  const int qo_len = p.qo_indptr[request + 1] - q_start;
  const int m0 = m_tile * kBlockM;
  if (m0 >= qo_len) return;
  const int kv_head = head / (p.num_qo_heads / p.num_kv_heads);
  extern __shared__ __align__(128) unsigned char smem[];
  KV kv(p, request, kv_head, smem + Config::kSmemBytes);
  const int kv_len = kv.kv_len;
  const MaskBand band{qo_len, kv_len, kv_len - qo_len, p.causal, p.window_left};

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // Warp w (or pair w % kRowGroups) owns CTA rows {mt * 16 * kRowGroups + (w % kRowGroups) * 16 +
  // [0, 16)}; this lane holds rows g and g + 8 of each of its m16 tiles. In a pair, warp half
  // `half` computes S for keys [half, half + 1) * kSKeys of each tile and O for head dims
  // [half, half + 1) * kODims.
  constexpr int kRowGroups = Config::kRowGroups, kKeyHalves = Config::kKeyHalves;
  constexpr int kSKeys = kBlockN / kKeyHalves, kSNTiles = kSKeys / 8;  // keys of S per warp
  constexpr int kODims = kHeadDim / kKeyHalves, kODTiles = kODims / 8;  // dims of O per warp
  const int row_group = Config::kWarpPairs ? warp % kRowGroups : warp;
  const int half = Config::kWarpPairs ? warp / kRowGroups : 0;  // a constant 0 without pairs
  auto tile_row = [&](int mt) { return mt * 16 * kRowGroups + row_group * 16; };

  const SwizzledTile<T, kBlockM, kHeadDim> q_tile{reinterpret_cast<T*>(smem)};
  const SwizzledTile<T, kBlockN, kHeadDim> k_tile{q_tile.base + kBlockM * kHeadDim};
  const SwizzledTile<T, kBlockN, kHeadDim> v_tile{k_tile.base + kBlockN * kHeadDim};
  // ldmatrix lanes: Q (A operand) and V (B, transposed) read rows (l%8) + 8*((l/8)%2), chunk l/16;
  // K (B operand) reads rows (l%8) + 8*(l/16), chunk (l/8)%2.
  const LdmatrixLane<T, kBlockM, kHeadDim> q_lane(q_tile, (lane % 8) + ((lane / 8) % 2) * 8, lane / 16);
  const LdmatrixLane<T, kBlockN, kHeadDim> k_lane(k_tile, (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);
  const LdmatrixLane<T, kBlockN, kHeadDim> v_lane =
      LdmatrixLane<T, kBlockN, kHeadDim>(v_tile, (lane % 8) + ((lane / 8) % 2) * 8, lane / 16).shifted(half * kODims);
  // Warp pairs: P as a swizzled kBlockM x kBlockN tile; this lane's stores (row g + 8r of each m16
  // tile, keys 2t, 2t + 1 of each of its 8-key tiles j: chunk (half * kSNTiles + j) ^ g) and its
  // ldmatrix addresses into the partner's key half (k-steps 2 (1 - half) + kk, A-operand pattern).
  T* const p_base = reinterpret_cast<T*>(smem + Config::kTileBytes);
  float* const exchange = reinterpret_cast<float*>(smem + Config::kTileBytes + kBlockM * kBlockN * 2);
  T* p_store[kSNTiles];
  const T* p_load[kSNTiles / 2];
  if constexpr (Config::kWarpPairs) {
#pragma unroll
    for (int j = 0; j < kSNTiles; ++j) p_store[j] = p_base + g * kBlockN + ((half * kSNTiles + j) ^ g) * 8 + 2 * t;
    const int lane_row = (lane % 8) + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int kk = 0; kk < kSNTiles / 2; ++kk) {
      const int step = (1 - half) * (kSNTiles / 2) + kk;
      p_load[kk] = p_base + lane_row * kBlockN + ((2 * step + lane / 16) ^ (lane_row % 8)) * 8;
    }
  }
  // The pair's barrier (ids 1..kRowGroups; 0 is __syncthreads').
  auto pair_sync = [&] { named_barrier_sync(1 + row_group, kKeyHalves * 32); };
  static_assert(kRowGroups < 16, "named barrier ids 1..15");

  const T* q_head = static_cast<const T*>(p.q) + int64_t(q_start) * p.q_stride_row + head * p.q_stride_head;

  // The KV tiles this CTA visits: those meeting the band of any of its rows.
  const int last_row = min(m0 + kBlockM, qo_len) - 1;
  const int n_begin = band.key_begin(m0);
  const int n_end = band.key_end(last_row);
  const int first_tile = n_begin / kBlockN;
  const int end_tile = n_end > n_begin ? (n_end + kBlockN - 1) / kBlockN : first_tile;

  AccTile<kODims> o[kMTiles] = {};  // this warp's unnormalised O: its rows, its head dims
  RowSoftmax<kMTiles, Config::kTreeRowReductions, Config::kTreeRowReductions> softmax;
  auto& row_max = softmax.row_max;
  auto& row_sum = softmax.row_sum;

  load_tile_async<T, kBlockM, kHeadDim, kThreads>(q_tile, q_head, p.q_stride_row, m0, qo_len);
  if (first_tile < end_tile) {
    if constexpr (KV::kSmemBytes > 0) {  // the first two tiles' page ids, the first's rows located
      kv.fetch_rows(p, first_tile * kBlockN, first_tile & 1);
      if (first_tile + 1 < end_tile) kv.fetch_rows(p, (first_tile + 1) * kBlockN, (first_tile + 1) & 1);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      kv.publish_rows(p, first_tile * kBlockN, first_tile & 1);
      __syncthreads();
    }
    kv.load(p, k_tile, first_tile * kBlockN, first_tile & 1, KVPart::kKeys);
  }
  cp_async_commit();

  // K(tile + 1) into the K tile, once V(tile) has landed and every warp is done with K(tile):
  // after the softmax, or between its maxima and exponentials (kExponentialsAfterKeyRequest).
  auto request_next_keys = [&](int tile) {
    const int n1 = (tile + 1) * kBlockN;
    if (tile + 1 < end_tile) kv.publish_rows(p, n1, (tile + 1) & 1);
    cp_async_wait<0>();
    __syncthreads();  // V(tile) landed; every warp is done with K(tile); next rows located
    if (tile + 1 < end_tile) kv.load(p, k_tile, n1, (tile + 1) & 1, KVPart::kKeys);
    cp_async_commit();
  };

  const Logits logits(p.scale, p.soft_cap);
  for (int tile = first_tile; tile < end_tile; ++tile) {
    const int n0 = tile * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K(tile) (and Q) landed; every warp is done with V(tile - 1)
    kv.load(p, v_tile, n0, tile & 1, KVPart::kValues);
    if (tile + 2 < end_tile) kv.fetch_rows(p, n0 + 2 * kBlockN, tile & 1);  // lands with V(tile)
    cp_async_commit();

    // S = Q K^T over this warp's keys: each K fragment read from shared memory serves all kMTiles
    // row tiles.
    AccTile<kSKeys> s[kMTiles] = {};
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], q_lane.at(tile_row(mt), ks));
#pragma unroll
      for (int np = 0; np < kSNTiles / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, k_lane.at(half * kSKeys + np * 16, ks));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<T>(s[mt].v[2 * np], a[mt], b[0], b[1]);
          mma_16816<T>(s[mt].v[2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // Logits; keys outside the band (or past kv_len) at -inf. Only tiles crossing the band's edge
    // pay for the per-element test.
    if constexpr (!Logits::kIdentity) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) for_each(s[mt], [&](float& x, int, int, int) { x = logits(x); });
    }
    const bool needs_mask = n0 + kBlockN > kv_len ||
                            (p.causal && n0 + kBlockN - 1 > m0 + band.offset) ||
                            (p.window_left >= 0 && n0 < last_row + band.offset - p.window_left);
    if (needs_mask) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int j = 0; j < kSNTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = n0 + half * kSKeys + j * 8 + 2 * t + (e & 1);
            const int row = m0 + tile_row(mt) + g + (e < 2 ? 0 : 8);
            if (!band.visible(row, key)) s[mt].v[j][e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax: new row maxima (the 4 lanes of a row share them; a pair exchanges its two
    // key halves' through shared memory), rescale what came before.
    float pair_max[kMTiles][2];
    if constexpr (Config::kWarpPairs) {
      // The partner read the previous tile's values before the pair's last barrier.
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          pair_max[mt][r] = softmax.tile_max(s[mt], mt, r);
          if (t == 0) exchange[half * kBlockM + tile_row(mt) + g + 8 * r] = pair_max[mt][r];
        }
      }
      pair_sync();
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          pair_max[mt][r] = fmaxf(pair_max[mt][r], exchange[(1 - half) * kBlockM + tile_row(mt) + g + 8 * r]);
    }
    auto new_max = [&](int mt, int r) { return Config::kWarpPairs ? pair_max[mt][r] : softmax.tile_max(s[mt], mt, r); };
    float rescale[kMTiles][2];
    bool max_moved = false;
    // A row whose maximum did not move has rescale exactly 1 (ex2 of 0): O is rescaled only when
    // some row of the warp moved, which after the first tiles is rare (or on every tile:
    // kRescaleEveryTile). Results are bitwise those of rescaling always.
    auto rescale_o = [&] {
      if (Config::kRescaleEveryTile || __any_sync(0xffffffffu, max_moved)) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) mul_row(o[mt], rescale[mt]);
      }
    };
    const float log2_scale = logits.log2_scale;
    if constexpr (Config::kExponentialsAfterKeyRequest) {
      // Maxima, O rescale and K(tile + 1)'s request first: the exponentials and O += P V then
      // share one basic block (no branch or barrier between them) that the compiler interleaves.
      float m_scaled[kMTiles][2];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          m_scaled[mt][r] = softmax.update_max(mt, r, new_max(mt, r), log2_scale, rescale[mt][r], max_moved);
      rescale_o();
      request_next_keys(tile);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) softmax.exponentiate(s[mt], mt, r, log2_scale, m_scaled[mt][r], rescale[mt][r]);
    } else {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          softmax.exponentiate(s[mt], mt, r, log2_scale,
                               softmax.update_max(mt, r, new_max(mt, r), log2_scale, rescale[mt][r], max_moved),
                               rescale[mt][r]);
      rescale_o();
      request_next_keys(tile);
    }

    // O += P V over this warp's head dims, P of its own keys taken straight from the S
    // accumulators (two 8-key tiles make one k16 A tile); a pair's other key half from shared memory.
    if constexpr (Config::kWarpPairs) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int j = 0; j < kSNTiles; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            *reinterpret_cast<uint32_t*>(p_store[j] + (tile_row(mt) + 8 * r) * kBlockN) =
                pack2<T>(s[mt].v[j][2 * r], s[mt].v[j][2 * r + 1]);
    }
    auto accumulate_pv = [&](const uint32_t (&a)[kMTiles][4], int key0) {
#pragma unroll
      for (int dp = 0; dp < kODTiles / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_lane.at(key0, dp));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<T>(o[mt].v[2 * dp], a[mt], b[0], b[1]);
          mma_16816<T>(o[mt].v[2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    };
#pragma unroll
    for (int ks = 0; ks < kSKeys / 16; ++ks) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        a_fragment<T>(s[mt], ks, a[mt]);
      }
      accumulate_pv(a, half * kSKeys + ks * 16);
    }
    if constexpr (Config::kWarpPairs) {
      // The partner's half of P is stored. Waiting here, after this warp's own half of P V, measured
      // 316.7 vs 313.4 TFLOP/s against waiting before it (v11 with K(j+1) requested after S); with
      // K(j+1) after the softmax, a split bar.arrive (after the stores) / bar.sync (here) lost
      // 316.4 vs 322.7 (prefill_portable.md v11).
      pair_sync();
#pragma unroll
      for (int ks = 0; ks < kSKeys / 16; ++ks) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], p_load[ks] + tile_row(mt) * kBlockN);
        accumulate_pv(a, (1 - half) * kSKeys + ks * 16);
      }
    }
  }
  cp_async_wait<0>();  // nothing in flight at exit (a CTA with no visible tile still loaded Q)

  // Epilogue: O / l, LSE = (max * log2_scale + log2 l) * ln 2; rows that saw no key give 0 and -inf.
  T* o_head = static_cast<T*>(p.o) + int64_t(q_start) * p.o_stride_row + head * p.o_stride_head;
  if constexpr (Config::kWarpPairs) {  // row sums over the row's 4 lanes and both key halves
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = row_sum[mt][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        row_sum[mt][r] = l + __shfl_xor_sync(0xffffffffu, l, 2);
        if (t == 0) exchange[half * kBlockM + tile_row(mt) + g + 8 * r] = row_sum[mt][r];
      }
    }
    pair_sync();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) row_sum[mt][r] += exchange[(1 - half) * kBlockM + tile_row(mt) + g + 8 * r];
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[mt][r];
      if constexpr (!Config::kWarpPairs) {
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
      }
      // Nothing visible gives l == 0; a NaN logit gives l = NaN (and row_max may stay -inf,
      // since fmaxf skips NaN), which must reach O and LSE rather than read as empty.
      const bool empty = l == 0.f;
      const float inv_sum = empty ? 0.f : 1.f / l;
      const int row = m0 + tile_row(mt) + g + 8 * r;
      if (row >= qo_len) continue;
      T* o_row = o_head + int64_t(row) * p.o_stride_row + half * kODims;
#pragma unroll
      for (int d = 0; d < kODTiles; ++d) {
        *reinterpret_cast<uint32_t*>(o_row + d * 8 + 2 * t) =
            pack2<T>(o[mt].v[d][2 * r] * inv_sum, o[mt].v[d][2 * r + 1] * inv_sum);
      }
      if (p.lse != nullptr && t == 0 && half == 0) {
        p.lse[int64_t(q_start + row) * p.lse_stride_row + head * p.lse_stride_head] =
            empty ? -INFINITY
                  : (row_max[mt][r] * logits.log2_scale + log2f(l)) * 0.6931471805599453f;
      }
    }
  }
}

template <typename T, typename Config, typename Logits, typename KV>
void launch_prefill_variant(const PrefillParams& p, const dim3& grid, cudaStream_t stream) {
  constexpr int kSmemBytes = Config::kSmemBytes + KV::kSmemBytes;
  auto kernel = prefill_sm80_kernel<T, Config, Logits, KV>;
  if (kSmemBytes > 48 * 1024) {
    static detail::OncePerDevice smem_limit_raised;
    smem_limit_raised([&] {
      TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              kSmemBytes));
    });
  }
  kernel<<<grid, Config::kThreads, kSmemBytes, stream>>>(p);
}

template <typename T, typename Config>
void launch_prefill_config(const PrefillParams& p, cudaStream_t stream) {
  const int m_tiles = (p.max_qo_len + Config::kBlockM - 1) / Config::kBlockM;
  if (m_tiles == 0 || p.batch_size == 0 || p.num_qo_heads == 0) return;
  PrefillParams params = p;
  params.grid_tiles_last = p.causal && m_tiles <= 65535;  // grid z holds at most 65535
  const dim3 grid = params.grid_tiles_last ? dim3(p.num_qo_heads, p.batch_size, m_tiles)
                                           : dim3(m_tiles, p.batch_size, p.num_qo_heads);
  constexpr int kHeadDim = Config::kHeadDim;
  using Ragged = RaggedKV<T, Config::kBlockN, kHeadDim, Config::kThreads, Config::kRaggedFullTileCopy>;
  using Paged = PagedKV<T, Config::kBlockN, kHeadDim, Config::kThreads>;
  if (p.soft_cap > 0.f) {
    if (p.paged) launch_prefill_variant<T, Config, SoftCappedLogits, Paged>(params, grid, stream);
    else launch_prefill_variant<T, Config, SoftCappedLogits, Ragged>(params, grid, stream);
  } else {
    if (p.paged) launch_prefill_variant<T, Config, PlainLogits, Paged>(params, grid, stream);
    else launch_prefill_variant<T, Config, PlainLogits, Ragged>(params, grid, stream);
  }
}

// Shared memory per CTA of the default or compact shape (the paged loader's included).
template <int kHeadDim>
int prefill_smem_bytes(bool compact) {
  auto bytes = [](auto config) {
    using Config = decltype(config);
    return Config::kSmemBytes +
           PagedKV<__nv_bfloat16, Config::kBlockN, kHeadDim, Config::kThreads>::kSmemBytes;
  };
  return compact ? bytes(PrefillConfig<kHeadDim, true>{}) : bytes(PrefillConfig<kHeadDim, false>{});
}

// compact: the caller found the default shape too large for the GPU's shared memory per block.
template <typename T, int kHeadDim>
void launch_prefill(const PrefillParams& p, bool compact, cudaStream_t stream) {
  if constexpr (PrefillConfig<kHeadDim, true>::kWide != PrefillConfig<kHeadDim, false>::kWide) {
    if (compact) return launch_prefill_config<T, PrefillConfig<kHeadDim, true>>(p, stream);
  }
  launch_prefill_config<T, PrefillConfig<kHeadDim, false>>(p, stream);
}

}  // namespace tessera::kernels::sm80
