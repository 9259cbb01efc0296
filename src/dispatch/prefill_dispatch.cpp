#include "dispatch/prefill_dispatch.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <string>

#include "core/cuda_check.h"
#include "dispatch/kernel_families.h"
#include "kernels/attention/prefill_params.h"
#include "kernels/attention/sm90/prefill_sm90_launch.h"
#include "tessera/error.h"
#include "tessera_instantiations.h"

namespace tessera {

namespace kernels {
// One per instantiation group (src/kernels/attention/portable/prefill_sm80_hd*.cu).
#if TESSERA_INST_HD64
void launch_prefill_sm80_hd64(DType dtype, const PrefillParams& p, bool compact, cudaStream_t stream);
int prefill_sm80_smem_bytes_hd64(bool compact);
int prefill_sm80_block_m_hd64(bool compact);
#endif
#if TESSERA_INST_HD128
void launch_prefill_sm80_hd128(DType dtype, const PrefillParams& p, bool compact, cudaStream_t stream);
int prefill_sm80_smem_bytes_hd128(bool compact);
int prefill_sm80_block_m_hd128(bool compact);
#endif
#if TESSERA_INST_HD256
void launch_prefill_sm80_hd256(DType dtype, const PrefillParams& p, bool compact, cudaStream_t stream);
int prefill_sm80_smem_bytes_hd256(bool compact);
int prefill_sm80_block_m_hd256(bool compact);
#endif

bool prefill_sm80_compiled(DType dtype, int head_dim) {
  if (!dispatch::prefill_dtype_compiled(dtype)) return false;
  for (int d : dispatch::compiled_prefill_head_dims()) {
    if (d == head_dim) return true;
  }
  return false;
}

namespace {
int prefill_sm80_smem_bytes(int head_dim, bool compact) {
  switch (head_dim) {
#if TESSERA_INST_HD64
    case 64: return prefill_sm80_smem_bytes_hd64(compact);
#endif
#if TESSERA_INST_HD128
    case 128: return prefill_sm80_smem_bytes_hd128(compact);
#endif
#if TESSERA_INST_HD256
    case 256: return prefill_sm80_smem_bytes_hd256(compact);
#endif
    default: return 0;
  }
}
int prefill_sm80_block_m(int head_dim, bool compact) {
  switch (head_dim) {
#if TESSERA_INST_HD64
    case 64: return prefill_sm80_block_m_hd64(compact);
#endif
#if TESSERA_INST_HD128
    case 128: return prefill_sm80_block_m_hd128(compact);
#endif
#if TESSERA_INST_HD256
    case 256: return prefill_sm80_block_m_hd256(compact);
#endif
    default: return 0;
  }
}
// The default tile shape where the GPU's shared memory per block holds it, else the compact one
// (hd256 on sm_86 / sm_89).
bool prefill_sm80_compact(int head_dim) {
  return prefill_sm80_smem_bytes(head_dim, false) > dispatch::shared_memory_per_block();
}
}  // namespace

int prefill_sm80_block_m(int head_dim) { return prefill_sm80_block_m(head_dim, prefill_sm80_compact(head_dim)); }

void launch_prefill_sm80(DType dtype, int head_dim, const PrefillParams& params,
                         cudaStream_t stream) {
  if (params.gqa_pack != 0) throw Error("tessera: the portable prefill family does not pack GQA heads (internal error)");
  if (!prefill_sm80_compiled(dtype, head_dim)) {
    throw Error(std::string("tessera: portable prefill for ") + dtype_name(dtype) + " head_dim " +
                std::to_string(head_dim) + " is not compiled in this build (TESSERA_HEAD_DIMS / "
                "TESSERA_DTYPES)");
  }
  // Neither tile shape fitting (prefill_sm80_compact) is an error, not a launch failure.
  const int budget = dispatch::shared_memory_per_block();
  const bool compact = prefill_sm80_compact(head_dim);
  if (compact && prefill_sm80_smem_bytes(head_dim, true) > budget) {
    throw Error("tessera: portable prefill at head_dim " + std::to_string(head_dim) + " needs " +
                std::to_string(prefill_sm80_smem_bytes(head_dim, true)) +
                " bytes of shared memory per block; this GPU allows " + std::to_string(budget));
  }
  switch (head_dim) {
#if TESSERA_INST_HD64
    case 64: launch_prefill_sm80_hd64(dtype, params, compact, stream); return;
#endif
#if TESSERA_INST_HD128
    case 128: launch_prefill_sm80_hd128(dtype, params, compact, stream); return;
#endif
#if TESSERA_INST_HD256
    case 256: launch_prefill_sm80_hd256(dtype, params, compact, stream); return;
#endif
    default: break;
  }
}

namespace sm90 {
// One per instantiation group (generated prefill_sm90_hd*.cu, sm_90a).
#if TESSERA_INST_HOPPER
#define TESSERA_DECLARE_PREFILL_SM90(HD)                                                                   \
  void launch_prefill_sm90_hd##HD(DType dtype, const PrefillParams& p, const PrefillSm90Schedule& schedule, \
                                  int num_sms, cudaStream_t stream);                                        \
  int prefill_sm90_smem_bytes_hd##HD();                                                                    \
  PrefillSm90Tile prefill_sm90_tile_hd##HD();
#if TESSERA_INST_HD64
TESSERA_DECLARE_PREFILL_SM90(64)
#endif
#if TESSERA_INST_HD128
TESSERA_DECLARE_PREFILL_SM90(128)
#define TESSERA_DECLARE_PREFILL_SM90_WIDE(N)                                                                  \
  void launch_prefill_sm90_hd128_n##N(DType dtype, const PrefillParams& p, const PrefillSm90Schedule& schedule, \
                                      int num_sms, cudaStream_t stream);                                        \
  int prefill_sm90_smem_bytes_hd128_n##N();
#if TESSERA_INST_HD128_N160
TESSERA_DECLARE_PREFILL_SM90_WIDE(160)
#endif
#if TESSERA_INST_HD128_N192
TESSERA_DECLARE_PREFILL_SM90_WIDE(192)
#endif
#undef TESSERA_DECLARE_PREFILL_SM90_WIDE
#endif
#if TESSERA_INST_HD256
TESSERA_DECLARE_PREFILL_SM90(256)
#endif
#undef TESSERA_DECLARE_PREFILL_SM90
#endif

bool prefill_sm90_compiled(DType dtype, int head_dim) {
  return TESSERA_INST_HOPPER && prefill_sm80_compiled(dtype, head_dim);
}

PrefillSm90BlockNChoices prefill_sm90_block_n_choices(int head_dim) {
  PrefillSm90BlockNChoices c{1, {prefill_sm90_default_block_n(head_dim), 0, 0}};
#if TESSERA_INST_HOPPER && TESSERA_INST_HD128
  if (head_dim == 128) {
    if (TESSERA_INST_HD128_N160) c.keys[c.count++] = 160;
    if (TESSERA_INST_HD128_N192) c.keys[c.count++] = 192;
  }
#endif
  return c;
}

int prefill_sm90_smem_bytes(int head_dim, int block_n) {
#if TESSERA_INST_HOPPER && TESSERA_INST_HD128
#if TESSERA_INST_HOPPER && TESSERA_INST_HD128 && TESSERA_INST_HD128_N160
  if (head_dim == 128 && block_n == 160) return prefill_sm90_smem_bytes_hd128_n160();
#endif
#if TESSERA_INST_HOPPER && TESSERA_INST_HD128 && TESSERA_INST_HD128_N192
  if (head_dim == 128 && block_n == 192) return prefill_sm90_smem_bytes_hd128_n192();
#endif
#endif
  if (block_n != 0 && block_n != prefill_sm90_default_block_n(head_dim)) return 0;
  switch (head_dim) {
#if TESSERA_INST_HOPPER && TESSERA_INST_HD64
    case 64: return prefill_sm90_smem_bytes_hd64();
#endif
#if TESSERA_INST_HOPPER && TESSERA_INST_HD128
    case 128: return prefill_sm90_smem_bytes_hd128();
#endif
#if TESSERA_INST_HOPPER && TESSERA_INST_HD256
    case 256: return prefill_sm90_smem_bytes_hd256();
#endif
    default: return 0;
  }
}

PrefillSm90Tile prefill_sm90_tile(int head_dim) {
  switch (head_dim) {
#if TESSERA_INST_HOPPER && TESSERA_INST_HD64
    case 64: return prefill_sm90_tile_hd64();
#endif
#if TESSERA_INST_HOPPER && TESSERA_INST_HD128
    case 128: return prefill_sm90_tile_hd128();
#endif
#if TESSERA_INST_HOPPER && TESSERA_INST_HD256
    case 256: return prefill_sm90_tile_hd256();
#endif
    default: return {128, 128};
  }
}

void launch_prefill_sm90(DType dtype, int head_dim, const PrefillParams& params, const PrefillSm90Schedule& schedule,
                         int num_sms, cudaStream_t stream) {
  if (!prefill_sm90_compiled(dtype, head_dim)) {
    throw Error(std::string("tessera: Hopper prefill for ") + dtype_name(dtype) + " head_dim " +
                std::to_string(head_dim) + " is not compiled in this build (TESSERA_HOPPER / TESSERA_HEAD_DIMS / "
                "TESSERA_DTYPES)");
  }
  switch (head_dim) {
#if TESSERA_INST_HOPPER && TESSERA_INST_HD64
    case 64: launch_prefill_sm90_hd64(dtype, params, schedule, num_sms, stream); return;
#endif
#if TESSERA_INST_HOPPER && TESSERA_INST_HD128
    case 128:
#if TESSERA_INST_HD128_N160
      if (schedule.block_n == 160) {
        launch_prefill_sm90_hd128_n160(dtype, params, schedule, num_sms, stream);
        return;
      }
#endif
#if TESSERA_INST_HD128_N192
      if (schedule.block_n == 192) {
        launch_prefill_sm90_hd128_n192(dtype, params, schedule, num_sms, stream);
        return;
      }
#endif
      launch_prefill_sm90_hd128(dtype, params, schedule, num_sms, stream);
      return;
#endif
#if TESSERA_INST_HOPPER && TESSERA_INST_HD256
    case 256: launch_prefill_sm90_hd256(dtype, params, schedule, num_sms, stream); return;
#endif
    default: break;
  }
  (void)params;
  (void)schedule;
  (void)num_sms;
  (void)stream;
}
}  // namespace sm90
}  // namespace kernels

