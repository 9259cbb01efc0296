#include "plan/decode_plan.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <functional>
#include <cstring>
#include <new>
#include <numeric>
#include <string>

#include "tessera/error.h"

// The estimate's placement lambda is called once per split request; GCC stopped inlining it when
// the heap's sift grew (+4% instructions), so it is forced.
#if defined(__GNUC__) || defined(__clang__)
#define TESSERA_PLAN_ALWAYS_INLINE __attribute__((always_inline))
#else
#define TESSERA_PLAN_ALWAYS_INLINE
#endif

namespace tessera::plan {
namespace {


// The one-CTA-per-SM plan may have a makespan up to 1/16 longer than the default plan's and still
// be taken: it writes fewer partials and merges (b16 x 8K unsplit: +2%).
constexpr double kOneCtaPerSmMargin = 17.0 / 16.0;

// Requests per step at most: the plan's host buffers and work list stay below a few hundred MB.
constexpr int32_t kMaxBatchSize = 1 << 20;

// How far apart two estimates must be for the one with more chunks to be taken: the model's
// makespans were within 2-5% of the measured ones (notes/decode_plan.md, "Cost model"); b9 x 8K
// in 7 chunks (2 rounds) was estimated 1% faster than in 3 (one round) and ran 4.5% slower.
constexpr double kModelTolerance = 1.02;

}  // namespace

void DecodePlanner::fail(const char* arg, const std::string& rule) const {
  throw Error("tessera::" + entry_point_ + ": argument '" + arg + "': " + rule);
}

void DecodePlanner::fail_plan(const char* arg, const std::string& rule) const {
  throw Error("tessera::" + entry_point_ + "::plan: argument '" + arg + "': " + rule);
}

DecodePlanner::DecodePlanner(const PlanCapacity& capacity, const SplitPolicy& policy, const char* entry_point)
    : cap_(capacity), policy_(policy), entry_point_(entry_point) {
  if (cap_.max_batch_size < 1 || cap_.max_batch_size > kMaxBatchSize) {
    fail("max_batch_size", "must be in 1.." + std::to_string(kMaxBatchSize) + ", got " +
                               std::to_string(cap_.max_batch_size));
  }
  if (cap_.max_qo_len < 1) fail("max_qo_len", "must be >= 1");
  if (cap_.num_kv_heads < 1 || cap_.num_qo_heads < 1 || cap_.num_qo_heads % cap_.num_kv_heads != 0) {
    fail("num_qo_heads", "must be a positive multiple of num_kv_heads (" +
                             std::to_string(cap_.num_qo_heads) + " / " +
                             std::to_string(cap_.num_kv_heads) + ")");
  }
  if (cap_.num_sms < 1 || cap_.ctas_per_sm < 1) fail("num_sms", "num_sms and ctas_per_sm must be >= 1");
  if (cap_.head_dim < 8 || cap_.head_dim % 8 != 0) {
    fail("head_dim", "must be a positive multiple of 8, got " + std::to_string(cap_.head_dim));
  }
  if (policy_.min_chunk_tokens < 1 || policy_.granularity < 1 || policy_.max_chunks_per_slot < 1) {
    fail("policy", "min_chunk_tokens, granularity and max_chunks_per_slot must be >= 1");
  }
  if (policy_.fixed_chunk_tokens < 0 || policy_.max_chunk_partials < 0 || policy_.max_chunk_partials > INT32_MAX / 2) {
    fail("policy", "fixed_chunk_tokens must be >= 0 and max_chunk_partials in 0..2^30");
  }
  const CostModel& c = policy_.cost;
  if (!(c.sm_read_bytes_per_us > 0) || !(c.cta_peak_bytes_per_us > 0) ||
      !(c.one_cta_per_sm_peak_bytes_per_us > 0) || !(c.merge_bytes_per_us > 0) || !(c.task_start_us >= 0) ||
      !(c.merge_start_us >= 0)) {
    fail("policy", "the cost model's rates must be > 0 and its start-up times >= 0");
  }
  if (cap_.one_cta_per_sm_shape && cap_.ctas_per_sm < 2) {
    fail("one_cta_per_sm_shape", "needs a default shape of at least 2 CTAs per SM (ctas_per_sm " +
                                     std::to_string(cap_.ctas_per_sm) + ")");
  }
  group_ = cap_.num_qo_heads / cap_.num_kv_heads;
  // Bounds. Split rows hold at most max_chunks_per_slot x wave chunk partials (the ladder skips
  // chunk targets that would exceed it), each split (request, KV head) at least 2 of them. A
  // two-level merge of n chunks has about sqrt(n) <= n / 2 groups (n >= 4), so the group
  // partials add at most half the chunk partials, and the merge rows (one per split pair and one
  // per group) are at most as many as the chunk partials. Splitting adds at most as many tasks as
  // there are chunk partials.
  const int64_t wave = int64_t(cap_.num_sms) * cap_.ctas_per_sm;
  const int64_t chunk_slots =
      policy_.max_chunk_partials > 0 ? policy_.max_chunk_partials : wave * policy_.max_chunks_per_slot;
  max_chunk_partials_ = chunk_slots;
  const int64_t unsplit_items = int64_t(cap_.max_batch_size) * cap_.num_kv_heads;
  if (unsplit_items + 2 * chunk_slots > INT32_MAX) {
    fail("max_batch_size", "max_batch_size x num_kv_heads exceeds 2^31 - 1");
  }
  max_work_ = static_cast<int32_t>(unsplit_items + chunk_slots);
  max_slots_ = static_cast<int32_t>(chunk_slots + chunk_slots / 2);
  max_merges_ = static_cast<int32_t>(chunk_slots);
  auto aligned = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };
  std::size_t at = 0;
  auto place = [&](std::size_t bytes) {
    const std::size_t offset = at;
    at += aligned(bytes);
    return offset;
  };
  const std::size_t rows = static_cast<std::size_t>(int64_t(max_slots_) * cap_.max_qo_len * group_);
  layout_.header = place(sizeof(PlanHeader));
  layout_.work = place(std::size_t(max_work_) * sizeof(WorkItem));
  layout_.merges = place(std::size_t(max_merges_) * sizeof(MergeRow));
  layout_.slot_rows = place(std::size_t(max_slots_ + 1) * sizeof(int64_t));
  layout_.merge_counters = place(std::size_t(max_merges_) * sizeof(int32_t));
  layout_.plan_bytes = at;
  layout_.partial_o = place(rows * std::size_t(cap_.head_dim) * sizeof(float));
  layout_.partial_lse = place(rows * sizeof(float));
  layout_.total = at;

