// tessera::batch_prefill: validation, kernel choice, launch.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>

#include "core/arg_check.h"
#include "dispatch/prefill_dispatch.h"
#include "kernels/attention/prefill_params.h"
#include "tessera/attention.h"
#include "tessera/device_info.h"

#include <cuda_runtime_api.h>

namespace tessera {
namespace {

void validate(const detail::ArgCheck& check, const PrefillArgs& a) {
  check.tensor(a.q, "q", 3);
  check.tensor(a.k, "k", 3);
  check.tensor(a.v, "v", 3);
  check.tensor(a.o, "o", 3);
  check.dtype(a.q, "q", {DType::kBF16, DType::kFP16});
  check.dtype(a.k, "k", {a.q.dtype});
  check.dtype(a.v, "v", {a.q.dtype});
  check.dtype(a.o, "o", {a.q.dtype});
  check.same_shape(a.k, "k", a.v, "v");
  check.same_shape(a.q, "q", a.o, "o");
  check.require(a.k.size(2) == a.q.size(2), "k",
                "head_dim " + std::to_string(a.k.size(2)) + " must equal q's head_dim " +
                    std::to_string(a.q.size(2)));
  check.head_config(a.q.size(1), a.k.size(1), a.q.size(2), dispatch::compiled_prefill_head_dims());
  for (auto [t, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.o, "o"}}) {
    check.vectorizable_rows(*t, name);
  }
  if (!a.lse.empty_view()) {
    check.tensor(a.lse, "lse", 2);
    check.dtype(a.lse, "lse", {DType::kFP32});
    check.require(a.lse.size(0) == a.q.size(0) && a.lse.size(1) == a.q.size(1), "lse",
                  "shape " + detail::shape_string(a.lse) + " must be [total_q, num_qo_heads] = [" +
                      std::to_string(a.q.size(0)) + ", " + std::to_string(a.q.size(1)) + "]");
  }
  check.output_layout(a.o, "o");
  for (auto [in, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}}) {
    check.disjoint(a.o, "o", *in, name);
    if (!a.lse.empty_view()) check.disjoint(a.lse, "lse", *in, name);
  }
  if (!a.lse.empty_view()) {
    check.output_layout(a.lse, "lse");
    check.disjoint(a.lse, "lse", a.o, "o");
  }
  check.index_array(a.qo_indptr, "qo_indptr");
  check.index_array(a.kv_indptr, "kv_indptr");
  check.require(a.qo_indptr.size(0) >= 1, "qo_indptr", "must have batch_size + 1 >= 1 entries");
  check.dim(a.kv_indptr, "kv_indptr", 0, a.qo_indptr.size(0), "qo_indptr's length");
  check.require(a.host_qo_indptr != nullptr, "host_qo_indptr",
                "is required (a host copy of qo_indptr sizes the launch)");
  check.require(a.host_kv_indptr != nullptr, "host_kv_indptr",
                "is required (a host copy of kv_indptr)");
  const int64_t n = a.qo_indptr.size(0);
  check.indptr_host(a.host_qo_indptr, n, "qo_indptr", a.q.size(0), /*exact_end=*/false);
  check.indptr_host(a.host_kv_indptr, n, "kv_indptr", a.k.size(0), /*exact_end=*/false);
  check.require(a.window_left >= -1, "window_left",
                "must be -1 (no window) or >= 0, got " + std::to_string(a.window_left));
  check.require(std::isfinite(a.scale) && a.scale >= 0.f, "scale",
                "must be finite and >= 0 (0 means 1/sqrt(head_dim))");
  check.require(std::isfinite(a.soft_cap) && a.soft_cap >= 0.f, "soft_cap",
                "must be finite and >= 0 (0 means no soft-cap)");
  check.require(a.q.size(0) < (int64_t(1) << 31), "q", "more than 2^31 - 1 rows");
  check.require(a.k.size(0) < (int64_t(1) << 31), "k", "more than 2^31 - 1 rows");
  // The launch grid is (query tiles, requests, heads); CUDA caps the last two at 65535.
  check.require(a.qo_indptr.size(0) - 1 <= 65535, "qo_indptr",
                "batch size " + std::to_string(a.qo_indptr.size(0) - 1) + " exceeds 65535 requests");
  check.require(a.q.size(1) <= 65535, "q", "more than 65535 query heads");
}

}  // namespace