namespace dispatch {

namespace {
std::atomic<int> g_shared_memory_limit{0};
}  // namespace

void limit_shared_memory_per_block(int bytes) { g_shared_memory_limit.store(bytes); }

namespace {
// A fixed attribute of the current device, read once per device (devices 0..63; others every
// time): the prefill entry points read them on every launch.
template <cudaDeviceAttr kAttribute>
int current_device_attribute() {
  static std::array<std::atomic<int>, 64> value_of{};  // 0: not read yet
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  int value = device < 64 ? value_of[device].load(std::memory_order_relaxed) : 0;
  if (value == 0) {
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&value, kAttribute, device));
    if (device < 64) value_of[device].store(value, std::memory_order_relaxed);
  }
  return value;
}
}  // namespace

int shared_memory_per_block() {
  const int optin = current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
  const int limit = g_shared_memory_limit.load();
  return limit > 0 ? std::min(limit, optin) : optin;
}

std::vector<int> compiled_prefill_head_dims() {
  std::vector<int> dims;
  if (TESSERA_INST_HD64) dims.push_back(64);
  if (TESSERA_INST_HD128) dims.push_back(128);
  if (TESSERA_INST_HD256) dims.push_back(256);
  return dims;
}

bool prefill_dtype_compiled(DType dtype) {
  return (dtype == DType::kBF16 && TESSERA_INST_BF16) || (dtype == DType::kFP16 && TESSERA_INST_FP16);
}

