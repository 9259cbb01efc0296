// The fp64 attention reference against a dense brute-force formulation written here from
// docs/CONVENTIONS.md, and against its invariants: split-KV + merge, GQA = repeated MHA, paged = ragged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "reference/attention_ref.h"
#include "reference/merge_ref.h"

namespace tessera::ref {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kTol = 1e-12;  // fp64 vs fp64 computed in a different order

using Lengths = std::vector<std::pair<int, int>>;  // (qo_len, kv_len) per request

// Awkward on purpose: lengths 1, 7, 54, 97, qo_len <, = and > kv_len, and empty requests.
const Lengths kMixedLengths = {{7, 54}, {54, 54}, {54, 7}, {0, 7}, {1, 97},
                               {5, 0},  {0, 0},   {1, 1}, {97, 1}, {13, 97}};

// A ragged batch with random Q, K, V in [-1, 1].
struct Batch {
  int num_qo_heads = 0, num_kv_heads = 0, head_dim = 0;
  std::vector<int32_t> qo_indptr{0}, kv_indptr{0};
  std::vector<float> q, k, v;

  int size() const { return static_cast<int>(qo_indptr.size()) - 1; }
  int qo_len(int r) const { return qo_indptr[r + 1] - qo_indptr[r]; }
  int kv_len(int r) const { return kv_indptr[r + 1] - kv_indptr[r]; }
  RaggedKV ragged() const {
    return RaggedKV(k.data(), v.data(), kv_indptr, num_kv_heads, head_dim);
  }
  const float* q_row(int r, int i) const {
    return q.data() + static_cast<size_t>(qo_indptr[r] + i) * num_qo_heads * head_dim;
  }
};

Batch make_batch(const Lengths& lengths, int num_qo_heads, int num_kv_heads, int head_dim,
                 uint32_t seed) {
  Batch b;
  b.num_qo_heads = num_qo_heads;
  b.num_kv_heads = num_kv_heads;
  b.head_dim = head_dim;
  for (auto [qo_len, kv_len] : lengths) {
    b.qo_indptr.push_back(b.qo_indptr.back() + qo_len);
    b.kv_indptr.push_back(b.kv_indptr.back() + kv_len);
  }
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto fill = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (float& e : x) e = dist(rng);
  };
  fill(b.q, static_cast<size_t>(b.qo_indptr.back()) * num_qo_heads * head_dim);
  fill(b.k, static_cast<size_t>(b.kv_indptr.back()) * num_kv_heads * head_dim);
  fill(b.v, static_cast<size_t>(b.kv_indptr.back()) * num_kv_heads * head_dim);
  return b;
}

AttentionParams params_for(const Batch& b) {
  AttentionParams p;
  p.num_qo_heads = b.num_qo_heads;
  p.num_kv_heads = b.num_kv_heads;
  p.head_dim = b.head_dim;
  return p;
}

// Max |a - b|; equal infinities count as 0, any NaN or unequal infinity as +inf.
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return kInf;
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return kInf;
    if (a[i] == b[i]) continue;  // also covers -inf == -inf
    worst = std::max(worst, std::abs(a[i] - b[i]));
  }
  return worst;
}