  // Host buffers for the largest step: a capacity too large for the host is an argument error,
  // not std::bad_alloc.
  try {
    reserve_buffers();
  } catch (const std::bad_alloc&) {
    fail("max_batch_size", "a plan for " + std::to_string(cap_.max_batch_size) + " requests x " +
                               std::to_string(cap_.num_kv_heads) + " KV heads needs more host memory than can be allocated");
  }
}

void DecodePlanner::reserve_buffers() {
  const int64_t wave = int64_t(cap_.num_sms) * cap_.ctas_per_sm;
  work_storage_.resize(max_work_);
  plan_.merges.reserve(max_merges_);
  plan_.requests.reserve(cap_.max_batch_size);
  plan_.slot_row_offset.reserve(max_slots_ + 1);
  keys_.reserve(cap_.max_batch_size);
  emit_keys_.reserve(cap_.max_batch_size);
  split_keys_.resize(cap_.max_batch_size);
  has_query_.reserve(cap_.max_batch_size);
  kv_len_.reserve(cap_.max_batch_size);
  first_key_.reserve(cap_.max_batch_size);
  rows_.reserve(cap_.max_batch_size);
  sorted_len_.reserve(cap_.max_batch_size);
  sorted_rows_.reserve(cap_.max_batch_size);
  prefix_len_.reserve(cap_.max_batch_size + 1);
  loads_.reserve(wave);
  pending_merges_.reserve(wave);
}

int64_t DecodePlanner::max_partial_rows() const {
  return int64_t(max_slots_) * cap_.max_qo_len * group_;
}

void DecodePlanner::write_image(void* image) const {
  auto* base = static_cast<unsigned char*>(image);
  const PlanHeader header{plan_.num_tasks,
                          static_cast<int32_t>(plan_.merges.size()), plan_.num_slots(),
                          plan_.chunk_tokens};
  std::memcpy(base + layout_.header, &header, sizeof(header));
  if (plan_.work.data() != reinterpret_cast<const WorkItem*>(base + layout_.work)) {
    std::memcpy(base + layout_.work, plan_.work.data(), plan_.work.size() * sizeof(WorkItem));
  }
  std::memcpy(base + layout_.merges, plan_.merges.data(), plan_.merges.size() * sizeof(MergeRow));
  std::memcpy(base + layout_.slot_rows, plan_.slot_row_offset.data(),
              plan_.slot_row_offset.size() * sizeof(int64_t));
  std::memset(base + layout_.merge_counters, 0, plan_.merges.size() * sizeof(int32_t));
}

// chunk_length, split_count, token_us, merge_us and item_costs are inline (only this file calls
// them): built -fPIC (libtessera is shared), GCC kept them as interposable calls, ~5% of
// b64_one_long_h1's plan instructions.
inline int64_t DecodePlanner::chunk_length(int64_t len, int64_t chunk) const {
  if (len <= chunk) return len;
  const int64_t n = (len + chunk - 1) / chunk;
  return std::min(chunk, ((len + n - 1) / n + granule_ - 1) / granule_ * granule_);
}

inline DecodePlanner::SplitCount DecodePlanner::split_count(int64_t chunk, int64_t task_limit) const {
  // Only the requests longer than the chunk (a prefix of the longest-first order) are split, into
  // ceil(len / chunk) chunks, which bounds the balanced count (chunk_length() can make one fewer)
  // at one 32-bit division per request (lengths and chunks are below 2^31). The per-head sum only
  // grows, so it can stop once past task_limit / heads (the binary searches of choose_chunk mostly
  // probe chunks far too short to fit).
  SplitCount count{num_with_query_, 0};
  const int64_t limit = task_limit / cap_.num_kv_heads;
  const uint32_t c = static_cast<uint32_t>(chunk);
  for (size_t i = 0; i < sorted_len_.size() && sorted_len_[i] > chunk && count.items <= limit; ++i) {
    const int64_t n = (static_cast<uint32_t>(sorted_len_[i]) + c - 1) / c;
    count.items += n - 1;
    count.chunk_slots += n;
  }
  count.items *= cap_.num_kv_heads;
  count.chunk_slots *= cap_.num_kv_heads;
  return count;
}