PrefillChoice choose_prefill(AttentionPath requested, int cc_major, int cc_minor, DType dtype, int head_dim,
                             const PrefillProblem& problem) {
  PrefillChoice c;
  const std::string gpu = "sm_" + std::to_string(cc_major) + std::to_string(cc_minor);
  if (cc_major < 8) {
    c.why_not = "the GPU (" + gpu + ") is older than sm_80, the oldest tessera supports";
    return c;
  }
  // Why the Hopper family cannot run this problem here ("" when it can).
  const KernelFamily& hopper = *kernel_family(AttentionPath::kHopper);
  std::string hopper_no;
  if (!hopper.built) {
    hopper_no = "the Hopper prefill family is not in this build (TESSERA_HOPPER=OFF)";
  } else if (!hopper.runs_on(cc_major, cc_minor)) {
    hopper_no = "the Hopper prefill family runs on sm_90 only; this GPU is " + gpu;
  } else if (!kernels::sm90::prefill_sm90_compiled(dtype, head_dim)) {
    hopper_no = std::string("Hopper prefill for ") + dtype_name(dtype) + " head_dim " + std::to_string(head_dim) +
                " is not compiled in this build";
  } else if (problem.shared_memory_per_block > 0 &&
             kernels::sm90::prefill_sm90_smem_bytes(head_dim) > problem.shared_memory_per_block) {
    hopper_no = "the Hopper prefill family needs " + std::to_string(kernels::sm90::prefill_sm90_smem_bytes(head_dim)) +
                " bytes of shared memory per block at head_dim " + std::to_string(head_dim) + "; this GPU allows " +
                std::to_string(problem.shared_memory_per_block);
  } else if (problem.tiles >= (int64_t(1) << 31)) {
    hopper_no = "the problem has " + std::to_string(problem.tiles) + " query tiles; the Hopper family takes < 2^31";
  }
  // Pages TMA cannot box (page_size % 8 != 0) the Hopper family gathers with cp.async
  // (GatheredKVSm90); on the H200 that beats the portable family at every head dim (8K, page 1,
  // same run: hd64 459 vs 294 TFLOP/s, hd128 487 vs 362, hd256 482 vs 329), so auto takes it.
  if (requested == AttentionPath::kHopper || (requested == AttentionPath::kAuto && hopper_no.empty())) {
    if (!hopper_no.empty()) {
      c.why_not = hopper_no;
      return c;
    }
    c.path = AttentionPath::kHopper;
    c.ok = true;
    return c;
  }
  if (!kernels::prefill_sm80_compiled(dtype, head_dim)) {
    c.why_not = std::string("portable prefill for ") + dtype_name(dtype) + " head_dim " +
                std::to_string(head_dim) + " is not compiled in this build";
    return c;
  }
  c.path = AttentionPath::kPortable;
  c.ok = true;
  return c;
}

