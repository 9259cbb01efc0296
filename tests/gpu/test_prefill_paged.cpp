// batch_prefill_paged (prefill / extend over a paged KV cache) on the GPU against the fp64 CPU
// reference, with the tolerance rule of docs/CONVENTIONS.md: max error <= 2 x (max error of the
// naive computation in the kernel's precision) + a floor (1e-4 for O, 2e-4 for LSE, as the ragged
// prefill tests).
//
// As in test_decode.cpp, pages are handed out in shuffled order and every cache element no request
// owns (the tail of a last page, spare pages, stride padding) holds NaN, as does the row padding of
// q: a loader that reads outside the page table, or lets a masked slot leak into P.V, fails loudly.
// Outputs are poisoned before each run; every element of o / lse must be written and nothing
// around them.
#include <gmock/gmock.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "dispatch/prefill_dispatch.h"
#include "gpu/gpu_test_util.h"
#include "gpu/paged_kv_util.h"
#include "kernels/attention/sm90/tensor_map_sm90.h"
#include "tessera_instantiations.h"
#include "reference/attention_ref.h"
#include "tessera/attention.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

// ---- What this build compiled -------------------------------------------------------------------
// A narrowed build (TESSERA_HEAD_DIMS / TESSERA_DTYPES) tests only what it compiled.
bool prefill_compiled(int head_dim, DType dtype) {
  const auto dims = dispatch::compiled_prefill_head_dims();
  return std::find(dims.begin(), dims.end(), head_dim) != dims.end() &&
         dispatch::prefill_dtype_compiled(dtype);
}

// hd128 / bf16 when compiled (the common serving shape), else the first compiled pair.
void pick_compiled(int& head_dim, DType& dtype) {
  for (int hd : {128, 64, 256}) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      if (prefill_compiled(hd, dt)) {
        head_dim = hd;
        dtype = dt;
        return;
      }
    }
  }
}

// Why the Hopper family cannot run (dtype, head_dim) here ("" when it can).
std::string hopper_unavailable(DType dtype, int head_dim) {
  const DeviceInfo info = device_info();
  const auto c = dispatch::choose_prefill(AttentionPath::kHopper, info.cc_major, info.cc_minor, dtype, head_dim);
  return c.ok ? std::string() : c.why_not;
}

// Where two runs differ (for the failure message of a bitwise comparison).
std::string first_difference(const Outputs& a, const Outputs& b) {
  size_t o_diff = 0, lse_diff = 0, first_o = 0, first_lse = 0;
  for (size_t i = 0; i < std::min(a.o_raw.size(), b.o_raw.size()); ++i) {
    if (a.o_raw[i] != b.o_raw[i] && o_diff++ == 0) first_o = i;
  }
  for (size_t i = 0; i < std::min(a.lse_raw.size(), b.lse_raw.size()); ++i) {
    if (std::memcmp(&a.lse_raw[i], &b.lse_raw[i], 4) != 0 && lse_diff++ == 0) first_lse = i;
  }
  std::string s = std::to_string(o_diff) + " o elements differ";
  if (o_diff) s += " (first at buffer element " + std::to_string(first_o) + ")";
  s += ", " + std::to_string(lse_diff) + " lse elements differ";
  if (lse_diff) {
    s += " (first at " + std::to_string(first_lse) + ": " + std::to_string(a.lse_raw[first_lse]) +
         " vs " + std::to_string(b.lse_raw[first_lse]) + ")";
  }
  return s;
}

void check_against(const Outputs& got, const Expected& want, const std::string& what) {
  EXPECT_EQ(got.stray, 0u) << what << ": elements outside the o / lse views were written";
  expect_within_rule(got.o, want.o, want.o_naive_err, 1e-4, what + " o");
  expect_within_rule(got.lse, want.lse, want.lse_naive_err, 2e-4, what + " lse");
}

// ---- One paged prefill -------------------------------------------------------------------------------
struct PagedCase {
  KVGeometry kv;
  int num_qo_heads = 8;
  std::vector<int> qo_len, kv_len;
  bool causal = true;
  int window_left = -1;
  float soft_cap = 0.f;
  float scale = 0.f;
  int64_t q_pad = 0;  // extra elements per row of q and o (strided rows)
  AttentionPath path = AttentionPath::kAuto;
};

std::string list_of(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string describe(const PagedCase& c) {
  std::string s = std::string(dtype_name(c.kv.dtype)) + " hd" + std::to_string(c.kv.head_dim) + " " +
                  kv_layout_name(c.kv.layout) + " page " + std::to_string(c.kv.page_size) + " heads " +
                  std::to_string(c.num_qo_heads) + "/" + std::to_string(c.kv.num_kv_heads) +
                  " qo_len " + list_of(c.qo_len) + " kv_len " + list_of(c.kv_len);
  s += c.causal ? " causal" : " non-causal";
  if (c.window_left >= 0) s += " window " + std::to_string(c.window_left);
  if (c.soft_cap > 0) s += " soft_cap " + std::to_string(c.soft_cap);
  if (c.scale > 0) s += " scale " + std::to_string(c.scale);
  if (c.kv.head_pad || c.kv.k_page_pad || c.kv.v_page_pad) s += " strided pages";
  if (c.q_pad) s += " strided rows";
  if (c.path != AttentionPath::kAuto) s += std::string(" path ") + attention_path_name(c.path);
  return s;
}

// A case's inputs on the host and the device, with poisoned output buffers.
struct PagedProblem {
  PagedCase c;
  std::mt19937 rng;
  HostPagedKV kv;
  std::vector<int32_t> qo_indptr;
  HostRows q;
  DevicePagedKV dkv;
  DeviceBuffer dq, d_qo_indptr, o, lse;

  PagedProblem(const PagedCase& pc, uint32_t seed)
      : c(pc), rng(seed), kv(make_paged_kv(pc.kv, pc.kv_len, 0, rng)), qo_indptr(indptr_of(pc.qo_len)),
        q(random_rows(qo_indptr.back(), pc.num_qo_heads, pc.kv.head_dim, pc.q_pad, pc.kv.dtype, rng, 2.f)),
        dkv(kv, kv.batch()),
        dq(size_t(std::max<int64_t>(q.rows * q.row_stride, 8)) * 2),
        d_qo_indptr(qo_indptr.size() * 4),
        o(size_t(std::max<int64_t>(q.rows * q.row_stride, 8)) * 2),
        lse(size_t(std::max<int64_t>(q.rows * q.heads, 2)) * 4) {
    if (pc.qo_len.size() != pc.kv_len.size()) throw std::runtime_error("qo_len / kv_len sizes differ");
    dkv.upload(kv);
    dq.upload(q.bits);
    d_qo_indptr.upload(qo_indptr);
  }

  DType dtype() const { return c.kv.dtype; }
  TensorView q_view() const {
    return TensorView::strided(dq.get(), dtype(), {q.rows, q.heads, q.dim}, {q.row_stride, q.dim, 1});
  }
  TensorView o_view() const {
    return TensorView::strided(o.get(), dtype(), {q.rows, q.heads, q.dim}, {q.row_stride, q.dim, 1});
  }
  TensorView lse_view() const {
    return TensorView::contiguous(lse.get(), DType::kFP32, {q.rows, q.heads});
  }
  TensorView qo_indptr_view() const {
    return TensorView::contiguous(d_qo_indptr.get(), DType::kInt32, {int64_t(qo_indptr.size())});
  }
  OutputShape out_shape() const { return {q.rows, q.heads, q.dim, q.row_stride, dtype()}; }

  PagedPrefillArgs args() const {
    PagedPrefillArgs a;
    a.q = q_view();
    a.qo_indptr = qo_indptr_view();
    a.host_qo_indptr = qo_indptr.data();
    a.cache = dkv.cache(kv);
    a.table = dkv.table(kv);
    a.o = o_view();
    a.lse = lse_view();
    a.causal = c.causal;
    a.window_left = c.window_left;
    a.scale = c.scale;
    a.soft_cap = c.soft_cap;
    a.path = c.path;
    return a;
  }

  void poison() {
    o.poison();
    lse.poison();
  }
  // Poisons o / lse, runs, waits and reads them back.
  Outputs run_and_fetch(const PagedPrefillArgs& a, cudaStream_t stream = nullptr) {
    poison();
    batch_prefill_paged(a, stream);
    const cudaError_t launch = cudaGetLastError();
    if (launch != cudaSuccess) throw std::runtime_error(std::string("launch: ") + cudaGetErrorString(launch));
    const cudaError_t done = cudaStreamSynchronize(stream);
    if (done != cudaSuccess) throw std::runtime_error(std::string("run: ") + cudaGetErrorString(done));
    return fetch(o, lse, out_shape());
  }
  Outputs run_and_fetch(cudaStream_t stream = nullptr) { return run_and_fetch(args(), stream); }

  Expected expected() const {
    ref::AttentionParams p;
    p.num_qo_heads = c.num_qo_heads;
    p.num_kv_heads = c.kv.num_kv_heads;
    p.head_dim = c.kv.head_dim;
    p.causal = c.causal;
    p.window_left = c.window_left;
    p.scale = c.scale;
    p.soft_cap = c.soft_cap;
    const ref::PagedKV source = kv.reference();
    Expected e;
    std::vector<double> o_naive, lse_naive;
    ref::attention(q.dense.data(), qo_indptr, source, p, e.o, e.lse);
    ref::attention_naive_lowp(q.dense.data(), qo_indptr, source, p, dtype() == DType::kBF16 ? 7 : 10,
                              o_naive, lse_naive);
    e.o_naive_err = max_finite_diff(o_naive, e.o);
    e.lse_naive_err = max_finite_diff(lse_naive, e.lse);
    return e;
  }
};

// A BatchPrefillPaged config for a case's heads, head dim and pages, holding q_rows query rows
// (the callers set the rest).
PagedPrefillConfig prefill_config(const PagedCase& c, int64_t q_rows) {
  PagedPrefillConfig cfg;
  cfg.num_qo_heads = c.num_qo_heads;
  cfg.head_dim = c.kv.head_dim;
  cfg.page_size = c.kv.page_size;
  cfg.max_q_rows = static_cast<int>(q_rows);
  return cfg;
}

// Runs a case and checks O and LSE against the fp64 reference.
void run_case(const PagedCase& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  if (!prefill_compiled(c.kv.head_dim, c.kv.dtype)) {
    GTEST_SKIP() << describe(c) << ": not compiled in this build";
  }
  PagedProblem p(c, seed);
  check_against(p.run_and_fetch(), p.expected(), "paged prefill");
}

// ---- 1. Page sizes and layouts ---------------------------------------------------------------------
// bf16 hd128, GQA 8 / 2, causal. The batch mixes chunked prefill (qo_len < kv_len), a full prefill
// (qo_len == kv_len), a request without KV (its rows give 0 and LSE -inf), one without queries this
// step, one with more queries than keys (its leading rows see nothing under the causal mask), and
// KV lengths that end mid-page for every page size.
TEST(GpuPrefillPaged, PageSizesAndLayouts) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 1;
  std::vector<std::pair<KVLayout, int>> shapes;
  for (int page_size : {1, 16, 64}) {
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) shapes.emplace_back(layout, page_size);
  }
  shapes.emplace_back(KVLayout::kHND, 256);  // a page larger than a whole KV tile, once
  for (auto [layout, page_size] : shapes) {
    PagedCase c;
    c.kv.layout = layout;
    c.kv.page_size = page_size;
    c.kv.dtype = DType::kBF16;
    c.kv.head_dim = 128;
    c.num_qo_heads = 8;
    c.kv.num_kv_heads = 2;
    c.causal = true;
    c.qo_len = {97, 54, 7, 0, 130, 40, 1};
    c.kv_len = {577, 54, 0, 33, 1000, 16, 97};
    run_case(c, seed++);
  }
}

