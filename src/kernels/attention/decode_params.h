// What the paged decode kernels read: host-visible, no CUDA types but the stream. The work list,
// request table and merge map are the planner's (src/plan/decode_plan.h), already copied into the
// device workspace by the time a kernel runs.
#pragma once

#include <cstdint>

#include "plan/decode_plan.h"
#include "tessera/dtype.h"
#include "tessera/stream.h"

namespace tessera::kernels {

struct DecodeParams {
  // Q / O [total_q, num_qo_heads, head_dim]; element strides of rows and heads (head_dim is
  // contiguous). LSE [total_q, num_qo_heads] fp32, may be null.
  const void* q = nullptr;
  int64_t q_stride_row = 0, q_stride_head = 0;
  void* o = nullptr;
  int64_t o_stride_row = 0, o_stride_head = 0;
  float* lse = nullptr;
  int64_t lse_stride_row = 0, lse_stride_head = 0;

  // K / V pages: element strides of the page, token-in-page and head dims (NHD or HND alike),
  // each below 2^31 (checked on the host): 32-bit strides keep the per-row address math to
  // IMAD.WIDE (the page offset itself is 64-bit).
  const void* k_pages = nullptr;
  const void* v_pages = nullptr;
  int32_t k_stride_page = 0, k_stride_token = 0, k_stride_head = 0;
  int32_t v_stride_page = 0, v_stride_token = 0, v_stride_head = 0;
  const int32_t* kv_indices = nullptr;  // device: page ids; a work item's from its req.page_begin
  int page_size = 1;
  // token / page_size = (umulhi(token, page_magic) + token) >> page_shift (see page_index()).
  unsigned page_magic = 0;
  int page_shift = 0;

  // The plan, in the workspace.
  const plan::PlanHeader* header = nullptr;
  const plan::WorkItem* work = nullptr;
  const plan::MergeRow* merges = nullptr;
  const int64_t* slot_rows = nullptr;
  float* partial_o = nullptr;    // [partial rows, head_dim]
  float* partial_lse = nullptr;  // [partial rows], natural log
  int32_t* merge_counters = nullptr;  // [merge rows]: chunks finished

  int num_qo_heads = 0;
  int num_kv_heads = 0;
  bool causal = true;
  int window_left = -1;
  float scale = 0.f;
  float soft_cap = 0.f;
  // Last, so that the fields the release kernels read keep their offsets: pages of k_pages /
  // v_pages, read only by the device checks (device_check.cuh).
  int64_t num_pages = 0;
};

// What the decoder needs to know about its kernel on the current GPU.
struct DecodeKernelInfo {
  int ctas_per_sm = 0;                    // resident CTAs per SM (registers, shared memory)
  bool waits_for_preceding_grid = false;  // its code has the programmatic-launch wait (sm_90+ code)
};

// Grid size of one run: the decode kernel walks the work list with `decode_ctas` CTAs (one per
// item in eager mode; the capacity's maximum when captured into a CUDA graph).
struct DecodeLaunch {
  int decode_ctas = 0;
  int stages = 3;  // K/V pipeline stages: 3, or 2 where shared memory is short (dispatch picks)
  bool one_cta_per_sm = false;  // the CTA shape the plan was balanced for (3 stages only)
  bool programmatic = false;  // programmatic dependent launch (sm_90+)
};

}  // namespace tessera::kernels
