#include "plan/decode_plan.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <numeric>
#include <string>

#include "tessera/error.h"

namespace tessera::plan {
namespace {

[[noreturn]] void fail(const char* arg, const std::string& rule) {
  throw Error(std::string("tessera::DecodePlanner: argument '") + arg + "': " + rule);
}

// The one-CTA-per-SM plan may have a longest task up to 1/16 longer than ctas_per_sm x the default
// plan's and still be taken: it writes fewer partials and merges (b16 x 8K unsplit: +2%).
constexpr double kOneCtaPerSmMargin = 17.0 / 16.0;

}  // namespace

DecodePlanner::DecodePlanner(const PlanCapacity& capacity, const SplitPolicy& policy)
    : cap_(capacity), policy_(policy) {
  if (cap_.max_batch_size < 1) fail("max_batch_size", "must be >= 1");
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
  if (policy_.min_chunk_tokens < 1 || policy_.granularity < 1 || policy_.waves < 1) {
    fail("policy", "waves, min_chunk_tokens and granularity must be >= 1");
  }
  if (cap_.one_cta_per_sm_shape && cap_.ctas_per_sm < 2) {
    fail("one_cta_per_sm_shape", "needs a default shape of at least 2 CTAs per SM (ctas_per_sm " +
                                     std::to_string(cap_.ctas_per_sm) + ")");
  }
  group_ = cap_.num_qo_heads / cap_.num_kv_heads;
  const int32_t wave = cap_.num_sms * cap_.ctas_per_sm * policy_.waves;
  // Fitting one wave, a split list has at most `wave` items. Overfilled, chunks are at least the
  // average load per CTA slot (total / wave per head), so splitting adds at most wave / heads
  // chunks per head: at most batch x heads + wave items, and the split requests' chunks (each
  // longer than a chunk, so fewer than wave / heads of them per head) at most 2 x wave slots.
  const int64_t unsplit_items = int64_t(cap_.max_batch_size) * cap_.num_kv_heads;
  if (unsplit_items + 2 * int64_t(wave) > INT32_MAX) {
    fail("max_batch_size", "max_batch_size x num_kv_heads exceeds 2^31 - 1");
  }
  max_work_ = static_cast<int32_t>(unsplit_items + wave);
  max_slots_ = 2 * wave;
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
  layout_.merges = place(std::size_t(max_slots_) * sizeof(MergeRow));
  layout_.slot_rows = place(std::size_t(max_slots_ + 1) * sizeof(int64_t));
  layout_.merge_counters = place(std::size_t(max_slots_) * sizeof(int32_t));
  layout_.plan_bytes = at;
  layout_.partial_o = place(rows * std::size_t(cap_.head_dim) * sizeof(float));
  layout_.partial_lse = place(rows * sizeof(float));
  layout_.total = at;

  work_storage_.resize(max_work_);
  plan_.merges.reserve(max_slots_);
  plan_.requests.reserve(cap_.max_batch_size);
  plan_.slot_row_offset.reserve(max_slots_ + 1);
  keys_.reserve(cap_.max_batch_size);
  has_query_.reserve(cap_.max_batch_size);
  kv_len_.reserve(cap_.max_batch_size);
  first_key_.reserve(cap_.max_batch_size);
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

int64_t DecodePlanner::items_for_chunk(int64_t chunk) const {
  int64_t items = 0;
  for (size_t r = 0; r < kv_len_.size(); ++r) {
    if (!has_query_[r]) continue;
    const int64_t len = kv_len_[r];
    items += len <= chunk ? 1 : (len + chunk - 1) / chunk;
  }
  return items * cap_.num_kv_heads;
}

int64_t DecodePlanner::chunk_for_wave(int32_t wave, int64_t gran, int64_t longest) const {
  // The smallest multiple of the granularity, at least min_chunk_tokens, whose work list fits one
  // wave. items_for_chunk() never grows with the chunk, so binary search over granules. When even
  // the unsplit list overfills the wave, see below.
  const int64_t hi_granules = std::max<int64_t>(1, (longest + gran - 1) / gran);
  int64_t lo = std::min(hi_granules, (int64_t(policy_.min_chunk_tokens) + gran - 1) / gran);
  int64_t hi = hi_granules;
  if (items_for_chunk(hi * gran) <= wave) {
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (items_for_chunk(mid * gran) <= wave) hi = mid; else lo = mid + 1;
    }
  } else {
    // Overfilled: the CTAs take items as SMs free up, so the makespan is about the average load
    // per CTA slot plus the longest item. Requests longer than that average (a skewed batch's
    // few long ones) are split to it; everything else stays whole.
    int64_t total = 0;
    for (int64_t len : kv_len_) total += len;
    const int64_t average = (total * cap_.num_kv_heads + wave - 1) / wave;
    hi = std::min(hi_granules, std::max(lo, (average + gran - 1) / gran));
  }
  return hi * gran;
}

void DecodePlanner::pin_shape(CtaShape shape) {
  if (shape == CtaShape::kOneCtaPerSm && !cap_.one_cta_per_sm_shape) {
    fail("shape", "the capacity has no one-CTA-per-SM decode shape (one_cta_per_sm_shape)");
  }
  shape_pinned_ = true;
  pinned_shape_ = shape;
}

const Plan& DecodePlanner::plan(const format::BsrLayout& kv, const int32_t* qo_indptr,
                                void* image) {
  const int32_t batch = kv.num_rows;
  if (batch > cap_.max_batch_size) {
    fail("kv_indptr", "batch size " + std::to_string(batch) + " exceeds the planner's max_batch_size " +
                          std::to_string(cap_.max_batch_size));
  }
  if (qo_indptr == nullptr) fail("qo_indptr", "host copy is required");
  const std::string bad = format::check_bsr(kv, -1);
  if (!bad.empty()) fail("kv_indptr", bad);

  if (qo_indptr[0] != 0) fail("qo_indptr", "must start at 0, got " + std::to_string(qo_indptr[0]));
  kv_len_.clear();
  first_key_.clear();
  has_query_.clear();
  plan_.requests.clear();
  int64_t longest = 0;
  int64_t with_query = 0;
  for (int32_t r = 0; r < batch; ++r) {
    const int32_t qo_len = qo_indptr[r + 1] - qo_indptr[r];
    if (qo_len < 0 || qo_len > cap_.max_qo_len) {
      fail("qo_indptr", "request " + std::to_string(r) + " has " + std::to_string(qo_len) +
                            " query tokens; the planner allows 0.." + std::to_string(cap_.max_qo_len) +
                            " (and qo_indptr must be non-decreasing)");
    }
    const int64_t tokens = kv.row_tokens(r);
    if (tokens > format::kMaxRowTokens) {
      fail("kv_indptr", "request " + std::to_string(r) + " holds " + std::to_string(tokens) +
                            " tokens; at most 2^31 - 2^16 are supported");
    }
    // A request with no query this step reads nothing: cost 0, no work item. With a sliding
    // window its rows see keys from tokens - qo_len - window_left on (the first row's band; the
    // kernel masks per row inside it), so only those are planned and read.
    const int64_t first_key =
        cap_.window_left >= 0 ? std::max<int64_t>(0, tokens - qo_len - cap_.window_left) : 0;
    first_key_.push_back(static_cast<int32_t>(first_key));
    kv_len_.push_back(qo_len == 0 ? 0 : tokens - first_key);
    has_query_.push_back(qo_len > 0);
    with_query += qo_len > 0;
    plan_.requests.push_back({qo_indptr[r], qo_len, static_cast<int32_t>(tokens), kv.indptr[r]});
    longest = std::max(longest, kv_len_.back());
  }

  // The chunk length for the default shape's wave and, where the one-CTA-per-SM shape exists,
  // for its wave of num_sms CTAs. That shape is taken when its list fits its wave, its longest
  // task is at most ctas_per_sm x the default's (a CTA of it streams as fast as the default CTAs
  // an SM would otherwise hold; within kOneCtaPerSmMargin, since it saves chunks and merges) and
  // it splits nothing, or the capacity says it pays for split lists too. Measured on the H200
  // (notes/decode.md, v12): unsplit it gains 2-3% (b12-b16 x 8K: no partials, no merge); at hd128
  // a split list runs 0.5-2% slower in it (b1-b8), at hd256 2-13% faster (b4, b1 x 32K).
  const int32_t wave = cap_.num_sms * cap_.ctas_per_sm * policy_.waves;
  const int64_t gran = std::lcm<int64_t>(kv.block_size, policy_.granularity);
  int64_t chunk = chunk_for_wave(wave, gran, longest);
  plan_.shape = CtaShape::kDefault;
  plan_.wave_ctas = wave;
  const int32_t wide_wave = cap_.num_sms * policy_.waves;
  const bool may_fit = with_query * cap_.num_kv_heads <= wide_wave;  // unsplit items, at least
  if (cap_.one_cta_per_sm_shape && (shape_pinned_ ? pinned_shape_ == CtaShape::kOneCtaPerSm : may_fit)) {
    const int64_t wide_chunk = chunk_for_wave(wide_wave, gran, longest);
    const int64_t longest_task = std::min(chunk, longest);
    const int64_t wide_longest_task = std::min(wide_chunk, longest);
    const bool fits = items_for_chunk(wide_chunk) <= wide_wave;
    const bool pays = wide_chunk >= longest || cap_.one_cta_per_sm_for_splits;
    const bool balanced = double(wide_longest_task) <=
                          double(longest_task) * cap_.ctas_per_sm * kOneCtaPerSmMargin;
    if (shape_pinned_ || (fits && pays && balanced)) {
      chunk = wide_chunk;
      plan_.shape = CtaShape::kOneCtaPerSm;
      plan_.wave_ctas = wide_wave;
    }
  }
  const bool any_split = chunk < longest;

  // Longest first; ties by request id. One packed key per request keeps the sort to plain
  // integer compares (kv_len < 2^31 tokens).
  keys_.clear();
  for (int32_t r = 0; r < batch; ++r) {
    keys_.push_back((int64_t(INT32_MAX) - kv_len_[r]) << 32 | r);
  }
  if (!std::is_sorted(keys_.begin(), keys_.end())) std::sort(keys_.begin(), keys_.end());

  // Emit into the image or the reserved storage, without reallocation.
  WorkItem* const work = image != nullptr
                             ? reinterpret_cast<WorkItem*>(static_cast<unsigned char*>(image) + layout_.work)
                             : work_storage_.data();
  plan_.merges.clear();
  plan_.slot_row_offset.assign(1, 0);
  plan_.chunk_tokens = any_split ? static_cast<int32_t>(chunk) : 0;
  WorkItem* out = work;
  for (int64_t key : keys_) {
    const int32_t r = static_cast<int32_t>(key & 0xffffffff);
    if (!has_query_[r]) continue;
    const int32_t len = static_cast<int32_t>(kv_len_[r]);
    const int32_t first = first_key_[r];
    if (len <= chunk) {
      *out++ = WorkItem{r, first, first + len, -1, -1, 0, plan_.requests[r]};
      continue;
    }
    // Chunk c of KV head h parks in slot first_slot + h x chunks + c: each head's merge row holds
    // consecutive slots.
    const int64_t rows = int64_t(qo_indptr[r + 1] - qo_indptr[r]) * group_;
    const int32_t chunks = static_cast<int32_t>((len + chunk - 1) / chunk);
    const int32_t first_slot = plan_.num_slots();
    const int32_t first_merge = static_cast<int32_t>(plan_.merges.size());
    for (int32_t c = 0; c < chunks; ++c) {
      *out++ = WorkItem{r,
                        first + static_cast<int32_t>(c * chunk),
                        first + static_cast<int32_t>(std::min<int64_t>((c + 1) * chunk, len)),
                        first_slot + c,
                        first_merge,
                        chunks,
                        plan_.requests[r]};
    }
    for (int32_t h = 0; h < cap_.num_kv_heads; ++h) {
      plan_.merges.push_back({r, h, first_slot + h * chunks, chunks});
      for (int32_t c = 0; c < chunks; ++c) {
        plan_.slot_row_offset.push_back(plan_.slot_row_offset.back() + rows);
      }
    }
  }
  plan_.work.data_ = work;
  plan_.work.size_ = static_cast<std::size_t>(out - work);
  plan_.num_tasks = static_cast<int32_t>(plan_.work.size()) * cap_.num_kv_heads;
  if (image != nullptr) write_image(image);
  return plan_;
}

}  // namespace tessera::plan
