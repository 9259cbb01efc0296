// What the Hopper prefill kernel reads: the family-independent PrefillParams plus the TMA tensor
// maps of Q, K and V and the tile list's shape and order (set by the launcher).
#pragma once

#include <cuda.h>  // CUtensorMap

#include "kernels/attention/prefill_params.h"
#include "kernels/common/fast_divisor.h"
#include "kernels/attention/sm90/prefill_sm90_launch.h"

namespace tessera::kernels::sm90 {

struct PrefillSm90Params {
  CUtensorMap q_map;  // [total_q, num_qo_heads, head_dim], box 64 x 1 x kBlockM (packed GQA: 64 x G x kBlockM / G)
  CUtensorMap k_map;  // ragged: [total_kv, num_kv_heads, head_dim], box 64 x 1 x kBlockN;
  CUtensorMap v_map;  // paged: 4-D over the pages, box_rows-row boxes (kv_source_sm90.cuh)
  CUtensorMap o_map;  // [total_q, num_qo_heads, head_dim], box 64 x 1 x 64 (or 64 x G x 64 / G; when o_via_tma)
  bool o_via_tma = false;  // Config::kStoreOViaSmem and o is a tensor the copy engine can write
  PrefillParams base;
  int m_tiles = 0;       // query tiles of the longest request
  int tiles = 0;         // list length: batch x heads x m_tiles (heads: KV heads when packed)
  TileOrder order = TileOrder::kQueryTilesInner;
  bool heavy_first = false;
  int run_length = 1;
  // Paged K / V: rows per TMA box (gcd(page_size, kBlockN)) and whether a map's second dim is
  // the page's token dim (HND: tokens are closer than heads) rather than its head dim (NHD).
  int kv_box_rows = 0;
  int kv_tile_rows = 0;  // kBlockN
  bool kv_grouped = false, kv_head_in_blocks = false;  // PagedTensorMaps::grouped / head_in_blocks
  bool k_token_dim_first = false, v_token_dim_first = false;
  bool kv_gathered = false;  // pages of page_size % 8 != 0: GatheredKVSm90 (no K / V maps)
  // The list shape's divisors, set up once by the launcher (the kernels of kFastDecode,
  // tile_scheduler_sm90.cuh, decode a position with them): m_tiles, the list's heads
  // (num_qo_heads >> gqa_pack), batch x those heads, max(1, kv_splits), the GQA group
  // (num_qo_heads / num_kv_heads). Last in the struct: the other fields keep their offsets.
  FastDivisor m_tiles_divisor, heads_divisor, pairs_divisor, splits_divisor, group_divisor;
#if TESSERA_SM90_TIMELINE
  unsigned* timeline = nullptr;  // phase_timeline_sm90.cuh's records (experiment builds only)
  int timeline_tiles = 0;        // records a consumer warpgroup
#endif
};

}  // namespace tessera::kernels::sm90
