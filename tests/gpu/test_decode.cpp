// BatchDecoder (paged decode, plan / run) on the GPU against the fp64 CPU reference, with the
// tolerance rule of docs/CONVENTIONS.md: max error <= 2 x (max error of the naive computation in
// the kernel's precision) + a floor of 1e-4, for O and for LSE.
//
// Pages are handed out in shuffled order, and every cache element no request owns (the tail of a
// last page, spare pages, stride padding) holds NaN, as does the row padding of q: a kernel that
// reads outside the page table, or lets a masked slot leak into P.V, fails loudly. Outputs are
// poisoned before each run; every element of o / lse must be written and nothing around them.
#include <gmock/gmock.h>

#include <algorithm>
#include <cstring>
#include <array>
#include <functional>
#include <numeric>

#include "dispatch/decode_dispatch.h"
#include "dispatch/prefill_dispatch.h"
#include "gpu/gpu_test_util.h"
#include "gpu/paged_kv_util.h"
#include "reference/attention_ref.h"
#include "tessera/decode.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

// ---- What this build compiled -------------------------------------------------------------------
// A narrowed build (TESSERA_HEAD_DIMS / TESSERA_DTYPES) tests only what it compiled.
bool decode_compiled(int head_dim, DType dtype) { return dispatch::decode_compiled(dtype, head_dim); }

// hd128 / bf16 when compiled (the common serving shape), else the first compiled pair.
void pick_compiled(int& head_dim, DType& dtype) {
  for (int hd : {128, 64, 256}) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      if (decode_compiled(hd, dt)) {
        head_dim = hd;
        dtype = dt;
        return;
      }
    }
  }
}

Expected reference(const HostPagedKV& kv, const HostRows& q, const std::vector<int32_t>& qo_indptr,
                   const DecodeConfig& cfg) {
  ref::AttentionParams p;
  p.num_qo_heads = cfg.num_qo_heads;
  p.num_kv_heads = cfg.num_kv_heads;
  p.head_dim = cfg.head_dim;
  p.causal = cfg.causal;
  p.window_left = cfg.window_left;
  p.scale = cfg.scale;
  p.soft_cap = cfg.soft_cap;
  const ref::PagedKV source = kv.reference();
  Expected e;
  std::vector<double> o_naive, lse_naive;
  ref::attention(q.dense.data(), qo_indptr, source, p, e.o, e.lse);
  ref::attention_naive_lowp(q.dense.data(), qo_indptr, source, p, cfg.dtype == DType::kBF16 ? 7 : 10,
                            o_naive, lse_naive);
  e.o_naive_err = max_finite_diff(o_naive, e.o);
  e.lse_naive_err = max_finite_diff(lse_naive, e.lse);
  return e;
}

void check_against(const Outputs& got, const Expected& want, const std::string& what) {
  EXPECT_EQ(got.stray, 0u) << what << ": elements outside the o / lse views were written";
  expect_within_rule(got.o, want.o, want.o_naive_err, 1e-4, what + " o");
  expect_within_rule(got.lse, want.lse, want.lse_naive_err, 1e-4, what + " lse");
}

// ---- One decode step -------------------------------------------------------------------------------
struct DecodeCase {
  KVGeometry kv;
  int num_qo_heads = 8;
  std::vector<int> kv_len;
  std::vector<int> qo_len;  // empty: one query token per request
  int max_qo_len = 1;
  int max_batch_size = 0;   // 0: the batch size
  bool causal = true;
  int window_left = -1;
  float soft_cap = 0.f;
  float scale = 0.f;
  int64_t q_pad = 0;        // extra elements per row of q and o (strided rows)
  int pipeline_stages = 0;  // 0: the kernel the GPU gets by default
  int ctas_per_sm = 0;      // 0: the plan picks the CTA shape; 1 or 2 forces it
};

std::vector<int> qo_lens(const DecodeCase& c) {
  return c.qo_len.empty() ? std::vector<int>(c.kv_len.size(), 1) : c.qo_len;
}

DecodeConfig config_of(const DecodeCase& c) {
  DecodeConfig cfg;
  cfg.num_qo_heads = c.num_qo_heads;
  cfg.num_kv_heads = c.kv.num_kv_heads;
  cfg.head_dim = c.kv.head_dim;
  cfg.page_size = c.kv.page_size;
  cfg.dtype = c.kv.dtype;
  cfg.layout = c.kv.layout;
  cfg.max_batch_size = c.max_batch_size > 0 ? c.max_batch_size : static_cast<int>(c.kv_len.size());
  cfg.max_qo_len = c.max_qo_len;
  cfg.causal = c.causal;
  cfg.window_left = c.window_left;
  cfg.scale = c.scale;
  cfg.soft_cap = c.soft_cap;
  cfg.pipeline_stages = c.pipeline_stages;
  cfg.ctas_per_sm = c.ctas_per_sm;
  return cfg;
}

