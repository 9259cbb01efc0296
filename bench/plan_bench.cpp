// CPU cost of DecodePlanner::plan for a serving step (targets: < 20 us for 256 requests, < 50 us
// for 1024), and of the fixed-grid paged prefill's static schedule (plan/prefill_schedule.h, the
// part of BatchPrefillPaged::plan that grows with the step's tiles). Prints one JSON object per
// case. No GPU needed: the planners are pure C++. The capacity is the H200's at hd128 (132 SMs,
// two CTAs per SM, the one-CTA-per-SM shape available; the Hopper prefill's 128 x 128 tiles, one
// slot per SM).
//   tessera_plan_bench [iterations] [case-filter]   (only the cases whose name contains the filter)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "plan/decode_plan.h"
#include "plan/prefill_schedule.h"

using namespace tessera;

namespace {

// Streams 64 MB through the caches (more than any host's last level), so the next call finds none
// of its data there.
void evict_caches() {
  static std::vector<uint64_t> buffer(size_t(8) << 20);
  static uint64_t sink = 0;
  for (size_t i = 0; i < buffer.size(); i += 8) buffer[i] += ++sink;
}

struct PageTable {
  std::vector<int32_t> indptr{0}, indices, last, qo{0};
};

PageTable make(const std::vector<int64_t>& kv_len, int32_t page) {
  PageTable t;
  for (int64_t len : kv_len) {
    const int32_t pages = static_cast<int32_t>((len + page - 1) / page);
    for (int32_t p = 0; p < pages; ++p) t.indices.push_back(static_cast<int32_t>(t.indices.size()));
    t.indptr.push_back(t.indptr.back() + pages);
    t.last.push_back(pages ? static_cast<int32_t>(len - int64_t(pages - 1) * page) : 0);
    t.qo.push_back(t.qo.back() + 1);
  }
  return t;
}

const char* g_filter = "";

void run(const char* name, const std::vector<int64_t>& kv_len, int32_t page, int iterations,
         int32_t kv_heads = 8) {
  if (std::string(name).find(g_filter) == std::string::npos) return;
  const PageTable t = make(kv_len, page);
  plan::PlanCapacity cap;
  cap.max_batch_size = 1024;
  cap.max_qo_len = 1;
  cap.num_qo_heads = 8 * kv_heads;
  cap.num_kv_heads = kv_heads;
  cap.head_dim = 128;
  cap.num_sms = 132;
  cap.ctas_per_sm = 2;
  cap.one_cta_per_sm_shape = true;
  // As BatchDecoder's capacity at hd128 (decode_api.cpp).
  if (kv_heads == 1) cap.one_cta_per_sm_use = plan::OneCtaPerSmUse::kWheneverItFits;
  plan::DecodePlanner planner(cap);
  const auto bsr = format::bsr_from_page_table(page, static_cast<int32_t>(kv_len.size()),
                                               t.indptr.data(), t.indices.data(), t.last.data());
  // Timed: plan() into its own storage, and plan() writing the whole image into a host buffer
  // (what BatchDecoder::plan does before enqueueing the copy; the work items go straight there).
  std::vector<unsigned char> image(planner.layout().plan_bytes);
  std::vector<double> us(iterations), with_image(iterations);
  size_t items = 0, tasks = 0;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const plan::Plan& p = planner.plan(bsr, t.qo.data());
    const auto t1 = std::chrono::steady_clock::now();
    planner.plan(bsr, t.qo.data(), image.data());
    const auto t2 = std::chrono::steady_clock::now();
    items = p.work.size();
    tasks = static_cast<size_t>(p.num_tasks);
    us[i] = std::chrono::duration<double, std::micro>(t1 - t0).count();
    with_image[i] = std::chrono::duration<double, std::micro>(t2 - t1).count();
  }
  std::nth_element(us.begin(), us.begin() + iterations / 2, us.end());
  std::nth_element(with_image.begin(), with_image.begin() + iterations / 2, with_image.end());
  std::printf("{\"suite\": \"plan\", \"case\": \"%s\", \"metric\": \"us\", \"tessera\": %.3f, "
              "\"with_image_us\": %.3f, \"image_bytes\": %zu, \"work_items\": %zu, \"tasks\": %zu, "
              "\"requests\": %zu, \"kv_heads\": %d, \"chunk_tokens\": %d, \"estimated_us\": %.1f}\n",
              name, us[iterations / 2], with_image[iterations / 2], image.size(), items, tasks, kv_len.size(),
              kv_heads, planner.plan(bsr, t.qo.data()).chunk_tokens, planner.plan(bsr, t.qo.data()).estimated_us);
}


