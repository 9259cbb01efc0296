// The decode kernel's CTA shape: keys per shared-memory stage, warps, the copy layout and the
// shared-memory budget (decode_sm80.cuh says what each part does with them), and the page lookup.
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/decode_params.h"

namespace tessera::kernels::sm80 {

// kStagesT: 3 wherever the shared memory allows (every sm_80/sm_90 part), 2 on GPUs with 99 KB
// per block (sm_86, sm_89), where three stages at hd128/hd256 (103/107 KB) cannot launch.
// kCtasPerSmT: the CTA shape. 2: two CTAs share an SM, each with 32 KB stages (the default). 1: one
// CTA per SM with twice the warps and 64 KB stages, the same registers and shared memory per SM
// (sm_90's 227 KB; hd128 and hd256). The planner picks it where it pays (decode_plan.h): mostly a
// batch whose (request, KV head) items about fill the SMs, which it then runs unsplit (no
// partials, no merge). Measured gains and losses: notes/decode.md, v12.
template <int kHeadDim, int kStagesT = 3, int kCtasPerSmT = 2>
struct DecodeTileConfig {
  static_assert(kCtasPerSmT == 1 || kCtasPerSmT == 2, "one or two CTAs per SM");
  static constexpr int kCtasPerSm = kCtasPerSmT;
  static constexpr int kBlockN = 16384 / (kHeadDim * kCtasPerSm);  // keys per stage: K + V are 64 KB per SM
  static constexpr int kWarps = kBlockN / 16;      // each warp owns 16 keys of every stage
  static constexpr int kThreads = kWarps * 32;
  // Measured on H200 (hd128, NHD page 16, see notes/decode.md): 3 stages x 2 CTAs per SM beat
  // 2 stages x 3 CTAs (b64 x 4K: 4.32 vs 3.86 TB/s, a wave-quantisation tail) and 4 or 6 stages
  // x 1 CTA of 4 warps (2.5 and 2.3 TB/s: one 4-warp CTA per SM cannot issue the copies fast
  // enough; the one-CTA-per-SM shape has 8).
  static constexpr int kStages = kStagesT;
  static constexpr int kMinBlocksPerSM = kCtasPerSm;
  static constexpr int kRows = 16;                 // query rows per pass: one m16 tile
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks of one K/V/Q row
  // A thread copies one chunk column of kRowsPerThread rows, kRowStep apart, of each stage.
  static constexpr int kRowStep = kThreads / kChunksPerRow;
  static constexpr int kRowsPerThread = kBlockN / kRowStep;
  static constexpr int kScratchStride = kHeadDim + 8;  // fp32 combine rows, padded against bank conflicts
  static constexpr int kQBytes = kRows * kHeadDim * 2;
  static constexpr int kStageBytes = 2 * kBlockN * kHeadDim * 2;
  static constexpr int kStatBytes = 2 * kWarps * kRows * 4;
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes + kStatBytes;
  // Q fragments live in registers across the KV loop up to hd128 (32 registers); at hd256 the O
  // accumulators alone take 128, so Q is re-read from shared memory.
  static constexpr bool kQInRegisters = kHeadDim <= 128;
  static_assert(kThreads % kChunksPerRow == 0 && kBlockN % kRowStep == 0, "copy layout");
  static_assert(kWarps * kRows * kScratchStride * 4 <= kStages * kStageBytes &&
                    (kThreads * 4 + kThreads / (kHeadDim / 4) * (kHeadDim + 1)) * 4 <=
                        kStages * kStageBytes,
                "the combine and merge scratch reuse the stages");
};

// token / page_size without a division: (umulhi(token, magic) + token) >> shift, exact for any
// page size 1..2^31 and token < 2^31 (Granlund-Montgomery; magic and shift come from the host).
// Branch-free, 3 instructions: the copy loop computes it for every row of every stage.
__device__ inline int page_index(const DecodeParams& p, int token) {
  const unsigned t = static_cast<unsigned>(token);
  return static_cast<int>((__umulhi(t, p.page_magic) + t) >> p.page_shift);
}

}  // namespace tessera::kernels::sm80
