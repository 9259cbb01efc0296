// tessera::batch_prefill: validation, kernel choice, launch.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>

#include "core/arg_check.h"
#include "api/attention_checks.h"
#include "api/paged_prefill_params.h"
#include "core/fast_divisor.h"
#include "format/bsr.h"
#include "dispatch/prefill_dispatch.h"
#include "kernels/attention/prefill_params.h"
#include "tessera/attention.h"
#include "tessera/device_info.h"

#include <cuda_runtime_api.h>

namespace tessera {
namespace {

void validate(const detail::ArgCheck& check, const PrefillArgs& a) {
  check.tensor(a.k, "k", 3);
  check.tensor(a.v, "v", 3);
  // Every input's own view rules before the overlap checks, which would otherwise charge a broken
  // index array (one reaching past 2^63 bytes spans everything) to the output.
  check.index_array(a.qo_indptr, "qo_indptr");
  check.index_array(a.kv_indptr, "kv_indptr");
  check.dtype(a.k, "k", {DType::kBF16, DType::kFP16});  // (q's own dtype is matched below)
  check.dtype(a.v, "v", {DType::kBF16, DType::kFP16});
  // The outputs overlap no input: neither K / V nor the index arrays the kernel reads.
  detail::check_queries_and_outputs(check, a.q, a.o, a.lse,
                                    {{&a.k, "k"}, {&a.v, "v"}, {&a.qo_indptr, "qo_indptr"}, {&a.kv_indptr, "kv_indptr"}});
  check.dtype(a.k, "k", {a.q.dtype});
  check.dtype(a.v, "v", {a.q.dtype});
  check.same_shape(a.k, "k", a.v, "v");
  TESSERA_REQUIRE(check, a.k.size(2) == a.q.size(2), "k",
                  "head_dim " + std::to_string(a.k.size(2)) + " must equal q's head_dim " +
                      std::to_string(a.q.size(2)));
  check.head_config(a.q.size(1), a.k.size(1), a.q.size(2), dispatch::compiled_prefill_head_dims());
  check.vectorizable_rows(a.k, "k");
  check.vectorizable_rows(a.v, "v");
  TESSERA_REQUIRE(check, a.qo_indptr.size(0) >= 1, "qo_indptr", "must have batch_size + 1 >= 1 entries");
  check.dim(a.kv_indptr, "kv_indptr", 0, a.qo_indptr.size(0), "qo_indptr's length");
  TESSERA_REQUIRE(check, a.host_qo_indptr != nullptr, "host_qo_indptr",
                  "is required (a host copy of qo_indptr sizes the launch)");
  TESSERA_REQUIRE(check, a.host_kv_indptr != nullptr, "host_kv_indptr",
                  "is required (a host copy of kv_indptr)");
  const int64_t n = a.qo_indptr.size(0);
  check.indptr_host(a.host_qo_indptr, n, "qo_indptr", a.q.size(0), /*exact_end=*/false);
  check.indptr_host(a.host_kv_indptr, n, "kv_indptr", a.k.size(0), /*exact_end=*/false);
  detail::check_variant(check, a.window_left, a.scale, a.soft_cap);
  TESSERA_REQUIRE(check, a.q.size(0) < (int64_t(1) << 31), "q", "more than 2^31 - 1 rows");
  TESSERA_REQUIRE(check, a.k.size(0) < (int64_t(1) << 31), "k", "more than 2^31 - 1 rows");
  // The launch grid is (query tiles, requests, heads); CUDA caps the last two at 65535.
  TESSERA_REQUIRE(check, a.qo_indptr.size(0) - 1 <= 65535, "qo_indptr",
                  "batch size " + std::to_string(a.qo_indptr.size(0) - 1) + " exceeds 65535 requests");
  TESSERA_REQUIRE(check, a.q.size(1) <= 65535, "q", "more than 65535 query heads");
}

}  // namespace

namespace {
// Compute capability of the current device, looked up once per device (batch_prefill runs per
// layer per step; the full property query is too slow for that).
struct CurrentGpu {
  int cc_major = 0, cc_minor = 0;
};
CurrentGpu current_gpu(const char* entry_point) {
  constexpr int kMaxDevices = 64;
  // major * 100 + minor per device, 0 until looked up; atomics because engines call from many
  // threads (each looks up the same value, so the first store wins nothing it can break).
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    cudaGetLastError();
    const DeviceInfo info = device_info();
    if (!info.present) throw Error(std::string("tessera::") + entry_point + ": no GPU: " + info.reason);
    return {info.cc_major, info.cc_minor};
  }
  int cc = cached[device].load(std::memory_order_relaxed);
  if (cc == 0) {
    const DeviceInfo info = device_info(device);
    if (!info.present) throw Error(std::string("tessera::") + entry_point + ": no GPU: " + info.reason);
    cc = info.cc_major * 100 + info.cc_minor;
    cached[device].store(cc, std::memory_order_relaxed);
  }
  return {cc / 100, cc % 100};
}
}  // namespace

