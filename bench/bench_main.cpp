// tessera's benchmarks. One case per invocation, parameters as key=value; prints one JSON object
// (the record's tessera side) on the last line. bench/run_bench.py feeds it the case files of
// bench/cases and merges the peers' figures measured in the same run.
//   tessera_bench ceiling [bytes=N] (the streamed buffer; default 4 GiB)
//   tessera_bench host_calls [iterations=50] (host cost of plan()'s CUDA calls; copy enqueue by size)
//   tessera_bench append name=b8_a8192_nhd batch=8 append_len=8192 num_kv_heads=8 head_dim=128 page_size=16 layout=NHD
//   tessera_bench merge name=... rows=16384 heads=32 head_dim=128 n=2 in_dtype=bf16 out_dtype=bf16
//   tessera_bench decode name=b64_kv4096_p16 batch=64 kv_len=4096 num_qo_heads=32 num_kv_heads=8 head_dim=128 page_size=16
//                 [layout=NHD|HND] [dtype=bf16|fp16] [lengths=uniform|zipf zipf_s=1.1 seed=1]
//                 [lengths=list kv_lens=32768,16,300,... (batch values; kv_len not needed)]
//                 [pipeline_stages=0|2|3] [ctas_per_sm=0|1|2] (0: what the decoder picks)
//   tessera_bench prefill | prefill_portable name=... batch=... seq=... num_qo_heads=... num_kv_heads=... head_dim=... causal=...
//                 [timeline=FILE [timeline_tiles=64]] (a build with -DTESSERA_SM90_TIMELINE=ON: one more
//                 launch writes the Hopper consumers' phase timeline to FILE; bench/prefill_timeline.py)
//   tessera_bench memory name=... seq=... head_dim=... [causal=...]
//   tessera_bench prefill_plan name=q512_kv32k_b2 batch=2 qo_len=512 kv_len=32768 num_qo_heads=32 num_kv_heads=8
//                 head_dim=128 page_size=16 [causal=true] [layout=NHD|HND]
//                 [lengths=list qo_lens=512,1,... kv_lens=16384,4096,... (batch values each)]
//                 (a build with -DTESSERA_PLAN_PHASES=ON also prints plan()'s time by phase: "plan_phases")
//   tessera_bench moe_gemm name=deepseek_v3_up_t128 experts=256 top_k=8 tokens=128 K=7168 N=4096
//                 activation=swiglu|none routing=random|balanced [seed=1]
//   tessera_bench moe_layer name=qwen3_30b_t1024 experts=128 top_k=8 tokens=1024 hidden=2048 inter=768
//                 [score=softmax|sigmoid] [renormalize=true|false] [seed=1]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "api/plan_phases.h"
#include "ceilings.h"
#include "dispatch/moe_dispatch.h"
#include "dispatch/prefill_dispatch.h"
#include "kernels/attention/sm90/prefill_sm90_launch.h"
#include "tessera/decode.h"
#include "tessera/tessera.h"
#include "timing.h"

using namespace tessera;
using namespace tessera::bench;

namespace {

using Args = std::map<std::string, std::string>;

std::string arg(const Args& a, const char* key, const char* fallback = nullptr) {
  auto it = a.find(key);
  if (it != a.end()) return it->second;
  if (fallback) return fallback;
  std::fprintf(stderr, "tessera_bench: missing parameter '%s'\n", key);
  std::exit(2);
}
long arg_int(const Args& a, const char* key, const char* fallback = nullptr) {
  return std::stol(arg(a, key, fallback));
}
// A list of integers, "32768,16,300" (run_bench.py writes a case's JSON list so); brackets and
// spaces are skipped, so "[32768, 16, 300]" reads the same.
std::vector<int32_t> arg_int_list(const Args& a, const char* key) {
  const std::string s = arg(a, key);
  std::vector<int32_t> out;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == ',' || s[i] == ' ' || s[i] == '[' || s[i] == ']') { ++i; continue; }
    size_t used = 0;
    out.push_back(static_cast<int32_t>(std::stol(s.substr(i), &used)));
    i += used;
  }
  return out;
}
// The per-request lengths of lengths=list: exactly `batch` values of at least `min_value`.
std::vector<int32_t> arg_lengths(const Args& a, const char* key, int batch, int32_t min_value) {
  std::vector<int32_t> v = arg_int_list(a, key);
  if (static_cast<int>(v.size()) != batch) {
    std::fprintf(stderr, "tessera_bench: %s has %zu values, batch is %d\n", key, v.size(), batch);
    std::exit(2);
  }
  for (int32_t x : v) {
    if (x < min_value) {
      std::fprintf(stderr, "tessera_bench: %s holds %d (< %d)\n", key, x, min_value);
      std::exit(2);
    }
  }
  return v;
}
DType parse_dtype(const std::string& s) {
  if (s == "bf16") return DType::kBF16;
  if (s == "fp16") return DType::kFP16;
  if (s == "fp32") return DType::kFP32;
  std::fprintf(stderr, "tessera_bench: unknown dtype '%s'\n", s.c_str());
  std::exit(2);
}

void print_record(const char* suite, const std::string& name, double tbs, double us,
                  const std::string& extra = "") {
  std::printf("{\"suite\": \"%s\", \"case\": \"%s\", \"metric\": \"TB/s\", \"tessera\": %.4f, "
              "\"time_us\": %.3f%s}\n", suite, name.c_str(), tbs, us, extra.c_str());
}

// A contiguous paged cache's views over two page buffers.
PagedKVCache paged_cache(void* k, void* v, DType dtype, KVLayout layout, int64_t num_pages,
                         int64_t page_size, int64_t heads, int64_t head_dim) {
  const bool nhd = layout == KVLayout::kNHD;
  const int64_t d1 = nhd ? page_size : heads, d2 = nhd ? heads : page_size;
  PagedKVCache cache;
  cache.layout = layout;
  cache.k_pages = TensorView::contiguous(k, dtype, {num_pages, d1, d2, head_dim});
  cache.v_pages = TensorView::contiguous(v, dtype, {num_pages, d1, d2, head_dim});
  return cache;
}

// A page table uploaded to the device, and its PageTable with the host copies (the vectors must
// outlive it).
struct DevicePageTable {
  Buffer indptr, ids, last;
  PageTable table;
  DevicePageTable(const std::vector<int32_t>& h_indptr, const std::vector<int32_t>& h_ids,
                  const std::vector<int32_t>& h_last)
      : indptr(h_indptr.size() * 4), ids(h_ids.size() * 4), last(h_last.size() * 4) {
    cuda_ok(cudaMemcpy(indptr.get(), h_indptr.data(), h_indptr.size() * 4, cudaMemcpyHostToDevice), "upload");
    cuda_ok(cudaMemcpy(ids.get(), h_ids.data(), h_ids.size() * 4, cudaMemcpyHostToDevice), "upload");
    cuda_ok(cudaMemcpy(last.get(), h_last.data(), h_last.size() * 4, cudaMemcpyHostToDevice), "upload");
    const int64_t batch = static_cast<int64_t>(h_last.size());
    table.indptr = TensorView::contiguous(indptr.get(), DType::kInt32, {batch + 1});
    table.indices = TensorView::contiguous(ids.get(), DType::kInt32, {int64_t(h_ids.size())});
    table.last_page_len = TensorView::contiguous(last.get(), DType::kInt32, {batch});
    table.host_indptr = h_indptr.data();
    table.host_indices = h_ids.data();
    table.host_last_page_len = h_last.data();
  }
};