inline double DecodePlanner::token_us(const Wave& wave, int64_t concurrent) const {
  // `concurrent` CTAs spread over the SMs (the hardware fills every SM before doubling up): the
  // SMs holding the most of them set the round's end. Their CTAs get the bandwidth the others
  // leave (at their peak), shared, and at most an SM's share each: b9 x 8K in 3 chunks, 216 CTAs
  // (84 SMs with two): 18.5 GB/s, measured 18.5; b1 x 32K in 21 chunks (168 CTAs, 36 SMs with
  // two): 23.5 GB/s, so 33 chunks (264 CTAs) end sooner, as measured.
  const double peak = wave.cta_peak_bytes_per_us;
  const double bandwidth = policy_.cost.sm_read_bytes_per_us * cap_.num_sms;
  const int64_t n = std::max<int64_t>(1, concurrent), sms = cap_.num_sms;
  double rate = std::min(peak, bandwidth / double(n));
  if (n > sms) {
    const int64_t most = (n + sms - 1) / sms;          // CTAs on the busiest SMs
    const int64_t busiest = (n - (most - 1) * sms) * most;  // CTAs on them
    const double others = double(n - busiest) * peak;
    const double full_share = bandwidth / double(std::max<int64_t>(n, wave.ctas));  // never less
    rate = std::min({peak, policy_.cost.shared_sm_peak_bytes_per_us / double(most),
                     std::max(full_share, (bandwidth - others) / double(busiest))});
  }
  return 4.0 * cap_.head_dim / rate;  // K and V rows of one KV head, 2-byte elements
}

double DecodePlanner::task_us(int64_t tokens, const Wave& wave) const {
  return policy_.cost.task_start_us + double(tokens) * token_us(wave, wave.ctas);
}

inline double DecodePlanner::merge_us(int64_t slots, int64_t rows, int32_t* groups) const {
  const CostModel& c = policy_.cost;
  const double row_us = (4.0 * cap_.head_dim + 4.0) / c.merge_bytes_per_us;  // fp32 O row + LSE
  const double fold = double(slots * rows) * row_us;
  const double flat = c.merge_start_us + fold;
  *groups = 1;
  // A tree pays a second start-up: it can only win where the fold costs more than that.
  if (!policy_.merge_tree || slots < 4 || fold <= c.merge_start_us) return flat;
  // Groups of about sqrt(slots) chunks merge in parallel, then one CTA merges the groups.
  const int32_t g = std::max(2, static_cast<int32_t>(std::sqrt(double(slots)) + 0.5));
  const int64_t largest_group = (slots + g - 1) / g;
  const double tree = 2 * c.merge_start_us + double((largest_group + g) * rows) * row_us;
  if (tree >= flat) return flat;
  *groups = g;
  return tree;
}

inline DecodePlanner::ItemCosts DecodePlanner::item_costs(int64_t tasks, const Wave& wave) const {
  const int32_t heads = cap_.num_kv_heads;
  const double rounds = heads > wave.ctas ? double(heads) / wave.ctas : 1.0;  // more heads than slots
  // Tasks of full rounds stream at the full wave's share of the bandwidth, those of the last
  // (partial) round at a larger share; items placed from item `last_round` on are in it.
  const int64_t full_rounds = (tasks - 1) / wave.ctas;
  ItemCosts costs;
  costs.last_round = full_rounds * wave.ctas / heads;
  costs.full_token = token_us(wave, wave.ctas) * rounds;
  costs.last_token = token_us(wave, tasks - full_rounds * wave.ctas) * rounds;
  costs.start = policy_.cost.task_start_us * rounds;
  return costs;
}