namespace {

void validate_paged(const detail::ArgCheck& check, const PagedPrefillArgs& a) {
  const PagedKVCache& c = a.cache;
  check.kv_layout(c.layout, "cache.layout");
  check.tensor(c.k_pages, "k_pages", 4);
  check.tensor(c.v_pages, "v_pages", 4);
  // The index arrays' own view rules before the overlap checks (as in validate()).
  check.index_array(a.qo_indptr, "qo_indptr");
  check.index_array(a.table.indptr, "kv_indptr");
  check.index_array(a.table.indices, "kv_indices");
  check.index_array(a.table.last_page_len, "kv_last_page_len");
  check.dtype(c.k_pages, "k_pages", {DType::kBF16, DType::kFP16});  // (q's own dtype is matched below)
  check.dtype(c.v_pages, "v_pages", {DType::kBF16, DType::kFP16});
  detail::check_queries_and_outputs(check, a.q, a.o, a.lse,
                                    {{&c.k_pages, "k_pages"}, {&c.v_pages, "v_pages"}, {&a.qo_indptr, "qo_indptr"},
                                     {&a.table.indptr, "kv_indptr"}, {&a.table.indices, "kv_indices"},
                                     {&a.table.last_page_len, "kv_last_page_len"}});
  check.dtype(c.k_pages, "k_pages", {a.q.dtype});
  check.dtype(c.v_pages, "v_pages", {a.q.dtype});
  check.same_shape(c.k_pages, "k_pages", c.v_pages, "v_pages");
  check.vectorizable_rows(c.k_pages, "k_pages");
  check.vectorizable_rows(c.v_pages, "v_pages");
  TESSERA_REQUIRE(check, c.head_dim() == a.q.size(2), "k_pages",
                  "head_dim " + std::to_string(c.head_dim()) + " must equal q's head_dim " +
                      std::to_string(a.q.size(2)));
  check.head_config(a.q.size(1), c.num_kv_heads(), a.q.size(2), dispatch::compiled_prefill_head_dims());
  TESSERA_REQUIRE(check, c.page_size() >= 1, "k_pages", "page_size must be at least 1");
  check.page_strides_32bit(c.k_pages, "k_pages");
  check.page_strides_32bit(c.v_pages, "v_pages");
  detail::check_variant(check, a.window_left, a.scale, a.soft_cap);

  TESSERA_REQUIRE(check, a.qo_indptr.size(0) >= 1, "qo_indptr", "must have batch_size + 1 >= 1 entries");
  const int64_t n = a.qo_indptr.size(0);
  check.dim(a.table.indptr, "kv_indptr", 0, n, "qo_indptr's length");
  check.dim(a.table.last_page_len, "kv_last_page_len", 0, n - 1, "the batch size");
  TESSERA_REQUIRE(check, a.host_qo_indptr != nullptr, "host_qo_indptr",
                  "is required (a host copy of qo_indptr sizes the launch)");
  TESSERA_REQUIRE(check, a.table.host_indptr != nullptr, "host_indptr",
                  "is required (a host copy of kv_indptr sizes the launch)");
  TESSERA_REQUIRE(check, a.table.host_indices != nullptr, "host_indices",
                  "is required (a host copy of kv_indices: page ids are checked against the cache)");
  TESSERA_REQUIRE(check, a.table.host_last_page_len != nullptr, "host_last_page_len",
                  "is required (a host copy of kv_last_page_len)");
  check.indptr_host(a.host_qo_indptr, n, "qo_indptr", a.q.size(0), /*exact_end=*/false);
  check.indptr_host(a.table.host_indptr, n, "kv_indptr", a.table.indices.size(0), /*exact_end=*/false);
  const auto bsr = format::bsr_from_page_table(static_cast<int32_t>(c.page_size()), static_cast<int32_t>(n - 1),
                                               a.table.host_indptr, a.table.host_indices,
                                               a.table.host_last_page_len);
  const std::string bad = format::check_bsr(bsr, c.num_pages());
  if (!bad.empty()) {
    const format::BsrError e = format::split_bsr_error(bad);
    check.fail(e.array.c_str(), e.rule);
  }
  TESSERA_REQUIRE(check, a.q.size(0) < (int64_t(1) << 31), "q", "more than 2^31 - 1 rows");
  TESSERA_REQUIRE(check, n - 1 <= 65535, "qo_indptr", "batch size " + std::to_string(n - 1) + " exceeds 65535 requests");
  TESSERA_REQUIRE(check, a.q.size(1) <= 65535, "q", "more than 65535 query heads");
}

}  // namespace

