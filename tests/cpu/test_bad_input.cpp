// Every public entry point rejects bad arguments on the host, before touching the GPU, with an
// error that names the argument. These run without a GPU: validation never dereferences device
// pointers, so aligned dummy addresses stand in for device buffers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/arg_check.h"
#include "tessera/tessera.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

void* fake(uintptr_t offset = 0) { return reinterpret_cast<void*>(0x100000 + offset); }

// Runs `call`, expects a tessera::Error whose message contains every fragment.
void expect_error(const std::function<void()>& call, std::vector<std::string> fragments) {
  try {
    call();
    ADD_FAILURE() << "expected tessera::Error containing '" << fragments[0] << "'";
  } catch (const Error& e) {
    for (const auto& f : fragments) EXPECT_THAT(e.what(), HasSubstr(f));
  }
}

// A valid append problem (2 requests, page_size 16, 4 KV heads, hd 128) that each test breaks
// in one way. Host mirrors are set so index contents are checked.
struct AppendProblem {
  std::vector<int32_t> indptr{0, 2, 3};
  std::vector<int32_t> indices{4, 0, 2};
  std::vector<int32_t> last{16, 5};
  std::vector<int32_t> append{0, 3, 4};
  PagedKVCache cache;
  PageTable table;
  TensorView append_indptr, k_new, v_new;

  AppendProblem() {
    cache.layout = KVLayout::kNHD;
    cache.k_pages = TensorView::contiguous(fake(), DType::kBF16, {8, 16, 4, 128});
    cache.v_pages = TensorView::contiguous(fake(1 << 20), DType::kBF16, {8, 16, 4, 128});
    table.indptr = TensorView::contiguous(fake(2 << 20), DType::kInt32, {3});
    table.indices = TensorView::contiguous(fake(3 << 20), DType::kInt32, {3});
    table.last_page_len = TensorView::contiguous(fake(4 << 20), DType::kInt32, {2});
    append_indptr = TensorView::contiguous(fake(5 << 20), DType::kInt32, {3});
    k_new = TensorView::contiguous(fake(6 << 20), DType::kBF16, {4, 4, 128});
    v_new = TensorView::contiguous(fake(7 << 20), DType::kBF16, {4, 4, 128});
  }
  const int32_t* host_append = nullptr;
  void attach() {  // the host copies point at the vectors (edit their elements, not their size)
    table.host_indptr = indptr.data();
    table.host_indices = indices.data();
    table.host_last_page_len = last.data();
    host_append = append.data();
  }
  void call() { append_paged_kv(cache, table, append_indptr, k_new, v_new, nullptr, host_append); }
  void run() {
    attach();
    call();
  }
};

TEST(BadInputAppend, WrongDtypes) {
  AppendProblem p;
  p.cache.k_pages.dtype = DType::kFP32;
  expect_error([&] { p.run(); }, {"append_paged_kv", "'k_pages'", "dtype must be bf16 or fp16"});
  AppendProblem q;
  q.cache.v_pages.dtype = DType::kFP16;
  expect_error([&] { q.run(); }, {"'v_pages'", "dtype must be bf16"});
  AppendProblem r;
  r.k_new.dtype = DType::kFP16;
  expect_error([&] { r.run(); }, {"'k_new'", "dtype"});
  AppendProblem s;
  s.table.indptr.dtype = DType::kFP32;
  expect_error([&] { s.run(); }, {"'kv_indptr'", "dtype must be int32"});
}

TEST(BadInputAppend, MismatchedShapesAndHeadCounts) {
  AppendProblem p;
  p.k_new = TensorView::contiguous(fake(6 << 20), DType::kBF16, {4, 2, 128});
  expect_error([&] { p.run(); }, {"'k_new'", "num_kv_heads of the cache = 4"});
  AppendProblem q;
  q.v_new = TensorView::contiguous(fake(7 << 20), DType::kBF16, {3, 4, 128});
  expect_error([&] { q.run(); }, {"'v_new'", "must equal the shape of 'k_new'"});
  AppendProblem r;
  r.k_new = TensorView::contiguous(fake(6 << 20), DType::kBF16, {4, 4, 64});
  expect_error([&] { r.run(); }, {"'k_new'", "head_dim of the cache = 128"});
  AppendProblem s;
  s.cache.k_pages = TensorView::contiguous(fake(), DType::kBF16, {8, 16, 4});
  expect_error([&] { s.run(); }, {"'k_pages'", "must have rank 4"});
  AppendProblem t;
  t.table.last_page_len = TensorView::contiguous(fake(4 << 20), DType::kInt32, {3});
  expect_error([&] { t.run(); }, {"'kv_last_page_len'", "batch_size"});
  AppendProblem u;
  u.k_new.device = Device::kCPU;
  expect_error([&] { u.run(); }, {"'k_new'", "must be in device memory"});
}

TEST(BadInputAppend, UnsupportedHeadDimAndMisalignment) {
  AppendProblem p;
  p.cache.k_pages = TensorView::contiguous(fake(), DType::kBF16, {8, 16, 4, 12});
  p.cache.v_pages = TensorView::contiguous(fake(1 << 20), DType::kBF16, {8, 16, 4, 12});
  expect_error([&] { p.run(); }, {"'k_pages'", "multiple of 8 elements"});
  AppendProblem q;
  q.k_new.data = fake((6 << 20) + 2);
  expect_error([&] { q.run(); }, {"'k_new'", "16-byte aligned"});
  AppendProblem r;
  r.cache.k_pages = TensorView::strided(fake(), DType::kBF16, {8, 16, 4, 128},
                                        {16 * 4 * 256, 4 * 256, 256, 2});
  expect_error([&] { r.run(); }, {"'k_pages'", "must be contiguous (stride 1)"});
  AppendProblem s;
  s.k_new = TensorView::strided(fake(6 << 20), DType::kBF16, {4, 4, 128}, {516, 129, 1});
  expect_error([&] { s.run(); }, {"'k_new'", "multiple of 16 bytes"});
}

TEST(BadInputAppend, BadIndptr) {
  AppendProblem p;
  p.indptr = {1, 2, 3};
  expect_error([&] { p.run(); }, {"'kv_indptr'", "must start at 0"});
  AppendProblem q;
  q.indptr = {0, 2, 1};
  expect_error([&] { q.run(); }, {"'kv_indptr'", "non-decreasing"});
  AppendProblem r;
  r.append = {0, 3, 3};
  expect_error([&] { r.run(); }, {"'append_indptr'", "must equal 4"});
  AppendProblem s;
  s.append = {0, 4, 3};
  expect_error([&] { s.run(); }, {"'append_indptr'", "non-decreasing"});
}

TEST(BadInputAppend, LastPageLenOutsideRange) {
  AppendProblem p;
  p.last = {17, 5};
  expect_error([&] { p.run(); }, {"'kv_last_page_len'", "value 17 at index 0", "1..16"});
  AppendProblem q;
  q.last = {16, 0};
  expect_error([&] { q.run(); }, {"'kv_last_page_len'", "value 0 at index 1"});
}

TEST(BadInputAppend, PageIdsOutsideCache) {
  AppendProblem p;
  p.indices = {4, 8, 2};
  expect_error([&] { p.run(); }, {"'kv_indices'", "page id 8", "outside the cache's 8 pages"});
  AppendProblem q;
  q.indices = {4, -1, 2};  // request 0 appends into its second page
  expect_error([&] { q.run(); }, {"'kv_indices'", "page id -1"});
}

TEST(BadInputAppend, AppendLongerThanCachedLength) {
  AppendProblem p;
  p.append = {0, 3, 4};
  p.last = {16, 5};
  p.indptr = {0, 2, 2};  // request 1 has no pages but appends one row
  expect_error([&] { p.run(); }, {"'append_indptr'", "request 1 appends 1 rows", "hold only 0"});
}

TEST(BadInputAppend, ValidProblemPassesValidation) {
  // The same problem without any defect gets past validation; with a null stream and fake
  // pointers it would then launch, so stop it at the one remaining check: zero rows to append.
  AppendProblem p;
  p.append = {0, 0, 0};
  p.k_new = TensorView::contiguous(fake(6 << 20), DType::kBF16, {0, 4, 128});
  p.v_new = TensorView::contiguous(fake(7 << 20), DType::kBF16, {0, 4, 128});
  EXPECT_NO_THROW(p.run());
}

TEST(BadInputAppend, CombinedCache) {
  // K and V interleaved in one [8, 2, 16, 4, 128] (NHD) or [8, 2, 4, 16, 128] (HND) buffer, split
  // into two views with the same shape and strides, V one dim-1 step after K: they share the
  // buffer but no element, and are accepted (zero new rows: full validation, no launch).
  auto combined = [](AppendProblem& p, KVLayout layout) {
    const int64_t a = layout == KVLayout::kNHD ? 16 : 4, b = layout == KVLayout::kNHD ? 4 : 16;
    p.cache.layout = layout;
    p.cache.k_pages = TensorView::strided(fake(), DType::kBF16, {8, a, b, 128}, {2 * a * b * 128, b * 128, 128, 1});
    p.cache.v_pages = p.cache.k_pages;
    p.cache.v_pages.data = fake(a * b * 128 * 2);
  };
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    AppendProblem p;
    combined(p, layout);
    p.append = {0, 0, 0};
    p.k_new = TensorView::contiguous(fake(6 << 20), DType::kBF16, {0, 4, 128});
    p.v_new = TensorView::contiguous(fake(7 << 20), DType::kBF16, {0, 4, 128});
    EXPECT_NO_THROW(p.run()) << kv_layout_name(layout);
  }
  // V one page later (V's page i is K's page i + 1) shares elements.
  AppendProblem q;
  combined(q, KVLayout::kNHD);
  q.cache.v_pages.data = fake(2 * 16 * 4 * 128 * 2);
  expect_error([&] { q.run(); }, {"'v_pages'", "must not overlap 'k_pages'"});
  // New rows inside the cache's buffer (other shapes: not decided, so refused).
  AppendProblem r;
  combined(r, KVLayout::kNHD);
  r.k_new.data = fake(16 * 4 * 128 * 2 + 256);
  expect_error([&] { r.run(); }, {"'k_pages'", "must not overlap 'k_new'"});
}

struct MergeProblem {
  TensorView o_a = TensorView::contiguous(fake(), DType::kBF16, {16, 4, 128});
  TensorView s_a = TensorView::contiguous(fake(1 << 20), DType::kFP32, {16, 4});
  TensorView o_b = TensorView::contiguous(fake(2 << 20), DType::kBF16, {16, 4, 128});
  TensorView s_b = TensorView::contiguous(fake(3 << 20), DType::kFP32, {16, 4});
  TensorView o_out = TensorView::contiguous(fake(4 << 20), DType::kBF16, {16, 4, 128});
  TensorView s_out = TensorView::contiguous(fake(5 << 20), DType::kFP32, {16, 4});
  void run() { merge_state(o_a, s_a, o_b, s_b, o_out, s_out, nullptr); }
};

