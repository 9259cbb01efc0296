// Instantiation group: portable prefill, head_dim 128 (bf16 and fp16 as compiled).
#include "core/cuda_check.h"
#include "kernels/attention/portable/prefill_sm80.cuh"
#include "tessera_instantiations.h"

namespace tessera::kernels {

#if TESSERA_INST_HD128
void launch_prefill_sm80_hd128(DType dtype, const PrefillParams& p, cudaStream_t stream) {
#if TESSERA_INST_BF16
  if (dtype == DType::kBF16) sm80::launch_prefill<__nv_bfloat16, 128>(p, stream);
#endif
#if TESSERA_INST_FP16
  if (dtype == DType::kFP16) sm80::launch_prefill<__half, 128>(p, stream);
#endif
  TESSERA_CHECK_LAUNCH();
}
#endif

}  // namespace tessera::kernels
