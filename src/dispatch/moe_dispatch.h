// Kernel selection for the MoE grouped GEMM: the Hopper kernel (TMA + wgmma) on sm_90 where it is
// built, the portable mma.sync kernel on every other GPU from sm_80 on.
#pragma once

#include <vector>

#include "kernels/moe/grouped_gemm_params.h"

namespace tessera::dispatch {

enum class MoeGemmFamily { kPortable, kHopper };

// Pure decision (no GPU needed).
MoeGemmFamily choose_moe_gemm(int cc_major, int cc_minor);

// The families that run on the current GPU: {kHopper, kPortable} on sm_90 where the Hopper kernel
// is built, {kPortable} elsewhere (tests run each; the first is the default).
std::vector<MoeGemmFamily> moe_gemm_families_on_this_gpu();
const char* moe_gemm_family_name(MoeGemmFamily family);

// Runs the grouped GEMM on the current GPU with the family choose_moe_gemm names, or the one a
// test forced (force_moe_gemm_family; nullptr lifts it). Forcing a family the GPU cannot run is
// the caller's error: tests take it from moe_gemm_families_on_this_gpu().
void run_moe_grouped_gemm(const kernels::moe::GroupedGemmParams& params, cudaStream_t stream);
void force_moe_gemm_family(const MoeGemmFamily* family);
// Forces the Hopper kernel's token rows per tile (16, 32, 64 or 128; 0 lifts it), so a benchmark
// can time the shapes its rule chooses between (GroupedGemmParams::token_rows).
void force_moe_gemm_token_rows(int token_rows);

// How fused_moe feeds x's rows to the first grouped GEMM: gathered inside the GEMM's loads
// (kGather: moe_permute writes no permuted copy of x, and the workspace holds none) or copied by
// moe_permute first (kCopy), by the layer's shape (fused_moe_rows) unless a benchmark forced one.
// The workspace size follows the same choice, so fused_moe_workspace_bytes needs no GPU.
enum class FusedMoeRows { kGather, kCopy };
FusedMoeRows fused_moe_rows(int64_t inter);
void force_fused_moe_rows(const FusedMoeRows* rows);  // nullptr lifts it

}  // namespace tessera::dispatch
