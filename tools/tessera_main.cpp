// The tessera command.
//   tessera info   the GPU, its memory hierarchy and the kernel path the library takes there
//   tessera [run]  the main job: one serving step's KV append and split-KV merge on the GPU,
//                  checked against the CPU reference; without a GPU, the CPU reference path on a
//                  small paged batch.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "reference/attention_ref.h"
#include "reference/merge_ref.h"
#include "tessera/tessera.h"

namespace {

using namespace tessera;

void print_info(const DeviceInfo& info) { std::fputs(info_text(info).c_str(), stdout); }

// A small paged batch: request lengths, page_size 16, NHD, 2 KV heads, 8 query heads, hd 64.
struct SmallBatch {
  int page_size = 16, kv_heads = 2, qo_heads = 8, head_dim = 64;
  std::vector<int> kv_len{1, 37, 300, 97};
  std::vector<int> qo_len{1, 5, 17, 1};
};

// CPU reference path: paged attention equals ragged attention, and split-KV + merge equals whole.
int run_cpu_reference() {
  SmallBatch b;
  std::mt19937 rng(2026);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  const int B = static_cast<int>(b.kv_len.size()), D = b.head_dim, H = b.kv_heads;
  std::vector<int32_t> qo_indptr{0}, kv_indptr{0}, page_indptr{0}, indices, last;
  for (int i = 0; i < B; ++i) {
    qo_indptr.push_back(qo_indptr.back() + b.qo_len[i]);
    kv_indptr.push_back(kv_indptr.back() + b.kv_len[i]);
    const int pages = (b.kv_len[i] + b.page_size - 1) / b.page_size;
    for (int p = 0; p < pages; ++p) indices.push_back(static_cast<int32_t>(indices.size()));
    page_indptr.push_back(static_cast<int32_t>(indices.size()));
    last.push_back(b.kv_len[i] - (pages - 1) * b.page_size);
  }
  std::vector<float> q(size_t(qo_indptr.back()) * b.qo_heads * D), k(size_t(kv_indptr.back()) * H * D),
      v(k.size());
  for (auto* t : {&q, &k, &v})
    for (auto& x : *t) x = dist(rng);
  // Copy the ragged K/V into NHD pages.
  std::vector<float> kp(indices.size() * b.page_size * H * D, 0.f), vp(kp.size(), 0.f);
  for (int i = 0; i < B; ++i)
    for (int t = 0; t < b.kv_len[i]; ++t) {
      const size_t dst = (size_t(indices[page_indptr[i] + t / b.page_size]) * b.page_size + t % b.page_size) * H * D;
      const size_t src = size_t(kv_indptr[i] + t) * H * D;
      std::memcpy(&kp[dst], &k[src], sizeof(float) * H * D);
      std::memcpy(&vp[dst], &v[src], sizeof(float) * H * D);
    }
  ref::AttentionParams params;
  params.num_qo_heads = b.qo_heads;
  params.num_kv_heads = H;
  params.head_dim = D;
  params.causal = true;
  const int64_t strides[3] = {int64_t(b.page_size) * H * D, int64_t(H) * D, D};
  ref::RaggedKV ragged(k.data(), v.data(), kv_indptr, H, D);
  ref::PagedKV paged(kp.data(), vp.data(), ref::PageLayout::kNHD, b.page_size, H, D, strides,
                     strides, page_indptr, indices, last);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<double> o_r, lse_r, o_p, lse_p;
  ref::attention(q.data(), qo_indptr, ragged, params, o_r, lse_r);
  ref::attention(q.data(), qo_indptr, paged, params, o_p, lse_p);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  double diff = 0, checksum = 0;
  for (size_t i = 0; i < o_r.size(); ++i) {
    diff = std::fmax(diff, std::fabs(o_r[i] - o_p[i]));
    checksum += o_r[i];
  }
  std::printf("CPU reference: causal paged attention, %d requests (kv_len 1/37/300/97, qo_len "
              "1/5/17/1), GQA 8/2, hd 64, page_size 16: %.1f ms\n", B, ms);
  std::printf("  paged vs ragged max |diff| = %.3g, output checksum %.6f\n", diff, checksum);
  return diff == 0 ? 0 : 1;
}

}  // namespace

int run_gpu_step(const DeviceInfo& info);  // tools/gpu_step.cpp

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "run";
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    std::printf("usage: tessera [info | run]\n");
    return 0;
  }
  const DeviceInfo info = device_info();
  if (cmd == "info") {
    print_info(info);
    return 0;
  }
  if (cmd != "run") {
    std::fprintf(stderr, "tessera: unknown command '%s' (try: tessera info | tessera run)\n", cmd.c_str());
    return 2;
  }
  print_info(info);
  try {
    if (!info.present) {
      std::printf("\nNo GPU found: running the CPU reference path on a small problem.\n");
      return run_cpu_reference();
    }
    return run_gpu_step(info);
  } catch (const Error& e) {
    std::fprintf(stderr, "tessera: %s\n", e.what());
    return 1;
  }
}
