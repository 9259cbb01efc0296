// The attention mask, defined once for every family: a bottom-right aligned causal band and/or a
// left window, over one request's qo_len query rows and kv_len keys (docs/CONVENTIONS.md). Host
// code (the prefill planner's cost model) reads the same band.
#pragma once

#if defined(__CUDACC__)
#define TESSERA_BAND_FN __host__ __device__ __forceinline__
#else
#define TESSERA_BAND_FN inline
#endif

namespace tessera::kernels {

// The band of keys a query row may see: [key_begin(i), key_end(i)).
struct MaskBand {
  int qo_len, kv_len, offset;  // offset = kv_len - qo_len (bottom-right alignment)
  bool causal;
  int window_left;             // < 0: no window
  TESSERA_BAND_FN int key_begin(int row) const {
    const int first = row + offset - window_left;
    return window_left >= 0 && first > 0 ? first : 0;
  }
  TESSERA_BAND_FN int key_end(int row) const {
    return causal && row + offset + 1 < kv_len ? row + offset + 1 : kv_len;
  }
  TESSERA_BAND_FN bool visible(int row, int key) const {
    return key < kv_len && (!causal || key <= row + offset) &&
           (window_left < 0 || key >= row + offset - window_left);
  }
  // Whether some (row, key) of rows [first_row, last_row] x keys [n0, n0 + kBlockN) is outside the
  // band: only such tiles pay for the per-element test.
  TESSERA_BAND_FN bool tile_crosses_edge(int n0, int block_n, int first_row, int last_row) const {
    return n0 + block_n > kv_len || (causal && n0 + block_n - 1 > first_row + offset) ||
           (window_left >= 0 && n0 < last_row + offset - window_left);
  }
};

}  // namespace tessera::kernels