// append: each request appends append_len tokens after an existing history of the same length;
// bytes = K and V rows read once and written once.
int bench_append(const Args& a) {
  const int batch = arg_int(a, "batch"), append_len = arg_int(a, "append_len");
  const int H = arg_int(a, "num_kv_heads"), D = arg_int(a, "head_dim"), P = arg_int(a, "page_size");
  const KVLayout layout = arg(a, "layout", "NHD") == "HND" ? KVLayout::kHND : KVLayout::kNHD;
  const int history = arg_int(a, "history", "0");
  const int kv_len = history + append_len;
  const int pages_per_req = (kv_len + P - 1) / P;
  const int nnz = batch * append_len;
  const double bytes = 2.0 * 2.0 * double(nnz) * H * D * 2;  // (K, V) x (read, write)
  const int rot = rotations_for(bytes);
  const int pages_per_rot = batch * pages_per_req;
  const int num_pages = rot * pages_per_rot;
  const size_t row = size_t(H) * D * 2;
  Buffer kp(size_t(num_pages) * P * row), vp(size_t(num_pages) * P * row);
  std::vector<std::unique_ptr<Buffer>> kn, vn, idx;
  std::vector<std::vector<int32_t>> host_ids;
  std::vector<int32_t> indptr{0}, last, app{0};
  for (int i = 0; i < batch; ++i) {
    indptr.push_back(indptr.back() + pages_per_req);
    last.push_back(kv_len - (pages_per_req - 1) * P);
    app.push_back(app.back() + append_len);
  }
  Buffer d_indptr(indptr.size() * 4), d_last(last.size() * 4), d_app(app.size() * 4);
  cuda_ok(cudaMemcpy(d_indptr.get(), indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice), "upload");
  cuda_ok(cudaMemcpy(d_last.get(), last.data(), last.size() * 4, cudaMemcpyHostToDevice), "upload");
  cuda_ok(cudaMemcpy(d_app.get(), app.data(), app.size() * 4, cudaMemcpyHostToDevice), "upload");
  for (int r = 0; r < rot; ++r) {
    kn.push_back(std::make_unique<Buffer>(nnz * row));
    vn.push_back(std::make_unique<Buffer>(nnz * row));
    fill_random(kn.back()->get(), nnz * row, 2 * r + 1, false);
    fill_random(vn.back()->get(), nnz * row, 2 * r + 2, false);
    // Rotation r writes its own pages, interleaved with the other rotations' pages.
    std::vector<int32_t> ids(pages_per_rot);
    for (int p = 0; p < pages_per_rot; ++p) ids[p] = p * rot + r;
    idx.push_back(std::make_unique<Buffer>(ids.size() * 4));
    cuda_ok(cudaMemcpy(idx.back()->get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), "upload");
    host_ids.push_back(std::move(ids));
  }
  const PagedKVCache cache = paged_cache(kp.get(), vp.get(), DType::kBF16, layout, num_pages, P, H, D);
  const TensorView append = TensorView::contiguous(d_app.get(), DType::kInt32, {batch + 1});
  const double ms = median_ms([&](int i) {
    const int r = i % rot;
    PageTable t;
    t.indptr = TensorView::contiguous(d_indptr.get(), DType::kInt32, {batch + 1});
    t.indices = TensorView::contiguous(idx[r]->get(), DType::kInt32, {pages_per_rot});
    t.last_page_len = TensorView::contiguous(d_last.get(), DType::kInt32, {batch});
    t.host_indptr = indptr.data();
    t.host_indices = host_ids[r].data();
    t.host_last_page_len = last.data();
    append_paged_kv(cache, t, append, TensorView::contiguous(kn[r]->get(), DType::kBF16, {nnz, H, D}),
                    TensorView::contiguous(vn[r]->get(), DType::kBF16, {nnz, H, D}), nullptr,
                    app.data());
  });
  print_record("append", arg(a, "name"), bytes / (ms * 1e-3) / 1e12, ms * 1e3,
               ", \"rotations\": " + std::to_string(rot));
  return 0;
}

// merge: n states [rows, heads, head_dim] (n = 2: merge_state on two tensors; n > 2:
// merge_states on one stacked tensor); bytes = every o and LSE read + the output o and LSE written.
int bench_merge(const Args& a) {
  const int rows = arg_int(a, "rows"), H = arg_int(a, "heads"), D = arg_int(a, "head_dim"),
            n = arg_int(a, "n");
    // "dtype" sets both sides; "in_dtype" / "out_dtype" set one each.
  const std::string both = arg(a, "dtype", "bf16");
  const DType in = parse_dtype(arg(a, "in_dtype", both.c_str()));
  const DType out = parse_dtype(arg(a, "out_dtype", both.c_str()));
  const size_t o_elems = size_t(rows) * H * D, s_elems = size_t(rows) * H;
  const double bytes = double(n) * (o_elems * dtype_size(in) + s_elems * 4) +
                       o_elems * dtype_size(out) + s_elems * 4;
  const int rot = rotations_for(bytes);
  struct Set { std::unique_ptr<Buffer> o, s, o_out, s_out; };
  std::vector<Set> sets;
  for (int r = 0; r < rot; ++r) {
    Set st{std::make_unique<Buffer>(n * o_elems * dtype_size(in)), std::make_unique<Buffer>(n * s_elems * 4),
           std::make_unique<Buffer>(o_elems * dtype_size(out)), std::make_unique<Buffer>(s_elems * 4)};
    fill_random(st.o->get(), st.o->bytes(), 10 * r + 1, in == DType::kFP32);
    fill_random(st.s->get(), st.s->bytes(), 10 * r + 2, true);  // LSE in [-0.5, 0.5)
    sets.push_back(std::move(st));
  }
  const double ms = median_ms([&](int i) {
    Set& st = sets[i % rot];
    const TensorView o_out = TensorView::contiguous(st.o_out->get(), out, {rows, H, D});
    const TensorView s_out = TensorView::contiguous(st.s_out->get(), DType::kFP32, {rows, H});
    if (n == 2) {
      char* o = static_cast<char*>(st.o->get());
      char* s = static_cast<char*>(st.s->get());
      merge_state(TensorView::contiguous(o, in, {rows, H, D}),
                  TensorView::contiguous(s, DType::kFP32, {rows, H}),
                  TensorView::contiguous(o + o_elems * dtype_size(in), in, {rows, H, D}),
                  TensorView::contiguous(s + s_elems * 4, DType::kFP32, {rows, H}), o_out, s_out,
                  nullptr);
    } else {
      merge_states(TensorView::contiguous(st.o->get(), in, {rows, n, H, D}),
                   TensorView::contiguous(st.s->get(), DType::kFP32, {rows, n, H}), o_out, s_out,
                   nullptr);
    }
  });
  print_record("merge", arg(a, "name"), bytes / (ms * 1e-3) / 1e12, ms * 1e3,
               ", \"rotations\": " + std::to_string(rot));
  return 0;
}

// A bf16 prefill problem on the device: batch requests of seq tokens each (qo_len = kv_len = seq),
// ragged layout, random inputs, and the PrefillArgs that run it.
struct PrefillProblem {
  int64_t tokens;
  std::vector<int32_t> indptr;
  Buffer q, k, v, o, lse, d_indptr;
  PrefillArgs args;

  PrefillProblem(int batch, int seq, int qh, int kh, int d, bool causal)
      : tokens(int64_t(batch) * seq), indptr(batch + 1), q(tokens * qh * d * 2),
        k(tokens * kh * d * 2), v(tokens * kh * d * 2), o(tokens * qh * d * 2), lse(tokens * qh * 4),
        d_indptr(indptr.size() * 4) {
    fill_random(q.get(), q.bytes(), 1, false);
    fill_random(k.get(), k.bytes(), 2, false);
    fill_random(v.get(), v.bytes(), 3, false);
    for (int i = 0; i <= batch; ++i) indptr[i] = i * seq;
    cuda_ok(cudaMemcpy(d_indptr.get(), indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice), "upload");
    args.q = TensorView::contiguous(q.get(), DType::kBF16, {tokens, qh, d});
    args.k = TensorView::contiguous(k.get(), DType::kBF16, {tokens, kh, d});
    args.v = TensorView::contiguous(v.get(), DType::kBF16, {tokens, kh, d});
    args.o = TensorView::contiguous(o.get(), DType::kBF16, {tokens, qh, d});
    args.lse = TensorView::contiguous(lse.get(), DType::kFP32, {tokens, qh});
    args.qo_indptr = TensorView::contiguous(d_indptr.get(), DType::kInt32, {batch + 1});
    args.kv_indptr = args.qo_indptr;
    args.host_qo_indptr = indptr.data();
    args.host_kv_indptr = indptr.data();
    args.causal = causal;
  }
  // Device memory held by a call beyond its inputs: o + lse + the drop in free memory around it.
  double held_mb(size_t free_before, size_t free_after) const {
    return (o.bytes() + lse.bytes() + double(free_before) - double(free_after)) / 1e6;
  }
};

// scheduler=persistent|single order=inner|outer|mirror heavy_first=true|false run_length=N: force
// the Hopper family's schedule (ablations); absent, the dispatcher's policy.
void force_schedule_if_asked(const Args& a) {
  if (a.count("scheduler") == 0) return;
  kernels::sm90::PrefillSm90Schedule schedule;
  schedule.scheduler = arg(a, "scheduler") == "single" ? kernels::sm90::SchedulerKind::kSingleTile
                                                       : kernels::sm90::SchedulerKind::kStaticPersistent;
  const std::string order = arg(a, "order", "inner");
  schedule.order = order == "outer"    ? kernels::sm90::TileOrder::kQueryTilesOuter
                   : order == "mirror" ? kernels::sm90::TileOrder::kMirroredPairs
                                       : kernels::sm90::TileOrder::kQueryTilesInner;
  schedule.run_length = static_cast<int>(arg_int(a, "run_length", order == "mirror" ? "2" : "1"));
  schedule.heavy_first = arg(a, "heavy_first", "false") == "true";
  dispatch::force_prefill_sm90_schedule(&schedule);
}

// gqa_pack=auto|on|off: packed GQA on the Hopper family as the dispatcher decides, wherever the
// group allows it, or never (ablations; dispatch::force_prefill_gqa_pack).
void force_gqa_pack(const Args& a) {
  const std::string mode = arg(a, "gqa_pack", "auto");
  dispatch::force_prefill_gqa_pack(mode == "on"    ? dispatch::GqaPack::kAlways
                                   : mode == "off" ? dispatch::GqaPack::kNever
                                                   : dispatch::GqaPack::kAuto);
}

// kv_tile=auto|128|192: the Hopper family's keys per K / V tile as the dispatcher decides, or
// forced where the head dim and source have that width (ablations; dispatch::force_prefill_sm90_block_n).
void force_kv_tile(const Args& a) {
  const std::string keys = arg(a, "kv_tile", "auto");
  dispatch::force_prefill_sm90_block_n(keys == "auto" ? 0 : std::stoi(keys));
}

