// libFuzzer target: every public entry point's argument validation on arbitrary views, flags and
// host index arrays (mostly well formed, one rule broken now and then). A call must either be
// refused with tessera::Error or pass validation (and then fail on the CUDA call, since the target
// hides every GPU); any other exception, a crash or a sanitizer report is a finding. Host index
// arrays are always as long as the device views they mirror claim (that is the caller's part of
// the contract, which no entry point can check).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "tessera/tessera.h"

using namespace tessera;

namespace {

// Fake device addresses: validation never dereferences them, and no GPU is visible to run on.
constexpr uintptr_t kBase = uintptr_t(1) << 32;

DType pick_dtype(fuzz::FuzzInput& in, DType usual) {
  const DType all[] = {DType::kBF16, DType::kFP16, DType::kFP32, DType::kInt32};
  return in.range(0, 7) == 0 ? in.pick(all) : usual;
}

// A view of `shape` (row-major strides, a distinct 1 GiB region per view), then at most one broken
// rule: a dtype, a dim, a stride (zero, negative, huge), the pointer (misaligned, null), the device.
TensorView view(fuzz::FuzzInput& in, int region, DType dtype, std::vector<int64_t> shape) {
  TensorView t;
  t.dtype = pick_dtype(in, dtype);
  t.rank = static_cast<int>(shape.size());
  t.data = reinterpret_cast<void*>(kBase + (uintptr_t(region) << 30));
  int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride;
    stride *= std::max<int64_t>(1, shape[i]);
  }
  switch (in.range(0, 15)) {
    case 0: if (t.rank) t.shape[in.range(0, t.rank - 1)] += in.range(-2, 2); break;
    case 1: if (t.rank) t.stride[in.range(0, t.rank - 1)] = in.pick((const int64_t[]){0, -1, 3, int64_t(1) << 40, int64_t(1) << 62}); break;
    case 2: t.data = reinterpret_cast<char*>(t.data) + in.range(1, 15); break;
    case 3: t.data = nullptr; break;
    case 4: t.device = Device::kCPU; break;
    case 5: t.rank = static_cast<int>(in.range(0, TensorView::kMaxRank)); break;
    default: break;
  }
  return t;
}

// A CSR offset array of `count` entries (host), mostly valid, ending at most at `end`.
std::vector<int32_t> offsets(fuzz::FuzzInput& in, int64_t count, int64_t end) {
  std::vector<int32_t> v(std::max<int64_t>(count, 1) + 1, 0);
  for (int64_t i = 1; i < count; ++i) v[i] = v[i - 1] + static_cast<int32_t>(in.range(0, 2 * std::max<int64_t>(end, 1) / std::max<int64_t>(count, 1) + 1));
  if (count > 0 && in.range(0, 7) == 0) v[in.range(0, count - 1)] = static_cast<int32_t>(in.range(-3, end + 3));
  return v;
}

