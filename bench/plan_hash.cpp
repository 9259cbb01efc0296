// Prints one line per random batch: the chosen chunk, the estimate and a hash of the whole plan
// image. Two builds of the planner that must decide alike print the same lines (a change meant
// to be decision-identical is checked with `diff` of their outputs). CPU only.
//   tessera_plan_hash [batches]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include "plan/decode_plan.h"

using namespace tessera;

int main(int argc, char** argv) {
  const int batches = argc > 1 ? std::atoi(argv[1]) : 3000;
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < batches; ++trial) {
    const int heads = (int[]){1, 2, 4, 8}[rng() % 4];
    const int page = (int[]){1, 16, 64}[rng() % 3];
    const int batch = 1 + int(rng() % (trial % 5 == 0 ? 1024 : 128));
    std::vector<int64_t> len(batch);
    for (auto& l : len) {
      const int kind = int(rng() % 10);
      l = kind == 0 ? int64_t(rng() % 65536) : kind < 3 ? int64_t(rng() % 8192) : int64_t(rng() % 2048);
      if (rng() % 20 == 0) l = 0;
    }
    std::vector<int32_t> indptr{0}, indices, last, qo{0};
    for (int64_t L : len) {
      const int32_t pages = int32_t((L + page - 1) / page);
      for (int32_t p = 0; p < pages; ++p) indices.push_back(int32_t(indices.size()));
      indptr.push_back(indptr.back() + pages);
      last.push_back(pages ? int32_t(L - int64_t(pages - 1) * page) : 0);
      qo.push_back(qo.back() + (rng() % 7 == 0 ? 0 : 1));
    }
    plan::PlanCapacity cap;
    cap.max_batch_size = 1024; cap.max_qo_len = 1; cap.num_qo_heads = 8 * heads; cap.num_kv_heads = heads;
    cap.head_dim = (rng() % 3 == 0) ? 256 : 128; cap.num_sms = 132; cap.ctas_per_sm = 2;
    cap.one_cta_per_sm_shape = rng() % 2; if (cap.head_dim >= 256) cap.one_cta_per_sm_use = plan::OneCtaPerSmUse::kAlsoSplitLists;
    plan::DecodePlanner planner(cap);
    const auto bsr = format::bsr_from_page_table(page, batch, indptr.data(), indices.data(), last.data());
    std::vector<unsigned char> image(planner.layout().plan_bytes);
    const plan::Plan& p = planner.plan(bsr, qo.data(), image.data());
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : image) { h ^= c; h *= 1099511628211ull; }
    std::printf("%d %d %.6f %016llx\n", trial, p.chunk_tokens, p.estimated_us, (unsigned long long)h);
  }
}