// Dense attention of the whole batch, request by request: materialise the [qo_len, kv_len] score
// matrix, mask it explicitly, softmax each row. Written from docs/CONVENTIONS.md, independently of
// attention_ref.cpp.
void brute_force(const Batch& b, const AttentionParams& p, std::vector<double>& out,
                 std::vector<double>& lse) {
  const int hq = b.num_qo_heads, d = b.head_dim, group = b.num_qo_heads / b.num_kv_heads;
  const double scale = p.scale > 0 ? p.scale : 1.0 / std::sqrt(double(d));
  out.clear();
  lse.clear();
  for (int r = 0; r < b.size(); ++r) {
    const int qo_len = b.qo_len(r), kv_len = b.kv_len(r);
    // mask[i][j]: bottom-right alignment puts row i's diagonal at key kv_len - qo_len + i; causal
    // hides keys after the diagonal, a window of w hides keys more than w behind it.
    std::vector<std::vector<bool>> mask(qo_len, std::vector<bool>(kv_len));
    for (int i = 0; i < qo_len; ++i) {
      for (int j = 0; j < kv_len; ++j) {
        const int behind_diagonal = (kv_len - qo_len + i) - j;
        mask[i][j] = (!p.causal || behind_diagonal >= 0) &&
                     (p.window_left < 0 || behind_diagonal <= p.window_left);
      }
    }
    for (int i = 0; i < qo_len; ++i) {
      for (int h = 0; h < hq; ++h) {
        const float* qv = b.q_row(r, i) + h * d;
        std::vector<double> s(kv_len, -kInf);
        for (int j = 0; j < kv_len; ++j) {
          const size_t kv_row = (size_t(b.kv_indptr[r] + j) * b.num_kv_heads + h / group) * d;
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += double(qv[c]) * double(b.k[kv_row + c]);
          double logit = scale * dot;
          if (p.soft_cap > 0) logit = p.soft_cap * std::tanh(logit / p.soft_cap);
          if (mask[i][j]) s[j] = logit;
        }
        const double m = kv_len ? *std::max_element(s.begin(), s.end()) : -kInf;
        std::vector<double> o(d, 0.0);
        if (m == -kInf) {  // no visible key
          out.insert(out.end(), o.begin(), o.end());
          lse.push_back(-kInf);
          continue;
        }
        double sum = 0;
        for (int j = 0; j < kv_len; ++j) sum += std::exp(s[j] - m);
        for (int j = 0; j < kv_len; ++j) {
          const size_t kv_row = (size_t(b.kv_indptr[r] + j) * b.num_kv_heads + h / group) * d;
          for (int c = 0; c < d; ++c) o[c] += std::exp(s[j] - m) / sum * b.v[kv_row + c];
        }
        out.insert(out.end(), o.begin(), o.end());
        lse.push_back(m + std::log(sum));
      }
    }
  }
}

void expect_matches_brute_force(AttentionParams p, const Batch& b) {
  std::vector<double> out, lse, want_out, want_lse;
  attention(b.q.data(), b.qo_indptr, b.ragged(), p, out, lse);
  brute_force(b, p, want_out, want_lse);
  EXPECT_LE(max_abs_diff(out, want_out), kTol);
  EXPECT_LE(max_abs_diff(lse, want_lse), kTol);
}

// ---- masks and key_visible --------------------------------------------------------------------

TEST(RefAttention, KeyVisibleHandCases) {
  AttentionParams p;
  // No mask: everything in range is visible, nothing outside.
  EXPECT_TRUE(key_visible(p, 0, 4, 2, 5));
  EXPECT_FALSE(key_visible(p, 0, 5, 2, 5));
  EXPECT_FALSE(key_visible(p, 0, -1, 2, 5));
  EXPECT_FALSE(key_visible(p, 2, 0, 2, 5));
  // Causal, 2 queries over 5 keys: row 0 sees keys 0..3, row 1 sees 0..4.
  p.causal = true;
  EXPECT_TRUE(key_visible(p, 0, 3, 2, 5));
  EXPECT_FALSE(key_visible(p, 0, 4, 2, 5));
  EXPECT_TRUE(key_visible(p, 1, 4, 2, 5));
  // Causal, 5 queries over 2 keys: rows 0..2 see nothing, row 3 sees key 0, row 4 keys 0..1.
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(key_visible(p, i, 0, 5, 2)) << "row " << i;
  }
  EXPECT_TRUE(key_visible(p, 3, 0, 5, 2));
  EXPECT_FALSE(key_visible(p, 3, 1, 5, 2));
  EXPECT_TRUE(key_visible(p, 4, 1, 5, 2));
  // Causal + window 1, 2 queries over 5 keys: row 0 sees keys 2..3, row 1 sees 3..4.
  p.window_left = 1;
  EXPECT_FALSE(key_visible(p, 0, 1, 2, 5));
  EXPECT_TRUE(key_visible(p, 0, 2, 2, 5));
  EXPECT_TRUE(key_visible(p, 0, 3, 2, 5));
  EXPECT_FALSE(key_visible(p, 0, 4, 2, 5));
  EXPECT_FALSE(key_visible(p, 1, 2, 2, 5));
  EXPECT_TRUE(key_visible(p, 1, 4, 2, 5));
  // Window 0: only the diagonal key.
  p.window_left = 0;
  EXPECT_TRUE(key_visible(p, 1, 4, 2, 5));
  EXPECT_FALSE(key_visible(p, 1, 3, 2, 5));
  // Window without causal bounds from below only: 4 queries over 4 keys, w = 1.
  p.causal = false;
  p.window_left = 1;
  EXPECT_TRUE(key_visible(p, 0, 3, 4, 4));
  EXPECT_TRUE(key_visible(p, 3, 2, 4, 4));
  EXPECT_FALSE(key_visible(p, 3, 1, 4, 4));
}