// prefill: FLOPs = 4 * batch * heads * seq^2 * head_dim, halved when causal.
//   [path=portable|hopper] forces a family; [scheduler= order=inner|outer|mirror heavy_first= run_length=]
//   the Hopper schedule; [gqa_pack=auto|on|off] packed GQA (force_gqa_pack); [kv_tile=auto|128|192]
//   the K / V tile width (force_kv_tile).
// One launch with the Hopper prefill's phase timeline on (kernels/attention/sm90/
// phase_timeline_sm90.cuh; builds with -DTESSERA_SM90_TIMELINE=ON), its records as CSV: one line a
// (slot = CTA x consumers + consumer, ordinal) record that was written; cycles after the tile's
// start, and the loop's wait sums.
template <class Launch>
void write_prefill_timeline(const std::string& path, int64_t slots, int per_slot, Launch launch) {
  if (!kernels::sm90::prefill_sm90_timeline_built()) {
    throw Error("timeline=: this tessera_bench was built without -DTESSERA_SM90_TIMELINE=ON");
  }
  constexpr int kWords = kernels::sm90::kPrefillSm90TimelineWords;
  const size_t words = size_t(slots) * per_slot * kWords;
  Buffer buffer(words * sizeof(unsigned));
  cuda_ok(cudaMemset(buffer.get(), 0xff, words * sizeof(unsigned)), "timeline");
  kernels::sm90::set_prefill_sm90_timeline(static_cast<unsigned*>(buffer.get()), per_slot);
  launch();
  cuda_ok(cudaDeviceSynchronize(), "timeline launch");
  kernels::sm90::set_prefill_sm90_timeline(nullptr, 0);
  std::vector<unsigned> host(words);
  cuda_ok(cudaMemcpy(host.data(), buffer.get(), words * sizeof(unsigned), cudaMemcpyDeviceToHost), "timeline");
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) throw Error("timeline=: cannot write " + path);
  std::fprintf(f, "slot,ordinal,tile_start,q_ready,first_scores,loop_end,last_values,epilogue_end,wait_inputs,"
                  "wait_scores,wait_values,tile_row,head,split,sm,kv_tiles,out_normalised,out_staged,decode\n");
  for (int64_t slot = 0; slot < slots; ++slot) {
    for (int i = 0; i < per_slot; ++i) {
      const unsigned* r = &host[(size_t(slot) * per_slot + i) * kWords];
      if (r[11] == 0xffffffffu) break;  // (a slot's records are written in order)
      std::fprintf(f, "%lld,%d,%u,%u,%u,%u,%u,%u,%u,%u,%u,%u,%u,%u,%u,%u,%u,%u,%u\n", static_cast<long long>(slot), i,
                   r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10] & 0xffff, r[10] >> 16,
                   r[11] >> 16, r[11] & 0xffff, r[12], r[13], r[14]);
    }
  }
  std::fclose(f);
}

int bench_prefill(const char* suite, const Args& a, AttentionPath path) {
  const int batch = arg_int(a, "batch"), seq = arg_int(a, "seq");
  const int qh = arg_int(a, "num_qo_heads"), kh = arg_int(a, "num_kv_heads"), d = arg_int(a, "head_dim");
  const bool causal = arg(a, "causal", "false") == "true";
  PrefillProblem prob(batch, seq, qh, kh, d, causal);
  PrefillArgs& pa = prob.args;
  pa.path = path;
  if (a.count("path")) pa.path = arg(a, "path") == "hopper" ? AttentionPath::kHopper : AttentionPath::kPortable;
  // smem_limit_kb: run the tile shape a GPU with that much shared memory per block gets (99 on
  // sm_86 / sm_89: the compact hd256 prefill), timed on this GPU.
  const long smem_limit_kb = arg_int(a, "smem_limit_kb", "0");
  dispatch::limit_shared_memory_per_block(static_cast<int>(smem_limit_kb * 1024));
  force_schedule_if_asked(a);
  force_gqa_pack(a);
  force_kv_tile(a);
  size_t free_before = 0, free_after = 0, total = 0;
  cuda_ok(cudaMemGetInfo(&free_before, &total), "meminfo");
  const double ms = median_ms([&](int) { batch_prefill(pa, nullptr); }, 3, 20);
  cuda_ok(cudaMemGetInfo(&free_after, &total), "meminfo");
  if (a.count("timeline")) {
    // Records of every (CTA, consumer) slot: grid <= max(SMs, tiles), tiles <= batch x heads x
    // ceil(seq / 64), at most 3 consumers a CTA.
    int device = 0, sms = 0;
    cuda_ok(cudaGetDevice(&device), "device");
    cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "device");
    const int per_slot = static_cast<int>(arg_int(a, "timeline_tiles", "64"));
    const int64_t ctas = std::max<int64_t>(sms, int64_t(batch) * qh * ((seq + 63) / 64));
    write_prefill_timeline(arg(a, "timeline"), ctas * 3, per_slot, [&] { batch_prefill(pa, nullptr); });
  }
  const double flops = 4.0 * batch * qh * double(seq) * seq * d * (causal ? 0.5 : 1.0);
  const double held_mb = prob.held_mb(free_before, free_after);
  std::printf("{\"suite\": \"%s\", \"case\": \"%s\", \"metric\": \"TFLOP/s\", \"tessera\": %.2f, "
              "\"time_us\": %.1f, \"held_mb\": %.1f, \"path\": \"%s\"}\n",
              suite, arg(a, "name").c_str(), flops / (ms * 1e-3) / 1e12, ms * 1e3, held_mb,
              attention_path_name(choose_prefill_path(pa)));
  return 0;
}

// splitmix64 (Steele, Lea & Flood 2014): the random source of the decode case that bench/peers.py
// implements bit for bit (splitmix64_next there), so both sides draw the same per-request lengths.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

// Fisher-Yates, from the last element down: swap v[i] with v[next() % (i + 1)].
template <class T>
void shuffle(std::vector<T>& v, SplitMix64& rng) {
  for (size_t i = v.size(); i-- > 1;) std::swap(v[i], v[rng.next() % (i + 1)]);
}

// Per-request KV lengths of a skewed batch (lengths=zipf). Kept identical to
// zipf_lengths() in bench/peers.py; any change goes to both:
//   w[r]   = pow(r + 1, -s) for rank r = 0 .. batch-1            (Zipf weights, libm pow)
//   cap    = 16 * mean; target = mean * batch                      (doubles)
//   k      = the smallest k in 0 .. batch-1 with w[k] * scale_k <= cap, where
//            scale_k = (target - k * cap) / (w[k] + w[k+1] + ... + w[batch-1])  (summed in rank
//            order, plain left-to-right additions): ranks < k are capped, the rest share the
//            remaining tokens in proportion to w, so the mean is `mean` (up to rounding)
//   len[r] = cap for r < k, else clamp(floor(w[r] * scale_k + 0.5), 1, cap)
//   then the lengths are shuffled over the batch with shuffle(splitmix64 seeded with `seed`).
// Only +, -, *, / and floor (exactly rounded IEEE doubles, no FMA: the product is stored first)
// and pow (the same libm on one machine) are involved, so both sides agree exactly; both also
// report the total as "kv_tokens" and peers.py flags a mismatch.
std::vector<int32_t> zipf_lengths(int batch, int mean, double s, uint64_t seed) {
  const int64_t cap = 16 * int64_t(mean);
  std::vector<double> w(batch);
  for (int r = 0; r < batch; ++r) w[r] = std::pow(double(r + 1), -s);
  const double target = double(mean) * double(batch);
  int k = 0;
  double scale = 0.0;
  for (; k < batch; ++k) {
    double rest = 0.0;
    for (int r = k; r < batch; ++r) rest += w[r];
    scale = (target - double(k) * double(cap)) / rest;
    if (w[k] * scale <= double(cap)) break;
  }
  std::vector<int32_t> len(batch);
  for (int r = 0; r < batch; ++r) {
    if (r < k) { len[r] = int32_t(cap); continue; }
    volatile double x = w[r] * scale;  // rounded to double before the + 0.5, as in Python
    const double rounded = std::floor(x + 0.5);
    len[r] = int32_t(std::clamp<double>(rounded, 1.0, double(cap)));
  }
  SplitMix64 rng{seed};
  shuffle(len, rng);
  return len;
}

// A page table over per-request lengths, host side: CSR in request order (request i owns
// ceil(len[i] / P) pages, the last holding the rest) over a pool whose page ids are a permutation
// drawn with shuffle(splitmix64 seeded with `seed`), so a request's pages are scattered, as in a
// serving engine. bench/peers.py (shuffled_page_table there) builds the same table for its paged
// peers.
struct HostPageTable {
  std::vector<int32_t> indptr{0}, ids, last;
  int64_t tokens = 0;
  int32_t max_len = 0;
  int num_pages() const { return indptr.back(); }
};

// `rotations` sets of random K/V page pools, Q, and O / LSE buffers for a paged benchmark (rotated
// so that a timed call does not find its inputs in L2).
struct PagedSet {
  std::unique_ptr<Buffer> k, v, q, o, lse;
};
std::vector<PagedSet> random_paged_sets(int rotations, size_t pool_bytes, size_t q_bytes, size_t lse_bytes) {
  std::vector<PagedSet> sets;
  for (int r = 0; r < rotations; ++r) {
    PagedSet st{std::make_unique<Buffer>(pool_bytes), std::make_unique<Buffer>(pool_bytes),
                std::make_unique<Buffer>(q_bytes), std::make_unique<Buffer>(q_bytes),
                std::make_unique<Buffer>(lse_bytes)};
    fill_random(st.k->get(), pool_bytes, 10 * r + 1, false);
    fill_random(st.v->get(), pool_bytes, 10 * r + 2, false);
    fill_random(st.q->get(), q_bytes, 10 * r + 3, false);
    sets.push_back(std::move(st));
  }
  return sets;
}