// ---- 1b. The Hopper family over pages --------------------------------------------------------------
// sm_90: every page size. Multiples of 8 by TMA (boxes of gcd(page_size, KV tile) rows: 8-row
// boxes, pages of 48 and 80 with 16-row boxes, pages larger than a tile); the others (1, 3, 7, 12,
// 100) gathered by the producer warpgroup with cp.async (GatheredKVSm90). Both layouts, every compiled
// head dim and dtype, causal and windowed, GQA, strided pages; the batch of PageSizesAndLayouts
// (chunked prefill, empty requests, qo_len > kv_len).
TEST(GpuPrefillPaged, HopperFamilyPageSizesAndLayouts) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 50;
  int tested = 0, rotation = 0;
  for (int head_dim : {64, 128, 256}) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      if (!prefill_compiled(head_dim, dtype) || !hopper_unavailable(dtype, head_dim).empty()) continue;
      for (int page_size : {8, 16, 48, 64, 80, 128, 256, 1, 3, 7, 12, 100}) {
        const int r = rotation++;
        PagedCase c;
        c.path = AttentionPath::kHopper;
        c.kv.dtype = dtype;
        c.kv.head_dim = head_dim;
        c.kv.layout = r % 2 == 0 ? KVLayout::kNHD : KVLayout::kHND;
        c.kv.page_size = page_size;
        c.num_qo_heads = r % 3 == 0 ? 8 : 4;
        c.kv.num_kv_heads = r % 3 == 2 ? 4 : r % 3 == 1 ? 1 : 2;
        c.causal = r % 4 != 3;
        c.window_left = r % 5 == 4 ? 90 : -1;
        c.soft_cap = r % 7 == 5 ? 20.f : 0.f;
        if (r % 3 == 1) {  // strided pages, different for K and V
          c.kv.head_pad = 8;
          c.kv.k_page_pad = 24;
          c.kv.v_page_pad = 40;
          c.q_pad = 24;
        }
        c.qo_len = {97, 54, 7, 0, 130, 40, 1};
        c.kv_len = {577, 54, 0, 33, 1000, 16, 97};
        run_case(c, seed++);
        ++tested;
      }
    }
  }
  if (tested == 0) GTEST_SKIP() << hopper_unavailable(DType::kBF16, 128);
}

// ---- 2. Head dims, dtypes, masks and logit variants, GQA groups --------------------------------------
TEST(GpuPrefillPaged, HeadDimsDtypesAndVariants) {
  TESSERA_REQUIRE_GPU();
  struct Variant {
    const char* name;
    bool causal;
    int window_left;
    float soft_cap, scale;
  };
  const Variant variants[] = {
      {"none", false, -1, 0.f, 0.f},
      {"causal", true, -1, 0.f, 0.f},
      {"causal window", true, 37, 0.f, 0.f},
      {"window without causal", false, 37, 0.f, 0.f},
      {"soft_cap with scale 1", true, -1, 30.f, 1.f},  // logits of tens: the cap bites
      {"custom scale", false, -1, 0.f, 0.05f},
  };
  const std::pair<int, int> groups[] = {{4, 4}, {8, 2}, {8, 1}};  // GQA groups 1, 4, 8
  uint32_t seed = 100;
  int rotation = 0;
  for (int head_dim : {64, 128, 256}) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      if (!prefill_compiled(head_dim, dtype)) continue;
      // Every (head_dim, dtype) sees every variant and every group; the pairing rotates.
      for (size_t v = 0; v < std::size(variants); ++v) {
        const auto [qo_heads, kv_heads] = groups[(v + size_t(rotation)) % std::size(groups)];
        SCOPED_TRACE(variants[v].name);
        PagedCase c;
        c.kv.dtype = dtype;
        c.kv.head_dim = head_dim;
        c.kv.layout = dtype == DType::kBF16 ? KVLayout::kNHD : KVLayout::kHND;
        c.kv.page_size = dtype == DType::kBF16 ? 16 : 32;
        c.num_qo_heads = qo_heads;
        c.kv.num_kv_heads = kv_heads;
        c.causal = variants[v].causal;
        c.window_left = variants[v].window_left;
        c.soft_cap = variants[v].soft_cap;
        c.scale = variants[v].scale;
        c.qo_len = {33, 64, 1, 20};
        c.kv_len = {300, 64, 130, 0};
        run_case(c, seed++);
      }
      ++rotation;
    }
  }
}

