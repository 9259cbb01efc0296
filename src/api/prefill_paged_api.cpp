// BatchPrefillPaged: paged prefill with a KV split decided once per step (include/tessera/attention.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "api/paged_prefill_params.h"
#include "api/plan_phases.h"
#include "core/arg_check.h"
#include "core/cuda_check.h"
#include "dispatch/prefill_dispatch.h"
#include "format/bsr.h"
#include "kernels/merge/merge_states.h"
#include "kernels/attention/sm90/prefill_sm90_launch.h"
#include "tessera/attention.h"
#include "plan/prefill_schedule.h"
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

// The Hopper family's tiles as they run: packed GQA (pack) puts block_m >> pack tokens of a KV
// head's 2^pack query heads in a tile, and the grid counts num_qo_heads >> pack heads. The split
// judgement and the fixed grid's schedule both read this one derivation.
struct HopperRunTiles {
  int block_m, block_n, heads;
};
HopperRunTiles hopper_run_tiles(const PagedPrefillConfig& c, int pack) {
  const kernels::sm90::PrefillSm90Tile tile = kernels::sm90::prefill_sm90_tile(c.head_dim);
  return {tile.block_m >> pack, tile.block_n, c.num_qo_heads >> pack};
}

// The fixed grid (cuda_graph, or an eager config with max_batch_size) can run a step.
bool has_fixed_grid(const PagedPrefillConfig& c) { return c.cuda_graph || c.max_batch_size >= 1; }

// The workspace: the split partials (max_kv_splits > 1), then with the fixed grid the step's image
// (plan()'s copy): the PrefillStep header, qo_indptr [max_batch + 1], kv_indptr [max_batch + 1],
// kv_last_page_len [max_batch], and the static schedule (plan/prefill_schedule.h): slot_begin
// [kMaxPrefillSlots + 1] and the slots' list positions [max_schedule_tiles], int32.
std::size_t partial_bytes(const PagedPrefillConfig& c) {
  if (c.max_kv_splits == 1) return 0;
  const std::size_t states = std::size_t(c.max_kv_splits) * c.max_q_rows * c.num_qo_heads;
  return states * (std::size_t(c.head_dim) + 1) * sizeof(float);
}
struct StepImage {
  std::size_t offset = 0;  // bytes from the workspace's start (256-byte aligned)
  std::size_t bytes = 0;
  std::size_t qo_indptr = 0, kv_indptr = 0, last_page_len = 0, slot_begin = 0, slot_tiles = 0;  // int32 offsets
  std::size_t max_tiles = 0;  // the schedule's positions, at most
};
// plan() copies at least this much of the image. The driver writes a smaller pinned copy into its
// command stream on the calling thread, at the CPU's pace; from some size on it hands it to the
// copy engine for a fixed cost: on the H200 machine's host cudaMemcpyAsync took 3.3 us at 4 KB and
// 5.7 us at 16 KB, 2.1-2.3 us at 40 KB to 640 KB (notes/prefill_paged.md). Past the step's image
// the copy carries what earlier steps left in the staging buffer (zeros at first), which the
// kernels do not read.
constexpr std::size_t kMinStepCopyBytes = std::size_t(64) << 10;
// Query rows of the smallest tile either family runs (Hopper hd64 takes 192, the others 128).
constexpr std::size_t kSmallestBlockM = 64;
StepImage step_image(const PagedPrefillConfig& c) {
  StepImage im;
  if (!has_fixed_grid(c)) return im;
  im.offset = (partial_bytes(c) + 255) / 256 * 256;
  const std::size_t header = sizeof(kernels::PrefillStep) / sizeof(int32_t);
  im.qo_indptr = header;
  im.kv_indptr = im.qo_indptr + std::size_t(c.max_batch_size) + 1;
  im.last_page_len = im.kv_indptr + std::size_t(c.max_batch_size) + 1;
  im.slot_begin = im.last_page_len + std::size_t(c.max_batch_size);
  im.slot_tiles = im.slot_begin + kernels::kMaxPrefillSlots + 1;
  // Tiles with rows: sum of ceil(qo_len / block_m) <= max_q_rows / block_m + batch, per head and split.
  im.max_tiles = std::size_t(c.num_qo_heads) * c.max_kv_splits *
                 ((std::size_t(c.max_q_rows) + kSmallestBlockM - 1) / kSmallestBlockM + c.max_batch_size);
  im.bytes = std::max((im.slot_tiles + im.max_tiles) * sizeof(int32_t), kMinStepCopyBytes);
  return im;
}

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
  TESSERA_REQUIRE(check, c.num_kv_heads >= 0 && (c.num_kv_heads == 0 || c.num_qo_heads % c.num_kv_heads == 0),
                  "num_kv_heads", "must be 0 (not given) or divide num_qo_heads (" + std::to_string(c.num_qo_heads) +
                                      "), got " + std::to_string(c.num_kv_heads));
  if (c.cuda_graph) {
    TESSERA_REQUIRE(check, c.max_batch_size >= 1 && c.max_batch_size <= 65535, "max_batch_size",
                    "must be in 1..65535 with cuda_graph (it sizes the step's index arrays in the workspace), got " +
                        std::to_string(c.max_batch_size));
  } else {
    TESSERA_REQUIRE(check, c.max_batch_size >= 0 && c.max_batch_size <= 65535, "max_batch_size",
                    "must be in 0..65535 (0: not bounded, no fixed grid), got " + std::to_string(c.max_batch_size));
  }
}