namespace {

// The family for (path, dtype, head_dim, problem) on the current GPU, or an error naming `entry_point`.
AttentionPath choose_path(const char* entry_point, AttentionPath requested, DType dtype, int head_dim,
                          const dispatch::PrefillProblem& problem) {
  const CurrentGpu gpu = current_gpu(entry_point);
  const auto c = dispatch::choose_prefill(requested, gpu.cc_major, gpu.cc_minor, dtype, head_dim, problem);
  if (!c.ok) throw Error(std::string("tessera::") + entry_point + ": argument 'path': " + c.why_not);
  return c.path;
}

// The longest request's query rows (host copy of qo_indptr).
int max_qo_len(const TensorView& qo_indptr, const int32_t* host_qo_indptr) {
  int max_qo = 0;
  for (int64_t i = 0; i + 1 < qo_indptr.size(0); ++i) max_qo = std::max(max_qo, host_qo_indptr[i + 1] - host_qo_indptr[i]);
  return max_qo;
}

// PrefillParams::uniform_lengths (every request has the same qo_len and the same kv_len),
// shortest_history and total_keys from the host copies (kv_len(i): request i's keys).
template <typename KvLen>
void summarize_lengths(const int32_t* host_qo_indptr, int64_t batch, KvLen kv_len, kernels::PrefillParams& p) {
  const int32_t qo0 = batch > 0 ? host_qo_indptr[1] - host_qo_indptr[0] : 0;
  const int64_t kv0 = batch > 0 ? int64_t(kv_len(0)) : 0;
  p.uniform_lengths = true;
  p.shortest_history = -1;
  p.total_keys = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const int32_t qo = host_qo_indptr[i + 1] - host_qo_indptr[i];
    const int64_t kv = kv_len(i);
    p.uniform_lengths = p.uniform_lengths && qo == qo0 && kv == kv0;
    p.total_keys += std::max<int64_t>(kv, 0);
    if (qo > 0) p.shortest_history = p.shortest_history < 0 ? kv - qo : std::min(p.shortest_history, kv - qo);
  }
  if (p.shortest_history < 0) p.shortest_history = 0;  // (no rows, or a request with more rows than keys)
}

// What both prefill entry points fill the same way: queries, outputs, LSE, qo_indptr, head counts,
// the launch size and the variant. `max_qo` / `max_kv` are the longest request's rows and KV (host
// copies); max_kv is checked against the kernels' token limit.
kernels::PrefillParams query_side_params(const detail::ArgCheck& check, const TensorView& q,
                                         const TensorView& o, const TensorView& lse,
                                         const TensorView& qo_indptr, int max_qo, int num_kv_heads,
                                         int64_t max_kv, bool causal, int window_left, float scale,
                                         float soft_cap) {
  kernels::PrefillParams p;
  p.q = q.data;
  p.o = o.data;
  p.q_stride_row = q.stride[0];
  p.q_stride_head = q.stride[1];
  p.o_stride_row = o.stride[0];
  p.o_stride_head = o.stride[1];
  if (!lse.empty_view()) {
    p.lse = static_cast<float*>(lse.data);
    p.lse_stride_row = lse.stride[0];
    p.lse_stride_head = lse.stride[1];
  }
  p.qo_indptr = static_cast<const int32_t*>(qo_indptr.data);
  p.batch_size = static_cast<int>(qo_indptr.size(0) - 1);
  p.num_qo_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = num_kv_heads;
  TESSERA_REQUIRE(check, max_kv <= format::kMaxRowTokens, "kv_indptr",
                  "a request holds " + std::to_string(max_kv) + " tokens; at most 2^31 - 2^16 are supported");
  p.max_qo_len = max_qo;
  p.causal = causal;
  // A window at least as long as every request's KV excludes nothing: pass it as "no window", which
  // also keeps the kernel's int32 band arithmetic (row + offset - window) far from overflow.
  p.window_left = window_left >= max_kv ? -1 : window_left;
  p.scale = scale > 0.f ? scale : 1.f / std::sqrt(static_cast<float>(q.size(2)));
  p.soft_cap = soft_cap;
  return p;
}

}  // namespace