// ---- against the brute force -------------------------------------------------------------------

TEST(RefAttention, MatchesBruteForceNoMask) {
  const Batch b = make_batch(kMixedLengths, 4, 2, 8, 101);
  expect_matches_brute_force(params_for(b), b);
}

TEST(RefAttention, MatchesBruteForceCausal) {
  const Batch b = make_batch(kMixedLengths, 4, 2, 8, 102);
  AttentionParams p = params_for(b);
  p.causal = true;
  expect_matches_brute_force(p, b);
}

TEST(RefAttention, MatchesBruteForceCausalWindow) {
  const Batch b = make_batch(kMixedLengths, 4, 2, 8, 103);
  AttentionParams p = params_for(b);
  p.causal = true;
  for (int w : {0, 1, 6, 200}) {
    SCOPED_TRACE(w);
    p.window_left = w;
    expect_matches_brute_force(p, b);
  }
}

TEST(RefAttention, MatchesBruteForceWindowWithoutCausal) {
  const Batch b = make_batch(kMixedLengths, 4, 2, 8, 104);
  AttentionParams p = params_for(b);
  p.window_left = 5;
  expect_matches_brute_force(p, b);
}

TEST(RefAttention, MatchesBruteForceSoftCap) {
  const Batch b = make_batch(kMixedLengths, 4, 2, 8, 105);
  AttentionParams p = params_for(b);
  p.scale = 3.0;       // large logits, so the cap bends them noticeably
  p.soft_cap = 1.5;
  expect_matches_brute_force(p, b);
  p.causal = true;
  expect_matches_brute_force(p, b);
}

TEST(RefAttention, MatchesBruteForceCustomScale) {
  const Batch b = make_batch(kMixedLengths, 4, 4, 8, 106);
  AttentionParams p = params_for(b);
  p.scale = 0.77;
  p.causal = true;
  p.window_left = 9;
  expect_matches_brute_force(p, b);
}

TEST(RefAttention, DefaultScaleIsInverseSqrtHeadDim) {
  AttentionParams p;
  p.head_dim = 64;
  EXPECT_DOUBLE_EQ(p.effective_scale(), 0.125);
  p.scale = 0.3;
  EXPECT_DOUBLE_EQ(p.effective_scale(), 0.3);
}

TEST(RefAttention, FullyMaskedRowsGiveZerosAndNegInfLse) {
  // Causal with 9 queries over 4 keys: rows 0..4 see no key; rows 5..8 see keys 0..i-5.
  const Batch b = make_batch({{9, 4}, {3, 0}}, 2, 1, 8, 107);
  AttentionParams p = params_for(b);
  p.causal = true;
  std::vector<double> out, lse;
  attention(b.q.data(), b.qo_indptr, b.ragged(), p, out, lse);
  for (int row = 0; row < 12; ++row) {
    const bool masked = row < 5 || row >= 9;  // rows 9..11: the kv_len = 0 request
    for (int h = 0; h < 2; ++h) {
      SCOPED_TRACE(testing::Message() << "row " << row << " head " << h);
      const double s = lse[row * 2 + h];
      if (masked) {
        EXPECT_EQ(s, -kInf);
        for (int c = 0; c < 8; ++c) EXPECT_EQ(out[(row * 2 + h) * 8 + c], 0.0) << "element " << c;
      } else {
        EXPECT_TRUE(std::isfinite(s));
      }
    }
  }
}