namespace {
// Compute capability of the current device, looked up once per device (batch_prefill runs per
// layer per step; the full property query is too slow for that).
struct CurrentGpu {
  int cc_major = 0, cc_minor = 0;
};
CurrentGpu current_gpu() {
  constexpr int kMaxDevices = 64;
  // major * 100 + minor per device, 0 until looked up; atomics because engines call from many
  // threads (each looks up the same value, so the first store wins nothing it can break).
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    cudaGetLastError();
    const DeviceInfo info = device_info();
    if (!info.present) throw Error("tessera::batch_prefill: no GPU: " + info.reason);
    return {info.cc_major, info.cc_minor};
  }
  int cc = cached[device].load(std::memory_order_relaxed);
  if (cc == 0) {
    const DeviceInfo info = device_info(device);
    if (!info.present) throw Error("tessera::batch_prefill: no GPU: " + info.reason);
    cc = info.cc_major * 100 + info.cc_minor;
    cached[device].store(cc, std::memory_order_relaxed);
  }
  return {cc / 100, cc % 100};
}
}  // namespace

AttentionPath choose_prefill_path(const PrefillArgs& args) {
  const CurrentGpu gpu = current_gpu();
  const auto c = dispatch::choose_prefill(args.path, gpu.cc_major, gpu.cc_minor, args.q.dtype,
                                          static_cast<int>(args.q.size(2)));
  if (!c.ok) throw Error("tessera::batch_prefill: argument 'path': " + c.why_not);
  return c.path;
}

void batch_prefill(const PrefillArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("batch_prefill");
  validate(check, a);
  const AttentionPath path = choose_prefill_path(a);

  kernels::PrefillParams p;
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.o = a.o.data;
  p.q_stride_row = a.q.stride[0];
  p.q_stride_head = a.q.stride[1];
  p.k_stride_row = a.k.stride[0];
  p.k_stride_head = a.k.stride[1];
  p.v_stride_row = a.v.stride[0];
  p.v_stride_head = a.v.stride[1];
  p.o_stride_row = a.o.stride[0];
  p.o_stride_head = a.o.stride[1];
  if (!a.lse.empty_view()) {
    p.lse = static_cast<float*>(a.lse.data);
    p.lse_stride_row = a.lse.stride[0];
    p.lse_stride_head = a.lse.stride[1];
  }
  p.qo_indptr = static_cast<const int32_t*>(a.qo_indptr.data);
  p.kv_indptr = static_cast<const int32_t*>(a.kv_indptr.data);
  p.batch_size = static_cast<int>(a.qo_indptr.size(0) - 1);
  p.num_qo_heads = static_cast<int>(a.q.size(1));
  p.num_kv_heads = static_cast<int>(a.k.size(1));
  int max_qo = 0, max_kv = 0;
  for (int i = 0; i < p.batch_size; ++i) {
    max_qo = std::max(max_qo, a.host_qo_indptr[i + 1] - a.host_qo_indptr[i]);
    max_kv = std::max(max_kv, a.host_kv_indptr[i + 1] - a.host_kv_indptr[i]);
  }
  p.max_qo_len = max_qo;
  p.causal = a.causal;
  // A window at least as long as every request's KV excludes nothing: pass it as "no window", which
  // also keeps the kernel's int32 band arithmetic (row + offset - window) far from overflow.
  p.window_left = a.window_left >= max_kv ? -1 : a.window_left;
  p.scale = a.scale > 0.f ? a.scale : 1.f / std::sqrt(static_cast<float>(a.q.size(2)));
  p.soft_cap = a.soft_cap;
  (void)path;  // only the portable family exists so far
  kernels::launch_prefill_sm80(a.q.dtype, static_cast<int>(a.q.size(2)), p, stream);
}

}  // namespace tessera