namespace {
// The launch's problem shape as the family choice sees it: (request, head, Hopper query tile)
// triples, and for paged K / V the page size.
dispatch::PrefillProblem prefill_problem(const TensorView& q, const TensorView& qo_indptr, int max_qo,
                                         int page_size) {
  dispatch::PrefillProblem problem;
  problem.paged = page_size > 0;
  problem.page_size = page_size;
  problem.shared_memory_per_block = dispatch::shared_memory_per_block();
  const int64_t block_m = kernels::sm90::prefill_sm90_block_m(static_cast<int>(q.size(2)));
  problem.tiles = (qo_indptr.size(0) - 1) * q.size(1) * ((max_qo + block_m - 1) / block_m);
  return problem;
}

dispatch::PrefillProblem paged_problem(const PagedPrefillArgs& a, int max_qo) {
  return prefill_problem(a.q, a.qo_indptr, max_qo, static_cast<int>(a.cache.page_size()));
}
}  // namespace

AttentionPath choose_prefill_paged_path(const PagedPrefillArgs& args) {
  const detail::ArgCheck check("batch_prefill_paged");
  validate_paged(check, args);
  return choose_path("batch_prefill_paged", args.path, args.q.dtype, static_cast<int>(args.q.size(2)),
                     paged_problem(args, max_qo_len(args.qo_indptr, args.host_qo_indptr)));
}

namespace detail {

kernels::PrefillParams paged_prefill_params(const ArgCheck& check, const PagedPrefillArgs& a, AttentionPath& path) {
  validate_paged(check, a);
  const PagedKVCache& c = a.cache;
  const int head_dim = static_cast<int>(a.q.size(2));
  const int max_qo = max_qo_len(a.qo_indptr, a.host_qo_indptr);
  path = choose_path(check.entry_point(), a.path, a.q.dtype, head_dim, paged_problem(a, max_qo));

  // The host page table as the checks read it (validate_paged): each request's keys.
  const format::BsrLayout kv = format::bsr_from_page_table(
      static_cast<int32_t>(c.page_size()), static_cast<int32_t>(a.qo_indptr.size(0) - 1), a.table.host_indptr,
      a.table.host_indices, a.table.host_last_page_len);
  int64_t max_kv = 0;
  for (int32_t i = 0; i < kv.num_rows; ++i) max_kv = std::max(max_kv, kv.row_tokens(i));
  kernels::PrefillParams p =
      query_side_params(check, a.q, a.o, a.lse, a.qo_indptr, max_qo, static_cast<int>(c.num_kv_heads()),
                        max_kv, a.causal, a.window_left, a.scale, a.soft_cap);
  const bool nhd = c.layout == KVLayout::kNHD;
  p.k = c.k_pages.data;
  p.v = c.v_pages.data;
  p.k_stride_head = c.k_pages.stride[nhd ? 2 : 1];
  p.v_stride_head = c.v_pages.stride[nhd ? 2 : 1];
  p.paged = true;
  p.k_stride_page = static_cast<int32_t>(c.k_pages.stride[0]);
  p.k_stride_token = static_cast<int32_t>(c.k_pages.stride[nhd ? 1 : 2]);
  p.v_stride_page = static_cast<int32_t>(c.v_pages.stride[0]);
  p.v_stride_token = static_cast<int32_t>(c.v_pages.stride[nhd ? 1 : 2]);
  p.page_size = static_cast<int>(c.page_size());
  const detail::FastDivisor div = detail::fast_divisor(static_cast<uint32_t>(p.page_size));
  p.page_magic = div.magic;
  p.page_shift = div.shift;
  p.kv_indices = static_cast<const int32_t*>(a.table.indices.data);
  p.kv_last_page_len = static_cast<const int32_t*>(a.table.last_page_len.data);
  p.kv_indptr = static_cast<const int32_t*>(a.table.indptr.data);
  p.q_rows = a.q.size(0);
  p.num_pages = c.num_pages();
  summarize_lengths(a.host_qo_indptr, p.batch_size, [&](int64_t i) { return kv.row_tokens(static_cast<int32_t>(i)); }, p);
  return p;
}

void launch_prefill(const kernels::PrefillParams& p, AttentionPath path, DType dtype, int head_dim,
                    cudaStream_t stream, int gqa_pack) {
  if (path == AttentionPath::kHopper) {
    const int num_sms = dispatch::sm_count();
    kernels::PrefillParams hp = p;
    // As the caller says (BatchPrefillPaged: one choice for all its steps and grids), else as the
    // dispatcher does.
    hp.gqa_pack = gqa_pack >= 0 ? gqa_pack : dispatch::choose_prefill_gqa_pack(hp);
    kernels::sm90::launch_prefill_sm90(
        dtype, head_dim, hp,
        dispatch::choose_prefill_sm90_schedule(hp, head_dim, num_sms, dispatch::shared_memory_per_block(),
                                               dispatch::l2_cache_bytes()),
        num_sms,
        stream);
  } else {
    kernels::launch_prefill_sm80(dtype, head_dim, p, stream);
  }
}

}  // namespace detail

