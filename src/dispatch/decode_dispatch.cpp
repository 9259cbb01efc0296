#include "dispatch/decode_dispatch.h"

#include <string>

#include "dispatch/prefill_dispatch.h"
#include "tessera/error.h"
#include "tessera_instantiations.h"

namespace tessera {
namespace kernels {
// One per instantiation group (generated decode_sm80_hd*.cu).
#define TESSERA_DECLARE_DECODE(HD)                                                           \
  void launch_decode_sm80_hd##HD(DType dtype, const DecodeParams& p, const DecodeLaunch& l,  \
                                 cudaStream_t stream);                                       \
  int decode_sm80_ctas_per_sm_hd##HD(DType dtype);
#if TESSERA_INST_HD64
TESSERA_DECLARE_DECODE(64)
#endif
#if TESSERA_INST_HD128
TESSERA_DECLARE_DECODE(128)
#endif
#if TESSERA_INST_HD256
TESSERA_DECLARE_DECODE(256)
#endif
#undef TESSERA_DECLARE_DECODE
}  // namespace kernels

namespace dispatch {

bool decode_compiled(DType dtype, int head_dim) {
  if (!prefill_dtype_compiled(dtype)) return false;
  for (int d : compiled_prefill_head_dims()) {
    if (d == head_dim) return true;
  }
  return false;
}

namespace {
[[noreturn]] void not_compiled(DType dtype, int head_dim) {
  throw Error(std::string("tessera: paged decode for ") + dtype_name(dtype) + " head_dim " +
              std::to_string(head_dim) +
              " is not compiled in this build (TESSERA_HEAD_DIMS / TESSERA_DTYPES)");
}
}  // namespace

void launch_decode(DType dtype, int head_dim, const kernels::DecodeParams& params,
                   const kernels::DecodeLaunch& launch, cudaStream_t stream) {
  if (!decode_compiled(dtype, head_dim)) not_compiled(dtype, head_dim);
  switch (head_dim) {
#if TESSERA_INST_HD64
    case 64: kernels::launch_decode_sm80_hd64(dtype, params, launch, stream); return;
#endif
#if TESSERA_INST_HD128
    case 128: kernels::launch_decode_sm80_hd128(dtype, params, launch, stream); return;
#endif
#if TESSERA_INST_HD256
    case 256: kernels::launch_decode_sm80_hd256(dtype, params, launch, stream); return;
#endif
    default: not_compiled(dtype, head_dim);
  }
}

int decode_ctas_per_sm(DType dtype, int head_dim) {
  if (!decode_compiled(dtype, head_dim)) not_compiled(dtype, head_dim);
  switch (head_dim) {
#if TESSERA_INST_HD64
    case 64: return kernels::decode_sm80_ctas_per_sm_hd64(dtype);
#endif
#if TESSERA_INST_HD128
    case 128: return kernels::decode_sm80_ctas_per_sm_hd128(dtype);
#endif
#if TESSERA_INST_HD256
    case 256: return kernels::decode_sm80_ctas_per_sm_hd256(dtype);
#endif
    default: not_compiled(dtype, head_dim);
  }
}

}  // namespace dispatch
}  // namespace tessera