// ---- 2b. The compact tile shape -------------------------------------------------------------------
// GPUs with 99 KB of shared memory per block (sm_86, sm_89) run hd256 paged prefill with the compact
// tile shape too; the limit is imposed on this GPU to run it, over pages of 1, 16 and 64 tokens.
TEST(GpuPrefillPaged, CompactTileShapeForLessSharedMemory) {
  TESSERA_REQUIRE_GPU();
  const SharedMemoryLimit limit(99 * 1024);  // sm_86 / sm_89
  uint32_t seed = 150;
  for (int page_size : {1, 16, 64}) {
    PagedCase c;
    c.kv.dtype = prefill_compiled(256, DType::kBF16) ? DType::kBF16 : DType::kFP16;
    c.kv.head_dim = 256;
    c.kv.layout = page_size == 16 ? KVLayout::kNHD : KVLayout::kHND;
    c.kv.page_size = page_size;
    c.num_qo_heads = 8;
    c.kv.num_kv_heads = 2;
    c.qo_len = {97, 1, 40};
    c.kv_len = {577, 40, 300};
    c.causal = page_size != 1;
    c.window_left = page_size == 64 ? 70 : -1;
    c.soft_cap = page_size == 64 ? 5.f : 0.f;
    run_case(c, seed++);
  }
}

// ---- 3. Paged == ragged ------------------------------------------------------------------------------
// The same tokens laid out ragged ([total_kv, heads, head_dim], batch_prefill) and paged (shuffled
// pages, NaN everywhere no request owns, batch_prefill_paged) give bitwise identical O and LSE.
// That is the design, on each family: both run the same kernel template with the same tile shape,
// the same launch grid, the same launch parameters (scale, window collapse) and the same math;
// only the loader that fills the K/V shared-memory tiles differs, and both loaders zero-fill V rows
// past kv_len (the logits of K rows past it are overwritten by the mask). So
// the shared-memory tiles, hence every fp operation and its order, are identical. (If this ever
// fails while the reference comparison passes, the paths have diverged in something other than
// addressing, e.g. a different tile config for the paged instantiation.)
TEST(GpuPrefillPaged, PagedEqualsRagged) {
  TESSERA_REQUIRE_GPU();
  struct Shape {
    KVLayout layout;
    int page_size, head_dim;
    bool causal;
    int window_left;
    float soft_cap;
  };
  const Shape shapes[] = {
      {KVLayout::kNHD, 1, 128, true, -1, 0.f},
      {KVLayout::kHND, 16, 128, false, -1, 0.f},
      {KVLayout::kNHD, 64, 64, true, 37, 0.f},
      {KVLayout::kHND, 48, 256, true, -1, 30.f},  // a page size that is not a power of two
      {KVLayout::kNHD, 7, 128, false, 100, 0.f},
  };
  uint32_t seed = 200;
  for (const Shape& s : shapes)
  for (AttentionPath path : {AttentionPath::kPortable, AttentionPath::kHopper}) {
    PagedCase c;
    c.path = path;
    c.kv.layout = s.layout;
    c.kv.page_size = s.page_size;
    c.kv.head_dim = s.head_dim;
    c.kv.dtype = DType::kBF16;
    if (!prefill_compiled(c.kv.head_dim, c.kv.dtype)) c.kv.dtype = DType::kFP16;
    c.num_qo_heads = 8;
    c.kv.num_kv_heads = 2;
    c.causal = s.causal;
    c.window_left = s.window_left;
    c.soft_cap = s.soft_cap;
    c.scale = s.soft_cap > 0 ? 1.f : 0.f;
    c.qo_len = {97, 54, 5, 0, 40};
    c.kv_len = {577, 54, 0, 33, 16};
    SCOPED_TRACE(describe(c));
    if (!prefill_compiled(c.kv.head_dim, c.kv.dtype)) continue;
    if (path == AttentionPath::kHopper && !hopper_unavailable(c.kv.dtype, s.head_dim).empty()) continue;
    PagedProblem p(c, seed++);
    const Outputs paged = p.run_and_fetch();
    check_against(paged, p.expected(), "paged");

    // The same K/V rows, ragged and contiguous.
    const HostPagedKV& kv = p.kv;
    const int heads = c.kv.num_kv_heads, hd = c.kv.head_dim;
    const std::vector<int32_t> kv_indptr = indptr_of(c.kv_len);
    const int64_t total_kv = kv_indptr.back();
    std::vector<uint16_t> k_rows(size_t(std::max<int64_t>(total_kv * heads * hd, 8)));
    std::vector<uint16_t> v_rows(k_rows.size());
    for (int r = 0; r < kv.batch(); ++r) {
      for (int64_t pos = 0; pos < c.kv_len[r]; ++pos) {
        for (int h = 0; h < heads; ++h) {
          const size_t dst = size_t(((kv_indptr[r] + pos) * heads + h) * hd);
          std::copy_n(kv.k_bits.begin() + kv.offset(kv.k_strides, r, pos, h), hd, k_rows.begin() + dst);
          std::copy_n(kv.v_bits.begin() + kv.offset(kv.v_strides, r, pos, h), hd, v_rows.begin() + dst);
        }
      }
    }
    DeviceBuffer dk(k_rows.size() * 2), dv(v_rows.size() * 2), d_kv_indptr(kv_indptr.size() * 4);
    dk.upload(k_rows);
    dv.upload(v_rows);
    d_kv_indptr.upload(kv_indptr);
    PrefillArgs a;
    a.q = p.q_view();
    a.k = TensorView::contiguous(dk.get(), c.kv.dtype, {total_kv, heads, hd});
    a.v = TensorView::contiguous(dv.get(), c.kv.dtype, {total_kv, heads, hd});
    a.qo_indptr = p.qo_indptr_view();
    a.kv_indptr = TensorView::contiguous(d_kv_indptr.get(), DType::kInt32, {int64_t(kv_indptr.size())});
    a.host_qo_indptr = p.qo_indptr.data();
    a.host_kv_indptr = kv_indptr.data();
    a.o = p.o_view();
    a.lse = p.lse_view();
    a.causal = c.causal;
    a.window_left = c.window_left;
    a.scale = c.scale;
    a.soft_cap = c.soft_cap;
    // The family the paged run took, so that the two are the same kernel and must agree bit for bit.
    a.path = path;
    p.poison();
    batch_prefill(a, nullptr);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    const Outputs ragged = fetch(p.o, p.lse, p.out_shape());
    EXPECT_TRUE(bitwise_equal(paged, ragged))
        << "paged and ragged prefill differ: " << first_difference(paged, ragged);
  }
}

// ---- 4. Strided pages and rows -------------------------------------------------------------------------
TEST(GpuPrefillPaged, StridedPagesAndRows) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 300;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      for (int page_size : {1, 16}) {
        PagedCase c;
        pick_compiled(c.kv.head_dim, c.kv.dtype);
        c.kv.dtype = dtype;
        if (!prefill_compiled(c.kv.head_dim, dtype)) continue;
        c.kv.layout = layout;
        c.kv.page_size = page_size;
        c.kv.head_pad = 8;     // head / slot strides larger than head_dim
        c.kv.k_page_pad = 24;  // page strides larger than a page, and different for K and V
        c.kv.v_page_pad = 40;
        c.q_pad = 24;          // q / o row stride larger than num_qo_heads x head_dim
        c.num_qo_heads = 8;
        c.kv.num_kv_heads = 2;
        c.causal = true;
        c.qo_len = {1, 54, 97, 70};
        c.kv_len = {1, 54, 300, 700};
        run_case(c, seed++);
      }
    }
  }
}

// ---- 5. Determinism ---------------------------------------------------------------------------------
TEST(GpuPrefillPaged, RepeatBitwise) {
  TESSERA_REQUIRE_GPU();
  PagedCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.kv.page_size = 16;
  c.causal = true;
  c.qo_len = {300, 97, 1};
  c.kv_len = {1000, 577, 33};
  SCOPED_TRACE(describe(c));
  PagedProblem p(c, 400);
  const Outputs first = p.run_and_fetch();
  check_against(first, p.expected(), "first run");
  const Outputs second = p.run_and_fetch();
  EXPECT_TRUE(bitwise_equal(first, second)) << "second run differs: " << first_difference(first, second);
  Stream stream;
  const Outputs other_stream = p.run_and_fetch(stream);
  EXPECT_TRUE(bitwise_equal(first, other_stream))
      << "run on another stream differs: " << first_difference(first, other_stream);

  // lse is optional: without it O is the same and the lse buffer is left alone.
  PagedPrefillArgs no_lse = p.args();
  no_lse.lse = TensorView{};
  const Outputs without = p.run_and_fetch(no_lse);
  EXPECT_TRUE(without.o_raw == first.o_raw) << "O differs when lse is not requested";
  EXPECT_TRUE(std::all_of(without.lse_raw.begin(), without.lse_raw.end(), is_poison))
      << "lse was written although it was not requested";
}

