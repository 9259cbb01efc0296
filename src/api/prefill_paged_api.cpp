// BatchPrefillPaged: paged prefill with a KV split decided once per step (include/tessera/attention.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "api/paged_prefill_params.h"
#include "core/arg_check.h"
#include "core/cuda_check.h"
#include "dispatch/prefill_dispatch.h"
#include "kernels/attention/sm90/prefill_sm90_launch.h"
#include "tessera/attention.h"
#include "plan/prefill_split.h"
#include "tessera/merge.h"

namespace tessera {
namespace {

// Query rows per CTA of the portable prefill kernel (every compiled tile shape: 4 warps x 32 rows,
// or 8 warps in pairs at hd256).
constexpr int64_t kRowsPerCta = 128;
// A split is worth its partials and merge while each run keeps at least this many keys (four KV
// tiles of 64), and the grid is filled when it holds this many CTAs per SM (the portable kernel
// runs one or two per SM: two waves of the smaller).
constexpr int64_t kMinKeysPerRun = 256;
constexpr int64_t kTargetCtasPerSm = 4;

void validate_config(const detail::ArgCheck& check, const PagedPrefillConfig& c) {
  TESSERA_REQUIRE(check, c.num_qo_heads >= 1, "num_qo_heads", "must be >= 1");
  TESSERA_REQUIRE(check, c.head_dim >= 8 && c.head_dim % 8 == 0, "head_dim", "must be a positive multiple of 8");
  TESSERA_REQUIRE(check, c.page_size >= 1, "page_size", "must be >= 1");
  TESSERA_REQUIRE(check, c.max_q_rows >= 1, "max_q_rows", "must be >= 1");
  TESSERA_REQUIRE(check, c.max_kv_splits >= 1 && c.max_kv_splits <= 256, "max_kv_splits", "must be in 1..256");
  TESSERA_REQUIRE(check,
                  c.path == AttentionPath::kAuto || c.path == AttentionPath::kPortable || c.path == AttentionPath::kHopper,
                  "path", "must be kAuto, kPortable or kHopper");
  TESSERA_REQUIRE(check, c.window_left >= -1, "window_left", "must be >= -1 (-1: no window)");
}

}  // namespace

std::size_t BatchPrefillPaged::workspace_bytes(const PagedPrefillConfig& config) {
  const detail::ArgCheck check("BatchPrefillPaged::workspace_bytes");
  validate_config(check, config);
  if (config.max_kv_splits == 1) return 0;
  const std::size_t states = std::size_t(config.max_kv_splits) * config.max_q_rows * config.num_qo_heads;
  return states * (std::size_t(config.head_dim) + 1) * sizeof(float);
}

BatchPrefillPaged::BatchPrefillPaged(const PagedPrefillConfig& config, void* workspace, std::size_t workspace_size)
    : config_(config) {
  const detail::ArgCheck check("BatchPrefillPaged");
  validate_config(check, config);
  const std::size_t needed = workspace_bytes(config);
  TESSERA_REQUIRE(check, needed == 0 || workspace != nullptr, "workspace", "must not be null");
  TESSERA_REQUIRE(check, workspace_size >= needed, "workspace_size",
                  std::to_string(workspace_size) + " bytes is less than the " + std::to_string(needed) +
                      " this config needs (BatchPrefillPaged::workspace_bytes)");
  TESSERA_REQUIRE(check, reinterpret_cast<uintptr_t>(workspace) % 256 == 0, "workspace",
                  "must be 256-byte aligned (cudaMalloc's alignment)");
  workspace_ = static_cast<float*>(workspace);
  int device = 0, cc_major = 0, cc_minor = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  // Whether the Hopper family would run the step (judged for bf16, or fp16 in a build without
  // bf16; the dtype is run()'s, and either family gives the same results, so this only steers
  // the split).
  dispatch::PrefillProblem problem;
  problem.paged = true;
  problem.page_size = config.page_size;
  problem.shared_memory_per_block = dispatch::shared_memory_per_block();
  const dispatch::PrefillChoice family = dispatch::choose_prefill(
      config.path, cc_major, cc_minor, dispatch::prefill_dtype_compiled(DType::kBF16) ? DType::kBF16 : DType::kFP16,
      config.head_dim, problem);
  hopper_reads_pages_ = family.ok && family.path == AttentionPath::kHopper;
}

void BatchPrefillPaged::plan(const int32_t* host_qo_indptr, const PageTable& table) {
  const detail::ArgCheck check("BatchPrefillPaged::plan");
  TESSERA_REQUIRE(check, host_qo_indptr != nullptr, "host_qo_indptr", "is required");
  TESSERA_REQUIRE(check, table.host_indptr != nullptr && table.host_last_page_len != nullptr, "kv_indptr",
                  "the host copies of kv_indptr and kv_last_page_len are required");
  TESSERA_REQUIRE(check, table.indptr.rank == 1 && table.indptr.size(0) >= 1, "kv_indptr",
                  "must be 1-D with batch_size + 1 >= 1 entries");
  const int64_t batch = table.batch_size();
  check.indptr_host(host_qo_indptr, batch + 1, "qo_indptr", config_.max_q_rows, /*exact_end=*/false);
  // The grid's query tiles (with rows; portable and Hopper tile heights) and the longest key range
  // a tile can see.
  const int64_t hopper_rows = kernels::sm90::prefill_sm90_block_m(config_.head_dim);
  int64_t tiles = 0, hopper_tiles = 0, longest = 0, max_qo = 0;
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t qo = host_qo_indptr[r + 1] - host_qo_indptr[r];
    max_qo = std::max(max_qo, qo);
    tiles += (qo + kRowsPerCta - 1) / kRowsPerCta;
    hopper_tiles += (qo + hopper_rows - 1) / hopper_rows;
    const int64_t pages = table.host_indptr[r + 1] - table.host_indptr[r];
    longest = std::max(longest, pages);
  }
  tiles *= config_.num_qo_heads;
  hopper_tiles *= config_.num_qo_heads;
  info_.query_tiles = tiles;
  info_.estimated_us = 0.0;
  planned_ = true;
  planned_rows_ = host_qo_indptr[batch];
  // Either family's grid counts every (request, head, query tile of the longest request) times the
  // splits in 31 bits: a split count (forced, or from a batch of many empty requests) that would
  // not fit is cut down.
  const int64_t grid_tiles =
      batch * config_.num_qo_heads * ((max_qo + std::min<int64_t>(hopper_rows, kRowsPerCta) - 1) /
                                      std::min<int64_t>(hopper_rows, kRowsPerCta));
  const int64_t fits = std::max<int64_t>(1, ((int64_t(1) << 31) - 1) / std::max<int64_t>(1, grid_tiles));
  auto capped = [&](int64_t splits) {
    return static_cast<int>(std::max<int64_t>(1, std::min({splits, int64_t(config_.max_kv_splits), fits})));
  };
  const int forced = dispatch::forced_prefill_kv_splits();
  if (config_.path == AttentionPath::kHopper || hopper_reads_pages_) {
    // The Hopper family splits by its cost model (plan/prefill_split.h). A grid of two tiles per
    // SM or more is never split: the model's gain there is within its error, and the estimate is
    // skipped (plan time).
    info_.path = AttentionPath::kHopper;
    info_.kv_splits = 1;
    if (forced > 0) {
      info_.kv_splits = capped(forced);
    } else if (hopper_tiles < 2 * int64_t(num_sms_) && config_.max_kv_splits > 1) {
      const kernels::sm90::PrefillSm90Tile tile = kernels::sm90::prefill_sm90_tile(config_.head_dim);
      plan::PrefillSplitProblem problem;
      problem.qo_indptr = host_qo_indptr;
      problem.kv_indptr = table.host_indptr;
      problem.last_page_len = table.host_last_page_len;
      problem.page_size = config_.page_size;
      problem.batch = batch;
      problem.num_qo_heads = config_.num_qo_heads;
      problem.head_dim = config_.head_dim;
      problem.block_m = tile.block_m;
      problem.block_n = tile.block_n;
      problem.causal = config_.causal;
      problem.window_left = config_.window_left;
      problem.slots = num_sms_;
      problem.max_splits = config_.max_kv_splits;
      const plan::PrefillSplitChoice choice =
          plan::choose_prefill_split(problem, plan::hopper_prefill_split_cost(config_.head_dim, tile.block_m, config_.page_size));
      info_.kv_splits = capped(choice.splits);
      info_.estimated_us = choice.estimated_us;
    }
    if (config_.path != AttentionPath::kHopper && info_.kv_splits == 1) info_.path = config_.path;
    return;
  }
  // The portable family: enough CTAs for kTargetCtasPerSm per SM, each run at least
  // kMinKeysPerRun keys.
  const int64_t keys = longest * config_.page_size;
  const int64_t wanted = tiles > 0 ? (kTargetCtasPerSm * num_sms_ + tiles - 1) / tiles : 1;
  info_.kv_splits = capped(forced > 0 ? forced : std::min(wanted, keys / kMinKeysPerRun));
  info_.path = info_.kv_splits > 1 ? AttentionPath::kPortable : config_.path;
}