// cuda_graph: grids of a fixed size over the step plan() wrote into the workspace (the index
// arrays there, not the arguments'), partials laid out for max_kv_splits whatever the step's
// count, and a merge that reads the step's split count (nothing to merge at 1).
void launch_fixed_grid(const detail::ArgCheck& check, const PagedPrefillConfig& config, float* workspace,
                       int planned_splits, int gqa_pack, const PagedPrefillArgs& a, kernels::PrefillParams& p,
                       AttentionPath path, cudaStream_t stream) {
  const bool can_split = config.max_kv_splits > 1;
  TESSERA_REQUIRE(check, !can_split || a.q.size(0) <= config.max_q_rows, "q",
                  "has " + std::to_string(a.q.size(0)) + " rows, more than the config's max_q_rows " +
                      std::to_string(config.max_q_rows) + " (the partials' buffers hold that many)");
  // The merge's grid-stride loop counts 8-element vectors of o in int32 (as merge_states checks).
  TESSERA_REQUIRE(check, a.q.size(0) * a.q.size(1) * a.q.size(2) / 8 < (int64_t(1) << 31) - (int64_t(1) << 24), "q",
                  "too many elements for the split merge of one call");
  const StepImage layout = step_image(config);
  unsigned char* const image = reinterpret_cast<unsigned char*>(workspace) + layout.offset;
  const int32_t* const arrays = reinterpret_cast<const int32_t*>(image);
  p.step = reinterpret_cast<const kernels::PrefillStep*>(image);
  p.qo_indptr = arrays + layout.qo_indptr;
  p.kv_indptr = arrays + layout.kv_indptr;
  p.kv_last_page_len = arrays + layout.last_page_len;
  p.slot_begin = arrays + layout.slot_begin;
  p.slot_tiles = arrays + layout.slot_tiles;
  // A window no request can exceed excludes nothing (paged_prefill_params judged it by this step's
  // longest request only).
  p.window_left = a.window_left >= format::kMaxRowTokens ? -1 : a.window_left;
  p.kv_splits = planned_splits;  // the host's view only: the kernels read the step's
  const int64_t rows = a.q.size(0), heads = a.q.size(1), d = a.q.size(2);
  if (can_split) {
    p.partial_o = workspace;
    p.partial_lse = workspace + int64_t(config.max_kv_splits) * rows * heads * d;
  }
  detail::launch_prefill(p, path, a.q.dtype, static_cast<int>(d), stream, gqa_pack);  // as plan() scheduled
  // An unsplit step's kernels write o themselves and its merge would write nothing: an eager
  // run() skips the launch (~3 us); a captured one keeps it for the later steps it replays.
  if (!can_split || (!config.cuda_graph && planned_splits == 1)) return;
  // Partials [split, row, head, d] read as the merge's stacked [row, split, head, d].
  kernels::MergeStatesParams m;
  m.num_states = config.max_kv_splits;
  m.stacked = true;
  m.o_base[0] = p.partial_o;
  m.s_base[0] = p.partial_lse;
  m.o_row[0] = heads * d;
  m.o_part = rows * heads * d;
  m.o_head[0] = d;
  m.s_row[0] = heads;
  m.s_part = rows * heads;
  m.s_head[0] = 1;
  m.o_out = a.o.data;
  m.o_out_row = a.o.stride[0];
  m.o_out_head = a.o.stride[1];
  if (!a.lse.empty_view()) {
    m.s_out = static_cast<float*>(a.lse.data);
    m.s_out_row = a.lse.stride[0];
    m.s_out_head = a.lse.stride[1];
  }
  m.rows = static_cast<int>(rows);
  m.heads = static_cast<int>(heads);
  m.head_dim = static_cast<int>(d);
  m.step = p.step;
  kernels::launch_merge_step_states(a.o.dtype, m, stream);
}

}  // namespace