std::string list_of(const std::vector<int>& v) {
  if (v.size() > 16) {
    return "[" + std::to_string(v.size()) + " requests, longest " +
           std::to_string(*std::max_element(v.begin(), v.end())) + "]";
  }
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string describe(const DecodeCase& c) {
  std::string s = std::string(dtype_name(c.kv.dtype)) + " hd" + std::to_string(c.kv.head_dim) + " " +
                  kv_layout_name(c.kv.layout) + " page " + std::to_string(c.kv.page_size) + " heads " +
                  std::to_string(c.num_qo_heads) + "/" + std::to_string(c.kv.num_kv_heads) +
                  " kv_len " + list_of(c.kv_len) + " qo_len " + list_of(qo_lens(c));
  if (c.causal && c.max_qo_len > 1) s += " causal";
  if (!c.causal) s += " non-causal";
  if (c.window_left >= 0) s += " window " + std::to_string(c.window_left);
  if (c.soft_cap > 0) s += " soft_cap " + std::to_string(c.soft_cap);
  if (c.scale > 0) s += " scale " + std::to_string(c.scale);
  if (c.kv.head_pad || c.kv.k_page_pad || c.kv.v_page_pad) s += " strided pages";
  if (c.q_pad) s += " strided rows";
  if (c.pipeline_stages) s += " " + std::to_string(c.pipeline_stages) + " stages";
  if (c.ctas_per_sm) s += " " + std::to_string(c.ctas_per_sm) + " CTA(s) per SM";
  return s;
}

// A case's inputs on the host and the device, with poisoned output buffers.
struct DecodeProblem {
  DecodeConfig cfg;
  std::mt19937 rng;
  HostPagedKV kv;
  std::vector<int32_t> qo_indptr;
  HostRows q;
  DevicePagedKV dkv;
  DeviceBuffer dq, o, lse;

  DecodeProblem(const DecodeCase& c, uint32_t seed)
      : cfg(config_of(c)), rng(seed), kv(make_paged_kv(c.kv, c.kv_len, 0, rng)),
        qo_indptr(indptr_of(qo_lens(c))),
        q(random_rows(qo_indptr.back(), c.num_qo_heads, c.kv.head_dim, c.q_pad, c.kv.dtype, rng, 2.f)),
        dkv(kv, kv.batch()),
        dq(size_t(std::max<int64_t>(q.rows * q.row_stride, 8)) * 2),
        o(size_t(std::max<int64_t>(q.rows * q.row_stride, 8)) * 2),
        lse(size_t(std::max<int64_t>(q.rows * q.heads, 2)) * 4) {
    dkv.upload(kv);
    dq.upload(q.bits);
  }

  TensorView q_view() const {
    return TensorView::strided(dq.get(), cfg.dtype, {q.rows, q.heads, q.dim}, {q.row_stride, q.dim, 1});
  }
  TensorView o_view() const {
    return TensorView::strided(o.get(), cfg.dtype, {q.rows, q.heads, q.dim}, {q.row_stride, q.dim, 1});
  }
  TensorView lse_view() const {
    return TensorView::contiguous(lse.get(), DType::kFP32, {q.rows, q.heads});
  }
  PagedKVCache cache() const { return dkv.cache(kv); }
  PageTable table() const { return dkv.table(kv); }
  OutputShape out_shape() const { return {q.rows, q.heads, q.dim, q.row_stride, cfg.dtype}; }

  void plan(BatchDecoder& d, cudaStream_t stream = nullptr) const {
    d.plan(qo_indptr.data(), table(), stream, kv.num_pages);
  }
  void run(BatchDecoder& d, cudaStream_t stream = nullptr) const {
    d.run(q_view(), cache(), table(), o_view(), lse_view(), stream);
  }
  // Poisons o / lse, runs, waits and reads them back.
  Outputs run_and_fetch(BatchDecoder& d, cudaStream_t stream = nullptr) {
    o.poison();
    lse.poison();
    run(d, stream);
    if (cudaStreamSynchronize(stream) != cudaSuccess) throw std::runtime_error("run() failed on the GPU");
    return fetch(o, lse, out_shape());
  }
  Expected expected() const { return reference(kv, q, qo_indptr, cfg); }
};

// Plans and runs a case twice (the second run must be bitwise identical) and checks O and LSE
// against the fp64 reference; `info` receives what the plan decided.
void run_case(const DecodeCase& c, uint32_t seed, DecodePlanInfo* info = nullptr) {
  SCOPED_TRACE(describe(c));
  if (!decode_compiled(c.kv.head_dim, c.kv.dtype)) {
    GTEST_SKIP() << describe(c) << ": not compiled in this build";
  }
  DecodeProblem p(c, seed);
  DeviceBuffer ws(BatchDecoder::workspace_bytes(p.cfg));
  BatchDecoder decoder(p.cfg, ws.get(), ws.bytes());
  p.plan(decoder);
  if (info) *info = decoder.last_plan();
  const Outputs first = p.run_and_fetch(decoder);
  const Outputs second = p.run_and_fetch(decoder);
  EXPECT_TRUE(bitwise_equal(first, second)) << "a second run() with the same plan differs";
  check_against(first, p.expected(), "decode");
}

// ---- 1. Page sizes and layouts ---------------------------------------------------------------------
TEST(GpuDecode, PageSizesAndLayouts) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 1;
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    for (int page_size : {1, 16, 64, 256}) {
      DecodeCase c;
      c.kv.layout = layout;
      c.kv.page_size = page_size;
      c.kv.dtype = DType::kBF16;
      c.kv.head_dim = 128;
      c.num_qo_heads = 8;
      c.kv.num_kv_heads = 2;
      // A request with no KV (o = 0, lse = -inf) and one with no query token this step.
      c.kv_len = {1, 54, 0, 97, 700, 33};
      c.qo_len = {1, 1, 1, 1, 1, 0};
      run_case(c, seed++);
    }
  }
}

// ---- 2. GQA groups, head dims, dtypes --------------------------------------------------------------
TEST(GpuDecode, GroupsHeadDimsAndDtypes) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 100;
  for (int head_dim : {64, 128, 256}) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      if (!decode_compiled(head_dim, dtype)) continue;
      // Groups 1, 4, 8, 16.
      for (auto [qo_heads, kv_heads] : {std::pair{2, 2}, {8, 2}, {8, 1}, {16, 1}}) {
        DecodeCase c;
        c.kv.dtype = dtype;
        c.kv.head_dim = head_dim;
        c.kv.layout = dtype == DType::kBF16 ? KVLayout::kNHD : KVLayout::kHND;
        c.num_qo_heads = qo_heads;
        c.kv.num_kv_heads = kv_heads;
        c.kv_len = {97, 1, 577, 16};
        run_case(c, seed++);
      }
    }
  }
}

// ---- 2b. The 2-stage kernel (what GPUs with 99 KB of shared memory per block run) ---------------
TEST(GpuDecode, TwoStagePipeline) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 150;
  for (int head_dim : {64, 128, 256}) {
    DecodeCase c;
    c.kv.dtype = DType::kBF16;
    if (!decode_compiled(head_dim, c.kv.dtype)) c.kv.dtype = DType::kFP16;
    c.kv.head_dim = head_dim;
    c.kv.page_size = head_dim == 128 ? 16 : 1;
    c.kv.layout = head_dim == 256 ? KVLayout::kHND : KVLayout::kNHD;
    c.num_qo_heads = 8;
    c.kv.num_kv_heads = 2;
    c.pipeline_stages = 2;
    c.kv_len = {1, 54, 0, 97, 700, 16385};  // the long request is split and merged
    run_case(c, seed++);
  }
}

// What a GPU with 99 KB of shared memory per block (sm_86, sm_89) picks: 2 stages where 3 do not
// fit; forcing 3 there is an error naming the field.
TEST(GpuDecode, StagesFollowSharedMemory) {
  TESSERA_REQUIRE_GPU();
  const SharedMemoryLimit limit(99 * 1024);  // sm_86 / sm_89
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.kv.page_size = 16;
  c.num_qo_heads = 8;
  c.kv.num_kv_heads = 2;
  c.kv_len = {300, 16385};
  run_case(c, 170);
  if (c.kv.head_dim >= 128) {  // 3 stages need 103 / 107 KB there
    c.pipeline_stages = 3;
    const DecodeConfig cfg = config_of(c);
    try {
      (void)BatchDecoder::workspace_bytes(cfg);
      ADD_FAILURE() << "3 stages cannot fit in 99 KB at head_dim " << c.kv.head_dim;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("pipeline_stages"));
      EXPECT_THAT(e.what(), HasSubstr("shared memory"));
    }
  }
}

