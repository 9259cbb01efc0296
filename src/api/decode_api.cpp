// tessera::BatchDecoder: config validation, plan (host planner + one async copy), run (launch).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "api/attention_checks.h"
#include "core/arg_check.h"
#include "core/cuda_check.h"
#include "core/fast_divisor.h"
#include "dispatch/decode_dispatch.h"
#include "dispatch/prefill_dispatch.h"
#include "format/bsr.h"
#include "plan/decode_plan.h"
#include "tessera/decode.h"

namespace tessera {
namespace {

constexpr int kMaxGroup = 16;
constexpr int kMaxQoLen = 8;
constexpr int kMaxPageSize = 256;

void validate_config(const detail::ArgCheck& check, const DecodeConfig& c) {
  check.head_config(c.num_qo_heads, c.num_kv_heads, c.head_dim, dispatch::compiled_prefill_head_dims());
  TESSERA_REQUIRE(check, c.num_qo_heads / c.num_kv_heads <= kMaxGroup, "num_qo_heads",
                  "the GQA group num_qo_heads / num_kv_heads = " +
                      std::to_string(c.num_qo_heads / c.num_kv_heads) + " exceeds " +
                      std::to_string(kMaxGroup));
  check.kv_layout(c.layout, "layout");
  TESSERA_REQUIRE(check, c.dtype == DType::kBF16 || c.dtype == DType::kFP16, "dtype",
                  std::string("must be bf16 or fp16, got ") + dtype_name(c.dtype));
  TESSERA_REQUIRE(check, dispatch::decode_compiled(c.dtype, c.head_dim), "dtype",
                  std::string("paged decode for ") + dtype_name(c.dtype) + " head_dim " +
                      std::to_string(c.head_dim) + " is not compiled in this build");
  TESSERA_REQUIRE(check, c.page_size >= 1 && c.page_size <= kMaxPageSize, "page_size",
                  "must be in 1.." + std::to_string(kMaxPageSize) + ", got " + std::to_string(c.page_size));
  TESSERA_REQUIRE(check, c.max_batch_size >= 1, "max_batch_size",
                  "must be >= 1, got " + std::to_string(c.max_batch_size));
  TESSERA_REQUIRE(check, c.max_qo_len >= 1 && c.max_qo_len <= kMaxQoLen, "max_qo_len",
                  "must be in 1.." + std::to_string(kMaxQoLen) + ", got " + std::to_string(c.max_qo_len));
  detail::check_variant(check, c.window_left, c.scale, c.soft_cap);
  TESSERA_REQUIRE(check, c.pipeline_stages == 0 || c.pipeline_stages == 2 || c.pipeline_stages == 3,
                  "pipeline_stages", "must be 0 (automatic), 2 or 3, got " + std::to_string(c.pipeline_stages));
  TESSERA_REQUIRE(check, c.ctas_per_sm >= 0 && c.ctas_per_sm <= 2, "ctas_per_sm",
                  "must be 0 (automatic), 1 or 2, got " + std::to_string(c.ctas_per_sm));
  const int chunk = c.batch_invariant_chunk_tokens;
  TESSERA_REQUIRE(check, chunk == 0 || (chunk >= 128 && chunk % 16 == 0 && chunk % c.page_size == 0),
                  "batch_invariant_chunk_tokens",
                  "must be 0 (never split) or a multiple of 16 and of page_size (" + std::to_string(c.page_size) +
                      ") of at least 128, got " + std::to_string(chunk));
  TESSERA_REQUIRE(check, c.batch_invariant_max_chunks >= 0 && c.batch_invariant_max_chunks <= (1 << 30),
                  "batch_invariant_max_chunks",
                  "must be in 0..2^30 (0: 8 x max_batch_size x num_kv_heads), got " +
                      std::to_string(c.batch_invariant_max_chunks));
}

struct GpuShape {
  int num_sms = 0;
  int stages = 3;  // the decode kernel's K/V pipeline stages on this GPU
  int ctas_per_sm = 0;         // resident CTAs of the default shape (2 on sm_90, 1 on an A100)
  bool one_cta_per_sm = false;  // the one-CTA-per-SM shape is compiled, fits and may be planned
  bool programmatic_launch = false;  // asked for, and the kernel's code waits (sm_90+ code)
};

GpuShape current_gpu_shape(const DecodeConfig& c) {
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  GpuShape g;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&g.num_sms, cudaDevAttrMultiProcessorCount, device));
  g.stages = dispatch::decode_stages(c.head_dim, c.pipeline_stages);
  const kernels::DecodeKernelInfo kernel = dispatch::decode_kernel_info(c.dtype, c.head_dim, g.stages, 2);
  g.ctas_per_sm = kernel.ctas_per_sm;
  g.programmatic_launch = c.programmatic_launch && kernel.waits_for_preceding_grid;
  if (g.ctas_per_sm < 1) {
    throw Error("tessera::BatchDecoder: the decode kernel cannot be resident on this GPU "
                "(occupancy 0 for its shared memory and registers)");
  }
  if (c.ctas_per_sm != 2 && g.stages == 3 && g.ctas_per_sm >= 2 &&
      dispatch::decode_one_cta_per_sm_fits(c.head_dim)) {
    g.one_cta_per_sm = dispatch::decode_kernel_info(c.dtype, c.head_dim, 3, 1).ctas_per_sm >= 1;
  }
  if (c.ctas_per_sm == 1 && !g.one_cta_per_sm) {
    const int bytes = dispatch::decode_one_cta_per_sm_bytes(c.head_dim);
    std::string why;
    if (bytes == 0) {
      why = "it is not compiled for head_dim " + std::to_string(c.head_dim) +
            " (head_dim 128 and 256, TESSERA_DECODE_ONE_CTA_PER_SM)";
    } else if (g.stages != 3) {
      why = "it needs 3 pipeline stages; this decoder has " + std::to_string(g.stages);
    } else {
      why = "it needs " + std::to_string(bytes) + " bytes of shared memory per block and an SM that "
            "holds two default CTAs; this GPU allows " + std::to_string(dispatch::shared_memory_per_block()) +
            " bytes and holds " + std::to_string(g.ctas_per_sm);
    }
    throw Error("tessera::BatchDecoder: DecodeConfig.ctas_per_sm = 1 asks for the one-CTA-per-SM "
                "decode shape, which this decoder cannot use: " + why);
  }
  return g;
}