// The fixed grid (cuda_graph or max_batch_size): the pinned staging buffer of the step's image, the
// event of its last copy, and the smallest buffers any captured run() was given (what a replay
// reads without a check).
struct BatchPrefillPaged::FixedGrid {
  void* staging = nullptr;
  cudaEvent_t copied = nullptr;
  int device = -1;                              // the GPU the grids and schedule are for
  AttentionPath family = AttentionPath::kAuto;  // the family the last schedule was made for
  plan::PrefillScheduleScratch scratch;         // the scheduler's
  plan::PrefillScheduleResult schedule;
  bool captured = false;
  int64_t q_rows = INT64_MAX, kv_indices_len = INT64_MAX, cache_pages = INT64_MAX;
  // The fixed grids and the schedule are for the GPU the object was made on.
  void require_device(const detail::ArgCheck& check) const {
    int current = -1;
    TESSERA_CUDA_CHECK(cudaGetDevice(&current));
    TESSERA_REQUIRE(check, current == device, "device",
                    "the current device " + std::to_string(current) + " is not the one this BatchPrefillPaged was made on (" +
                        std::to_string(device) + "): its fixed grids and schedule are that GPU's");
  }
  ~FixedGrid() {
    if (copied) cudaEventDestroy(copied);
    if (staging) cudaFreeHost(staging);
  }
};

namespace {
// Every request of the step has the same query rows and the same keys.
bool uniform_step(const int32_t* qo_indptr, const PageTable& table, int64_t batch) {
  for (int64_t r = 1; r < batch; ++r) {
    if (qo_indptr[r + 1] - qo_indptr[r] != qo_indptr[1] - qo_indptr[0] ||
        table.host_indptr[r + 1] - table.host_indptr[r] != table.host_indptr[1] - table.host_indptr[0] ||
        table.host_last_page_len[r] != table.host_last_page_len[0]) {
      return false;
    }
  }
  return true;
}
}  // namespace

BatchPrefillPaged::~BatchPrefillPaged() = default;