// ---- 2c. The one-CTA-per-SM shape (twice the warps and stage bytes; sm_90, hd128 / hd256) ------
bool one_cta_per_sm_fits(int head_dim, DType dtype) {
  return decode_compiled(head_dim, dtype) && dispatch::decode_one_cta_per_sm_fits(head_dim);
}

TEST(GpuDecode, OneCtaPerSmShape) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 180;
  int tested = 0;
  for (int head_dim : {128, 256}) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      if (!one_cta_per_sm_fits(head_dim, dtype)) continue;
      ++tested;
      DecodeCase c;
      c.kv.dtype = dtype;
      c.kv.head_dim = head_dim;
      c.ctas_per_sm = 1;
      c.num_qo_heads = 8;
      c.kv.num_kv_heads = 2;
      for (auto [layout, page_size] : {std::pair{KVLayout::kNHD, 16}, {KVLayout::kHND, 1}, {KVLayout::kNHD, 64}}) {
        c.kv.layout = layout;
        c.kv.page_size = page_size;
        // A request with no KV, one with no query, and a long one that is split and merged.
        c.kv_len = {1, 54, 0, 97, 700, 33, 16385};
        c.qo_len = {1, 1, 1, 1, 1, 0, 1};
        DecodePlanInfo info;
        run_case(c, seed++, &info);
        EXPECT_EQ(info.ctas_per_sm, 1);
        EXPECT_GT(info.num_split_requests, 0) << "the 16385-token request should be split";
      }
      // Group 16 x 3 verification tokens (48 rows: three passes), a window and a soft cap.
      DecodeCase m = c;
      m.kv.layout = KVLayout::kNHD;
      m.kv.page_size = 16;
      m.num_qo_heads = 16;
      m.kv.num_kv_heads = 1;
      m.max_qo_len = 8;
      m.kv_len = {97, 4000, 1, 20000};
      m.qo_len = {3, 8, 1, 2};
      m.window_left = 1500;
      m.soft_cap = 30.f;
      run_case(m, seed++);
    }
  }
  if (tested == 0) GTEST_SKIP() << "this GPU or build has no one-CTA-per-SM decode shape (sm_90 shared memory, hd128/hd256)";
  // Where the shape does not exist, forcing it is an error naming the field.
  DecodeCase small;
  small.kv.head_dim = 64;
  small.kv_len = {10};
  if (decode_compiled(64, small.kv.dtype)) {
    small.ctas_per_sm = 1;
    expect_error([&] { (void)BatchDecoder::workspace_bytes(config_of(small)); }, {"ctas_per_sm", "head_dim 64"});
  }
}

// The plan picks the shape per step: one CTA per SM, unsplit, when the batch's (request, KV head)
// pairs about fill the SMs; the default shape when they overfill them, or when the GPU's shared
// memory cannot hold the other.
TEST(GpuDecode, PlanPicksTheCtaShape) {
  TESSERA_REQUIRE_GPU();
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  if (!one_cta_per_sm_fits(c.kv.head_dim, c.kv.dtype)) {
    GTEST_SKIP() << "this GPU or build has no one-CTA-per-SM decode shape";
  }
  int num_sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  c.num_qo_heads = 32;
  c.kv.num_kv_heads = 8;
  c.kv.page_size = 16;
  c.kv_len.assign(num_sms / 8, 1500);  // num_sms / 8 x 8 heads <= num_sms items
  DecodePlanInfo info;
  run_case(c, 190, &info);
  EXPECT_EQ(info.ctas_per_sm, 1);
  EXPECT_EQ(info.num_split_requests, 0);
  c.kv_len.assign(num_sms / 2, 300);  // 4 x num_sms items
  run_case(c, 191, &info);
  EXPECT_EQ(info.ctas_per_sm, 2);

  // Where the shared memory per block cannot hold that shape (an A100's 163 KB, imposed here),
  // the first batch gets the default one, and forcing the shape is an error naming the field.
  const SharedMemoryLimit limit(163 * 1024);
  c.kv_len.assign(num_sms / 8, 1500);
  run_case(c, 192, &info);
  EXPECT_EQ(info.ctas_per_sm, 2);
  c.ctas_per_sm = 1;
  expect_error([&] { (void)BatchDecoder::workspace_bytes(config_of(c)); }, {"ctas_per_sm", "shared memory"});
}

// ---- 3. Split-KV (flash-decoding) -------------------------------------------------------------------
TEST(GpuDecodeSplit, LongRequestAlone) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 200;
  for (auto [layout, page_size] : {std::pair{KVLayout::kNHD, 16}, {KVLayout::kNHD, 1}, {KVLayout::kHND, 64}}) {
    DecodeCase c;
    pick_compiled(c.kv.head_dim, c.kv.dtype);
    c.kv.layout = layout;
    c.kv.page_size = page_size;
    c.kv_len = {16385};
    DecodePlanInfo info;
    run_case(c, seed++, &info);
    EXPECT_GT(info.chunk_tokens, 0) << "a lone 16385-token request should be split";
    EXPECT_LT(info.chunk_tokens, 16385);
    EXPECT_EQ(info.num_split_requests, c.kv.num_kv_heads) << "every KV head of the request is split";
  }
}

TEST(GpuDecodeSplit, LongRequestsInSmallBatches) {
  TESSERA_REQUIRE_GPU();
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.kv_len = {16385, 54, 1, 0, 700};  // long, short, single-token, no KV, medium
  DecodePlanInfo info;
  run_case(c, 250, &info);
  EXPECT_GT(info.chunk_tokens, 0);
  EXPECT_GE(info.num_split_requests, c.kv.num_kv_heads);

  c.kv.layout = KVLayout::kHND;
  c.kv_len = {16385, 16385};
  run_case(c, 251, &info);
  EXPECT_GT(info.chunk_tokens, 0);
  EXPECT_EQ(info.num_split_requests, 2 * c.kv.num_kv_heads);
}

// Split chunks of several query rows, and chunks that a window masks entirely (their partial
// states are -inf and must contribute nothing to the merge).
TEST(GpuDecodeSplit, MultiTokenAndWindowedLongRequests) {
  TESSERA_REQUIRE_GPU();
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.max_qo_len = 4;
  c.kv_len = {16385, 300};
  c.qo_len = {4, 3};
  DecodePlanInfo info;
  run_case(c, 260, &info);
  EXPECT_GT(info.chunk_tokens, 0);
  // A window of 3000 keys: only the last ~3000 keys are planned (and split into chunks), starting
  // mid-page; a window of 37 is read by one unsplit item per head.
  c.window_left = 3000;
  run_case(c, 261, &info);
  EXPECT_GT(info.chunk_tokens, 0);
  EXPECT_LT(info.num_work_items, 2 * c.kv.num_kv_heads * (3004 / info.chunk_tokens + 2));
  c.window_left = 37;
  run_case(c, 262, &info);
  EXPECT_EQ(info.chunk_tokens, 0) << "41 visible keys per request need no split";
}