// Requests hold at most format::kMaxRowTokens tokens. A window at least that long excludes no key:
// it is passed as "none", which also keeps the kernels' band arithmetic (row + kv_len - qo_len -
// window) far from overflow.
int effective_window(int window_left) {
  return window_left >= format::kMaxRowTokens ? -1 : window_left;
}

plan::PlanCapacity capacity_for(const DecodeConfig& c, const GpuShape& g) {
  plan::PlanCapacity cap;
  cap.max_batch_size = c.max_batch_size;
  cap.max_qo_len = c.max_qo_len;
  cap.num_qo_heads = c.num_qo_heads;
  cap.num_kv_heads = c.num_kv_heads;
  cap.head_dim = c.head_dim;
  cap.num_sms = g.num_sms;
  cap.ctas_per_sm = g.ctas_per_sm;
  cap.one_cta_per_sm_shape = g.one_cta_per_sm;
  // At hd256 the default CTA has 2 warps (32 keys per stage) and its merges of many chunks are
  // slow, so the one-CTA-per-SM shape pays for split lists there (measured: decode_plan.cpp); at
  // 8 KV heads split lists ran 0.5-2% slower in it (b1-b8, v12), so there it stays unsplit only.
  // With one KV head (a work item is one CTA and its partials are the whole group's rows) it wins
  // whenever the batch fits it, so the default shape is not even estimated: same kernels, 8 / 1
  // heads, hd128, the planner's plan in each shape, wide against default (H100, 20d7bbe, TB/s):
  // 64 requests skewed 0.861 vs 0.711, one 64K among 63 of 512 1.681 vs 1.446, Zipf 1.5 1.805 vs
  // 1.615, uniform 2K 2.032 vs 1.933; b1 x 32K 0.843 vs 0.667, b1 x 128K 1.770 vs 1.589, b4 x 16K
  // 1.349 vs 1.140, b8 x 4K 0.997 vs 0.712, b16 x 8K 2.022 vs 1.886, b32 x 4K 2.038 vs 1.891,
  // b128 Zipf 1.1 2.528 vs 2.300, b132 x 2K 2.629 vs 2.395 (notes/decode_plan.md, "1 KV head").
  cap.one_cta_per_sm_use = c.num_kv_heads == 1    ? plan::OneCtaPerSmUse::kWheneverItFits
                           : c.head_dim >= 256 ? plan::OneCtaPerSmUse::kAlsoSplitLists
                                                 : plan::OneCtaPerSmUse::kUnsplitLists;
  cap.window_left = effective_window(c.window_left);
  return cap;
}