TEST(RefAttention, EmptyRequestsDoNotDisturbNeighbours) {
  const Lengths lengths = {{3, 5}, {0, 4}, {2, 0}, {0, 0}, {4, 6}};
  const Batch b = make_batch(lengths, 2, 2, 8, 108);
  AttentionParams p = params_for(b);
  p.causal = true;
  std::vector<double> out, lse;
  attention(b.q.data(), b.qo_indptr, b.ragged(), p, out, lse);
  ASSERT_EQ(out.size(), size_t(9 * 2 * 8));
  for (int r : {0, 4}) {  // each non-empty request computed alone must give the same rows
    const int qo_len = b.qo_len(r), kv_len = b.kv_len(r);
    const size_t kv_off = size_t(b.kv_indptr[r]) * 2 * 8;
    RaggedKV alone(b.k.data() + kv_off, b.v.data() + kv_off, {0, kv_len}, 2, 8);
    std::vector<double> out1, lse1;
    attention(b.q_row(r, 0), {0, qo_len}, alone, p, out1, lse1);
    const size_t o_off = size_t(b.qo_indptr[r]) * 2 * 8, s_off = size_t(b.qo_indptr[r]) * 2;
    EXPECT_EQ(max_abs_diff(out1, {out.begin() + o_off, out.begin() + o_off + out1.size()}), 0.0);
    EXPECT_EQ(max_abs_diff(lse1, {lse.begin() + s_off, lse.begin() + s_off + lse1.size()}), 0.0);
  }
}

TEST(RefAttention, NaNPropagatesOnlyToRowsThatSeeIt) {
  const int hq = 2, d = 8;  // one query head per KV head
  Batch b = make_batch({{6, 6}, {4, 5}}, hq, hq, d, 109);
  // A NaN in key 2 (request 0, KV head 0) and in value 4, component 3 (request 0, KV head 1).
  b.k[(2 * hq + 0) * d + 5] = std::numeric_limits<float>::quiet_NaN();
  b.v[(4 * hq + 1) * d + 3] = std::numeric_limits<float>::quiet_NaN();
  AttentionParams p = params_for(b);
  p.causal = true;  // row i of request 0 sees keys 0..i
  std::vector<double> out, lse;
  attention(b.q.data(), b.qo_indptr, b.ragged(), p, out, lse);
  for (int row = 0; row < 10; ++row) {
    for (int h = 0; h < hq; ++h) {
      SCOPED_TRACE(testing::Message() << "row " << row << " head " << h);
      const bool sees_nan_key = row < 6 && h == 0 && row >= 2;
      const bool sees_nan_value = row < 6 && h == 1 && row >= 4;
      EXPECT_EQ(std::isnan(lse[row * hq + h]), sees_nan_key);
      for (int c = 0; c < d; ++c) {
        const bool want_nan = sees_nan_key || (sees_nan_value && c == 3);
        EXPECT_EQ(std::isnan(out[(row * hq + h) * d + c]), want_nan) << "component " << c;
      }
    }
  }
}

// ---- split-KV, GQA, paged -----------------------------------------------------------------------