HostPageTable shuffled_page_table(const std::vector<int32_t>& len, int P, uint64_t seed) {
  HostPageTable t;
  for (const int32_t n : len) {
    const int32_t pages = (n + P - 1) / P;
    t.indptr.push_back(t.indptr.back() + pages);
    t.last.push_back(n - (pages - 1) * P);
    t.tokens += n;
    t.max_len = std::max(t.max_len, n);
  }
  t.ids.resize(t.indptr.back());
  for (int p = 0; p < t.num_pages(); ++p) t.ids[p] = p;
  SplitMix64 rng{seed};
  shuffle(t.ids, rng);
  return t;
}

// decode: one query token per request over a paged KV cache, through BatchDecoder (plan once,
// time run()). Pages are a random permutation of the pool (a request's pages are scattered, as in
// a serving engine); data is random, never zero. bytes = the K and V rows of every request read
// once: sum over requests of kv_len * num_kv_heads * head_dim * 2 (K, V) * sizeof(dtype), the
// same figure bench/peers.py counts for its contiguous-KV peers. When one input set is smaller
// than the L2-rotation budget, several copies of the cache (and of q / o / lse) are rotated; all
// copies share one page table, so the plan stays valid for every run().
int bench_decode(const Args& a) {
  const int batch = arg_int(a, "batch");
  const int qh = arg_int(a, "num_qo_heads"), kh = arg_int(a, "num_kv_heads");
  const int D = arg_int(a, "head_dim"), P = arg_int(a, "page_size");
  const KVLayout layout = arg(a, "layout", "NHD") == "HND" ? KVLayout::kHND : KVLayout::kNHD;
  const DType dtype = parse_dtype(arg(a, "dtype", "bf16"));
  const std::string lengths = arg(a, "lengths", "uniform");
  const uint64_t seed = std::stoull(arg(a, "seed", "1"));
  std::vector<int32_t> len;
  if (lengths == "uniform") {
    len.assign(batch, static_cast<int32_t>(arg_int(a, "kv_len")));
  } else if (lengths == "zipf") {
    len = zipf_lengths(batch, arg_int(a, "kv_len"), std::stod(arg(a, "zipf_s", "1.1")), seed);
  } else if (lengths == "list") {
    len = arg_lengths(a, "kv_lens", batch, 1);
  } else {
    std::fprintf(stderr, "tessera_bench: lengths must be uniform, zipf or list, got '%s'\n", lengths.c_str());
    return 2;
  }

  // Page table: request i owns ceil(len_i / P) pages, ids a random permutation of the pool, drawn
  // from a stream of its own (seed ^ "pages"), not the lengths' stream.
  const HostPageTable host_table = shuffled_page_table(len, P, seed ^ 0x7061676573ull);
  const std::vector<int32_t>& indptr = host_table.indptr;
  const std::vector<int32_t>& ids = host_table.ids;
  const std::vector<int32_t>& last = host_table.last;
  const int64_t kv_tokens = host_table.tokens;
  const int32_t max_kv = host_table.max_len;
  const int num_pages = host_table.num_pages();
  std::vector<int32_t> qo_indptr(batch + 1);
  for (int i = 0; i <= batch; ++i) qo_indptr[i] = i;

  const size_t esize = dtype_size(dtype);
  const double bytes = double(kv_tokens) * kh * D * 2 * double(esize);
  const size_t q_bytes = size_t(batch) * qh * D * esize, lse_bytes = size_t(batch) * qh * 4;
  const int rot = rotations_for(bytes + 2.0 * q_bytes + lse_bytes);
  const size_t pool_bytes = size_t(num_pages) * P * kh * D * esize;
  const std::vector<PagedSet> sets = random_paged_sets(rot, pool_bytes, q_bytes, lse_bytes);
  const DevicePageTable device_table(indptr, ids, last);
  const PageTable& table = device_table.table;

  DecodeConfig cfg;
  cfg.num_qo_heads = qh;
  cfg.num_kv_heads = kh;
  cfg.head_dim = D;
  cfg.page_size = P;
  cfg.dtype = dtype;
  cfg.layout = layout;
  cfg.max_batch_size = batch;
  cfg.max_qo_len = 1;
  cfg.programmatic_launch = arg_int(a, "programmatic", "1") != 0;
  cfg.pipeline_stages = static_cast<int>(arg_int(a, "pipeline_stages", "0"));
  cfg.ctas_per_sm = static_cast<int>(arg_int(a, "ctas_per_sm", "0"));
  cfg.batch_invariant = arg(a, "batch_invariant", "false") == "true";  // (the mode's cost)
  cfg.batch_invariant_chunk_tokens = static_cast<int>(arg_int(a, "batch_invariant_chunk_tokens", "1024"));
  const size_t ws_bytes = BatchDecoder::workspace_bytes(cfg);
  Buffer ws(ws_bytes);
  BatchDecoder decoder(cfg, ws.get(), ws_bytes);

  // plan(): host cost per serving step (planning + the staging wait + the async copy's enqueue),
  // median of 200 calls after 10 warm-up calls. Every call plans the same step.
  // Timed twice: as an engine whose allocator vouches for its page ids calls it (num_pages -1),
  // and with every page id checked against the cache (O(pages)).
  const int plan_warmup = 10, plan_iters = 200;
  auto time_plan = [&](int64_t check_pages) {
    std::vector<double> plan_us(plan_iters);
    for (int i = 0; i < plan_warmup + plan_iters; ++i) {
      // As in a serving loop, the previous step's plan copy has long completed: without this
      // sync, back-to-back calls would time the wait for the previous copy.
      cuda_ok(cudaDeviceSynchronize(), "plan");
      const auto t0 = std::chrono::steady_clock::now();
      decoder.plan(qo_indptr.data(), table, nullptr, check_pages);
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= plan_warmup) plan_us[i - plan_warmup] = std::chrono::duration<double, std::micro>(t1 - t0).count();
    }
    std::nth_element(plan_us.begin(), plan_us.begin() + plan_iters / 2, plan_us.end());
    return plan_us[plan_iters / 2];
  };
  const double plan_checked_us = time_plan(num_pages);
  const double plan_median_us = time_plan(-1);
  cuda_ok(cudaDeviceSynchronize(), "plan");
  const DecodePlanInfo info = decoder.last_plan();

  auto run_step = [&](int i) {
    const PagedSet& st = sets[i % rot];
    const PagedKVCache cache = paged_cache(st.k->get(), st.v->get(), dtype, layout, num_pages, P, kh, D);
    decoder.run(TensorView::contiguous(st.q->get(), dtype, {batch, qh, D}), cache, table,
                TensorView::contiguous(st.o->get(), dtype, {batch, qh, D}),
                TensorView::contiguous(st.lse->get(), DType::kFP32, {batch, qh}), nullptr);
  };
  const double ms = median_ms(run_step);
  // Steps back to back, as an engine's stream issues them (no event between the calls).
  const double stream_step_ms = stream_ms(run_step);
  char extra[512];
  std::snprintf(extra, sizeof(extra),
                ", \"rotations\": %d, \"kv_tokens\": %lld, \"max_kv_len\": %d, \"chunk_tokens\": %d, "
                "\"work_items\": %d, \"split_requests\": %d, \"grid_ctas\": %d, \"ctas_per_sm\": %d, \"plan_us\": %.3f, "
                "\"plan_checked_us\": %.3f, \"stream_us\": %.3f, \"stream_tbs\": %.4f, \"merge_rows\": %d, "
                "\"estimated_us\": %.1f, \"batch_invariant\": %s",
                rot, static_cast<long long>(kv_tokens), max_kv, info.chunk_tokens, info.num_work_items,
                info.num_split_requests, info.grid_ctas, info.ctas_per_sm, plan_median_us, plan_checked_us,
                stream_step_ms * 1e3, bytes / (stream_step_ms * 1e-3) / 1e12, info.num_merge_rows, info.estimated_us,
                cfg.batch_invariant ? "true" : "false");
  print_record("decode", arg(a, "name"), bytes / (ms * 1e-3) / 1e12, ms * 1e3, extra);
  return 0;
}

