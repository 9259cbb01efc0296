// CPU reference attention (fp64) and its naive low-precision twin. Conventions: attention_ref.h.
#include "reference/attention_ref.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

namespace tessera::ref {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("tessera::ref: " + what);
}

void check_params(const AttentionParams& p) {
  require(p.num_qo_heads > 0 && p.num_kv_heads > 0 && p.head_dim > 0,
          "num_qo_heads, num_kv_heads and head_dim must be positive");
  require(p.num_qo_heads % p.num_kv_heads == 0, "num_qo_heads must be a multiple of num_kv_heads");
  require(p.window_left >= -1, "window_left must be -1 or >= 0");
}

void check_indptr(const std::vector<int32_t>& indptr, const char* name) {
  require(!indptr.empty() && indptr[0] == 0, std::string(name) + " must start with 0");
  for (size_t i = 1; i < indptr.size(); ++i) {
    require(indptr[i] >= indptr[i - 1], std::string(name) + " must be non-decreasing");
  }
}

// Sizes out (zeros) and lse (-inf), then calls body(scratch, request, row i within the request,
// qo_len, kv_len, kv_head, q vector, out vector, lse slot) for every (query row, query head) of
// the batch. Rows are independent and each writes only its own slots, so they run on every
// hardware thread (a Scratch each, blocks of rows taken in turn from a shared counter): the
// result does not depend on the thread count. The GPU tests' largest references (~10^9 visible
// (row, key) pairs) took minutes on one thread.
template <typename Scratch, typename Body>
void for_each_row(const float* q, const std::vector<int32_t>& qo_indptr, const KVSource& kv,
                  const AttentionParams& p, std::vector<double>& out, std::vector<double>& lse,
                  Body body) {
  check_params(p);
  check_indptr(qo_indptr, "qo_indptr");
  const int batch = static_cast<int>(qo_indptr.size()) - 1;
  require(kv.batch_size() == batch, "KV batch size does not match qo_indptr");
  const int64_t total_q = qo_indptr.back();
  const int group = p.num_qo_heads / p.num_kv_heads;
  out.assign(static_cast<size_t>(total_q) * p.num_qo_heads * p.head_dim, 0.0);
  lse.assign(static_cast<size_t>(total_q) * p.num_qo_heads, kNegInf);
  // The request of each row, for rows handed out by index.
  std::vector<int> request_of_row(static_cast<size_t>(total_q));
  for (int r = 0; r < batch; ++r) {
    std::fill(request_of_row.begin() + qo_indptr[r], request_of_row.begin() + qo_indptr[r + 1], r);
  }
  constexpr int64_t kRowsPerBlock = 16;
  std::atomic<int64_t> next_row{0};
  std::mutex failure_mutex;
  std::exception_ptr failure;  // the first exception a row threw (a KV source's own check)
  auto rows = [&] {
    Scratch scratch;
    for (int64_t first = next_row.fetch_add(kRowsPerBlock); first < total_q;
         first = next_row.fetch_add(kRowsPerBlock)) {
      const int64_t last = std::min(total_q, first + kRowsPerBlock);
      for (int64_t row = first; row < last; ++row) {
        const int r = request_of_row[static_cast<size_t>(row)];
        const int64_t qo_len = qo_indptr[r + 1] - qo_indptr[r];
        const int64_t kv_len = kv.kv_len(r);
        for (int h = 0; h < p.num_qo_heads; ++h) {
          const int64_t slot = row * p.num_qo_heads + h;
          body(scratch, r, row - qo_indptr[r], qo_len, kv_len, h / group, q + slot * p.head_dim,
               out.data() + slot * p.head_dim, &lse[slot]);
        }
      }
    }
  };
  auto worker = [&] {
    try {
      rows();
    } catch (...) {
      next_row = total_q;  // the others stop after their current block
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  // A thread per hardware thread, but none for less than a block of rows each.
  const int64_t useful = (total_q + kRowsPerBlock - 1) / kRowsPerBlock;
  const int threads = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), useful)));
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  try {
    for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  } catch (const std::system_error&) {
    // A thread limit (ulimit, a container's pids.max) refused one: the rows go to the threads
    // that did start and to this one, which all take blocks from the same counter.
  }
  worker();
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