void call_prefill(fuzz::FuzzInput& in, bool paged) {
  const int64_t batch = in.range(0, 6), heads = in.pick((const int64_t[]){8, 4, 32, 6}), kv_heads = in.pick((const int64_t[]){2, 1, 8, 3});
  const int64_t d = in.pick((const int64_t[]){128, 64, 256, 96}), rows = in.range(0, 300);
  PrefillArgs a;
  PagedPrefillArgs p;
  const std::vector<int32_t> qo = offsets(in, batch + 1, rows);
  const std::vector<int32_t> kv = offsets(in, batch + 1, 700);
  const TensorView q = view(in, 0, DType::kBF16, {rows, heads, d});
  const TensorView o = view(in, 1, q.dtype, {rows, heads, d});
  const TensorView lse = in.flag() ? TensorView{} : view(in, 2, DType::kFP32, {rows, heads});
  const TensorView qo_indptr = view(in, 3, DType::kInt32, {batch + 1});
  const bool causal = in.flag();
  const int window = in.flag() ? -1 : static_cast<int>(in.range(-3, 500));
  const float scale = in.range(0, 7) == 0 ? -1.f : 0.f, soft_cap = in.range(0, 7) == 0 ? 30.f : 0.f;
  if (!paged) {
    a.q = q, a.o = o, a.lse = lse, a.qo_indptr = qo_indptr;
    a.k = view(in, 4, q.dtype, {kv.back() + in.range(0, 3), kv_heads, d});
    a.v = view(in, 5, q.dtype, {a.k.shape[0], kv_heads, d});
    a.kv_indptr = view(in, 6, DType::kInt32, {batch + 1});
    a.host_qo_indptr = qo.data();
    a.host_kv_indptr = kv.data();
    a.causal = causal, a.window_left = window, a.scale = scale, a.soft_cap = soft_cap;
    (void)choose_prefill_path(a);
    batch_prefill(a, nullptr);
    return;
  }
  const int64_t page = in.pick((const int64_t[]){16, 1, 64, 7}), pages = in.range(0, 64);
  std::vector<int32_t> ids(std::max<int32_t>(kv.back(), 0) + 1);
  for (int32_t& id : ids) id = static_cast<int32_t>(in.range(0, 31) == 0 ? in.range(-2, pages + 2) : in.range(0, std::max<int64_t>(pages - 1, 0)));
  std::vector<int32_t> last(batch + 1);
  for (int32_t& l : last) l = static_cast<int32_t>(in.range(0, 15) == 0 ? in.range(-1, page + 1) : in.range(1, page));
  p.q = q, p.o = o, p.lse = lse, p.qo_indptr = qo_indptr, p.host_qo_indptr = qo.data();
  p.cache.layout = in.range(0, 15) == 0 ? static_cast<KVLayout>(in.range(2, 9)) : in.flag() ? KVLayout::kNHD : KVLayout::kHND;
  const bool nhd = p.cache.layout == KVLayout::kNHD;
  p.cache.k_pages = view(in, 4, q.dtype, nhd ? std::vector<int64_t>{pages, page, kv_heads, d} : std::vector<int64_t>{pages, kv_heads, page, d});
  p.cache.v_pages = view(in, 5, q.dtype, nhd ? std::vector<int64_t>{pages, page, kv_heads, d} : std::vector<int64_t>{pages, kv_heads, page, d});
  p.table.indptr = view(in, 6, DType::kInt32, {batch + 1});
  p.table.indices = view(in, 7, DType::kInt32, {static_cast<int64_t>(ids.size()) - 1});
  p.table.last_page_len = view(in, 8, DType::kInt32, {batch});
  p.table.host_indptr = kv.data();
  p.table.host_indices = ids.data();
  p.table.host_last_page_len = last.data();
  p.causal = causal, p.window_left = window, p.scale = scale, p.soft_cap = soft_cap;
  batch_prefill_paged(p, nullptr);
}

void call_merge(fuzz::FuzzInput& in) {
  const int64_t rows = in.range(0, 64), heads = in.range(1, 8), d = in.pick((const int64_t[]){128, 64, 256, 40});
  const DType in_dtype = in.flag() ? DType::kFP32 : DType::kBF16;
  const TensorView o_a = view(in, 0, in_dtype, {rows, heads, d}), s_a = view(in, 1, DType::kFP32, {rows, heads});
  const TensorView o_b = view(in, 2, in_dtype, {rows, heads, d}), s_b = view(in, 3, DType::kFP32, {rows, heads});
  const TensorView o_out = view(in, 4, DType::kBF16, {rows, heads, d});
  const TensorView s_out = in.flag() ? TensorView{} : view(in, 5, DType::kFP32, {rows, heads});
  switch (in.range(0, 2)) {
    case 0: merge_state(o_a, s_a, o_b, s_b, o_out, s_out, nullptr); break;
    case 1: merge_state_in_place(o_a, s_a, in.flag() ? o_a : o_b, s_b, nullptr); break;
    default: {
      const int64_t n = in.range(0, 5);
      merge_states(view(in, 6, in_dtype, {rows, n, heads, d}), view(in, 7, DType::kFP32, {rows, n, heads}), o_out,
                   s_out, nullptr);
    }
  }
}