// ---- 6. Bad input ------------------------------------------------------------------------------------
// ---- BatchPrefillPaged: the KV split ------------------------------------------------------------------
// Chunked prefill that under-fills the GPU (a few query tiles over long histories) runs split
// into key runs whose partial states are merged; results against the reference, bitwise repeatable,
// and the same as the unsplit batch_prefill_paged within the tolerance rule. Mixed batches (a
// prefill chunk beside decode-like requests of 1 token, a request without keys) in one plan.
TEST(GpuPrefillPagedSplit, ChunkedPrefillOverLongHistories) {
  TESSERA_REQUIRE_GPU();
  struct Shape {
    std::vector<int> qo_len, kv_len;
    int kv_heads, qo_heads;
    bool causal;
    bool packed_only;  // under-fills only as packed GQA tiles (num_kv_heads given)
  };
  // Every shape has fewer query tiles than the H200 has SMs on either family, so plan() splits
  // (the CPU reference bounds the sizes: its fp64 and low-precision passes run on one core).
  const std::vector<Shape> shapes = {
      {{128}, {16384}, 2, 8, true, false},                       // one chunk of 128 over 16K
      {{97, 300}, {9000, 5000}, 2, 8, true, false},              // awkward lengths
      {{512, 1, 1, 0, 3}, {6000, 4096, 1, 700, 0}, 1, 8, true, false},  // mixed, with empty ones
      {{128, 128}, {9000, 9000}, 2, 8, false, false},            // non-causal
      // Decode-like rows (1-4 tokens), 32 query / 8 KV heads: 288 one-tile-per-head tiles fill two
      // waves unpacked, 72 packed ones (one per KV head) half of one, so the split is judged on
      // the packed tiles.
      {{1, 4, 1, 2, 1, 3, 1, 4, 1}, {8000, 7001, 8192, 6500, 8100, 7777, 8000, 5000, 8191}, 8, 32, true, true},
  };
  uint32_t seed = 900;
  for (const Shape& sh : shapes) {
    PagedCase c;
    pick_compiled(c.kv.head_dim, c.kv.dtype);
    c.kv.page_size = 16;
    c.kv.num_kv_heads = sh.kv_heads;
    c.num_qo_heads = sh.qo_heads;
    c.qo_len = sh.qo_len;
    c.kv_len = sh.kv_len;
    c.causal = sh.causal;
    SCOPED_TRACE(describe(c));
    PagedProblem p(c, seed++);
    const Expected expected = p.expected();
    const bool hopper_here = hopper_unavailable(c.kv.dtype, c.kv.head_dim).empty();
    for (const bool packed : {false, true}) {
      SCOPED_TRACE(packed ? "packed GQA (num_kv_heads given)" : "unpacked");
      PagedPrefillConfig cfg = prefill_config(c, p.q.rows);
      if (packed) cfg.num_kv_heads = c.kv.num_kv_heads;
      DeviceBuffer ws(std::max<size_t>(BatchPrefillPaged::workspace_bytes(cfg), 256));
      BatchPrefillPaged prefill(cfg, ws.get(), ws.bytes());
      const PagedPrefillArgs a = p.args();
      prefill.plan(a.host_qo_indptr, a.table);
      auto run = [&] {
        p.poison();
        prefill.run(a, nullptr);
        if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("run() failed on the GPU");
        return fetch(p.o, p.lse, p.out_shape());
      };
      const Outputs split = run();
      if (!sh.packed_only || (packed && hopper_here)) {
        EXPECT_GT(prefill.last_plan().kv_splits, 1) << "the case under-fills the GPU and should be split";
        EXPECT_EQ(prefill.last_plan().path, hopper_here ? AttentionPath::kHopper : AttentionPath::kPortable)
            << "the family that reads the pages splits";
      }
      check_against(split, expected, "split paged prefill");
      EXPECT_TRUE(bitwise_equal(split, run())) << "a second run() of the same plan differs";
    }
  }
}

// Every split count on both families, forced (dispatch::force_prefill_kv_splits): 1, a few, and
// more runs than a query tile has KV tiles (empty runs write the empty state, which the merge
// must ignore); a mixed batch with a request without keys and one without queries; the compiled
// head dims (hd256's 80-key tiles, hd64's 192-row ones) over NHD and HND pages of 1 to 64 tokens
// (1 and 7 gathered by the Hopper producer warpgroup).
TEST(GpuPrefillPagedSplit, ForcedSplitCountsOnBothFamilies) {
  TESSERA_REQUIRE_GPU();
  struct Geometry {
    int head_dim;  // 0: the default compiled one
    KVLayout layout;
    int page_size;
  };
  struct ForcedSplits {
    ~ForcedSplits() { dispatch::force_prefill_kv_splits(0); }
  } lift;
  for (const Geometry& geo : {Geometry{0, KVLayout::kNHD, 16}, Geometry{256, KVLayout::kHND, 16},
                              Geometry{64, KVLayout::kNHD, 64}, Geometry{128, KVLayout::kHND, 8},
                              Geometry{128, KVLayout::kNHD, 1}, Geometry{256, KVLayout::kHND, 7}}) {  // gathered
    PagedCase c;
    pick_compiled(c.kv.head_dim, c.kv.dtype);
    if (geo.head_dim != 0) {
      if (!prefill_compiled(geo.head_dim, c.kv.dtype)) continue;
      c.kv.head_dim = geo.head_dim;
    }
    c.kv.layout = geo.layout;
    c.kv.page_size = geo.page_size;
    c.kv.num_kv_heads = 2;
    c.num_qo_heads = 8;
    c.qo_len = {300, 1, 0, 64, 2};
    c.kv_len = {3000, 2100, 700, 0, 130};
    PagedProblem p(c, 77);
    const Expected want_causal = p.expected();
    p.c.causal = false;
    const Expected want_full = p.expected();
    for (AttentionPath path : {AttentionPath::kHopper, AttentionPath::kPortable}) {
      if (path == AttentionPath::kHopper && !hopper_unavailable(c.kv.dtype, c.kv.head_dim).empty()) continue;
      PagedPrefillConfig cfg = prefill_config(c, p.q.rows);
      cfg.max_kv_splits = 64;
      cfg.path = path;
      DeviceBuffer ws(std::max<size_t>(BatchPrefillPaged::workspace_bytes(cfg), 256));
      BatchPrefillPaged prefill(cfg, ws.get(), ws.bytes());
      for (bool causal : {true, false}) {
        for (int splits : {1, 2, 5, 40}) {
          SCOPED_TRACE(describe(c) + " " + attention_path_name(path) + (causal ? " causal" : " non-causal") +
                       " splits " + std::to_string(splits));
          dispatch::force_prefill_kv_splits(splits);
          PagedPrefillArgs a = p.args();
          a.causal = causal;
          prefill.plan(a.host_qo_indptr, a.table);
          EXPECT_EQ(prefill.last_plan().kv_splits, splits);
          p.poison();
          prefill.run(a, nullptr);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          check_against(fetch(p.o, p.lse, p.out_shape()), causal ? want_causal : want_full, "forced split");
        }
      }
    }
  }
}

