#include "dispatch/prefill_dispatch.h"

#include "kernels/attention/prefill_params.h"
#include "tessera/error.h"
#include "tessera_instantiations.h"

namespace tessera {

const char* attention_path_name(AttentionPath path) {
  switch (path) {
    case AttentionPath::kAuto: return "auto";
    case AttentionPath::kPortable: return "portable";
    case AttentionPath::kHopper: return "hopper";
  }
  return "unknown";
}

namespace kernels {
// One per instantiation group (src/kernels/attention/portable/prefill_sm80_hd*.cu).
#if TESSERA_INST_HD64
void launch_prefill_sm80_hd64(DType dtype, const PrefillParams& p, cudaStream_t stream);
#endif
#if TESSERA_INST_HD128
void launch_prefill_sm80_hd128(DType dtype, const PrefillParams& p, cudaStream_t stream);
#endif
#if TESSERA_INST_HD256
void launch_prefill_sm80_hd256(DType dtype, const PrefillParams& p, cudaStream_t stream);
#endif

bool prefill_sm80_compiled(DType dtype, int head_dim) {
  if (!dispatch::prefill_dtype_compiled(dtype)) return false;
  for (int d : dispatch::compiled_prefill_head_dims()) {
    if (d == head_dim) return true;
  }
  return false;
}

void launch_prefill_sm80(DType dtype, int head_dim, const PrefillParams& params,
                         cudaStream_t stream) {
  if (!prefill_sm80_compiled(dtype, head_dim)) {
    throw Error(std::string("tessera: portable prefill for ") + dtype_name(dtype) + " head_dim " +
                std::to_string(head_dim) + " is not compiled in this build (TESSERA_HEAD_DIMS / "
                "TESSERA_DTYPES)");
  }
  switch (head_dim) {
#if TESSERA_INST_HD64
    case 64: launch_prefill_sm80_hd64(dtype, params, stream); return;
#endif
#if TESSERA_INST_HD128
    case 128: launch_prefill_sm80_hd128(dtype, params, stream); return;
#endif
#if TESSERA_INST_HD256
    case 256: launch_prefill_sm80_hd256(dtype, params, stream); return;
#endif
    default: break;
  }
}
}  // namespace kernels

namespace dispatch {

std::vector<int> compiled_prefill_head_dims() {
  std::vector<int> dims;
  if (TESSERA_INST_HD64) dims.push_back(64);
  if (TESSERA_INST_HD128) dims.push_back(128);
  if (TESSERA_INST_HD256) dims.push_back(256);
  return dims;
}

bool prefill_dtype_compiled(DType dtype) {
  return (dtype == DType::kBF16 && TESSERA_INST_BF16) || (dtype == DType::kFP16 && TESSERA_INST_FP16);
}

PrefillChoice choose_prefill(AttentionPath requested, int cc_major, int cc_minor, DType dtype,
                             int head_dim) {
  PrefillChoice c;
  const std::string gpu = "sm_" + std::to_string(cc_major) + std::to_string(cc_minor);
  if (cc_major < 8) {
    c.why_not = "the GPU (" + gpu + ") is older than sm_80, the oldest tessera supports";
    return c;
  }
  if (requested == AttentionPath::kHopper) {
    c.why_not = "the Hopper prefill family is not in this build yet (force 'portable' or 'auto')";
    return c;
  }
  if (!kernels::prefill_sm80_compiled(dtype, head_dim)) {
    c.why_not = std::string("portable prefill for ") + dtype_name(dtype) + " head_dim " +
                std::to_string(head_dim) + " is not compiled in this build";
    return c;
  }
  c.path = AttentionPath::kPortable;
  c.ok = true;
  return c;
}

}  // namespace dispatch
}  // namespace tessera
