// batch_prefill on the GPU against the fp64 CPU reference, with the tolerance rule of docs/CONVENTIONS.md:
// max error <= 2 x (max error of the naive computation in the kernel's precision) + a floor.
#include <gmock/gmock.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "dispatch/kernel_families.h"
#include "dispatch/prefill_dispatch.h"
#include "gpu/gpu_test_util.h"
#include "reference/attention_ref.h"

namespace tessera::testing {
namespace {

struct PrefillCase {
  DType dtype = DType::kBF16;
  int head_dim = 128;
  int num_qo_heads = 4, num_kv_heads = 4;
  std::vector<int> qo_len, kv_len;
  bool causal = false;
  int window_left = -1;
  float soft_cap = 0.f;
  float scale = 0.f;
  int64_t pad = 0;       // extra elements per row of q/k/v/o (strided rows)
  int64_t head_pad = 0;  // extra elements per head of q/k/v (head stride > head_dim)
  AttentionPath path = AttentionPath::kAuto;
  float q_range = 2.f, kv_range = 1.f;  // inputs uniform in [-range, range]
  int64_t nan_key = -1;  // >= 0: this row of k (every head) holds NaN
  // Logits beyond fp32's resolution (|q|, |k| ~ 1e4: logits ~ 1e9, an fp32 ulp ~ 64): no kernel
  // in fp32 can weigh keys whose logits differ by less than that, so instead of the tolerance
  // rule every output must be finite and inside the hull of V (|o| <= max |v|, one 16-bit
  // rounding over), and the LSE within a relative 1e-6 of the reference.
  bool beyond_fp32_resolution = false;
  // Hopper family: each of these schedules in turn (empty: the dispatcher's).
  std::vector<kernels::sm90::PrefillSm90Schedule> schedules;
  // Hopper family: each packed-GQA mode in turn (empty: the dispatcher's), every run bitwise equal
  // to the first (a row's arithmetic does not depend on the rows that share its tile).
  std::vector<dispatch::GqaPack> gqa_packs;
  // Hopper family: each of these K / V tile widths forced in turn (dispatch::
  // force_prefill_sm90_block_n; empty: the dispatcher's choice). One reference serves them all.
  std::vector<int> block_ns;
};

std::string describe(const PrefillCase& c) {
  std::string s = std::string(dtype_name(c.dtype)) + " hd" + std::to_string(c.head_dim) + " heads " +
                  std::to_string(c.num_qo_heads) + "/" + std::to_string(c.num_kv_heads) + " qo_len [";
  for (int x : c.qo_len) s += std::to_string(x) + " ";
  s += "] kv_len [";
  for (int x : c.kv_len) s += std::to_string(x) + " ";
  s += "]";
  if (c.causal) s += " causal";
  if (c.window_left >= 0) s += " window " + std::to_string(c.window_left);
  if (c.soft_cap > 0) s += " softcap " + std::to_string(c.soft_cap);
  if (c.pad) s += " strided rows";
  if (c.head_pad) s += " strided heads";
  return s;
}

struct Ragged16 {  // a ragged [rows, heads, dim] tensor with padded rows and heads, host + device
  int64_t rows, heads, dim, head_stride, row_stride;
  std::vector<uint16_t> bits;
  std::vector<float> dense;  // [rows, heads, dim] exact values, unpadded
  DeviceBuffer dev;
  Ragged16(int64_t r, int64_t h, int64_t d, int64_t pad, int64_t head_pad, DType dtype,
           std::mt19937& rng, float range)
      : rows(r), heads(h), dim(d), head_stride(d + head_pad), row_stride(h * (d + head_pad) + pad),
        dev(std::max<int64_t>(r * (h * (d + head_pad) + pad), 8) * 2) {
    std::vector<uint16_t> packed;
    dense = random_16bit(size_t(r * h * d), dtype, rng, packed, -range, range);
    bits.assign(size_t(std::max<int64_t>(r * row_stride, 8)), to_bits(0.5f, dtype));
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < h; ++j)
        std::copy_n(&packed[(i * h + j) * d], d, &bits[i * row_stride + j * head_stride]);
    dev.upload(bits);
  }
  TensorView view(DType dtype) const {
    return TensorView::strided(dev.get(), dtype, {rows, heads, dim}, {row_stride, head_stride, 1});
  }
};

// The families a case runs on: the one it forces, or (kAuto) every family this GPU runs for it.
std::vector<AttentionPath> paths_to_test(AttentionPath forced, DType dtype, int head_dim) {
  if (forced != AttentionPath::kAuto) return {forced};
  const DeviceInfo info = device_info();
  dispatch::PrefillProblem problem;
  problem.shared_memory_per_block = dispatch::shared_memory_per_block();
  std::vector<AttentionPath> paths;
  for (const auto& family : dispatch::kernel_families()) {
    if (dispatch::choose_prefill(family.path, info.cc_major, info.cc_minor, dtype, head_dim, problem).ok) {
      paths.push_back(family.path);
    }
  }
  return paths;
}

void run_case(const PrefillCase& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  // A narrowed build (TESSERA_HEAD_DIMS / TESSERA_DTYPES) tests only what it compiled.
  const auto dims = dispatch::compiled_prefill_head_dims();
  if (std::find(dims.begin(), dims.end(), c.head_dim) == dims.end() ||
      !dispatch::prefill_dtype_compiled(c.dtype)) {
    GTEST_SKIP() << describe(c) << ": not compiled in this build";
  }
  std::mt19937 rng(seed);
  const int B = static_cast<int>(c.qo_len.size());
  std::vector<int32_t> qo_indptr{0}, kv_indptr{0};
  for (int i = 0; i < B; ++i) {
    qo_indptr.push_back(qo_indptr.back() + c.qo_len[i]);
    kv_indptr.push_back(kv_indptr.back() + c.kv_len[i]);
  }
  const int64_t total_q = qo_indptr.back(), total_kv = kv_indptr.back();
  Ragged16 q(total_q, c.num_qo_heads, c.head_dim, c.pad, c.head_pad, c.dtype, rng, c.q_range);
  Ragged16 k(total_kv, c.num_kv_heads, c.head_dim, c.pad, c.head_pad, c.dtype, rng, c.kv_range);
  Ragged16 v(total_kv, c.num_kv_heads, c.head_dim, c.pad, c.head_pad, c.dtype, rng, c.kv_range);
  if (c.nan_key >= 0) {
    for (int64_t h = 0; h < c.num_kv_heads; ++h) {
      for (int64_t d = 0; d < c.head_dim; ++d) {
        k.dense[size_t((c.nan_key * c.num_kv_heads + h) * c.head_dim + d)] = NAN;
        k.bits[size_t(c.nan_key * k.row_stride + h * k.head_stride + d)] = 0x7FC0;  // a quiet NaN in bf16 and fp16
      }
    }
    k.dev.upload(k.bits);
  }
  const int64_t o_stride = int64_t(c.num_qo_heads) * c.head_dim + c.pad;
  DeviceBuffer o(std::max<int64_t>(total_q * o_stride, 8) * 2), lse(std::max<int64_t>(total_q * c.num_qo_heads, 2) * 4);
  DeviceBuffer d_qo(qo_indptr.size() * 4), d_kv(kv_indptr.size() * 4);
  d_qo.upload(qo_indptr);
  d_kv.upload(kv_indptr);

  PrefillArgs a;
  a.q = q.view(c.dtype);
  a.k = k.view(c.dtype);
  a.v = v.view(c.dtype);
  a.o = TensorView::strided(o.get(), c.dtype, {total_q, c.num_qo_heads, c.head_dim}, {o_stride, c.head_dim, 1});
  a.lse = TensorView::contiguous(lse.get(), DType::kFP32, {total_q, c.num_qo_heads});
  a.qo_indptr = TensorView::contiguous(d_qo.get(), DType::kInt32, {B + 1});
  a.kv_indptr = TensorView::contiguous(d_kv.get(), DType::kInt32, {B + 1});
  a.host_qo_indptr = qo_indptr.data();
  a.host_kv_indptr = kv_indptr.data();
  a.causal = c.causal;
  a.window_left = c.window_left;
  a.soft_cap = c.soft_cap;
  a.scale = c.scale;

  ref::AttentionParams rp;
  rp.num_qo_heads = c.num_qo_heads;
  rp.num_kv_heads = c.num_kv_heads;
  rp.head_dim = c.head_dim;
  rp.causal = c.causal;
  rp.window_left = c.window_left;
  rp.scale = c.scale;
  rp.soft_cap = c.soft_cap;
  ref::RaggedKV kv(k.dense.data(), v.dense.data(), kv_indptr, c.num_kv_heads, c.head_dim);
  std::vector<double> o_ref, lse_ref, o_naive, lse_naive;
  // TESSERA_TEST_PROGRESS=1: what the test is doing, timestamped, before each step that can take
  // long (the CPU references of the largest cases take a minute; a kernel that never returns
  // leaves its run as the last line).
  const bool progress = std::getenv("TESSERA_TEST_PROGRESS") != nullptr;
  const auto progress_line = [&](const std::string& what) {
    static const auto start = std::chrono::steady_clock::now();
    const std::chrono::duration<double> since = std::chrono::steady_clock::now() - start;
    if (progress) std::fprintf(stderr, "%7.1f s %s: %s\n", since.count(), what.c_str(), describe(c).c_str());
  };
  progress_line("reference");
  ref::attention(q.dense.data(), qo_indptr, kv, rp, o_ref, lse_ref);
  ref::attention_naive_lowp(q.dense.data(), qo_indptr, kv, rp, c.dtype == DType::kBF16 ? 7 : 10,
                            o_naive, lse_naive);
  double naive_err = 0;
  for (size_t i = 0; i < o_ref.size(); ++i) {
    if (std::isfinite(o_naive[i] - o_ref[i])) naive_err = std::max(naive_err, std::fabs(o_naive[i] - o_ref[i]));
  }

  // Every family this GPU runs (or the one the case forces), each against the reference; the
  // Hopper family under each schedule the case lists.
  struct Run {
    AttentionPath path;
    const kernels::sm90::PrefillSm90Schedule* schedule;
    dispatch::GqaPack pack;
    int block_n;  // 0: the dispatcher's
  };
  std::vector<Run> runs;
  for (AttentionPath path : paths_to_test(c.path, c.dtype, c.head_dim)) {
    const bool hopper = path == AttentionPath::kHopper;
    std::vector<const kernels::sm90::PrefillSm90Schedule*> schedules{nullptr};
    if (hopper && !c.schedules.empty()) {
      schedules.clear();
      for (const auto& s : c.schedules) schedules.push_back(&s);
    }
    const std::vector<dispatch::GqaPack> packs =
        hopper && !c.gqa_packs.empty() ? c.gqa_packs : std::vector<dispatch::GqaPack>{dispatch::GqaPack::kAuto};
    const std::vector<int> widths = hopper && !c.block_ns.empty() ? c.block_ns : std::vector<int>{0};
    for (int block_n : widths)
      for (const auto* s : schedules)
        for (dispatch::GqaPack pack : packs) runs.push_back({path, s, pack, block_n});
  }
  std::vector<uint16_t> first_packed_o;  // of the width's first run with gqa_packs
  std::vector<float> first_packed_lse;
  int packed_width = -1;
  for (const Run& run : runs) {
    const AttentionPath path = run.path;
    std::string trace = std::string("path ") + attention_path_name(path);
    if (run.schedule != nullptr) {
      trace += " scheduler " + std::to_string(int(run.schedule->scheduler)) + " order " +
               std::to_string(int(run.schedule->order)) + " heavy_first " + std::to_string(run.schedule->heavy_first);
    }
    if (run.block_n != 0) trace += " kv tile " + std::to_string(run.block_n);
    if (run.pack == dispatch::GqaPack::kAlways) trace += " gqa packed";
    if (run.pack == dispatch::GqaPack::kNever) trace += " gqa unpacked";
    SCOPED_TRACE(trace);
    progress_line("run " + trace);
    dispatch::force_prefill_sm90_block_n(run.block_n);
    dispatch::force_prefill_sm90_schedule(run.schedule);
    dispatch::force_prefill_gqa_pack(run.pack);
    a.path = path;
    o.poison();
    lse.poison();
    batch_prefill(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const auto o_bits = o.download<uint16_t>(size_t(total_q * o_stride));
    const auto lse_got = lse.download<float>(size_t(total_q * c.num_qo_heads));
    std::vector<float> o_got(size_t(total_q) * c.num_qo_heads * c.head_dim);
    for (int64_t r = 0; r < total_q; ++r)
      for (int64_t e = 0; e < int64_t(c.num_qo_heads) * c.head_dim; ++e) {
        const uint16_t b = o_bits[r * o_stride + e];
        float& dst = o_got[r * c.num_qo_heads * c.head_dim + e];
        if (b == kPoison16) std::memcpy(&dst, "\xff\xff\xff\xff", 4);
        else dst = from_bits(b, c.dtype);
      }

    // Bitwise identical on a second run, O and LSE.
    batch_prefill(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(o.download<uint16_t>(size_t(total_q * o_stride)) == o_bits) << "second run differs (o)";
    const auto lse_again = lse.download<float>(size_t(total_q * c.num_qo_heads));
    EXPECT_EQ(std::memcmp(lse_again.data(), lse_got.data(), lse_got.size() * 4), 0) << "second run differs (lse)";
    if (run.pack != dispatch::GqaPack::kAuto) {
      if (run.block_n != packed_width) {  // (tile widths sum in other orders: compared per width)
        packed_width = run.block_n;
        first_packed_o = o_bits;
        first_packed_lse = lse_got;
      } else {
        EXPECT_TRUE(o_bits == first_packed_o) << "o differs from the other packing's";
        EXPECT_EQ(std::memcmp(lse_got.data(), first_packed_lse.data(), lse_got.size() * 4), 0)
            << "lse differs from the other packing's";
      }
    }

    if (c.beyond_fp32_resolution) {
      expect_bounded(o_got, c.kv_range * (1.0 + 1.0 / 128), "o");
      double lse_scale = 0;
      for (double x : lse_ref) lse_scale = std::isfinite(x) ? std::max(lse_scale, std::fabs(x)) : lse_scale;
      expect_within_rule(lse_got, lse_ref, 0.0, 1e-6 * lse_scale, "lse");
    } else {
      expect_within_rule(o_got, o_ref, naive_err, 1e-4, "o");
      expect_within_rule(lse_got, lse_ref, 0.0, 2e-4, "lse");
    }
  }
  dispatch::force_prefill_sm90_schedule(nullptr);
  dispatch::force_prefill_gqa_pack(dispatch::GqaPack::kAuto);
  dispatch::force_prefill_sm90_block_n(0);
}

// Numerical edge cases on every family: a NaN in one request's K reaches exactly the rows that see
// that key (the same tile's rows that mask it stay finite; other requests untouched), inputs of
// magnitude 1e4 in bf16 (logits ~1e9) stay finite and exact to the rule, soft-cap over extreme
// logits.
TEST(GpuPrefill, NanIsolationAndExtremeMagnitudes) {
  TESSERA_REQUIRE_GPU();
  PrefillCase c;
  c.head_dim = 128;
  c.num_qo_heads = 4;
  c.num_kv_heads = 2;
  c.qo_len = {40, 97, 7};
  c.kv_len = {300, 577, 7};
  c.causal = true;
  // Request 1's key 560: its rows i see keys j <= i + 480, so rows 80.. see it, rows 0..79 mask it
  // inside the same KV tile.
  c.nan_key = 300 + 560;
  run_case(c, 700);
  c.nan_key = -1;
  c.q_range = 1e4f;
  c.kv_range = 1e4f;
  c.beyond_fp32_resolution = true;
  run_case(c, 701);
  c.beyond_fp32_resolution = false;
  c.causal = false;
  c.soft_cap = 30.f;
  c.q_range = 1e3f;
  c.kv_range = 1e3f;
  run_case(c, 702);
}

TEST(GpuPrefill, HeadDimsDtypesMasks) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 1;
  for (int hd : dispatch::compiled_prefill_head_dims()) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      if (!dispatch::prefill_dtype_compiled(dt)) continue;
      PrefillCase c;
      c.dtype = dt;
      c.head_dim = hd;
      c.qo_len = {97, 1, 130};
      c.kv_len = {97, 577, 200};
      run_case(c, seed++);
      c.causal = true;
      run_case(c, seed++);
      c.window_left = 33;
      run_case(c, seed++);
      c.causal = false;
      run_case(c, seed++);
      c.window_left = -1;
      c.soft_cap = 5.f;
      c.causal = true;
      run_case(c, seed++);
    }
  }
}