plan::SplitPolicy split_policy(const DecodeConfig& c, const GpuShape& g) {
  plan::SplitPolicy policy;
  if (c.batch_invariant) {
    policy.split = c.batch_invariant_chunk_tokens > 0;
    policy.fixed_chunk_tokens = c.batch_invariant_chunk_tokens;
    // (The balancing planner's own bound: max_chunks_per_slot partials a CTA slot of the wave.)
    const int64_t planner_bound = int64_t(g.num_sms) * g.ctas_per_sm * policy.max_chunks_per_slot;
    const int64_t eight_chunks = 8 * int64_t(c.max_batch_size) * c.num_kv_heads;
    policy.max_chunk_partials = c.batch_invariant_max_chunks > 0
                                    ? c.batch_invariant_max_chunks
                                    : std::min<int64_t>(int64_t(1) << 30, std::max(planner_bound, eight_chunks));
  }
  return policy;
}

}  // namespace

struct BatchDecoder::Impl {
  DecodeConfig config;
  GpuShape gpu;
  plan::DecodePlanner planner;
  unsigned char* workspace = nullptr;
  void* staging = nullptr;         // pinned host image of the plan
  cudaEvent_t copied = nullptr;    // the staging buffer's last copy has completed
  bool planned = false;
  plan::CtaShape plan_shape = plan::CtaShape::kDefault;  // the kernel shape of the last plan
  int device = 0;
  // What run() checks its arguments against.
  int64_t total_q = 0;
  int64_t total_pages = 0;
  int64_t checked_num_pages = -1;  // the cache size plan() checked the page ids against, or -1
  // plan() without num_pages: the range of the step's page ids, which run() checks against the
  // cache it is given (kSkipPageIdCheck: not scanned, not checked).
  bool ids_scanned = false;
  format::BlockIdRange page_ids;
  struct CapturedBounds {  // the smallest buffers any captured run() was given
    bool captured = false;
    int64_t q_rows = INT64_MAX, kv_indices_len = INT64_MAX, cache_pages = INT64_MAX;
  } graph;
  DecodePlanInfo info;

  Impl(const DecodeConfig& c, const GpuShape& g)
      : config(c), gpu(g), planner(capacity_for(c, g), split_policy(c, g), "BatchDecoder") {
    if (c.ctas_per_sm != 0) {
      planner.pin_shape(c.ctas_per_sm == 1 ? plan::CtaShape::kOneCtaPerSm : plan::CtaShape::kDefault);
    } else if (c.batch_invariant) {
      planner.pin_shape(plan::CtaShape::kDefault);  // one shape for every step
    }
  }
  ~Impl() {
    if (copied) cudaEventDestroy(copied);
    if (staging) cudaFreeHost(staging);
  }
};

std::size_t BatchDecoder::workspace_bytes(const DecodeConfig& config) {
  const detail::ArgCheck check("BatchDecoder::workspace_bytes");
  validate_config(check, config);
  const GpuShape gpu = current_gpu_shape(config);
  return plan::DecodePlanner(capacity_for(config, gpu), split_policy(config, gpu),
                             "BatchDecoder::workspace_bytes")
      .workspace_bytes();
}