namespace {
std::atomic<bool> g_schedule_forced{false};
kernels::sm90::PrefillSm90Schedule g_forced_schedule;
std::atomic<int> g_forced_kv_splits{0};
std::atomic<GqaPack> g_gqa_pack{GqaPack::kAuto};
std::atomic<int> g_forced_block_n{0};
// Keys a query row sees, weighted by work (PrefillParams::work_weighted_row_keys), from which hd128
// takes 192-key tiles: with O staged in a V stage, between 2K non-causal (2048: 1.00x) and 4K
// causal (2731: 1.01x).
constexpr int64_t kWideKvTileMinKeys = 2400;
constexpr int kWideKvTileKeys = 192;
kernels::sm90::PrefillSm90Schedule choose_prefill_sm90_order(const kernels::PrefillParams& p, int head_dim,
                                                             int num_sms, int64_t l2_cache_bytes);
}  // namespace

int prefill_gqa_pack_limit(int num_qo_heads, int num_kv_heads) {
  if (num_kv_heads <= 0 || num_qo_heads % num_kv_heads != 0) return 0;
  const int group = num_qo_heads / num_kv_heads;
  if (group < 2 || (group & (group - 1)) != 0) return 0;
  int pack = 0;
  while ((1 << pack) < group) ++pack;
  return pack <= kernels::sm90::kMaxGqaPack ? pack : 0;
}