TEST(RefAttention, SplitKVThenMergeEqualsWhole) {
  const Lengths lengths = {{7, 54}, {1, 97}, {5, 1}, {54, 54}, {3, 13}};
  const int hq = 4, hkv = 2, d = 8;
  const Batch b = make_batch(lengths, hq, hkv, d, 110);
  AttentionParams p = params_for(b);
  p.soft_cap = 2.0;
  std::vector<double> whole_out, whole_lse;
  attention(b.q.data(), b.qo_indptr, b.ragged(), p, whole_out, whole_lse);

  std::mt19937 rng(111);
  for (int r = 0; r < b.size(); ++r) {
    const int qo_len = b.qo_len(r), kv_len = b.kv_len(r);
    // Chunk bounds 0 <= a <= a <= c <= kv_len: four chunks, one of them always empty.
    const int a = std::uniform_int_distribution<int>(0, kv_len)(rng);
    const int c = std::uniform_int_distribution<int>(a, kv_len)(rng);
    const std::vector<int> bounds = {0, a, a, c, kv_len};
    const int n = static_cast<int>(bounds.size()) - 1;
    std::vector<std::vector<double>> chunk_out(n), chunk_lse(n);
    for (int i = 0; i < n; ++i) {
      const size_t off = size_t(b.kv_indptr[r] + bounds[i]) * hkv * d;
      RaggedKV chunk(b.k.data() + off, b.v.data() + off, {0, bounds[i + 1] - bounds[i]}, hkv, d);
      attention(b.q_row(r, 0), {0, qo_len}, chunk, p, chunk_out[i], chunk_lse[i]);
    }
    // Merge the n partial states of each (row, head) and compare with the unsplit result.
    double worst_o = 0, worst_s = 0;
    std::vector<double> parts(size_t(n) * d), lses(n), o(d);
    for (int row = 0; row < qo_len; ++row) {
      for (int h = 0; h < hq; ++h) {
        const int slot = row * hq + h;
        for (int i = 0; i < n; ++i) {
          std::copy_n(chunk_out[i].begin() + slot * d, d, parts.begin() + i * d);
          lses[i] = chunk_lse[i][slot];
        }
        double s;
        merge_n(parts.data(), lses.data(), n, d, o.data(), &s);
        const size_t whole_slot = size_t(b.qo_indptr[r]) * hq + slot;
        worst_s = std::max(worst_s, std::abs(s - whole_lse[whole_slot]));
        for (int k = 0; k < d; ++k) {
          worst_o = std::max(worst_o, std::abs(o[k] - whole_out[whole_slot * d + k]));
        }
      }
    }
    EXPECT_LE(worst_o, kTol) << "request " << r;
    EXPECT_LE(worst_s, kTol) << "request " << r;
  }
}

TEST(RefAttention, GQAEqualsMHAWithRepeatedKV) {
  const Lengths lengths = {{5, 9}, {13, 13}, {1, 30}, {0, 3}};
  const int hkv = 2, d = 8;
  for (int group : {1, 4, 8}) {
    SCOPED_TRACE(testing::Message() << "group " << group);
    const int hq = hkv * group;
    const Batch b = make_batch(lengths, hq, hkv, d, 112 + group);
    // MHA copy: K/V head h of the repeated tensors is KV head h / group of the originals.
    const size_t total_kv = size_t(b.kv_indptr.back());
    std::vector<float> k_rep(total_kv * hq * d), v_rep(total_kv * hq * d);
    for (size_t t = 0; t < total_kv; ++t) {
      for (int h = 0; h < hq; ++h) {
        for (int c = 0; c < d; ++c) {
          k_rep[(t * hq + h) * d + c] = b.k[(t * hkv + h / group) * d + c];
          v_rep[(t * hq + h) * d + c] = b.v[(t * hkv + h / group) * d + c];
        }
      }
    }
    AttentionParams p = params_for(b);
    p.causal = true;
    p.window_left = 6;
    std::vector<double> out, lse, mha_out, mha_lse;
    attention(b.q.data(), b.qo_indptr, b.ragged(), p, out, lse);
    p.num_kv_heads = hq;
    attention(b.q.data(), b.qo_indptr, RaggedKV(k_rep.data(), v_rep.data(), b.kv_indptr, hq, d),
              p, mha_out, mha_lse);
    EXPECT_EQ(max_abs_diff(out, mha_out), 0.0);
    EXPECT_EQ(max_abs_diff(lse, mha_lse), 0.0);
  }
}

// The batch's K/V copied into shuffled pages with padded strides; everything else is NaN, so a
// read of the wrong element shows up in the output.
struct PagedCopy {
  std::vector<float> k, v;
  int64_t k_strides[3], v_strides[3];
  std::vector<int32_t> indptr{0}, indices, last_page_len;
};

// Element strides of (page, dim 1, dim 2) with `pad` unused floats after every row and level.
void padded_strides(PageLayout layout, int page_size, int heads, int head_dim, int pad,
                    int64_t strides[3]) {
  const int dim2 = layout == PageLayout::kNHD ? heads : page_size;
  const int dim1 = layout == PageLayout::kNHD ? page_size : heads;
  strides[2] = head_dim + pad;
  strides[1] = dim2 * strides[2] + pad;
  strides[0] = dim1 * strides[1] + pad;
}