// The same long request inside a batch that fills the GPU on its own: only the long request is
// split (to the average load per CTA slot); the short ones run whole.
TEST(GpuDecodeSplit, OverfilledBatchSplitsOnlyItsLongRequest) {
  TESSERA_REQUIRE_GPU();
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.num_qo_heads = 8;
  c.kv.num_kv_heads = 8;  // 1024 requests x 8 KV heads: far more work items than one wave
  std::mt19937 rng(270);
  std::uniform_int_distribution<int> short_len(1, 40);
  c.kv_len = {16385};
  while (c.kv_len.size() < 1024) c.kv_len.push_back(short_len(rng));
  DecodePlanInfo info;
  run_case(c, 271, &info);
  // The long request exceeds the average load per CTA slot and is split (once per KV head); the
  // short ones stay whole.
  EXPECT_GT(info.chunk_tokens, 0);
  EXPECT_EQ(info.num_split_requests, c.kv.num_kv_heads);
  EXPECT_GT(info.num_work_items, 1024 * c.kv.num_kv_heads);

  c.kv_len.erase(c.kv_len.begin());
  c.kv_len.push_back(40);
  run_case(c, 272, &info);
  EXPECT_EQ(info.chunk_tokens, 0) << "a batch of equal short requests should not be split ("
                                  << info.num_work_items << " work items)";
  EXPECT_EQ(info.num_split_requests, 0);
}

// ---- 4. Multi-token verification, windows, soft-cap --------------------------------------------------
// ---- 3b. Skewed batches (the planner's makespan objective, two-level merges) ------------------------
// One long request among 63 short ones, with 8 KV heads (group 4) and with 1 KV head (group 8, a
// tensor-parallel slice): the long request is split into many chunks, which merge in two levels
// where they are many (1 KV head: 8 rows per partial); results against the fp64 reference and a
// second run bitwise identical (run_case).
TEST(GpuDecodeSkew, OneLongRequestAmongManyShortOnes) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 280;
  for (int kv_heads : {8, 1}) {
    for (int long_len : {32768, 65536}) {
      DecodeCase c;
      pick_compiled(c.kv.head_dim, c.kv.dtype);
      c.kv.num_kv_heads = kv_heads;
      c.num_qo_heads = kv_heads == 8 ? 32 : 8;
      std::mt19937 rng(seed);
      std::uniform_int_distribution<int> short_len(16, 2048);
      c.kv_len.assign(64, 0);
      for (int& len : c.kv_len) len = short_len(rng);
      c.kv_len[37] = long_len;
      DecodePlanInfo info;
      run_case(c, seed++, &info);
      EXPECT_GE(info.num_split_requests, kv_heads) << "the long request is split";
      if (kv_heads == 1) {
        EXPECT_GT(info.num_merge_rows, info.num_split_requests)
            << "many chunks of 8 rows merge in two levels (" << info.num_work_items << " work items, chunk "
            << info.chunk_tokens << ")";
      }
    }
  }
}

// A heavy tail (a few requests of 10K-32K, the rest of 40-900 tokens), many tiny requests and
// empty ones, in one batch.
TEST(GpuDecodeSkew, HeavyTailWithTinyAndEmptyRequests) {
  TESSERA_REQUIRE_GPU();
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.num_qo_heads = 32;
  c.kv.num_kv_heads = 8;
  std::mt19937 rng(290);
  std::uniform_int_distribution<int> body(40, 900);
  for (int i = 0; i < 28; ++i) c.kv_len.push_back(body(rng));
  c.kv_len.insert(c.kv_len.end(), {32768, 20000, 12000, 10000, 0, 1, 3, 0});
  std::shuffle(c.kv_len.begin(), c.kv_len.end(), rng);
  DecodePlanInfo info;
  run_case(c, 291, &info);
  EXPECT_GE(info.num_split_requests, 4 * c.kv.num_kv_heads) << "every long request is split";
  c.kv.num_kv_heads = 1;
  c.num_qo_heads = 8;
  run_case(c, 292, &info);
}

TEST(GpuDecode, MultiTokenVerification) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 300;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (bool causal : {true, false}) {
      DecodeCase c;
      pick_compiled(c.kv.head_dim, c.kv.dtype);
      c.kv.dtype = dtype;
      if (!decode_compiled(c.kv.head_dim, dtype)) continue;
      c.causal = causal;
      c.max_qo_len = 4;
      // qo_len == kv_len (the first row sees one key), no KV, no query, page-boundary lengths.
      c.kv_len = {97, 700, 1000, 4, 0, 54, 33, 16};
      c.qo_len = {2, 4, 3, 4, 2, 0, 1, 4};
      run_case(c, seed++);
    }
  }
  // The largest tile of query rows: group 16 x max_qo_len 8.
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.num_qo_heads = 16;
  c.kv.num_kv_heads = 1;
  c.max_qo_len = 8;
  c.kv_len = {300, 8, 1000};
  c.qo_len = {8, 5, 7};
  run_case(c, seed++);
}

TEST(GpuDecode, SlidingWindowAndSoftCap) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 400;
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.kv_len = {1, 37, 38, 39, 700, 5000};  // shorter than, at and past the window
  c.window_left = 37;
  run_case(c, seed++);
  c.window_left = 0;  // only the last key
  run_case(c, seed++);
  c.window_left = 37;
  c.max_qo_len = 4;
  c.qo_len = {1, 4, 2, 3, 4, 4};
  run_case(c, seed++);

  DecodeCase s;
  pick_compiled(s.kv.head_dim, s.kv.dtype);
  s.kv_len = {97, 700, 1, 2000};
  s.soft_cap = 30.f;
  run_case(s, seed++);
  s.scale = 1.f;  // logits of tens: the cap bites
  run_case(s, seed++);
  s.soft_cap = 0.f;
  s.scale = 0.05f;
  run_case(s, seed++);
}

// ---- 5. Strided pages and rows ---------------------------------------------------------------------
TEST(GpuDecode, StridedPagesAndRows) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 500;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      for (int page_size : {1, 16}) {
        DecodeCase c;
        pick_compiled(c.kv.head_dim, c.kv.dtype);
        c.kv.dtype = dtype;
        if (!decode_compiled(c.kv.head_dim, dtype)) continue;
        c.kv.layout = layout;
        c.kv.page_size = page_size;
        c.kv.head_pad = 8;     // head / slot strides larger than head_dim
        c.kv.k_page_pad = 24;  // page strides larger than a page, and different for K and V
        c.kv.v_page_pad = 40;
        c.q_pad = 24;          // q / o row stride larger than num_qo_heads x head_dim
        c.max_qo_len = 2;
        c.kv_len = {1, 54, 97, 700};
        c.qo_len = {1, 2, 1, 2};
        run_case(c, seed++);
      }
    }
  }
}

