// Kernel selection for the MoE grouped GEMM: the Hopper kernel (TMA + wgmma) on sm_90 where it is
// built, the portable mma.sync kernel on every other GPU from sm_80 on.
#pragma once

#include "kernels/moe/grouped_gemm_params.h"

namespace tessera::dispatch {

enum class MoeGemmFamily { kPortable, kHopper };

// Pure decision (no GPU needed).
MoeGemmFamily choose_moe_gemm(int cc_major, int cc_minor);

// Runs the grouped GEMM on the current GPU with the family choose_moe_gemm names.
void run_moe_grouped_gemm(const kernels::moe::GroupedGemmParams& params, cudaStream_t stream);

}  // namespace tessera::dispatch
