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
#include "kernels/attention/portable/prefill_config_sm80.cuh"
#include "kernels/attention/portable/prefill_scheduler_sm80.cuh"
#include "kernels/attention/portable/row_softmax_sm80.cuh"
#include "kernels/attention/prefill_params.h"
#include "kernels/common/mma_sm80.cuh"

namespace tessera::kernels::sm80 {

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

  const PrefillWorkTile work = prefill_work_tile<kBlockM>(p);
  if (!work.has_rows()) return;
  const int request = work.request, head = work.head, q_start = work.q_start, qo_len = work.qo_len, m0 = work.m0;
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
  // ldmatrix lanes: Q as the A operand, K as B operands, V as B operands read transposed (this
  // warp's head dims).
  const auto q_lane = LdmatrixLane<T, kBlockM, kHeadDim>::a_operand(q_tile, lane);
  const auto k_lane = LdmatrixLane<T, kBlockN, kHeadDim>::b_operands(k_tile, lane);
  const auto v_lane = LdmatrixLane<T, kBlockN, kHeadDim>::a_operand(v_tile, lane).shifted(half * kODims);
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
    const int lane_row = LdmatrixX4::a_row(lane);
#pragma unroll
    for (int kk = 0; kk < kSNTiles / 2; ++kk) {
      const int step = (1 - half) * (kSNTiles / 2) + kk;
      p_load[kk] = p_base + lane_row * kBlockN + ((2 * step + LdmatrixX4::a_chunk(lane)) ^ (lane_row % 8)) * 8;
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
      const float inv_sum = state_inv_sum(l);
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
            l == 0.f ? -INFINITY : Log2Units::lse(row_max[mt][r] * logits.log2_scale, l);
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
  const dim3 grid = prefill_grid(params, m_tiles);
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
