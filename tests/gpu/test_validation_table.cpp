// The validation table where it needs a GPU (its CPU half: tests/cpu/test_bad_input.cpp,
// ValidationTable.*). BatchDecoder and BatchPrefillPaged query the device when they are made, so
// their plan() and run() are tested here, over real device buffers: each tensor argument x each
// view rule, and each index-range rule of the host arrays they read. Every case expects a
// tessera::Error from the entry point charged to the argument ("tessera::<entry>: argument
// '<name>'"), and o / lse, poisoned before, unwritten after: a rule that validation missed would
// launch. The valid step, run last, writes every element of o and lse (so each case was refused for
// its one broken rule). Without a GPU the tests skip.
#include <gmock/gmock.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dispatch/decode_dispatch.h"
#include "dispatch/prefill_dispatch.h"
#include "gpu/gpu_test_util.h"
#include "gpu/paged_kv_util.h"
#include "tessera/attention.h"
#include "tessera/decode.h"

namespace tessera::testing {
namespace {

// A head dim and dtype compiled for both decode and prefill (hd128 bf16 first).
bool pick_compiled(KVGeometry& g) {
  const std::vector<int> dims = dispatch::compiled_prefill_head_dims();
  for (int hd : {128, 64, 256}) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      if (dispatch::decode_compiled(dt, hd) && dispatch::prefill_dtype_compiled(dt) &&
          std::find(dims.begin(), dims.end(), hd) != dims.end()) {
        g.head_dim = hd;
        g.dtype = dt;
        return true;
      }
    }
  }
  return false;
}

// Whether `call` threw a tessera::Error from `entry` charged to `arg` whose rule contains `rule`;
// `what` receives its message ("accepted" when nothing was thrown).
bool charged(const std::function<void()>& call, const std::string& entry, const std::string& arg,
             const std::string& rule, std::string& what) {
  try {
    call();
    what = "accepted";
    return false;
  } catch (const Error& e) {
    what = e.what();
    return what.find("tessera::" + entry + ": argument '" + arg + "'") != std::string::npos &&
           what.find(rule) != std::string::npos;
  }
}

bool all_poison(const DeviceBuffer& b) {
  const std::vector<uint8_t> bytes = b.download<uint8_t>(b.bytes());
  return std::all_of(bytes.begin(), bytes.end(), [](uint8_t x) { return x == 0xFF; });
}
// Every 16-bit element of o and every fp32 element of lse lost its poison.
bool fully_written(const DeviceBuffer& o, const DeviceBuffer& lse) {
  const std::vector<uint16_t> o_bits = o.download<uint16_t>(o.bytes() / 2);
  const std::vector<float> lse_values = lse.download<float>(lse.bytes() / 4);
  return std::none_of(o_bits.begin(), o_bits.end(), [](uint16_t b) { return b == kPoison16; }) &&
         std::none_of(lse_values.begin(), lse_values.end(), is_poison);
}

void add_unit_dim(TensorView& t) { t.shape[t.rank] = 1, t.stride[t.rank] = 1, ++t.rank; }

// The view rules of the CPU table.
struct ViewRule {
  const char* rule;
  bool outputs_only;
  std::function<void(TensorView&)> apply;
};
std::vector<ViewRule> view_rules() {
  return {
      {"dtype", false, [](TensorView& t) { t.dtype = t.dtype == DType::kInt32 ? DType::kFP32 : DType::kInt32; }},
      {"rank", false, add_unit_dim},
      {"null data", false, [](TensorView& t) { t.data = nullptr; }},
      {"host memory", false, [](TensorView& t) { t.device = Device::kCPU; }},
      {"misaligned", false, [](TensorView& t) { t.data = static_cast<char*>(t.data) + 1; }},
      {"extent past 2^63 bytes", false, [](TensorView& t) { t.stride[0] = int64_t(1) << 62; }},
      {"broadcast output", true, [](TensorView& t) { t.stride[0] = 0; }},
  };
}

template <typename Args>
struct ViewArg {
  const char* name;
  bool output;
  std::function<TensorView&(Args&)> view;
};

