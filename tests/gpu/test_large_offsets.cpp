// Element offsets past 2^31: page tensors and ragged K / V of more than 2^31 elements, whose
// addresses the kernels must compute in 64 bits. Element 2^31 of a bf16 tensor is where a signed
// 32-bit element offset wraps and, at byte 2^32, an unsigned 32-bit byte offset too, so every
// batch below reads or writes rows on both sides of that mark and at the very end of the tensors.
//
// Sizes (bf16, 8 KV heads, head_dim 128):
//   - paged: NHD pages of 16 tokens, 144180 pages (1.1 x 2^31 elements per page tensor, 4.72 GB
//     each for K and V, 9.45 GB in all). Page kMarkPage = 131072 starts at element 2^31.
//   - ragged: [2228224 rows, 8, 128] K and V (1.0625 x 2^31 elements, 4.56 GB each, 9.13 GB in
//     all). Row kMarkRow = 2^21 starts at element 2^31.
// Each test takes a few seconds on an H200 (the host reference and, for the append, reading the
// whole cache back dominate); a GPU without enough free memory skips them.
//
// Nothing is filled from the host but the rows a batch owns: the tensors are cudaMemset to zero
// (finite, since a key a KV tile loads but every row masks still multiplies its P of 0 into P.V
// under the FlashAttention-2 exception of docs/CONVENTIONS.md), and the pages a request owns are
// uploaded whole, with NaN in the slots past its kv_len (keys past kv_len are never loaded, so
// those NaN must not reach anything). The CPU reference reads the owned rows through a sparse
// KVSource that holds only them and refuses any other key. Outputs are poisoned before each run;
// every element of o / lse must be written and nothing around them; the tolerance rule is the
// one of test_decode.cpp (decode) and test_prefill_paged.cpp (prefill).
#include <gmock/gmock.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch/decode_dispatch.h"
#include "dispatch/prefill_dispatch.h"
#include "gpu/gpu_test_util.h"
#include "gpu/paged_kv_util.h"
#include "reference/attention_ref.h"
#include "tessera/attention.h"
#include "tessera/decode.h"
#include "tessera/kv_cache.h"