TEST(GpuPrefill, AwkwardLengthsAndEmptyRequests) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 100;
  PrefillCase c;
  c.head_dim = 128;
  c.num_qo_heads = 2;
  c.num_kv_heads = 2;
  // qo_len < kv_len, = kv_len, > kv_len (fully masked leading rows when causal), empty q, empty kv.
  c.qo_len = {1, 7, 577, 97, 0, 54, 1000, 5};
  c.kv_len = {7, 7, 577, 54, 9, 0, 1000, 1};
  for (bool causal : {false, true}) {
    c.causal = causal;
    run_case(c, seed++);
  }
}

TEST(GpuPrefill, GqaGroupsStridesAndScale) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 200;
  for (auto [qh, kh] : {std::pair{8, 8}, {8, 2}, {8, 1}, {16, 1}}) {
    PrefillCase c;
    c.head_dim = 64;
    c.num_qo_heads = qh;
    c.num_kv_heads = kh;
    c.qo_len = {65, 128};
    c.kv_len = {300, 128};
    c.causal = true;
    c.pad = 24;
    c.head_pad = qh == 8 ? 8 : 0;
    c.scale = 0.2f;
    run_case(c, seed++);
  }
}

TEST(GpuPrefill, ForcedPaths) {
  TESSERA_REQUIRE_GPU();
  PrefillCase c;
  c.head_dim = dispatch::compiled_prefill_head_dims().front();
  c.dtype = dispatch::prefill_dtype_compiled(DType::kBF16) ? DType::kBF16 : DType::kFP16;
  c.qo_len = {16};
  c.kv_len = {16};
  c.path = AttentionPath::kPortable;
  run_case(c, 300);
  // The Hopper family where this GPU and build run it; elsewhere a clear error, not a fallback.
  c.path = AttentionPath::kHopper;
  const DeviceInfo info = device_info();
  if (dispatch::choose_prefill(AttentionPath::kHopper, info.cc_major, info.cc_minor, c.dtype, c.head_dim).ok) {
    run_case(c, 301);
  } else {
    EXPECT_THROW(run_case(c, 301), Error);
  }
}

