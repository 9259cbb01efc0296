// MoE routing and permutation on the GPU against the CPU reference (src/reference/moe_ref.h).
// Routing: logits are a shuffled grid (distinct and far enough apart that fp32 and fp64 rank them
// alike), so expert ids must match exactly and weights within 1e-5; ties are tested with equal
// logits (the lower id wins). Permutation: exact equality of every output, rows bitwise, over
// skewed routings (empty experts, one expert taking everything, dropped ids), CUDA-graph replay
// equal to eager, repeat runs bitwise equal.
#include <gmock/gmock.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "reference/moe_ref.h"
#include "tessera/moe.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

struct RouteCase {
  int tokens = 1, experts = 8, top_k = 1;
  MoeScore score = MoeScore::kSoftmax;
  bool renormalize = false, bias = false;
  int num_groups = 1, topk_groups = 1;
  float routed_scaling = 1.f;
  DType dtype = DType::kFP32;
  bool ties = false;  // every logit equal
};

std::string describe(const RouteCase& c) {
  return "T " + std::to_string(c.tokens) + " E " + std::to_string(c.experts) + " k " + std::to_string(c.top_k) +
         (c.score == MoeScore::kSigmoid ? " sigmoid" : " softmax") + (c.renormalize ? " renorm" : "") +
         (c.bias ? " bias" : "") + " groups " + std::to_string(c.num_groups) + "/" + std::to_string(c.topk_groups) +
         " " + dtype_name(c.dtype) + (c.ties ? " ties" : "");
}

void run_route(const RouteCase& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  std::mt19937 rng(seed);
  // Per token a shuffled grid over [-3, 3]: distinct logits, exact in bf16 / fp16 for E <= 256
  // only when rounded, so the reference reads the rounded values.
  std::vector<float> logits(size_t(c.tokens) * c.experts);
  std::vector<int> order(c.experts);
  for (int t = 0; t < c.tokens; ++t) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int e = 0; e < c.experts; ++e) {
      // Offset by a third of a step: no two logits are negatives of each other, so sigmoid pairs
      // never sum to exactly 1 and group scores do not tie exactly.
      const float x = c.ties ? 0.5f : -3.f + 6.f * (float(order[e]) + 1.f / 3.f) / float(c.experts);
      logits[size_t(t) * c.experts + e] = c.dtype == DType::kFP32 ? x : round_to(x, c.dtype);
    }
  }
  std::vector<float> bias(c.experts);
  if (c.bias) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int e = 0; e < c.experts; ++e) bias[e] = c.ties ? 0.f : 2.f * float(order[e] % 7);  // ties across groups on purpose
  }
  ref::RouterParams rp;
  rp.num_experts = c.experts;
  rp.top_k = c.top_k;
  rp.score = c.score == MoeScore::kSigmoid ? ref::RouterScore::kSigmoid : ref::RouterScore::kSoftmax;
  rp.renormalize = c.renormalize;
  rp.num_groups = c.num_groups;
  rp.topk_groups = c.topk_groups;
  if (c.bias) rp.selection_bias.assign(bias.begin(), bias.end());
  rp.routed_scaling = c.routed_scaling;
  const ref::Routing want = ref::route(logits.data(), c.tokens, rp);

  DeviceBuffer d_logits(std::max<size_t>(logits.size() * 4, 4)), d_bias(size_t(c.experts) * 4);
  DeviceBuffer d_ids(std::max<size_t>(size_t(c.tokens) * c.top_k * 4, 4)), d_w(std::max<size_t>(size_t(c.tokens) * c.top_k * 4, 4));
  if (c.dtype == DType::kFP32) {
    d_logits.upload(logits);
  } else {
    std::vector<uint16_t> bits(logits.size());
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = to_bits(logits[i], c.dtype);
    d_logits.upload(bits);
  }
  d_bias.upload(bias);
  d_ids.poison();
  d_w.poison();
  MoeRouteArgs a;
  a.logits = TensorView::contiguous(d_logits.get(), c.dtype, {c.tokens, c.experts});
  if (c.bias) a.selection_bias = TensorView::contiguous(d_bias.get(), DType::kFP32, {c.experts});
  a.top_k = c.top_k;
  a.score = c.score;
  a.renormalize = c.renormalize;
  a.num_groups = c.num_groups;
  a.topk_groups = c.topk_groups;
  a.routed_scaling = c.routed_scaling;
  a.topk_ids = TensorView::contiguous(d_ids.get(), DType::kInt32, {c.tokens, c.top_k});
  a.topk_weights = TensorView::contiguous(d_w.get(), DType::kFP32, {c.tokens, c.top_k});
  moe_route(a, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const auto ids = d_ids.download<int32_t>(size_t(c.tokens) * c.top_k);
  const auto w = d_w.download<float>(size_t(c.tokens) * c.top_k);
  int bad = 0;
  for (size_t i = 0; i < ids.size() && bad < 5; ++i) {
    if (ids[i] != want.expert[i]) {
      ADD_FAILURE() << "token " << i / c.top_k << " choice " << i % c.top_k << ": expert " << ids[i] << ", want "
                    << want.expert[i];
      ++bad;
    } else if (!(std::abs(double(w[i]) - want.weight[i]) <= 2e-6 + 1e-5 * std::abs(want.weight[i]))) {
      ADD_FAILURE() << "token " << i / c.top_k << " choice " << i % c.top_k << ": weight " << w[i] << ", want "
                    << want.weight[i];
      ++bad;
    }
  }
}

