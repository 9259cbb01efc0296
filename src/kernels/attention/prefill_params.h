// What a prefill attention kernel reads: host-visible, no CUDA types but the stream.
#pragma once

#include <cstdint>

#include "tessera/dtype.h"
#include "tessera/stream.h"

namespace tessera::kernels {

// A paged prefill step as plan() wrote it into the workspace (BatchPrefillPaged with cuda_graph):
// kernels launched with grids of a fixed size read these instead of the launch's own counts, so
// one captured launch runs whatever step the last plan() describes.
struct PrefillStep {
  int32_t batch_size;
  int32_t max_qo_len;  // sizes the list of query tiles: batch x heads x ceil(max_qo_len / rows a tile)
  int32_t kv_splits;   // 1: no split; the kernels write O / LSE and the merge does nothing
  int32_t rows;        // query rows of the step (qo_indptr[batch]): what the merge covers
  int32_t slots;       // CTA slots of the schedule (plan/prefill_schedule.h)
  int32_t reserved[3];
};
// Slots of a fixed-grid schedule, at most (it sizes the workspace; 2 per SM of a 512-SM GPU).
constexpr int kMaxPrefillSlots = 1024;

struct PrefillParams {
  // Ragged Q/O [total_q, num_qo_heads, head_dim], K/V [total_kv, num_kv_heads, head_dim] (or pages,
  // see below); element strides of the row and head dims (head_dim is contiguous).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // [total_q, num_qo_heads], may be null
  int64_t q_stride_row = 0, q_stride_head = 0;
  int64_t k_stride_row = 0, k_stride_head = 0;
  int64_t v_stride_row = 0, v_stride_head = 0;
  int64_t o_stride_row = 0, o_stride_head = 0;
  int64_t lse_stride_row = 0, lse_stride_head = 0;
  const int32_t* qo_indptr = nullptr;  // device [batch + 1]
  const int32_t* kv_indptr = nullptr;  // device [batch + 1]: rows (ragged) or pages (paged)
  int64_t q_rows = 0;   // rows of the q tensor (and o)
  int64_t kv_rows = 0;  // rows of the ragged k / v tensors (0 when paged)

  // Paged K/V (paged == true): k / v are the page tensors, element strides of the page, token and
  // head dims below (each < 2^31), request r owns pages kv_indices[kv_indptr[r] ..] and its kv_len
  // is page_size * (pages - 1) + kv_last_page_len[r]; token / page_size is computed as
  // (umulhi(token, page_magic) + token) >> page_shift.
  bool paged = false;
  const int32_t* kv_indices = nullptr;
  const int32_t* kv_last_page_len = nullptr;
  int page_size = 1;
  unsigned page_magic = 0;
  int page_shift = 0;
  int64_t num_pages = 0;  // pages of the k / v page tensors
  int32_t k_stride_page = 0, k_stride_token = 0;
  int32_t v_stride_page = 0, v_stride_token = 0;
  int batch_size = 0;
  int num_qo_heads = 0;
  int num_kv_heads = 0;
  // Packed GQA (the Hopper family only; 0 elsewhere): a query tile holds the 2^gqa_pack query
  // heads of one KV head, num_qo_heads == num_kv_heads << gqa_pack, its rows (token, head in the
  // group) token-major, so kBlockM / 2^gqa_pack tokens a tile. A request shorter than a tile then
  // fills it with its group's heads instead of leaving rows empty, and the list counts KV heads.
  int gqa_pack = 0;
  int max_qo_len = 0;  // from the host copy of qo_indptr: sizes the grid
  // From the host copies: every request has the same qo_len and the same kv_len (the Hopper
  // family's schedule pairs tiles by cost only then; prefill_dispatch.cpp).
  bool uniform_lengths = true;
  // From the host copies: the fewest keys a request has before its first query row (kv_len -
  // qo_len over the requests with rows; -1: not computed) and the keys of all requests. The Hopper
  // family's one-tile causal grids keep a head's query tiles together when those keys' K / V
  // outgrow the L2 (prefill_dispatch.cpp).
  int64_t shortest_history = -1;
  int64_t total_keys = 0;
  // From the host copies: the keys a query row sees under the mask, averaged over the batch's rows
  // weighted by those keys, so by where the work is (sum of k_r^2 over sum of k_r; 0: not
  // computed). The Hopper family picks its hd128 K / V tile width by it (prefill_dispatch.cpp).
  int64_t work_weighted_row_keys = 0;
  bool grid_tiles_last = false;  // set by the launcher: the grid's order (see prefill_sm80.cuh)
  // Mask: bottom-right causal and/or a left window (window_left < 0: none).
  bool causal = false;
  int window_left = -1;
  // Logits: s = scale * q.k; with soft_cap > 0, s = soft_cap * tanh(s / soft_cap).
  float scale = 0.f;
  float soft_cap = 0.f;
  // Split-KV (kv_splits > 1, both families): each query tile's visible KV tiles are cut into
  // kv_splits equal runs (the last shorter, some possibly empty), one work tile each, which write
  // fp32 partial states (O normalised, natural-log LSE; no visible key: O = 0, LSE = -inf) to
  // partial_o [kv_splits, q_rows, num_qo_heads, head_dim] and partial_lse [kv_splits, q_rows,
  // num_qo_heads]; the caller merges them.
  int kv_splits = 1;
  float* partial_o = nullptr;
  float* partial_lse = nullptr;
  // Fixed-grid launch (BatchPrefillPaged with cuda_graph): batch_size, max_qo_len and kv_splits
  // come from *step on the device (the fields above hold the capture step's, for the host), and
  // partial_o / partial_lse are set whether or not the step splits. The plan's static schedule:
  // slot s runs the list positions slot_tiles[slot_begin[s] .. slot_begin[s + 1]), in order.
  const PrefillStep* step = nullptr;
  const int32_t* slot_begin = nullptr;
  const int32_t* slot_tiles = nullptr;
};

// Portable (sm_80+) kernel family. dtype: bf16 or fp16; head_dim: 64, 128 or 256 (as compiled,
// see the instantiation list). Throws tessera::Error for a combination that was not compiled.
void launch_prefill_sm80(DType dtype, int head_dim, const PrefillParams& params,
                         cudaStream_t stream);

// Whether the portable family was compiled for (dtype, head_dim).
bool prefill_sm80_compiled(DType dtype, int head_dim);

// Query rows a CTA of the portable family computes at head_dim on the current GPU (the compact
// tile shape's where its shared memory asks for that one).
int prefill_sm80_block_m(int head_dim);

}  // namespace tessera::kernels
