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
#include "kernels/attention/portable/prefill_epilogue_sm80.cuh"
#include "kernels/attention/portable/prefill_mainloop_sm80.cuh"
#include "kernels/attention/portable/prefill_scheduler_sm80.cuh"
#include "kernels/attention/portable/prefill_softmax_sm80.cuh"
#include "kernels/attention/portable/prefill_warp_sm80.cuh"
#include "kernels/attention/portable/row_softmax_sm80.cuh"
#include "kernels/attention/prefill_params.h"
#include "kernels/common/mma_sm80.cuh"

namespace tessera::kernels::sm80 {

using kernels::MaskBand;

// One work tile (with rows): its KV tiles (kv_splits > 1: the tile's run of them) through the
// mainloop, then the epilogue (partials: a split's fp32 state instead of O / LSE).
// KV: RaggedKV or PagedKV of kv_source_sm80.cuh, instantiated for this tile shape.
// kFixedGrid: a fixed-grid launch, whose step has list_splits runs (p.kv_splits otherwise; the
// count is read where it is used, which keeps the one-tile kernel's registers as they were).
template <typename T, typename Config, typename Logits, typename KV, bool kFixedGrid>
__device__ __forceinline__ void prefill_sm80_tile(const PrefillParams& p, const PrefillWorkTile& work, int list_splits,
                                                  unsigned char* smem) {
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kMTiles = Config::kMTiles;
  const int request = work.request, head = work.head, q_start = work.q_start, qo_len = work.qo_len, m0 = work.m0;
  const int kv_head = head / (p.num_qo_heads / p.num_kv_heads);
  KV kv(p, request, kv_head, smem + Config::kSmemBytes);
  const int kv_len = kv.kv_len;
  const MaskBand band{qo_len, kv_len, kv_len - qo_len, p.causal, p.window_left};

  // This warp's place in the CTA (prefill_warp_sm80.cuh), computed here for the parts.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int row_group = Config::kWarpPairs ? warp % Config::kRowGroups : warp;
  const int half = Config::kWarpPairs ? warp / Config::kRowGroups : 0;  // a constant 0 without pairs
  const PrefillWarp<Config> wp{warp, lane, g, t, row_group, half};

  const PrefillMainloop<T, Config> mainloop(smem, lane, half);
  float* const exchange = reinterpret_cast<float*>(smem + Config::kTileBytes + kBlockM * kBlockN * 2);
  T* p_store[Config::kSNTiles];
  const T* p_load[Config::kSNTiles / 2];
  pair_p_addresses<Config>(reinterpret_cast<T*>(smem + Config::kTileBytes), wp, p_store, p_load);
  const T* q_head = static_cast<const T*>(p.q) + int64_t(q_start) * p.q_stride_row + head * p.q_stride_head;

  // The KV tiles this CTA visits: those meeting the band of any of its rows.
  const int last_row = min(m0 + kBlockM, qo_len) - 1;
  const int n_begin = band.key_begin(m0);
  const int n_end = band.key_end(last_row);
  int first_tile = n_begin / kBlockN;
  int end_tile = n_end > n_begin ? (n_end + kBlockN - 1) / kBlockN : first_tile;
  const int kv_splits = kFixedGrid ? list_splits : p.kv_splits;
  if (kv_splits > 1) {  // this CTA's run of them (possibly none: it then writes an empty state)
    const int per_split = (end_tile - first_tile + kv_splits - 1) / kv_splits;
    first_tile = min(end_tile, first_tile + work.split * per_split);
    end_tile = min(end_tile, first_tile + per_split);
  }

  AccTile<Config::kODims> o[kMTiles] = {};  // this warp's unnormalised O: its rows, its head dims
  PrefillRowSoftmax<Config> softmax;
  mainloop.load_q_and_first_keys(p, kv, q_head, m0, qo_len, first_tile, end_tile);
  auto request_next_keys = [&](int tile) { mainloop.request_next_keys(p, kv, tile, end_tile); };
  const Logits logits(p.scale, p.soft_cap);
  for (int tile = first_tile; tile < end_tile; ++tile) {
    const int n0 = tile * kBlockN;
    mainloop.load_values(p, kv, tile, end_tile);
    // This tile's registers, declared here for the parts (PrefillMainloop::QKFragments says why).
    AccTile<Config::kSKeys> s[kMTiles] = {};  // S, then P
    uint32_t q_frag[kMTiles][4], k_frag[4];
    mainloop.scores(s, wp, {q_frag, k_frag});

    // Logits; keys outside the band (or past kv_len) at -inf on the tiles that cross its edge.
    if constexpr (!Logits::kIdentity) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) for_each(s[mt], [&](float& x, int, int, int) { x = logits(x); });
    }
    // (MaskBand::tile_crosses_edge's test, on the kernel's parameters: through the band the compiler
    // ordered it differently and the machine code changed.)
    const bool needs_mask = n0 + kBlockN > kv_len ||
                            (p.causal && n0 + kBlockN - 1 > m0 + band.offset) ||
                            (p.window_left >= 0 && n0 < last_row + band.offset - p.window_left);
    if (needs_mask) prefill_mask<Config>(s, band, wp, n0, m0);