TEST(GpuMoeRoute, AgainstTheReference) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 1;
  int r = 0;
  for (int experts : {8, 64, 128, 256}) {
    for (int top_k : {1, 2, 8}) {
      for (int tokens : {1, 3, 127, 1024}) {
        RouteCase c;
        c.tokens = tokens;
        c.experts = experts;
        c.top_k = top_k;
        c.score = r % 2 ? MoeScore::kSigmoid : MoeScore::kSoftmax;
        c.renormalize = r % 3 != 0;
        c.dtype = (r / 2) % 3 == 1 ? DType::kBF16 : (r / 2) % 3 == 2 ? DType::kFP16 : DType::kFP32;  // x both scores
        c.routed_scaling = r % 5 == 2 ? 2.5f : 1.f;
        run_route(c, seed++);
        ++r;
      }
    }
  }
}

// DeepSeek-V3 (256 experts, 8 groups keep 4, top-8, sigmoid + selection bias, renormalised,
// scaled 2.5) and Qwen3 / Mixtral style, with ties.
TEST(GpuMoeRoute, GroupedBiasedAndTies) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 100;
  RouteCase ds;
  ds.tokens = 127;
  ds.experts = 256;
  ds.top_k = 8;
  ds.score = MoeScore::kSigmoid;
  ds.renormalize = true;
  ds.bias = true;
  ds.num_groups = 8;
  ds.topk_groups = 4;
  ds.routed_scaling = 2.5f;
  run_route(ds, seed++);
  ds.dtype = DType::kBF16;
  run_route(ds, seed++);
  ds.num_groups = 32;  // groups of 8 experts, keep 4 of 32 groups
  ds.topk_groups = 4;
  run_route(ds, seed++);
  // Ties: every logit (and bias) equal: the lowest ids (and groups) win.
  for (int groups : {1, 8}) {
    RouteCase t;
    t.tokens = 33;
    t.experts = 64;
    t.top_k = 8;
    t.ties = true;
    t.bias = groups > 1;
    t.num_groups = groups;
    t.topk_groups = groups > 1 ? 2 : 1;
    t.score = groups > 1 ? MoeScore::kSigmoid : MoeScore::kSoftmax;
    run_route(t, seed++);
  }
  // 512 experts (the kernel's limit), 32 choices.
  RouteCase big;
  big.tokens = 5;
  big.experts = 512;
  big.top_k = 32;
  big.renormalize = true;
  run_route(big, seed++);
}