PagedCopy make_paged(const Batch& b, PageLayout layout, int page_size, std::mt19937& rng) {
  const int hkv = b.num_kv_heads, d = b.head_dim;
  PagedCopy pc;
  int num_pages = 3;  // spare pages that no request owns
  for (int r = 0; r < b.size(); ++r) num_pages += (b.kv_len(r) + page_size - 1) / page_size;
  std::vector<int32_t> page_ids(num_pages);
  std::iota(page_ids.begin(), page_ids.end(), 0);
  std::shuffle(page_ids.begin(), page_ids.end(), rng);
  padded_strides(layout, page_size, hkv, d, /*pad=*/3, pc.k_strides);
  padded_strides(layout, page_size, hkv, d, /*pad=*/5, pc.v_strides);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  pc.k.assign(size_t(num_pages * pc.k_strides[0]), nan);
  pc.v.assign(size_t(num_pages * pc.v_strides[0]), nan);
  auto at = [&](const int64_t* s, int64_t page, int slot, int head) {
    return page * s[0] + (layout == PageLayout::kNHD ? slot * s[1] + head * s[2]
                                                     : head * s[1] + slot * s[2]);
  };
  int next = 0;
  for (int r = 0; r < b.size(); ++r) {
    const int kv_len = b.kv_len(r), pages = (kv_len + page_size - 1) / page_size;
    for (int i = 0; i < pages; ++i) pc.indices.push_back(page_ids[next++]);
    pc.indptr.push_back(pc.indptr.back() + pages);
    pc.last_page_len.push_back(kv_len == 0 ? 0 : kv_len - (pages - 1) * page_size);
    for (int pos = 0; pos < kv_len; ++pos) {
      const int64_t page = pc.indices[pc.indptr[r] + pos / page_size];
      const int slot = pos % page_size;
      for (int h = 0; h < hkv; ++h) {
        const size_t src = (size_t(b.kv_indptr[r] + pos) * hkv + h) * d;
        std::copy_n(b.k.begin() + src, d, pc.k.begin() + at(pc.k_strides, page, slot, h));
        std::copy_n(b.v.begin() + src, d, pc.v.begin() + at(pc.v_strides, page, slot, h));
      }
    }
  }
  return pc;
}

TEST(RefAttention, PagedEqualsRagged) {
  // Lengths below, at and past page multiples (16, 5, 54 = 3*16+6), and an empty request.
  const Lengths lengths = {{3, 1}, {5, 16}, {0, 0}, {2, 17}, {7, 54}, {1, 97}, {4, 5}, {9, 4}};
  for (PageLayout layout : {PageLayout::kNHD, PageLayout::kHND}) {
    for (int page_size : {1, 16, 5}) {
      SCOPED_TRACE(testing::Message() << (layout == PageLayout::kNHD ? "NHD" : "HND")
                                      << " page_size " << page_size);
      const Batch b = make_batch(lengths, 4, 2, 8, 120 + page_size);
      std::mt19937 rng(130 + page_size);
      const PagedCopy pc = make_paged(b, layout, page_size, rng);
      const PagedKV paged(pc.k.data(), pc.v.data(), layout, page_size, 2, 8, pc.k_strides,
                          pc.v_strides, pc.indptr, pc.indices, pc.last_page_len);
      ASSERT_EQ(paged.batch_size(), b.size());
      for (int r = 0; r < b.size(); ++r) EXPECT_EQ(paged.kv_len(r), b.kv_len(r)) << "request " << r;

      AttentionParams p = params_for(b);
      p.causal = true;
      p.window_left = 20;
      std::vector<double> out, lse, want_out, want_lse;
      attention(b.q.data(), b.qo_indptr, paged, p, out, lse);
      attention(b.q.data(), b.qo_indptr, b.ragged(), p, want_out, want_lse);
      // Same values summed in the same order: bit-identical.
      EXPECT_EQ(max_abs_diff(out, want_out), 0.0);
      EXPECT_EQ(max_abs_diff(lse, want_lse), 0.0);
    }
  }
}