    float pair_max[kMTiles][2], rescale[kMTiles][2];
    bool max_moved = false;
    float m_scaled[kMTiles][2];
    prefill_softmax_tile<Config>(softmax, s, o, wp, exchange, logits.log2_scale, request_next_keys, tile,
                                 {pair_max, rescale, max_moved, m_scaled});

    uint32_t p_own[kMTiles][4], p_partner[kMTiles][4];
    mainloop.accumulate(s, o, wp, {p_store, p_load}, {p_own, p_partner});
  }
  cp_async_wait<0>();  // nothing in flight at exit (a CTA with no visible tile still loaded Q)
  prefill_epilogue<T, Config, kFixedGrid>(p, o, softmax, wp, exchange, logits.log2_scale, q_start, qo_len, head, m0,
                                          work.split, list_splits);
}

// One CTA per work tile, the grid sized to the step (prefill_scheduler_sm80.cuh).
template <typename T, typename Config, typename Logits, typename KV>
__global__ void __launch_bounds__(Config::kThreads, Config::kMinBlocksPerSM)
    prefill_sm80_kernel(const PrefillParams p) {
  const PrefillWorkTile work = prefill_work_tile<Config::kBlockM>(p);
  if (!work.has_rows()) return;
  extern __shared__ __align__(128) unsigned char smem[];
  prefill_sm80_tile<T, Config, Logits, KV, false>(p, work, 0, smem);
}

// A fixed grid (BatchPrefillPaged with cuda_graph: a graph's launch replays later steps) whose
// CTAs walk the plan's schedule (plan/prefill_schedule.h): CTA b the slots b, b + gridDim.x, ...,
// each slot's list positions in order (prefill_step_work_tile decodes them).
template <typename T, typename Config, typename Logits, typename KV>
__global__ void __launch_bounds__(Config::kThreads, Config::kMinBlocksPerSM)
    prefill_sm80_step_kernel(const PrefillParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const PrefillStepList list = prefill_step_list<Config::kBlockM>(p);
  for (int slot = blockIdx.x; slot < list.slots; slot += gridDim.x) {
    const int end = __ldg(&p.slot_begin[slot + 1]);
    for (int cursor = __ldg(&p.slot_begin[slot]); cursor < end; ++cursor) {
      const PrefillWorkTile work = prefill_step_work_tile<Config::kBlockM>(p, list, __ldg(&p.slot_tiles[cursor]));
      if (!work.has_rows()) continue;
      prefill_sm80_tile<T, Config, Logits, KV, true>(p, work, list.kv_splits, smem);
      __syncthreads();  // the next tile's loads overwrite shared memory this one's epilogue read
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

// The fixed-grid kernel: as many CTAs as fit on the GPU at once.
template <typename T, typename Config, typename Logits, typename KV>
void launch_prefill_step_variant(const PrefillParams& p, cudaStream_t stream) {
  constexpr int kSmemBytes = Config::kSmemBytes + KV::kSmemBytes;
  auto kernel = prefill_sm80_step_kernel<T, Config, Logits, KV>;
  static detail::OncePerDevice smem_limit_raised;
  static int resident_ctas = 0;  // per SM; the same on every device of one kind
  smem_limit_raised([&] {
    if (kSmemBytes > 48 * 1024)
      TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    TESSERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident_ctas, kernel, Config::kThreads, kSmemBytes));
  });
  int device = 0, sms = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  kernel<<<sms * (resident_ctas > 0 ? resident_ctas : 1), Config::kThreads, kSmemBytes, stream>>>(p);
}

template <typename T, typename Config>
void launch_prefill_config(const PrefillParams& p, cudaStream_t stream) {
  using Paged = PagedKV<T, Config::kBlockN, Config::kHeadDim, Config::kThreads>;
  if (p.step != nullptr) {  // fixed grid, paged only (BatchPrefillPaged with cuda_graph)
    if (p.soft_cap > 0.f) launch_prefill_step_variant<T, Config, SoftCappedLogits, Paged>(p, stream);
    else launch_prefill_step_variant<T, Config, PlainLogits, Paged>(p, stream);
    return;
  }
  const int m_tiles = (p.max_qo_len + Config::kBlockM - 1) / Config::kBlockM;
  if (m_tiles == 0 || p.batch_size == 0 || p.num_qo_heads == 0) return;
  PrefillParams params = p;
  const dim3 grid = prefill_grid(params, m_tiles);
  constexpr int kHeadDim = Config::kHeadDim;
  using Ragged = RaggedKV<T, Config::kBlockN, kHeadDim, Config::kThreads, Config::kRaggedFullTileCopy>;
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