// A step whose query tiles fill the GPU is not split; where the Hopper family reads the pages it
// then runs there, with the Hopper config too (plan() only: no reference needed).
TEST(GpuPrefillPagedSplit, FullStepsAreNotSplit) {
  TESSERA_REQUIRE_GPU();
  const int batch = 16, qo = 128, pages_per_request = 4096 / 16;
  std::vector<int32_t> qo_indptr(batch + 1), kv_indptr(batch + 1), indices(batch * pages_per_request), last(batch, 16);
  for (int r = 0; r <= batch; ++r) {
    qo_indptr[r] = r * qo;
    kv_indptr[r] = r * pages_per_request;
  }
  std::iota(indices.begin(), indices.end(), 0);
  DeviceBuffer d_indptr(kv_indptr.size() * 4), d_indices(indices.size() * 4), d_last(last.size() * 4);
  PageTable table;
  table.indptr = TensorView::contiguous(d_indptr.get(), DType::kInt32, {batch + 1});
  table.indices = TensorView::contiguous(d_indices.get(), DType::kInt32, {int64_t(indices.size())});
  table.last_page_len = TensorView::contiguous(d_last.get(), DType::kInt32, {batch});
  table.host_indptr = kv_indptr.data();
  table.host_indices = indices.data();
  table.host_last_page_len = last.data();
  int head_dim = 128;
  DType dtype = DType::kBF16;
  pick_compiled(head_dim, dtype);
  for (AttentionPath path : {AttentionPath::kAuto, AttentionPath::kHopper, AttentionPath::kPortable}) {
    PagedPrefillConfig cfg;
    cfg.num_qo_heads = 32;
    cfg.head_dim = head_dim;
    cfg.page_size = 16;
    cfg.max_q_rows = batch * qo;
    cfg.path = path;
    DeviceBuffer ws(std::max<size_t>(BatchPrefillPaged::workspace_bytes(cfg), 256));
    BatchPrefillPaged prefill(cfg, ws.get(), ws.bytes());
    prefill.plan(qo_indptr.data(), table);
    SCOPED_TRACE(attention_path_name(path));
    const bool hopper_here = hopper_unavailable(dtype, head_dim).empty();
    if (path == AttentionPath::kHopper || (path == AttentionPath::kAuto && hopper_here)) {
      EXPECT_EQ(prefill.last_plan().kv_splits, 1) << "512 Hopper query tiles fill 132 SMs";
      EXPECT_EQ(prefill.last_plan().path, path);
    }
  }
}

// ---- The fixed grid in eager mode (max_batch_size without cuda_graph) ----------------------------
// Steps whose requests differ run on the fixed grid over plan()'s schedule, uniform ones on the
// one-tile grid; either way the results match the reference and, on the Hopper family, are bitwise
// those of a config without max_batch_size (the same tiles, splits and merge). Both families, TMA-boxed (16) and
// gathered (7) pages, a split step and an unsplit one.
TEST(GpuPrefillPagedFixedGrid, EagerStepsMatchTheOneTileGrid) {
  TESSERA_REQUIRE_GPU();
  struct Step {
    std::vector<int> qo_len, kv_len;
    bool uniform;
  };
  const std::vector<Step> steps = {
      {{300, 97, 1, 0, 5}, {3000, 97, 4096, 10, 5}, false},  // mixed, empty requests
      {{128, 1}, {12000, 900}, false},                         // under-fills: split
      {{64, 64, 64}, {700, 700, 700}, true},                   // uniform: the one-tile grid
      {{512, 1, 1, 1}, {520, 2000, 64, 3000}, false},          // a prefill beside decodes
  };
  for (const int page_size : {16, 7}) {
    for (const Step& step : steps) {
      PagedCase c;
      pick_compiled(c.kv.head_dim, c.kv.dtype);
      c.kv.layout = page_size == 7 ? KVLayout::kHND : KVLayout::kNHD;
      c.kv.page_size = page_size;
      c.kv.num_kv_heads = 2;
      c.num_qo_heads = 8;
      c.causal = true;
      c.qo_len = step.qo_len;
      c.kv_len = step.kv_len;
      PagedProblem p(c, 900 + static_cast<uint32_t>(step.qo_len.size()) + page_size);
      const Expected want = p.expected();
      for (AttentionPath path : {AttentionPath::kHopper, AttentionPath::kPortable}) {
        if (path == AttentionPath::kHopper && !hopper_unavailable(c.kv.dtype, c.kv.head_dim).empty()) continue;
        SCOPED_TRACE(describe(c) + " " + attention_path_name(path));
        // bounded 2: max_batch_size and num_kv_heads given: every grid of the object packs the
        // group's 4 query heads into each tile (Hopper only); 0 and 1 never pack.
        Outputs results[3];
        int splits[3] = {0, 0, 0};
        for (int bounded = 0; bounded < (path == AttentionPath::kHopper ? 3 : 2); ++bounded) {
          PagedPrefillConfig cfg = prefill_config(c, p.q.rows);
          cfg.path = path;
          cfg.causal = true;
          cfg.max_batch_size = bounded ? static_cast<int>(c.qo_len.size()) : 0;
          if (bounded == 2) cfg.num_kv_heads = c.kv.num_kv_heads;
          DeviceBuffer ws(std::max<size_t>(BatchPrefillPaged::workspace_bytes(cfg), 256));
          BatchPrefillPaged prefill(cfg, ws.get(), ws.bytes());
          const PagedPrefillArgs a = p.args();
          prefill.plan(a.host_qo_indptr, a.table);
          EXPECT_EQ(prefill.last_plan().fixed_grid, bounded && !step.uniform);
          EXPECT_EQ(prefill.last_plan().gqa_pack, bounded == 2 ? 2 : 0);
          splits[bounded] = prefill.last_plan().kv_splits;
          p.poison();
          prefill.run(a, nullptr);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          results[bounded] = fetch(p.o, p.lse, p.out_shape());
          const char* what[3] = {"unbounded config", "max_batch_size config", "packed GQA config"};
          check_against(results[bounded], want, what[bounded]);
        }
        // The Hopper family's fixed-grid scheduler runs the same consumer code as its one-tile
        // grid: bitwise equal. The portable step kernel is the one-tile body in a loop, compiled
        // into another kernel: its results differ in the last bit of a few elements (measured: up to
        // 23 of 90K o elements, lse by 1e-6), both within the tolerance rule checked above.
        if (path == AttentionPath::kHopper) {
          EXPECT_TRUE(bitwise_equal(results[0], results[1]))
              << "the fixed grid and the one-tile grid differ: " << first_difference(results[0], results[1]);
          // Packed or not, a row's arithmetic is the same when its keys are not split (a split cuts
          // each tile's own KV range, which a packed tile of fewer tokens may have shorter: other
          // runs, other rounding, both within the rule checked above).
          if (splits[0] == 1 && splits[2] == 1) {
            EXPECT_TRUE(bitwise_equal(results[0], results[2]))
                << "the packed and unpacked tiles differ: " << first_difference(results[0], results[2]);
          }
        }
      }
    }
  }
}