int choose_prefill_gqa_pack(const kernels::PrefillParams& p) {
  const int pack = prefill_gqa_pack_limit(p.num_qo_heads, p.num_kv_heads);
  const GqaPack mode = g_gqa_pack.load();
  if (pack == 0 || mode == GqaPack::kNever || (int64_t(p.max_qo_len) << pack) >= (int64_t(1) << 31)) return 0;
  // Packed, a tile holds block_m / group tokens of every head of the group: never more tiles than
  // unpacked, the same masked share of a tile's keys, one read of the group's K / V, and the
  // short requests of a batch fill tiles with their heads instead of leaving rows empty. Same
  // run, two rounds each (H200, notes/prefill_hopper.md v9): serving_b256 186 vs 72 TFLOP/s,
  // serving_b1024 118 vs 41, mixed_b16 513 vs 468; equal long requests 1.00-1.03x (GQA 4 2K
  // causal 510 vs 496, GQA 8 16K causal 608 vs 591, GQA 8 8K 628 vs 630). So: wherever possible.
  return pack;
}

void force_prefill_gqa_pack(GqaPack mode) { g_gqa_pack.store(mode); }
GqaPack forced_prefill_gqa_pack() { return g_gqa_pack.load(); }

void force_prefill_kv_splits(int splits) { g_forced_kv_splits.store(splits > 0 ? splits : 0); }
int forced_prefill_kv_splits() { return g_forced_kv_splits.load(); }

void force_prefill_sm90_schedule(const kernels::sm90::PrefillSm90Schedule* schedule) {
  if (schedule != nullptr) g_forced_schedule = *schedule;
  g_schedule_forced.store(schedule != nullptr);
}

// The keys a query row sees under the mask, averaged over the batch's rows weighted by those
// keys (PrefillParams::work_weighted_row_keys; host copies): sum of k_r^2 / sum of k_r over rows
// r. Per request of q rows over k keys: without the causal mask every row sees k; bottom-right
// causal, row r sees min(k, k - q + r + 1) (>= 0), a run of consecutive counts. A left window caps
// a row at window_left + 1 (exact for causal rows; for non-causal ones an estimate, which is all
// the choice needs).
int64_t work_weighted_row_keys(const int32_t* host_qo_indptr, const int32_t* host_kv_indptr, int64_t batch,
                               bool causal, int window_left) {
  const double cap = window_left >= 0 ? double(window_left) + 1 : 0;
  // Rows seeing lo, lo + 1, ..., hi keys (one row each), capped: (sum of keys, sum of squares).
  const auto run = [cap](double lo, double hi, double& sum, double& squares) {
    if (hi < lo) return;
    const auto s1 = [](double n) { return n * (n + 1) / 2; };
    const auto s2 = [](double n) { return n * (n + 1) * (2 * n + 1) / 6; };
    double top = hi;
    if (cap > 0 && hi > cap) {
      const double capped = hi - std::max(lo - 1, cap);  // rows over the cap
      sum += capped * cap;
      squares += capped * cap * cap;
      top = std::max(lo - 1, cap);
    }
    sum += s1(top) - s1(lo - 1);
    squares += s2(top) - s2(lo - 1);
  };
  double sum = 0, squares = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const double q = host_qo_indptr[i + 1] - host_qo_indptr[i], k = double(host_kv_indptr[i + 1] - host_kv_indptr[i]);
    if (q <= 0 || k <= 0) continue;
    if (causal) {
      run(std::max(1.0, k - q + 1), k, sum, squares);
    } else {
      const double seen = cap > 0 ? std::min(k, cap) : k;
      sum += q * seen;
      squares += q * seen * seen;
    }
  }
  return sum > 0 ? static_cast<int64_t>(squares / sum) : 0;
}