// GPUs with 99 KB of shared memory per block (sm_86, sm_89) get the compact hd256 tile shape
// (the default one needs 145 KB); here the limit is imposed on this GPU to run that shape.
TEST(GpuPrefill, CompactTileShapeForLessSharedMemory) {
  TESSERA_REQUIRE_GPU();
  const SharedMemoryLimit limit(99 * 1024);  // sm_86 / sm_89
  uint32_t seed = 400;
  for (int hd : dispatch::compiled_prefill_head_dims()) {
    PrefillCase c;
    c.dtype = dispatch::prefill_dtype_compiled(DType::kBF16) ? DType::kBF16 : DType::kFP16;
    c.head_dim = hd;
    c.num_qo_heads = 8;
    c.num_kv_heads = 2;
    c.qo_len = {97, 1, 300};
    c.kv_len = {577, 40, 300};
    run_case(c, seed++);
    c.causal = true;
    c.window_left = 70;
    c.soft_cap = 5.f;
    run_case(c, seed++);
  }
  dispatch::limit_shared_memory_per_block(2 * 1024);  // nothing fits: a clear error
  {
    PrefillCase c;
    c.head_dim = dispatch::compiled_prefill_head_dims().back();
    c.dtype = dispatch::prefill_dtype_compiled(DType::kBF16) ? DType::kBF16 : DType::kFP16;
    c.qo_len = {16};
    c.kv_len = {16};
    try {
      run_case(c, 410);
      ADD_FAILURE() << "expected an error naming the shared memory the kernel needs";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("shared memory per block"));
    }
  }
}

