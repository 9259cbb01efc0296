// Launch interface of the attention-state merge kernel (host-visible).
#pragma once

#include <cstdint>

#include "kernels/attention/prefill_params.h"
#include "tessera/dtype.h"
#include "tessera/stream.h"

namespace tessera::kernels {

// Where the input states live. Two layouts share one kernel:
//  - separate: state i (i < 2) is its own tensor, o_base[i] with strides o_row[i], o_head[i];
//  - stacked: n states in one tensor [rows, n, heads, head_dim], o_base[0] plus i * o_part.
struct MergeStatesParams {
  int num_states = 0;
  bool stacked = false;
  const void* o_base[2] = {nullptr, nullptr};
  const float* s_base[2] = {nullptr, nullptr};
  int64_t o_row[2] = {0, 0}, o_head[2] = {0, 0};
  int64_t s_row[2] = {0, 0}, s_head[2] = {0, 0};
  int64_t o_part = 0, s_part = 0;  // stacked only
  void* o_out = nullptr;
  float* s_out = nullptr;          // may be null
  int64_t o_out_row = 0, o_out_head = 0, s_out_row = 0, s_out_head = 0;
  int rows = 0, heads = 0, head_dim = 0;
  // launch_merge_step_states only: the step's rows and state count (its kv_splits), read on the
  // device; rows above is the most the step can have.
  const PrefillStep* step = nullptr;
};

// in_dtype: dtype of the input o's; out_dtype: of o_out. Supported pairs: (bf16, bf16),
// (fp16, fp16), (fp32, fp32), (fp32, bf16), (fp32, fp16). Validated by the caller.
void launch_merge_states(DType in_dtype, DType out_dtype, const MergeStatesParams& params,
                         cudaStream_t stream);

// A fixed-grid merge of stacked fp32 partials (BatchPrefillPaged with cuda_graph): rows and the
// state count from params.step on the device; a step with one state merges nothing.
void launch_merge_step_states(DType out_dtype, const MergeStatesParams& params, cudaStream_t stream);

}  // namespace tessera::kernels