TEST(BadInputMerge, WrongDtypes) {
  MergeProblem p;
  p.s_a.dtype = DType::kBF16;
  expect_error([&] { p.run(); }, {"merge_state", "'s_a'", "dtype must be fp32"});
  MergeProblem q;
  q.o_b.dtype = DType::kFP16;
  expect_error([&] { q.run(); }, {"'o_b'", "dtype must be bf16"});
  MergeProblem r;
  r.o_out.dtype = DType::kFP16;
  expect_error([&] { r.run(); }, {"'o_out'", "dtype must be bf16, got fp16"});
  MergeProblem s;
  s.o_a.dtype = DType::kInt32;
  expect_error([&] { s.run(); }, {"'o_a'", "dtype"});
}

// Element alignment, stride overflow and enum ranges: rules every entry point's views follow.
TEST(BadInputViews, MisalignedElementsStrideOverflowAndLayoutValues) {
  MergeProblem p;
  p.s_a.data = fake((2 << 20) + 2);  // an fp32 LSE sliced at a 2-byte offset
  expect_error([&] { p.run(); }, {"merge_state", "'s_a'", "aligned to its 4-byte elements"});
  MergeProblem q;
  q.o_b.stride[0] = int64_t(1) << 62;  // the farthest element lies past 2^63 bytes
  expect_error([&] { q.run(); }, {"'o_b'", "past 2^63 bytes"});
  AppendProblem a;
  a.cache.layout = static_cast<KVLayout>(5);
  expect_error([&] { a.run(); }, {"append_paged_kv", "'cache.layout'", "NHD or HND, got the value 5"});
}

TEST(BadInputMerge, MismatchedShapes) {
  MergeProblem p;
  p.o_b = TensorView::contiguous(fake(2 << 20), DType::kBF16, {16, 8, 128});
  expect_error([&] { p.run(); }, {"'s_b'", "leading dims"});
  MergeProblem q;
  q.s_out = TensorView::contiguous(fake(5 << 20), DType::kFP32, {15, 4});
  expect_error([&] { q.run(); }, {"'s_out'", "must equal the shape of 's_a'"});
  MergeProblem r;
  r.o_out = TensorView::contiguous(fake(4 << 20), DType::kBF16, {16, 4, 64});
  expect_error([&] { r.run(); }, {"'o_out'", "must equal the shape of 'o_a'"});
  expect_error(
      [&] {
        merge_states(TensorView::contiguous(fake(), DType::kFP32, {16, 3, 4, 128}),
                     TensorView::contiguous(fake(1 << 20), DType::kFP32, {16, 2, 4}),
                     TensorView::contiguous(fake(2 << 20), DType::kBF16, {16, 4, 128}),
                     TensorView(), nullptr);
      },
      {"merge_states", "'s_parts'", "leading dims"});
}

TEST(BadInputMerge, UnsupportedHeadDimAndMisalignment) {
  for (int64_t hd : {24, 512}) {
    MergeProblem p;
    p.o_a = TensorView::contiguous(fake(), DType::kBF16, {16, 4, hd});
    p.o_b = TensorView::contiguous(fake(2 << 20), DType::kBF16, {16, 4, hd});
    p.o_out = TensorView::contiguous(fake(4 << 20), DType::kBF16, {16, 4, hd});
    expect_error([&] { p.run(); }, {"'o_a'", "head_dim must be one of"});
  }
  MergeProblem q;
  q.o_a.data = fake(8);
  expect_error([&] { q.run(); }, {"'o_a'", "16-byte aligned"});
}

TEST(BadInputHeads, GqaGroupsAndHeadDims) {
  const detail::ArgCheck check("batch_prefill");
  expect_error([&] { check.head_config(32, 6, 128, {64, 128, 256}); },
               {"batch_prefill", "'num_qo_heads'", "multiple of num_kv_heads"});
  expect_error([&] { check.head_config(32, 0, 128, {64, 128, 256}); }, {"'num_kv_heads'"});
  expect_error([&] { check.head_config(32, 8, 96, {64, 128, 256}); },
               {"'head_dim'", "{64, 128, 256}", "got 96"});
  EXPECT_NO_THROW(check.head_config(32, 8, 128, {64, 128, 256}));
  EXPECT_NO_THROW(check.head_config(16, 1, 64, {64}));
}

TEST(TensorViewBasics, ContiguousStridesAndDescribe) {
  const TensorView t = TensorView::contiguous(fake(), DType::kBF16, {2, 3, 4});
  EXPECT_EQ(t.stride[0], 12);
  EXPECT_EQ(t.stride[2], 1);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.size(-1), 4);
  const TensorView s = TensorView::strided(fake(), DType::kFP32, {2, 3}, {8, 1});
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_THAT(s.describe(), HasSubstr("[2, 3] fp32 strides [8, 1]"));
  EXPECT_THROW(TensorView::strided(fake(), DType::kFP32, {2, 3}, {1}), Error);
}