void call_append(fuzz::FuzzInput& in) {
  const int64_t batch = in.range(0, 5), page = in.pick((const int64_t[]){16, 1, 64}), pages = in.range(0, 32);
  const int64_t kv_heads = in.range(1, 4), d = in.pick((const int64_t[]){128, 64, 8, 12});
  const std::vector<int32_t> indptr = offsets(in, batch + 1, pages);
  std::vector<int32_t> ids(std::max<int32_t>(indptr[batch], 0) + 1);
  for (int32_t& id : ids) id = static_cast<int32_t>(in.range(-1, pages));
  std::vector<int32_t> last(batch + 1);
  for (int32_t& l : last) l = static_cast<int32_t>(in.range(0, page + 1));
  const std::vector<int32_t> append = offsets(in, batch + 1, 40);
  PagedKVCache cache;
  cache.layout = in.range(0, 15) == 0 ? static_cast<KVLayout>(in.range(2, 9)) : KVLayout::kNHD;
  cache.k_pages = view(in, 0, DType::kBF16, {pages, page, kv_heads, d});
  cache.v_pages = in.range(0, 7) == 0 ? cache.k_pages : view(in, 1, cache.k_pages.dtype, {pages, page, kv_heads, d});
  PageTable table;
  table.indptr = view(in, 2, DType::kInt32, {batch + 1});
  table.indices = view(in, 3, DType::kInt32, {static_cast<int64_t>(ids.size()) - 1});
  table.last_page_len = view(in, 4, DType::kInt32, {batch});
  table.host_indptr = indptr.data();
  table.host_indices = ids.data();
  table.host_last_page_len = last.data();
  const int64_t nnz = std::max<int32_t>(append[batch], 0) + in.range(0, 2);
  append_paged_kv(cache, table, view(in, 5, DType::kInt32, {batch + 1}), view(in, 6, cache.k_pages.dtype, {nnz, kv_heads, d}),
                  view(in, 7, cache.k_pages.dtype, {nnz, kv_heads, d}), nullptr, append.data());
}

void call_moe(fuzz::FuzzInput& in) {
  const int64_t tokens = in.range(0, 40), experts = in.pick((const int64_t[]){8, 1, 64, 1024, 1025, 0});
  const int64_t top_k = in.range(0, 9), hidden = in.pick((const int64_t[]){64, 8, 72, 12, 0});
  const int64_t inter = in.pick((const int64_t[]){32, 8, 36, 0});
  switch (in.range(0, 5)) {
    case 0: {
      MoeRouteArgs a;
      a.logits = view(in, 0, DType::kFP32, {tokens, experts});
      a.top_k = static_cast<int>(top_k);
      a.num_groups = static_cast<int>(in.pick((const int64_t[]){1, 4, 3, 0, 33}));
      a.topk_groups = static_cast<int>(in.range(-1, 5));
      a.score = in.range(0, 15) == 0 ? static_cast<MoeScore>(in.range(2, 9)) : MoeScore::kSoftmax;
      if (in.flag()) a.selection_bias = view(in, 1, DType::kFP32, {experts});
      a.topk_ids = view(in, 2, DType::kInt32, {tokens, top_k});
      a.topk_weights = view(in, 3, DType::kFP32, {tokens, top_k});
      moe_route(a, nullptr);
      break;
    }
    case 1: {
      MoePermuteArgs a;
      a.topk_ids = view(in, 0, DType::kInt32, {tokens, top_k});
      a.num_experts = static_cast<int>(experts);
      a.align = static_cast<int>(in.pick((const int64_t[]){1, 128, 0, 1025}));
      const int64_t cap = tokens * std::max<int64_t>(top_k, 0) + std::max<int64_t>(experts, 0) * std::max(a.align - 1, 0);
      a.expert_offsets = view(in, 1, DType::kInt32, {experts + 1});
      a.permuted_token = view(in, 2, DType::kInt32, {cap});
      a.inverse = view(in, 3, DType::kInt32, {tokens, top_k});
      if (in.flag()) {
        a.x = view(in, 4, DType::kBF16, {tokens, hidden});
        a.permuted_x = view(in, 5, a.x.dtype, {cap, hidden});
      }
      a.workspace = reinterpret_cast<void*>(kBase + (uintptr_t(6) << 30) + (in.range(0, 7) == 0 ? 2 : 0));
      a.workspace_size = static_cast<std::size_t>(in.range(0, 1 << 20));
      moe_permute(a, nullptr);
      break;
    }
    case 2: {
      MoeGroupedGemmArgs a;
      const int64_t rows = tokens * 4, n = in.flag() ? inter * 2 : hidden;
      a.a = view(in, 0, DType::kBF16, {rows, hidden});
      a.weights = view(in, 1, a.a.dtype, {experts, n, hidden});
      a.expert_offsets = view(in, 2, DType::kInt32, {experts + 1});
      a.activation = in.range(0, 15) == 0 ? static_cast<MoeActivation>(in.range(2, 9))
                                          : in.flag() ? MoeActivation::kSwiGLU : MoeActivation::kNone;
      a.out = view(in, 3, a.a.dtype, {rows, a.activation == MoeActivation::kSwiGLU ? n / 2 : n});
      moe_grouped_gemm(a, nullptr);
      break;
    }
    case 3: {
      MoeCombineArgs a;
      a.expert_out = view(in, 0, DType::kBF16, {tokens * std::max<int64_t>(top_k, 1), hidden});
      a.inverse = view(in, 1, DType::kInt32, {tokens, top_k});
      a.topk_weights = view(in, 2, DType::kFP32, {tokens, top_k});
      if (in.flag()) a.shared_out = view(in, 3, a.expert_out.dtype, {tokens, hidden});
      a.out = in.range(0, 15) == 0 ? a.expert_out : view(in, 4, a.expert_out.dtype, {tokens, hidden});
      moe_combine(a, nullptr);
      break;
    }
    default: {
      FusedMoeArgs a;
      a.x = view(in, 0, DType::kBF16, {tokens, hidden});
      a.w1 = view(in, 1, a.x.dtype, {experts, 2 * inter, hidden});
      a.w2 = view(in, 2, a.x.dtype, {experts, hidden, inter});
      a.top_k = static_cast<int>(top_k);
      if (in.flag()) {
        a.router_logits = view(in, 3, DType::kFP32, {tokens, experts});
      }
      if (in.flag() || a.router_logits.rank == 0) {
        a.topk_ids = view(in, 4, DType::kInt32, {tokens, top_k});
        a.topk_weights = view(in, 5, DType::kFP32, {tokens, top_k});
      }
      if (in.range(0, 3) == 0) {
        a.shared_w1 = view(in, 6, a.x.dtype, {2 * inter, hidden});
        a.shared_w2 = view(in, 7, a.x.dtype, {hidden, inter});
      }
      a.out = view(in, 8, a.x.dtype, {tokens, hidden});
      a.workspace = reinterpret_cast<void*>(kBase + (uintptr_t(9) << 30) + (in.range(0, 7) == 0 ? 8 : 0));
      a.workspace_size = static_cast<std::size_t>(in.range(0, 1 << 24));
      if (in.range(0, 3) == 0) {
        try {
          a.workspace_size = fused_moe_workspace_bytes(tokens, hidden, inter, static_cast<int>(experts),
                                                       static_cast<int>(top_k), a.shared_w1.rank ? inter : 0);
        } catch (const Error&) {
        }
      }
      fused_moe(a, nullptr);
    }
  }
}