// The reference spreads rows over the host's threads: every row must come out as it does when its
// request is computed alone (bitwise), and a KV source's exception must reach the caller.
TEST(RefAttention, RowsOnManyThreadsEqualRequestsAlone) {
  Lengths lengths;
  for (int r = 0; r < 40; ++r) lengths.push_back({1 + (r * 7) % 16, 1 + (r * 13) % 97});
  const Batch b = make_batch(lengths, 4, 2, 8, 77);
  AttentionParams p = params_for(b);
  p.causal = true;
  std::vector<double> out, lse;
  attention(b.q.data(), b.qo_indptr, b.ragged(), p, out, lse);
  const size_t row_floats = static_cast<size_t>(b.num_qo_heads) * b.head_dim;
  for (int r = 0; r < b.size(); ++r) {
    // Request r alone: its rows (at most 16: one block of the reference's work split).
    const std::vector<int32_t> qo{0, b.qo_len(r)}, kv{0, b.kv_len(r)};
    const float* q = b.q_row(r, 0);
    const size_t kv_floats = static_cast<size_t>(b.num_kv_heads) * b.head_dim;
    const RaggedKV alone(b.k.data() + b.kv_indptr[r] * kv_floats, b.v.data() + b.kv_indptr[r] * kv_floats, kv,
                         b.num_kv_heads, b.head_dim);
    std::vector<double> o1, l1;
    attention(q, qo, alone, p, o1, l1);
    for (size_t i = 0; i < o1.size(); ++i)
      ASSERT_EQ(o1[i], out[b.qo_indptr[r] * row_floats + i]) << "request " << r << " element " << i;
    for (size_t i = 0; i < l1.size(); ++i)
      ASSERT_EQ(l1[i], lse[b.qo_indptr[r] * b.num_qo_heads + i]) << "request " << r << " LSE " << i;
  }
}

class ThrowingKV final : public KVSource {
 public:
  explicit ThrowingKV(const RaggedKV& inner) : inner_(inner) {}
  int batch_size() const override { return inner_.batch_size(); }
  int64_t kv_len(int r) const override { return inner_.kv_len(r); }
  const float* key(int r, int64_t pos, int h) const override {
    if (r == 3) throw std::logic_error("key of request 3");
    return inner_.key(r, pos, h);
  }
  const float* value(int r, int64_t pos, int h) const override { return inner_.value(r, pos, h); }

 private:
  const RaggedKV& inner_;
};

TEST(RefAttention, KvSourceExceptionsReachTheCaller) {
  Lengths lengths(64, {16, 20});
  const Batch b = make_batch(lengths, 2, 2, 8, 78);
  const RaggedKV ragged = b.ragged();
  const ThrowingKV throwing(ragged);
  std::vector<double> out, lse;
  EXPECT_THROW(attention(b.q.data(), b.qo_indptr, throwing, params_for(b), out, lse), std::logic_error);
  EXPECT_THROW(attention_naive_lowp(b.q.data(), b.qo_indptr, throwing, params_for(b), 7, out, lse), std::logic_error);
}

// ---- naive low precision ----------------------------------------------------------------------