BatchDecoder::BatchDecoder(const DecodeConfig& config, void* workspace, std::size_t workspace_size) {
  const detail::ArgCheck check("BatchDecoder");
  validate_config(check, config);
  impl_ = std::make_unique<Impl>(config, current_gpu_shape(config));
  const std::size_t needed = impl_->planner.workspace_bytes();
  TESSERA_REQUIRE(check, workspace != nullptr, "workspace", "must not be null");
  TESSERA_REQUIRE(check, workspace_size >= needed, "workspace_size",
                  std::to_string(workspace_size) + " bytes is less than the " + std::to_string(needed) +
                      " this config needs (BatchDecoder::workspace_bytes)");
  TESSERA_REQUIRE(check, reinterpret_cast<uintptr_t>(workspace) % 256 == 0, "workspace",
                  "must be 256-byte aligned (cudaMalloc's alignment)");
  cudaPointerAttributes attr{};
  const bool device_memory = cudaPointerGetAttributes(&attr, workspace) == cudaSuccess &&
                             (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged);
  cudaGetLastError();
  TESSERA_REQUIRE(check, device_memory, "workspace", "must be device memory (cudaMalloc)");
  TESSERA_CUDA_CHECK(cudaGetDevice(&impl_->device));
  impl_->workspace = static_cast<unsigned char*>(workspace);
  TESSERA_CUDA_CHECK(cudaMallocHost(&impl_->staging, impl_->planner.layout().plan_bytes));
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&impl_->copied, cudaEventDisableTiming));
}

BatchDecoder::~BatchDecoder() = default;

const DecodeConfig& BatchDecoder::config() const { return impl_->config; }
DecodePlanInfo BatchDecoder::last_plan() const { return impl_->info; }