double DecodePlanner::makespan_us(int64_t chunk, const Wave& wave, int64_t tasks) const {
  // Items (a request's chunk for every KV head) on `machines` groups of num_kv_heads slots: the
  // heads of one item start together, so with slots a multiple of the heads, list scheduling of
  // tasks is list scheduling of items on slots / heads machines.
  const int32_t heads = cap_.num_kv_heads;
  const int32_t machines = std::max(1, wave.ctas / heads);
  if (tasks < 0) tasks = split_count(chunk).items;
  const ItemCosts costs = item_costs(tasks, wave);
  const int64_t last_round = costs.last_round;
  const double full_token = costs.full_token, last_token = costs.last_token, start = costs.start;
  const double small = (start + double(chunk) * last_token) / 4;  // cheaper items fill in as a fluid
  int64_t placed = 0;  // items so far
  // Wide waves (few KV heads: up to 264 machines on an H200) are estimated with machines in
  // lockstep groups of `lockstep`, each group taking `lockstep` consecutive items at once at the
  // cost of the longest: exact for runs of equal chunks, and it keeps the estimate to at most
  // ~64 machines and a fraction of the items.
  const int32_t lockstep = std::max(1, machines / 64);
  const int32_t groups = machines / lockstep;
  // List scheduling onto the least loaded group. The first `groups` batches go to empty groups,
  // filled from the back of the array: batches arriving longest first leave it sorted ascending,
  // which is a valid min-heap, so only later ones pay a sift (of a 4-ary heap); a batch longer
  // than the one before it breaks the order, and the heap is then built once.
  loads_.assign(groups, 0.0);
  double* const h = loads_.data();
  int32_t empty = groups;  // groups [0, empty) are still empty
  bool sorted = true;
  auto sift_down = [&](int32_t i, double v) {  // puts v at i or below, restoring the heap order
    for (;;) {
      const int32_t first = 4 * i + 1;
      if (first >= groups) break;
      int32_t c = first;
      double least = h[first];  // the smallest child (the first of equal ones)
      if (first + 4 <= groups) {
        // Four children (all but the last parent): a tournament of two pairs, each keeping its
        // first of equal ones, then the first pair's on a tie: the same child as the scan below,
        // without its loop (a third of the estimate's heap instructions).
        const int32_t a = h[first + 1] < h[first] ? first + 1 : first;
        const int32_t b = h[first + 3] < h[first + 2] ? first + 3 : first + 2;
        c = h[b] < h[a] ? b : a;
        least = h[c];
      } else {
        for (int32_t k = first + 1; k < groups; ++k) {
          const bool less = h[k] < least;
          least = less ? h[k] : least;
          c = less ? k : c;
        }
      }
      if (!(least < v)) break;
      h[i] = least;
      i = c;
    }
    h[i] = v;
  };
  auto place = [&](double cost) {
    if (empty > 0) {
      --empty;
      if (empty + 1 < groups && cost > h[empty + 1]) sorted = false;
      h[empty] = cost;
      if (empty == 0 && !sorted) {
        for (int32_t i = (groups - 2) / 4; i >= 0; --i) sift_down(i, h[i]);
      }
      return cost;
    }
    const double v = h[0] + cost;
    sift_down(0, v);
    return v;
  };
  // The batch being gathered for one group, and the merges of split requests whose last chunk is
  // in it (they start when it ends).
  int32_t batch_items = 0;
  double batch_cost = 0, last_end = 0, merges_end = 0, run_end = 0;
  pending_merges_.clear();
  auto flush = [&] {
    if (batch_items == 0) return;
    last_end = place(batch_cost);
    run_end = std::max(run_end, last_end);
    for (double m : pending_merges_) merges_end = std::max(merges_end, last_end + m);
    pending_merges_.clear();
    batch_items = 0;
    batch_cost = 0;
  };
  auto add = [&](int64_t count, int64_t tokens) TESSERA_PLAN_ALWAYS_INLINE {  // `count` items of `tokens` each
    while (count > 0) {
      // The items at one cost: up to the last round's start, or all of them.
      const bool last = placed >= last_round;
      const double cost = start + double(tokens) * (last ? last_token : full_token);
      int64_t take = last ? count : std::min(count, last_round - placed);
      placed += take;
      count -= take;
      if (batch_items > 0) {  // complete the batch being gathered
        const int64_t fill = std::min<int64_t>(take, lockstep - batch_items);
        batch_items += static_cast<int32_t>(fill);
        batch_cost = std::max(batch_cost, cost);
        take -= fill;
        if (batch_items == lockstep) flush();
      }
      for (; take >= lockstep; take -= lockstep) {  // whole batches (no merge waits on them yet)
        last_end = place(cost);
        run_end = std::max(run_end, last_end);
      }
      if (take > 0) {
        batch_items = static_cast<int32_t>(take);
        batch_cost = cost;
      }
    }
  };
  const size_t n_requests = sorted_len_.size();
  size_t i = 0;
  // Requests of equal length and rows (adjacent in this order) are one run: their chunks are
  // equal, and the latest of them ends the run's merges.
  auto run_of = [&](size_t first) {
    size_t last = first + 1;
    while (last < n_requests && sorted_len_[last] == sorted_len_[first] && sorted_rows_[last] == sorted_rows_[first]) {
      ++last;
    }
    return last;
  };
  int64_t merge_n = -1, merge_rows = -1;
  double merge = 0;
  while (i < n_requests && sorted_len_[i] > chunk) {  // the split requests, longest first
    const size_t next = run_of(i);
    const int64_t len = sorted_len_[i];
    const int64_t piece = chunk_length(len, chunk);
    const int64_t n = (len + piece - 1) / piece;
    run_end = 0;
    add(n * int64_t(next - i), piece);
    // Consecutive split requests mostly share their chunk count and rows: one merge estimate each.
    if (n != merge_n || sorted_rows_[i] != merge_rows) {
      int32_t merge_groups;
      merge_n = n;
      merge_rows = sorted_rows_[i];
      merge = merge_us(n, merge_rows, &merge_groups);
    }
    if (run_end > 0) merges_end = std::max(merges_end, run_end + merge);  // batches that ended
    if (batch_items > 0) pending_merges_.push_back(merge);               // and the one gathering
    i = next;
  }
  while (i < n_requests && start + double(sorted_len_[i]) * last_token >= small) {
    const size_t next = run_of(i);
    add(int64_t(next - i), sorted_len_[i]);
    i = next;
  }
  flush();
  // The rest, from the prefix sums: they fill the least loaded machines up to a common level,
  // which only matters where it rises above the most loaded group.
  const double fluid_token = placed < last_round ? full_token : last_token;
  const double fluid = (double(n_requests - i) * start + double(len_total_ - prefix_len_[i]) * fluid_token) / lockstep;
  double most = 0, sum = 0;
  for (int32_t k = 0; k < groups; ++k) {
    most = std::max(most, h[k]);
    sum += h[k];
  }
  const double room = most * groups - sum;
  const double level = fluid <= room ? most : most + (fluid - room) / groups;
  return std::max(level, merges_end);
}