// ---- 6. Determinism --------------------------------------------------------------------------------
TEST(GpuDecode, RepeatedRunsAreBitwiseIdentical) {
  TESSERA_REQUIRE_GPU();
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.kv_len = {16385, 54, 700};  // split, so the merge is covered too
  DecodeProblem p(c, 600);
  DeviceBuffer ws(BatchDecoder::workspace_bytes(p.cfg));
  BatchDecoder decoder(p.cfg, ws.get(), ws.bytes());
  p.plan(decoder);
  const Outputs first = p.run_and_fetch(decoder);
  check_against(first, p.expected(), "first run");
  EXPECT_TRUE(bitwise_equal(first, p.run_and_fetch(decoder))) << "second run() differs";
  p.plan(decoder);  // the same step planned again
  EXPECT_TRUE(bitwise_equal(first, p.run_and_fetch(decoder))) << "run() after a second plan() differs";
  Stream stream;    // planned and run on another stream
  p.plan(decoder, stream);
  EXPECT_TRUE(bitwise_equal(first, p.run_and_fetch(decoder, stream))) << "run() on another stream differs";
}

// Batch-invariant mode (DecodeConfig::batch_invariant): the first `keep` requests of a batch, planned
// and run as a batch of their own over the same cache, give bitwise the same O and LSE rows as in
// the whole batch. (A long request among short ones: the balancing planner would split it one way
// alone and another way in the crowd.) With the mode's fixed chunks (the long requests split into
// chunks of at most 2048 keys, alone as in the crowd) and without (nothing split).
TEST(GpuDecode, BatchInvariantModeKeepsARequestsBits) {
  TESSERA_REQUIRE_GPU();
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.kv_len.assign(40, 300);
  c.kv_len[0] = 20000;
  c.kv_len[1] = 4100;
  DecodeProblem p(c, 610);
  for (const int chunk : {0, 2048}) {
    SCOPED_TRACE("batch_invariant_chunk_tokens " + std::to_string(chunk));
    p.cfg.batch_invariant = true;
    p.cfg.batch_invariant_chunk_tokens = chunk;
    DeviceBuffer ws(BatchDecoder::workspace_bytes(p.cfg));
    BatchDecoder decoder(p.cfg, ws.get(), ws.bytes());
    p.plan(decoder);
    const int split_pairs = decoder.last_plan().num_split_requests;
    EXPECT_EQ(split_pairs, chunk == 0 ? 0 : 2 * c.kv.num_kv_heads);  // requests 0 and 1, every KV head
    const Outputs whole = p.run_and_fetch(decoder);
    check_against(whole, p.expected(), "batch-invariant decode");
    for (const int keep : {1, 2}) {
      // The sub-batch: prefixes of the same device arrays, the same q and o rows.
      PageTable sub = p.table();
      sub.indptr = TensorView::contiguous(sub.indptr.data, DType::kInt32, {keep + 1});
      sub.indices = TensorView::contiguous(sub.indices.data, DType::kInt32, {p.kv.indptr[keep]});
      sub.last_page_len = TensorView::contiguous(sub.last_page_len.data, DType::kInt32, {keep});
      const TensorView q_sub = TensorView::strided(p.dq.get(), p.cfg.dtype, {keep, p.q.heads, p.q.dim},
                                                   {p.q.row_stride, p.q.dim, 1});
      const TensorView o_sub = TensorView::strided(p.o.get(), p.cfg.dtype, {keep, p.q.heads, p.q.dim},
                                                   {p.q.row_stride, p.q.dim, 1});
      const TensorView lse_sub = TensorView::contiguous(p.lse.get(), DType::kFP32, {keep, p.q.heads});
      decoder.plan(p.qo_indptr.data(), sub, nullptr, p.kv.num_pages);
      EXPECT_EQ(decoder.last_plan().num_split_requests, chunk == 0 ? 0 : keep * c.kv.num_kv_heads);
      p.o.poison();
      p.lse.poison();
      decoder.run(q_sub, p.cache(), sub, o_sub, lse_sub, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const Outputs alone = fetch(p.o, p.lse, p.out_shape());
      const size_t o_elems = size_t(keep * p.q.row_stride), lse_elems = size_t(keep * p.q.heads);
      EXPECT_TRUE(std::equal(alone.o_raw.begin(), alone.o_raw.begin() + o_elems, whole.o_raw.begin()))
          << "a request's O bits depend on the rest of the batch (keep " << keep << ")";
      EXPECT_EQ(std::memcmp(alone.lse_raw.data(), whole.lse_raw.data(), lse_elems * 4), 0)
          << "a request's LSE bits depend on the rest of the batch (keep " << keep << ")";
    }
  }
}

// With programmatic launch (sm_90+) a run() may start while the kernel ahead of it in the stream
// still runs; it must wait for that kernel before reading anything. Two steps chained on one
// stream with no synchronisation between them, the first step's O being the second step's Q:
// the second must see the first's output, bit for bit as with plain launches.
void check_chained_steps(const DecodeCase& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  DecodeProblem p(c, seed);
  auto chain = [&](bool programmatic) -> Outputs {
    DecodeConfig cfg = p.cfg;
    cfg.programmatic_launch = programmatic;
    DeviceBuffer ws(BatchDecoder::workspace_bytes(cfg));
    BatchDecoder decoder(cfg, ws.get(), ws.bytes());
    p.plan(decoder);
    DeviceBuffer o2(p.o.bytes()), lse2(p.lse.bytes());
    p.o.poison();
    o2.poison();
    lse2.poison();
    p.run(decoder);  // writes p.o
    decoder.run(p.o_view(), p.cache(), p.table(),
                TensorView::strided(o2.get(), cfg.dtype, {p.q.rows, p.q.heads, p.q.dim}, {p.q.row_stride, p.q.dim, 1}),
                TensorView::contiguous(lse2.get(), DType::kFP32, {p.q.rows, p.q.heads}), nullptr);
    if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("run() failed on the GPU");
    return fetch(o2, lse2, p.out_shape());
  };
  const Outputs plain = chain(false);
  EXPECT_EQ(plain.stray, 0u);
  EXPECT_TRUE(bitwise_equal(plain, chain(true))) << "the chained step differs with programmatic launch";
}

TEST(GpuDecode, ProgrammaticLaunchWaitsForThePreviousKernel) {
  TESSERA_REQUIRE_GPU();
  int device = 0, major = 0;
  CUDA_OK(cudaGetDevice(&device));
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) GTEST_SKIP() << "programmatic launch needs sm_90 or newer; this GPU gets plain launches";
  DecodeCase base;
  pick_compiled(base.kv.head_dim, base.kv.dtype);
  base.kv_len = {16385, 54, 700};  // a long first step: the second launches well before it ends
  // The kernel lets the next one launch after its last 16-row pass: also with several passes
  // (group 8 x 4 verification tokens = 32 rows), and in both CTA shapes.
  DecodeCase passes = base;
  passes.num_qo_heads = 16;
  passes.kv.num_kv_heads = 2;
  passes.max_qo_len = 4;
  passes.qo_len = {4, 3, 4};
  std::vector<DecodeCase> cases;
  for (int ctas_per_sm : {2, 1}) {
    if (ctas_per_sm == 1 && !one_cta_per_sm_fits(base.kv.head_dim, base.kv.dtype)) continue;
    for (DecodeCase c : {base, passes}) {
      c.ctas_per_sm = ctas_per_sm;
      cases.push_back(c);
    }
  }
  uint32_t seed = 601;
  for (const DecodeCase& c : cases) check_chained_steps(c, seed++);
}