// prefill_paged: the prefill cases with K/V in a paged cache (page_size, layout; pages of each
// request in a shuffled order, written with append_paged_kv), timed next to the ragged kernel on
// the same tokens in the same process: the record's notes carry both and their ratio.
//   [path=portable|hopper] forces a family for both.
int bench_prefill_paged(const Args& a) {
  const int batch = arg_int(a, "batch"), seq = arg_int(a, "seq");
  const int qh = arg_int(a, "num_qo_heads"), kh = arg_int(a, "num_kv_heads"), d = arg_int(a, "head_dim");
  const bool causal = arg(a, "causal", "false") == "true";
  const int P = arg_int(a, "page_size", "16");
  const KVLayout layout = arg(a, "layout", "NHD") == "HND" ? KVLayout::kHND : KVLayout::kNHD;
  PrefillProblem prob(batch, seq, qh, kh, d, causal);

  // Page table: request i owns ceil(seq / P) pages, drawn from a shuffled pool.
  const int pages_per_req = (seq + P - 1) / P;
  const int num_pages = batch * pages_per_req;
  std::vector<int32_t> ids(num_pages), indptr(batch + 1), last(batch);
  for (int i = 0; i < num_pages; ++i) ids[i] = i;
  SplitMix64 rng{7};
  shuffle(ids, rng);
  for (int r = 0; r <= batch; ++r) indptr[r] = r * pages_per_req;
  for (int r = 0; r < batch; ++r) last[r] = seq - (pages_per_req - 1) * P;
  const DevicePageTable device_table(indptr, ids, last);
  const PageTable& table = device_table.table;
  const size_t page_bytes = size_t(P) * kh * d * 2;
  Buffer kp(num_pages * page_bytes), vp(num_pages * page_bytes);
  const PagedKVCache cache = paged_cache(kp.get(), vp.get(), DType::kBF16, layout, num_pages, P, kh, d);
  append_paged_kv(cache, table, prob.args.kv_indptr, prob.args.k, prob.args.v, nullptr,
                  prob.indptr.data());

  PagedPrefillArgs pa;
  pa.q = prob.args.q;
  pa.qo_indptr = prob.args.qo_indptr;
  pa.host_qo_indptr = prob.indptr.data();
  pa.cache = cache;
  pa.table = table;
  pa.o = prob.args.o;
  pa.lse = prob.args.lse;
  pa.causal = causal;
  if (a.count("path")) {  // the family forced for both the paged and the ragged run
    pa.path = arg(a, "path") == "hopper" ? AttentionPath::kHopper : AttentionPath::kPortable;
    prob.args.path = pa.path;
  }
  const double flops = 4.0 * batch * qh * double(seq) * seq * d * (causal ? 0.5 : 1.0);
  const double ragged_ms = median_ms([&](int) { batch_prefill(prob.args, nullptr); }, 3, 20);
  const double paged_ms = median_ms([&](int) { batch_prefill_paged(pa, nullptr); }, 3, 20);
  std::printf("{\"suite\": \"prefill_paged\", \"case\": \"%s\", \"metric\": \"TFLOP/s\", "
              "\"tessera\": %.2f, \"time_us\": %.1f, \"ragged_tflops\": %.2f, "
              "\"paged_over_ragged\": %.3f, \"page_size\": %d, \"layout\": \"%s\", \"path\": \"%s\", "
              "\"ragged_path\": \"%s\"}\n",
              arg(a, "name").c_str(), flops / (paged_ms * 1e-3) / 1e12, paged_ms * 1e3,
              flops / (ragged_ms * 1e-3) / 1e12, ragged_ms / paged_ms, P, kv_layout_name(layout),
              attention_path_name(choose_prefill_paged_path(pa)), attention_path_name(choose_prefill_path(prob.args)));
  return 0;
}

// The (query, key) pairs a request of qo query tokens over kv keys computes: all of them, or with
// the bottom-right causal mask (query i sees keys j <= kv - qo + i) sum_{i<qo} (kv - qo + i + 1).
double visible_pairs(int64_t qo, int64_t kv, bool causal) {
  return causal ? double(qo * (kv - qo) + qo * (qo + 1) / 2) : double(qo * kv);
}