void batch_prefill_paged(const PagedPrefillArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("batch_prefill_paged");
  AttentionPath path = AttentionPath::kAuto;
  const kernels::PrefillParams p = detail::paged_prefill_params(check, a, path);
  detail::launch_prefill(p, path, a.q.dtype, static_cast<int>(a.q.size(2)), stream);
}

AttentionPath choose_prefill_path(const PrefillArgs& args) {
  const detail::ArgCheck check("batch_prefill");
  validate(check, args);
  return choose_path("batch_prefill", args.path, args.q.dtype, static_cast<int>(args.q.size(2)),
                     prefill_problem(args.q, args.qo_indptr, max_qo_len(args.qo_indptr, args.host_qo_indptr), 0));
}

void batch_prefill(const PrefillArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("batch_prefill");
  validate(check, a);
  int64_t max_kv = 0;
  for (int64_t i = 0; i + 1 < a.qo_indptr.size(0); ++i) {
    max_kv = std::max<int64_t>(max_kv, a.host_kv_indptr[i + 1] - a.host_kv_indptr[i]);
  }
  kernels::PrefillParams p =
      query_side_params(check, a.q, a.o, a.lse, a.qo_indptr, max_qo_len(a.qo_indptr, a.host_qo_indptr),
                        static_cast<int>(a.k.size(1)), max_kv, a.causal, a.window_left, a.scale, a.soft_cap);
  const AttentionPath path = choose_path("batch_prefill", a.path, a.q.dtype, static_cast<int>(a.q.size(2)),
                                         prefill_problem(a.q, a.qo_indptr, p.max_qo_len, 0));
  p.k = a.k.data;
  p.v = a.v.data;
  p.k_stride_row = a.k.stride[0];
  p.k_stride_head = a.k.stride[1];
  p.v_stride_row = a.v.stride[0];
  p.v_stride_head = a.v.stride[1];
  p.kv_indptr = static_cast<const int32_t*>(a.kv_indptr.data);
  p.q_rows = a.q.size(0);
  p.kv_rows = a.k.size(0);
  const auto kv_len = [&](int64_t i) { return a.host_kv_indptr[i + 1] - a.host_kv_indptr[i]; };
  summarize_lengths(a.host_qo_indptr, p.batch_size, kv_len, p);
  p.work_weighted_row_keys =
      dispatch::work_weighted_row_keys(a.host_qo_indptr, a.host_kv_indptr, p.batch_size, p.causal, p.window_left);
  detail::launch_prefill(p, path, a.q.dtype, static_cast<int>(a.q.size(2)), stream);
}

}  // namespace tessera