// One prefill step: qo_lens[i] new rows over kv_lens[i] keys (history included), pages of 16,
// `heads` query heads in 128-row tiles; pack > 0: packed GQA of 2^pack query heads a KV head (the
// Hopper fixed grid with num_kv_heads given: heads >> pack list heads, 128 >> pack tokens a tile).
void run_schedule(const char* name, const std::vector<int32_t>& qo_lens, const std::vector<int32_t>& kv_lens,
                  int iterations, int heads = 32, int pack = 0) {
  if (std::string(name).find(g_filter) == std::string::npos) return;
  std::vector<int32_t> qo_indptr{0}, kv_indptr{0}, last;
  for (size_t i = 0; i < qo_lens.size(); ++i) {
    const int32_t pages = (kv_lens[i] + 15) / 16;
    qo_indptr.push_back(qo_indptr.back() + qo_lens[i]);
    kv_indptr.push_back(kv_indptr.back() + pages);
    last.push_back(pages ? kv_lens[i] - (pages - 1) * 16 : 0);
  }
  plan::PrefillScheduleProblem p;
  p.qo_indptr = qo_indptr.data();
  p.kv_indptr = kv_indptr.data();
  p.last_page_len = last.data();
  p.page_size = 16;
  p.batch = int64_t(qo_lens.size());
  p.num_qo_heads = heads >> pack;
  p.block_m = 128 >> pack;
  p.block_n = 128;
  p.causal = true;
  p.slots = 132;
  std::vector<int32_t> slot_begin(size_t(p.slots) + 1), positions(size_t(plan::prefill_schedule_tiles(p)));
  plan::PrefillScheduleScratch scratch;
  std::vector<double> us(iterations);
  plan::PrefillScheduleResult res;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    res = plan::schedule_prefill(p, slot_begin.data(), positions.data(), scratch);
    us[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  const double fastest = *std::min_element(us.begin(), us.end());
  std::nth_element(us.begin(), us.begin() + iterations / 2, us.end());
  // As a serving loop calls it: once a step, with the step's other work in between. Each call
  // here follows a pass over 64 MB, which leaves none of the schedule's data in the caches.
  const int cold_iterations = std::max(1, iterations / 20);
  std::vector<double> cold(size_t(cold_iterations), 0.0);
  for (double& c : cold) {
    evict_caches();
    const auto t0 = std::chrono::steady_clock::now();
    res = plan::schedule_prefill(p, slot_begin.data(), positions.data(), scratch);
    c = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  std::nth_element(cold.begin(), cold.begin() + cold_iterations / 2, cold.end());
  std::printf("{\"suite\": \"prefill_schedule\", \"case\": \"%s\", \"metric\": \"us\", \"tessera\": %.3f, "
              "\"min_us\": %.3f, \"cold_us\": %.3f, \"tiles\": %lld, \"requests\": %zu, \"heads\": %d, \"slots\": %d, \"makespan\": %.0f, "
              "\"lower_bound\": %.1f}\n",
              name, us[iterations / 2], fastest, cold[size_t(cold_iterations / 2)], static_cast<long long>(res.tiles), qo_lens.size(), heads, p.slots, res.makespan,
              std::max(res.longest, res.total / p.slots));
}

// The prefill_plan suite's serving steps (bench/cases/prefill_plan.json): `chunks` prefill chunks
// of `chunk` rows spread through `requests` requests, the rest decode-like (1 row); histories
// uniform in [lo, hi). Also as a GQA-4 model (32 query / 8 KV heads) schedules it packed: `name`_gqa4.
void run_serving(const char* name, int requests, int chunks, int chunk, int lo, int hi, int iterations,
                 std::mt19937& rng) {
  std::vector<int32_t> qo, kv;
  for (int i = 0; i < requests; ++i) {
    qo.push_back(i % (requests / chunks) == 0 ? chunk : 1);
    kv.push_back(std::uniform_int_distribution<int32_t>(lo, hi - 1)(rng) + (qo.back() > 1 ? chunk : 0));
  }
  run_schedule(name, qo, kv, iterations);
  run_schedule((std::string(name) + "_gqa4").c_str(), qo, kv, iterations, 32, 2);
  run_schedule((std::string(name) + "_gqa8").c_str(), qo, kv, iterations, 32, 3);
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 2000;
  if (argc > 2) g_filter = argv[2];
  std::mt19937 rng(1);
  // Zipf-like lengths: a few long requests, many short ones.
  std::vector<int64_t> zipf(256);
  for (size_t i = 0; i < zipf.size(); ++i) {
    zipf[i] = std::max<int64_t>(1, static_cast<int64_t>(32768.0 / std::pow(double(i + 1), 1.1)));
  }
  std::shuffle(zipf.begin(), zipf.end(), rng);
  run("b256_zipf_p16", zipf, 16, iterations);
  run("b256_kv2048_p16", std::vector<int64_t>(256, 2048), 16, iterations);
  run("b256_kv2048_p1", std::vector<int64_t>(256, 2048), 1, iterations);
  run("b1_kv32768_p16", {32768}, 16, iterations);
  // Skewed batches of the decode suite's kind: a heavy tail, and one long request among many
  // short ones with one KV head (a tensor-parallel slice).
  std::vector<int64_t> tail;
  for (int i = 0; i < 28; ++i) tail.push_back(std::uniform_int_distribution<int64_t>(40, 900)(rng));
  tail.insert(tail.end(), {32768, 20000, 12000, 10000});
  std::shuffle(tail.begin(), tail.end(), rng);
  run("b32_heavy_tail_p16", tail, 16, iterations);
  std::vector<int64_t> one_long;
  for (int i = 0; i < 63; ++i) one_long.push_back(std::uniform_int_distribution<int64_t>(16, 2048)(rng));
  one_long.push_back(32768);
  run("b64_one_long_h1_p16", one_long, 16, iterations, 1);
  std::vector<int64_t> zipf1024(1024);
  for (size_t i = 0; i < zipf1024.size(); ++i) {
    zipf1024[i] = std::max<int64_t>(1, static_cast<int64_t>(65536.0 / std::pow(double(i + 1), 1.1)));
  }
  std::shuffle(zipf1024.begin(), zipf1024.end(), rng);
  run("b1024_zipf_p16", zipf1024, 16, iterations);
  run("b1024_zipf_h1_p16", zipf1024, 16, iterations, 1);
  run("b1024_kv2048_p16", std::vector<int64_t>(1024, 2048), 16, iterations);
  // The page-id range scan BatchDecoder::plan does by default (num_pages not given).
  for (const int64_t pages : {32768, 262144}) {
    if (std::string("page_id_range_" + std::to_string(pages)).find(g_filter) == std::string::npos) continue;
    const PageTable t = make({pages * 16}, 16);
    const auto bsr = format::bsr_from_page_table(16, 1, t.indptr.data(), t.indices.data(), t.last.data());
    std::vector<double> us(iterations);
    int64_t sink = 0;
    for (int i = 0; i < iterations; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      sink += format::block_id_range(bsr).max;
      us[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    std::nth_element(us.begin(), us.begin() + iterations / 2, us.end());
    std::printf("{\"suite\": \"plan\", \"case\": \"page_id_range_%lld\", \"metric\": \"us\", \"tessera\": %.3f, "
                "\"pages\": %lld, \"sink\": %lld}\n",
                static_cast<long long>(pages), us[iterations / 2], static_cast<long long>(pages), static_cast<long long>(sink));
  }
  // The fixed-grid prefill schedule: the serving steps of the plan-time targets, and random
  // steps of 64 requests (chunks of 1-1024 rows over histories of 0-32K).
  run_serving("prefill_serving_b256", 256, 16, 256, 256, 8192, iterations, rng);
  run_serving("prefill_serving_b1024", 1024, 16, 512, 128, 4096, iterations, rng);
  for (int step = 0; step < 4; ++step) {
    std::vector<int32_t> qo, kv;
    for (int i = 0; i < 64; ++i) {
      const bool decode = rng() % 2 == 0;
      qo.push_back(decode ? 1 : 1 + int32_t(rng() % 1024));
      kv.push_back(qo.back() + int32_t(rng() % 32768));
    }
    run_schedule(("prefill_random_b64_" + std::to_string(step)).c_str(), qo, kv, iterations);
  }
  return 0;
}