TEST(GpuPrefill, HeadStridesWindowsAndChunkedPrefill) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 400;
  PrefillCase c;
  c.head_dim = 128;
  c.num_qo_heads = 4;
  c.num_kv_heads = 2;
  c.qo_len = {300, 97, 1};
  c.kv_len = {200, 500, 64};  // qo_len > kv_len, qo_len < kv_len, decode-like
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    c.dtype = dt;
    c.causal = true;
    c.window_left = 50;
    run_case(c, seed++);
    c.window_left = 1 << 30;  // longer than any KV: the same as no window
    run_case(c, seed++);
    c.window_left = 0;         // only the diagonal key
    run_case(c, seed++);
  }
}


// ---- The Hopper family ---------------------------------------------------------------------

// Why the Hopper family cannot run (dtype, head_dim) on this GPU, or "" when it can.
std::string hopper_unavailable(DType dtype, int head_dim) {
  const DeviceInfo info = device_info();
  const auto c = dispatch::choose_prefill(AttentionPath::kHopper, info.cc_major, info.cc_minor, dtype, head_dim);
  return c.ok ? std::string() : c.why_not;
}

// Every scheduler x tile order on ragged batches of more tiles than SMs (persistent CTAs walk
// several tiles, with the K / V rings running across them), causal, windowed and plain.
// q / o / lse may hold more rows than qo_indptr's last entry (fixed-size buffers, as CUDA-graph
// users keep them): the rows past it are neither read nor written, on every family.
TEST(GpuPrefill, RowsPastTheLastRequestAreNotWritten) {
  TESSERA_REQUIRE_GPU();
  const auto dims = dispatch::compiled_prefill_head_dims();
  if (std::find(dims.begin(), dims.end(), 128) == dims.end() || !dispatch::prefill_dtype_compiled(DType::kBF16)) {
    GTEST_SKIP() << "hd128 bf16 not compiled in this build";
  }
  std::mt19937 rng(77);
  const std::vector<int32_t> qo_indptr{0, 97, 300}, kv_indptr{0, 97, 700};
  const int64_t used_rows = 300, rows = used_rows + 37, heads = 8, kv_heads = 2, d = 128;
  Ragged16 q(rows, heads, d, 0, 0, DType::kBF16, rng, 1.f);
  Ragged16 k(kv_indptr.back(), kv_heads, d, 0, 0, DType::kBF16, rng, 1.f);
  Ragged16 v(kv_indptr.back(), kv_heads, d, 0, 0, DType::kBF16, rng, 1.f);
  DeviceBuffer o(rows * heads * d * 2), lse(rows * heads * 4), d_qo(12), d_kv(12);
  d_qo.upload(qo_indptr);
  d_kv.upload(kv_indptr);
  PrefillArgs a;
  a.q = q.view(DType::kBF16);
  a.k = k.view(DType::kBF16);
  a.v = v.view(DType::kBF16);
  a.o = TensorView::contiguous(o.get(), DType::kBF16, {rows, heads, d});
  a.lse = TensorView::contiguous(lse.get(), DType::kFP32, {rows, heads});
  a.qo_indptr = TensorView::contiguous(d_qo.get(), DType::kInt32, {3});
  a.kv_indptr = TensorView::contiguous(d_kv.get(), DType::kInt32, {3});
  a.host_qo_indptr = qo_indptr.data();
  a.host_kv_indptr = kv_indptr.data();
  a.causal = true;
  for (AttentionPath path : paths_to_test(AttentionPath::kAuto, DType::kBF16, 128)) {
    SCOPED_TRACE(std::string("path ") + attention_path_name(path));
    a.path = path;
    o.poison();
    lse.poison();
    batch_prefill(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const auto o_bits = o.download<uint16_t>(size_t(rows * heads * d));
    const auto lse_bits = lse.download<uint32_t>(size_t(rows * heads));
    int64_t written_past = 0, unwritten_before = 0;
    for (int64_t i = 0; i < rows * heads * d; ++i) {
      const bool poisoned = o_bits[i] == kPoison16;
      if (i / (heads * d) >= used_rows) written_past += !poisoned; else unwritten_before += poisoned;
    }
    uint32_t lse_poison;
    std::memset(&lse_poison, 0xff, 4);
    for (int64_t i = used_rows * heads; i < rows * heads; ++i) written_past += lse_bits[i] != lse_poison;
    EXPECT_EQ(written_past, 0) << "rows past qo_indptr's last entry were written";
    EXPECT_EQ(unwritten_before, 0) << "rows of the requests were left unwritten";
  }
}

// Every schedule of the Hopper family: both schedulers x every order (heavy first or not).
std::vector<kernels::sm90::PrefillSm90Schedule> every_hopper_schedule() {
  std::vector<kernels::sm90::PrefillSm90Schedule> schedules;
  for (auto scheduler : {kernels::sm90::SchedulerKind::kStaticPersistent, kernels::sm90::SchedulerKind::kSingleTile}) {
    for (auto order : {kernels::sm90::TileOrder::kQueryTilesInner, kernels::sm90::TileOrder::kQueryTilesOuter}) {
      for (bool heavy_first : {false, true}) {
        kernels::sm90::PrefillSm90Schedule schedule;
        schedule.scheduler = scheduler;
        schedule.order = order;
        schedule.heavy_first = heavy_first;
        schedules.push_back(schedule);
      }
    }
    kernels::sm90::PrefillSm90Schedule mirrored;  // a query tile and its mirror per turn
    mirrored.scheduler = scheduler;
    mirrored.order = kernels::sm90::TileOrder::kMirroredPairs;
    mirrored.run_length = 2;
    schedules.push_back(mirrored);
  }
  return schedules;
}

TEST(GpuPrefillHopper, EverySchedule) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 500;
  const std::vector<kernels::sm90::PrefillSm90Schedule> schedules = every_hopper_schedule();
  for (int hd : dispatch::compiled_prefill_head_dims()) {
    const std::string why = hopper_unavailable(DType::kBF16, hd);
    if (!why.empty()) GTEST_SKIP() << why;
    PrefillCase c;
    c.head_dim = hd;
    c.num_qo_heads = 4;
    c.num_kv_heads = 1;
    // 9 requests x 4 heads x 17 query tiles (2100 rows) = 612 list entries for 132 SMs; qo_len >
    // kv_len (97 over 54), an empty q, KV tiles ending mid-tile.
    c.qo_len = {1, 7, 577, 1000, 300, 0, 129, 97, 2100};
    c.kv_len = {7, 7, 577, 1200, 2100, 9, 128, 54, 2100};
    c.path = AttentionPath::kHopper;
    c.schedules = schedules;
    c.causal = true;
    run_case(c, seed++);
    c.causal = false;
    c.window_left = 100;
    run_case(c, seed++);
  }
}