TEST(DeviceInfoPaths, PathByComputeCapability) {
  // sm_90 takes the Hopper family where the build holds it (PrefillDispatch.FamilyListIsTheOneSource).
  EXPECT_NE(kernel_path_for(9, 0), KernelPath::kNone);
  EXPECT_EQ(kernel_path_for(8, 0), KernelPath::kPortableSm80);
  EXPECT_EQ(kernel_path_for(8, 9), KernelPath::kPortableSm80);
  EXPECT_EQ(kernel_path_for(10, 0), KernelPath::kPortableSm80);
  EXPECT_EQ(kernel_path_for(7, 5), KernelPath::kNone);
  // Without a GPU, device_info says so instead of throwing.
  const DeviceInfo info = device_info();
  if (!info.present) EXPECT_FALSE(info.reason.empty());
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// A valid prefill problem (2 requests, 8 query heads / 2 KV heads, hd 128) broken one way a test.
struct PrefillProblem {
  std::vector<int32_t> qo{0, 5, 9};
  std::vector<int32_t> kv{0, 7, 20};
  PrefillArgs a;
  PrefillProblem() {
    a.q = TensorView::contiguous(fake(), DType::kBF16, {9, 8, 128});
    a.k = TensorView::contiguous(fake(1 << 20), DType::kBF16, {20, 2, 128});
    a.v = TensorView::contiguous(fake(2 << 20), DType::kBF16, {20, 2, 128});
    a.o = TensorView::contiguous(fake(3 << 20), DType::kBF16, {9, 8, 128});
    a.qo_indptr = TensorView::contiguous(fake(4 << 20), DType::kInt32, {3});
    a.kv_indptr = TensorView::contiguous(fake(5 << 20), DType::kInt32, {3});
  }
  void attach() {
    a.host_qo_indptr = qo.data();
    a.host_kv_indptr = kv.data();
  }
  void call() { batch_prefill(a, nullptr); }
  void run() {
    attach();
    call();
  }
};

// An output must not overlap an index array the kernel reads (it could overwrite the offsets or
// page ids it is about to use).
TEST(BadInputPrefill, OutputsOverlappingIndexArrays) {
  PrefillProblem p;
  p.a.qo_indptr = TensorView::contiguous(fake((3 << 20) + 64), DType::kInt32, {3});  // inside o
  expect_error([&] { p.run(); }, {"batch_prefill", "'o'", "must not overlap 'qo_indptr'"});
  PrefillProblem q;
  q.a.lse = TensorView::contiguous(fake(6 << 20), DType::kFP32, {9, 8});
  q.a.kv_indptr = TensorView::contiguous(fake((6 << 20) + 8), DType::kInt32, {3});  // inside lse
  expect_error([&] { q.run(); }, {"'lse'", "must not overlap 'kv_indptr'"});
  AppendProblem a;
  a.table.indices = TensorView::contiguous(fake(1 << 20), DType::kInt32, {3});  // v_pages' first bytes
  expect_error([&] { a.run(); }, {"append_paged_kv", "'v_pages'", "must not overlap 'kv_indices'"});
}

TEST(BadInputPrefill, GqaGroupNotAMultiple) {
  PrefillProblem p;
  p.a.k = TensorView::contiguous(fake(1 << 20), DType::kBF16, {20, 3, 128});
  p.a.v = TensorView::contiguous(fake(2 << 20), DType::kBF16, {20, 3, 128});
  expect_error([&] { p.run(); }, {"batch_prefill", "'num_qo_heads'", "multiple of num_kv_heads"});
}

TEST(BadInputPrefill, UnsupportedHeadDim) {
  PrefillProblem p;
  for (TensorView* t : {&p.a.q, &p.a.o}) t->shape[2] = 96, t->stride[1] = 96, t->stride[0] = 8 * 96;
  for (TensorView* t : {&p.a.k, &p.a.v}) t->shape[2] = 96, t->stride[1] = 96, t->stride[0] = 2 * 96;
  expect_error([&] { p.run(); }, {"'head_dim'", "compiled head dims", "got 96"});
}

TEST(BadInputPrefill, DtypesShapesAndIndptr) {
  PrefillProblem p;
  p.a.v.dtype = DType::kFP16;
  expect_error([&] { p.run(); }, {"'v'", "dtype must be bf16"});
  PrefillProblem q;
  q.a.o = TensorView::contiguous(fake(3 << 20), DType::kBF16, {9, 4, 128});
  expect_error([&] { q.run(); }, {"'o'", "must equal the shape of 'q'"});
  PrefillProblem r;
  r.qo = {1, 5, 9};
  expect_error([&] { r.run(); }, {"'qo_indptr'", "must start at 0"});
  PrefillProblem s;
  s.kv = {0, 7, 21};
  expect_error([&] { s.run(); }, {"'kv_indptr'", "exceeds 20"});
  PrefillProblem t;
  t.a.window_left = -2;
  expect_error([&] { t.run(); }, {"'window_left'"});
  PrefillProblem u;
  u.a.lse = TensorView::contiguous(fake(6 << 20), DType::kFP32, {9, 7});
  expect_error([&] { u.run(); }, {"'lse'", "[total_q, num_qo_heads]"});
  PrefillProblem w;
  w.a.q.data = fake(4);
  expect_error([&] { w.run(); }, {"'q'", "16-byte aligned"});
  PrefillProblem x;
  x.a.host_qo_indptr = nullptr;
  expect_error([&] { batch_prefill(x.a, nullptr); }, {"'host_qo_indptr'", "is required"});
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

TEST(BadInputAppend, HostCopiesAreRequired) {
  AppendProblem p;
  expect_error([&] {
    p.table.host_indptr = nullptr;
    append_paged_kv(p.cache, p.table, p.append_indptr, p.k_new, p.v_new, nullptr, p.append.data());
  }, {"'host_indptr'", "is required"});
  AppendProblem q;
  q.table.host_indptr = q.indptr.data();
  q.table.host_indices = q.indices.data();
  q.table.host_last_page_len = q.last.data();
  expect_error([&] { append_paged_kv(q.cache, q.table, q.append_indptr, q.k_new, q.v_new, nullptr, nullptr); },
               {"'host_append_indptr'", "is required"});
}

TEST(BadInputAppend, PageWrittenTwice) {
  AppendProblem p;
  p.indices = {4, 2, 2};  // request 0's last page is request 1's only page
  expect_error([&] { p.run(); }, {"'kv_indices'", "page id 2 receives new rows twice"});
}

TEST(BadInputAppend, OverlappingOrBroadcastPages) {
  AppendProblem p;
  p.cache.v_pages.data = p.cache.k_pages.data;
  expect_error([&] { p.run(); }, {"'v_pages'", "must not overlap 'k_pages'"});
  AppendProblem q;
  q.cache.k_pages.stride[0] = 0;  // every page aliases page 0
  expect_error([&] { q.run(); }, {"'k_pages'", "positive stride"});
  AppendProblem r;
  r.k_new.data = r.cache.k_pages.data;
  expect_error([&] { r.run(); }, {"'k_pages'", "must not overlap 'k_new'"});
}

TEST(BadInputMerge, InPlaceAndNaryArguments) {
  MergeProblem p;
  // In place, errors name the arguments as the caller passes them: (o, s, o_other, s_other).
  expect_error([&] { merge_state_in_place(p.o_a, p.o_b, p.o_b, p.s_b, nullptr); },
               {"merge_state_in_place", "'s'", "rank 2"});
  expect_error([&] { merge_state_in_place(p.o_a, p.s_a, p.o_a, p.s_b, nullptr); },
               {"merge_state_in_place", "'o'", "must not overlap 'o_other'"});
  expect_error([&] { merge_state_in_place(p.o_a, p.s_a, p.o_b, p.s_a, nullptr); },
               {"merge_state_in_place", "'s'", "must not overlap 's_other'"});
  expect_error(
      [&] {
        merge_states(TensorView::contiguous(fake(), DType::kBF16, {16, 3, 4, 128}),
                     TensorView::contiguous(fake(1 << 20), DType::kFP32, {16, 3, 4}),
                     TensorView::contiguous(fake(2 << 20), DType::kFP16, {16, 4, 128}), TensorView(),
                     nullptr);
      },
      {"merge_states", "'o_out'", "dtype must be bf16"});
  expect_error(
      [&] {
        merge_states(TensorView::contiguous(fake(), DType::kFP32, {16, 3, 4, 128}),
                     TensorView::contiguous(fake(1 << 20), DType::kFP32, {16, 3, 4}),
                     TensorView::contiguous(fake(2 << 20), DType::kBF16, {16, 4, 64}), TensorView(),
                     nullptr);
      },
      {"merge_states", "'o_out'", "[rows, heads, head_dim]"});
}

TEST(BadInputMerge, OverlappingOrBroadcastOutputs) {
  MergeProblem p;
  p.o_out.data = fake(128);  // one row into o_a
  expect_error([&] { p.run(); }, {"'o_out'", "must not overlap 'o_a'"});
  MergeProblem q;
  q.s_out.stride[0] = 0;
  q.s_out.stride[1] = 0;
  expect_error([&] { q.run(); }, {"'s_out'", "positive stride"});
}

TEST(BadInputPrefill, IndptrAndLayoutRules) {
  PrefillProblem p;
  p.kv = {0, 21, 20};
  expect_error([&] { p.run(); }, {"'kv_indptr'", "non-decreasing"});
  PrefillProblem q;
  q.a.qo_indptr.stride[0] = 2;
  expect_error([&] { q.run(); }, {"'qo_indptr'", "must be contiguous"});
  PrefillProblem r;
  r.a.k.stride[0] = 2 * 128 + 4;  // rows no longer 16-byte aligned
  r.a.v.stride[0] = 2 * 128 + 4;
  expect_error([&] { r.run(); }, {"'k'", "multiple of 16 bytes"});
  PrefillProblem s;
  s.a.k = TensorView::contiguous(fake(1 << 20), DType::kBF16, {20, 2, 64});
  s.a.v = TensorView::contiguous(fake(2 << 20), DType::kBF16, {20, 2, 64});
  expect_error([&] { s.run(); }, {"'k'", "head_dim 64 must equal q's head_dim 128"});
  PrefillProblem t;
  t.a.o.data = t.a.k.data;
  expect_error([&] { t.run(); }, {"'o'", "must not overlap 'k'"});
  PrefillProblem u;
  u.a.lse = TensorView::strided(fake(6 << 20), DType::kFP32, {9, 8}, {0, 1});
  expect_error([&] { u.run(); }, {"'lse'", "positive stride"});
  PrefillProblem w;
  w.a.scale = -1.f;
  expect_error([&] { w.run(); }, {"'scale'"});
}

// ---- The validation table: every entry point x every tensor argument x every view rule ------------
// Each case starts from a valid problem, breaks one rule of one argument and expects a
// tessera::Error from the entry point charged to that argument ("tessera::<entry>: argument
// '<name>'"; never a CUDA error: the refusal comes before anything touches the GPU, so nothing is
// written). The rules (docs/CONVENTIONS.md, "Errors and execution"): dtype, rank, null data, host
// memory, element alignment, a broadcast (zero-stride) or overlapping output, and the extent.
struct TableArg {
  const char* name;
  bool output;
  std::function<TensorView&(void*)> view;  // the argument inside a problem made by `make`
};
struct TableEntry {
  const char* entry;
  std::function<std::shared_ptr<void>()> make;  // a valid problem
  std::function<void(void*)> call;
  std::vector<TableArg> args;
};

struct PagedPrefillProblem {
  std::vector<int32_t> qo{0, 5, 9};
  std::vector<int32_t> indptr{0, 2, 3}, indices{4, 0, 2}, last{16, 5};
  PagedPrefillArgs a;
  PagedPrefillProblem() {
    a.q = TensorView::contiguous(fake(), DType::kBF16, {9, 8, 128});
    a.o = TensorView::contiguous(fake(3 << 20), DType::kBF16, {9, 8, 128});
    a.qo_indptr = TensorView::contiguous(fake(4 << 20), DType::kInt32, {3});
    a.cache.layout = KVLayout::kNHD;
    a.cache.k_pages = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 16, 2, 128});
    a.cache.v_pages = TensorView::contiguous(fake(2 << 24), DType::kBF16, {8, 16, 2, 128});
    a.table.indptr = TensorView::contiguous(fake(5 << 20), DType::kInt32, {3});
    a.table.indices = TensorView::contiguous(fake(6 << 20), DType::kInt32, {3});
    a.table.last_page_len = TensorView::contiguous(fake(7 << 20), DType::kInt32, {2});
    a.lse = TensorView::contiguous(fake(8 << 20), DType::kFP32, {9, 8});
  }
  void attach() {
    a.host_qo_indptr = qo.data();
    a.table.host_indptr = indptr.data();
    a.table.host_indices = indices.data();
    a.table.host_last_page_len = last.data();
  }
  void call() { batch_prefill_paged(a, nullptr); }
  void run() {
    attach();
    call();
  }
};

struct MergeStatesProblem {
  TensorView o_parts = TensorView::contiguous(fake(), DType::kFP32, {16, 3, 4, 128});
  TensorView s_parts = TensorView::contiguous(fake(1 << 24), DType::kFP32, {16, 3, 4});
  TensorView o_out = TensorView::contiguous(fake(2 << 24), DType::kBF16, {16, 4, 128});
  TensorView s_out = TensorView::contiguous(fake(3 << 24), DType::kFP32, {16, 4});
  void run() { merge_states(o_parts, s_parts, o_out, s_out, nullptr); }
};

template <typename P>
TableEntry table_entry(const char* entry, std::function<void(P&)> call,
                       std::vector<std::pair<const char*, std::pair<bool, std::function<TensorView&(P&)>>>> args) {
  TableEntry e{entry, [] { return std::static_pointer_cast<void>(std::make_shared<P>()); },
               [call](void* p) { call(*static_cast<P*>(p)); }, {}};
  for (auto& [name, spec] : args) {
    auto get = spec.second;
    e.args.push_back({name, spec.first, [get](void* p) -> TensorView& { return get(*static_cast<P*>(p)); }});
  }
  return e;
}

std::vector<TableEntry> validation_table() {
  using PP = PrefillProblem;
  using QP = PagedPrefillProblem;
  using AP = AppendProblem;
  using MP = MergeProblem;
  using SP = MergeStatesProblem;
  auto in = [](auto get) { return std::make_pair(false, get); };
  auto out = [](auto get) { return std::make_pair(true, get); };
  std::vector<TableEntry> t;
  t.push_back(table_entry<PP>("batch_prefill", [](PP& p) { p.a.lse = TensorView::contiguous(fake(8 << 20), DType::kFP32, {9, 8}); p.run(); },
      {{"q", in(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.q; }))},
       {"k", in(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.k; }))},
       {"v", in(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.v; }))},
       {"o", out(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.o; }))},
       {"qo_indptr", in(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.qo_indptr; }))},
       {"kv_indptr", in(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.kv_indptr; }))}}));
  t.push_back(table_entry<QP>("batch_prefill_paged", [](QP& p) { p.run(); },
      {{"q", in(std::function<TensorView&(QP&)>([](QP& p) -> TensorView& { return p.a.q; }))},
       {"o", out(std::function<TensorView&(QP&)>([](QP& p) -> TensorView& { return p.a.o; }))},
       {"lse", out(std::function<TensorView&(QP&)>([](QP& p) -> TensorView& { return p.a.lse; }))},
       {"k_pages", in(std::function<TensorView&(QP&)>([](QP& p) -> TensorView& { return p.a.cache.k_pages; }))},
       {"v_pages", in(std::function<TensorView&(QP&)>([](QP& p) -> TensorView& { return p.a.cache.v_pages; }))},
       {"qo_indptr", in(std::function<TensorView&(QP&)>([](QP& p) -> TensorView& { return p.a.qo_indptr; }))},
       {"kv_indptr", in(std::function<TensorView&(QP&)>([](QP& p) -> TensorView& { return p.a.table.indptr; }))},
       {"kv_indices", in(std::function<TensorView&(QP&)>([](QP& p) -> TensorView& { return p.a.table.indices; }))},
       {"kv_last_page_len", in(std::function<TensorView&(QP&)>([](QP& p) -> TensorView& { return p.a.table.last_page_len; }))}}));
  t.push_back(table_entry<AP>("append_paged_kv", [](AP& p) { p.run(); },
      {{"k_pages", out(std::function<TensorView&(AP&)>([](AP& p) -> TensorView& { return p.cache.k_pages; }))},
       {"v_pages", out(std::function<TensorView&(AP&)>([](AP& p) -> TensorView& { return p.cache.v_pages; }))},
       {"k_new", in(std::function<TensorView&(AP&)>([](AP& p) -> TensorView& { return p.k_new; }))},
       {"v_new", in(std::function<TensorView&(AP&)>([](AP& p) -> TensorView& { return p.v_new; }))},
       {"kv_indptr", in(std::function<TensorView&(AP&)>([](AP& p) -> TensorView& { return p.table.indptr; }))},
       {"kv_indices", in(std::function<TensorView&(AP&)>([](AP& p) -> TensorView& { return p.table.indices; }))},
       {"kv_last_page_len", in(std::function<TensorView&(AP&)>([](AP& p) -> TensorView& { return p.table.last_page_len; }))},
       {"append_indptr", in(std::function<TensorView&(AP&)>([](AP& p) -> TensorView& { return p.append_indptr; }))}}));
  t.push_back(table_entry<MP>("merge_state", [](MP& p) { p.run(); },
      {{"o_a", in(std::function<TensorView&(MP&)>([](MP& p) -> TensorView& { return p.o_a; }))},
       {"s_a", in(std::function<TensorView&(MP&)>([](MP& p) -> TensorView& { return p.s_a; }))},
       {"o_b", in(std::function<TensorView&(MP&)>([](MP& p) -> TensorView& { return p.o_b; }))},
       {"s_b", in(std::function<TensorView&(MP&)>([](MP& p) -> TensorView& { return p.s_b; }))},
       {"o_out", out(std::function<TensorView&(MP&)>([](MP& p) -> TensorView& { return p.o_out; }))},
       {"s_out", out(std::function<TensorView&(MP&)>([](MP& p) -> TensorView& { return p.s_out; }))}}));
  t.push_back(table_entry<MP>("merge_state_in_place", [](MP& p) { merge_state_in_place(p.o_a, p.s_a, p.o_b, p.s_b, nullptr); },
      {{"o", out(std::function<TensorView&(MP&)>([](MP& p) -> TensorView& { return p.o_a; }))},
       {"s", out(std::function<TensorView&(MP&)>([](MP& p) -> TensorView& { return p.s_a; }))},
       {"o_other", in(std::function<TensorView&(MP&)>([](MP& p) -> TensorView& { return p.o_b; }))},
       {"s_other", in(std::function<TensorView&(MP&)>([](MP& p) -> TensorView& { return p.s_b; }))}}));
  t.push_back(table_entry<SP>("merge_states", [](SP& p) { p.run(); },
      {{"o_parts", in(std::function<TensorView&(SP&)>([](SP& p) -> TensorView& { return p.o_parts; }))},
       {"s_parts", in(std::function<TensorView&(SP&)>([](SP& p) -> TensorView& { return p.s_parts; }))},
       {"o_out", out(std::function<TensorView&(SP&)>([](SP& p) -> TensorView& { return p.o_out; }))},
       {"s_out", out(std::function<TensorView&(SP&)>([](SP& p) -> TensorView& { return p.s_out; }))}}));
  return t;
}

