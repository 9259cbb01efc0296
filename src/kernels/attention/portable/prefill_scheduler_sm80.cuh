// The work order of the portable prefill kernel: one CTA per (request, query head, kBlockM-row
// query tile), in grid order.
//
// CTAs start roughly in grid order (x fastest). Causal: grid (heads, requests, query tiles from the
// last), so the heaviest tiles of every (request, head) go first and the light ones fill the tail
// (measured +10% at 2K-8K causal against heavy-first within each head). Otherwise tiles are equal:
// grid (query tiles, requests, heads), so the CTAs running together share a head's K/V in L2.
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/prefill_params.h"
#include "kernels/common/device_check.cuh"

namespace tessera::kernels::sm80 {

// One CTA's work: query rows [m0, m0 + kBlockM) of `request` (rows [q_start, q_start + qo_len) of
// Q and O) for query head `head`.
struct PrefillWorkTile {
  int request, head;
  int q_start, qo_len;
  int m0;
  int split;  // which of params.kv_splits runs of the tile's KV tiles (0 without a split)
  __device__ __forceinline__ bool has_rows() const { return m0 < qo_len; }
};

// w.request's rows (checked against q's on the device) and the first row of its query tile m_tile.
template <int kBlockM>
__device__ __forceinline__ void locate_rows(const PrefillParams& p, int m_tile, PrefillWorkTile& w) {
  w.q_start = p.qo_indptr[w.request];
  w.qo_len = p.qo_indptr[w.request + 1] - w.q_start;
  TESSERA_DEVICE_CHECK(w.qo_len <= 0 || (w.q_start >= 0 && int64_t(w.q_start) + w.qo_len <= p.q_rows),
                       "qo_indptr (device copy) reaches past q's rows");
  w.m0 = m_tile * kBlockM;
}

template <int kBlockM>
__device__ __forceinline__ PrefillWorkTile prefill_work_tile(const PrefillParams& p) {
  const bool tiles_last = p.grid_tiles_last;
  // The tile dim holds m_tiles x kv_splits: a tile's splits are neighbours in launch order.
  const int slot = tiles_last ? gridDim.z - 1 - blockIdx.z : gridDim.x - 1 - blockIdx.x;
  const int m_tile = slot / p.kv_splits;
  PrefillWorkTile w;
  w.split = slot - m_tile * p.kv_splits;
  w.request = blockIdx.y;
  w.head = tiles_last ? blockIdx.x : blockIdx.z;
  locate_rows<kBlockM>(p, m_tile, w);
  return w;
}

// The list a fixed-grid launch walks (prefill_sm80_step_kernel): the plan's PrefillStep read on
// the device; a list position is ((request x heads + head) x m_tiles + query tile) x kv_splits +
// split (plan/prefill_schedule.h), in the order of the plan's schedule.
struct PrefillStepList {
  int batch_size, m_tiles, kv_splits, slots;
};

template <int kBlockM>
__device__ __forceinline__ PrefillStepList prefill_step_list(const PrefillParams& p) {
  PrefillStepList l;
  l.batch_size = __ldg(&p.step->batch_size);
  l.m_tiles = (__ldg(&p.step->max_qo_len) + kBlockM - 1) / kBlockM;
  l.kv_splits = __ldg(&p.step->kv_splits);
  l.slots = __ldg(&p.step->slots);
  return l;
}

template <int kBlockM>
__device__ __forceinline__ PrefillWorkTile prefill_step_work_tile(const PrefillParams& p, const PrefillStepList& l,
                                                                  int position) {
  PrefillWorkTile w;
  const int tile = position / l.kv_splits;
  w.split = position - tile * l.kv_splits;
  const int pair = tile / l.m_tiles;  // (request, head)
  const int m_tile = tile - pair * l.m_tiles;
  w.request = pair / p.num_qo_heads;
  w.head = pair - w.request * p.num_qo_heads;
  locate_rows<kBlockM>(p, m_tile, w);
  return w;
}

// The grid of m_tiles query tiles per (request, head), and its order in params.grid_tiles_last.
inline dim3 prefill_grid(PrefillParams& params, int m_tiles) {
  const int slots = m_tiles * params.kv_splits;
  params.grid_tiles_last = params.causal && slots <= 65535;  // grid z holds at most 65535
  return params.grid_tiles_last ? dim3(params.num_qo_heads, params.batch_size, slots)
                                : dim3(slots, params.batch_size, params.num_qo_heads);
}

}  // namespace tessera::kernels::sm80