// ---- 7. CUDA graphs ---------------------------------------------------------------------------------
struct CapturedGraph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~CapturedGraph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
};

// Captures `launch` on `stream` in global mode (an unsafe CUDA call inside fails the capture).
void capture(cudaStream_t stream, const std::function<void()>& launch, CapturedGraph& out) {
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    launch();
  } catch (const std::exception& e) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream, &broken);
    if (broken) cudaGraphDestroy(broken);
    FAIL() << "run() threw during capture: " << e.what();
  }
  CUDA_OK(cudaStreamEndCapture(stream, &out.graph));
  size_t nodes = 0;
  CUDA_OK(cudaGraphGetNodes(out.graph, nullptr, &nodes));
  EXPECT_GT(nodes, 0u) << "the captured run() launched nothing";
  CUDA_OK(cudaGraphInstantiate(&out.exec, out.graph, 0));
}

// One decoder (config.ctas_per_sm as given) captured on a first step and replayed over the steps.
void replay_across_steps(int ctas_per_sm) {
  SCOPED_TRACE("DecodeConfig.ctas_per_sm " + std::to_string(ctas_per_sm));
  DecodeCase shape;
  pick_compiled(shape.kv.head_dim, shape.kv.dtype);
  shape.ctas_per_sm = ctas_per_sm;
  shape.num_qo_heads = 8;
  shape.kv.num_kv_heads = 2;
  shape.kv.page_size = 16;
  shape.max_batch_size = 8;
  shape.max_qo_len = 2;
  const DecodeConfig cfg = config_of(shape);
  const KVGeometry& g = shape.kv;
  const int64_t num_pages = 700;  // the cache every step lives in

  struct Step {
    std::vector<int> kv_len, qo_len;
  };
  const std::vector<Step> steps = {
      {{54, 700, 1}, {1, 2, 1}},                                               // captured on this one
      {{9000, 0, 97, 1, 16, 333, 2, 1000}, {1, 1, 2, 1, 0, 2, 2, 1}},          // full batch, a long one
      {{10000}, {2}},                                                          // one long request
      {{9000, 3, 1, 7, 0, 5, 2, 9}, {1, 1, 1, 1, 1, 1, 1, 1}},                 // skewed: two-level merges
      {{5, 17}, {2, 1}},                                                       // fewer than captured
  };
  std::mt19937 rng(700);
  std::vector<HostPagedKV> kvs;
  std::vector<HostRows> qs;
  std::vector<std::vector<int32_t>> qo_indptrs;
  for (const Step& s : steps) {
    kvs.push_back(make_paged_kv(g, s.kv_len, num_pages, rng));
    qo_indptrs.push_back(indptr_of(s.qo_len));
    qs.push_back(random_rows(qo_indptrs.back().back(), cfg.num_qo_heads, g.head_dim, 0, g.dtype, rng, 2.f));
  }

  // Fixed-address buffers at the capacity, shared by every step.
  const int64_t max_rows = int64_t(cfg.max_batch_size) * cfg.max_qo_len;
  const int64_t width = int64_t(cfg.num_qo_heads) * g.head_dim;
  DevicePagedKV dkv(kvs[0], cfg.max_batch_size);
  DeviceBuffer dq(size_t(max_rows * width) * 2), o(size_t(max_rows * width) * 2),
      lse(size_t(max_rows * cfg.num_qo_heads) * 4);
  DeviceBuffer ws(BatchDecoder::workspace_bytes(cfg));
  BatchDecoder decoder(cfg, ws.get(), ws.bytes());
  Stream stream;
  const PagedKVCache cache = dkv.cache(kvs[0]);  // the same views for every step
  auto rows_view = [&](const DeviceBuffer& b, int64_t rows) {
    return TensorView::contiguous(b.get(), g.dtype, {rows, cfg.num_qo_heads, g.head_dim});
  };
  auto lse_view = [&](int64_t rows) {
    return TensorView::contiguous(lse.get(), DType::kFP32, {rows, cfg.num_qo_heads});
  };
  auto load_and_plan = [&](size_t i) {
    CUDA_OK(cudaStreamSynchronize(stream));  // the previous step is done with the buffers
    dkv.upload(kvs[i]);
    dq.upload(qs[i].bits);
    o.poison();
    lse.poison();
    decoder.plan(qo_indptrs[i].data(), dkv.table(kvs[i]), stream, num_pages);
  };

  load_and_plan(0);
  // The captured run() is given the buffers' full sizes (max rows, every page-table slot): a replay
  // checks nothing, so plan() checks later steps against what was captured.
  PageTable captured_table = dkv.table(kvs[0]);
  captured_table.indices = TensorView::contiguous(dkv.indices.get(), DType::kInt32, {num_pages});
  CapturedGraph graph;
  ASSERT_NO_FATAL_FAILURE(capture(stream, [&] {
    decoder.run(rows_view(dq, max_rows), cache, captured_table, rows_view(o, max_rows),
                lse_view(max_rows), stream);
  }, graph));
  // The graph holds the kernel of the captured plan's CTA shape: every later plan keeps it.
  const int captured_shape = decoder.last_plan().ctas_per_sm;

  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i) + ": kv_len " + list_of(steps[i].kv_len) + " qo_len " +
                 list_of(steps[i].qo_len));
    const int64_t rows = qs[i].rows;
    const OutputShape out{rows, cfg.num_qo_heads, g.head_dim, width, g.dtype};
    load_and_plan(i);
    const DecodePlanInfo info = decoder.last_plan();
    EXPECT_EQ(info.ctas_per_sm, captured_shape);
    CUDA_OK(cudaGraphLaunch(graph.exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const Outputs replayed = fetch(o, lse, out);

    o.poison();
    lse.poison();
    decoder.run(rows_view(dq, rows), cache, dkv.table(kvs[i]), rows_view(o, rows), lse_view(rows), stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    const Outputs eager = fetch(o, lse, out);

    EXPECT_TRUE(bitwise_equal(replayed, eager))
        << "graph replay and eager run() differ (chunk_tokens " << info.chunk_tokens << ")";
    check_against(replayed, reference(kvs[i], qs[i], qo_indptrs[i], cfg), "graph replay");
  }

  // Once captured, plan() must check page ids (a replay follows them unchecked) and must not be
  // called inside a capture.
  CUDA_OK(cudaStreamSynchronize(stream));
  try {
    decoder.plan(qo_indptrs[0].data(), dkv.table(kvs[0]), stream, -1);
    ADD_FAILURE() << "plan() without num_pages after a capture should be rejected";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("num_pages"));
  }
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  bool rejected = false;
  try {
    decoder.plan(qo_indptrs[0].data(), dkv.table(kvs[0]), stream, num_pages);
  } catch (const Error& e) {
    rejected = std::string(e.what()).find("captured") != std::string::npos;
  }
  cudaGraph_t discarded = nullptr;
  CUDA_OK(cudaStreamEndCapture(stream, &discarded));
  if (discarded != nullptr) cudaGraphDestroy(discarded);
  EXPECT_TRUE(rejected) << "plan() inside a capture should be rejected";
}