// prefill_plan: chunked prefill over a paged cache through batch_prefill_paged. Request r brings
// qo_len[r] new query tokens, the last qo_len[r] positions of its kv_len[r] keys (its history and
// the chunk itself, already in the cache); causal (the default) is bottom-right aligned. FLOPs =
// 4 * num_qo_heads * head_dim * the visible pairs of every request (visible_pairs), the figure
// bench/peers.py counts. Pages as shuffled_page_table builds them (seed 7, as prefill_paged);
// when one input set is smaller than the L2-rotation budget, several copies of the cache and of
// q / o / lse rotate, all sharing one page table.
int bench_prefill_plan(const Args& a) {
  const int batch = arg_int(a, "batch");
  const int qh = arg_int(a, "num_qo_heads"), kh = arg_int(a, "num_kv_heads"), d = arg_int(a, "head_dim");
  const int P = arg_int(a, "page_size", "16");
  const KVLayout layout = arg(a, "layout", "NHD") == "HND" ? KVLayout::kHND : KVLayout::kNHD;
  const bool causal = arg(a, "causal", "true") == "true";
  const std::string lengths = arg(a, "lengths", "uniform");
  std::vector<int32_t> qo, kv;
  if (lengths == "uniform") {
    qo.assign(batch, static_cast<int32_t>(arg_int(a, "qo_len")));
    kv.assign(batch, static_cast<int32_t>(arg_int(a, "kv_len")));
  } else if (lengths == "list") {
    qo = arg_lengths(a, "qo_lens", batch, 1);
    kv = arg_lengths(a, "kv_lens", batch, 1);
  } else {
    std::fprintf(stderr, "tessera_bench: lengths must be uniform or list, got '%s'\n", lengths.c_str());
    return 2;
  }
  std::vector<int32_t> qo_indptr{0};
  double pairs = 0.0;
  for (int r = 0; r < batch; ++r) {
    if (qo[r] < 1 || qo[r] > kv[r]) {
      std::fprintf(stderr, "tessera_bench: request %d has qo_len %d over kv_len %d\n", r, qo[r], kv[r]);
      return 2;
    }
    qo_indptr.push_back(qo_indptr.back() + qo[r]);
    pairs += visible_pairs(qo[r], kv[r], causal);
  }
  const int64_t q_rows = qo_indptr.back();
  const HostPageTable host_table = shuffled_page_table(kv, P, 7);
  const int num_pages = host_table.num_pages();
  const DevicePageTable device_table(host_table.indptr, host_table.ids, host_table.last);
  Buffer d_qo(qo_indptr.size() * 4);
  cuda_ok(cudaMemcpy(d_qo.get(), qo_indptr.data(), qo_indptr.size() * 4, cudaMemcpyHostToDevice), "upload");

  const size_t pool_bytes = size_t(num_pages) * P * kh * d * 2;
  const size_t q_bytes = size_t(q_rows) * qh * d * 2, lse_bytes = size_t(q_rows) * qh * 4;
  const int rot = rotations_for(2.0 * double(host_table.tokens) * kh * d * 2 + 2.0 * q_bytes + lse_bytes);
  const std::vector<PagedSet> sets = random_paged_sets(rot, pool_bytes, q_bytes, lse_bytes);
  // split=1 (default): BatchPrefillPaged, planned once (the KV split it picks); split=0: the
  // unsplit batch_prefill_paged.
  // kv_splits=N forces the plan's split count (the cost model's sweep); path=portable|hopper the
  // family; scheduler=... the Hopper schedule (force_schedule_if_asked). cuda_graph=true: the
  // config's fixed-grid kernels (what a captured run() replays), timed as eager run()s over the
  // rotated inputs (a replay runs the same kernels; it saves only the launches).
  // max_batch_size=N (default: the batch, as an engine configures it): the config's bound, which
  // lets eager plans put non-uniform steps on the fixed grid; max_batch_size=0: the one-tile grid.
  const bool use_split = arg_int(a, "split", "1") != 0;
  const bool fixed_grid = arg(a, "cuda_graph", "false") == "true";
  dispatch::force_prefill_kv_splits(static_cast<int>(arg_int(a, "kv_splits", "0")));
  force_schedule_if_asked(a);
  force_gqa_pack(a);
  force_kv_tile(a);
  PagedPrefillConfig pcfg;
  pcfg.num_qo_heads = qh;
  pcfg.num_kv_heads = kh;  // as an engine configures it (packed GQA on the fixed grid; gqa_pack=off: none)
  pcfg.head_dim = d;
  pcfg.page_size = P;
  pcfg.max_q_rows = static_cast<int>(q_rows);
  // batch_invariant=true: every step split into exactly max_kv_splits runs (default 16, or the
  // forced kv_splits): the mode's cost against the planner's own choice.
  pcfg.max_kv_splits = a.count("max_kv_splits") ? static_cast<int>(arg_int(a, "max_kv_splits"))
                                                 : std::max(16, static_cast<int>(arg_int(a, "kv_splits", "0")));
  pcfg.batch_invariant = arg(a, "batch_invariant", "false") == "true";
  pcfg.causal = causal;
  if (a.count("path")) pcfg.path = arg(a, "path") == "hopper" ? AttentionPath::kHopper : AttentionPath::kPortable;
  pcfg.cuda_graph = fixed_grid;
  pcfg.max_batch_size = static_cast<int>(arg_int(a, "max_batch_size", std::to_string(batch).c_str()));
  Buffer split_ws(std::max<size_t>(BatchPrefillPaged::workspace_bytes(pcfg), 256));
  BatchPrefillPaged prefill(pcfg, split_ws.get(), split_ws.bytes());
  // plan()'s host time: median of 50 calls on the same step (on the fixed grid: the schedule and
  // the enqueue of the step's copy), each after the previous call's copy has finished, as in a
  // serving loop, where a step's plan() runs while the previous step's layers do and its copy
  // finished when they started. (Back to back, a call would also wait out the previous copy's
  // round trip, ~10-20 us, which no engine sees.)
  cuda_ok(cudaDeviceSynchronize(), "fills");
  std::vector<double> plan_us(50);
  for (double& us : plan_us) {
    cuda_ok(cudaDeviceSynchronize(), "plan copy");
    const auto t0 = std::chrono::steady_clock::now();
    prefill.plan(qo_indptr.data(), device_table.table, nullptr);
    us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  std::nth_element(plan_us.begin(), plan_us.begin() + 25, plan_us.end());
  // The same with the cache's page count given (a captured run() requires it): every page id the
  // step names is checked against it.
  std::vector<double> plan_ids_us(50);
  for (double& us : plan_ids_us) {
    cuda_ok(cudaDeviceSynchronize(), "plan copy");
    const auto t0 = std::chrono::steady_clock::now();
    prefill.plan(qo_indptr.data(), device_table.table, nullptr, num_pages);
    us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  std::nth_element(plan_ids_us.begin(), plan_ids_us.begin() + 25, plan_ids_us.end());
  if (detail::plan_phases_built()) {
    // Experiment builds (-DTESSERA_PLAN_PHASES=ON): each phase's median over 50 calls as above,
    // without and with num_pages, one line each (before the record's line).
    for (const bool ids : {false, true}) {
      std::vector<std::vector<double>> phase(detail::kPlanPhases, std::vector<double>(50));
      std::vector<double> total(50);
      for (int i = 0; i < 50; ++i) {
        cuda_ok(cudaDeviceSynchronize(), "plan copy");
        const auto t0 = std::chrono::steady_clock::now();
        prefill.plan(qo_indptr.data(), device_table.table, nullptr, ids ? num_pages : -1);
        total[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        for (int k = 0; k < detail::kPlanPhases; ++k) phase[k][i] = detail::last_plan_phase_us()[k];
      }
      auto median = [](std::vector<double>& v) {
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        return v[v.size() / 2];
      };
      std::printf("{\"suite\": \"plan_phases\", \"case\": \"%s\", \"num_pages_given\": %s, \"plan_us\": %.2f",
                  arg(a, "name").c_str(), ids ? "true" : "false", median(total));
      for (int k = 0; k < detail::kPlanPhases; ++k) std::printf(", \"%s\": %.2f", detail::kPlanPhaseNames[k], median(phase[k]));
      std::printf("}\n");
    }
  }
  cuda_ok(cudaDeviceSynchronize(), "plan");
  auto run_step = [&](int i) {
    const PagedSet& st = sets[i % rot];
    PagedPrefillArgs pa;
    pa.q = TensorView::contiguous(st.q->get(), DType::kBF16, {q_rows, qh, d});
    pa.qo_indptr = TensorView::contiguous(d_qo.get(), DType::kInt32, {batch + 1});
    pa.host_qo_indptr = qo_indptr.data();
    pa.cache = paged_cache(st.k->get(), st.v->get(), DType::kBF16, layout, num_pages, P, kh, d);
    pa.table = device_table.table;
    pa.o = TensorView::contiguous(st.o->get(), DType::kBF16, {q_rows, qh, d});
    pa.lse = TensorView::contiguous(st.lse->get(), DType::kFP32, {q_rows, qh});
    pa.causal = causal;
    pa.path = pcfg.path;
    if (use_split) prefill.run(pa, nullptr);
    else batch_prefill_paged(pa, nullptr);
  };
  const double ms = median_ms(run_step, 3, 20);
  const double flops = 4.0 * qh * d * pairs;
  std::printf("{\"suite\": \"prefill_plan\", \"case\": \"%s\", \"metric\": \"TFLOP/s\", "
              "\"tessera\": %.2f, \"time_us\": %.1f, \"q_tokens\": %lld, \"kv_tokens\": %lld, "
              "\"rotations\": %d, \"page_size\": %d, \"layout\": \"%s\", \"kv_splits\": %d, "
              "\"plan_path\": \"%s\", \"estimated_us\": %.1f, \"cuda_graph\": %s, \"plan_us\": %.1f, \"plan_us_num_pages\": %.1f, "
              "\"max_batch_size\": %d, \"fixed_grid\": %s, \"batch_invariant\": %s, \"gqa_pack\": %d}\n",
              arg(a, "name").c_str(), flops / (ms * 1e-3) / 1e12, ms * 1e3, static_cast<long long>(q_rows),
              static_cast<long long>(host_table.tokens), rot, P, kv_layout_name(layout),
              use_split ? prefill.last_plan().kv_splits : 1,
              attention_path_name(use_split ? prefill.last_plan().path : AttentionPath::kAuto),
              use_split ? prefill.last_plan().estimated_us : 0.0, fixed_grid ? "true" : "false", plan_us[25], plan_ids_us[25],
              pcfg.max_batch_size, use_split && prefill.last_plan().fixed_grid ? "true" : "false",
              pcfg.batch_invariant ? "true" : "false", use_split ? prefill.last_plan().gqa_pack : 0);
  return 0;
}

// memory: one head, seq tokens, hd: what tessera holds beyond its inputs (o + lse + any
// workspace, from the device's free-memory readings around the call) against what materialised
// fp32 scores would need.
int bench_memory(const Args& a) {
  const int seq = arg_int(a, "seq"), d = arg_int(a, "head_dim");
  PrefillProblem prob(1, seq, 1, 1, d, arg(a, "causal", "false") == "true");
  const int64_t tokens = prob.tokens;
  size_t free_before = 0, free_after = 0, total = 0;
  cuda_ok(cudaDeviceSynchronize(), "sync");
  cuda_ok(cudaMemGetInfo(&free_before, &total), "meminfo");
  batch_prefill(prob.args, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "sync");
  cuda_ok(cudaMemGetInfo(&free_after, &total), "meminfo");
  const double held_mb = prob.held_mb(free_before, free_after);
  const double scores_mb = double(tokens) * tokens * 4 / 1e6;
  std::printf("{\"suite\": \"memory\", \"case\": \"%s\", \"metric\": \"MB\", \"tessera\": %.2f, "
              "\"materialised_scores_mb\": %.1f}\n", arg(a, "name").c_str(), held_mb, scores_mb);
  return 0;
}

// ---- MoE: moe_gemm (the grouped GEMM alone) and moe_layer (fused_moe) ----------------------------

// Routing of a moe_gemm case (top_k copies of each of `tokens` tokens), identical to moe_routing()
// in bench/peers.py, so both sides run the same rows per expert:
//   balanced: copy i = t * top_k + j goes to expert i % experts (every expert gets the same rows
//             when tokens * top_k is a multiple of experts; PERF.md's MoE table was measured so);
//   random:   one splitmix64 stream seeded with `seed`; for each token in order and j < top_k,
//             draw e = next() % experts until e differs from the token's earlier picks (a uniform
//             top_k choice per token; modulo bias < 2^-56).
std::vector<int32_t> moe_routing(const std::string& kind, int64_t tokens, int top_k, int experts, uint64_t seed) {
  if (top_k < 1 || top_k > experts) throw Error("moe bench: top_k must be in 1..experts");
  std::vector<int32_t> ids(size_t(tokens) * top_k);
  if (kind == "balanced") {
    if ((tokens * top_k) % experts != 0) throw Error("moe bench: balanced routing needs tokens * top_k % experts == 0");
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i % size_t(experts));
    return ids;
  }
  if (kind != "random") throw Error("moe bench: routing must be balanced or random, got '" + kind + "'");
  SplitMix64 rng{seed};
  for (int64_t t = 0; t < tokens; ++t) {
    int32_t* picked = ids.data() + t * top_k;
    for (int j = 0; j < top_k;) {
      const int32_t e = int32_t(rng.next() % uint64_t(experts));
      if (std::find(picked, picked + j, e) == picked + j) picked[j++] = e;
    }
  }
  return ids;
}

// Router logits of a moe_layer case, [tokens, experts] fp32 row-major, identical to
// moe_router_logits() in bench/peers.py: one splitmix64 stream seeded with `seed`, one draw per
// (token, expert) in row-major order; u = (draw >> 48) << 8 | expert (24 bits), logit =
// (u - 2^23) / 2^21, in [-4, 4). Exact in fp32 on both sides, and never equal within a token (the
// low byte is the expert id; experts <= 256), so top-k has no ties to break.
std::vector<float> moe_router_logits(int64_t tokens, int experts, uint64_t seed) {
  if (experts > 256) throw Error("moe bench: router logits are generated for at most 256 experts");
  std::vector<float> logits(size_t(tokens) * experts);
  SplitMix64 rng{seed};
  for (size_t i = 0; i < logits.size(); ++i) {
    const int64_t u = int64_t(((rng.next() >> 48) << 8) | uint64_t(i % size_t(experts)));
    logits[i] = float(double(u - (int64_t(1) << 23)) / double(1 << 21));
  }
  return logits;
}

// The top_k experts of each token by logit (every score moe_route offers is monotonic in the
// logit): the routing tessera must have chosen, to check fused_moe's topk_ids against.
std::vector<int32_t> host_top_k(const std::vector<float>& logits, int64_t tokens, int experts, int top_k) {
  std::vector<int32_t> ids(size_t(tokens) * top_k), order(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits.data() + t * experts;
    for (int e = 0; e < experts; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [row](int32_t x, int32_t y) { return row[x] > row[y]; });
    std::copy(order.begin(), order.begin() + top_k, ids.begin() + t * top_k);
  }
  return ids;
}

// Rows per expert of a routing, and what the records report of it. expert_rows_fnv is FNV-1a
// (64-bit) over the per-expert row counts in expert order (h ^= count; h *= 1099511628211), printed
// as 16 hex digits; bench/peers.py computes the same and its merge flags a mismatch.
struct ExpertRows {
  std::vector<int64_t> rows;  // [experts]
  int64_t total = 0, max_rows = 0;
  int touched = 0;
  uint64_t fnv = 14695981039346656037ull;
};
ExpertRows expert_rows(const std::vector<int32_t>& ids, int experts) {
  ExpertRows r;
  r.rows.assign(experts, 0);
  for (const int32_t e : ids) ++r.rows[e];
  for (const int64_t n : r.rows) {
    r.total += n;
    r.max_rows = std::max(r.max_rows, n);
    r.touched += n > 0;
    r.fnv = (r.fnv ^ uint64_t(n)) * 1099511628211ull;
  }
  return r;
}
std::string routing_json(const ExpertRows& r) {
  char s[160];
  std::snprintf(s, sizeof(s), ", \"rows\": %lld, \"touched_experts\": %d, \"max_expert_rows\": %lld, "
                "\"expert_rows_fnv\": \"%016llx\"", static_cast<long long>(r.total), r.touched,
                static_cast<long long>(r.max_rows), static_cast<unsigned long long>(r.fnv));
  return s;
}

void upload(void* dst, const void* src, size_t bytes) {
  cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "upload");
}

// moe_gemm: experts, tokens, top_k (default 1), K, N, activation none|swiglu, routing
// balanced|random (default balanced), seed (default 1). The routing is built on the host
// (moe_routing), x [tokens, K] is permuted once by moe_permute (align 1) into the grouped layout,
// and only moe_grouped_gemm is timed: a [rows, K] x weights [experts, N, K] (nn.Linear layout) ->
// out [rows, N], or [rows, N / 2] with the SwiGLU epilogue. Rows = tokens * top_k, no padding.
//   FLOPs = 2 * rows * N * K (the useful ones: no padding rows; SwiGLU counts its whole N = 2I);
//   touched weight bytes = the experts with >= 1 row x N x K x 2, the floor of the few-rows regime:
//   weight_gbs = those bytes over the time (run_bench.py divides by the read ceiling).
// The weights of one case are far larger than the L2 on the model shapes; when the touched set
// with a and out is not, rotations_for() copies weights and out.
//   a_rows=gathered: the GEMM reads x's rows through permuted_token (a_rows) instead of the
//   permuted copy (what fused_moe does; the copy's own time is the difference moe_layer sees).
int bench_moe_gemm(const Args& a) {
  const int E = arg_int(a, "experts"), top_k = arg_int(a, "top_k", "1");
  const int64_t T = arg_int(a, "tokens"), K = arg_int(a, "K"), N = arg_int(a, "N");
  const std::string act_name = arg(a, "activation", "none");
  if (act_name != "none" && act_name != "swiglu") {
    std::fprintf(stderr, "tessera_bench: activation must be none or swiglu, got '%s'\n", act_name.c_str());
    return 2;
  }
  const bool swiglu = act_name == "swiglu";
  const int64_t n_out = swiglu ? N / 2 : N;
  // token_rows=16|32|64|128: force the Hopper kernel's tile shape (ablations); absent, its rule.
  const int token_rows = static_cast<int>(arg_int(a, "token_rows", "0"));
  dispatch::force_moe_gemm_token_rows(token_rows);
  const std::vector<int32_t> ids =
      moe_routing(arg(a, "routing", "balanced"), T, top_k, E, std::stoull(arg(a, "seed", "1")));
  const ExpertRows routed = expert_rows(ids, E);
  const int64_t rows = routed.total;

  // The grouped layout: moe_permute once, and its offsets checked against the host's counts.
  const int64_t capacity = moe_permute_capacity(T, top_k, E, 1);
  Buffer d_ids(ids.size() * 4), d_offsets(size_t(E + 1) * 4), d_ptok(size_t(capacity) * 4),
      d_inverse(ids.size() * 4), x(size_t(T) * K * 2), px(size_t(capacity) * K * 2);
  Buffer ws(std::max<size_t>(moe_permute_workspace_bytes(T, top_k, E), 4));
  upload(d_ids.get(), ids.data(), ids.size() * 4);
  fill_random(x.get(), x.bytes(), 1, false);
  MoePermuteArgs perm;
  perm.topk_ids = TensorView::contiguous(d_ids.get(), DType::kInt32, {T, top_k});
  perm.num_experts = E;
  perm.align = 1;
  perm.x = TensorView::contiguous(x.get(), DType::kBF16, {T, K});
  perm.permuted_x = TensorView::contiguous(px.get(), DType::kBF16, {capacity, K});
  perm.expert_offsets = TensorView::contiguous(d_offsets.get(), DType::kInt32, {E + 1});
  perm.permuted_token = TensorView::contiguous(d_ptok.get(), DType::kInt32, {capacity});
  perm.inverse = TensorView::contiguous(d_inverse.get(), DType::kInt32, {T, top_k});
  perm.workspace = ws.get();
  perm.workspace_size = ws.bytes();
  moe_permute(perm, nullptr);
  std::vector<int32_t> offsets(E + 1);
  cuda_ok(cudaMemcpy(offsets.data(), d_offsets.get(), offsets.size() * 4, cudaMemcpyDeviceToHost), "download");
  for (int e = 0; e < E; ++e) {
    if (offsets[e + 1] - offsets[e] != routed.rows[e]) {
      std::fprintf(stderr, "tessera_bench: moe_permute gave expert %d %d rows, the routing %lld\n", e,
                   offsets[e + 1] - offsets[e], static_cast<long long>(routed.rows[e]));
      return 1;
    }
  }

  const double touched_bytes = double(routed.touched) * N * K * 2;
  const size_t w_bytes = size_t(E) * N * K * 2, out_bytes = size_t(capacity) * n_out * 2;
  const int rot = rotations_for(touched_bytes + double(px.bytes()) + double(out_bytes));
  std::vector<std::unique_ptr<Buffer>> w, out;
  for (int r = 0; r < rot; ++r) {
    w.push_back(std::make_unique<Buffer>(w_bytes));
    out.push_back(std::make_unique<Buffer>(out_bytes));
    fill_random(w.back()->get(), w_bytes, 100 + r, false);
  }
  const std::string a_rows = arg(a, "a_rows", "copied");
  if (a_rows != "copied" && a_rows != "gathered") {
    std::fprintf(stderr, "tessera_bench: a_rows must be copied or gathered, got '%s'\n", a_rows.c_str());
    return 2;
  }
  const bool gathered = a_rows == "gathered";
  const double ms = median_ms([&](int i) {
    MoeGroupedGemmArgs g;
    g.a = TensorView::contiguous(px.get(), DType::kBF16, {capacity, K});
    if (gathered) {
      g.a = perm.x;
      g.a_rows = perm.permuted_token;
    }
    g.weights = TensorView::contiguous(w[i % rot]->get(), DType::kBF16, {E, N, K});
    g.expert_offsets = perm.expert_offsets;
    g.activation = swiglu ? MoeActivation::kSwiGLU : MoeActivation::kNone;
    g.out = TensorView::contiguous(out[i % rot]->get(), DType::kBF16, {capacity, n_out});
    moe_grouped_gemm(g, nullptr);
  });
  const double flops = 2.0 * double(rows) * N * K;
  char extra[320];
  std::snprintf(extra, sizeof(extra), ", \"activation\": \"%s\", \"touched_weight_bytes\": %.0f, \"weight_gbs\": %.1f, "
                "\"rotations\": %d, \"token_rows\": %d, \"a_rows\": \"%s\"", act_name.c_str(), touched_bytes,
                touched_bytes / (ms * 1e-3) / 1e9, rot, token_rows, a_rows.c_str());
  std::printf("{\"suite\": \"moe_gemm\", \"case\": \"%s\", \"metric\": \"TFLOP/s\", \"tessera\": %.2f, "
              "\"time_us\": %.2f%s%s}\n", arg(a, "name").c_str(), flops / (ms * 1e-3) / 1e12, ms * 1e3,
              routing_json(routed).c_str(), extra);
  return 0;
}

// moe_layer: experts, top_k, tokens, hidden, inter, [score softmax|sigmoid (softmax)]
// [renormalize true|false (true)] [seed (1)]: fused_moe from router logits (moe_router_logits) to
// the combined output, timed as one call (route, permute, grouped GEMM up + SwiGLU, grouped GEMM
// down, combine); no shared experts. Weights w1 [experts, 2 * inter, hidden] (gate rows, then up
// rows) and w2 [experts, hidden, inter] are allocated once per process (one case per process).
//   FLOPs = the useful GEMM FLOPs 2 T k H 2I + 2 T k I H (routing, SwiGLU and combine not counted);
//   touched weight bytes = the experts with >= 1 row x 3 H I x 2; weight_gbs as in moe_gemm.
// The topk_ids fused_moe wrote are checked against the host's top-k of the logits
// (routing_matches_host) and summarised as in moe_gemm, so the torch composition's rows per expert
// can be compared.
int bench_moe_layer(const Args& a) {
  const int E = arg_int(a, "experts"), top_k = arg_int(a, "top_k");
  const int64_t T = arg_int(a, "tokens"), H = arg_int(a, "hidden"), I = arg_int(a, "inter");
  const std::string score = arg(a, "score", "softmax");
  if (score != "softmax" && score != "sigmoid") {
    std::fprintf(stderr, "tessera_bench: score must be softmax or sigmoid, got '%s'\n", score.c_str());
    return 2;
  }
  const bool renormalize = arg(a, "renormalize", "true") == "true";
  // x_rows=gather|copy forces how the first GEMM gets x's rows (the ablation); absent (auto),
  // fused_moe's own rule (dispatch::fused_moe_rows).
  const std::string x_rows_arg = arg(a, "x_rows", "auto");
  if (x_rows_arg != "auto" && x_rows_arg != "gather" && x_rows_arg != "copy") {
    std::fprintf(stderr, "tessera_bench: x_rows must be auto, gather or copy, got '%s'\n", x_rows_arg.c_str());
    return 2;
  }
  const dispatch::FusedMoeRows forced_rows =
      x_rows_arg == "copy" ? dispatch::FusedMoeRows::kCopy : dispatch::FusedMoeRows::kGather;
  dispatch::force_fused_moe_rows(x_rows_arg == "auto" ? nullptr : &forced_rows);
  const std::string x_rows =
      dispatch::fused_moe_rows(I) == dispatch::FusedMoeRows::kCopy ? "copy" : "gather";  // what runs
  const std::vector<float> logits = moe_router_logits(T, E, std::stoull(arg(a, "seed", "1")));
  Buffer d_logits(logits.size() * 4), x(size_t(T) * H * 2), out(size_t(T) * H * 2), ids(size_t(T) * top_k * 4),
      weights(size_t(T) * top_k * 4);
  Buffer w1(size_t(E) * 2 * I * H * 2), w2(size_t(E) * H * I * 2);
  upload(d_logits.get(), logits.data(), d_logits.bytes());
  fill_random(x.get(), x.bytes(), 1, false);
  fill_random(w1.get(), w1.bytes(), 2, false);
  fill_random(w2.get(), w2.bytes(), 3, false);
  Buffer ws(std::max<size_t>(fused_moe_workspace_bytes(T, H, I, E, top_k), 256));

  FusedMoeArgs f;
  f.x = TensorView::contiguous(x.get(), DType::kBF16, {T, H});
  f.w1 = TensorView::contiguous(w1.get(), DType::kBF16, {E, 2 * I, H});
  f.w2 = TensorView::contiguous(w2.get(), DType::kBF16, {E, H, I});
  f.router_logits = TensorView::contiguous(d_logits.get(), DType::kFP32, {T, E});
  f.top_k = top_k;
  f.score = score == "sigmoid" ? MoeScore::kSigmoid : MoeScore::kSoftmax;
  f.renormalize = renormalize;
  f.topk_ids = TensorView::contiguous(ids.get(), DType::kInt32, {T, top_k});
  f.topk_weights = TensorView::contiguous(weights.get(), DType::kFP32, {T, top_k});
  f.out = TensorView::contiguous(out.get(), DType::kBF16, {T, H});
  f.workspace = ws.get();
  f.workspace_size = ws.bytes();
  auto run = [&](int) { fused_moe(f, nullptr); };
  const double ms = median_ms(run);
  const double stream_step_ms = stream_ms(run);

  std::vector<int32_t> chosen(size_t(T) * top_k);
  cuda_ok(cudaMemcpy(chosen.data(), ids.get(), chosen.size() * 4, cudaMemcpyDeviceToHost), "download");
  for (const int32_t e : chosen) {
    if (e < 0 || e >= E) {
      std::fprintf(stderr, "tessera_bench: fused_moe wrote expert id %d (experts %d)\n", e, E);
      return 1;
    }
  }
  const ExpertRows routed = expert_rows(chosen, E);
  const ExpertRows expected = expert_rows(host_top_k(logits, T, E, top_k), E);
  const double touched_bytes = double(routed.touched) * 3.0 * H * I * 2;
  const double flops = 2.0 * T * top_k * H * (2 * I) + 2.0 * T * top_k * I * H;
  char extra[400];
  std::snprintf(extra, sizeof(extra), ", \"stream_us\": %.2f, \"stream_tflops\": %.2f, \"touched_weight_bytes\": %.0f, "
                "\"weight_gbs\": %.1f, \"routing_matches_host\": %s, \"score\": \"%s\", \"renormalize\": %s, "
                "\"workspace_bytes\": %zu, \"x_rows\": \"%s\"", stream_step_ms * 1e3, flops / (stream_step_ms * 1e-3) / 1e12,
                touched_bytes, touched_bytes / (ms * 1e-3) / 1e9, routed.fnv == expected.fnv ? "true" : "false",
                score.c_str(), renormalize ? "true" : "false", ws.bytes(), x_rows.c_str());
  std::printf("{\"suite\": \"moe_layer\", \"case\": \"%s\", \"metric\": \"TFLOP/s\", \"tessera\": %.2f, "
              "\"time_us\": %.2f%s%s}\n", arg(a, "name").c_str(), flops / (ms * 1e-3) / 1e12, ms * 1e3,
              routing_json(routed).c_str(), extra);
  return 0;
}

}  // namespace

