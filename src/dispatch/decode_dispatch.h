// Kernel selection for paged decode: the portable (sm_80+) family is the only one built; the
// instantiation list is the prefill family's (same head dims and dtypes).
#pragma once

#include "kernels/attention/decode_params.h"
#include "tessera/dtype.h"

namespace tessera::dispatch {

bool decode_compiled(DType dtype, int head_dim);

// Throws tessera::Error for a combination that was not compiled.
void launch_decode(DType dtype, int head_dim, const kernels::DecodeParams& params,
                   const kernels::DecodeLaunch& launch, cudaStream_t stream);

// K/V pipeline stages for the current GPU: `requested` (2 or 3; the API validated it) if its
// shared memory per block holds that configuration, else a tessera::Error; requested 0 picks 3
// where it fits, else 2.
int decode_stages(int head_dim, int requested);

// Resident decode CTAs per SM on the current GPU, from the kernel's registers and shared memory.
int decode_ctas_per_sm(DType dtype, int head_dim, int stages);

}  // namespace tessera::dispatch