struct ViewRule {
  const char* rule;
  bool outputs_only;
  std::function<void(TensorView&)> apply;
};

TEST(ValidationTable, EveryEntryPointNamesTheArgumentOfEveryBrokenViewRule) {
  const std::vector<ViewRule> rules = {
      {"dtype", false, [](TensorView& t) { t.dtype = t.dtype == DType::kInt32 ? DType::kFP32 : DType::kInt32; }},
      {"rank", false, [](TensorView& t) { t.shape[t.rank] = 1, t.stride[t.rank] = 1, ++t.rank; }},
      {"null data", false, [](TensorView& t) { t.data = nullptr; }},
      {"host memory", false, [](TensorView& t) { t.device = Device::kCPU; }},
      {"misaligned", false, [](TensorView& t) { t.data = static_cast<char*>(t.data) + 1; }},
      {"extent past 2^63 bytes", false, [](TensorView& t) { t.stride[0] = int64_t(1) << 62; }},
      {"broadcast output", true, [](TensorView& t) { t.stride[0] = 0; }},
  };
  // With a GPU visible, a rule that validation missed would launch on the fake addresses: the
  // table runs where none is (CI), and there the valid problems are shown to pass validation.
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  (void)cudaGetLastError();
  if (gpus > 0) GTEST_SKIP() << "fake device pointers: the validation table runs where no GPU is visible";
  int cases = 0;
  for (const TableEntry& e : validation_table()) {
    {  // the valid problem passes validation and stops at the first CUDA call
      auto problem = e.make();
      try {
        e.call(problem.get());
      } catch (const Error& err) {
        EXPECT_THAT(err.what(), ::testing::Not(HasSubstr("argument"))) << e.entry << ": the valid problem is refused";
      }
    }
    for (const TableArg& arg : e.args) {
      for (const ViewRule& rule : rules) {
        if (rule.outputs_only && !arg.output) continue;
        auto problem = e.make();
        TensorView& view = arg.view(problem.get());
        if (view.rank == 0 || view.numel() == 0) continue;
        rule.apply(view);
        SCOPED_TRACE(std::string(e.entry) + " argument " + arg.name + ": " + rule.rule);
        expect_error([&] { e.call(problem.get()); }, {std::string("tessera::") + e.entry + ": argument '" + arg.name + "'"});
        ++cases;
      }
    }
  }
  EXPECT_GT(cases, 150);
}

// ---- The validation table, index-range rules -------------------------------------------------------
// The host copies of the index arrays break one documented rule (docs/CONVENTIONS.md): an indptr
// starts at 0, never decreases and ends inside the tensor it indexes (append_indptr: exactly at
// k_new's rows); kv_last_page_len is in 1..page_size for a request with pages; page ids lie in
// [0, num_pages) of the cache; the host copies are given. Each row expects a tessera::Error from the
// entry point charged to the array, saying which rule, before any CUDA call. Rows the BadInput*
// tests above already check are not repeated: batch_prefill's qo_indptr start, kv_indptr descent
// and end, host_qo_indptr (BadInputPrefill.DtypesShapesAndIndptr, IndptrAndLayoutRules);
// append_paged_kv's kv_indptr start and descent, append_indptr descent and end, kv_last_page_len,
// page ids, host_indptr and host_append_indptr (BadInputAppend.*). batch_prefill_paged's rows are
// here although GpuPrefillPagedBadInput checks some of them: that test needs a GPU. BatchDecoder
// and BatchPrefillPaged query the GPU when they are made: their rows are GpuValidationTable.* in
// tests/gpu/test_validation_table.cpp.
struct IndexRow {
  const char* entry;
  const char* arg;     // the array the error is charged to
  const char* rule;    // a fragment of the rule the error states
  std::function<void(bool broken)> call;  // the valid problem, with the row's edit when broken
};

// A row over problem P (attach() / call(), as the structs above): `edit` breaks the attached host
// copies in place.
template <typename P>
IndexRow index_row(const char* entry, const char* arg, const char* rule, std::function<void(P&)> edit) {
  return {entry, arg, rule, [edit](bool broken) {
            P p;
            p.attach();
            if (broken) edit(p);
            p.call();
          }};
}

std::vector<IndexRow> index_table() {
  using PP = PrefillProblem;       // qo {0, 5, 9} over q's 9 rows, kv {0, 7, 20} over k's 20
  using QP = PagedPrefillProblem;  // qo {0, 5, 9}, kv_indptr {0, 2, 3} over 3 ids of 8 pages of 16, last {16, 5}
  using AP = AppendProblem;        // kv_indptr {0, 2, 3} over 3 ids, append {0, 3, 4} over k_new's 4 rows
  using E = std::function<void(PP&)>;
  using F = std::function<void(QP&)>;
  using G = std::function<void(AP&)>;
  return {
      index_row<PP>("batch_prefill", "qo_indptr", "non-decreasing", E([](PP& p) { p.qo[1] = 10; })),
      index_row<PP>("batch_prefill", "qo_indptr", "last entry 10 exceeds 9", E([](PP& p) { p.qo[2] = 10; })),
      index_row<PP>("batch_prefill", "kv_indptr", "must start at 0", E([](PP& p) { p.kv[0] = 1; })),
      index_row<PP>("batch_prefill", "host_kv_indptr", "is required", E([](PP& p) { p.a.host_kv_indptr = nullptr; })),

      index_row<QP>("batch_prefill_paged", "qo_indptr", "must start at 0", F([](QP& p) { p.qo[0] = 1; })),
      index_row<QP>("batch_prefill_paged", "qo_indptr", "non-decreasing", F([](QP& p) { p.qo[1] = 10; })),
      index_row<QP>("batch_prefill_paged", "qo_indptr", "last entry 10 exceeds 9", F([](QP& p) { p.qo[2] = 10; })),
      index_row<QP>("batch_prefill_paged", "kv_indptr", "must start at 0", F([](QP& p) { p.indptr[0] = 1; })),
      index_row<QP>("batch_prefill_paged", "kv_indptr", "non-decreasing", F([](QP& p) { p.indptr[1] = 4; })),
      index_row<QP>("batch_prefill_paged", "kv_indptr", "last entry 4 exceeds 3", F([](QP& p) { p.indptr[2] = 4; })),
      index_row<QP>("batch_prefill_paged", "kv_last_page_len", "value 0 at index 1 is outside 1..16",
                    F([](QP& p) { p.last[1] = 0; })),
      index_row<QP>("batch_prefill_paged", "kv_last_page_len", "value 17 at index 0 is outside 1..16",
                    F([](QP& p) { p.last[0] = 17; })),
      index_row<QP>("batch_prefill_paged", "kv_indices", "page id 8 at index 1 is outside the cache's 8 pages",
                    F([](QP& p) { p.indices[1] = 8; })),
      index_row<QP>("batch_prefill_paged", "kv_indices", "page id -1 at index 2", F([](QP& p) { p.indices[2] = -1; })),
      index_row<QP>("batch_prefill_paged", "host_qo_indptr", "is required", F([](QP& p) { p.a.host_qo_indptr = nullptr; })),
      index_row<QP>("batch_prefill_paged", "host_indptr", "is required", F([](QP& p) { p.a.table.host_indptr = nullptr; })),
      index_row<QP>("batch_prefill_paged", "host_indices", "is required", F([](QP& p) { p.a.table.host_indices = nullptr; })),
      index_row<QP>("batch_prefill_paged", "host_last_page_len", "is required",
                    F([](QP& p) { p.a.table.host_last_page_len = nullptr; })),

      index_row<AP>("append_paged_kv", "kv_indptr", "last entry 4 exceeds 3", G([](AP& p) { p.indptr[2] = 4; })),
      index_row<AP>("append_paged_kv", "append_indptr", "must start at 0", G([](AP& p) { p.append[0] = 1; })),
      index_row<AP>("append_paged_kv", "host_indices", "is required", G([](AP& p) { p.table.host_indices = nullptr; })),
      index_row<AP>("append_paged_kv", "host_last_page_len", "is required",
                    G([](AP& p) { p.table.host_last_page_len = nullptr; })),
  };
}