DecodePlanner::Choice DecodePlanner::choose_chunk(const Wave& wave, int64_t longest) const {
  const int64_t lo = std::min(longest, (int64_t(policy_.min_chunk_tokens) + granule_ - 1) / granule_ * granule_);
  const int32_t heads = cap_.num_kv_heads;
  const int32_t machines = std::max(1, wave.ctas / heads);
  const double rounds = heads > wave.ctas ? double(heads) / wave.ctas : 1.0;
  const double per_token_us = token_us(wave, wave.ctas);  // all slots streaming: the bandwidth's share
  const double total = (double(num_with_query_) * policy_.cost.task_start_us + double(len_total_) * per_token_us) * rounds;
  const double average = total / machines;
  // Nothing to gain: the longest request is within the minimum chunk or the average load.
  if (longest <= lo || task_us(longest, wave) * rounds <= average) return {longest, 0.0};

  auto round_up = [&](double tokens) {
    const int64_t t = static_cast<int64_t>(std::ceil(std::max(1.0, tokens)));
    return std::min(longest, std::max(lo, (t + granule_ - 1) / granule_ * granule_));
  };
  const int64_t max_chunk_slots = int64_t(wave.ctas) * policy_.max_chunks_per_slot;
  const double fastest_token = token_us(wave, 1);
  Choice best{longest, INFINITY};
  // Estimates made so far: the ladder's rungs, its quarter steps and the wave-filling chunks often
  // round to the same chunk (b64 with one long request at 1 KV head estimated 208 twice), and an
  // estimate is most of the plan's cost.
  constexpr int kMemo = 16;
  int64_t memo_chunk[kMemo];
  double memo_us[kMemo];
  int memo_size = 0;
  auto estimate = [&](int64_t chunk, int64_t tasks) {
    for (int i = 0; i < memo_size; ++i)
      if (memo_chunk[i] == chunk) return memo_us[i];
    const double m = makespan_us(chunk, wave, tasks);
    if (memo_size < kMemo) {
      memo_chunk[memo_size] = chunk;
      memo_us[memo_size++] = m;
    }
    return m;
  };
  // Estimates a chunk target unless a lower bound of its makespan (its longest task, or the
  // average load with the start-ups its extra tasks add) already reaches the best one's.
  auto consider = [&](int64_t chunk) {
    if (chunk == best.chunk && best.makespan_us < INFINITY) return;  // already estimated
    const SplitCount count = split_count(chunk);
    if (count.chunk_slots > max_chunk_slots) return;
    // (Each at its fastest: a task at its CTA's peak, all of them at the whole bandwidth.)
    const int64_t extra = count.items / heads - num_with_query_;
    const double bound =
        std::max(policy_.cost.task_start_us + double(chunk_length(longest, chunk)) * fastest_token,
                 (double(num_with_query_ + extra) * heads * policy_.cost.task_start_us / wave.ctas +
                  double(len_total_) * heads * per_token_us / wave.ctas));
    if (bound >= best.makespan_us) return;
    // A second bound, on what the estimate itself computes: the longest request (the first in
    // its launch order) is split, its first item costs `first` (it goes to an empty machine
    // group, or to a batch that costs at least as much and ends no sooner), and its merge starts
    // no sooner than that item ends, so the makespan is at least first + its merge (the same
    // operations as in makespan_us on the same values, each monotone). A candidate whose bound
    // fails the test below that its estimate would have to pass cannot become the best one, so
    // skipping it decides the same (`first` is add()'s item cost expression, kept alike). At 1
    // KV head the long request's merge is most of the makespan: b64_one_long_h1 makes 5
    // estimates instead of 7, -12% of its plan's instructions (notes/decode_plan.md, 2026-12-06).
    if (best.makespan_us < INFINITY && chunk < sorted_len_[0]) {
      const ItemCosts costs = item_costs(count.items, wave);
      const int64_t len = sorted_len_[0];
      const int64_t piece = chunk_length(len, chunk);
      int32_t merge_groups;
      const double merge = merge_us((len + piece - 1) / piece, sorted_rows_[0], &merge_groups);
      const double first =
          costs.start + double(piece) * (costs.last_round > 0 ? costs.full_token : costs.last_token);
      const double at_least = first + merge;
      if (chunk > best.chunk ? at_least > best.makespan_us * kModelTolerance
                             : at_least * kModelTolerance >= best.makespan_us) {
        return;
      }
    }
    const double m = estimate(chunk, count.items);
    // Within the model's error (kModelTolerance) the longer chunk wins: fewer tasks, partials
    // and merges.
    const bool better = chunk > best.chunk ? m <= best.makespan_us * kModelTolerance
                                           : m * kModelTolerance < best.makespan_us;
    if (better || best.makespan_us == INFINITY) best = {chunk, m};
  };
  // The ladder: chunks around the one whose task costs the average load, ratio 2^(1/2), nearest
  // rungs first (the bound then skips most of the others), and the quarter-steps on either side
  // of the best rung.
  {
    const double at_average = (average / rounds - policy_.cost.task_start_us) / per_token_us;
    double best_rung = 0;
    auto try_rung = [&](int k) {  // whether rung k became the best
      const double rung = at_average * std::exp2(k / 2.0);
      const int64_t before = best.chunk;
      const double before_us = best.makespan_us;
      consider(round_up(rung));
      const bool took = best.chunk != before || best.makespan_us != before_us;
      if (took) best_rung = rung;
      return took;
    };
    try_rung(0);
    // Outwards only while a rung improves on the ones before it.
    if (try_rung(1)) try_rung(2);
    if (try_rung(-1)) try_rung(-2);
    if (best_rung > 0) {
      consider(round_up(best_rung * std::exp2(0.25)));
      consider(round_up(best_rung * std::exp2(-0.25)));
    }
  }
  // The smallest chunks whose lists fit one, two and three waves (a batch that under-fills the
  // GPU, or whose few requests split into whole rounds); the task count never grows with the
  // chunk, so binary search over granules.
  int64_t hi = (longest + granule_ - 1) / granule_;
  const int64_t unsplit_tasks = split_count(longest).items;
  for (int32_t waves = 1; waves <= 3; ++waves) {
    const int64_t fit = int64_t(wave.ctas) * waves;
    if (unsplit_tasks > fit) break;
    int64_t a = lo / granule_, b = hi;
    // Narrowed first, to the same answer: a list of chunk c has between len_total / c and
    // with_query + len_total / c items a head (each request max(1, ceil(len / c)) of them), so
    // every chunk below len_total / per_head fails and every one from len_total / (per_head -
    // with_query) on fits; the count is monotone, so the search over what is left ends at the same
    // b. b64_one_long_h1: ~31 split_count probes a plan -> ~9 (each a pass over the split
    // requests), -3.7% of its instructions (notes/decode_plan.md, 2026-12-06).
    const int64_t per_head = fit / heads;  // items * heads <= fit
    const int64_t span = granule_ * per_head;
    a = std::max(a, std::min(b, (len_total_ + span - 1) / span));
    if (per_head > num_with_query_) {
      const int64_t sure = granule_ * (per_head - num_with_query_);
      b = std::max(a, std::min(b, (len_total_ + sure - 1) / sure));
    }
    while (a < b) {
      const int64_t mid = a + (b - a) / 2;
      if (split_count(mid * granule_, fit).items <= fit) b = mid; else a = mid + 1;
    }
    consider(std::min(longest, b * granule_));
    hi = b;  // more waves fit shorter chunks
  }
  consider(longest);  // no split
  return best;
}