// run() captured once replays every later step: new batch sizes, query lengths, KV lengths (split
// or not) and cache contents in the same buffers, with only plan() called before each replay. The
// replay must match an eager run() of the same step bit for bit, and the reference. Both CTA
// shapes, and the plan's own choice.
TEST(GpuDecodeGraph, CapturedRunReplaysAcrossSteps) {
  TESSERA_REQUIRE_GPU();
  int head_dim = 128;
  DType dtype = DType::kBF16;
  pick_compiled(head_dim, dtype);
  for (int ctas_per_sm : {0, 2, 1}) {
    if (ctas_per_sm == 1 && !one_cta_per_sm_fits(head_dim, dtype)) continue;
    replay_across_steps(ctas_per_sm);
  }
}

// ---- 8. Bad input -----------------------------------------------------------------------------------

TEST(GpuDecodeBadInput, ConfigIsValidated) {
  TESSERA_REQUIRE_GPU();
  DecodeConfig good;
  pick_compiled(good.head_dim, good.dtype);
  good.num_qo_heads = 8;
  good.num_kv_heads = 2;
  good.page_size = 16;
  good.max_batch_size = 4;
  const std::size_t bytes = BatchDecoder::workspace_bytes(good);
  DeviceBuffer ws(bytes);
  EXPECT_NO_THROW({ BatchDecoder d(good, ws.get(), ws.bytes()); });

  struct Bad {
    std::function<void(DecodeConfig&)> edit;
    std::vector<std::string> fragments;
  };
  std::vector<Bad> bad = {
      {[](DecodeConfig& c) { c.num_qo_heads = 6; c.num_kv_heads = 4; }, {"num_qo_heads", "num_kv_heads"}},
      {[](DecodeConfig& c) { c.num_kv_heads = 0; }, {"num_kv_heads"}},
      {[](DecodeConfig& c) { c.num_qo_heads = 32; c.num_kv_heads = 1; }, {"num_qo_heads", "num_kv_heads", "16"}},
      {[](DecodeConfig& c) { c.head_dim = 96; }, {"'head_dim'", "96"}},
      {[](DecodeConfig& c) { c.page_size = 0; }, {"'page_size'"}},
      {[](DecodeConfig& c) { c.page_size = 300; }, {"'page_size'", "300"}},
      {[](DecodeConfig& c) { c.max_qo_len = 9; }, {"'max_qo_len'", "9"}},
      {[](DecodeConfig& c) { c.max_qo_len = 0; }, {"'max_qo_len'"}},
      {[](DecodeConfig& c) { c.max_batch_size = 0; }, {"'max_batch_size'"}},
      {[](DecodeConfig& c) { c.dtype = DType::kFP32; }, {"'dtype'"}},
      {[](DecodeConfig& c) { c.window_left = -2; }, {"'window_left'"}},
      {[](DecodeConfig& c) { c.pipeline_stages = 1; }, {"'pipeline_stages'", "1"}},
      {[](DecodeConfig& c) { c.pipeline_stages = 4; }, {"'pipeline_stages'", "4"}},
      {[](DecodeConfig& c) { c.ctas_per_sm = 3; }, {"'ctas_per_sm'", "3"}},
      {[](DecodeConfig& c) { c.batch_invariant_chunk_tokens = 100; }, {"'batch_invariant_chunk_tokens'", "100"}},
      {[](DecodeConfig& c) { c.batch_invariant_chunk_tokens = 2056; }, {"'batch_invariant_chunk_tokens'", "2056"}},
      {[](DecodeConfig& c) { c.batch_invariant_chunk_tokens = -16; }, {"'batch_invariant_chunk_tokens'"}},
      {[](DecodeConfig& c) { c.batch_invariant_max_chunks = -1; }, {"'batch_invariant_max_chunks'"}},
  };
  // What a narrowed build left out is a clear error, not a fallback.
  for (int hd : {64, 128, 256}) {
    if (!decode_compiled(hd, good.dtype)) bad.push_back({[hd](DecodeConfig& c) { c.head_dim = hd; }, {"'head_dim'"}});
  }
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    if (!decode_compiled(good.head_dim, dt)) bad.push_back({[dt](DecodeConfig& c) { c.dtype = dt; }, {"'dtype'"}});
  }
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE("bad config " + std::to_string(i));
    DecodeConfig c = good;
    bad[i].edit(c);
    expect_error([&] { BatchDecoder d(c, ws.get(), ws.bytes()); }, bad[i].fragments);
    expect_error([&] { (void)BatchDecoder::workspace_bytes(c); }, bad[i].fragments);
  }
  expect_error([&] { BatchDecoder d(good, ws.get(), bytes - 1); }, {"workspace"});
  expect_error([&] { BatchDecoder d(good, nullptr, bytes); }, {"workspace"});
}