void call_decoder_config(fuzz::FuzzInput& in) {
  DecodeConfig c;
  c.num_kv_heads = static_cast<int>(in.range(-1, 16));
  c.num_qo_heads = c.num_kv_heads * static_cast<int>(in.range(-1, 20));
  c.head_dim = static_cast<int>(in.pick((const int64_t[]){128, 64, 256, 96, 0}));
  c.page_size = static_cast<int>(in.range(-1, 300));
  c.dtype = pick_dtype(in, DType::kBF16);
  c.layout = in.range(0, 15) == 0 ? static_cast<KVLayout>(in.range(2, 9)) : KVLayout::kHND;
  c.max_batch_size = static_cast<int>(in.range(-1, 1 << 21));
  c.max_qo_len = static_cast<int>(in.range(-1, 10));
  c.window_left = static_cast<int>(in.range(-3, 100));
  c.pipeline_stages = static_cast<int>(in.range(0, 4));
  c.ctas_per_sm = static_cast<int>(in.range(-1, 3));
  c.scale = in.range(0, 7) == 0 ? -1.f : 0.f;
  (void)BatchDecoder::workspace_bytes(c);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("CUDA_VISIBLE_DEVICES", "", 1);  // nothing may run on a GPU with these fake pointers
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  try {
    switch (in.range(0, 5)) {
      case 0: call_prefill(in, false); break;
      case 1: call_prefill(in, true); break;
      case 2: call_merge(in); break;
      case 3: call_append(in); break;
      case 4: call_moe(in); break;
      default: call_decoder_config(in); break;
    }
  } catch (const Error&) {
    // Refused (or, past validation, no GPU to run on): what every bad input must get.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_arguments: an exception other than tessera::Error escaped: %s\n", e.what());
    std::abort();
  }
  return 0;
}
