// The attention mask, defined once for every family: a bottom-right aligned causal band and/or a
// left window, over one request's qo_len query rows and kv_len keys (docs/CONVENTIONS.md).
#pragma once

#include <cuda_runtime.h>

namespace tessera::kernels {

// The band of keys a query row may see: [key_begin(i), key_end(i)).
struct MaskBand {
  int qo_len, kv_len, offset;  // offset = kv_len - qo_len (bottom-right alignment)
  bool causal;
  int window_left;             // < 0: no window
  __device__ int key_begin(int row) const {
    return window_left >= 0 ? max(0, row + offset - window_left) : 0;
  }
  __device__ int key_end(int row) const {
    return causal ? min(kv_len, row + offset + 1) : kv_len;
  }
  __device__ bool visible(int row, int key) const {
    return key < kv_len && (!causal || key <= row + offset) &&
           (window_left < 0 || key >= row + offset - window_left);
  }
  // Whether some (row, key) of rows [first_row, last_row] x keys [n0, n0 + kBlockN) is outside the
  // band: only such tiles pay for the per-element test.
  __device__ bool tile_crosses_edge(int n0, int block_n, int first_row, int last_row) const {
    return n0 + block_n > kv_len || (causal && n0 + block_n - 1 > first_row + offset) ||
           (window_left >= 0 && n0 < last_row + offset - window_left);
  }
};

}  // namespace tessera::kernels