std::size_t BatchPrefillPaged::workspace_bytes(const PagedPrefillConfig& config) {
  const detail::ArgCheck check("BatchPrefillPaged::workspace_bytes");
  validate_config(check, config);
  const StepImage image = step_image(config);
  return has_fixed_grid(config) ? image.offset + image.bytes : partial_bytes(config);
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
  // Packed GQA on the Hopper family (num_kv_heads given): one choice for every step and grid of
  // this object. A KV split cuts each tile's own KV range into runs, and a packed tile (block_m /
  // group tokens) can see fewer KV tiles than an unpacked one, so the runs, and a request's bits,
  // follow the packing: batch_invariant needs all steps packed alike, and a captured graph's
  // tensor maps fix it anyway. A forced mode (tests, benchmarks) applies from construction on.
  const int limit = config.num_kv_heads > 0 ? dispatch::prefill_gqa_pack_limit(config.num_qo_heads, config.num_kv_heads) : 0;
  if (dispatch::forced_prefill_gqa_pack() != dispatch::GqaPack::kNever &&
      (int64_t(config.max_q_rows) << limit) < (int64_t(1) << 31)) {
    gqa_pack_ = limit;
  }
  if (has_fixed_grid(config)) {
    cudaPointerAttributes attr{};
    const bool device_memory = cudaPointerGetAttributes(&attr, workspace) == cudaSuccess &&
                               (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged);
    cudaGetLastError();
    TESSERA_REQUIRE(check, device_memory, "workspace",
                    "must be device memory (cudaMalloc) with cuda_graph or max_batch_size (plan() copies the step there)");
    fixed_ = std::make_unique<FixedGrid>();
    fixed_->device = device;
    const std::size_t staging_bytes = step_image(config).bytes;
    TESSERA_CUDA_CHECK(cudaMallocHost(&fixed_->staging, staging_bytes));
    std::memset(fixed_->staging, 0, staging_bytes);  // (plan() copies past the image)
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&fixed_->copied, cudaEventDisableTiming));
  }
}