TEST(GpuMoeRoute, ArgumentsAreValidated) {
  TESSERA_REQUIRE_GPU();
  DeviceBuffer logits(16 * 64 * 4), ids(16 * 9 * 4), w(16 * 9 * 4);
  logits.upload(std::vector<float>(16 * 64, 0.f));  // one valid call runs on it (initcheck-clean)
  auto args = [&] {
    MoeRouteArgs a;
    a.logits = TensorView::contiguous(logits.get(), DType::kFP32, {16, 64});
    a.top_k = 8;
    a.topk_ids = TensorView::contiguous(ids.get(), DType::kInt32, {16, 8});
    a.topk_weights = TensorView::contiguous(w.get(), DType::kFP32, {16, 8});
    return a;
  };
  auto expect_error = [](const MoeRouteArgs& a, const std::string& arg) {
    try {
      moe_route(a, nullptr);
      ADD_FAILURE() << "accepted; expected an error naming '" << arg << "'";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("argument '" + arg + "'"));
    }
  };
  MoeRouteArgs a = args();
  a.top_k = 65;
  expect_error(a, "top_k");
  a = args();
  a.num_groups = 3;
  expect_error(a, "num_groups");
  a = args();
  a.num_groups = 8;
  a.topk_groups = 1;
  moe_route(a, nullptr);  // 8 choices from the one kept group of 8: valid
  CUDA_OK(cudaDeviceSynchronize());
  a.top_k = 9;  // 9 are not
  a.topk_ids = TensorView::contiguous(ids.get(), DType::kInt32, {16, 9});
  a.topk_weights = TensorView::contiguous(w.get(), DType::kFP32, {16, 9});
  expect_error(a, "top_k");
  a = args();
  a.topk_ids = TensorView::contiguous(ids.get(), DType::kFP32, {16, 8});
  expect_error(a, "topk_ids");
  a = args();
  a.topk_weights = TensorView::contiguous(ids.get(), DType::kFP32, {16, 8});
  try {  // the same bytes as topk_ids: the error names both
    moe_route(a, nullptr);
    ADD_FAILURE() << "overlapping outputs accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("'topk_weights'"));
  }
  a = args();
  a.logits = TensorView::contiguous(logits.get(), DType::kInt32, {16, 64});
  expect_error(a, "logits");
}

// ---- Permutation -------------------------------------------------------------------------------
struct PermuteCase {
  int tokens = 1, top_k = 1, experts = 8, align = 1, hidden = 64;
  enum Skew { kUniform, kOneExpert, kHalfEmpty, kDropped } skew = kUniform;
};

std::string describe(const PermuteCase& c) {
  static const char* skews[] = {"uniform", "one expert", "half the experts empty", "some ids dropped"};
  return "T " + std::to_string(c.tokens) + " k " + std::to_string(c.top_k) + " E " + std::to_string(c.experts) +
         " align " + std::to_string(c.align) + " hidden " + std::to_string(c.hidden) + " " + skews[c.skew];
}

struct PermuteRun {
  std::vector<int32_t> offsets, permuted_token, inverse;
  std::vector<uint16_t> rows;
};