TEST(RefAttention, RoundToMantissaHandCases) {
  const float one = 1.0f;
  EXPECT_EQ(round_to_mantissa(one + std::ldexp(1.0f, -8), 7), one);  // tie: to even (down)
  EXPECT_EQ(round_to_mantissa(one + 3 * std::ldexp(1.0f, -8), 7),
            one + std::ldexp(1.0f, -6));                                // tie: to even (up)
  EXPECT_EQ(round_to_mantissa(-(one + 3 * std::ldexp(1.0f, -8)), 7),
            -(one + std::ldexp(1.0f, -6)));
  EXPECT_EQ(round_to_mantissa(one + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -12), 7),
            one + std::ldexp(1.0f, -7));                                // above half: up
  EXPECT_EQ(round_to_mantissa(1.0f / 3.0f, 7), 0.333984375f);         // bf16 0x3EAB
  EXPECT_EQ(round_to_mantissa(1.0f / 3.0f, 10), 0.333251953125f);     // fp16 0x3555
  EXPECT_EQ(round_to_mantissa(std::numeric_limits<float>::max(), 7),
            std::numeric_limits<float>::infinity());                  // carries into inf
  EXPECT_EQ(round_to_mantissa(0.0f, 7), 0.0f);
  EXPECT_EQ(round_to_mantissa(-std::numeric_limits<float>::infinity(), 7),
            -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(round_to_mantissa(std::numeric_limits<float>::quiet_NaN(), 7)));
  EXPECT_EQ(round_to_mantissa(0.1f, 23), 0.1f);

  // Random values: idempotent, and within half an ulp (relative 2^-(bits+1)).
  std::mt19937 rng(140);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  for (int i = 0; i < 1000; ++i) {
    const float x = dist(rng);
    for (int bits : {7, 10}) {
      const float r = round_to_mantissa(x, bits);
      EXPECT_EQ(round_to_mantissa(r, bits), r);
      EXPECT_LE(std::abs(double(r) - x), std::ldexp(std::abs(double(x)), -(bits + 1)));
    }
  }
}

TEST(RefAttention, NaiveLowpRoundsProbabilitiesBeforePV) {
  // One query, two keys with softmax weights 0.6 and 0.4 (head_dim 2, second Q/K component 0);
  // V rows (1, 0.5) and (-1, 0.5). bf16 rounds P to (0.6015625, 0.400390625), so output column 0
  // is 0.201171875 (exact in bf16), not bf16(0.2) = 0.2001953125; column 1 stays exactly 0.5.
  const float q[2] = {1.0f, 0.0f};
  const float k[4] = {float(std::log(0.6)), 0.0f, float(std::log(0.4)), 0.0f};
  const float v[4] = {1.0f, 0.5f, -1.0f, 0.5f};
  AttentionParams p;
  p.num_qo_heads = p.num_kv_heads = 1;
  p.head_dim = 2;
  p.scale = 1.0;
  std::vector<double> out, lse;
  attention_naive_lowp(q, {0, 1}, RaggedKV(k, v, {0, 2}, 1, 2), p, 7, out, lse);
  EXPECT_EQ(out[0], 0.201171875);
  EXPECT_EQ(out[1], 0.5);
  EXPECT_NEAR(lse[0], 0.0, 1e-6);  // log(0.6 + 0.4)
}

// Max error of attention_naive_lowp against attention on inputs rounded to `bits`.
std::pair<double, double> lowp_error(int bits, bool causal, uint32_t seed) {
  Batch b = make_batch({{7, 54}, {54, 54}, {1, 97}, {0, 5}, {9, 3}}, 4, 2, 32, seed);
  for (auto* x : {&b.q, &b.k, &b.v}) {
    for (float& e : *x) e = round_to_mantissa(e, bits);
  }
  AttentionParams p = params_for(b);
  p.causal = causal;
  std::vector<double> out, lse, low_out, low_lse;
  attention(b.q.data(), b.qo_indptr, b.ragged(), p, out, lse);
  attention_naive_lowp(b.q.data(), b.qo_indptr, b.ragged(), p, bits, low_out, low_lse);
  return {max_abs_diff(low_out, out), max_abs_diff(low_lse, lse)};
}

TEST(RefAttention, NaiveLowpErrorIsSmallButNonzero) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "no mask");  // causal also has fully masked rows (-inf)
    const auto [bf16_o, bf16_s] = lowp_error(7, causal, 150);
    const auto [fp16_o, fp16_s] = lowp_error(10, causal, 150);
    EXPECT_GT(bf16_o, 0.0);
    EXPECT_LT(bf16_o, 2e-2);
    EXPECT_GT(fp16_o, 0.0);
    EXPECT_LT(fp16_o, 3e-3);
    EXPECT_LT(fp16_o, bf16_o);  // three more mantissa bits must help
    EXPECT_LT(bf16_s, 1e-5);    // LSE stays fp32
    EXPECT_LT(fp16_s, 1e-5);
  }
}

}  // namespace
}  // namespace tessera::ref