TEST(ValidationTable, EveryEntryPointNamesTheArrayOfEveryBrokenIndexRule) {
  // As the view table: a rule missed would launch on the fake addresses where a GPU is visible.
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  (void)cudaGetLastError();
  if (gpus > 0) GTEST_SKIP() << "fake device pointers: the validation table runs where no GPU is visible";
  for (const IndexRow& row : index_table()) {
    SCOPED_TRACE(std::string(row.entry) + " argument " + row.arg + ": " + row.rule);
    try {  // unbroken, the row's problem passes validation (and stops at the first CUDA call)
      row.call(false);
    } catch (const Error& err) {
      EXPECT_THAT(err.what(), ::testing::Not(HasSubstr("argument"))) << "the valid problem is refused";
    }
    expect_error([&] { row.call(true); },
                 {std::string("tessera::") + row.entry + ": argument '" + row.arg + "'", row.rule});
  }
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// MoE routing and permutation: each broken rule names its argument, on the host, before any launch.
// BatchPrefillPaged's config, checked before any GPU call (workspace_bytes): cuda_graph needs
// max_batch_size (it sizes the step's index arrays and schedule in the workspace), which then
// adds the step's image to the partials.
TEST(BadInputPrefillPaged, CudaGraphConfig) {
  PagedPrefillConfig c;
  c.num_qo_heads = 8;
  c.head_dim = 128;
  c.page_size = 16;
  c.max_q_rows = 256;
  const std::size_t plain = BatchPrefillPaged::workspace_bytes(c);
  c.cuda_graph = true;
  expect_error([&] { BatchPrefillPaged::workspace_bytes(c); },
               {"tessera::BatchPrefillPaged::workspace_bytes: argument 'max_batch_size'", "with cuda_graph"});
  c.max_batch_size = 70000;
  expect_error([&] { BatchPrefillPaged::workspace_bytes(c); }, {"argument 'max_batch_size'", "1..65535"});
  c.max_batch_size = 32;
  // The step header (8 int32), its three index arrays, the schedule's slot offsets (1025) and its
  // tiles: heads x splits x (max_q_rows / 64 + max_batch) at most; at least 64 KB (what plan()
  // copies at least: the copy engine's size, not the command stream's).
  auto image = [&](std::size_t splits, std::size_t rows) {
    return std::max<std::size_t>(4 * (8 + 33 + 33 + 32 + 1025 + 8 * splits * (rows / 64 + 32)), 64 << 10);
  };
  EXPECT_EQ(image(16, 256), std::size_t(64) << 10);  // (under the floor)
  EXPECT_EQ(BatchPrefillPaged::workspace_bytes(c), (plain + 255) / 256 * 256 + image(16, 256));
  c.max_kv_splits = 1;  // no partials: the image alone
  EXPECT_EQ(BatchPrefillPaged::workspace_bytes(c), image(1, 256));
  c.max_q_rows = 131072;  // over the floor
  EXPECT_GT(image(1, 131072), std::size_t(64) << 10);
  EXPECT_EQ(BatchPrefillPaged::workspace_bytes(c), image(1, 131072));
  c.max_q_rows = 256;
  c.cuda_graph = false;
  c.max_batch_size = -1;
  expect_error([&] { BatchPrefillPaged::workspace_bytes(c); }, {"argument 'max_batch_size'", "must be in 0..65535"});
  c.max_batch_size = 0;
  c.num_kv_heads = 3;  // does not divide 8 query heads
  expect_error([&] { BatchPrefillPaged::workspace_bytes(c); }, {"argument 'num_kv_heads'", "divide num_qo_heads (8)"});
  c.num_kv_heads = -1;
  expect_error([&] { BatchPrefillPaged::workspace_bytes(c); }, {"argument 'num_kv_heads'"});
  c.num_kv_heads = 0;
  const std::size_t unpacked = BatchPrefillPaged::workspace_bytes(c);
  c.num_kv_heads = 2;
  EXPECT_EQ(BatchPrefillPaged::workspace_bytes(c), unpacked);  // packing needs no more workspace
}

TEST(BadInputMoe, RouteAndPermute) {
  // A rule validation missed would launch on the fake addresses: on a GPU machine the GPU tests
  // (GpuMoeRoute / GpuMoePermute .ArgumentsAreValidated) cover these with real buffers.
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  (void)cudaGetLastError();
  if (gpus > 0) GTEST_SKIP() << "fake device pointers: runs where no GPU is visible";
  const auto route_args = [] {
    MoeRouteArgs a;
    a.logits = TensorView::contiguous(fake(), DType::kFP32, {16, 64});
    a.top_k = 8;
    a.topk_ids = TensorView::contiguous(fake(1 << 20), DType::kInt32, {16, 8});
    a.topk_weights = TensorView::contiguous(fake(2 << 20), DType::kFP32, {16, 8});
    return a;
  };
  MoeRouteArgs r = route_args();
  r.top_k = 0;
  expect_error([&] { moe_route(r, nullptr); }, {"moe_route", "argument 'top_k'"});
  r = route_args();
  r.logits = TensorView::contiguous(fake(), DType::kFP32, {16, 513});
  expect_error([&] { moe_route(r, nullptr); }, {"argument 'logits'", "1..512"});
  r = route_args();
  r.num_groups = 8;
  r.topk_groups = 9;
  expect_error([&] { moe_route(r, nullptr); }, {"argument 'topk_groups'"});
  r = route_args();
  r.selection_bias = TensorView::contiguous(fake(3 << 20), DType::kFP32, {63});
  expect_error([&] { moe_route(r, nullptr); }, {"argument 'selection_bias'"});
  r = route_args();
  r.topk_weights = TensorView::contiguous(fake(2 << 20), DType::kFP32, {16, 4});
  expect_error([&] { moe_route(r, nullptr); }, {"argument 'topk_weights'"});
  r = route_args();
  r.topk_weights = TensorView::contiguous(fake(1 << 20), DType::kFP32, {16, 8});  // topk_ids' bytes
  expect_error([&] { moe_route(r, nullptr); }, {"topk_weights"});

  const int64_t cap = moe_permute_capacity(16, 2, 8, 16);
  EXPECT_EQ(cap, 16 * 2 + 8 * 15);
  const auto permute_args = [cap] {
    MoePermuteArgs a;
    a.topk_ids = TensorView::contiguous(fake(), DType::kInt32, {16, 2});
    a.num_experts = 8;
    a.align = 16;
    a.expert_offsets = TensorView::contiguous(fake(1 << 20), DType::kInt32, {9});
    a.permuted_token = TensorView::contiguous(fake(2 << 20), DType::kInt32, {cap});
    a.inverse = TensorView::contiguous(fake(3 << 20), DType::kInt32, {16, 2});
    a.workspace = fake(4 << 20);
    a.workspace_size = moe_permute_workspace_bytes(16, 2, 8);
    return a;
  };
  MoePermuteArgs p = permute_args();
  p.align = 0;
  expect_error([&] { moe_permute(p, nullptr); }, {"moe_permute", "argument 'align'"});
  p = permute_args();
  p.permuted_token = TensorView::contiguous(fake(2 << 20), DType::kInt32, {cap - 1});
  expect_error([&] { moe_permute(p, nullptr); }, {"argument 'permuted_token'", "moe_permute_capacity"});
  p = permute_args();
  p.x = TensorView::contiguous(fake(5 << 20), DType::kBF16, {16, 64});
  expect_error([&] { moe_permute(p, nullptr); }, {"argument 'permuted_x'"});  // x without permuted_x
  p.permuted_x = TensorView::contiguous(fake(6 << 20), DType::kFP16, {cap, 64});
  expect_error([&] { moe_permute(p, nullptr); }, {"argument 'permuted_x'"});  // dtype differs from x's
  p = permute_args();
  p.inverse = TensorView::contiguous(fake(2 << 20), DType::kInt32, {16, 2});  // inside permuted_token
  expect_error([&] { moe_permute(p, nullptr); }, {"inverse"});
  p = permute_args();
  p.workspace = fake(4 << 20 | 2);
  expect_error([&] { moe_permute(p, nullptr); }, {"argument 'workspace'", "4-byte"});
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// `tessera info` names the kernel path and the MoE parts with their limits, with or without a GPU.
TEST(DeviceInfoText, ListsThePathAndTheMoeParts) {
  const std::string text = info_text(device_info());
  EXPECT_THAT(text, HasSubstr("kernel path: "));
  EXPECT_THAT(text, HasSubstr("MoE: routing (top-k <= 32 of <= 512 experts"));
  EXPECT_THAT(text, HasSubstr("grouped GEMM (<= 1024 experts"));
  EXPECT_THAT(text, HasSubstr("fused_moe"));
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// Overlaps the first MoE validation missed (review): the bias against the outputs, the workspace
// against the ids, x against the outputs, permuted_x against the ids; sizing helpers name their
// argument.
TEST(BadInputMoe, OverlapsAndSizing) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  (void)cudaGetLastError();
  if (gpus > 0) GTEST_SKIP() << "fake device pointers: runs where no GPU is visible";
  MoeRouteArgs r;
  r.logits = TensorView::contiguous(fake(), DType::kFP32, {16, 64});
  r.top_k = 8;
  r.topk_ids = TensorView::contiguous(fake(1 << 20), DType::kInt32, {16, 8});
  r.topk_weights = TensorView::contiguous(fake(2 << 20), DType::kFP32, {16, 8});
  r.selection_bias = TensorView::contiguous(fake(2 << 20), DType::kFP32, {64});  // inside topk_weights
  expect_error([&] { moe_route(r, nullptr); }, {"'topk_weights'", "'selection_bias'"});

  const int64_t cap = moe_permute_capacity(16, 2, 8, 1);
  MoePermuteArgs p;
  p.topk_ids = TensorView::contiguous(fake(), DType::kInt32, {16, 2});
  p.num_experts = 8;
  p.expert_offsets = TensorView::contiguous(fake(1 << 20), DType::kInt32, {9});
  p.permuted_token = TensorView::contiguous(fake(2 << 20), DType::kInt32, {cap});
  p.inverse = TensorView::contiguous(fake(3 << 20), DType::kInt32, {16, 2});
  p.workspace = fake(16);  // inside topk_ids
  p.workspace_size = moe_permute_workspace_bytes(16, 2, 8);
  expect_error([&] { moe_permute(p, nullptr); }, {"'workspace'", "'topk_ids'"});
  p.workspace = fake(4 << 20);
  p.x = TensorView::contiguous(fake(3 << 20), DType::kBF16, {16, 64});  // over inverse
  p.permuted_x = TensorView::contiguous(fake(5 << 20), DType::kBF16, {cap, 64});
  expect_error([&] { moe_permute(p, nullptr); }, {"'inverse'", "'x'"});
  p.x = TensorView::contiguous(fake(6 << 20), DType::kBF16, {16, 64});
  p.permuted_x = TensorView::contiguous(fake(), DType::kBF16, {cap, 64});  // over topk_ids
  expect_error([&] { moe_permute(p, nullptr); }, {"'permuted_x'", "'topk_ids'"});
  expect_error([] { moe_permute_capacity(4, 0, 8, 1); }, {"argument 'top_k'"});
  expect_error([] { moe_permute_capacity(4, 2, 8, 0); }, {"argument 'align'"});
  expect_error([] { moe_permute_workspace_bytes(4, 2, 2000); }, {"argument 'num_experts'"});
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// ---- The grouped GEMM, the combine and fused_moe -------------------------------------------------
// Valid problems each test breaks in one way; the error must name the entry point and the argument,
// and come from validation (on the host, before any launch: the pointers are fake). Where the
// contract leaves open which of two arguments a cross-rule blames (K of `a` against the weights'),
// either is accepted.

bool gpu_visible() {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  (void)cudaGetLastError();
  return gpus > 0;
}

// Expects a tessera::Error from `call` naming `entry` (or `alt_entry`: fused_moe's routing options
// may be reported by the moe_route it runs, under the same names) and at least one of `args`.
void expect_arg_error(const char* entry, const std::function<void()>& call, std::vector<std::string> args,
                      const char* alt_entry = nullptr) {
  std::string names;
  for (const auto& a : args) names += (names.empty() ? "'" : " or '") + a + "'";
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming " << names;
  } catch (const Error& e) {
    const std::string what = e.what();
    if (alt_entry == nullptr || what.find(std::string("tessera::") + alt_entry + ": ") == std::string::npos) {
      EXPECT_THAT(what, HasSubstr(std::string("tessera::") + entry + ": "));
    }
    bool named = false;
    for (const auto& a : args) named = named || what.find("argument '" + a + "'") != std::string::npos;
    EXPECT_TRUE(named) << "'" << what << "' names none of " << names;
  }
}

// A valid problem passes validation: with fake pointers and no GPU it fails later, if at all,
// without blaming an argument.
void expect_passes_validation(const std::function<void()>& call, const char* what) {
  try {
    call();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("argument"))) << what << ": the valid problem is refused";
  }
}

