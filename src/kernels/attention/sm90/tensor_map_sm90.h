// TMA tensor maps (CUtensorMap) of the Hopper prefill family's ragged Q, K and V, encoded on the
// host through the driver's cuTensorMapEncodeTiled (reached through cudart's driver entry point, so
// the library does not link libcuda).
#pragma once

#include <cuda.h>

#include "kernels/attention/prefill_params.h"
#include "tessera/dtype.h"

namespace tessera::kernels::sm90 {

struct RaggedTensorMaps {
  CUtensorMap q, k, v;
};

// 3-D maps over [rows, heads, head_dim] (innermost first: head_dim, heads, rows), 128-byte
// swizzled boxes of 64 x 1 x box_rows; q's boxes are q_box_rows, k's and v's kv_box_rows. With
// packed GQA (p.gqa_pack) q's and o's boxes are 64 x 2^gqa_pack x (rows >> gqa_pack): a KV
// head's query heads, token-major.
// Throws tessera::Error if the driver rejects a map (strides or addresses it cannot describe).
RaggedTensorMaps ragged_tensor_maps(DType dtype, const PrefillParams& p, int head_dim, int q_box_rows,
                                    int kv_box_rows);

struct PagedTensorMaps {
  CUtensorMap q, k, v;
  int kv_box_rows = 0;           // rows per K / V copy run: gcd(page_size, kv_tile_rows)
  // Grouped maps (both k and v): one box copies box_rows rows of every column block into a
  // Sw128GroupedTile. 5-D, innermost first: 64 columns, 8 tokens, column blocks, 8-token groups,
  // pages; NHD folds the head into the column blocks (its head_dim x heads row is contiguous:
  // head stride == head_dim), HND into the token groups (its page_size x heads rows are: head
  // stride == page_size x token stride). Otherwise (padded heads) the 4-D maps below.
  bool grouped = false;
  bool head_in_blocks = false;     // grouped NHD (else grouped HND)
  // Else (and always at head_dim 64, one column block) 4-D maps over the pages, innermost first:
  // head_dim, then the page's head and token dims ordered by stride (NHD: head, token; HND: token,
  // head), then pages; 64 x 8-row boxes (head_dim 64: 64 x kv_box_rows).
  bool k_token_dim_first = false;  // k's second dim is the token dim (else the head dim)
  bool v_token_dim_first = false;
};

// q as ragged_tensor_maps; k and v as above. Requires page_size % 8 == 0 (other page sizes are
// gathered without maps: GatheredKVSm90) and throws tessera::Error otherwise or if the driver
// rejects a map.
PagedTensorMaps paged_tensor_maps(DType dtype, const PrefillParams& p, int head_dim, int q_box_rows,
                                  int kv_tile_rows);

// q alone, as ragged_tensor_maps makes it (paged K / V the producer gathers, page_size % 8 != 0).
CUtensorMap query_tensor_map(DType dtype, const PrefillParams& p, int head_dim, int q_box_rows);

// o as a 3-D map for TMA stores (as q's: innermost head_dim, heads, rows; boxes of 64 rows),
// into *map. Returns false, leaving *map alone, when the copy engine cannot write o: a base not
// 16-byte aligned, or a row / head stride (of a dim with more than one element) that is not a
// multiple of 16 bytes or not below 2^40 bytes. The kernel then stores O from registers.
bool output_tensor_map(DType dtype, const PrefillParams& p, int head_dim, CUtensorMap* map);

}  // namespace tessera::kernels::sm90