// One long request (16385 rows: a tile of one row at the end), large logits, fp16, a packed-qkv
// style stride and GQA group 16, all on the Hopper family.
TEST(GpuPrefillHopper, LongRequestsMagnitudesAndStrides) {
  TESSERA_REQUIRE_GPU();
  const std::string why = hopper_unavailable(DType::kBF16, 128);
  if (!why.empty()) GTEST_SKIP() << why;
  PrefillCase c;
  c.path = AttentionPath::kHopper;
  c.num_qo_heads = 1;
  c.num_kv_heads = 1;
  c.qo_len = {16385};
  c.kv_len = {16385};
  c.causal = true;
  c.window_left = 300;
  run_case(c, 600);
  c.qo_len = {333, 1};
  c.kv_len = {2000, 1};
  c.causal = false;
  c.window_left = -1;
  c.q_range = 24.f;  // logits up to ~|24 * 4 * 128| / sqrt(128): a max far from the first tile's
  c.kv_range = 4.f;
  run_case(c, 601);
  c.q_range = 2.f;
  c.kv_range = 1.f;
  c.num_qo_heads = 16;
  c.num_kv_heads = 1;
  c.pad = 40;  // rows of a packed projection: row stride = heads x dim + 40
  c.soft_cap = 20.f;
  c.causal = true;
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    if (!dispatch::prefill_dtype_compiled(dt)) continue;
    c.dtype = dt;
    run_case(c, 602);
  }
}