void run_permute(const PermuteCase& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  std::mt19937 rng(seed);
  const int64_t entries = int64_t(c.tokens) * c.top_k;
  std::vector<int32_t> ids(size_t(std::max<int64_t>(entries, 1)));
  std::uniform_int_distribution<int> pick(0, c.experts - 1);
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int k = 0; k < c.top_k; ++k) {
      int e = pick(rng);
      if (c.skew == PermuteCase::kOneExpert) e = c.experts / 2;
      if (c.skew == PermuteCase::kHalfEmpty) e = (e / 2) * 2;
      if (c.skew == PermuteCase::kDropped && e % 5 == 0) e = (e % 2) ? c.experts + e : -1;
      ids[size_t(t * c.top_k + k)] = e;
    }
  }
  const int64_t capacity = moe_permute_capacity(c.tokens, c.top_k, c.experts, c.align);
  const ref::Permutation want = ref::permute(ids.data(), c.tokens, c.top_k, c.experts, c.align, capacity);
  std::vector<uint16_t> x_bits;
  random_16bit(size_t(c.tokens) * c.hidden, DType::kBF16, rng, x_bits, -2.f, 2.f);
  x_bits.resize(std::max<size_t>(x_bits.size(), 8));

  DeviceBuffer d_ids(ids.size() * 4), d_x(x_bits.size() * 2), d_px(size_t(std::max<int64_t>(capacity, 1)) * c.hidden * 2);
  DeviceBuffer d_off(size_t(c.experts + 1) * 4), d_tok(size_t(std::max<int64_t>(capacity, 1)) * 4);
  DeviceBuffer d_inv(ids.size() * 4);
  const size_t ws_bytes = moe_permute_workspace_bytes(c.tokens, c.top_k, c.experts);
  DeviceBuffer d_ws(std::max<size_t>(ws_bytes, 256));
  d_ids.upload(ids);
  d_x.upload(x_bits);
  MoePermuteArgs a;
  a.topk_ids = TensorView::contiguous(d_ids.get(), DType::kInt32, {c.tokens, c.top_k});
  a.num_experts = c.experts;
  a.align = c.align;
  a.x = TensorView::contiguous(d_x.get(), DType::kBF16, {c.tokens, c.hidden});
  a.permuted_x = TensorView::contiguous(d_px.get(), DType::kBF16, {capacity, c.hidden});
  a.expert_offsets = TensorView::contiguous(d_off.get(), DType::kInt32, {c.experts + 1});
  a.permuted_token = TensorView::contiguous(d_tok.get(), DType::kInt32, {capacity});
  a.inverse = TensorView::contiguous(d_inv.get(), DType::kInt32, {c.tokens, c.top_k});
  a.workspace = d_ws.get();
  a.workspace_size = ws_bytes;
  // Integer outputs start as 0x5A5A5A5A, not the poison's -1, which is a value they must hold.
  auto fill_int_outputs = [&] {
    for (DeviceBuffer* b : {&d_off, &d_tok, &d_inv}) cudaMemset(b->get(), 0x5A, b->bytes());
  };
  auto run = [&](cudaStream_t stream) {
    d_px.poison();
    fill_int_outputs();
    moe_permute(a, stream);
    if (cudaStreamSynchronize(stream) != cudaSuccess) throw std::runtime_error("moe_permute failed on the GPU");
    PermuteRun r;
    r.offsets = d_off.download<int32_t>(size_t(c.experts + 1));
    r.permuted_token = d_tok.download<int32_t>(size_t(capacity));
    r.inverse = d_inv.download<int32_t>(size_t(entries));
    r.rows = d_px.download<uint16_t>(size_t(capacity) * c.hidden);
    return r;
  };
  const PermuteRun got = run(nullptr);
  EXPECT_EQ(got.offsets, want.offsets);
  EXPECT_EQ(got.permuted_token, want.permuted_token);
  EXPECT_EQ(got.inverse, want.inverse);
  // Rows: the token's row, zeros on padding inside the segments, untouched (poison) past the end.
  int bad = 0;
  for (int64_t row = 0; row < capacity && bad < 3; ++row) {
    const int32_t t = want.permuted_token[size_t(row)];
    for (int j = 0; j < c.hidden; ++j) {
      const uint16_t g = got.rows[size_t(row * c.hidden + j)];
      const uint16_t w = row >= want.offsets.back() ? uint16_t(0xFFFF) : t < 0 ? uint16_t(0) : x_bits[size_t(t) * c.hidden + j];
      if (g != w) {
        ADD_FAILURE() << "permuted_x row " << row << " col " << j << ": " << g << ", want " << w;
        ++bad;
        break;
      }
    }
  }
  // Deterministic, and the same inside a CUDA graph.
  const PermuteRun again = run(nullptr);
  EXPECT_TRUE(again.inverse == got.inverse && again.rows == got.rows && again.permuted_token == got.permuted_token &&
              again.offsets == got.offsets)
      << "a second run differs";
  Stream stream;
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  moe_permute(a, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  d_px.poison();
  fill_int_outputs();
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(d_off.download<int32_t>(size_t(c.experts + 1)), got.offsets) << "graph replay";
  EXPECT_EQ(d_inv.download<int32_t>(size_t(entries)), got.inverse) << "graph replay";
  EXPECT_EQ(d_tok.download<int32_t>(size_t(capacity)), got.permuted_token) << "graph replay";
  EXPECT_EQ(d_px.download<uint16_t>(size_t(capacity) * c.hidden), got.rows) << "graph replay";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(GpuMoePermute, AgainstTheReference) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 500;
  int r = 0;
  for (int experts : {8, 64, 256}) {
    for (int top_k : {1, 2, 8}) {
      for (int tokens : {1, 3, 127, 1024}) {
        PermuteCase c;
        c.tokens = tokens;
        c.top_k = top_k;
        c.experts = experts;
        c.align = r % 3 == 0 ? 1 : r % 3 == 1 ? 16 : 128;
        c.hidden = r % 2 ? 64 : 136;  // a hidden size that is not a power of two
        c.skew = PermuteCase::Skew(r % 4);
        run_permute(c, seed++);
        ++r;
      }
    }
  }
  // Several chunks with a partial last one, one expert, the most experts, the widest alignment,
  // no tokens, expert counts that are not powers of two.
  const PermuteCase edges[] = {
      {1000, 3, 60, 16, 136, PermuteCase::kDropped}, {257, 2, 1, 1, 64, PermuteCase::kUniform},
      {300, 4, 1024, 1, 8, PermuteCase::kUniform},   {50, 2, 160, 1024, 8, PermuteCase::kHalfEmpty},
      {0, 2, 8, 16, 64, PermuteCase::kUniform},
  };
  for (const PermuteCase& c : edges) run_permute(c, seed++);
  // 32768 tokens x top-8 (256 chunks of entries), 128 experts, everything to one expert too.
  for (auto skew : {PermuteCase::kUniform, PermuteCase::kOneExpert}) {
    PermuteCase c;
    c.tokens = 32768;
    c.top_k = 8;
    c.experts = 128;
    c.align = 64;
    c.hidden = 16;
    c.skew = skew;
    run_permute(c, seed++);
  }
}

