// Kernel selection for prefill attention: by compute capability, problem and the forced path.
#pragma once

#include <string>
#include <vector>

#include "tessera/attention.h"
#include "tessera/dtype.h"

namespace tessera::dispatch {

// Head dims / dtypes this build instantiated for the portable prefill family (the list of
// src/dispatch/instantiations.h.in, narrowed by TESSERA_HEAD_DIMS / TESSERA_DTYPES).
std::vector<int> compiled_prefill_head_dims();
bool prefill_dtype_compiled(DType dtype);

struct PrefillChoice {
  AttentionPath path = AttentionPath::kAuto;  // kPortable or kHopper when ok
  bool ok = false;
  std::string why_not;  // when !ok: which rule the request broke
};

// Shared memory per block the kernels may use on the current GPU (its opt-in maximum), or less
// after limit_shared_memory_per_block(bytes) (0 lifts the limit): tests use it to run the tile
// shapes that GPUs with less shared memory get (the compact hd256 prefill, 2-stage decode).
int shared_memory_per_block();
void limit_shared_memory_per_block(int bytes);

// Pure decision (no GPU needed): which family runs `requested` on a GPU of capability
// cc_major.cc_minor. Today the Hopper family is not built, so kAuto takes the portable family on
// every GPU from sm_80 on (it is a supported configuration there, not a fallback) and a forced
// kHopper is an error.
PrefillChoice choose_prefill(AttentionPath requested, int cc_major, int cc_minor, DType dtype,
                             int head_dim);

}  // namespace tessera::dispatch