// 64 rows, 8 experts, K 72, N 136 (kStore).
struct MoeGemmProblem {
  MoeGroupedGemmArgs a;
  MoeGemmProblem() {
    a.a = TensorView::contiguous(fake(), DType::kBF16, {64, 72});
    a.weights = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 136, 72});
    a.expert_offsets = TensorView::contiguous(fake(2 << 24), DType::kInt32, {9});
    a.out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {64, 136});
  }
  void run() { moe_grouped_gemm(a, nullptr); }
};

// The same GEMM with its 64 product rows gathered from 24 tokens of x (a_rows [64] int32).
struct MoeGemmGatheredProblem : MoeGemmProblem {
  MoeGemmGatheredProblem() {
    a.a = TensorView::contiguous(fake(), DType::kBF16, {24, 72});
    a.a_rows = TensorView::contiguous(fake(4 << 24), DType::kInt32, {64});
  }
};

// 16 tokens x top-2 over 40 permuted rows, hidden 64, with a shared expert's output.
struct MoeCombineProblem {
  MoeCombineArgs a;
  MoeCombineProblem() {
    a.expert_out = TensorView::contiguous(fake(), DType::kBF16, {40, 64});
    a.inverse = TensorView::contiguous(fake(1 << 24), DType::kInt32, {16, 2});
    a.topk_weights = TensorView::contiguous(fake(2 << 24), DType::kFP32, {16, 2});
    a.shared_out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {16, 64});
    a.out = TensorView::contiguous(fake(4 << 24), DType::kBF16, {16, 64});
  }
  void run() { moe_combine(a, nullptr); }
};

// 16 tokens over 64 experts, top-8 (moe_route), with a selection bias.
struct MoeRouteProblem {
  MoeRouteArgs a;
  MoeRouteProblem() {
    a.logits = TensorView::contiguous(fake(), DType::kFP32, {16, 64});
    a.selection_bias = TensorView::contiguous(fake(3 << 24), DType::kFP32, {64});
    a.top_k = 8;
    a.topk_ids = TensorView::contiguous(fake(1 << 24), DType::kInt32, {16, 8});
    a.topk_weights = TensorView::contiguous(fake(2 << 24), DType::kFP32, {16, 8});
  }
  void run() { moe_route(a, nullptr); }
};

// 16 tokens, top-2 of 8 experts, segments aligned to 16 rows, x (hidden 64) permuted too.
struct MoePermuteProblem {
  MoePermuteArgs a;
  MoePermuteProblem() {
    const int64_t cap = moe_permute_capacity(16, 2, 8, 16);
    a.topk_ids = TensorView::contiguous(fake(), DType::kInt32, {16, 2});
    a.num_experts = 8;
    a.align = 16;
    a.x = TensorView::contiguous(fake(5 << 24), DType::kBF16, {16, 64});
    a.permuted_x = TensorView::contiguous(fake(6 << 24), DType::kBF16, {cap, 64});
    a.expert_offsets = TensorView::contiguous(fake(1 << 24), DType::kInt32, {9});
    a.permuted_token = TensorView::contiguous(fake(2 << 24), DType::kInt32, {cap});
    a.inverse = TensorView::contiguous(fake(3 << 24), DType::kInt32, {16, 2});
    a.workspace = fake(4 << 24);
    a.workspace_size = moe_permute_workspace_bytes(16, 2, 8);
  }
  void run() { moe_permute(a, nullptr); }
};

// 16 tokens, hidden 64, inter 32, 8 experts, top-2 routed from logits (received in topk_ids /
// topk_weights), a selection bias, a shared expert of inter 16.
struct FusedMoeProblem {
  FusedMoeArgs a;
  FusedMoeProblem() {
    a.x = TensorView::contiguous(fake(), DType::kBF16, {16, 64});
    a.w1 = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 64, 64});
    a.w2 = TensorView::contiguous(fake(2 << 24), DType::kBF16, {8, 64, 32});
    a.router_logits = TensorView::contiguous(fake(3 << 24), DType::kFP32, {16, 8});
    a.top_k = 2;
    a.selection_bias = TensorView::contiguous(fake(4 << 24), DType::kFP32, {8});
    a.topk_ids = TensorView::contiguous(fake(5 << 24), DType::kInt32, {16, 2});
    a.topk_weights = TensorView::contiguous(fake(6 << 24), DType::kFP32, {16, 2});
    a.shared_w1 = TensorView::contiguous(fake(7 << 24), DType::kBF16, {32, 64});
    a.shared_w2 = TensorView::contiguous(fake(8 << 24), DType::kBF16, {64, 16});
    a.out = TensorView::contiguous(fake(9 << 24), DType::kBF16, {16, 64});
    a.workspace = fake(10 << 24);
    a.workspace_size = fused_moe_workspace_bytes(16, 64, 32, 8, 2, 16);
  }
  void run() { fused_moe(a, nullptr); }
};

// The routing given by the caller: topk_ids / topk_weights are inputs, no logits.
struct FusedMoeGivenProblem : FusedMoeProblem {
  FusedMoeGivenProblem() {
    a.router_logits = TensorView();
    a.selection_bias = TensorView();
  }
};

// ValidationTable's generic view rules over the MoE entry points' tensors (routing, permutation,
// grouped GEMM, combine, the fused layer). "null data" is skipped for optional tensors (a null view
// there means "not given").
TEST(BadInputMoeGemm, EveryBrokenViewRuleNamesItsArgument) {
  if (gpu_visible()) GTEST_SKIP() << "fake device pointers: runs where no GPU is visible";
  const std::vector<ViewRule> rules = {
      {"dtype", false, [](TensorView& t) { t.dtype = t.dtype == DType::kInt32 ? DType::kFP32 : DType::kInt32; }},
      {"rank", false, [](TensorView& t) { t.shape[t.rank] = 1, t.stride[t.rank] = 1, ++t.rank; }},
      {"null data", false, [](TensorView& t) { t.data = nullptr; }},
      {"host memory", false, [](TensorView& t) { t.device = Device::kCPU; }},
      {"misaligned", false, [](TensorView& t) { t.data = static_cast<char*>(t.data) + 1; }},
      {"extent past 2^63 bytes", false, [](TensorView& t) { t.stride[0] = int64_t(1) << 62; }},
      {"broadcast output", true, [](TensorView& t) { t.stride[0] = 0; }},
  };
  using RP = MoeRouteProblem;
  using PP = MoePermuteProblem;
  using GP = MoeGemmProblem;
  using GG = MoeGemmGatheredProblem;
  using CP = MoeCombineProblem;
  using FP = FusedMoeProblem;
  using FG = FusedMoeGivenProblem;
  auto in = [](auto get) { return std::make_pair(false, get); };
  auto out = [](auto get) { return std::make_pair(true, get); };
  std::vector<TableEntry> t;
  t.push_back(table_entry<RP>("moe_route", [](RP& p) { p.run(); },
      {{"logits", in(std::function<TensorView&(RP&)>([](RP& p) -> TensorView& { return p.a.logits; }))},
       {"topk_ids", out(std::function<TensorView&(RP&)>([](RP& p) -> TensorView& { return p.a.topk_ids; }))},
       {"topk_weights", out(std::function<TensorView&(RP&)>([](RP& p) -> TensorView& { return p.a.topk_weights; }))}}));
  t.push_back(table_entry<PP>("moe_permute", [](PP& p) { p.run(); },
      {{"topk_ids", in(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.topk_ids; }))},
       {"expert_offsets", out(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.expert_offsets; }))},
       {"permuted_token", out(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.permuted_token; }))},
       {"inverse", out(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.inverse; }))}}));
  t.push_back(table_entry<GP>("moe_grouped_gemm", [](GP& p) { p.run(); },
      {{"a", in(std::function<TensorView&(GP&)>([](GP& p) -> TensorView& { return p.a.a; }))},
       {"weights", in(std::function<TensorView&(GP&)>([](GP& p) -> TensorView& { return p.a.weights; }))},
       {"expert_offsets", in(std::function<TensorView&(GP&)>([](GP& p) -> TensorView& { return p.a.expert_offsets; }))},
       {"out", out(std::function<TensorView&(GP&)>([](GP& p) -> TensorView& { return p.a.out; }))}}));
  t.push_back(table_entry<CP>("moe_combine", [](CP& p) { p.run(); },
      {{"expert_out", in(std::function<TensorView&(CP&)>([](CP& p) -> TensorView& { return p.a.expert_out; }))},
       {"inverse", in(std::function<TensorView&(CP&)>([](CP& p) -> TensorView& { return p.a.inverse; }))},
       {"topk_weights", in(std::function<TensorView&(CP&)>([](CP& p) -> TensorView& { return p.a.topk_weights; }))},
       {"out", out(std::function<TensorView&(CP&)>([](CP& p) -> TensorView& { return p.a.out; }))}}));
  t.push_back(table_entry<FP>("fused_moe", [](FP& p) { p.run(); },
      {{"x", in(std::function<TensorView&(FP&)>([](FP& p) -> TensorView& { return p.a.x; }))},
       {"w1", in(std::function<TensorView&(FP&)>([](FP& p) -> TensorView& { return p.a.w1; }))},
       {"w2", in(std::function<TensorView&(FP&)>([](FP& p) -> TensorView& { return p.a.w2; }))},
       {"out", out(std::function<TensorView&(FP&)>([](FP& p) -> TensorView& { return p.a.out; }))}}));
  t.push_back(table_entry<FG>("fused_moe", [](FG& p) { p.run(); },
      {{"topk_ids", in(std::function<TensorView&(FG&)>([](FG& p) -> TensorView& { return p.a.topk_ids; }))},
       {"topk_weights", in(std::function<TensorView&(FG&)>([](FG& p) -> TensorView& { return p.a.topk_weights; }))}}));
  // Optional tensors: every rule but "null data".
  std::vector<TableEntry> optional;
  optional.push_back(table_entry<RP>("moe_route", [](RP& p) { p.run(); },
      {{"selection_bias", in(std::function<TensorView&(RP&)>([](RP& p) -> TensorView& { return p.a.selection_bias; }))}}));
  optional.push_back(table_entry<PP>("moe_permute", [](PP& p) { p.run(); },
      {{"x", in(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.x; }))},
       {"permuted_x", out(std::function<TensorView&(PP&)>([](PP& p) -> TensorView& { return p.a.permuted_x; }))}}));
  optional.push_back(table_entry<GG>("moe_grouped_gemm", [](GG& p) { p.run(); },
      {{"a_rows", in(std::function<TensorView&(GG&)>([](GG& p) -> TensorView& { return p.a.a_rows; }))}}));
  optional.push_back(table_entry<CP>("moe_combine", [](CP& p) { p.run(); },
      {{"shared_out", in(std::function<TensorView&(CP&)>([](CP& p) -> TensorView& { return p.a.shared_out; }))}}));
  optional.push_back(table_entry<FP>("fused_moe", [](FP& p) { p.run(); },
      {{"router_logits", in(std::function<TensorView&(FP&)>([](FP& p) -> TensorView& { return p.a.router_logits; }))},
       {"selection_bias", in(std::function<TensorView&(FP&)>([](FP& p) -> TensorView& { return p.a.selection_bias; }))},
       {"shared_w1", in(std::function<TensorView&(FP&)>([](FP& p) -> TensorView& { return p.a.shared_w1; }))},
       {"shared_w2", in(std::function<TensorView&(FP&)>([](FP& p) -> TensorView& { return p.a.shared_w2; }))},
       {"topk_ids", out(std::function<TensorView&(FP&)>([](FP& p) -> TensorView& { return p.a.topk_ids; }))},
       {"topk_weights", out(std::function<TensorView&(FP&)>([](FP& p) -> TensorView& { return p.a.topk_weights; }))}}));
  int cases = 0;
  for (bool is_optional : {false, true}) {
    for (const TableEntry& e : is_optional ? optional : t) {
      {
        auto problem = e.make();
        expect_passes_validation([&] { e.call(problem.get()); }, e.entry);
      }
      for (const TableArg& arg : e.args) {
        for (const ViewRule& rule : rules) {
          if (rule.outputs_only && !arg.output) continue;
          if (is_optional && std::string(rule.rule) == "null data") continue;
          auto problem = e.make();
          TensorView& view = arg.view(problem.get());
          rule.apply(view);
          SCOPED_TRACE(std::string(e.entry) + " argument " + arg.name + ": " + rule.rule);
          const bool route_option = std::string(arg.name) == "selection_bias";
          // x alone without permuted_x (or the reverse) is refused as the pair's rule, naming either.
          std::vector<std::string> named = {arg.name};
          if (std::string(e.entry) == "moe_permute" && (std::string(arg.name) == "x" || std::string(arg.name) == "permuted_x"))
            named = {"x", "permuted_x"};
          expect_arg_error(e.entry, [&] { e.call(problem.get()); }, named, route_option ? "moe_route" : nullptr);
          ++cases;
        }
      }
    }
  }
  EXPECT_GT(cases, 100);
}