void BatchDecoder::plan(const int32_t* host_qo_indptr, const PageTable& table, cudaStream_t stream,
                        int64_t num_pages) {
  const detail::ArgCheck check("BatchDecoder::plan");
  Impl& im = *impl_;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  TESSERA_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  TESSERA_REQUIRE(check, capturing == cudaStreamCaptureStatusNone, "stream",
                  "is being captured into a CUDA graph: call plan() outside the graph, before each "
                  "replay (it copies the plan from host memory)");
  TESSERA_REQUIRE(check, host_qo_indptr != nullptr, "host_qo_indptr", "is required");
  TESSERA_REQUIRE(check, table.host_indptr != nullptr, "host_indptr", "is required (a host copy of kv_indptr)");
  TESSERA_REQUIRE(check, table.host_indices != nullptr, "host_indices", "is required (a host copy of kv_indices)");
  TESSERA_REQUIRE(check, table.host_last_page_len != nullptr, "host_last_page_len",
                  "is required (a host copy of kv_last_page_len)");
  TESSERA_REQUIRE(check, table.indptr.rank == 1 && table.indptr.size(0) >= 1, "kv_indptr",
                  "must be 1-D with batch_size + 1 >= 1 entries");
  const int64_t batch = table.batch_size();
  TESSERA_REQUIRE(check, batch <= im.config.max_batch_size, "kv_indptr",
                  "batch size " + std::to_string(batch) + " exceeds the decoder's max_batch_size " +
                      std::to_string(im.config.max_batch_size));
  const auto bsr = format::bsr_from_page_table(im.config.page_size, static_cast<int32_t>(batch),
                                               table.host_indptr, table.host_indices,
                                               table.host_last_page_len);
  TESSERA_REQUIRE(check, num_pages >= kSkipPageIdCheck, "num_pages",
                  "must be >= 0 (the cache's pages), -1 (checked at run()) or kSkipPageIdCheck (-2), got " +
                      std::to_string(num_pages));
  const std::string bad = format::check_bsr(bsr, num_pages);
  if (!bad.empty()) {
    const format::BsrError e = format::split_bsr_error(bad);
    check.fail(e.array.c_str(), e.rule);
  }
  check.indptr_host(host_qo_indptr, batch + 1, "qo_indptr", INT32_MAX, /*exact_end=*/false);

  const int64_t total_pages = table.host_indptr[batch];

  // A captured run() replays with the buffers it was captured with and checks nothing: every later
  // plan must fit them, and its page ids must be checked against the captured cache.
  if (im.graph.captured) {
    TESSERA_REQUIRE(check, host_qo_indptr[batch] <= im.graph.q_rows, "qo_indptr",
                    "the step has " + std::to_string(host_qo_indptr[batch]) +
                        " query rows but the captured run() was given " +
                        std::to_string(im.graph.q_rows));
    TESSERA_REQUIRE(check, table.host_indptr[batch] <= im.graph.kv_indices_len, "kv_indptr",
                    "the step uses " + std::to_string(table.host_indptr[batch]) +
                        " page-table entries but the captured run() was given " +
                        std::to_string(im.graph.kv_indices_len));
    TESSERA_REQUIRE(check, num_pages >= 0 && num_pages <= im.graph.cache_pages, "num_pages",
                    "must be given (>= 0) and at most the captured cache's " +
                        std::to_string(im.graph.cache_pages) +
                        " pages once run() was captured: a replay follows the page ids unchecked");
  }
  // The staging buffer may still be read by the previous step's copy (long done in a serving
  // loop). The planner then writes the plan image straight into it.
  TESSERA_CUDA_CHECK(cudaEventSynchronize(im.copied));
  const plan::Plan& plan = im.planner.plan(bsr, host_qo_indptr, im.staging);
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(im.workspace, im.staging, im.planner.layout().plan_bytes,
                                     cudaMemcpyHostToDevice, stream));
  TESSERA_CUDA_CHECK(cudaEventRecord(im.copied, stream));

  im.planned = true;
  im.total_q = host_qo_indptr[batch];
  im.total_pages = total_pages;
  im.checked_num_pages = num_pages;
  // Safe by default: without num_pages the ids' range is taken now and checked against the cache
  // at run() (one vectorised pass: 3 us at 32K ids on the development CPU, tessera_plan_bench).
  im.ids_scanned = num_pages == -1;
  if (im.ids_scanned) im.page_ids = format::block_id_range(bsr);
  im.info.num_work_items = plan.num_tasks;
  im.info.num_split_requests = plan.split_rows;
  im.info.num_merge_rows = static_cast<int>(plan.merges.size());
  im.info.estimated_us = plan.estimated_us;
  im.info.chunk_tokens = plan.chunk_tokens;
  im.info.grid_ctas = plan.num_tasks;
  im.info.ctas_per_sm = plan.shape == plan::CtaShape::kOneCtaPerSm ? 1 : 2;
  im.plan_shape = plan.shape;
}