TEST(GpuMoePermute, ArgumentsAreValidated) {
  TESSERA_REQUIRE_GPU();
  const int T = 16, k = 2, E = 8;
  const int64_t cap = moe_permute_capacity(T, k, E, 16);
  DeviceBuffer ids(T * k * 4), off((E + 1) * 4), tok(cap * 4), inv(T * k * 4), ws(moe_permute_workspace_bytes(T, k, E));
  auto args = [&] {
    MoePermuteArgs a;
    a.topk_ids = TensorView::contiguous(ids.get(), DType::kInt32, {T, k});
    a.num_experts = E;
    a.align = 16;
    a.expert_offsets = TensorView::contiguous(off.get(), DType::kInt32, {E + 1});
    a.permuted_token = TensorView::contiguous(tok.get(), DType::kInt32, {cap});
    a.inverse = TensorView::contiguous(inv.get(), DType::kInt32, {T, k});
    a.workspace = ws.get();
    a.workspace_size = ws.bytes();
    return a;
  };
  auto expect_error = [](const MoePermuteArgs& a, const std::string& arg) {
    try {
      moe_permute(a, nullptr);
      ADD_FAILURE() << "accepted; expected an error naming '" << arg << "'";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("argument '" + arg + "'"));
    }
  };
  MoePermuteArgs a = args();
  a.permuted_token = TensorView::contiguous(tok.get(), DType::kInt32, {cap - 1});
  expect_error(a, "permuted_token");
  a = args();
  a.expert_offsets = TensorView::contiguous(off.get(), DType::kInt32, {E});
  expect_error(a, "expert_offsets");
  a = args();
  a.workspace_size = 16;
  expect_error(a, "workspace_size");
  a = args();
  a.inverse = TensorView::contiguous(ids.get(), DType::kInt32, {T, k});  // the ids' own bytes
  expect_error(a, "inverse");
  a = args();
  a.num_experts = 0;
  expect_error(a, "num_experts");
}

}  // namespace
}  // namespace tessera::testing