void DecodePlanner::pin_shape(CtaShape shape) {
  if (shape == CtaShape::kOneCtaPerSm && !cap_.one_cta_per_sm_shape) {
    fail("shape", "the capacity has no one-CTA-per-SM decode shape (one_cta_per_sm_shape)");
  }
  shape_pinned_ = true;
  pinned_shape_ = shape;
}

// keys_ (filled in request order) sorted ascending, i.e. longest first with ties in request
// order: a stable LSD radix sort, 8 bits a pass, over the only part that differs between keys,
// longest - kv_len (the high half minus its smallest value); the request ids in the low half are
// already in order, which a stable sort keeps. Same result as std::sort of the whole keys; at 1024
// requests it took a fifth of the plan's instructions as an introsort (comparisons of 64-bit keys
// with unpredictable branches). Small batches keep std::sort.
void DecodePlanner::sort_by_length(int64_t longest) {
  const size_t n = keys_.size();
  if (n < 128) {
    std::sort(keys_.begin(), keys_.end());
    return;
  }
  const int64_t base = int64_t(INT32_MAX) - longest;  // the smallest high half
  int passes = 0;
  for (uint64_t span = static_cast<uint64_t>(longest); span > 0; span >>= 8) ++passes;
  int64_t* from = keys_.data();
  int64_t* to = split_keys_.data();  // reserved for max_batch_size keys; unused until emission
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 8 * pass;
    uint32_t count[257] = {};
    for (size_t i = 0; i < n; ++i) ++count[(((from[i] >> 32) - base) >> shift & 0xff) + 1];
    for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
    for (size_t i = 0; i < n; ++i) to[count[((from[i] >> 32) - base) >> shift & 0xff]++] = from[i];
    std::swap(from, to);
  }
  if (from != keys_.data()) std::copy(from, from + n, keys_.data());
}