// The host side of one plan() / run() call, which an index row edits: copies of the step's arrays,
// the host copies left out (null), and num_pages for plan().
struct HostTable {
  std::vector<int32_t> qo, indptr, indices, last;
  bool no_qo = false, no_indptr = false, no_indices = false, no_last = false;
  int64_t num_pages = -1;
  const int32_t* host_qo() const { return no_qo ? nullptr : qo.data(); }
  void attach(PageTable& t) const {
    t.host_indptr = no_indptr ? nullptr : indptr.data();
    t.host_indices = no_indices ? nullptr : indices.data();
    t.host_last_page_len = no_last ? nullptr : last.data();
  }
};

// One row of an index table: `edit` breaks one rule of the step's host arrays. `open`, where set,
// is a known gap (the call is accepted, or refused with an error charged elsewhere), said how: such
// a row passes while the error is not charged to `arg`, and fails once it is, so that the note goes
// with the gap.
struct IndexRow {
  const char* entry;
  const char* arg;
  const char* rule;  // a fragment of the rule the error states
  std::function<void(HostTable&)> edit;
  const char* open = nullptr;
};

// Runs every row against `call` over a copy of `base`; o / lse must stay poisoned.
void check_index_rows(const std::vector<IndexRow>& rows, const HostTable& base,
                      const std::function<void(const HostTable&)>& call, const DeviceBuffer& o,
                      const DeviceBuffer& lse) {
  for (const IndexRow& row : rows) {
    SCOPED_TRACE(std::string(row.entry) + " argument " + row.arg + ": " + row.rule);
    HostTable h = base;
    row.edit(h);
    std::string what;
    const bool ok = charged([&] { call(h); }, row.entry, row.arg, row.rule, what);
    if (row.open == nullptr) {
      EXPECT_TRUE(ok) << "got: " << what;
    } else {
      EXPECT_FALSE(ok) << "now charged to '" << row.arg << "': drop the row's open note (" << row.open << ")";
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(all_poison(o) && all_poison(lse)) << "a rejected call wrote o / lse";
  }
}

// Runs each view rule on each argument of `make()`'s valid arguments against `run`, which must
// refuse it naming `entry` and the argument; o / lse must stay poisoned. Counts the cases run.
template <typename A>
void check_view_rows(const std::vector<ViewArg<A>>& args, const char* entry, const std::function<A()>& make,
                     const std::function<void(const A&)>& run, const DeviceBuffer& o, const DeviceBuffer& lse,
                     int& cases) {
  cases = 0;
  for (const ViewArg<A>& arg : args) {
    for (const ViewRule& rule : view_rules()) {
      if (rule.outputs_only && !arg.output) continue;
      SCOPED_TRACE(std::string(entry) + " argument " + arg.name + ": " + rule.rule);
      A a = make();
      rule.apply(arg.view(a));
      std::string what;
      EXPECT_TRUE(charged([&] { run(a); }, entry, arg.name, "", what)) << "got: " << what;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(all_poison(o) && all_poison(lse)) << "a rejected run() wrote o / lse";
      ++cases;
    }
  }
}

// ---- BatchDecoder ----------------------------------------------------------------------------------
// One decode step: 3 requests of 20, 5 and 40 keys in pages of 16 (9 pages, shuffled), 1 / 2 / 1
// query tokens, 8 query heads over 2 KV heads; its decoder; o and lse poisoned.
DecodeConfig decode_config(const KVGeometry& g) {
  DecodeConfig c;
  c.num_qo_heads = 8;
  c.num_kv_heads = g.num_kv_heads;
  c.head_dim = g.head_dim;
  c.page_size = g.page_size;
  c.dtype = g.dtype;
  c.layout = g.layout;
  c.max_batch_size = 3;
  c.max_qo_len = 2;
  return c;
}

struct DecodeStep {
  KVGeometry g;
  DecodeConfig cfg;
  std::mt19937 rng{1300};
  HostPagedKV kv;
  std::vector<int32_t> qo_indptr{0, 1, 3, 4};
  HostRows q;
  DevicePagedKV dkv;
  DeviceBuffer dq, o, lse, ws;
  BatchDecoder decoder;

  explicit DecodeStep(const KVGeometry& geometry)
      : g(geometry), cfg(decode_config(geometry)), kv(make_paged_kv(g, {20, 5, 40}, 0, rng)),
        q(random_rows(4, cfg.num_qo_heads, g.head_dim, 0, g.dtype, rng, 2.f)), dkv(kv, kv.batch()),
        dq(q.bits.size() * 2), o(q.bits.size() * 2), lse(size_t(q.rows * q.heads) * 4),
        ws(BatchDecoder::workspace_bytes(cfg)), decoder(cfg, ws.get(), ws.bytes()) {
    dkv.upload(kv);
    dq.upload(q.bits);
    o.poison();
    lse.poison();
  }

  struct RunArgs {
    TensorView q, o, lse;
    PagedKVCache cache;
    PageTable table;
  };
  RunArgs run_args() const {
    return {TensorView::contiguous(dq.get(), g.dtype, {q.rows, q.heads, q.dim}),
            TensorView::contiguous(o.get(), g.dtype, {q.rows, q.heads, q.dim}),
            TensorView::contiguous(lse.get(), DType::kFP32, {q.rows, q.heads}), dkv.cache(kv), dkv.table(kv)};
  }
  void run(const RunArgs& a) { decoder.run(a.q, a.cache, a.table, a.o, a.lse, nullptr); }
  HostTable host() const { return {qo_indptr, kv.indptr, kv.indices, kv.last_page_len, false, false, false, false, kv.num_pages}; }
  void plan(const HostTable& h) {
    PageTable t = dkv.table(kv);
    h.attach(t);
    decoder.plan(h.host_qo(), t, nullptr, h.num_pages);
  }
};

// BatchDecoder::run x {q, o, lse, k_pages, v_pages, kv_indices} x each view rule; BatchDecoder::plan's
// one view, kv_indptr (it reads the host copies only and takes the batch size from kv_indptr's
// length, so only its rank is a rule there).
TEST(GpuValidationTable, BatchDecoderNamesTheArgumentOfEveryBrokenViewRule) {
  TESSERA_REQUIRE_GPU();
  KVGeometry g;
  if (!pick_compiled(g)) GTEST_SKIP() << "no head dim / dtype compiled for both decode and prefill";
  DecodeStep s(g);
  using A = DecodeStep::RunArgs;
  const std::vector<ViewArg<A>> args = {
      {"q", false, [](A& a) -> TensorView& { return a.q; }},
      {"o", true, [](A& a) -> TensorView& { return a.o; }},
      {"lse", true, [](A& a) -> TensorView& { return a.lse; }},
      {"k_pages", false, [](A& a) -> TensorView& { return a.cache.k_pages; }},
      {"v_pages", false, [](A& a) -> TensorView& { return a.cache.v_pages; }},
      {"kv_indices", false, [](A& a) -> TensorView& { return a.table.indices; }},
  };
  {
    SCOPED_TRACE("BatchDecoder::plan argument kv_indptr: rank");
    PageTable t = s.dkv.table(s.kv);
    add_unit_dim(t.indptr);
    std::string what;
    EXPECT_TRUE(charged([&] { s.decoder.plan(s.qo_indptr.data(), t, nullptr, s.kv.num_pages); }, "BatchDecoder::plan",
                        "kv_indptr", "1-D", what))
        << "got: " << what;
  }
  s.plan(s.host());
  int cases = 0;
  check_view_rows<A>(args, "BatchDecoder::run", [&] { return s.run_args(); }, [&](const A& a) { s.run(a); }, s.o,
                     s.lse, cases);
  if (HasFatalFailure()) return;
  EXPECT_EQ(cases, 6 * 6 + 2);
  s.run(s.run_args());  // the valid step runs and writes every row
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(fully_written(s.o, s.lse)) << "the valid run() left elements of o / lse unwritten";
}

// The index-range rules of BatchDecoder::plan's host arrays that GpuDecodeBadInput.
// PlanArgumentsAreValidated does not already check (it checks page ids, kv_last_page_len past the
// page, qo_len past max_qo_len and the three host copies), and of what run() checks against the
// plan: the device kv_indices holding the planned page-table entries, a cache of the pages plan()
// checked the ids against. plan() has no q, so qo_indptr's end is checked by run() against q's rows
// (GpuDecodeBadInput.RunArgumentsAreValidated); the host copies' lengths are the caller's contract
// (kv_indptr's last entry is kv_indices' length there).
TEST(GpuValidationTable, BatchDecoderNamesTheArrayOfEveryBrokenIndexRule) {
  TESSERA_REQUIRE_GPU();
  KVGeometry g;
  if (!pick_compiled(g)) GTEST_SKIP() << "no head dim / dtype compiled for both decode and prefill";
  DecodeStep s(g);  // qo_indptr {0, 1, 3, 4}, kv_indptr {0, 2, 3, 6}, kv_last_page_len {4, 5, 8}, 9 pages
  const char* plan = "BatchDecoder::plan";
  const std::vector<IndexRow> rows = {
      {plan, "qo_indptr", "must start at 0", [](HostTable& h) { h.qo[0] = 1; }},
      {plan, "qo_indptr", "non-decreasing", [](HostTable& h) { h.qo[2] = 0; }},
      {plan, "kv_indptr", "must start at 0", [](HostTable& h) { h.indptr[0] = 1; }},
      {plan, "kv_indptr", "non-decreasing", [](HostTable& h) { h.indptr[1] = 4; }},
      {plan, "kv_last_page_len", "value 0 at index 1 is outside 1..16", [](HostTable& h) { h.last[1] = 0; }},
  };
  check_index_rows(rows, s.host(), [&](const HostTable& h) { s.plan(h); }, s.o, s.lse);

  s.plan(s.host());  // with num_pages 9
  struct RunRow {
    const char* arg;
    const char* rule;
    std::function<void(DecodeStep::RunArgs&)> edit;
  };
  const std::vector<RunRow> run_rows = {
      {"kv_indices", "has 5 entries but the plan's page table uses 6",
       [](DecodeStep::RunArgs& a) { a.table.indices.shape[0] = 5; }},
      {"k_pages", "holds 8 pages but plan() checked the page ids against 9",
       [](DecodeStep::RunArgs& a) { a.cache.k_pages.shape[0] = a.cache.v_pages.shape[0] = 8; }},
  };
  for (const RunRow& row : run_rows) {
    SCOPED_TRACE(std::string("BatchDecoder::run argument ") + row.arg + ": " + row.rule);
    DecodeStep::RunArgs a = s.run_args();
    row.edit(a);
    std::string what;
    EXPECT_TRUE(charged([&] { s.run(a); }, "BatchDecoder::run", row.arg, row.rule, what)) << "got: " << what;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(all_poison(s.o) && all_poison(s.lse)) << "a rejected run() wrote o / lse";
  }
  s.run(s.run_args());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(fully_written(s.o, s.lse)) << "the valid run() left elements of o / lse unwritten";
}

// ---- BatchPrefillPaged -----------------------------------------------------------------------------
// One paged prefill step: 3 requests of 5 / 20 / 3 query rows over 20 / 40 / 0 keys in pages of 16
// (8 pages, shuffled), 8 query heads over 2 KV heads, causal; a BatchPrefillPaged for its 28 rows;
// o and lse poisoned.
PagedPrefillConfig prefill_config(const KVGeometry& g) {
  PagedPrefillConfig c;
  c.num_qo_heads = 8;
  c.head_dim = g.head_dim;
  c.page_size = g.page_size;
  c.max_q_rows = 28;
  c.causal = true;
  return c;
}

struct PrefillStep {
  KVGeometry g;
  PagedPrefillConfig cfg;
  std::mt19937 rng{1400};
  HostPagedKV kv;
  std::vector<int32_t> qo_indptr{0, 5, 25, 28};
  HostRows q;
  DevicePagedKV dkv;
  DeviceBuffer dq, d_qo_indptr, o, lse, ws;
  BatchPrefillPaged prefill;

  explicit PrefillStep(const KVGeometry& geometry)
      : g(geometry), cfg(prefill_config(geometry)), kv(make_paged_kv(g, {20, 40, 0}, 0, rng)),
        q(random_rows(28, cfg.num_qo_heads, g.head_dim, 0, g.dtype, rng, 2.f)), dkv(kv, kv.batch()),
        dq(q.bits.size() * 2), d_qo_indptr(qo_indptr.size() * 4), o(q.bits.size() * 2),
        lse(size_t(q.rows * q.heads) * 4), ws(std::max<size_t>(BatchPrefillPaged::workspace_bytes(cfg), 256)),
        prefill(cfg, ws.get(), ws.bytes()) {
    dkv.upload(kv);
    dq.upload(q.bits);
    d_qo_indptr.upload(qo_indptr);
    o.poison();
    lse.poison();
  }

  HostTable host() const { return {qo_indptr, kv.indptr, kv.indices, kv.last_page_len, false, false, false, false, kv.num_pages}; }
  // run()'s arguments with the host copies of `h` (which must outlive them).
  PagedPrefillArgs args(const HostTable& h) const {
    PagedPrefillArgs a;
    a.q = TensorView::contiguous(dq.get(), g.dtype, {q.rows, q.heads, q.dim});
    a.qo_indptr = TensorView::contiguous(d_qo_indptr.get(), DType::kInt32, {int64_t(qo_indptr.size())});
    a.host_qo_indptr = h.host_qo();
    a.cache = dkv.cache(kv);
    a.table = dkv.table(kv);
    h.attach(a.table);
    a.o = TensorView::contiguous(o.get(), g.dtype, {q.rows, q.heads, q.dim});
    a.lse = TensorView::contiguous(lse.get(), DType::kFP32, {q.rows, q.heads});
    a.causal = true;
    return a;
  }
  void plan(const HostTable& h) {
    PageTable t = dkv.table(kv);
    h.attach(t);
    prefill.plan(h.host_qo(), t, nullptr, h.num_pages);
  }
};

// BatchPrefillPaged::run x each tensor argument of batch_prefill_paged x each view rule;
// BatchPrefillPaged::plan's one view, kv_indptr (rank only, as BatchDecoder::plan's).
TEST(GpuValidationTable, BatchPrefillPagedNamesTheArgumentOfEveryBrokenViewRule) {
  TESSERA_REQUIRE_GPU();
  KVGeometry g;
  if (!pick_compiled(g)) GTEST_SKIP() << "no head dim / dtype compiled for both decode and prefill";
  PrefillStep s(g);
  using A = PagedPrefillArgs;
  const std::vector<ViewArg<A>> args = {
      {"q", false, [](A& a) -> TensorView& { return a.q; }},
      {"o", true, [](A& a) -> TensorView& { return a.o; }},
      {"lse", true, [](A& a) -> TensorView& { return a.lse; }},
      {"k_pages", false, [](A& a) -> TensorView& { return a.cache.k_pages; }},
      {"v_pages", false, [](A& a) -> TensorView& { return a.cache.v_pages; }},
      {"qo_indptr", false, [](A& a) -> TensorView& { return a.qo_indptr; }},
      {"kv_indptr", false, [](A& a) -> TensorView& { return a.table.indptr; }},
      {"kv_indices", false, [](A& a) -> TensorView& { return a.table.indices; }},
      {"kv_last_page_len", false, [](A& a) -> TensorView& { return a.table.last_page_len; }},
  };
  const HostTable h = s.host();
  {
    SCOPED_TRACE("BatchPrefillPaged::plan argument kv_indptr: rank");
    PageTable t = s.dkv.table(s.kv);
    add_unit_dim(t.indptr);
    std::string what;
    EXPECT_TRUE(charged([&] { s.prefill.plan(s.qo_indptr.data(), t, nullptr, s.kv.num_pages); },
                        "BatchPrefillPaged::plan", "kv_indptr", "1-D", what))
        << "got: " << what;
  }
  s.plan(h);
  int cases = 0;
  check_view_rows<A>(args, "BatchPrefillPaged::run", [&] { return s.args(h); },
                     [&](const A& a) { s.prefill.run(a, nullptr); }, s.o, s.lse, cases);
  if (HasFatalFailure()) return;
  EXPECT_EQ(cases, 9 * 6 + 2);
  s.prefill.run(s.args(h), nullptr);  // the valid step runs and writes every row
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(fully_written(s.o, s.lse)) << "the valid run() left elements of o / lse unwritten";
}

// The index-range rules of the host arrays BatchPrefillPaged::plan reads (none is checked by
// another test) and of those run() reads (the rules batch_prefill_paged checks, GpuPrefillPagedBadInput
// and ValidationTable's rows, here under run()'s name). plan() has no q: qo_indptr ends within the
// config's max_q_rows; with num_pages every page id is checked against it and host_indices is
// required (without num_pages it is not read; run() checks the ids against its cache).
TEST(GpuValidationTable, BatchPrefillPagedNamesTheArrayOfEveryBrokenIndexRule) {
  TESSERA_REQUIRE_GPU();
  KVGeometry g;
  if (!pick_compiled(g)) GTEST_SKIP() << "no head dim / dtype compiled for both decode and prefill";
  PrefillStep s(g);  // qo_indptr {0, 5, 25, 28}, kv_indptr {0, 2, 5, 5} over 5 ids of 8 pages, last {4, 8, 0}
  // Rows both entry points share (run(): q's 28 rows; plan(): max_q_rows 28).
  auto shared = [](const char* entry) {
    return std::vector<IndexRow>{
        {entry, "qo_indptr", "must start at 0", [](HostTable& h) { h.qo[0] = 1; }},
        {entry, "qo_indptr", "non-decreasing", [](HostTable& h) { h.qo[1] = 26; }},
        {entry, "qo_indptr", "last entry 29 exceeds 28", [](HostTable& h) { h.qo[3] = 29; }},
        {entry, "kv_indptr", "must start at 0", [](HostTable& h) { h.indptr[0] = 1; }},
        {entry, "kv_indptr", "non-decreasing", [](HostTable& h) { h.indptr[1] = 6; }},
        {entry, "kv_last_page_len", "value 0 at index 0 is outside 1..16", [](HostTable& h) { h.last[0] = 0; }},
        {entry, "kv_last_page_len", "value 17 at index 1 is outside 1..16", [](HostTable& h) { h.last[1] = 17; }},
        {entry, "kv_indices", "page id 8 at index 1 is outside the cache's 8 pages", [](HostTable& h) { h.indices[1] = 8; }},
        {entry, "kv_indices", "page id -1 at index 3", [](HostTable& h) { h.indices[3] = -1; }},
        {entry, "host_qo_indptr", "is required", [](HostTable& h) { h.no_qo = true; }},
        {entry, "host_indices", "is required", [](HostTable& h) { h.no_indices = true; }},
    };
  };
  const char* plan = "BatchPrefillPaged::plan";
  std::vector<IndexRow> plan_rows = shared(plan);
  plan_rows.push_back({plan, "host_indptr", "required", [](HostTable& h) { h.no_indptr = true; }});
  plan_rows.push_back({plan, "host_last_page_len", "required", [](HostTable& h) { h.no_last = true; }});
  // kv_indptr ending past the kv_indices view's 5 entries (the host copy holds a sixth, valid id, so
  // that plan()'s read of it stays inside the vector).
  plan_rows.push_back({plan, "kv_indptr", "last entry 6 exceeds 5",
                       [](HostTable& h) {
                         h.indptr[3] = 6;  // request 2 gets one page, of one key
                         h.last[2] = 1;
                         h.indices.push_back(h.indices[0]);
                       }});
  check_index_rows(plan_rows, s.host(), [&](const HostTable& h) { s.plan(h); }, s.o, s.lse);

  const char* run = "BatchPrefillPaged::run";
  std::vector<IndexRow> run_rows = shared(run);
  run_rows.push_back({run, "kv_indptr", "last entry 6 exceeds 5", [](HostTable& h) { h.indptr[3] = 6; }});
  run_rows.push_back({run, "host_indptr", "is required", [](HostTable& h) { h.no_indptr = true; }});
  run_rows.push_back({run, "host_last_page_len", "is required", [](HostTable& h) { h.no_last = true; }});
  s.plan(s.host());
  check_index_rows(run_rows, s.host(), [&](const HostTable& h) { s.prefill.run(s.args(h), nullptr); }, s.o, s.lse);

  const HostTable valid = s.host();
  s.prefill.run(s.args(valid), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(fully_written(s.o, s.lse)) << "the valid run() left elements of o / lse unwritten";
}

}  // namespace
}  // namespace tessera::testing