// hd128's wide K / V tiles (160 keys; 192 with O staged in Q's buffer, or in a V stage in a build
// with TESSERA_SM90_O_IN_V=1), which the dispatcher takes for long rows, forced onto the grids of
// the 128-key tiles' tests: every schedule over awkward lengths (KV lengths below, at and across
// the tile's edges, qo_len > kv_len, empty q, requests without keys, rows past qo_len in a tile's
// O), windows, soft-cap, a 16385-row request with large logits, GQA 16 with packed-projection
// strides, fp16, and packed GQA bitwise equal to unpacked.
TEST(GpuPrefillHopper, WideKvTiles) {
  TESSERA_REQUIRE_GPU();
  const std::string why = hopper_unavailable(DType::kBF16, 128);
  if (!why.empty()) GTEST_SKIP() << why;
  const auto choices = kernels::sm90::prefill_sm90_block_n_choices(128);
  ASSERT_GT(choices.count, 1);
  // Every wide width of the build on each case (one CPU reference for all of them: the references
  // of the 16385-row cases take most of the test's time), with KV lengths at each width's edges.
  const std::vector<int> widths(choices.keys + 1, choices.keys + choices.count);
  uint32_t seed = 900;
  const auto hopper_case = [&] {  // hd128 bf16 on the Hopper family, each wide width
    PrefillCase x;
    x.head_dim = 128;
    x.block_ns = widths;
    x.path = AttentionPath::kHopper;
    return x;
  };
  PrefillCase c = hopper_case();
  c.num_qo_heads = 4;
  c.num_kv_heads = 1;
  c.schedules = every_hopper_schedule();
  c.qo_len = {1, 577, 1000, 300, 0, 97, 2100, 200};
  c.kv_len = {7, 577, 1200, 2100, 9, 54, 2100, 0};
  for (int keys : widths) {
    c.qo_len.insert(c.qo_len.end(), {7, 129, 64});
    c.kv_len.insert(c.kv_len.end(), {keys - 1, keys, 2 * keys + 1});
  }
  c.causal = true;
  run_case(c, seed++);
  c.causal = false;
  c.window_left = 100;
  run_case(c, seed++);
  c.window_left = -1;
  c.soft_cap = 30.f;
  run_case(c, seed++);
  // Several work tiles a CTA of the persistent schedules (~230): many KV tiles, one, and none
  // after one another, so each CTA hands its buffers on from tile to tile.
  c.num_qo_heads = 8;
  c.soft_cap = 0.f;
  c.qo_len = {1000, 450, 0, 2100, 60};
  c.kv_len = {1000, 1200, 50, 2100, 0};
  for (int keys : widths) {
    c.qo_len.push_back(1);
    c.kv_len.push_back(keys + 1);
  }
  run_case(c, seed++);

  PrefillCase l = hopper_case();
  l.num_qo_heads = 1;
  l.num_kv_heads = 1;
  l.qo_len = {16385};
  l.kv_len = {16385};
  l.causal = true;
  run_case(l, seed++);
  l.window_left = 300;  // (causal: non-causal windows are the first cases')
  run_case(l, seed++);
  l.window_left = -1;
  l.causal = false;
  l.qo_len = {333, 1};
  l.kv_len = {4000, 1};
  l.q_range = 24.f;
  l.kv_range = 4.f;
  run_case(l, seed++);
  l.q_range = 2.f;
  l.kv_range = 1.f;
  l.num_qo_heads = 16;
  l.pad = 40;
  l.soft_cap = 20.f;
  l.causal = true;
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    if (!dispatch::prefill_dtype_compiled(dt)) continue;
    l.dtype = dt;
    run_case(l, seed++);
  }

  PrefillCase g = hopper_case();
  g.gqa_packs = {dispatch::GqaPack::kNever, dispatch::GqaPack::kAlways};
  for (auto [qh, kh] : {std::pair{4, 2}, {32, 2}, {64, 1}}) {
    g.num_qo_heads = qh;
    g.num_kv_heads = kh;
    g.qo_len = {1, 7, 97, 0, 300, 3, 257, 1};
    g.kv_len = {1, 300, 54, 5, 700, 3, 257, 1500};
    g.causal = true;
    g.window_left = -1;
    g.pad = 0;
    run_case(g, seed++);
    g.causal = false;
    g.window_left = 150;
    g.pad = 24;
    run_case(g, seed++);
  }
}

