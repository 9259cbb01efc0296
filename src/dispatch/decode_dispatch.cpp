#include "dispatch/decode_dispatch.h"

#include <string>

#include "core/cuda_check.h"
#include "dispatch/prefill_dispatch.h"
#include "tessera/error.h"
#include "tessera_instantiations.h"

namespace tessera {
namespace kernels {
// One per instantiation group (generated decode_sm80_hd*.cu).
#define TESSERA_DECLARE_DECODE(HD)                                                           \
  void launch_decode_sm80_hd##HD(DType dtype, const DecodeParams& p, const DecodeLaunch& l,  \
                                 cudaStream_t stream);                                       \
  DecodeKernelInfo decode_sm80_kernel_info_hd##HD(DType dtype, int stages, int ctas_per_sm); \
  int decode_sm80_smem_bytes_hd##HD(int stages, int ctas_per_sm);
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

kernels::DecodeKernelInfo decode_kernel_info(DType dtype, int head_dim, int stages, int ctas_per_sm) {
  if (!decode_compiled(dtype, head_dim)) not_compiled(dtype, head_dim);
  switch (head_dim) {
#if TESSERA_INST_HD64
    case 64: return kernels::decode_sm80_kernel_info_hd64(dtype, stages, ctas_per_sm);
#endif
#if TESSERA_INST_HD128
    case 128: return kernels::decode_sm80_kernel_info_hd128(dtype, stages, ctas_per_sm);
#endif
#if TESSERA_INST_HD256
    case 256: return kernels::decode_sm80_kernel_info_hd256(dtype, stages, ctas_per_sm);
#endif
    default: not_compiled(dtype, head_dim);
  }
}

namespace {
// 0 when the shape is not compiled.
int decode_smem_bytes(int head_dim, int stages, int ctas_per_sm = 2) {
  switch (head_dim) {
#if TESSERA_INST_HD64
    case 64: return kernels::decode_sm80_smem_bytes_hd64(stages, ctas_per_sm);
#endif
#if TESSERA_INST_HD128
    case 128: return kernels::decode_sm80_smem_bytes_hd128(stages, ctas_per_sm);
#endif
#if TESSERA_INST_HD256
    case 256: return kernels::decode_sm80_smem_bytes_hd256(stages, ctas_per_sm);
#endif
    default: return 0;
  }
}
}  // namespace

int decode_one_cta_per_sm_bytes(int head_dim) { return decode_smem_bytes(head_dim, 3, 1); }

bool decode_one_cta_per_sm_fits(int head_dim) {
  const int needed = decode_one_cta_per_sm_bytes(head_dim);
  return needed > 0 && needed <= shared_memory_per_block();
}

int decode_stages(int head_dim, int requested) {
  const int smem_optin = shared_memory_per_block();
  for (int stages : {3, 2}) {
    if (requested != 0 && stages != requested) continue;
    const int needed = decode_smem_bytes(head_dim, stages);
    if (needed <= smem_optin) return stages;
    if (requested != 0) {
      throw Error("tessera::BatchDecoder: DecodeConfig.pipeline_stages = " + std::to_string(stages) +
                  " needs " + std::to_string(needed) + " bytes of shared memory per block at head_dim " +
                  std::to_string(head_dim) + "; this GPU allows " + std::to_string(smem_optin));
    }
  }
  throw Error("tessera::BatchDecoder: the decode kernel at head_dim " + std::to_string(head_dim) +
              " needs " + std::to_string(decode_smem_bytes(head_dim, 2)) +
              " bytes of shared memory per block even with 2 stages; this GPU allows " +
              std::to_string(smem_optin));
}

}  // namespace dispatch
}  // namespace tessera