double AttentionParams::effective_scale() const {
  return scale > 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

bool key_visible(const AttentionParams& p, int64_t i, int64_t j, int64_t qo_len, int64_t kv_len) {
  if (i < 0 || i >= qo_len || j < 0 || j >= kv_len) return false;
  // Bottom-right alignment: the last query row sits on the last key ("diagonal" key of row i).
  const int64_t diagonal = i + kv_len - qo_len;
  if (p.causal && j > diagonal) return false;
  // The window bounds from below whether or not the mask is causal (as FlashInfer does).
  if (p.window_left >= 0 && j < diagonal - p.window_left) return false;
  return true;
}

// ---- RaggedKV --------------------------------------------------------------------------------

RaggedKV::RaggedKV(const float* k, const float* v, std::vector<int32_t> kv_indptr,
                   int num_kv_heads, int head_dim)
    : k_(k), v_(v), indptr_(std::move(kv_indptr)), num_kv_heads_(num_kv_heads),
      head_dim_(head_dim) {
  check_indptr(indptr_, "kv_indptr");
}

int RaggedKV::batch_size() const { return static_cast<int>(indptr_.size()) - 1; }

int64_t RaggedKV::kv_len(int request) const { return indptr_[request + 1] - indptr_[request]; }

const float* RaggedKV::key(int request, int64_t pos, int kv_head) const {
  return k_ + ((indptr_[request] + pos) * num_kv_heads_ + kv_head) * head_dim_;
}

const float* RaggedKV::value(int request, int64_t pos, int kv_head) const {
  return v_ + ((indptr_[request] + pos) * num_kv_heads_ + kv_head) * head_dim_;
}

// ---- PagedKV ---------------------------------------------------------------------------------

PagedKV::PagedKV(const float* k_pages, const float* v_pages, PageLayout layout, int page_size,
                 int num_kv_heads, int head_dim, const int64_t k_strides[3],
                 const int64_t v_strides[3], std::vector<int32_t> kv_indptr,
                 std::vector<int32_t> kv_indices, std::vector<int32_t> kv_last_page_len)
    : k_(k_pages), v_(v_pages), layout_(layout), page_size_(page_size),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), indptr_(std::move(kv_indptr)),
      indices_(std::move(kv_indices)), last_page_len_(std::move(kv_last_page_len)) {
  std::memcpy(k_strides_, k_strides, sizeof(k_strides_));
  std::memcpy(v_strides_, v_strides, sizeof(v_strides_));
  require(page_size_ > 0, "page_size must be positive");
  check_indptr(indptr_, "kv_indptr");
  require(static_cast<int64_t>(indices_.size()) >= indptr_.back(),
          "kv_indices is shorter than kv_indptr.back()");
  require(last_page_len_.size() + 1 == indptr_.size(), "kv_last_page_len must have B entries");
  for (int r = 0; r < batch_size(); ++r) {
    const bool has_pages = indptr_[r + 1] > indptr_[r];
    require(!has_pages || (last_page_len_[r] >= 1 && last_page_len_[r] <= page_size_),
            "kv_last_page_len must be in [1, page_size] for a request with pages");
  }
}

int PagedKV::batch_size() const { return static_cast<int>(indptr_.size()) - 1; }

int64_t PagedKV::kv_len(int request) const {
  const int64_t pages = indptr_[request + 1] - indptr_[request];
  return pages == 0 ? 0 : page_size_ * (pages - 1) + last_page_len_[request];
}

const float* PagedKV::locate(const float* base, const int64_t* strides, int request, int64_t pos,
                             int kv_head) const {
  const int64_t page = indices_[indptr_[request] + pos / page_size_];
  const int64_t slot = pos % page_size_;
  // NHD: dims (page, slot, head); HND: dims (page, head, slot).
  const int64_t mid = layout_ == PageLayout::kNHD ? slot * strides[1] + kv_head * strides[2]
                                                  : kv_head * strides[1] + slot * strides[2];
  return base + page * strides[0] + mid;
}

const float* PagedKV::key(int request, int64_t pos, int kv_head) const {
  return locate(k_, k_strides_, request, pos, kv_head);
}

const float* PagedKV::value(int request, int64_t pos, int kv_head) const {
  return locate(v_, v_strides_, request, pos, kv_head);
}

// ---- fp64 attention --------------------------------------------------------------------------