void force_prefill_sm90_block_n(int keys) { g_forced_block_n.store(keys > 0 ? keys : 0); }

int choose_prefill_sm90_block_n(const kernels::PrefillParams& p, int head_dim, int shared_memory_per_block) {
  using namespace kernels::sm90;
  const PrefillSm90BlockNChoices choices = prefill_sm90_block_n_choices(head_dim);
  const int forced = g_forced_block_n.load();
  if (forced > 0) {
    for (int i = 0; i < choices.count; ++i)
      if (choices.keys[i] == forced && (i == 0 || !p.paged)) return forced;
    return choices.keys[0];  // (a width this head dim or source does not have: the default)
  }
  // hd128's 192-key tiles (ragged K / V): a tile's fixed work spread over 1.5x the keys, which
  // pays only where a query tile walks many KV tiles; below, the wider tile's longer first S and
  // last P V per work tile cost more than it saves. Same run, H200, 192 (O in a V stage) / 128
  // keys (notes/prefill_hopper.md v11; work-weighted keys a row in brackets): 1K 0.92 (1024), 1K
  // causal 0.88 (683), 2K 1.00 (2048), 4K 1.01, 4K causal 1.01 (2731), 8K 1.03, 8K causal 1.03
  // (5461), 16K 1.04, GQA 4 16K causal 1.05, GQA 8 8K 1.03.
  bool wide_built = false;
  for (int i = 1; i < choices.count; ++i) wide_built |= choices.keys[i] == kWideKvTileKeys;
  const bool wide_fits = wide_built && !p.paged &&
                         (shared_memory_per_block <= 0 ||
                          prefill_sm90_smem_bytes(head_dim, kWideKvTileKeys) <= shared_memory_per_block);
  if (wide_fits && p.work_weighted_row_keys >= kWideKvTileMinKeys) return kWideKvTileKeys;
  return choices.keys[0];
}

kernels::sm90::PrefillSm90Schedule choose_prefill_sm90_schedule(const kernels::PrefillParams& p, int head_dim,
                                                                int num_sms, int shared_memory_per_block,
                                                                int64_t l2_cache_bytes) {
  kernels::sm90::PrefillSm90Schedule s = choose_prefill_sm90_order(p, head_dim, num_sms, l2_cache_bytes);
  s.block_n = choose_prefill_sm90_block_n(p, head_dim, shared_memory_per_block);
  return s;
}

