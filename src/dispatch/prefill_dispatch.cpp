#include "dispatch/prefill_dispatch.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <string>

#include "core/cuda_check.h"
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
void launch_prefill_sm80_hd64(DType dtype, const PrefillParams& p, bool compact, cudaStream_t stream);
int prefill_sm80_smem_bytes_hd64(bool compact);
#endif
#if TESSERA_INST_HD128
void launch_prefill_sm80_hd128(DType dtype, const PrefillParams& p, bool compact, cudaStream_t stream);
int prefill_sm80_smem_bytes_hd128(bool compact);
#endif
#if TESSERA_INST_HD256
void launch_prefill_sm80_hd256(DType dtype, const PrefillParams& p, bool compact, cudaStream_t stream);
int prefill_sm80_smem_bytes_hd256(bool compact);
#endif

bool prefill_sm80_compiled(DType dtype, int head_dim) {
  if (!dispatch::prefill_dtype_compiled(dtype)) return false;
  for (int d : dispatch::compiled_prefill_head_dims()) {
    if (d == head_dim) return true;
  }
  return false;
}

namespace {
int prefill_sm80_smem_bytes(int head_dim, bool compact) {
  switch (head_dim) {
#if TESSERA_INST_HD64
    case 64: return prefill_sm80_smem_bytes_hd64(compact);
#endif
#if TESSERA_INST_HD128
    case 128: return prefill_sm80_smem_bytes_hd128(compact);
#endif
#if TESSERA_INST_HD256
    case 256: return prefill_sm80_smem_bytes_hd256(compact);
#endif
    default: return 0;
  }
}
}  // namespace

void launch_prefill_sm80(DType dtype, int head_dim, const PrefillParams& params,
                         cudaStream_t stream) {
  if (!prefill_sm80_compiled(dtype, head_dim)) {
    throw Error(std::string("tessera: portable prefill for ") + dtype_name(dtype) + " head_dim " +
                std::to_string(head_dim) + " is not compiled in this build (TESSERA_HEAD_DIMS / "
                "TESSERA_DTYPES)");
  }
  // The default tile shape where the GPU's shared memory per block holds it, else the compact one
  // (hd256 on sm_86 / sm_89); neither fitting is an error, not a launch failure.
  const int budget = dispatch::shared_memory_per_block();
  const bool compact = prefill_sm80_smem_bytes(head_dim, false) > budget;
  if (compact && prefill_sm80_smem_bytes(head_dim, true) > budget) {
    throw Error("tessera: portable prefill at head_dim " + std::to_string(head_dim) + " needs " +
                std::to_string(prefill_sm80_smem_bytes(head_dim, true)) +
                " bytes of shared memory per block; this GPU allows " + std::to_string(budget));
  }
  switch (head_dim) {
#if TESSERA_INST_HD64
    case 64: launch_prefill_sm80_hd64(dtype, params, compact, stream); return;
#endif
#if TESSERA_INST_HD128
    case 128: launch_prefill_sm80_hd128(dtype, params, compact, stream); return;
#endif
#if TESSERA_INST_HD256
    case 256: launch_prefill_sm80_hd256(dtype, params, compact, stream); return;
#endif
    default: break;
  }
}
}  // namespace kernels

namespace dispatch {

namespace {
std::atomic<int> g_shared_memory_limit{0};
}  // namespace

void limit_shared_memory_per_block(int bytes) { g_shared_memory_limit.store(bytes); }

int shared_memory_per_block() {
  // Read once per device (it is fixed): this runs on every prefill launch.
  static std::array<std::atomic<int>, 64> optin_of{};  // 0: not read yet
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  int optin = device < 64 ? optin_of[device].load(std::memory_order_relaxed) : 0;
  if (optin == 0) {
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (device < 64) optin_of[device].store(optin, std::memory_order_relaxed);
  }
  const int limit = g_shared_memory_limit.load();
  return limit > 0 ? std::min(limit, optin) : optin;
}

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