void BatchDecoder::run(const TensorView& q, const PagedKVCache& cache, const PageTable& table,
                       const TensorView& o, const TensorView& lse, cudaStream_t stream) {
  const detail::ArgCheck check("BatchDecoder::run");
  const Impl& im = *impl_;
  const DecodeConfig& c = im.config;
  TESSERA_REQUIRE(check, im.planned, "plan", "run() needs a plan(): call plan() once per step first");

  check.tensor(q, "q", 3);
  check.tensor(o, "o", 3);
  check.dtype(q, "q", {c.dtype});
  check.dtype(o, "o", {c.dtype});
  check.dim(q, "q", 1, c.num_qo_heads, "num_qo_heads of the config");
  check.dim(q, "q", 2, c.head_dim, "head_dim of the config");
  check.same_shape(q, "q", o, "o");
  TESSERA_REQUIRE(check, q.size(0) >= im.total_q, "q",
                  "has " + std::to_string(q.size(0)) + " rows but the plan's qo_indptr ends at " +
                      std::to_string(im.total_q));

  check.kv_layout(cache.layout, "cache.layout");
  check.tensor(cache.k_pages, "k_pages", 4);
  check.tensor(cache.v_pages, "v_pages", 4);
  check.dtype(cache.k_pages, "k_pages", {c.dtype});
  check.dtype(cache.v_pages, "v_pages", {c.dtype});
  check.same_shape(cache.k_pages, "k_pages", cache.v_pages, "v_pages");
  check.page_strides_32bit(cache.k_pages, "k_pages");
  check.page_strides_32bit(cache.v_pages, "v_pages");
  TESSERA_REQUIRE(check, cache.layout == c.layout, "cache",
                  std::string("layout ") + kv_layout_name(cache.layout) +
                      " differs from the config's " + kv_layout_name(c.layout));
  TESSERA_REQUIRE(check, cache.page_size() == c.page_size, "k_pages",
                  "page_size " + std::to_string(cache.page_size()) + " differs from the config's " +
                      std::to_string(c.page_size));
  TESSERA_REQUIRE(check, cache.num_kv_heads() == c.num_kv_heads, "k_pages",
                  "num_kv_heads " + std::to_string(cache.num_kv_heads()) +
                      " differs from the config's " + std::to_string(c.num_kv_heads));
  TESSERA_REQUIRE(check, cache.head_dim() == c.head_dim, "k_pages",
                  "head_dim " + std::to_string(cache.head_dim()) + " differs from the config's " +
                      std::to_string(c.head_dim));
  check.vectorizable_rows(cache.k_pages, "k_pages");
  check.vectorizable_rows(cache.v_pages, "v_pages");
  TESSERA_REQUIRE(check, im.checked_num_pages < 0 || cache.num_pages() >= im.checked_num_pages, "k_pages",
                  "holds " + std::to_string(cache.num_pages()) + " pages but plan() checked the page ids "
                  "against " + std::to_string(im.checked_num_pages));
  check.index_array(table.indices, "kv_indices");
  TESSERA_REQUIRE(check, !im.ids_scanned || im.page_ids.max < im.page_ids.min ||
                             (im.page_ids.min >= 0 && im.page_ids.max < cache.num_pages()),
                  "kv_indices",
                  "the planned page table uses page ids " + std::to_string(im.page_ids.min) + ".." +
                      std::to_string(im.page_ids.max) + " but the cache holds " + std::to_string(cache.num_pages()) +
                      " pages (pass num_pages to plan() to have them checked there)");
  TESSERA_REQUIRE(check, im.total_pages == 0 || cache.num_pages() >= 1, "k_pages",
                  "holds no pages but the planned page table uses " + std::to_string(im.total_pages));
  TESSERA_REQUIRE(check, table.indices.size(0) >= im.total_pages, "kv_indices",
                  "has " + std::to_string(table.indices.size(0)) + " entries but the plan's page table uses " +
                      std::to_string(im.total_pages));

  // The outputs overlap no input: not the pages, not the page ids, not this decoder's workspace
  // (its plan and partial states).
  const TensorView workspace_view = TensorView::contiguous(
      im.workspace, DType::kInt32, {static_cast<int64_t>(im.planner.workspace_bytes() / 4)});
  detail::check_queries_and_outputs(check, q, o, lse,
                                    {{&cache.k_pages, "k_pages"}, {&cache.v_pages, "v_pages"},
                                     {&table.indices, "kv_indices"}, {&workspace_view, "workspace"}});
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  TESSERA_REQUIRE(check, device == im.device, "stream",
                  "the current device (" + std::to_string(device) + ") is not the decoder's (" +
                      std::to_string(im.device) + ")");

  const plan::WorkspaceLayout& layout = im.planner.layout();
  kernels::DecodeParams p;
  p.q = q.data;
  p.q_stride_row = q.stride[0];
  p.q_stride_head = q.stride[1];
  p.o = o.data;
  p.o_stride_row = o.stride[0];
  p.o_stride_head = o.stride[1];
  if (!lse.empty_view()) {
    p.lse = static_cast<float*>(lse.data);
    p.lse_stride_row = lse.stride[0];
    p.lse_stride_head = lse.stride[1];
  }
  const bool nhd = cache.layout == KVLayout::kNHD;
  p.k_pages = cache.k_pages.data;
  p.v_pages = cache.v_pages.data;
  p.k_stride_page = static_cast<int32_t>(cache.k_pages.stride[0]);
  p.k_stride_token = static_cast<int32_t>(cache.k_pages.stride[nhd ? 1 : 2]);
  p.k_stride_head = static_cast<int32_t>(cache.k_pages.stride[nhd ? 2 : 1]);
  p.v_stride_page = static_cast<int32_t>(cache.v_pages.stride[0]);
  p.v_stride_token = static_cast<int32_t>(cache.v_pages.stride[nhd ? 1 : 2]);
  p.v_stride_head = static_cast<int32_t>(cache.v_pages.stride[nhd ? 2 : 1]);
  p.kv_indices = static_cast<const int32_t*>(table.indices.data);
  p.num_pages = cache.num_pages();
  p.page_size = c.page_size;
  const detail::FastDivisor div = detail::fast_divisor(static_cast<uint32_t>(c.page_size));
  p.page_magic = div.magic;
  p.page_shift = div.shift;
  unsigned char* ws = im.workspace;
  p.header = reinterpret_cast<const plan::PlanHeader*>(ws + layout.header);
  p.work = reinterpret_cast<const plan::WorkItem*>(ws + layout.work);
  p.merges = reinterpret_cast<const plan::MergeRow*>(ws + layout.merges);
  p.slot_rows = reinterpret_cast<const int64_t*>(ws + layout.slot_rows);
  p.partial_o = reinterpret_cast<float*>(ws + layout.partial_o);
  p.partial_lse = reinterpret_cast<float*>(ws + layout.partial_lse);
  p.merge_counters = reinterpret_cast<int32_t*>(ws + layout.merge_counters);
  p.num_qo_heads = c.num_qo_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.causal = c.causal;
  p.window_left = effective_window(c.window_left);
  p.scale = c.scale > 0.f ? c.scale : 1.f / std::sqrt(static_cast<float>(c.head_dim));
  p.soft_cap = c.soft_cap;

  // Eager launches are sized to this step's plan; a captured run() gets the grids of the largest
  // plan the capacity allows (the kernels read the step's counts from the workspace), so one
  // graph replays any later step.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TESSERA_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  kernels::DecodeLaunch launch;
  // One CTA per work item, not a persistent loop: the hardware hands items to SMs as they free
  // up, which balances unequal items, and a CTA's start-up overlaps the others' streaming.
  launch.decode_ctas = capture != cudaStreamCaptureStatusNone ? im.planner.max_work_items()
                                                               : im.info.num_work_items;
  launch.stages = im.gpu.stages;
  plan::CtaShape shape = im.plan_shape;
  if (capture != cudaStreamCaptureStatusNone) {
    // The graph holds one shape's kernel, and later plans are balanced for it. Left to the
    // planner (ctas_per_sm 0), the one-CTA-per-SM shape is kept only where no step of the capacity
    // can overfill it; a capacity with larger batches captures the default shape, which loses
    // little where the other would have won (2-3%) and nothing where it would have lost (up to 22%
    // at b17 x 8K). This step's plan runs correctly on either kernel (the grid covers every task).
    const bool capacity_fits_one_cta_per_sm = int64_t(c.max_batch_size) * c.num_kv_heads <= im.gpu.num_sms;
    if (c.ctas_per_sm == 0 && !capacity_fits_one_cta_per_sm) shape = plan::CtaShape::kDefault;
    impl_->planner.pin_shape(shape);
  }
  launch.one_cta_per_sm = shape == plan::CtaShape::kOneCtaPerSm;
  launch.programmatic = im.gpu.programmatic_launch;
  if (capture != cudaStreamCaptureStatusNone) {
    Impl::CapturedBounds& g = impl_->graph;
    g.captured = true;
    g.q_rows = std::min(g.q_rows, q.size(0));
    g.kv_indices_len = std::min(g.kv_indices_len, table.indices.size(0));
    g.cache_pages = std::min(g.cache_pages, cache.num_pages());
  }
  dispatch::launch_decode(c.dtype, c.head_dim, p, launch, stream);
}

}  // namespace tessera