namespace {
kernels::sm90::PrefillSm90Schedule choose_prefill_sm90_order(const kernels::PrefillParams& p, int head_dim,
                                                             int num_sms, int64_t l2_cache_bytes) {
  using namespace kernels::sm90;
  if (p.step != nullptr) {
    // A fixed-grid launch (a CUDA graph's) walks the plan's schedule (plan/prefill_schedule.h),
    // whose positions are in this order; a forced schedule does not apply.
    PrefillSm90Schedule s;
    s.scheduler = SchedulerKind::kStaticPersistent;
    s.order = TileOrder::kQueryTilesInner;
    return s;
  }
  if (g_schedule_forced.load()) return g_forced_schedule;
  // Measured on the H200 (notes/prefill_hopper.md, "Schedules"; runs 3-6, which move by up to
  // 10% between runs, so each rule rests on the cases where the runs agree):
  // - causal, hd64 / hd128: a persistent CTA takes a query tile and its mirror (equal cost per
  //   turn): 1K 316 vs 261, 2K 408 vs 358, 16K 606 vs 566, gqa4 16K 602 vs 546 TFLOP/s against
  //   the one-tile grid;
  // - causal, hd256: one tile per CTA, heaviest first, the hardware balancing (16K 662 vs 645,
  //   and 663 vs 647 in another run);
  // - non-causal: the persistent CTAs over each head's query tiles (gqa4 8K 621 vs 504 against the
  //   one-tile grid; MHA even from 8K and ahead below: 1K 474 vs 413).
  // - a KV split (BatchPrefillPaged): the persistent CTAs over the list, a tile's splits
  //   neighbours (equal runs: no pairing by cost);
  // - causal batches whose lengths differ (chunked prefill beside decode-like requests) or whose
  //   pairs would leave SMs idle (fewer than two tiles per SM: the pairs halve the grid): one tile
  //   per CTA, heaviest first, the hardware filling SMs as they free up. Where every request's
  //   query tiles cost within 2x of each other (at least as many keys before its chunk as in it:
  //   chunked prefill) and the batch's K / V outgrow the L2, each head's query tiles go together
  //   instead (heaviest first within the head): the last query tile of every head first makes
  //   each wave stream every head's K / V from DRAM again. Same binary, two rounds (H100, notes/
  //   prefill_paged.md): 128 query tokens x 8 requests over 8K / 32K / 64K keys (GQA 4, pages of
  //   16) 542 / 557 / 563 against 493 / 503 / 505 TFLOP/s (DRAM read 545 -> ~270 MB at 8K), 512 x 2
  //   over 8K (64 MB of K / V) 551 / 557 against 537 / 534; 1024 x 1 over 8K (32 MB, inside the
  //   L2) 549 / 547 against 551 / 556: there the order does not matter for DRAM and the global
  //   heaviest-first balances better.
  const int64_t block_m = prefill_sm90_block_m(head_dim);
  const int64_t m_tiles = ((int64_t(p.max_qo_len) << p.gqa_pack) + block_m - 1) / block_m;
  const int64_t tiles = int64_t(p.batch_size) * (p.num_qo_heads >> p.gqa_pack) * m_tiles;
  PrefillSm90Schedule s;
  if (p.kv_splits > 1) {
    s.scheduler = SchedulerKind::kStaticPersistent;
    s.order = TileOrder::kQueryTilesInner;
  } else if (p.causal && (head_dim == 256 || !p.uniform_lengths || tiles < 2 * int64_t(num_sms))) {
    s.scheduler = SchedulerKind::kSingleTile;
    s.heavy_first = true;
    const int64_t kv_bytes = p.total_keys * p.num_kv_heads * head_dim * 2 /* K and V */ * 2 /* bytes */;
    const bool chunks_over_history = p.shortest_history >= p.max_qo_len && p.max_qo_len > 0;
    s.order = chunks_over_history && l2_cache_bytes > 0 && kv_bytes > l2_cache_bytes ? TileOrder::kQueryTilesInner
                                                                                      : TileOrder::kQueryTilesOuter;
  } else if (p.causal) {
    s.scheduler = SchedulerKind::kStaticPersistent;
    s.order = TileOrder::kMirroredPairs;
    s.run_length = 2;
  } else {
    s.scheduler = SchedulerKind::kStaticPersistent;
    s.order = TileOrder::kQueryTilesInner;
  }
  return s;
}
}  // namespace

int sm_count() { return current_device_attribute<cudaDevAttrMultiProcessorCount>(); }
int64_t l2_cache_bytes() { return current_device_attribute<cudaDevAttrL2CacheSize>(); }
int compute_capability() {
  return current_device_attribute<cudaDevAttrComputeCapabilityMajor>() * 10 +
         current_device_attribute<cudaDevAttrComputeCapabilityMinor>();
}

}  // namespace dispatch
}  // namespace tessera