// The host cost of the CUDA calls a plan() makes, on this machine: cudaMemcpyAsync of pinned host
// memory to the device by size (the enqueue only, the GPU idle; the driver copies small ones into
// its command stream on the calling thread: BatchPrefillPaged's kMinStepCopyBytes), and the
// capture query, event wait and event record around it. Medians of 50, microseconds.
int bench_host_calls(const Args& a) {
  const int iterations = static_cast<int>(arg_int(a, "iterations", "50"));
  constexpr size_t kMost = size_t(1) << 20;
  Buffer device(kMost);
  void* pinned = nullptr;
  cuda_ok(cudaMallocHost(&pinned, kMost), "pinned");
  std::memset(pinned, 1, kMost);
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cudaEvent_t event;
  cuda_ok(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "event");
  cuda_ok(cudaEventRecord(event, stream), "event");
  auto median_us = [&](auto&& call) {
    std::vector<double> us(static_cast<size_t>(iterations), 0.0);
    for (double& u : us) {
      cuda_ok(cudaStreamSynchronize(stream), "sync");
      const auto t0 = std::chrono::steady_clock::now();
      call();
      u = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    std::nth_element(us.begin(), us.begin() + iterations / 2, us.end());
    return us[size_t(iterations / 2)];
  };
  cudaStreamCaptureStatus status;
  std::printf("{\"suite\": \"host_calls\", \"stream_is_capturing_us\": %.2f, \"event_synchronize_done_us\": %.2f, "
              "\"event_record_us\": %.2f}\n",
              median_us([&] { cudaStreamIsCapturing(stream, &status); }), median_us([&] { cudaEventSynchronize(event); }),
              median_us([&] { cudaEventRecord(event, stream); }));
  for (const size_t kb : {4, 8, 16, 24, 32, 40, 48, 64, 128, 640}) {
    const double us = median_us([&] { cudaMemcpyAsync(device.get(), pinned, kb << 10, cudaMemcpyHostToDevice, stream); });
    std::printf("{\"suite\": \"host_calls\", \"memcpy_async_pinned_kb\": %zu, \"enqueue_us\": %.2f}\n", kb, us);
  }
  cuda_ok(cudaStreamSynchronize(stream), "sync");
  cudaEventDestroy(event);
  cudaStreamDestroy(stream);
  cudaFreeHost(pinned);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: tessera_bench ceiling | host_calls | append | merge | decode | prefill | prefill_portable | "
                         "prefill_paged | prefill_plan | memory | moe_gemm | moe_layer key=value...\n");
    return 2;
  }
  const DeviceInfo info = device_info();
  if (!info.present) {
    std::fprintf(stderr, "tessera_bench: no GPU (%s); benchmarks need one\n", info.reason.c_str());
    return 3;
  }
  Args a;
  for (int i = 2; i < argc; ++i) {
    const char* eq = std::strchr(argv[i], '=');
    if (!eq) { std::fprintf(stderr, "tessera_bench: expected key=value, got '%s'\n", argv[i]); return 2; }
    a[std::string(argv[i], static_cast<size_t>(eq - argv[i]))] = eq + 1;
  }
  const std::string suite = argv[1];
  try {
    if (suite == "ceiling") {
      const size_t bytes = a.count("bytes") ? size_t(arg_int(a, "bytes")) : kCeilingBytes;
      const Ceilings c = measure_ceilings(bytes);
      std::printf("{\"gpu\": \"%s\", \"bytes\": %zu, \"copy\": %.4f, \"read\": %.4f, \"launch_us\": %.3f}\n",
                  info.name.c_str(), bytes, c.copy_tbs, c.read_tbs, c.launch_us);
      return 0;
    }
    if (suite == "host_calls") return bench_host_calls(a);
    if (suite == "append") return bench_append(a);
    if (suite == "merge") return bench_merge(a);
    if (suite == "decode") return bench_decode(a);
    if (suite == "prefill_portable") return bench_prefill("prefill_portable", a, AttentionPath::kPortable);
    if (suite == "prefill") return bench_prefill("prefill", a, AttentionPath::kAuto);
    if (suite == "memory") return bench_memory(a);
    if (suite == "prefill_paged") return bench_prefill_paged(a);
    if (suite == "prefill_plan") return bench_prefill_plan(a);
    if (suite == "moe_gemm") return bench_moe_gemm(a);
    if (suite == "moe_layer") return bench_moe_layer(a);
  } catch (const Error& e) {
    std::fprintf(stderr, "tessera_bench: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "tessera_bench: suite '%s' has no tessera benchmark yet\n", suite.c_str());
  return 4;
}
