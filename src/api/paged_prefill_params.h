// The paged prefill's validation and kernel parameters, shared by batch_prefill_paged and
// BatchPrefillPaged (which adds the KV split).
#pragma once

#include "core/arg_check.h"
#include "kernels/attention/prefill_params.h"
#include "tessera/attention.h"

namespace tessera::detail {

// Validates the arguments (tessera::Error naming the entry point and argument), picks the family
// (`path`: args.path, or the dispatcher's choice for kAuto) and returns the kernels' parameters
// for them (no split).
kernels::PrefillParams paged_prefill_params(const ArgCheck& check, const PagedPrefillArgs& args, AttentionPath& path);

// Launches a prefill (ragged or paged: p.paged; with p.kv_splits > 1 the portable family's split)
// on the family `path`. gqa_pack: the Hopper family's packed GQA (PrefillParams::gqa_pack; the
// portable family takes none), or -1 for the dispatcher's choice.
void launch_prefill(const kernels::PrefillParams& p, AttentionPath path, DType dtype, int head_dim,
                    cudaStream_t stream, int gqa_pack = -1);

}  // namespace tessera::detail
