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
// swizzled boxes of 64 x 1 x box_rows; q's boxes are q_box_rows, k's and v's kv_box_rows.
// Throws tessera::Error if the driver rejects a map (strides or addresses it cannot describe).
RaggedTensorMaps ragged_tensor_maps(DType dtype, const PrefillParams& p, int head_dim, int q_box_rows,
                                    int kv_box_rows);

struct PagedTensorMaps {
  CUtensorMap q, k, v;
  int kv_box_rows = 0;           // rows per K / V box: gcd(page_size, kv_tile_rows)
  bool k_token_dim_first = false;  // k's second dim is the token dim (else the head dim)
  bool v_token_dim_first = false;
};

// q as ragged_tensor_maps; k and v as 4-D maps over the pages, innermost first: head_dim, then
// the page's head and token dims ordered by stride (NHD: head, token; HND: token, head), then
// pages; boxes of 64 x box_rows rows of one head in one page. Requires page_size % 8 == 0 (the
// dispatcher's rule for this family) and throws tessera::Error otherwise or if the driver
// rejects a map.
PagedTensorMaps paged_tensor_maps(DType dtype, const PrefillParams& p, int head_dim, int q_box_rows,
                                  int kv_tile_rows);

// o as a 3-D map for TMA stores (as q's: innermost head_dim, heads, rows; boxes of 64 x 1 x 64),
// into *map. Returns false, leaving *map alone, when the copy engine cannot write o: a base not
// 16-byte aligned, or a row / head stride (of a dim with more than one element) that is not a
// multiple of 16 bytes or not below 2^40 bytes. The kernel then stores O from registers.
bool output_tensor_map(DType dtype, const PrefillParams& p, int head_dim, CUtensorMap* map);

}  // namespace tessera::kernels::sm90
