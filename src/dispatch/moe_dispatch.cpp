#include "dispatch/moe_dispatch.h"

#include <atomic>
#include <string>

#include "dispatch/kernel_families.h"
#include "dispatch/prefill_dispatch.h"  // sm_count, compute_capability
#include "tessera/error.h"
#include "tessera_instantiations.h"

namespace tessera::dispatch {

MoeGemmFamily choose_moe_gemm(int cc_major, int cc_minor) {
  // The Hopper attention family's rule (machine code for sm_90a only) holds for this kernel too.
  const KernelFamily* hopper = kernel_family(AttentionPath::kHopper);
  return hopper != nullptr && hopper->runs_on(cc_major, cc_minor) ? MoeGemmFamily::kHopper : MoeGemmFamily::kPortable;
}

namespace {
// A test's forced family: -1 none, else a MoeGemmFamily.
std::atomic<int> g_forced_family{-1};
std::atomic<int> g_forced_token_rows{0};
std::atomic<int> g_forced_rows{-1};  // -1 none, else a FusedMoeRows
}  // namespace

// The copy costs rows x hidden x 4 bytes (~4 TB/s) where the first GEMM costs rows x hidden x
// 4 inter FLOPs (~600 TFLOP/s): about 150 / inter of its time. Gathering made the Hopper GEMM's
// 128-row tiles 5-16% slower (cp.async rows against one TMA box; the swapped small-row tiles
// 0-3%), so it pays where inter is small. Measured on the H200, the whole layer, gather / copy:
// Qwen3-30B-A3B (inter 768) 1.03-1.06 at T 16-8192; DeepSeek-V3 (2048) 0.99-1.01; Mixtral
// (14336) 1.01 at T16, 0.98 / 0.94 / 0.92 at T128 / 1024 / 8192 (notes/moe.md).
constexpr int64_t kGatherMaxInter = 1024;
FusedMoeRows fused_moe_rows(int64_t inter) {
  const int forced = g_forced_rows.load();
  if (forced >= 0) return FusedMoeRows(forced);
  return inter <= kGatherMaxInter ? FusedMoeRows::kGather : FusedMoeRows::kCopy;
}
void force_fused_moe_rows(const FusedMoeRows* rows) { g_forced_rows.store(rows ? int(*rows) : -1); }

void force_moe_gemm_family(const MoeGemmFamily* family) { g_forced_family.store(family ? int(*family) : -1); }

void force_moe_gemm_token_rows(int token_rows) {
  if (token_rows != 0 && token_rows != 16 && token_rows != 32 && token_rows != 64 && token_rows != 128) {
    throw Error("tessera: force_moe_gemm_token_rows: token_rows must be 0, 16, 32, 64 or 128, got " +
                std::to_string(token_rows));
  }
  g_forced_token_rows.store(token_rows);
}

std::vector<MoeGemmFamily> moe_gemm_families_on_this_gpu() {
  const int cc = compute_capability();
  if (choose_moe_gemm(cc / 10, cc % 10) == MoeGemmFamily::kHopper) return {MoeGemmFamily::kHopper, MoeGemmFamily::kPortable};
  return {MoeGemmFamily::kPortable};
}

const char* moe_gemm_family_name(MoeGemmFamily family) {
  return family == MoeGemmFamily::kHopper ? "hopper" : "portable";
}

void run_moe_grouped_gemm(const kernels::moe::GroupedGemmParams& params, cudaStream_t stream) {
  // Without offsets the kernels give expert 0 every row, and so would every other expert: only a
  // single-expert (dense) problem may leave them out.
  if (params.offsets == nullptr && params.num_experts != 1) {
    throw Error("tessera: internal: a grouped GEMM of " + std::to_string(params.num_experts) +
                " experts needs expert offsets");
  }
  const int cc = compute_capability();
  const int forced = g_forced_family.load();
  const MoeGemmFamily family = forced >= 0 ? MoeGemmFamily(forced) : choose_moe_gemm(cc / 10, cc % 10);
  if (family == MoeGemmFamily::kHopper) {
#if TESSERA_INST_HOPPER
    kernels::moe::GroupedGemmParams p = params;
    if (const int forced_rows = g_forced_token_rows.load()) p.token_rows = forced_rows;
    kernels::moe::launch_grouped_gemm_sm90(p, sm_count(), stream);
    return;
#endif
  }
  kernels::moe::launch_grouped_gemm_sm80(params, sm_count(), stream);
}

}  // namespace tessera::dispatch