namespace tessera::testing {
namespace {

constexpr DType kDType = DType::kBF16;
constexpr int kPageSize = 16, kKvHeads = 8, kHeadDim = 128;
constexpr int64_t kTokenElems = int64_t(kKvHeads) * kHeadDim;  // one token's K (or V): 1024
constexpr int64_t kPageElems = kPageSize * kTokenElems;         // 2^14
constexpr int64_t kMark = int64_t(1) << 31;                     // the first element an int32 offset misses
constexpr int64_t kMarkPage = kMark / kPageElems;               // 131072: the first page at or past the mark
// 1.1 x 2^31 elements per page tensor, in whole pages: 144180 pages.
constexpr int64_t kNumPages = (kMark * 11 / 10 + kPageElems - 1) / kPageElems;
static_assert(kNumPages * kPageElems > kMark * 11 / 10, "K must hold more than 1.1 x 2^31 elements");
// append_paged_kv takes caches of fewer than 2^31 token slots (AppendRefusesCachesOf2To31TokenSlots).
static_assert(kNumPages * kPageSize < kMark, "the cache must stay inside append_paged_kv's limit");
constexpr int64_t kMarkRow = kMark / kTokenElems;            // 2^21: the first ragged row past the mark
constexpr int64_t kRaggedRows = kMarkRow + kMarkRow / 16;    // 2228224 rows: 1.0625 x 2^31 elements
constexpr size_t kPagedBytes = 2 * size_t(kNumPages * kPageElems) * 2;   // K and V
constexpr size_t kRaggedBytes = 2 * size_t(kRaggedRows * kTokenElems) * 2;

// "" when `bytes` (plus 1 GiB of room for the rest) fit in the GPU's free memory, else why not.
std::string memory_shortfall(size_t bytes) {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    cudaGetLastError();
    return "cudaMemGetInfo failed";
  }
  const size_t needed = bytes + (size_t(1) << 30);
  if (free_bytes >= needed) return {};
  return "needs " + std::to_string(needed >> 20) + " MiB of free device memory, the GPU has " +
         std::to_string(free_bytes >> 20) + " MiB free";
}

bool prefill_compiled() {
  const auto dims = dispatch::compiled_prefill_head_dims();
  return std::find(dims.begin(), dims.end(), kHeadDim) != dims.end() && dispatch::prefill_dtype_compiled(kDType);
}

// The prefill families this GPU runs for bf16 hd128 (Hopper first, where it runs).
std::vector<AttentionPath> prefill_families() {
  const DeviceInfo info = device_info();
  std::vector<AttentionPath> paths;
  for (AttentionPath path : {AttentionPath::kHopper, AttentionPath::kPortable}) {
    if (dispatch::choose_prefill(path, info.cc_major, info.cc_minor, kDType, kHeadDim).ok) paths.push_back(path);
  }
  return paths;
}

// Launch errors, then completion: a fault (a wrapped offset reading outside the tensors) stops
// the test here with CUDA's message.
void finish(const std::string& what) {
  const cudaError_t launch = cudaGetLastError();
  if (launch != cudaSuccess) throw std::runtime_error(what + ": launch: " + cudaGetErrorString(launch));
  const cudaError_t done = cudaDeviceSynchronize();
  if (done != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(done));
}

void zero_fill(const DeviceBuffer& b) {
  if (cudaMemset(b.get(), 0, b.bytes()) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    throw std::runtime_error("cudaMemset of the large tensor failed");
  }
}

// Copies `count` 16-bit elements to element `at` of a device buffer.
void copy_in(const DeviceBuffer& dst, int64_t at, const uint16_t* src, int64_t count) {
  if ((at + count) * 2 > static_cast<int64_t>(dst.bytes())) throw std::runtime_error("copy_in past the buffer");
  const cudaError_t e = cudaMemcpy(static_cast<char*>(dst.get()) + at * 2, src, size_t(count) * 2,
                                   cudaMemcpyHostToDevice);
  if (e != cudaSuccess) throw std::runtime_error(std::string("copy_in: ") + cudaGetErrorString(e));
}

class PinnedBuffer {  // page-locked host memory, freed on scope exit
 public:
  explicit PinnedBuffer(size_t bytes) {
    if (cudaMallocHost(&ptr_, bytes) != cudaSuccess) throw std::runtime_error("cudaMallocHost failed");
  }
  ~PinnedBuffer() { cudaFreeHost(ptr_); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint16_t* data() const { return static_cast<uint16_t*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

// ---- The reference over rows the host keeps --------------------------------------------------------
// A request's K / V rows from position `first` to kv_len - 1 ([rows, kv_heads, head_dim]); the keys
// before `first` are masked for every query row of the request.
struct StoredRows {
  int64_t kv_len = 0;
  int64_t first = 0;
  std::vector<uint16_t> k_bits, v_bits;
  std::vector<float> k, v;  // the exact values of the bits
  const uint16_t* bits_at(bool keys, int64_t pos) const {
    return (keys ? k_bits : v_bits).data() + (pos - first) * kTokenElems;
  }
};

StoredRows stored_rows(int64_t kv_len, int64_t first, std::mt19937& rng) {
  StoredRows s;
  s.kv_len = kv_len;
  s.first = first;
  const size_t n = size_t((kv_len - first) * kTokenElems);
  s.k = random_16bit(n, kDType, rng, s.k_bits);
  s.v = random_16bit(n, kDType, rng, s.v_bits);
  return s;
}

// The reference's view of the batch: only the stored rows exist; asking for any other key is a bug
// in the test (its mask and the stored ranges disagree), not a result.
class SparseKV final : public ref::KVSource {
 public:
  std::vector<StoredRows> requests;

  int batch_size() const override { return static_cast<int>(requests.size()); }
  int64_t kv_len(int r) const override { return requests[size_t(r)].kv_len; }
  const float* key(int r, int64_t pos, int h) const override { return at(r, pos, h, true); }
  const float* value(int r, int64_t pos, int h) const override { return at(r, pos, h, false); }

 private:
  const float* at(int r, int64_t pos, int h, bool keys) const {
    const StoredRows& s = requests[size_t(r)];
    if (pos < s.first || pos >= s.kv_len) {
      throw std::logic_error("the reference reads key " + std::to_string(pos) + " of request " + std::to_string(r) +
                             ", which the test did not store (rows " + std::to_string(s.first) + ".." +
                             std::to_string(s.kv_len - 1) + ")");
    }
    return (keys ? s.k : s.v).data() + ((pos - s.first) * kKvHeads + h) * kHeadDim;
  }
};

Expected reference(const SparseKV& kv, const HostRows& q, const std::vector<int32_t>& qo_indptr, int num_qo_heads,
                   bool causal, int window_left) {
  ref::AttentionParams p;
  p.num_qo_heads = num_qo_heads;
  p.num_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.causal = causal;
  p.window_left = window_left;
  Expected e;
  std::vector<double> o_naive, lse_naive;
  ref::attention(q.dense.data(), qo_indptr, kv, p, e.o, e.lse);
  ref::attention_naive_lowp(q.dense.data(), qo_indptr, kv, p, /*bf16 mantissa bits=*/7, o_naive, lse_naive);
  e.o_naive_err = max_finite_diff(o_naive, e.o);
  e.lse_naive_err = max_finite_diff(lse_naive, e.lse);
  return e;
}

// Floors: 1e-4 for O; for LSE 1e-4 in decode (test_decode.cpp), 2e-4 in prefill (test_prefill_paged.cpp).
void check_against(const Outputs& got, const Expected& want, double lse_floor, const std::string& what) {
  EXPECT_EQ(got.stray, 0u) << what << ": elements outside the o / lse views were written";
  expect_within_rule(got.o, want.o, want.o_naive_err, 1e-4, what + " o");
  expect_within_rule(got.lse, want.lse, want.lse_naive_err, lse_floor, what + " lse");
}

// ---- Queries and outputs ---------------------------------------------------------------------------
struct QueryBatch {
  std::vector<int32_t> qo_indptr;
  HostRows q;
  DeviceBuffer dq, d_qo_indptr, o, lse;

  QueryBatch(const std::vector<int>& qo_len, int num_qo_heads, std::mt19937& rng)
      : qo_indptr(indptr_of(qo_len)),
        q(random_rows(qo_indptr.back(), num_qo_heads, kHeadDim, /*pad=*/0, kDType, rng, 2.f)),
        dq(size_t(q.rows * q.row_stride) * 2), d_qo_indptr(qo_indptr.size() * 4),
        o(size_t(q.rows * q.row_stride) * 2), lse(size_t(q.rows * q.heads) * 4) {
    dq.upload(q.bits);
    d_qo_indptr.upload(qo_indptr);
  }
  TensorView q_view() const { return TensorView::contiguous(dq.get(), kDType, {q.rows, q.heads, q.dim}); }
  TensorView o_view() const { return TensorView::contiguous(o.get(), kDType, {q.rows, q.heads, q.dim}); }
  TensorView lse_view() const { return TensorView::contiguous(lse.get(), DType::kFP32, {q.rows, q.heads}); }
  TensorView qo_indptr_view() const {
    return TensorView::contiguous(d_qo_indptr.get(), DType::kInt32, {int64_t(qo_indptr.size())});
  }
  void poison() {
    o.poison();
    lse.poison();
  }
  Outputs outputs() const { return fetch(o, lse, {q.rows, q.heads, q.dim, q.row_stride, kDType}); }
};

// ---- The paged cache --------------------------------------------------------------------------------
// Four requests whose pages lie where 32-bit offsets break:
//   0: a low page (2), then pages past the mark (kMarkPage + 4096, kMarkPage + 1); 41 tokens.
//   1: the last four pages of the cache, shuffled, ending on the very last one; 55 tokens.
//   2: the two pages below the mark and the first page past it; 33 tokens: slot 15 of page
//      kMarkPage - 1 ends at element 2^31 - 1, slot 0 of page kMarkPage starts at element 2^31.
//   3: 250 pages drawn at random past the mark; 3997 tokens (long enough for decode to split it).
// n_new: the rows AppendPagedKVPastTheMark writes at the end of each request (request 2's two
// straddle the mark; request 1's land in the cache's last page).
struct PagedBatch {
  std::vector<std::vector<int32_t>> pages;  // each request's page ids, in sequence order
  std::vector<int> n_new{3, 1, 2, 5};
  SparseKV kv;                              // every row of every request
  std::vector<int32_t> indptr{0}, indices, last_page_len;
};

PagedBatch paged_batch(std::mt19937& rng) {
  PagedBatch b;
  const int32_t mark = static_cast<int32_t>(kMarkPage), last = static_cast<int32_t>(kNumPages - 1);
  std::vector<int32_t> pool;
  for (int32_t p = mark + 2; p < last - 3; ++p) {
    if (p != mark + 4096) pool.push_back(p);
  }
  std::shuffle(pool.begin(), pool.end(), rng);
  pool.resize(250);
  b.pages = {{2, mark + 4096, mark + 1}, {last - 3, last - 1, last - 2, last}, {mark - 2, mark - 1, mark}, pool};
  const std::vector<int64_t> kv_len = {41, 55, 33, 249 * kPageSize + 13};
  for (size_t r = 0; r < b.pages.size(); ++r) {
    const int64_t n = static_cast<int64_t>(b.pages[r].size());
    const int64_t tail = kv_len[r] - (n - 1) * kPageSize;
    if (tail < 1 || tail > kPageSize) throw std::logic_error("a request's kv_len does not fit its pages");
    b.indices.insert(b.indices.end(), b.pages[r].begin(), b.pages[r].end());
    b.indptr.push_back(static_cast<int32_t>(b.indices.size()));
    b.last_page_len.push_back(static_cast<int32_t>(tail));
    b.kv.requests.push_back(stored_rows(kv_len[r], 0, rng));
  }
  return b;
}

// The batch's page tensors (kNumPages pages each) and page table on the device.
struct LargePagedCache : PagedBatch {
  DeviceBuffer k, v, d_indptr, d_indices, d_last;

  explicit LargePagedCache(std::mt19937& rng)
      : PagedBatch(paged_batch(rng)), k(size_t(kNumPages * kPageElems) * 2), v(size_t(kNumPages * kPageElems) * 2),
        d_indptr(indptr.size() * 4), d_indices(indices.size() * 4), d_last(last_page_len.size() * 4) {
    d_indptr.upload(indptr);
    d_indices.upload(indices);
    d_last.upload(last_page_len);
  }

  int batch() const { return static_cast<int>(pages.size()); }
  int64_t kv_len(int r) const { return kv.requests[size_t(r)].kv_len; }

  // Page `index` of request r as the device should hold it when the request's first `upto`
  // tokens are in the cache: those slots from the stored rows, every other slot NaN.
  std::vector<uint16_t> page_image(int r, int64_t index, int64_t upto, bool keys) const {
    std::vector<uint16_t> image(size_t(kPageElems), nan_bits(kDType));
    for (int64_t slot = 0; slot < kPageSize; ++slot) {
      const int64_t pos = index * kPageSize + slot;
      if (pos < std::min(upto, kv_len(r))) {
        std::copy_n(kv.requests[size_t(r)].bits_at(keys, pos), kTokenElems, image.begin() + slot * kTokenElems);
      }
    }
    return image;
  }

  // Zeroes both page tensors, then uploads every page of the table with request r's first
  // upto[r] tokens.
  void upload(const std::vector<int64_t>& upto) {
    zero_fill(k);
    zero_fill(v);
    for (int r = 0; r < batch(); ++r) {
      for (size_t i = 0; i < pages[size_t(r)].size(); ++i) {
        const int64_t at = int64_t(pages[size_t(r)][i]) * kPageElems;
        copy_in(k, at, page_image(r, int64_t(i), upto[size_t(r)], true).data(), kPageElems);
        copy_in(v, at, page_image(r, int64_t(i), upto[size_t(r)], false).data(), kPageElems);
      }
    }
  }
  void upload_all() {
    std::vector<int64_t> upto;
    for (int r = 0; r < batch(); ++r) upto.push_back(kv_len(r));
    upload(upto);
  }

  PagedKVCache cache() const {
    PagedKVCache c;
    c.layout = KVLayout::kNHD;
    c.k_pages = TensorView::contiguous(k.get(), kDType, {kNumPages, kPageSize, kKvHeads, kHeadDim});
    c.v_pages = TensorView::contiguous(v.get(), kDType, {kNumPages, kPageSize, kKvHeads, kHeadDim});
    return c;
  }
  PageTable table() const {
    PageTable t;
    t.indptr = TensorView::contiguous(d_indptr.get(), DType::kInt32, {batch() + 1});
    t.indices = TensorView::contiguous(d_indices.get(), DType::kInt32, {int64_t(indices.size())});
    t.last_page_len = TensorView::contiguous(d_last.get(), DType::kInt32, {batch()});
    t.host_indptr = indptr.data();
    t.host_indices = indices.data();
    t.host_last_page_len = last_page_len.data();
    return t;
  }
};

// ---- 1a. append_paged_kv past the mark ----------------------------------------------------------------
// The cache holds every request but its last n_new tokens (their slots NaN); the append writes them
// (11 rows, into pages kMarkPage - 1, kMarkPage, kMarkPage + 1, the last page and one of request
// 3's). Then the whole cache is read back: every page of the table must equal its expected image
// bit for bit, and every other page must still be all zero (a wrapped write lands somewhere else).
TEST(GpuLargeOffsets, AppendPagedKVPastTheMark) {
  TESSERA_REQUIRE_GPU();
  if (const std::string why = memory_shortfall(kPagedBytes); !why.empty()) GTEST_SKIP() << why;
  std::mt19937 rng(31);
  LargePagedCache c(rng);
  std::vector<int64_t> before;
  std::vector<int32_t> append_indptr{0};
  std::vector<uint16_t> k_new, v_new;
  for (int r = 0; r < c.batch(); ++r) {
    before.push_back(c.kv_len(r) - c.n_new[size_t(r)]);
    append_indptr.push_back(append_indptr.back() + c.n_new[size_t(r)]);
    const StoredRows& s = c.kv.requests[size_t(r)];
    k_new.insert(k_new.end(), s.bits_at(true, before.back()), s.bits_at(true, s.kv_len));
    v_new.insert(v_new.end(), s.bits_at(false, before.back()), s.bits_at(false, s.kv_len));
  }
  c.upload(before);
  const int64_t nnz = append_indptr.back();
  DeviceBuffer dk(k_new.size() * 2), dv(v_new.size() * 2), d_append(append_indptr.size() * 4);
  dk.upload(k_new);
  dv.upload(v_new);
  d_append.upload(append_indptr);
  append_paged_kv(c.cache(), c.table(),
                  TensorView::contiguous(d_append.get(), DType::kInt32, {int64_t(append_indptr.size())}),
                  TensorView::contiguous(dk.get(), kDType, {nnz, kKvHeads, kHeadDim}),
                  TensorView::contiguous(dv.get(), kDType, {nnz, kKvHeads, kHeadDim}), nullptr,
                  append_indptr.data());
  finish("append_paged_kv");

  // Which request (and which of its pages) owns each page; -1: none.
  std::vector<int32_t> owner(size_t(kNumPages), -1), owner_index(size_t(kNumPages), 0);
  for (int r = 0; r < c.batch(); ++r) {
    for (size_t i = 0; i < c.pages[size_t(r)].size(); ++i) {
      owner[size_t(c.pages[size_t(r)][i])] = r;
      owner_index[size_t(c.pages[size_t(r)][i])] = static_cast<int32_t>(i);
    }
  }
  constexpr int64_t kChunkPages = 4096;  // 128 MiB of pinned memory per read-back
  PinnedBuffer host(size_t(kChunkPages * kPageElems) * 2);
  const std::vector<uint16_t> zero_page(size_t(kPageElems), 0);
  for (bool keys : {true, false}) {
    const DeviceBuffer& tensor = keys ? c.k : c.v;
    const char* name = keys ? "K" : "V";
    int64_t wrong = 0, first_wrong = -1, dirty = 0, first_dirty = -1;
    for (int64_t p0 = 0; p0 < kNumPages; p0 += kChunkPages) {
      const int64_t n = std::min(kChunkPages, kNumPages - p0);
      ASSERT_EQ(cudaMemcpy(host.data(), static_cast<const char*>(tensor.get()) + p0 * kPageElems * 2,
                           size_t(n * kPageElems) * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (int64_t p = p0; p < p0 + n; ++p) {
        const uint16_t* got = host.data() + (p - p0) * kPageElems;
        const int32_t r = owner[size_t(p)];
        if (r >= 0) {
          const std::vector<uint16_t> want = c.page_image(r, owner_index[size_t(p)], c.kv_len(r), keys);
          if (std::memcmp(got, want.data(), size_t(kPageElems) * 2) != 0 && wrong++ == 0) first_wrong = p;
        } else if (std::memcmp(got, zero_page.data(), size_t(kPageElems) * 2) != 0 && dirty++ == 0) {
          first_dirty = p;
        }
      }
    }
    EXPECT_EQ(wrong, 0) << name << ": " << wrong << " pages of the table differ from the expected cache (first: page "
                        << first_wrong << ", element " << first_wrong * kPageElems << "; the mark is page "
                        << kMarkPage << ")";
    EXPECT_EQ(dirty, 0) << name << ": " << dirty << " pages outside the table were written (first: page "
                        << first_dirty << ")";
  }
}

// ---- 1b. BatchDecoder past the mark -------------------------------------------------------------------
// qo_len 1, 1, 3, 1 (request 2's three rows causal over the pages around the mark), GQA groups 1
// and 4; the planner's own plan (which may split request 3), batch_invariant (its fixed chunks) and,
// where the GPU holds it, the one-CTA-per-SM shape.
TEST(GpuLargeOffsets, DecodePastTheMark) {
  TESSERA_REQUIRE_GPU();
  if (!dispatch::decode_compiled(kDType, kHeadDim)) GTEST_SKIP() << "bf16 hd128 decode is not compiled in this build";
  if (const std::string why = memory_shortfall(kPagedBytes); !why.empty()) GTEST_SKIP() << why;
  std::mt19937 rng(32);
  LargePagedCache c(rng);
  c.upload_all();
  const std::vector<int> qo_len = {1, 1, 3, 1};
  struct Variant {
    const char* name;
    bool batch_invariant;
    int ctas_per_sm;
  };
  const Variant variants[] = {{"planner's plan", false, 0}, {"batch_invariant", true, 0}, {"one CTA per SM", false, 1}};
  for (int group : {1, 4}) {
    const int num_qo_heads = kKvHeads * group;
    QueryBatch qb(qo_len, num_qo_heads, rng);
    const Expected want = reference(c.kv, qb.q, qb.qo_indptr, num_qo_heads, /*causal=*/true, -1);
    for (const Variant& variant : variants) {
      if (variant.ctas_per_sm == 1 && !dispatch::decode_one_cta_per_sm_fits(kHeadDim)) continue;
      const std::string what = "decode group " + std::to_string(group) + " " + variant.name;
      SCOPED_TRACE(what);
      DecodeConfig cfg;
      cfg.num_qo_heads = num_qo_heads;
      cfg.num_kv_heads = kKvHeads;
      cfg.head_dim = kHeadDim;
      cfg.page_size = kPageSize;
      cfg.dtype = kDType;
      cfg.layout = KVLayout::kNHD;
      cfg.max_batch_size = c.batch();
      cfg.max_qo_len = *std::max_element(qo_len.begin(), qo_len.end());
      cfg.causal = true;
      cfg.batch_invariant = variant.batch_invariant;
      cfg.ctas_per_sm = variant.ctas_per_sm;
      DeviceBuffer ws(BatchDecoder::workspace_bytes(cfg));
      BatchDecoder decoder(cfg, ws.get(), ws.bytes());
      decoder.plan(qb.qo_indptr.data(), c.table(), nullptr, kNumPages);
      qb.poison();
      decoder.run(qb.q_view(), c.cache(), c.table(), qb.o_view(), qb.lse_view(), nullptr);
      finish(what);
      const DecodePlanInfo info = decoder.last_plan();
      check_against(qb.outputs(), want, 1e-4,
                    what + " (" + std::to_string(info.num_split_requests) + " split (request, KV head) pairs)");
    }
  }
}

// ---- 1c. Paged prefill past the mark ------------------------------------------------------------------
// qo_len 5, 3, 7, 4, causal, GQA groups 1 and 4, over the same cache: batch_prefill_paged on each
// family this GPU runs, and BatchPrefillPaged (its KV split) on the one-tile grid and, with
// max_batch_size, the fixed grid.
TEST(GpuLargeOffsets, PagedPrefillPastTheMark) {
  TESSERA_REQUIRE_GPU();
  if (!prefill_compiled()) GTEST_SKIP() << "bf16 hd128 prefill is not compiled in this build";
  const std::vector<AttentionPath> families = prefill_families();
  if (families.empty()) GTEST_SKIP() << "no prefill family runs bf16 hd128 on this GPU";
  if (const std::string why = memory_shortfall(kPagedBytes); !why.empty()) GTEST_SKIP() << why;
  std::mt19937 rng(33);
  LargePagedCache c(rng);
  c.upload_all();
  const std::vector<int> qo_len = {5, 3, 7, 4};
  for (int group : {1, 4}) {
    const int num_qo_heads = kKvHeads * group;
    QueryBatch qb(qo_len, num_qo_heads, rng);
    const Expected want = reference(c.kv, qb.q, qb.qo_indptr, num_qo_heads, /*causal=*/true, -1);
    PagedPrefillArgs a;
    a.q = qb.q_view();
    a.qo_indptr = qb.qo_indptr_view();
    a.host_qo_indptr = qb.qo_indptr.data();
    a.cache = c.cache();
    a.table = c.table();
    a.o = qb.o_view();
    a.lse = qb.lse_view();
    a.causal = true;
    for (AttentionPath path : families) {
      a.path = path;
      const std::string family = std::string(attention_path_name(path)) + " group " + std::to_string(group);
      {
        const std::string what = "batch_prefill_paged " + family;
        SCOPED_TRACE(what);
        qb.poison();
        batch_prefill_paged(a, nullptr);
        finish(what);
        check_against(qb.outputs(), want, 2e-4, what);
      }
      for (bool fixed_grid : {false, true}) {
        const std::string what = "BatchPrefillPaged " + family + (fixed_grid ? " max_batch_size" : "");
        SCOPED_TRACE(what);
        PagedPrefillConfig cfg;
        cfg.num_qo_heads = num_qo_heads;
        cfg.head_dim = kHeadDim;
        cfg.page_size = kPageSize;
        cfg.max_q_rows = static_cast<int>(qb.q.rows);
        cfg.path = path;
        cfg.causal = true;
        cfg.max_batch_size = fixed_grid ? c.batch() : 0;
        DeviceBuffer ws(std::max<size_t>(BatchPrefillPaged::workspace_bytes(cfg), 256));
        BatchPrefillPaged prefill(cfg, ws.get(), ws.bytes());
        prefill.plan(qb.qo_indptr.data(), a.table, nullptr, kNumPages);
        qb.poison();
        prefill.run(a, nullptr);
        finish(what);
        const PagedPrefillPlanInfo info = prefill.last_plan();
        check_against(qb.outputs(), want, 2e-4,
                      what + " (kv_splits " + std::to_string(info.kv_splits) +
                          (info.fixed_grid ? ", fixed grid)" : ", one-tile grid)"));
      }
    }
  }
}

// ---- 2. Ragged batch_prefill past the mark --------------------------------------------------------------
// K / V [2228224 rows, 8, 128]; causal with window_left 64, so each request sees only its last
// qo_len + 64 keys and the reference stays cheap:
//   0: 2 rows over kMarkRow + 32 keys: its visible keys straddle the mark (rows 2^21 - 34 .. 2^21 + 31).
//   1: 1 row over the keys up to 300 rows from the end (all past the mark).
//   2: 7 rows over the last 300 keys, down to the tensors' last element.
// GQA groups 1 and 4, on each family this GPU runs.
TEST(GpuLargeOffsets, RaggedPrefillPastTheMark) {
  TESSERA_REQUIRE_GPU();
  if (!prefill_compiled()) GTEST_SKIP() << "bf16 hd128 prefill is not compiled in this build";
  const std::vector<AttentionPath> families = prefill_families();
  if (families.empty()) GTEST_SKIP() << "no prefill family runs bf16 hd128 on this GPU";
  if (const std::string why = memory_shortfall(kRaggedBytes); !why.empty()) GTEST_SKIP() << why;
  std::mt19937 rng(34);
  constexpr int kWindowLeft = 64;
  const std::vector<int> qo_len = {2, 1, 7};
  const std::vector<int32_t> kv_indptr = {0, static_cast<int32_t>(kMarkRow + 32),
                                          static_cast<int32_t>(kRaggedRows - 300), static_cast<int32_t>(kRaggedRows)};
  DeviceBuffer k(size_t(kRaggedRows * kTokenElems) * 2), v(size_t(kRaggedRows * kTokenElems) * 2);
  DeviceBuffer d_kv_indptr(kv_indptr.size() * 4);
  d_kv_indptr.upload(kv_indptr);
  zero_fill(k);
  zero_fill(v);
  SparseKV kv;
  for (size_t r = 0; r < qo_len.size(); ++r) {
    const int64_t kv_len = kv_indptr[r + 1] - kv_indptr[r];
    // Row 0's window starts at kv_len - qo_len - window_left: no row sees a key before it.
    const int64_t first = std::max<int64_t>(0, kv_len - qo_len[r] - kWindowLeft);
    kv.requests.push_back(stored_rows(kv_len, first, rng));
    const StoredRows& s = kv.requests.back();
    const int64_t at = (kv_indptr[r] + first) * kTokenElems;
    copy_in(k, at, s.k_bits.data(), static_cast<int64_t>(s.k_bits.size()));
    copy_in(v, at, s.v_bits.data(), static_cast<int64_t>(s.v_bits.size()));
  }
  for (int group : {1, 4}) {
    const int num_qo_heads = kKvHeads * group;
    QueryBatch qb(qo_len, num_qo_heads, rng);
    const Expected want = reference(kv, qb.q, qb.qo_indptr, num_qo_heads, /*causal=*/true, kWindowLeft);
    PrefillArgs a;
    a.q = qb.q_view();
    a.k = TensorView::contiguous(k.get(), kDType, {kRaggedRows, kKvHeads, kHeadDim});
    a.v = TensorView::contiguous(v.get(), kDType, {kRaggedRows, kKvHeads, kHeadDim});
    a.qo_indptr = qb.qo_indptr_view();
    a.kv_indptr = TensorView::contiguous(d_kv_indptr.get(), DType::kInt32, {int64_t(kv_indptr.size())});
    a.host_qo_indptr = qb.qo_indptr.data();
    a.host_kv_indptr = kv_indptr.data();
    a.o = qb.o_view();
    a.lse = qb.lse_view();
    a.causal = true;
    a.window_left = kWindowLeft;
    for (AttentionPath path : families) {
      a.path = path;
      const std::string what =
          std::string("batch_prefill ") + attention_path_name(path) + " group " + std::to_string(group);
      SCOPED_TRACE(what);
      qb.poison();
      batch_prefill(a, nullptr);
      finish(what);
      check_against(qb.outputs(), want, 2e-4, what);
    }
  }
}

// ---- 3. The largest cache append_paged_kv takes ---------------------------------------------------------
// append_paged_kv runs its kernel's token index in int32 and refuses a cache of 2^31 token slots or
// more (num_pages x page_size), naming k_pages and the limit; one page fewer is accepted. The page
// tensors (2^42 bytes each) are views at made-up addresses that nothing dereferences: validation
// refuses the large one before anything launches, and the other call appends no row, so it
// launches nothing either. The table holds the largest page id of each cache.
TEST(GpuLargeOffsets, AppendRefusesCachesOf2To31TokenSlots) {
  TESSERA_REQUIRE_GPU();
  constexpr int64_t kLimitPages = kMark / kPageSize;  // 2^27 pages of 16 tokens: 2^31 token slots
  auto at = [](uint64_t address) { return reinterpret_cast<void*>(static_cast<uintptr_t>(address)); };
  constexpr uint64_t kTB = uint64_t(1) << 40;  // K at 1 TB, V at 8 TB, the index arrays at 32 TB: disjoint spans
  const std::vector<int32_t> kv_indptr = {0, 1}, last_page_len = {kPageSize}, append_indptr = {0, 0};
  for (int64_t num_pages : {kLimitPages - 1, kLimitPages}) {
    SCOPED_TRACE(std::to_string(num_pages) + " pages");
    const std::vector<int32_t> kv_indices = {static_cast<int32_t>(num_pages - 1)};
    PagedKVCache cache;
    cache.layout = KVLayout::kNHD;
    cache.k_pages = TensorView::contiguous(at(kTB), kDType, {num_pages, kPageSize, kKvHeads, kHeadDim});
    cache.v_pages = TensorView::contiguous(at(8 * kTB), kDType, {num_pages, kPageSize, kKvHeads, kHeadDim});
    PageTable table;
    table.indptr = TensorView::contiguous(at(32 * kTB), DType::kInt32, {2});
    table.indices = TensorView::contiguous(at(32 * kTB + 4096), DType::kInt32, {1});
    table.last_page_len = TensorView::contiguous(at(32 * kTB + 8192), DType::kInt32, {1});
    table.host_indptr = kv_indptr.data();
    table.host_indices = kv_indices.data();
    table.host_last_page_len = last_page_len.data();
    const TensorView append = TensorView::contiguous(at(32 * kTB + 12288), DType::kInt32, {2});
    const TensorView no_rows = TensorView::contiguous(nullptr, kDType, {0, kKvHeads, kHeadDim});
    const auto call = [&] { append_paged_kv(cache, table, append, no_rows, no_rows, nullptr, append_indptr.data()); };
    if (num_pages < kLimitPages) {
      EXPECT_NO_THROW(call());
    } else {
      expect_error(call, {"tessera::append_paged_kv: argument 'k_pages'", "2147483648 token slots", "at most 2^31 - 1"});
    }
  }
}

}  // namespace
}  // namespace tessera::testing
