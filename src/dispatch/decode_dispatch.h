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

// Whether the one-CTA-per-SM decode shape (3 stages of 64 KB) is compiled at this head dim and
// fits the current GPU's shared memory per block (sm_90: yes; A100's 163 KB and 99 KB parts: no).
bool decode_one_cta_per_sm_fits(int head_dim);
// Its shared memory per block (0 where it is not compiled).
int decode_one_cta_per_sm_bytes(int head_dim);

// A decode kernel shape on the current GPU: resident CTAs per SM (from its registers and shared
// memory) and whether it may be launched early behind the previous kernel. ctas_per_sm 1 needs
// decode_one_cta_per_sm_fits.
kernels::DecodeKernelInfo decode_kernel_info(DType dtype, int head_dim, int stages, int ctas_per_sm);

}  // namespace tessera::dispatch