// Packed GQA (a tile holds a KV head's query heads, token-major) against the unpacked tiles and
// the reference: groups 2-64, decode-like and awkward lengths, empty requests, qo_len > kv_len,
// causal, windows, soft-cap, strided rows and heads, every head dim, both dtypes, every schedule
// the dispatcher may pick.
TEST(GpuPrefillHopper, PackedGqaEqualsUnpacked) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 700;
  int ran = 0;
  const std::vector<dispatch::GqaPack> packs{dispatch::GqaPack::kNever, dispatch::GqaPack::kAlways};
  for (int hd : dispatch::compiled_prefill_head_dims()) {
    if (!hopper_unavailable(DType::kBF16, hd).empty()) continue;
    for (int group : {2, 16}) {
      PrefillCase c;
      c.head_dim = hd;
      c.path = AttentionPath::kHopper;
      c.gqa_packs = packs;
      c.num_kv_heads = 2;
      c.num_qo_heads = 2 * group;
      ASSERT_GT(dispatch::prefill_gqa_pack_limit(c.num_qo_heads, c.num_kv_heads), 0);  // kAlways packs
      c.qo_len = {1, 7, 97, 0, 300, 3, 257};
      c.kv_len = {1, 300, 54, 5, 700, 3, 257};
      c.causal = true;
      run_case(c, seed++);
      c.causal = false;
      c.window_left = 100;
      c.soft_cap = 30.f;
      c.pad = 24;
      c.head_pad = 8;
      run_case(c, seed++);
      ++ran;
    }
    // 32 and 64 query heads on one KV head (64: the largest group packed; at hd64 a 192-row tile
    // of 3 tokens), decode-like rows; fp16 at hd128.
    for (int group : {32, 64}) {
      for (DType dt : {DType::kBF16, DType::kFP16}) {
        if ((dt == DType::kFP16 && (hd != 128 || group != 64)) || !dispatch::prefill_dtype_compiled(dt) ||
            !hopper_unavailable(dt, hd).empty()) {
          continue;
        }
        PrefillCase c;
        c.dtype = dt;
        c.head_dim = hd;
        c.path = AttentionPath::kHopper;
        c.gqa_packs = packs;
        c.num_qo_heads = group;
        c.num_kv_heads = 1;
        c.qo_len = {1, 1, 5, 130};
        c.kv_len = {1500, 17, 5, 700};
        c.causal = true;
        run_case(c, seed++);
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "the Hopper family runs no compiled head dim here";
}

// On sm_90 the dispatcher picks the Hopper family for ragged prefill.
TEST(GpuPrefillHopper, AutoPicksHopperOnSm90) {
  TESSERA_REQUIRE_GPU();
  const DeviceInfo info = device_info();
  const int hd = dispatch::compiled_prefill_head_dims().front();
  const std::string why = hopper_unavailable(DType::kBF16, hd);
  if (!why.empty()) GTEST_SKIP() << why;
  EXPECT_EQ(info.path, KernelPath::kHopperSm90a);
  EXPECT_EQ(dispatch::choose_prefill(AttentionPath::kAuto, info.cc_major, info.cc_minor, DType::kBF16, hd).path,
            AttentionPath::kHopper);
}

}  // namespace
}  // namespace tessera::testing