// ---- Batch invariance (config.batch_invariant) -------------------------------------------------------
// One request (a 200-row chunk over 3000 or 513 keys: several query tiles, several KV tiles) run alone and
// inside batches that would each get another split count, grid and schedule from the normal plan
// (short decode-like requests; a 20K-key request; forty small ones; the request last instead of
// first): its o and lse rows must be bitwise the same in every batch, for split counts 1 and 4, on
// the one-tile grid and (max_batch_size) the eager fixed grid, on each family the GPU runs (Hopper
// also with packed GQA: num_kv_heads given); and within the tolerance rule of the reference alone.
TEST(GpuPrefillPagedBatchInvariant, RequestBitsDoNotDependOnTheBatch) {
  TESSERA_REQUIRE_GPU();
  // (200, 513): packed tiles of 32 tokens see fewer KV tiles than the unpacked 128-row one, so
  // their split runs differ: an object must pack every step alike.
  for (const std::pair<int, int> request : {std::pair<int, int>{200, 3000}, std::pair<int, int>{200, 513}}) {
    const int r_qo = request.first, r_kv = request.second;
    SCOPED_TRACE("request of " + std::to_string(r_qo) + " rows over " + std::to_string(r_kv) + " keys");
    struct Batch {
      std::vector<int> qo_len, kv_len;
      int at;  // the request's place
    };
    std::vector<Batch> batches = {{{r_qo}, {r_kv}, 0},
                                  {{r_qo, 1, 1, 1, 1, 1, 1}, {r_kv, 100, 900, 2000, 64, 3000, 17}, 0},
                                  {{r_qo, 128}, {r_kv, 20000}, 0},
                                  {{1, 1, 64, r_qo}, {500, 4000, 64, r_kv}, 3}};
    Batch many{{r_qo}, {r_kv}, 0};
    for (int i = 0; i < 40; ++i) {
      many.qo_len.push_back(1 + i % 5);
      many.kv_len.push_back(10 + 97 * i);
    }
    batches.push_back(many);
    PagedCase base;
    pick_compiled(base.kv.head_dim, base.kv.dtype);
    base.kv.num_kv_heads = 2;
    base.num_qo_heads = 8;
    base.causal = true;
    // The request's own q and K / V, copied into its place in every batch.
    PagedCase alone_case = base;
    alone_case.qo_len = {r_qo};
    alone_case.kv_len = {r_kv};
    PagedProblem alone(alone_case, 1234);
    const Expected want = alone.expected();
    std::vector<std::unique_ptr<PagedProblem>> problems;
    for (size_t b = 0; b < batches.size(); ++b) {
      PagedCase c = base;
      c.qo_len = batches[b].qo_len;
      c.kv_len = batches[b].kv_len;
      problems.push_back(std::make_unique<PagedProblem>(c, 4321 + static_cast<uint32_t>(b)));
      PagedProblem& p = *problems.back();
      const int at = batches[b].at;
      for (int64_t pos = 0; pos < r_kv; ++pos) {
        for (int h = 0; h < base.kv.num_kv_heads; ++h) {
          std::copy_n(alone.kv.k_bits.begin() + alone.kv.offset(alone.kv.k_strides, 0, pos, h), base.kv.head_dim,
                      p.kv.k_bits.begin() + p.kv.offset(p.kv.k_strides, at, pos, h));
          std::copy_n(alone.kv.v_bits.begin() + alone.kv.offset(alone.kv.v_strides, 0, pos, h), base.kv.head_dim,
                      p.kv.v_bits.begin() + p.kv.offset(p.kv.v_strides, at, pos, h));
        }
      }
      const int64_t row0 = p.qo_indptr[size_t(at)];
      std::copy_n(alone.q.bits.begin(), size_t(r_qo * alone.q.row_stride), p.q.bits.begin() + row0 * p.q.row_stride);
      p.dkv.upload(p.kv);
      p.dq.upload(p.q.bits);
    }
    // The request's o and lse rows of one run.
    auto rows_of = [&](const Outputs& out, const PagedProblem& p, int at) {
      const int64_t row0 = p.qo_indptr[size_t(at)], width = p.q.heads * p.q.dim;
      std::vector<uint32_t> bits;
      for (int64_t i = row0 * width; i < (row0 + r_qo) * width; ++i) {
        uint32_t b;
        std::memcpy(&b, &out.o[size_t(i)], 4);
        bits.push_back(b);
      }
      for (int64_t i = row0 * p.q.heads; i < (row0 + r_qo) * p.q.heads; ++i) {
        uint32_t b;
        std::memcpy(&b, &out.lse[size_t(i)], 4);
        bits.push_back(b);
      }
      return bits;
    };
    for (AttentionPath path : {AttentionPath::kHopper, AttentionPath::kPortable}) {
      if (path == AttentionPath::kHopper && !hopper_unavailable(base.kv.dtype, base.kv.head_dim).empty()) continue;
      for (int splits : {1, 4}) {
        for (int mode = 0; mode < (path == AttentionPath::kHopper ? 4 : 2); ++mode) {
          const bool bounded = mode % 2 == 1, packed = mode >= 2;  // packed: num_kv_heads given
          SCOPED_TRACE(std::string(attention_path_name(path)) + " max_kv_splits " + std::to_string(splits) +
                       (bounded ? " max_batch_size (fixed grid)" : " one-tile grid") + (packed ? " packed GQA" : ""));
          std::vector<uint32_t> first;
          for (size_t b = 0; b < batches.size(); ++b) {
            PagedProblem& p = *problems[b];
            PagedPrefillConfig cfg = prefill_config(base, p.q.rows);
            cfg.max_kv_splits = splits;
            cfg.path = path;
            cfg.causal = true;
            cfg.batch_invariant = true;
            cfg.max_batch_size = bounded ? static_cast<int>(batches[b].qo_len.size()) : 0;
            if (packed) cfg.num_kv_heads = base.kv.num_kv_heads;
            DeviceBuffer ws(std::max<size_t>(BatchPrefillPaged::workspace_bytes(cfg), 256));
            BatchPrefillPaged prefill(cfg, ws.get(), ws.bytes());
            const PagedPrefillArgs a = p.args();
            prefill.plan(a.host_qo_indptr, a.table);
            EXPECT_EQ(prefill.last_plan().kv_splits, splits) << "batch " << b;
            p.poison();
            prefill.run(a, nullptr);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            const Outputs out = fetch(p.o, p.lse, p.out_shape());
            const std::vector<uint32_t> bits = rows_of(out, p, batches[b].at);
            if (b == 0) {
              check_against(out, want, "the request alone");
              first = bits;
            } else {
              EXPECT_TRUE(bits == first) << "batch " << b << ": the request's outputs depend on the batch";
            }
          }
        }
      }
    }
  }
}