const Plan& DecodePlanner::plan(const format::BsrLayout& kv, const int32_t* qo_indptr,
                                void* image) {
  const int32_t batch = kv.num_rows;
  if (batch > cap_.max_batch_size) {
    fail_plan("kv_indptr", "batch size " + std::to_string(batch) + " exceeds the planner's max_batch_size " +
                          std::to_string(cap_.max_batch_size));
  }
  if (qo_indptr == nullptr) fail_plan("qo_indptr", "host copy is required");
  const std::string bad = format::check_bsr(kv, -1);
  if (!bad.empty()) fail_plan("kv_indptr", bad);

  if (qo_indptr[0] != 0) fail_plan("qo_indptr", "must start at 0, got " + std::to_string(qo_indptr[0]));
  // Per-request arrays written in place (within the reserved capacity): push_back per request
  // was a fifth of the planner's instructions at 1024 requests.
  kv_len_.resize(batch);
  first_key_.resize(batch);
  has_query_.resize(batch);
  rows_.resize(batch);
  plan_.requests.resize(batch);
  keys_.resize(batch);
  int64_t longest = 0;
  int64_t with_query = 0;
  for (int32_t r = 0; r < batch; ++r) {
    const int32_t qo_len = qo_indptr[r + 1] - qo_indptr[r];
    if (qo_len < 0 || qo_len > cap_.max_qo_len) {
      fail_plan("qo_indptr", "request " + std::to_string(r) + " has " + std::to_string(qo_len) +
                            " query tokens; the planner allows 0.." + std::to_string(cap_.max_qo_len) +
                            " (and qo_indptr must be non-decreasing)");
    }
    const int64_t tokens = kv.row_tokens(r);
    if (tokens > format::kMaxRowTokens) {
      fail_plan("kv_indptr", "request " + std::to_string(r) + " holds " + std::to_string(tokens) +
                            " tokens; at most 2^31 - 2^16 are supported");
    }
    // A request with no query this step reads nothing: cost 0, no work item. With a sliding
    // window its rows see keys from tokens - qo_len - window_left on (the first row's band; the
    // kernel masks per row inside it), so only those are planned and read.
    const int64_t first_key =
        cap_.window_left >= 0 ? std::max<int64_t>(0, tokens - qo_len - cap_.window_left) : 0;
    const int64_t len = qo_len == 0 ? 0 : tokens - first_key;
    first_key_[r] = static_cast<int32_t>(first_key);
    kv_len_[r] = len;
    has_query_[r] = qo_len > 0;
    rows_[r] = qo_len * group_;
    with_query += qo_len > 0;
    plan_.requests[r] = {qo_indptr[r], qo_len, static_cast<int32_t>(tokens), kv.indptr[r]};
    // Longest first; ties by request id. One packed key per request keeps the sort to plain
    // integer compares (kv_len < 2^31 tokens).
    keys_[r] = (int64_t(INT32_MAX) - len) << 32 | r;
    longest = std::max(longest, len);
  }
  if (!std::is_sorted(keys_.begin(), keys_.end())) sort_by_length(longest);
  // The requests with a query in that order, their lengths, rows and length prefix sums: what
  // the cost model reads (the short tail as a sum).
  sorted_len_.resize(with_query);
  sorted_rows_.resize(with_query);
  prefix_len_.resize(with_query + 1);
  prefix_len_[0] = 0;
  int64_t at = 0;
  for (int64_t key : keys_) {
    const int32_t r = static_cast<int32_t>(key & 0xffffffff);
    if (!has_query_[r]) continue;
    sorted_len_[at] = kv_len_[r];
    sorted_rows_[at] = rows_[r];
    prefix_len_[at + 1] = prefix_len_[at] + kv_len_[r];
    ++at;
  }
  num_with_query_ = static_cast<int64_t>(sorted_len_.size());
  len_total_ = prefix_len_.back();

  // The chunk target for the default shape's slots and, where the one-CTA-per-SM shape exists
  // and the batch's unsplit items fit its num_sms CTAs, for that shape, whose CTA streams at the
  // SM's whole rate. It is taken when its makespan is within kOneCtaPerSmMargin of the default's
  // (it saves chunks and merges) and it splits nothing, or the capacity says it pays for split
  // lists too. Measured on the H200 (notes/decode.md, v12): unsplit it gains 2-3% (b12-b16 x 8K:
  // no partials, no merge); at hd128 a split list runs 0.5-2% slower in it (b1-b8), at hd256
  // 2-13% faster (b4, b1 x 32K). Where the capacity says it always pays (kWheneverItFits), the
  // default shape's search is skipped: its chunk search was half of such a plan's time.
  granule_ = std::lcm<int64_t>(kv.block_size, policy_.granularity);
  const Wave base{cap_.num_sms * cap_.ctas_per_sm, policy_.cost.cta_peak_bytes_per_us};
  const Wave wide{cap_.num_sms, policy_.cost.one_cta_per_sm_peak_bytes_per_us};
  const bool pinned_wide = shape_pinned_ && pinned_shape_ == CtaShape::kOneCtaPerSm;
  const bool may_fit = with_query * cap_.num_kv_heads <= cap_.num_sms;  // unsplit items, at least
  // A fixed chunk (batch invariance) is the step's chunk whatever the batch; it must fit the
  // workspace's chunk partials (split_count's bound: ceil(len / chunk) chunks a split request).
  const bool fixed = policy_.split && policy_.fixed_chunk_tokens > 0;
  const int64_t fixed_chunk = std::min<int64_t>(longest, policy_.fixed_chunk_tokens);
  if (fixed && fixed_chunk < longest) {
    const int64_t partials = split_count(fixed_chunk).chunk_slots;
    if (partials > max_chunk_partials_) {
      fail_plan("kv_indptr", "the step's requests split into " + std::to_string(partials) +
                                 " chunk partials (chunks of " + std::to_string(fixed_chunk) +
                                 " tokens x KV heads), more than the " + std::to_string(max_chunk_partials_) +
                                 " the workspace holds (DecodeConfig::batch_invariant_max_chunks)");
    }
  }
  auto pick = [&](const Wave& wave) {
    return fixed ? Choice{fixed_chunk, makespan_us(fixed_chunk, wave)} : choose_chunk(wave, longest);
  };
  Choice chosen{longest, 0.0};
  plan_.shape = CtaShape::kDefault;
  plan_.wave_ctas = base.ctas;
  const bool wide_fits = cap_.one_cta_per_sm_shape && !shape_pinned_ && may_fit;
  const bool wide_always = wide_fits && cap_.one_cta_per_sm_use == OneCtaPerSmUse::kWheneverItFits;
  const bool wide_splits = cap_.one_cta_per_sm_use != OneCtaPerSmUse::kUnsplitLists;
  if (!pinned_wide && !wide_always && policy_.split) chosen = pick(base);
  if (pinned_wide || wide_fits) {
    // Unless it pays for split lists, only its unsplit list can be taken: estimate that alone.
    Choice one = policy_.split && (wide_splits || pinned_wide) ? pick(wide) : Choice{longest, 0.0};
    if (one.makespan_us == 0) one.makespan_us = makespan_us(one.chunk, wide);
    const bool compare = !pinned_wide && !wide_always;
    if (compare && chosen.makespan_us == 0) chosen.makespan_us = makespan_us(chosen.chunk, base);
    const bool pays = one.chunk >= longest || wide_splits;
    if (!compare || (pays && one.makespan_us <= chosen.makespan_us * kOneCtaPerSmMargin)) {
      chosen = one;
      plan_.shape = CtaShape::kOneCtaPerSm;
      plan_.wave_ctas = wide.ctas;
    }
  }
  const int64_t chunk = chosen.chunk;
  const bool any_split = chunk < longest;
  plan_.estimated_us = chosen.makespan_us;

  // Launch order: longest task first (a split request by its chunk length), ties by request.
  // The split requests are a prefix of the longest-first order: only they are re-sorted, then
  // merged with the unsplit rest, which is in order already.
  const std::vector<int64_t>* order = &keys_;
  int64_t split_chunks = 0;  // chunks of the split requests (a bound on their slots below)
  if (any_split) {
    size_t split = 0;
    while (split < keys_.size() && kv_len_[keys_[split] & 0xffffffff] > chunk) ++split;
    emit_keys_.resize(keys_.size());
    for (size_t i = 0; i < split; ++i) {
      const int32_t r = static_cast<int32_t>(keys_[i] & 0xffffffff);
      const int64_t piece = chunk_length(kv_len_[r], chunk);
      emit_keys_[i] = (int64_t(INT32_MAX) - piece) << 32 | r;
      split_chunks += (kv_len_[r] + piece - 1) / piece;
    }
    std::sort(emit_keys_.begin(), emit_keys_.begin() + split);
    std::merge(emit_keys_.begin(), emit_keys_.begin() + split, keys_.begin() + split, keys_.end(),
               split_keys_.begin());
    order = &split_keys_;
  }

  // Emit into the image or the reserved storage, without reallocation.
  WorkItem* const work = image != nullptr
                             ? reinterpret_cast<WorkItem*>(static_cast<unsigned char*>(image) + layout_.work)
                             : work_storage_.data();
  plan_.merges.clear();
  // Slot row offsets sized once for the split requests (n chunks take at most 2n slots a head: a
  // two-level merge adds about sqrt(n) <= n / 2 group slots), cut to the slots used at the end:
  // a resize per split request was ~3% of b64_one_long_h1's plan. Within the reserved capacity
  // (the slots never exceed max_slots_); the loop still grows it should a request not fit.
  int32_t num_slots = 0;
  plan_.slot_row_offset.resize(1 + std::min<int64_t>(cap_.num_kv_heads * (split_chunks + split_chunks / 2), max_slots_));
  plan_.slot_row_offset[0] = 0;
  plan_.chunk_tokens = 0;
  plan_.split_rows = 0;
  const int32_t heads = cap_.num_kv_heads;
  WorkItem* out = work;
  int64_t merge_chunks = -1, merge_rows = -1;
  int32_t groups = 1;  // of the last merge_us
  for (int32_t k = 0; k < batch; ++k) {
    const int32_t r = static_cast<int32_t>((*order)[k] & 0xffffffff);
    if (!has_query_[r]) continue;
    const int32_t len = static_cast<int32_t>(kv_len_[r]);
    const int32_t first = first_key_[r];
    if (len <= chunk) {
      *out++ = WorkItem{r, first, first + len, -1, -1, 0, plan_.requests[r]};
      continue;
    }
    // Chunk c of KV head h parks in slot first_slot + h x chunks + c, so each head's chunks (and
    // each of their groups) hold consecutive slots. One level: head h merges through row
    // first_merge + h. Two levels: group j of head h is row first_merge + j x heads + h, which
    // merges its chunks into group slot group_slot + h x groups + j and counts at the head's top
    // row first_merge + groups x heads + h.
    const int64_t rows = rows_[r];
    const int32_t piece = static_cast<int32_t>(chunk_length(len, chunk));
    const int32_t chunks = (len + piece - 1) / piece;
    plan_.chunk_tokens = std::max(plan_.chunk_tokens, piece);
    // Consecutive split requests mostly share their chunk count and rows: one merge_us each.
    if (chunks != merge_chunks || rows != merge_rows) {
      merge_chunks = chunks;
      merge_rows = rows;
      (void)merge_us(chunks, rows, &groups);
    }
    const int32_t first_slot = num_slots;
    const int32_t first_merge = static_cast<int32_t>(plan_.merges.size());
    auto group_begin = [&](int32_t j) { return static_cast<int32_t>(int64_t(j) * chunks / groups); };
    // Locals, read once: the stores through `out` (WorkItem holds a RequestInfo) may alias them.
    const RequestInfo info = plan_.requests[r];
    for (int32_t j = 0; j < groups; ++j) {
      const int32_t group_end = group_begin(j + 1);
      const int32_t merge_row = first_merge + (groups > 1 ? j * heads : 0);
      for (int32_t c = group_begin(j); c < group_end; ++c) {
        *out++ = WorkItem{r, first + c * piece, first + std::min(len, (c + 1) * piece), first_slot + c, merge_row,
                          chunks, info};
      }
    }
    const int32_t group_slot = first_slot + heads * chunks;
    if (groups == 1) {
      for (int32_t h = 0; h < heads; ++h) plan_.merges.push_back({r, h, first_slot + h * chunks, chunks, -1, -1});
    } else {
      const int32_t top = first_merge + groups * heads;
      for (int32_t j = 0; j < groups; ++j) {
        for (int32_t h = 0; h < heads; ++h) {
          plan_.merges.push_back({r, h, first_slot + h * chunks + group_begin(j), group_begin(j + 1) - group_begin(j),
                                  group_slot + h * groups + j, top + h});
        }
      }
      for (int32_t h = 0; h < heads; ++h) plan_.merges.push_back({r, h, group_slot + h * groups, groups, -1, -1});
    }
    const int32_t slots = heads * (chunks + (groups > 1 ? groups : 0));
    const size_t at = size_t(num_slots) + 1;
    num_slots += slots;
    if (plan_.slot_row_offset.size() < size_t(num_slots) + 1) plan_.slot_row_offset.resize(size_t(num_slots) + 1);
    int64_t* offsets = plan_.slot_row_offset.data() + at;
    for (int32_t s = 0; s < slots; ++s) offsets[s] = offsets[s - 1] + rows;
    plan_.split_rows += heads;
  }
  plan_.slot_row_offset.resize(size_t(num_slots) + 1);  // the slots used (shrinking writes nothing)
  plan_.work.data_ = work;
  plan_.work.size_ = static_cast<std::size_t>(out - work);
  plan_.num_tasks = static_cast<int32_t>(plan_.work.size()) * cap_.num_kv_heads;
  if (image != nullptr) write_image(image);
  return plan_;
}

}  // namespace tessera::plan