void BatchPrefillPaged::plan(const int32_t* host_qo_indptr, const PageTable& table, cudaStream_t stream,
                             int64_t num_pages) {
  const detail::ArgCheck check("BatchPrefillPaged::plan");
  detail::PlanPhaseClock clock;  // (experiment builds only: plan_phases.h)
  planned_ = false;  // until this plan is complete: a plan() that throws leaves none for run()
  if (fixed_) {
    fixed_->require_device(check);
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    TESSERA_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    TESSERA_REQUIRE(check, capturing == cudaStreamCaptureStatusNone, "stream",
                    "is being captured into a CUDA graph: call plan() outside the graph, before each replay "
                    "(it copies the step from host memory)");
  }
  TESSERA_REQUIRE(check, host_qo_indptr != nullptr, "host_qo_indptr", "is required");
  TESSERA_REQUIRE(check, table.host_indptr != nullptr, "host_indptr", "is required (the host copy of kv_indptr)");
  TESSERA_REQUIRE(check, table.host_last_page_len != nullptr, "host_last_page_len",
                  "is required (the host copy of kv_last_page_len)");
  TESSERA_REQUIRE(check, table.indptr.rank == 1 && table.indptr.size(0) >= 1, "kv_indptr",
                  "must be 1-D with batch_size + 1 >= 1 entries");
  const int64_t batch = table.batch_size();
  check.indptr_host(host_qo_indptr, batch + 1, "qo_indptr", config_.max_q_rows, /*exact_end=*/false);
  // The page ids the table names lie inside kv_indices (plan() reads that many host ids); that
  // kv_indptr starts at 0 and never decreases, check_bsr below checks in its pass over the
  // requests (one pass, not two: ~1.5 ns a request each at 1024 requests).
  if (table.indices.rank == 1) {
    TESSERA_REQUIRE(check, table.host_indptr[batch] <= table.indices.size(0), "kv_indptr",
                    "last entry " + std::to_string(table.host_indptr[batch]) + " exceeds " +
                        std::to_string(table.indices.size(0)));
  }
  TESSERA_REQUIRE(check, num_pages >= -1, "num_pages", "must be >= 0 (the cache's pages) or -1 (not given)");
  const format::BsrLayout kv = format::bsr_from_page_table(config_.page_size, static_cast<int32_t>(batch),
                                                           table.host_indptr, table.host_indices,
                                                           table.host_last_page_len);
  if (num_pages >= 0) {
    TESSERA_REQUIRE(check, table.host_indices != nullptr, "host_indices",
                    "is required with num_pages (the page ids are checked against it)");
  }
  const std::string bad = format::check_bsr(kv, num_pages);
  if (!bad.empty()) {
    const format::BsrError e = format::split_bsr_error(bad);
    check.fail(e.array.c_str(), e.rule);
  }
  if (fixed_) {
    // A captured run() replays with the buffers it was captured with and checks nothing: every
    // later step must fit them and the workspace's index arrays, and its page ids must be checked.
    TESSERA_REQUIRE(check, batch <= config_.max_batch_size, "kv_indptr",
                    "batch size " + std::to_string(batch) + " exceeds the config's max_batch_size " +
                        std::to_string(config_.max_batch_size));
    // (Each request's keys, at most format::kMaxRowTokens, are checked in the pass below.)
    if (fixed_->captured) {
      TESSERA_REQUIRE(check, host_qo_indptr[batch] <= fixed_->q_rows, "qo_indptr",
                      "the step has " + std::to_string(host_qo_indptr[batch]) +
                          " query rows but the captured run() was given " + std::to_string(fixed_->q_rows));
      TESSERA_REQUIRE(check, table.host_indptr[batch] <= fixed_->kv_indices_len, "kv_indptr",
                      "the step uses " + std::to_string(table.host_indptr[batch]) +
                          " page-table entries but the captured run() was given " +
                          std::to_string(fixed_->kv_indices_len));
      TESSERA_REQUIRE(check, num_pages >= 0 && num_pages <= fixed_->cache_pages, "num_pages",
                      "must be given (>= 0) and at most the captured cache's " + std::to_string(fixed_->cache_pages) +
                          " pages once run() was captured: a replay follows the page ids unchecked");
    }
  }
  clock.end(detail::kPlanChecks);
  // The grid's query tiles (with rows; portable and Hopper tile heights: a packed Hopper tile holds
  // block_m >> gqa_pack_ tokens of a KV head's 2^gqa_pack_ query heads) and the longest key range
  // a tile can see.
  const HopperRunTiles hopper_run = hopper_run_tiles(config_, gqa_pack_);
  int64_t tiles = 0, hopper_tiles = 0, longest = 0, max_qo = 0;
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t qo = host_qo_indptr[r + 1] - host_qo_indptr[r];
    max_qo = std::max(max_qo, qo);
    tiles += (qo + kRowsPerCta - 1) / kRowsPerCta;
    hopper_tiles += plan::query_tiles(qo, hopper_run.block_m);
    const int64_t pages = table.host_indptr[r + 1] - table.host_indptr[r];
    longest = std::max(longest, pages);
    // The fixed grid's kernels count a request's keys in 32 bits (the request's rows and pages in
    // one pass: ~1.5 ns a request each at 1024 requests).
    if (fixed_) {
      TESSERA_REQUIRE(check, kv.row_tokens(static_cast<int32_t>(r)) <= format::kMaxRowTokens, "kv_indptr",
                      "request " + std::to_string(r) + " holds " + std::to_string(kv.row_tokens(static_cast<int32_t>(r))) +
                          " tokens; at most 2^31 - 2^16 are supported");
    }
  }
  clock.end(detail::kPlanTileLoop);
  tiles *= config_.num_qo_heads;
  const int64_t hopper_query_tiles = hopper_tiles;  // (the schedule's count, per head)
  hopper_tiles *= hopper_run.heads;
  info_.query_tiles = tiles;
  info_.estimated_us = 0.0;
  planned_rows_ = host_qo_indptr[batch];
  // Either family's grid counts every (request, head, query tile of the longest request) times the
  // splits in 31 bits: a split count (forced, or from a batch of many empty requests) that would
  // not fit is cut down.
  const int64_t smallest_rows = int64_t(kSmallestBlockM);  // of any tile shape (the compact hd256 one)
  const int64_t grid_tiles = batch * config_.num_qo_heads * ((max_qo + smallest_rows - 1) / smallest_rows);
  const int64_t fits = std::max<int64_t>(1, ((int64_t(1) << 31) - 1) / std::max<int64_t>(1, grid_tiles));
  auto capped = [&](int64_t splits) {
    return static_cast<int>(std::max<int64_t>(1, std::min({splits, int64_t(config_.max_kv_splits), fits})));
  };
  planned_batch_ = batch;
  // What both planners read of the step (the tile shape and slots are each one's).
  plan::PrefillTiling tiling;
  tiling.qo_indptr = host_qo_indptr;
  tiling.kv_indptr = table.host_indptr;
  tiling.last_page_len = table.host_last_page_len;
  tiling.page_size = config_.page_size;
  tiling.batch = batch;
  tiling.num_qo_heads = config_.num_qo_heads;
  tiling.causal = config_.causal;
  tiling.window_left = config_.window_left;
  // The family the step is planned for: the Hopper one where it reads this config's pages (or is
  // forced), else the portable one.
  const bool hopper_plans = config_.path == AttentionPath::kHopper || hopper_reads_pages_;
  info_.gqa_pack = hopper_plans ? gqa_pack_ : 0;
  // The split count (info_.kv_splits) and the family it is for (info_.path).
  [&] {
    const int forced = dispatch::forced_prefill_kv_splits();
    if (config_.batch_invariant) {
      // One split count for every step: a query tile's runs then depend on its own request only.
      info_.kv_splits = capped(config_.max_kv_splits);
      TESSERA_REQUIRE(check, info_.kv_splits == config_.max_kv_splits, "qo_indptr",
                      "the step's requests x heads x query tiles of the longest request x max_kv_splits exceed "
                      "the 2^31 list positions a step takes, so batch_invariant's split count cannot be kept");
      const AttentionPath family = hopper_plans ? AttentionPath::kHopper : AttentionPath::kPortable;
      info_.path = info_.kv_splits > 1 ? family : config_.path;
      return;
    }
    if (hopper_plans) {
      // The Hopper family splits by its cost model (plan/prefill_split.h). A grid of two tiles per
      // SM or more is never split: the model's gain there is within its error, and the estimate is
      // skipped (plan time).
      info_.path = AttentionPath::kHopper;
      info_.kv_splits = 1;
      if (forced > 0) {
        info_.kv_splits = capped(forced);
      } else if (hopper_tiles < 2 * int64_t(num_sms_) && config_.max_kv_splits > 1) {
        const int block_m = hopper_run.block_m << gqa_pack_;  // the tile's rows, packed or not
        plan::PrefillSplitProblem problem;
        static_cast<plan::PrefillTiling&>(problem) = tiling;
        problem.head_dim = config_.head_dim;
        // Judged on the tiles that run: packed, a decode-like request is one tile per KV head (a
        // tile costs its block_m rows, packed or not, so the cost model stands).
        problem.block_m = hopper_run.block_m;
        problem.num_qo_heads = hopper_run.heads;
        problem.packed_heads = 1 << gqa_pack_;
        problem.block_n = hopper_run.block_n;
        problem.slots = num_sms_;
        problem.max_splits = config_.max_kv_splits;
        const plan::PrefillSplitChoice choice =
            plan::choose_prefill_split(problem, plan::hopper_prefill_split_cost(config_.head_dim, block_m, config_.page_size));
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
  }();
  // The fixed grid runs every cuda_graph step, and with max_batch_size the eager steps whose
  // requests differ: there the plan's longest-first balance over persistent CTAs beat the
  // hardware's one-tile grid on 25 of 27 random serving steps (1.10-1.53x; the other two, where
  // one request's tile is the whole makespan, even), while steps of equal requests ran 0.97-1.01x
  // of it (their merge launch, and L2: the dynamic grid keeps a head's tiles together);
  // notes/prefill_paged.md.
  // (batch_invariant: the portable family's fixed-grid and one-tile kernels differ in the last bit,
  // so its eager steps keep the one-tile grid; the Hopper family's two grids agree bitwise.)
  const bool one_grid = config_.batch_invariant && !hopper_plans;
  info_.fixed_grid = fixed_ && (config_.cuda_graph || (!one_grid && !uniform_step(host_qo_indptr, table, batch)));
  clock.end(detail::kPlanSplit);
  if (!info_.fixed_grid) {
    planned_ = true;
    return;
  }
  // The step's image: the kernels' PrefillStep and the index arrays they read in place of run()'s.
  // The staging buffer may still be read by the previous step's copy (long done in a serving loop).
  TESSERA_CUDA_CHECK(cudaEventSynchronize(fixed_->copied));
  clock.end(detail::kPlanEventWait);
  const StepImage layout = step_image(config_);
  int32_t* image = static_cast<int32_t*>(fixed_->staging);
  // The static schedule, for the family that will run (its tile shape; run() checks it is the one).
  const bool hopper = hopper_plans;
  fixed_->family = hopper ? AttentionPath::kHopper : AttentionPath::kPortable;
  plan::PrefillScheduleProblem sp;
  static_cast<plan::PrefillTiling&>(sp) = tiling;
  if (hopper) {
    sp.block_m = hopper_run.block_m;
    sp.block_n = hopper_run.block_n;
    sp.num_qo_heads = hopper_run.heads;
    sp.max_qo_len = max_qo;  // (this pass's: the schedule's own pass over the requests skipped)
    sp.query_tiles = hopper_query_tiles;
  } else {
    sp.block_m = kernels::prefill_sm80_block_m(config_.head_dim);
    sp.block_n = 64;  // (costs only)
  }
  TESSERA_REQUIRE(check, sp.block_m > 0, "head_dim",
                  std::to_string(config_.head_dim) + " is not compiled for the " + attention_path_name(fixed_->family) +
                      " family in this build");
  sp.kv_splits = info_.kv_splits;
  // The kernels decode list positions ((request x heads + head) x m_tiles + m_tile) x splits + split
  // in int32.
  const int64_t positions = batch * sp.num_qo_heads * ((max_qo + sp.block_m - 1) / sp.block_m) * sp.kv_splits;
  TESSERA_REQUIRE(check, positions < (int64_t(1) << 31), "qo_indptr",
                  "the step's " + std::to_string(batch) + " requests x " + std::to_string(config_.num_qo_heads) +
                      " heads x query tiles of the longest request x splits make " + std::to_string(positions) +
                      " list positions; the fixed-grid kernels take < 2^31");
  // One slot per CTA the fixed grid holds: the Hopper family one CTA per SM; the portable one
  // walks slots round-robin over its resident CTAs (two per SM planned).
  sp.slots = std::min(kernels::kMaxPrefillSlots, hopper ? num_sms_ : 2 * num_sms_);
  if (plan::prefill_schedule_tiles(sp) > int64_t(layout.max_tiles)) {
    throw Error("tessera::BatchPrefillPaged::plan: the step's schedule outgrew its workspace (internal error)");
  }
  fixed_->schedule = plan::schedule_prefill(sp, image + layout.slot_begin, image + layout.slot_tiles, fixed_->scratch);
  clock.end(detail::kPlanSchedule);
  kernels::PrefillStep step{};
  step.batch_size = static_cast<int32_t>(batch);
  step.max_qo_len = static_cast<int32_t>(max_qo);
  step.kv_splits = info_.kv_splits;
  step.rows = host_qo_indptr[batch];
  step.slots = sp.slots;
  std::memcpy(image, &step, sizeof(step));
  std::memcpy(image + layout.qo_indptr, host_qo_indptr, sizeof(int32_t) * (batch + 1));
  std::memcpy(image + layout.kv_indptr, table.host_indptr, sizeof(int32_t) * (batch + 1));
  std::memcpy(image + layout.last_page_len, table.host_last_page_len, sizeof(int32_t) * batch);
  const std::size_t bytes =
      std::max(sizeof(int32_t) * (layout.slot_tiles + std::size_t(fixed_->schedule.tiles)), kMinStepCopyBytes);
  clock.end(detail::kPlanImage);
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<unsigned char*>(workspace_) + layout.offset, image, bytes,
                                     cudaMemcpyHostToDevice, stream));
  clock.end(detail::kPlanCopyEnqueue);
  TESSERA_CUDA_CHECK(cudaEventRecord(fixed_->copied, stream));
  clock.end(detail::kPlanEventRecord);
  planned_ = true;
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
  TESSERA_REQUIRE(check, config_.num_kv_heads == 0 || p.num_kv_heads == config_.num_kv_heads, "k_pages",
                  "has " + std::to_string(p.num_kv_heads) + " KV heads but the config's num_kv_heads is " +
                      std::to_string(config_.num_kv_heads));
  TESSERA_REQUIRE(check, p.batch_size == planned_batch_ && a.host_qo_indptr[p.batch_size] == planned_rows_,
                  "qo_indptr", "differs from the planned step's (plan() once per step, then run() per layer)");
  TESSERA_REQUIRE(check, a.cache.page_size() == config_.page_size, "k_pages",
                  "page size " + std::to_string(a.cache.page_size()) + " differs from the config's " +
                      std::to_string(config_.page_size));
  if (info_.fixed_grid) fixed_->require_device(check);
  // An eager step planned for the fixed grid whose dtype takes the other family (not compiled for
  // it) runs the one-tile grid: the schedule is the planned family's.
  if (info_.fixed_grid && (config_.cuda_graph || path == fixed_->family)) {
    // The kernels read the planned index arrays with the arguments' kv_indices and cache, which
    // run()'s checks above validated against the arguments' host copies: those must be the plan's.
    const StepImage layout = step_image(config_);
    const int32_t* planned_image = static_cast<const int32_t*>(fixed_->staging);
    auto same = [&](const int32_t* given, std::size_t at, int64_t count) {
      return count == 0 || std::memcmp(given, planned_image + at, sizeof(int32_t) * std::size_t(count)) == 0;
    };
    TESSERA_REQUIRE(check, same(a.host_qo_indptr, layout.qo_indptr, planned_batch_ + 1), "qo_indptr",
                    "differs from the planned step's (the fixed grid reads the step plan() saw)");
    TESSERA_REQUIRE(check, same(a.table.host_indptr, layout.kv_indptr, planned_batch_ + 1), "kv_indptr",
                    "differs from the planned step's (the fixed grid reads the step plan() saw)");
    TESSERA_REQUIRE(check, same(a.table.host_last_page_len, layout.last_page_len, planned_batch_), "kv_last_page_len",
                    "differs from the planned step's (the fixed grid reads the step plan() saw)");
    // A window of 2^31 - 2^16 keys or more excludes nothing (no request is longer); a slightly
    // smaller one could overflow the band's int32 arithmetic over a step's rows.
    TESSERA_REQUIRE(check, a.window_left < format::kMaxRowTokens - config_.max_q_rows || a.window_left >= format::kMaxRowTokens,
                    "window_left", "on the fixed grid must be below 2^31 - 2^16 - max_q_rows, or 2^31 - 2^16 or more (none)");
    TESSERA_REQUIRE(check, path == fixed_->family, "path",
                    std::string("runs the ") + attention_path_name(path) + " family for this dtype, but plan() " +
                        "scheduled the step for the " + attention_path_name(fixed_->family) +
                        " family: with cuda_graph, set the config's path to the family run() takes");
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TESSERA_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    launch_fixed_grid(check, config_, workspace_, info_.kv_splits, gqa_pack_, a, p, path, stream);
    if (capture != cudaStreamCaptureStatusNone) {  // what later plans must fit
      fixed_->captured = true;
      fixed_->q_rows = std::min(fixed_->q_rows, a.q.size(0));
      fixed_->kv_indices_len = std::min(fixed_->kv_indices_len, a.table.indices.size(0));
      fixed_->cache_pages = std::min(fixed_->cache_pages, a.cache.num_pages());
    }
    return;
  }
  const int64_t splits = info_.kv_splits;
  if (splits == 1) {
    detail::launch_prefill(p, path, a.q.dtype, static_cast<int>(a.q.size(2)), stream, gqa_pack_);
    return;
  }
  TESSERA_REQUIRE(check, a.q.size(0) <= config_.max_q_rows, "q",
                  "has " + std::to_string(a.q.size(0)) + " rows, more than the config's max_q_rows " +
                      std::to_string(config_.max_q_rows));
  const int64_t rows = a.q.size(0), heads = a.q.size(1), d = a.q.size(2);
  p.kv_splits = static_cast<int>(splits);
  p.partial_o = workspace_;
  p.partial_lse = workspace_ + splits * rows * heads * d;
  detail::launch_prefill(p, path, a.q.dtype, static_cast<int>(d), stream, gqa_pack_);
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