// ---- BatchPrefillPaged with cuda_graph ----------------------------------------------------------------
// One run() captured into a CUDA graph with one step, replayed for steps of other compositions:
// other batch sizes, a chunk over a long history (split), prefill chunks beside decode-like
// requests and empty ones, an empty step, a full prefill (unsplit). Each step's inputs are copied
// into the captured buffers (q, the pages, kv_indices), as an engine's append would write them.
// Every replay is checked against the reference, bitwise against an eager run() of the same plan,
// and for rows past the step left untouched; on each family the GPU runs, over TMA-boxed (16) and
// gathered (7) pages.
TEST(GpuPrefillPagedGraph, CapturedRunReplaysAcrossSteps) {
  TESSERA_REQUIRE_GPU();
  struct Step {
    std::vector<int> qo_len, kv_len;
  };
  const std::vector<Step> steps = {
      {{64, 1, 1}, {700, 300, 2000}},                                  // the captured step
      {{128}, {12000}},                                                // under-fills: split
      {{300, 97, 1, 0, 5}, {3000, 97, 4096, 10, 5}},                  // mixed, empty requests
      {{0}, {0}},                                                      // nothing to compute
      {{512, 512, 384}, {512, 600, 384}},                              // prefill
      {{1, 1, 1, 1, 1, 1, 1, 1}, {100, 2000, 3000, 1, 64, 65, 4000, 9}},  // decode-like
      {{64, 1, 1}, {700, 300, 2000}},                                  // the captured step again
  };
  struct Geometry {
    KVLayout layout;
    int page_size;
    int head_dim;      // 0: the default compiled one
    int smem_limit;    // > 0: as a GPU with this much shared memory per block (the compact hd256 tile)
  };
  for (const Geometry geo : {Geometry{KVLayout::kNHD, 16, 0, 0}, Geometry{KVLayout::kHND, 7, 0, 0},
                             Geometry{KVLayout::kNHD, 16, 256, 99 * 1024}}) {
    PagedCase base;
    pick_compiled(base.kv.head_dim, base.kv.dtype);
    if (geo.head_dim != 0) {
      if (!prefill_compiled(geo.head_dim, base.kv.dtype)) continue;
      base.kv.head_dim = geo.head_dim;
    }
    std::unique_ptr<SharedMemoryLimit> limit;
    if (geo.smem_limit > 0) limit = std::make_unique<SharedMemoryLimit>(geo.smem_limit);
    base.kv.layout = geo.layout;
    base.kv.page_size = geo.page_size;
    base.kv.num_kv_heads = 2;
    base.num_qo_heads = 8;
    base.causal = true;
    std::vector<std::unique_ptr<PagedProblem>> problems;
    std::vector<Expected> expected;
    int64_t max_rows = 1, max_entries = 1, max_k = 2, max_v = 2, max_pages = 1;
    int max_batch = 1;
    for (size_t i = 0; i < steps.size(); ++i) {
      PagedCase c = base;
      c.qo_len = steps[i].qo_len;
      c.kv_len = steps[i].kv_len;
      problems.push_back(std::make_unique<PagedProblem>(c, 500 + static_cast<uint32_t>(i)));
      const PagedProblem& p = *problems.back();
      expected.push_back(p.expected());
      max_rows = std::max(max_rows, p.q.rows);
      max_entries = std::max<int64_t>(max_entries, p.kv.indices.size());
      max_pages = std::max(max_pages, p.kv.num_pages);
      max_k = std::max<int64_t>(max_k, p.kv.k_bits.size());
      max_v = std::max<int64_t>(max_v, p.kv.v_bits.size());
      max_batch = std::max(max_batch, static_cast<int>(c.qo_len.size()));
    }
    const PagedProblem& first = *problems[0];
    const int64_t row_stride = first.q.row_stride;
    // The captured buffers, sized for the largest step.
    DeviceBuffer gq(size_t(max_rows * row_stride) * 2), go(size_t(max_rows * row_stride) * 2),
        glse(size_t(max_rows * first.q.heads) * 4), gk(size_t(max_k) * 2), gv(size_t(max_v) * 2),
        gindices(size_t(max_entries) * 4);
    gk.poison();
    gv.poison();
    auto graph_args = [&](const PagedProblem& p) {
      PagedPrefillArgs a = p.args();
      a.q = TensorView::strided(gq.get(), p.dtype(), {max_rows, p.q.heads, p.q.dim}, {row_stride, p.q.dim, 1});
      a.o = TensorView::strided(go.get(), p.dtype(), {max_rows, p.q.heads, p.q.dim}, {row_stride, p.q.dim, 1});
      a.lse = TensorView::contiguous(glse.get(), DType::kFP32, {max_rows, p.q.heads});
      a.cache.k_pages.data = gk.get();
      a.cache.v_pages.data = gv.get();
      a.cache.k_pages.shape[0] = max_pages;
      a.cache.v_pages.shape[0] = max_pages;
      a.table.indices = TensorView::contiguous(gindices.get(), DType::kInt32, {max_entries});
      return a;
    };
    auto load = [&](const PagedProblem& p, cudaStream_t stream) {  // the step's inputs into the captured buffers
      ASSERT_EQ(cudaMemcpyAsync(gq.get(), p.dq.get(), size_t(p.q.rows * row_stride) * 2, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(gk.get(), p.dkv.k.get(), p.kv.k_bits.size() * 2, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(gv.get(), p.dkv.v.get(), p.kv.v_bits.size() * 2, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
      if (!p.kv.indices.empty()) {
        ASSERT_EQ(cudaMemcpyAsync(gindices.get(), p.kv.indices.data(), p.kv.indices.size() * 4, cudaMemcpyHostToDevice,
                                  stream), cudaSuccess);
      }
      ASSERT_EQ(cudaMemsetAsync(go.get(), 0xFF, go.bytes(), stream), cudaSuccess);
      ASSERT_EQ(cudaMemsetAsync(glse.get(), 0xFF, glse.bytes(), stream), cudaSuccess);
    };
    for (AttentionPath path : {AttentionPath::kHopper, AttentionPath::kPortable}) {
      if (path == AttentionPath::kHopper && !hopper_unavailable(base.kv.dtype, base.kv.head_dim).empty()) continue;
      if (path == AttentionPath::kHopper && geo.smem_limit > 0) continue;  // needs more shared memory
      SCOPED_TRACE(describe(base) + " " + attention_path_name(path) + (geo.smem_limit ? " compact tiles" : ""));
      PagedPrefillConfig cfg = prefill_config(base, max_rows);
      cfg.path = path;
      cfg.causal = true;
      cfg.cuda_graph = true;
      cfg.max_batch_size = max_batch;
      // The Hopper family's graph packs each KV head's 4 query heads into a tile.
      if (path == AttentionPath::kHopper) cfg.num_kv_heads = base.kv.num_kv_heads;
      DeviceBuffer ws(BatchPrefillPaged::workspace_bytes(cfg));
      BatchPrefillPaged prefill(cfg, ws.get(), ws.bytes());
      cudaStream_t stream = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
      struct StreamGuard {
        cudaStream_t s;
        ~StreamGuard() { cudaStreamDestroy(s); }
      } stream_guard{stream};

      const PagedPrefillArgs captured = graph_args(first);
      load(first, stream);
      prefill.plan(first.qo_indptr.data(), captured.table, stream, max_pages);
      cudaGraph_t graph = nullptr;
      ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      prefill.run(captured, stream);
      ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      struct GraphGuard {
        cudaGraph_t g;
        cudaGraphExec_t e;
        ~GraphGuard() {
          cudaGraphExecDestroy(e);
          cudaGraphDestroy(g);
        }
      } graph_guard{graph, exec};

      bool saw_split = false, saw_unsplit = false;
      for (size_t i = 0; i < steps.size(); ++i) {
        const PagedProblem& p = *problems[i];
        SCOPED_TRACE("step " + std::to_string(i) + ": qo_len " + list_of(p.c.qo_len) + " kv_len " + list_of(p.c.kv_len));
        const PagedPrefillArgs a = graph_args(p);
        load(p, stream);
        prefill.plan(p.qo_indptr.data(), a.table, stream, max_pages);
        (prefill.last_plan().kv_splits > 1 ? saw_split : saw_unsplit) = true;
        EXPECT_EQ(prefill.last_plan().gqa_pack, path == AttentionPath::kHopper ? 2 : 0);
        ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        const OutputShape shape{p.q.rows, p.q.heads, p.q.dim, row_stride, p.dtype()};
        const Outputs replayed = fetch(go, glse, shape);
        check_against(replayed, expected[i], "graph replay");
        ASSERT_EQ(cudaMemsetAsync(go.get(), 0xFF, go.bytes(), stream), cudaSuccess);
        ASSERT_EQ(cudaMemsetAsync(glse.get(), 0xFF, glse.bytes(), stream), cudaSuccess);
        prefill.run(a, stream);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        const Outputs eager = fetch(go, glse, shape);
        EXPECT_TRUE(bitwise_equal(replayed, eager)) << "replay and eager run() differ: " << first_difference(replayed, eager);
      }
      EXPECT_TRUE(saw_split && saw_unsplit) << "the steps should include split and unsplit plans";

      // run() takes the step plan() saw: its kernels read the planned index arrays.
      {
        const PagedProblem& planned = *problems.back();
        PagedPrefillArgs other = graph_args(planned);
        std::vector<int32_t> last = planned.kv.last_page_len;
        last[0] = last[0] == base.kv.page_size ? 1 : last[0] + 1;  // another valid table
        other.table.host_last_page_len = last.data();
        expect_error([&] { prefill.run(other, stream); },
                     {"BatchPrefillPaged::run", "argument 'kv_last_page_len'", "planned step"});
      }
      // What a replay cannot check, plan() refuses once a run() was captured.
      const PagedProblem& big = *problems[1];
      const PagedPrefillArgs a = graph_args(big);
      expect_error([&] { prefill.plan(big.qo_indptr.data(), a.table, stream); },
                   {"BatchPrefillPaged::plan", "argument 'num_pages'", "once run() was captured"});
      expect_error([&] { prefill.plan(big.qo_indptr.data(), a.table, stream, max_pages + 1); },
                   {"argument 'num_pages'"});
      std::vector<int32_t> too_many(size_t(max_batch) + 2, 0);
      std::vector<int32_t> kv_too_many(size_t(max_batch) + 2, 0), last_too_many(size_t(max_batch) + 1, 1);
      PageTable wide = a.table;
      wide.indptr = TensorView::contiguous(big.dkv.indptr.get(), DType::kInt32, {max_batch + 2});
      wide.host_indptr = kv_too_many.data();
      wide.host_last_page_len = last_too_many.data();
      expect_error([&] { prefill.plan(too_many.data(), wide, stream, max_pages); },
                   {"argument 'kv_indptr'", "max_batch_size"});
    }
  }
}

TEST(GpuPrefillPagedBadInput, ArgumentsAreValidated) {
  TESSERA_REQUIRE_GPU();
  PagedCase c;
  pick_compiled(c.kv.head_dim, c.kv.dtype);
  c.kv.page_size = 16;
  c.qo_len = {5, 20, 3};
  c.kv_len = {20, 40, 0};
  PagedProblem p(c, 500);
  p.poison();
  const DType other = c.kv.dtype == DType::kBF16 ? DType::kFP16 : DType::kBF16;
  const int64_t dim = c.kv.head_dim;
  auto run_with = [&](const std::function<void(PagedPrefillArgs&)>& edit) {
    PagedPrefillArgs a = p.args();
    edit(a);
    batch_prefill_paged(a, nullptr);
  };

  // Page ids outside the cache (host copy: what the launch is checked on).
  for (int32_t bad_id : {int32_t(p.kv.num_pages), -1}) {
    std::vector<int32_t> indices = p.kv.indices;
    indices[1] = bad_id;
    expect_error([&] { run_with([&](PagedPrefillArgs& a) { a.table.host_indices = indices.data(); }); },
                 {"batch_prefill_paged", "'kv_indices'", "page id " + std::to_string(bad_id)});
  }
  // last_page_len 0 or past the page, for a request that has pages.
  for (int32_t bad_last : {0, c.kv.page_size + 1}) {
    std::vector<int32_t> last = p.kv.last_page_len;
    last[1] = bad_last;
    expect_error([&] { run_with([&](PagedPrefillArgs& a) { a.table.host_last_page_len = last.data(); }); },
                 {"'kv_last_page_len'", "value " + std::to_string(bad_last)});
  }
  // The host copies are required.
  expect_error([&] { run_with([](PagedPrefillArgs& a) { a.host_qo_indptr = nullptr; }); },
               {"host_qo_indptr", "required"});
  expect_error([&] { run_with([](PagedPrefillArgs& a) { a.table.host_indptr = nullptr; }); },
               {"'host_indptr'", "kv_indptr", "required"});
  expect_error([&] { run_with([](PagedPrefillArgs& a) { a.table.host_indices = nullptr; }); },
               {"'host_indices'", "kv_indices", "required"});
  expect_error([&] { run_with([](PagedPrefillArgs& a) { a.table.host_last_page_len = nullptr; }); },
               {"'host_last_page_len'", "kv_last_page_len", "required"});
  // Page tensors that do not match q or each other.
  expect_error([&] { run_with([&](PagedPrefillArgs& a) { a.cache.k_pages.dtype = other; }); },
               {"'k_pages'", "dtype"});
  expect_error([&] { run_with([&](PagedPrefillArgs& a) { a.cache.v_pages.dtype = other; }); },
               {"'v_pages'", "dtype"});
  expect_error([&] {
    run_with([&](PagedPrefillArgs& a) {  // both page tensors agree, but not with q
      a.cache.k_pages.shape[3] = dim / 2;
      a.cache.v_pages.shape[3] = dim / 2;
    });
  }, {"'k_pages'", "head_dim"});
  expect_error([&] { run_with([&](PagedPrefillArgs& a) { a.cache.v_pages.shape[3] = dim / 2; }); },
               {"'v_pages'", "shape"});
  expect_error([&] { run_with([&](PagedPrefillArgs& a) { a.cache.v_pages.shape[0] -= 1; }); },
               {"'v_pages'", "shape"});

  // Nothing was written by the calls that threw.
  CUDA_OK(cudaDeviceSynchronize());
  const Outputs untouched = fetch(p.o, p.lse, p.out_shape());
  EXPECT_TRUE(std::all_of(untouched.o_raw.begin(), untouched.o_raw.end(), [](uint16_t b) { return b == kPoison16; }))
      << "a rejected call wrote o";
  EXPECT_TRUE(std::all_of(untouched.lse_raw.begin(), untouched.lse_raw.end(), is_poison))
      << "a rejected call wrote lse";

  // The unedited arguments were valid all along.
  check_against(p.run_and_fetch(), p.expected(), "after rejected calls");
}


// The copy engine takes the grouped maps (one box per page run) for the usual caches, NHD and HND,
// combined K / V pages included; padded heads in NHD fall back to one box per 8 rows, and head_dim
// 64 (one column block) keeps its 4-D maps.
TEST(GpuPrefillPaged, UsualCachesTakeGroupedMaps) {
  TESSERA_REQUIRE_GPU();
  int head_dim = 128;
  DType dtype = DType::kBF16;
  pick_compiled(head_dim, dtype);
#if !TESSERA_INST_HOPPER
  GTEST_SKIP() << "the Hopper family is not built (TESSERA_HOPPER=OFF)";
#else
  if (!hopper_unavailable(dtype, head_dim).empty()) GTEST_SKIP() << hopper_unavailable(dtype, head_dim);
  struct Case {
    KVLayout layout;
    int64_t head_pad, page_gap;  // page_gap: K and V pages interleaved ([pages, 2, ...])
    bool grouped;
  };
  for (const Case& k : {Case{KVLayout::kNHD, 0, 0, true}, Case{KVLayout::kHND, 0, 0, true},
                        Case{KVLayout::kNHD, 0, 1, true}, Case{KVLayout::kHND, 8, 1, true},
                        Case{KVLayout::kNHD, 8, 0, false}}) {
    KVGeometry g;
    g.layout = k.layout;
    g.head_dim = head_dim;
    g.num_kv_heads = 4;
    g.head_pad = k.head_pad;
    const std::array<int64_t, 3> s = page_strides(g, 0);
    const int64_t pages = 6, page_stride = s[0] * (1 + k.page_gap);
    DeviceBuffer buf(size_t(pages * page_stride * 2 + 4096));
    kernels::PrefillParams p;
    p.q = p.k = p.v = buf.get();
    p.q_rows = 64;
    p.num_qo_heads = 4;
    p.q_stride_row = 4 * head_dim;
    p.q_stride_head = head_dim;
    p.num_kv_heads = g.num_kv_heads;
    p.page_size = g.page_size;
    p.num_pages = pages;
    const bool nhd = k.layout == KVLayout::kNHD;
    p.k_stride_page = p.v_stride_page = static_cast<int32_t>(page_stride);
    p.k_stride_token = p.v_stride_token = static_cast<int32_t>(nhd ? s[1] : s[2]);
    p.k_stride_head = p.v_stride_head = nhd ? s[2] : s[1];
    const kernels::sm90::PagedTensorMaps maps = kernels::sm90::paged_tensor_maps(dtype, p, head_dim, 128, 128);
    EXPECT_EQ(maps.grouped, k.grouped && head_dim > 64) << kv_layout_name(k.layout) << " head_pad " << k.head_pad << " page_gap "
                                       << k.page_gap;
    if (maps.grouped) EXPECT_EQ(maps.head_in_blocks, nhd);
  }
#endif
}

// With the device checks compiled in (TESSERA_DEVICE_CHECKS, a Debug build), a device page table
// whose ids leave the cache (the host copies being fine) traps on both families instead of
// reading outside the page tensors. Each case runs in a child process (a trap ends the context).
TEST(GpuDeviceChecks, BrokenPageIdsTrapOnBothFamilies) {
  TESSERA_REQUIRE_GPU();
#if !TESSERA_DEVICE_CHECKS
  GTEST_SKIP() << "the kernels were built without TESSERA_DEVICE_CHECKS (release build)";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (AttentionPath path : {AttentionPath::kPortable, AttentionPath::kHopper}) {
    PagedCase c;
    pick_compiled(c.kv.head_dim, c.kv.dtype);
    if (path == AttentionPath::kHopper && !hopper_unavailable(c.kv.dtype, c.kv.head_dim).empty()) continue;
    SCOPED_TRACE(attention_path_name(path));
    c.qo_len = {64};
    c.kv_len = {300};
    c.path = path;
    EXPECT_EXIT(
        {
          PagedProblem p(c, 5);
          std::vector<int32_t> broken = p.kv.indices;
          broken[3] = static_cast<int32_t>(p.kv.num_pages) + 7;
          p.dkv.indices.upload(broken);
          batch_prefill_paged(p.args(), nullptr);
          const cudaError_t err = cudaDeviceSynchronize();
          std::fprintf(stderr, "cuda: %s\n", cudaGetErrorName(err));
          std::exit(err == cudaSuccess ? 0 : 3);
        },
        ::testing::ExitedWithCode(3), "cuda: cudaError");
  }
#endif
}

}  // namespace
}  // namespace tessera::testing