void attention(const float* q, const std::vector<int32_t>& qo_indptr, const KVSource& kv,
               const AttentionParams& params, std::vector<double>& out, std::vector<double>& lse) {
  const int d = params.head_dim;
  const double scale = params.effective_scale();
  for_each_row<std::vector<double>>(q, qo_indptr, kv, params, out, lse,
               [&](std::vector<double>& logits, int r, int64_t i, int64_t qo_len, int64_t kv_len, int kv_head, const float* qv,
                   double* o, double* s_out) {
    // Scaled (then soft-capped) logits of the visible keys; masked keys are -inf.
    logits.assign(static_cast<size_t>(kv_len), kNegInf);
    double m = kNegInf;
    bool any_visible = false;
    for (int64_t j = 0; j < kv_len; ++j) {
      if (!key_visible(params, i, j, qo_len, kv_len)) continue;
      const float* kj = kv.key(r, j, kv_head);
      double dot = 0.0;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(qv[c]) * kj[c];
      double s = dot * scale;
      if (params.soft_cap > 0.0) s = params.soft_cap * std::tanh(s / params.soft_cap);
      logits[j] = s;
      m = std::fmax(m, s);  // a NaN logit still reaches the sum below through exp(NaN - m)
      any_visible = true;
    }
    if (!any_visible) return;  // zeros and LSE = -inf, as sized by for_each_row
    double sum = 0.0;
    for (int64_t j = 0; j < kv_len; ++j) {
      if (logits[j] == kNegInf) continue;
      const double pj = std::exp(logits[j] - m);
      sum += pj;
      const float* vj = kv.value(r, j, kv_head);
      for (int c = 0; c < d; ++c) o[c] += pj * vj[c];
    }
    for (int c = 0; c < d; ++c) o[c] /= sum;
    *s_out = m + std::log(sum);
  });
}

// ---- naive low precision ---------------------------------------------------------------------

float round_to_mantissa(float x, int mantissa_bits) {
  constexpr int kFloatMantissa = 23;
  if (mantissa_bits >= kFloatMantissa || !std::isfinite(x)) return x;
  require(mantissa_bits >= 0, "mantissa_bits must be >= 0");
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const int drop = kFloatMantissa - mantissa_bits;
  const uint32_t lsb = (u >> drop) & 1u;               // the kept bit that decides ties (to even)
  u += ((1u << (drop - 1)) - 1u) + lsb;                // a carry may bump the exponent (up to inf)
  u &= ~((1u << drop) - 1u);
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

void attention_naive_lowp(const float* q, const std::vector<int32_t>& qo_indptr,
                          const KVSource& kv, const AttentionParams& params, int mantissa_bits,
                          std::vector<double>& out, std::vector<double>& lse) {
  const int d = params.head_dim;
  const float scale = static_cast<float>(params.effective_scale());
  const float cap = static_cast<float>(params.soft_cap);
  constexpr float kNegInfF = -std::numeric_limits<float>::infinity();
  struct Scratch {
    std::vector<float> scores, acc;
  };
  for_each_row<Scratch>(q, qo_indptr, kv, params, out, lse,
               [&](Scratch& scratch, int r, int64_t i, int64_t qo_len, int64_t kv_len, int kv_head, const float* qv,
                   double* o, double* s_out) {
    std::vector<float>& scores = scratch.scores;
    std::vector<float>& acc = scratch.acc;
    acc.resize(static_cast<size_t>(d));
    // S = scale * Q K^T in fp32 (optionally soft-capped in fp32).
    scores.assign(static_cast<size_t>(kv_len), kNegInfF);
    float m = kNegInfF;
    bool any_visible = false;
    for (int64_t j = 0; j < kv_len; ++j) {
      if (!key_visible(params, i, j, qo_len, kv_len)) continue;
      const float* kj = kv.key(r, j, kv_head);
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot += qv[c] * kj[c];
      float s = dot * scale;
      if (params.soft_cap > 0.0) s = cap * std::tanh(s / cap);
      scores[j] = s;
      m = std::fmax(m, s);
      any_visible = true;
    }
    if (!any_visible) return;
    // Softmax in fp32; P is stored in the low precision before the P V product.
    float sum = 0.0f;
    for (int64_t j = 0; j < kv_len; ++j) {
      if (scores[j] != kNegInfF) sum += std::exp(scores[j] - m);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < kv_len; ++j) {
      if (scores[j] == kNegInfF) continue;
      const float pj = round_to_mantissa(std::exp(scores[j] - m) / sum, mantissa_bits);
      const float* vj = kv.value(r, j, kv_head);
      for (int c = 0; c < d; ++c) acc[c] += pj * vj[c];
    }
    for (int c = 0; c < d; ++c) o[c] = round_to_mantissa(acc[c], mantissa_bits);
    *s_out = static_cast<double>(m + std::log(sum));
  });
}

}  // namespace tessera::ref