TEST(BadInputMoeGemm, ShapesDtypesStridesAndLimits) {
  if (gpu_visible()) GTEST_SKIP() << "fake device pointers: runs where no GPU is visible";
  const char* kEntry = "moe_grouped_gemm";
  auto fails = [&](const std::function<void(MoeGroupedGemmArgs&)>& brk, std::vector<std::string> args) {
    MoeGemmProblem p;
    brk(p.a);
    expect_arg_error(kEntry, [&] { p.run(); }, std::move(args));
  };
  {
    MoeGemmProblem p;
    expect_passes_validation([&] { p.run(); }, kEntry);
    p.a.activation = MoeActivation::kSwiGLU;
    p.a.weights = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 144, 72});
    p.a.out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {64, 72});
    expect_passes_validation([&] { p.run(); }, "moe_grouped_gemm kSwiGLU");
    p.a.a = TensorView::strided(fake(), DType::kBF16, {64, 72}, {136, 1});  // a slice: row stride 136
    p.a.out = TensorView::strided(fake(3 << 24), DType::kBF16, {64, 72}, {80, 1});
    p.a.weights = TensorView::strided(fake(1 << 24), DType::kBF16, {8, 144, 72}, {144 * 80, 80, 1});
    expect_passes_validation([&] { p.run(); }, "moe_grouped_gemm strided");
  }
  fails([](auto& a) { a.a.dtype = DType::kFP32; }, {"a"});
  fails([](auto& a) { a.weights.dtype = DType::kFP16; }, {"weights"});  // not a's dtype
  fails([](auto& a) { a.out.dtype = DType::kFP16; }, {"out"});
  fails([](auto& a) { a.expert_offsets = TensorView::contiguous(fake(2 << 24), DType::kInt32, {8}); }, {"expert_offsets"});
  fails([](auto& a) { a.expert_offsets.dtype = DType::kFP32; }, {"expert_offsets"});
  fails([](auto& a) { a.expert_offsets = TensorView::strided(fake(2 << 24), DType::kInt32, {9}, {2}); }, {"expert_offsets"});
  fails([](auto& a) { a.expert_offsets.device = Device::kCPU; }, {"expert_offsets"});  // read on the device
  // K a multiple of 8, and the same in a and the weights.
  fails([](auto& a) {
    a.a = TensorView::contiguous(fake(), DType::kBF16, {64, 68});
    a.weights = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 136, 68});
  }, {"a", "weights"});
  fails([](auto& a) { a.a = TensorView::contiguous(fake(), DType::kBF16, {64, 80}); }, {"a", "weights"});
  // N (and I) multiples of 8; out's columns N, or N / 2 with SwiGLU.
  fails([](auto& a) {
    a.weights = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 132, 72});
    a.out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {64, 132});
  }, {"weights", "out"});
  fails([](auto& a) {
    a.activation = MoeActivation::kSwiGLU;  // N 136: I = 68
    a.out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {64, 68});
  }, {"weights", "out", "activation"});
  fails([](auto& a) {  // out holds N, not N / 2
    a.activation = MoeActivation::kSwiGLU;
    a.weights = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 144, 72});
    a.out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {64, 144});
  }, {"out"});
  fails([](auto& a) { a.out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {64, 68}); }, {"out"});
  fails([](auto& a) { a.activation = static_cast<MoeActivation>(7); }, {"activation"});
  // Rows: out as many as a.
  fails([](auto& a) { a.out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {63, 136}); }, {"out"});
  // Strides: contiguous columns, row strides multiples of 8 elements, the weights' K contiguous.
  fails([](auto& a) { a.a = TensorView::strided(fake(), DType::kBF16, {64, 72}, {76, 1}); }, {"a"});
  fails([](auto& a) { a.a = TensorView::strided(fake(), DType::kBF16, {64, 72}, {144, 2}); }, {"a"});
  fails([](auto& a) { a.out = TensorView::strided(fake(3 << 24), DType::kBF16, {64, 136}, {140, 1}); }, {"out"});
  fails([](auto& a) { a.out = TensorView::strided(fake(3 << 24), DType::kBF16, {64, 136}, {272, 2}); }, {"out"});
  fails([](auto& a) {
    a.weights = TensorView::strided(fake(1 << 24), DType::kBF16, {8, 136, 72}, {136 * 144, 144, 2});
  }, {"weights"});
  // Limits: at most 1024 experts, fewer than 2^31 rows.
  fails([](auto& a) {
    a.weights = TensorView::contiguous(fake(1 << 24), DType::kBF16, {1025, 8, 72});
    a.expert_offsets = TensorView::contiguous(fake(2 << 24), DType::kInt32, {1026});
    a.out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {64, 8});
  }, {"weights", "expert_offsets"});
  fails([](auto& a) {
    a.a = TensorView::contiguous(fake(), DType::kBF16, {int64_t(1) << 31, 8});
    a.weights = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 8, 8});
    a.out = TensorView::contiguous(fake(int64_t(1) << 36), DType::kBF16, {int64_t(1) << 31, 8});
  }, {"a", "out"});
  // out apart from every input.
  fails([](auto& a) { a.out = TensorView::contiguous(fake(), DType::kBF16, {64, 136}); }, {"out"});  // over a
  fails([](auto& a) { a.out = TensorView::contiguous(fake((1 << 24) + 256), DType::kBF16, {64, 136}); }, {"out"});
  fails([](auto& a) { a.out = TensorView::contiguous(fake((2 << 24) - 64), DType::kBF16, {64, 136}); },
        {"out", "expert_offsets"});
}

// a_rows (product row r reads a[a_rows[r]]): a 1-D contiguous int32 device array of out's rows, apart
// from out; `a` then has any number of rows (a size mismatch between a_rows and out blames out).
TEST(BadInputMoeGemm, GatheredRows) {
  if (gpu_visible()) GTEST_SKIP() << "fake device pointers: runs where no GPU is visible";
  const char* kEntry = "moe_grouped_gemm";
  auto fails = [&](const std::function<void(MoeGroupedGemmArgs&)>& brk, std::vector<std::string> args) {
    MoeGemmGatheredProblem p;
    brk(p.a);
    expect_arg_error(kEntry, [&] { p.run(); }, std::move(args));
  };
  {
    MoeGemmGatheredProblem p;  // a 24 rows, out 64
    expect_passes_validation([&] { p.run(); }, "moe_grouped_gemm with a_rows, fewer rows of a than out");
    p.a.a = TensorView::contiguous(fake(), DType::kBF16, {200, 72});
    expect_passes_validation([&] { p.run(); }, "moe_grouped_gemm with a_rows, more rows of a than out");
    p.a.a = TensorView::contiguous(fake(), DType::kBF16, {1, 72});
    expect_passes_validation([&] { p.run(); }, "moe_grouped_gemm with a_rows, one row of a");
    p.a.a = TensorView::contiguous(fake(), DType::kBF16, {64, 72});
    expect_passes_validation([&] { p.run(); }, "moe_grouped_gemm with a_rows, as many rows of a as out");
    p.a.a = TensorView::strided(fake(), DType::kBF16, {24, 72}, {136, 1});  // a column slice of x
    p.a.activation = MoeActivation::kSwiGLU;
    p.a.weights = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 144, 72});
    p.a.out = TensorView::strided(fake(3 << 24), DType::kBF16, {64, 72}, {80, 1});
    expect_passes_validation([&] { p.run(); }, "moe_grouped_gemm with a_rows, kSwiGLU, strided");
    MoeGemmGatheredProblem none;  // no product rows
    none.a.a_rows = TensorView::contiguous(fake(4 << 24), DType::kInt32, {0});
    none.a.out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {0, 136});
    expect_passes_validation([&] { none.run(); }, "moe_grouped_gemm with a_rows, no rows");
  }
  fails([](auto& a) { a.a_rows.dtype = DType::kFP32; }, {"a_rows"});
  fails([](auto& a) { a.a_rows = TensorView::contiguous(fake(4 << 24), DType::kInt32, {64, 1}); }, {"a_rows"});
  fails([](auto& a) { a.a_rows = TensorView::contiguous(fake(4 << 24), DType::kInt32, {1, 64}); }, {"a_rows"});
  fails([](auto& a) { a.a_rows = TensorView::strided(fake(4 << 24), DType::kInt32, {64}, {2}); }, {"a_rows"});
  fails([](auto& a) { a.a_rows.device = Device::kCPU; }, {"a_rows"});  // read on the device
  fails([](auto& a) { a.a_rows.data = static_cast<char*>(a.a_rows.data) + 2; }, {"a_rows"});  // misaligned
  // rows = a_rows.size(0) = out.size(0): a mismatch names out (against a_rows' rows).
  for (int64_t rows : {63, 65}) {
    MoeGemmGatheredProblem p;
    p.a.a_rows = TensorView::contiguous(fake(4 << 24), DType::kInt32, {rows});
    expect_arg_error(kEntry, [&] { p.run(); }, {"out"});
    expect_error([&] { p.run(); }, {"argument 'out'", "a_rows"});
  }
  // out apart from a_rows (and from a, as without a_rows).
  fails([](auto& a) { a.a_rows = TensorView::contiguous(fake(3 << 24), DType::kInt32, {64}); }, {"out"});
  fails([](auto& a) { a.a_rows = TensorView::contiguous(fake((3 << 24) + 64 * 136), DType::kInt32, {64}); }, {"out"});
  fails([](auto& a) { a.out = TensorView::contiguous(fake(), DType::kBF16, {64, 136}); }, {"out"});
  // The rules on a itself still hold with a_rows: dtype, K (against the weights), strides.
  fails([](auto& a) { a.a.dtype = DType::kFP32; }, {"a"});
  fails([](auto& a) { a.a = TensorView::contiguous(fake(), DType::kBF16, {24, 80}); }, {"a", "weights"});
  fails([](auto& a) { a.a = TensorView::strided(fake(), DType::kBF16, {24, 72}, {76, 1}); }, {"a"});
  // Without a_rows, a's rows must still equal out's.
  fails([](auto& a) { a.a_rows = TensorView(); }, {"out"});
}