void BatchPrefillPaged::run(const PagedPrefillArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("BatchPrefillPaged::run");
  TESSERA_REQUIRE(check, planned_, "plan", "run() needs a plan(): call plan() once per step first");
  TESSERA_REQUIRE(check, a.path == AttentionPath::kAuto || a.path == config_.path, "path",
                  std::string("is ") + attention_path_name(a.path) + " but the config's is " +
                      attention_path_name(config_.path));
  // The planned family; a Hopper plan of an automatic config lets the dispatcher confirm it for
  // run()'s dtype (either family runs any split).
  PagedPrefillArgs planned = a;
  planned.path = info_.path == AttentionPath::kHopper && config_.path == AttentionPath::kAuto ? AttentionPath::kAuto
                                                                                              : info_.path;
  AttentionPath path = AttentionPath::kAuto;
  kernels::PrefillParams p = detail::paged_prefill_params(check, planned, path);
  TESSERA_REQUIRE(check, a.q.size(1) == config_.num_qo_heads && a.q.size(2) == config_.head_dim, "q",
                  "num_qo_heads and head_dim must be the config's");
  TESSERA_REQUIRE(check, a.host_qo_indptr[p.batch_size] == planned_rows_, "qo_indptr",
                  "differs from the planned step's (plan() once per step, then run() per layer)");
  TESSERA_REQUIRE(check, a.cache.page_size() == config_.page_size, "k_pages",
                  "page size " + std::to_string(a.cache.page_size()) + " differs from the config's " +
                      std::to_string(config_.page_size));
  const int64_t splits = info_.kv_splits;
  if (splits == 1) {
    detail::launch_prefill(p, path, a.q.dtype, static_cast<int>(a.q.size(2)), stream);
    return;
  }
  TESSERA_REQUIRE(check, a.q.size(0) <= config_.max_q_rows, "q",
                  "has " + std::to_string(a.q.size(0)) + " rows, more than the config's max_q_rows " +
                      std::to_string(config_.max_q_rows));
  const int64_t rows = a.q.size(0), heads = a.q.size(1), d = a.q.size(2);
  p.kv_splits = static_cast<int>(splits);
  p.partial_o = workspace_;
  p.partial_lse = workspace_ + splits * rows * heads * d;
  detail::launch_prefill(p, path, a.q.dtype, static_cast<int>(d), stream);
  // Partials [splits, rows, heads, d] seen as merge_states' [rows, splits, heads, d].
  const int64_t used = a.host_qo_indptr[p.batch_size];
  const TensorView o_parts = TensorView::strided(p.partial_o, DType::kFP32, {used, splits, heads, d},
                                                 {heads * d, rows * heads * d, d, 1});
  const TensorView s_parts = TensorView::strided(p.partial_lse, DType::kFP32, {used, splits, heads},
                                                 {heads, rows * heads, 1});
  TensorView o_out = a.o, s_out = a.lse;
  o_out.shape[0] = used;
  if (!s_out.empty_view()) s_out.shape[0] = used;
  if (used > 0) merge_states(o_parts, s_parts, o_out, s_out, stream);
}

}  // namespace tessera