TEST(GpuDecodeBadInput, RunArgumentsAreValidated) {
  TESSERA_REQUIRE_GPU();
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.kv_len = {20, 5};
  DecodeProblem p(c, 800);
  DeviceBuffer ws(BatchDecoder::workspace_bytes(p.cfg));
  BatchDecoder decoder(p.cfg, ws.get(), ws.bytes());
  p.o.poison();
  p.lse.poison();
  expect_error([&] { p.run(decoder); }, {"plan"});  // run() before any plan()
  p.plan(decoder);

  const DType other = c.kv.dtype == DType::kBF16 ? DType::kFP16 : DType::kBF16;
  const int64_t rows = p.q.rows, heads = p.q.heads, dim = p.q.dim;
  struct Args {
    TensorView q, o, lse;
    PagedKVCache cache;
  };
  auto run_with = [&](const std::function<void(Args&)>& edit) {
    Args a{p.q_view(), p.o_view(), p.lse_view(), p.cache()};
    edit(a);
    decoder.run(a.q, a.cache, p.table(), a.o, a.lse, nullptr);
  };
  expect_error([&] { run_with([&](Args& a) { a.q.dtype = other; }); }, {"'q'", "dtype"});
  expect_error([&] { run_with([&](Args& a) { a.q = TensorView::contiguous(a.q.data, c.kv.dtype, {rows, heads / 2, dim}); }); },
               {"'q'"});
  expect_error([&] {  // fewer rows than the plan's qo_indptr ends at
    run_with([&](Args& a) {
      a.q = TensorView::contiguous(a.q.data, c.kv.dtype, {rows - 1, heads, dim});
      a.o = TensorView::contiguous(a.o.data, c.kv.dtype, {rows - 1, heads, dim});
      a.lse = TensorView::contiguous(a.lse.data, DType::kFP32, {rows - 1, heads});
    });
  }, {"'q'"});
  expect_error([&] { run_with([&](Args& a) { a.q.data = static_cast<char*>(a.q.data) + 2; }); }, {"'q'"});
  expect_error([&] { run_with([&](Args& a) { a.o = TensorView::contiguous(a.o.data, c.kv.dtype, {rows, heads, dim / 2}); }); },
               {"'o'"});
  expect_error([&] { run_with([&](Args& a) { a.o.dtype = DType::kFP32; }); }, {"'o'", "dtype"});
  expect_error([&] { run_with([&](Args& a) { a.lse.dtype = DType::kBF16; }); }, {"'lse'", "dtype"});
  expect_error([&] { run_with([&](Args& a) { a.lse = TensorView::contiguous(a.lse.data, DType::kFP32, {rows, heads - 1}); }); },
               {"'lse'"});
  expect_error([&] { run_with([&](Args& a) { a.cache.k_pages.dtype = other; }); }, {"'k_pages'"});
  expect_error([&] { run_with([&](Args& a) { a.cache.v_pages.shape[3] = dim / 2; }); }, {"'v_pages'"});
  expect_error([&] { run_with([&](Args& a) { a.cache.layout = KVLayout::kHND; }); }, {"layout"});

  // Nothing was written by the calls that threw.
  CUDA_OK(cudaDeviceSynchronize());
  const Outputs untouched = fetch(p.o, p.lse, p.out_shape());
  EXPECT_TRUE(std::all_of(untouched.o_raw.begin(), untouched.o_raw.end(), [](uint16_t b) { return b == kPoison16; }))
      << "a rejected run() wrote o";
  EXPECT_TRUE(std::all_of(untouched.lse_raw.begin(), untouched.lse_raw.end(), is_poison))
      << "a rejected run() wrote lse";
}

TEST(GpuDecodeBadInput, PlanArgumentsAreValidated) {
  TESSERA_REQUIRE_GPU();
  DecodeCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.kv_len = {20, 5, 40};
  c.qo_len = {1, 2, 1};
  c.max_qo_len = 2;
  DecodeProblem p(c, 900);
  DeviceBuffer ws(BatchDecoder::workspace_bytes(p.cfg));
  BatchDecoder decoder(p.cfg, ws.get(), ws.bytes());

  // A batch larger than max_batch_size.
  DecodeConfig small = p.cfg;
  small.max_batch_size = 2;
  DeviceBuffer small_ws(BatchDecoder::workspace_bytes(small));
  BatchDecoder small_decoder(small, small_ws.get(), small_ws.bytes());
  expect_error([&] { p.plan(small_decoder); }, {"max_batch_size"});

  // A request with more query tokens than max_qo_len; no host qo_indptr.
  const std::vector<int32_t> too_long{0, 1, 4, 5};
  expect_error([&] { decoder.plan(too_long.data(), p.table(), nullptr, p.kv.num_pages); }, {"qo_indptr"});
  expect_error([&] { decoder.plan(nullptr, p.table(), nullptr, p.kv.num_pages); }, {"qo_indptr", "required"});

  // Page ids outside the cache, a bad last_page_len.
  for (int32_t bad_id : {int32_t(p.kv.num_pages), -1}) {
    std::vector<int32_t> indices = p.kv.indices;
    indices[1] = bad_id;
    PageTable t = p.table();
    t.host_indices = indices.data();
    expect_error([&] { decoder.plan(p.qo_indptr.data(), t, nullptr, p.kv.num_pages); },
                 {"kv_indices", "page id " + std::to_string(bad_id)});
  }
  // Safe by default: planned without num_pages, the same bad ids are refused by run(), before
  // any launch, against the cache it is given; kSkipPageIdCheck opts out (not run here).
  for (int32_t bad_id : {int32_t(p.kv.num_pages), -1}) {
    std::vector<int32_t> indices = p.kv.indices;
    indices[1] = bad_id;
    PageTable t = p.table();
    t.host_indices = indices.data();
    decoder.plan(p.qo_indptr.data(), t, nullptr);
    expect_error([&] { p.run(decoder); }, {"BatchDecoder::run", "kv_indices", "page ids", "the cache holds"});
  }
  decoder.plan(p.qo_indptr.data(), p.table(), nullptr, BatchDecoder::kSkipPageIdCheck);
  expect_error([&] { decoder.plan(p.qo_indptr.data(), p.table(), nullptr, -3); }, {"num_pages", "kSkipPageIdCheck"});
  std::vector<int32_t> last = p.kv.last_page_len;
  last[0] = c.kv.page_size + 1;
  PageTable bad_last = p.table();
  bad_last.host_last_page_len = last.data();
  expect_error([&] { decoder.plan(p.qo_indptr.data(), bad_last, nullptr, p.kv.num_pages); }, {"kv_last_page_len"});

  // The host copies of the page table are required.
  PageTable t = p.table();
  t.host_indptr = nullptr;
  expect_error([&] { decoder.plan(p.qo_indptr.data(), t, nullptr, p.kv.num_pages); }, {"indptr", "required"});
  t = p.table();
  t.host_indices = nullptr;
  expect_error([&] { decoder.plan(p.qo_indptr.data(), t, nullptr, p.kv.num_pages); }, {"indices", "required"});
  t = p.table();
  t.host_last_page_len = nullptr;
  expect_error([&] { decoder.plan(p.qo_indptr.data(), t, nullptr, p.kv.num_pages); }, {"last_page_len", "required"});

  // The rejected plans left the decoder usable.
  p.plan(decoder);
  check_against(p.run_and_fetch(decoder), p.expected(), "after rejected plans");
}

}  // namespace
}  // namespace tessera::testing