TEST(BadInputMoeCombine, ShapesDtypesAndOverlaps) {
  if (gpu_visible()) GTEST_SKIP() << "fake device pointers: runs where no GPU is visible";
  const char* kEntry = "moe_combine";
  auto fails = [&](const std::function<void(MoeCombineArgs&)>& brk, std::vector<std::string> args) {
    MoeCombineProblem p;
    brk(p.a);
    expect_arg_error(kEntry, [&] { p.run(); }, std::move(args));
  };
  {
    MoeCombineProblem p;
    expect_passes_validation([&] { p.run(); }, kEntry);
    p.a.shared_out = TensorView();
    expect_passes_validation([&] { p.run(); }, "moe_combine without shared_out");
  }
  fails([](auto& a) { a.expert_out.dtype = DType::kFP32; }, {"expert_out"});
  fails([](auto& a) { a.expert_out = TensorView::strided(fake(), DType::kBF16, {40, 64}, {128, 2}); }, {"expert_out"});
  fails([](auto& a) { a.inverse.dtype = DType::kFP32; }, {"inverse"});
  fails([](auto& a) { a.inverse = TensorView::strided(fake(1 << 24), DType::kInt32, {16, 2}, {4, 1}); }, {"inverse"});
  fails([](auto& a) { a.topk_weights.dtype = DType::kBF16; }, {"topk_weights"});
  fails([](auto& a) { a.topk_weights = TensorView::contiguous(fake(2 << 24), DType::kFP32, {16, 3}); },
        {"topk_weights", "inverse"});
  fails([](auto& a) { a.shared_out.dtype = DType::kFP16; }, {"shared_out"});
  fails([](auto& a) { a.shared_out = TensorView::contiguous(fake(3 << 24), DType::kBF16, {16, 56}); }, {"shared_out"});
  fails([](auto& a) { a.out.dtype = DType::kFP16; }, {"out"});
  fails([](auto& a) { a.out = TensorView::contiguous(fake(4 << 24), DType::kBF16, {16, 72}); }, {"out"});
  fails([](auto& a) { a.out = TensorView::contiguous(fake(4 << 24), DType::kBF16, {15, 64}); }, {"out", "inverse"});
  fails([](auto& a) { a.out = TensorView::contiguous(fake(128), DType::kBF16, {16, 64}); }, {"out", "expert_out"});
  fails([](auto& a) { a.out = TensorView::contiguous(fake(1 << 24), DType::kBF16, {16, 64}); }, {"out", "inverse"});
}

TEST(BadInputFusedMoe, ShapesRoutingAndWorkspace) {
  if (gpu_visible()) GTEST_SKIP() << "fake device pointers: runs where no GPU is visible";
  const char* kEntry = "fused_moe";
  auto fails = [&](const std::function<void(FusedMoeArgs&)>& brk, std::vector<std::string> args,
                   const char* alt_entry = nullptr) {
    FusedMoeProblem p;
    brk(p.a);
    expect_arg_error(kEntry, [&] { p.run(); }, std::move(args), alt_entry);
  };
  {
    FusedMoeProblem p;
    expect_passes_validation([&] { p.run(); }, kEntry);
    FusedMoeGivenProblem g;
    expect_passes_validation([&] { g.run(); }, "fused_moe with the caller's routing");
    FusedMoeProblem q;  // no routing outputs, no shared expert, no bias
    q.a.topk_ids = q.a.topk_weights = q.a.shared_w1 = q.a.shared_w2 = q.a.selection_bias = TensorView();
    q.a.workspace_size = fused_moe_workspace_bytes(16, 64, 32, 8, 2);
    expect_passes_validation([&] { q.run(); }, "fused_moe, logits only");
  }
  fails([](auto& a) { a.x.dtype = DType::kFP32; }, {"x"});
  fails([](auto& a) { a.w1.dtype = DType::kFP16; }, {"w1"});
  fails([](auto& a) { a.w2.dtype = DType::kFP16; }, {"w2"});
  fails([](auto& a) { a.w1 = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 64, 72}); }, {"w1"});  // hidden
  fails([](auto& a) { a.w1 = TensorView::contiguous(fake(1 << 24), DType::kBF16, {8, 72, 64}); }, {"w1", "w2"});
  fails([](auto& a) { a.w2 = TensorView::contiguous(fake(2 << 24), DType::kBF16, {8, 72, 32}); }, {"w2"});
  fails([](auto& a) { a.w2 = TensorView::contiguous(fake(2 << 24), DType::kBF16, {4, 64, 32}); }, {"w2", "w1"});
  fails([](auto& a) { a.router_logits = TensorView::contiguous(fake(3 << 24), DType::kFP32, {16, 4}); },
        {"router_logits"});
  fails([](auto& a) { a.router_logits = TensorView::contiguous(fake(3 << 24), DType::kFP32, {15, 8}); },
        {"router_logits"});
  fails([](auto& a) { a.top_k = 0; }, {"top_k"});
  fails([](auto& a) { a.top_k = 9; }, {"top_k"});  // more than the 8 experts
  fails([](auto& a) { a.router_logits.dtype = DType::kInt32; }, {"router_logits"});
  fails([](auto& a) { a.num_groups = 3; }, {"num_groups"}, "moe_route");
  fails([](auto& a) { a.selection_bias = TensorView::contiguous(fake(4 << 24), DType::kFP32, {7}); },
        {"selection_bias"}, "moe_route");
  fails([](auto& a) { a.topk_ids = TensorView::contiguous(fake(5 << 24), DType::kInt32, {16, 3}); },
        {"topk_ids", "top_k"});
  fails([](auto& a) {  // no routing at all
    a.router_logits = a.selection_bias = a.topk_ids = a.topk_weights = TensorView();
  }, {"topk_ids", "router_logits"});
  fails([](auto& a) {  // the caller's ids without their weights
    a.router_logits = a.selection_bias = a.topk_weights = TensorView();
  }, {"topk_weights", "router_logits"});
  fails([](auto& a) { a.shared_w2 = TensorView(); }, {"shared_w2", "shared_w1"});
  fails([](auto& a) { a.shared_w1 = TensorView::contiguous(fake(7 << 24), DType::kBF16, {32, 72}); }, {"shared_w1"});
  fails([](auto& a) { a.shared_w2 = TensorView::contiguous(fake(8 << 24), DType::kBF16, {64, 24}); },
        {"shared_w2", "shared_w1"});
  fails([](auto& a) { a.out.dtype = DType::kFP16; }, {"out"});
  fails([](auto& a) { a.out = TensorView::contiguous(fake(9 << 24), DType::kBF16, {16, 72}); }, {"out"});
  fails([](auto& a) { a.out = TensorView::contiguous(fake(64), DType::kBF16, {16, 64}); }, {"out", "x"});  // over x
  fails([](auto& a) { a.workspace = nullptr; }, {"workspace"});
  fails([](auto& a) { a.workspace_size -= 1; }, {"workspace_size"});
  fails([](auto& a) { a.workspace = fake((10 << 24) + 8); }, {"workspace"});  // 8- but not 16-byte aligned
  fails([](auto& a) { a.workspace = fake(9 << 24); }, {"workspace", "out"});     // over out
  expect_arg_error("fused_moe_workspace_bytes", [] { fused_moe_workspace_bytes(16, 64, 32, 8, 0); }, {"top_k"});
  expect_arg_error("fused_moe_workspace_bytes", [] { fused_moe_workspace_bytes(16, 64, 32, 0, 2); }, {"num_experts"});
  // Limits that only the later steps knew, now refused before the first launch under fused_moe's
  // names: weights the copy engine cannot read (negative strides), permuted rows past the grouped
  // GEMM's 2^31 - 256, sizes whose workspace would not fit 64 bits.
  fails([](auto& a) {
    a.w2 = TensorView::strided(reinterpret_cast<char*>(a.w2.data) + 2 * 31 * 32 * 2, DType::kBF16, {8, 64, 32},
                               {64 * 32, -32, 1});
  }, {"w2"});
  fails([](auto& a) {
    a.x = TensorView::strided(a.x.data, DType::kBF16, {int64_t(1) << 28, 64}, {0, 1});  // broadcast rows
    a.out = TensorView::strided(a.out.data, DType::kBF16, {int64_t(1) << 28, 64}, {64, 1});
    a.router_logits = TensorView::strided(a.router_logits.data, DType::kFP32, {int64_t(1) << 28, 8}, {0, 1});
    a.topk_ids = a.topk_weights = TensorView();
    a.top_k = 8;  // 2^31 permuted rows
  }, {"x"});
  expect_arg_error("fused_moe_workspace_bytes", [] { fused_moe_workspace_bytes(16, int64_t(1) << 30, 32, 8, 2); },
                   {"hidden"});
  expect_arg_error("fused_moe_workspace_bytes",
                   [] { fused_moe_workspace_bytes((int64_t(1) << 31) / 8, 64, 32, 8, 8); }, {"tokens"});
}

}  // namespace
}  // namespace tessera
