// tessera._tessera: the C++ library's entry points for Python, one binding per public function.
//
// The bindings are thin on purpose: they convert arguments (tensor_args.h), pass them on and let
// the library validate. The Pythonic layer (defaults, output allocation, host/device copies of the
// index arrays, streams, torch.library registration) is python/tessera/*.py.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime_api.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "tensor_args.h"
#include "tessera/tessera.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace tessera::python {
namespace {

void bind_prefill(nb::module_& m) {
  m.def(
      "batch_prefill",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle qo_indptr, nb::handle kv_indptr,
         nb::handle host_qo_indptr, nb::handle host_kv_indptr, nb::handle o, nb::handle lse,
         bool causal, int window_left, float scale, float soft_cap, AttentionPath path,
         uintptr_t stream) {
        ArgConverter conv("batch_prefill");
        PrefillArgs a;
        a.q = conv.tensor(q, "q");
        a.k = conv.tensor(k, "k");
        a.v = conv.tensor(v, "v");
        a.qo_indptr = conv.tensor(qo_indptr, "qo_indptr");
        a.kv_indptr = conv.tensor(kv_indptr, "kv_indptr");
        a.host_qo_indptr = conv.host_indices(host_qo_indptr, "host_qo_indptr", a.qo_indptr.size(0));
        a.host_kv_indptr = conv.host_indices(host_kv_indptr, "host_kv_indptr", a.kv_indptr.size(0));
        a.o = conv.tensor(o, "o");
        a.lse = conv.optional(lse, "lse");
        a.causal = causal;
        a.window_left = window_left;
        a.scale = scale;
        a.soft_cap = soft_cap;
        a.path = path;
        DeviceGuard guard(conv.cuda_device());
        batch_prefill(a, as_stream(stream));
      },
      "q"_a, "k"_a, "v"_a, "qo_indptr"_a, "kv_indptr"_a, "host_qo_indptr"_a.none(),
      "host_kv_indptr"_a.none(), "o"_a, "lse"_a.none(), "causal"_a, "window_left"_a, "scale"_a,
      "soft_cap"_a, "path"_a, "stream"_a,
      "tessera::batch_prefill on ragged Q/K/V (see tessera.batch_prefill for the Python API).");

  m.def(
      "batch_prefill_paged",
      [](nb::handle q, nb::handle qo_indptr, nb::handle host_qo_indptr, nb::handle k_pages,
         nb::handle v_pages, nb::handle layout, nb::handle kv_indptr, nb::handle kv_indices,
         nb::handle kv_last_page_len, nb::handle host_kv_indptr, nb::handle host_kv_indices,
         nb::handle host_kv_last_page_len, nb::handle o, nb::handle lse, bool causal,
         int window_left, float scale, float soft_cap, AttentionPath path, uintptr_t stream) {
        ArgConverter conv("batch_prefill_paged");
        const PagedPrefillArgs a = paged_prefill_args(conv, q, qo_indptr, host_qo_indptr, k_pages, v_pages, layout,
                                                      kv_indptr, kv_indices, kv_last_page_len, host_kv_indptr,
                                                      host_kv_indices, host_kv_last_page_len, o, lse, causal,
                                                      window_left, scale, soft_cap, path);
        DeviceGuard guard(conv.cuda_device());
        batch_prefill_paged(a, as_stream(stream));
      },
      "q"_a, "qo_indptr"_a, "host_qo_indptr"_a.none(), "k_pages"_a, "v_pages"_a.none(),
      "layout"_a, "kv_indptr"_a, "kv_indices"_a, "kv_last_page_len"_a, "host_kv_indptr"_a.none(),
      "host_kv_indices"_a.none(), "host_kv_last_page_len"_a.none(), "o"_a, "lse"_a.none(),
      "causal"_a, "window_left"_a, "scale"_a, "soft_cap"_a, "path"_a, "stream"_a,
      "tessera::batch_prefill_paged (see tessera.batch_prefill_paged for the Python API).");
}

void bind_kv_and_merge(nb::module_& m) {
  m.def(
      "append_paged_kv",
      [](nb::handle k_pages, nb::handle v_pages, nb::handle layout, nb::handle kv_indptr,
         nb::handle kv_indices, nb::handle kv_last_page_len, nb::handle host_kv_indptr,
         nb::handle host_kv_indices, nb::handle host_kv_last_page_len, nb::handle append_indptr,
         nb::handle host_append_indptr, nb::handle k_new, nb::handle v_new, uintptr_t stream) {
        ArgConverter conv("append_paged_kv");
        const PagedKVCache cache =
            conv.paged_cache(k_pages, v_pages, parse_layout(layout, "append_paged_kv", "layout"));
        const PageTable table = page_table(conv, kv_indptr, kv_indices, kv_last_page_len,
                                           host_kv_indptr, host_kv_indices, host_kv_last_page_len);
        const TensorView append = conv.tensor(append_indptr, "append_indptr");
        const int32_t* host_append = conv.host_indices(host_append_indptr, "host_append_indptr", append.size(0));
        const TensorView kn = conv.tensor(k_new, "k_new");
        const TensorView vn = conv.tensor(v_new, "v_new");
        DeviceGuard guard(conv.cuda_device());
        append_paged_kv(cache, table, append, kn, vn, as_stream(stream), host_append);
      },
      "k_pages"_a, "v_pages"_a.none(), "layout"_a, "kv_indptr"_a, "kv_indices"_a,
      "kv_last_page_len"_a, "host_kv_indptr"_a.none(), "host_kv_indices"_a.none(),
      "host_kv_last_page_len"_a.none(), "append_indptr"_a, "host_append_indptr"_a.none(),
      "k_new"_a, "v_new"_a, "stream"_a,
      "tessera::append_paged_kv (see tessera.append_paged_kv for the Python API).");

  m.def(
      "merge_state",
      [](nb::handle o_a, nb::handle s_a, nb::handle o_b, nb::handle s_b, nb::handle o_out,
         nb::handle s_out, uintptr_t stream) {
        ArgConverter conv("merge_state");
        const TensorView oa = conv.tensor(o_a, "o_a"), sa = conv.tensor(s_a, "s_a");
        const TensorView ob = conv.tensor(o_b, "o_b"), sb = conv.tensor(s_b, "s_b");
        const TensorView oo = conv.tensor(o_out, "o_out"), so = conv.optional(s_out, "s_out");
        DeviceGuard guard(conv.cuda_device());
        merge_state(oa, sa, ob, sb, oo, so, as_stream(stream));
      },
      "o_a"_a, "s_a"_a, "o_b"_a, "s_b"_a, "o_out"_a, "s_out"_a.none(), "stream"_a,
      "tessera::merge_state (see tessera.merge_state for the Python API).");

  m.def(
      "merge_state_in_place",
      [](nb::handle o, nb::handle s, nb::handle o_other, nb::handle s_other, uintptr_t stream) {
        ArgConverter conv("merge_state_in_place");
        const TensorView ov = conv.tensor(o, "o"), sv = conv.tensor(s, "s");
        const TensorView oo = conv.tensor(o_other, "o_other"), so = conv.tensor(s_other, "s_other");
        DeviceGuard guard(conv.cuda_device());
        merge_state_in_place(ov, sv, oo, so, as_stream(stream));
      },
      "o"_a, "s"_a, "o_other"_a, "s_other"_a, "stream"_a,
      "tessera::merge_state_in_place (see tessera.merge_state_in_place for the Python API).");

  m.def(
      "merge_states",
      [](nb::handle o_parts, nb::handle s_parts, nb::handle o_out, nb::handle s_out, uintptr_t stream) {
        ArgConverter conv("merge_states");
        const TensorView op = conv.tensor(o_parts, "o_parts"), sp = conv.tensor(s_parts, "s_parts");
        const TensorView oo = conv.tensor(o_out, "o_out"), so = conv.optional(s_out, "s_out");
        DeviceGuard guard(conv.cuda_device());
        merge_states(op, sp, oo, so, as_stream(stream));
      },
      "o_parts"_a, "s_parts"_a, "o_out"_a, "s_out"_a.none(), "stream"_a,
      "tessera::merge_states (see tessera.merge_states for the Python API).");
}

// A workspace the library takes as an address and a size: a 1-D contiguous device tensor (its
// layout is checked here, where the tensor is still seen).
std::pair<void*, std::size_t> device_workspace(ArgConverter& conv, nb::handle workspace) {
  const TensorView ws = conv.tensor(workspace, "workspace");
  if (ws.device != Device::kCUDA) conv.fail("workspace", "must be in device memory");
  if (ws.rank != 1 || !ws.is_contiguous()) conv.fail("workspace", "must be 1-D and contiguous, got " + ws.describe());
  return {ws.data, std::size_t(ws.numel()) * dtype_size(ws.dtype)};
}

void bind_moe(nb::module_& m) {
  m.def(
      "moe_route",
      [](nb::handle logits, nb::handle selection_bias, int top_k, int score, bool renormalize, int num_groups,
         int topk_groups, float routed_scaling, nb::handle topk_ids, nb::handle topk_weights, uintptr_t stream) {
        ArgConverter conv("moe_route");
        MoeRouteArgs a;
        a.logits = conv.tensor(logits, "logits");
        a.selection_bias = conv.optional(selection_bias, "selection_bias");
        a.top_k = top_k;
        a.score = static_cast<MoeScore>(score);
        a.renormalize = renormalize;
        a.num_groups = num_groups;
        a.topk_groups = topk_groups;
        a.routed_scaling = routed_scaling;
        a.topk_ids = conv.tensor(topk_ids, "topk_ids");
        a.topk_weights = conv.tensor(topk_weights, "topk_weights");
        DeviceGuard guard(conv.cuda_device());
        moe_route(a, as_stream(stream));
      },
      "logits"_a, "selection_bias"_a.none(), "top_k"_a, "score"_a, "renormalize"_a, "num_groups"_a,
      "topk_groups"_a, "routed_scaling"_a, "topk_ids"_a, "topk_weights"_a, "stream"_a,
      "tessera::moe_route (see tessera.moe_route for the Python API).");

  m.def(
      "moe_permute",
      [](nb::handle topk_ids, int num_experts, int align, nb::handle x, nb::handle permuted_x,
         nb::handle expert_offsets, nb::handle permuted_token, nb::handle inverse, nb::handle workspace,
         uintptr_t stream) {
        ArgConverter conv("moe_permute");
        MoePermuteArgs a;
        a.topk_ids = conv.tensor(topk_ids, "topk_ids");
        a.num_experts = num_experts;
        a.align = align;
        a.x = conv.optional(x, "x");
        a.permuted_x = conv.optional(permuted_x, "permuted_x");
        a.expert_offsets = conv.tensor(expert_offsets, "expert_offsets");
        a.permuted_token = conv.tensor(permuted_token, "permuted_token");
        a.inverse = conv.tensor(inverse, "inverse");
        std::tie(a.workspace, a.workspace_size) = device_workspace(conv, workspace);
        DeviceGuard guard(conv.cuda_device());
        moe_permute(a, as_stream(stream));
      },
      "topk_ids"_a, "num_experts"_a, "align"_a, "x"_a.none(), "permuted_x"_a.none(), "expert_offsets"_a,
      "permuted_token"_a, "inverse"_a, "workspace"_a, "stream"_a,
      "tessera::moe_permute (see tessera.moe_permute for the Python API).");
  m.def("moe_permute_capacity", &moe_permute_capacity, "tokens"_a, "top_k"_a, "num_experts"_a, "align"_a,
        "Rows moe_permute's permuted_token / permuted_x must hold: tokens x top_k + num_experts x (align - 1).");
  m.def("moe_permute_workspace_bytes", &moe_permute_workspace_bytes, "tokens"_a, "top_k"_a, "num_experts"_a,
        "Bytes of device workspace moe_permute needs.");

  m.def(
      "moe_grouped_gemm",
      [](nb::handle a, nb::handle weights, nb::handle expert_offsets, int activation, nb::handle out,
         nb::handle a_rows, uintptr_t stream) {
        ArgConverter conv("moe_grouped_gemm");
        MoeGroupedGemmArgs args;
        args.a = conv.tensor(a, "a");
        args.weights = conv.tensor(weights, "weights");
        args.expert_offsets = conv.tensor(expert_offsets, "expert_offsets");
        args.activation = static_cast<MoeActivation>(activation);
        args.out = conv.tensor(out, "out");
        args.a_rows = conv.optional(a_rows, "a_rows");
        DeviceGuard guard(conv.cuda_device());
        moe_grouped_gemm(args, as_stream(stream));
      },
      "a"_a, "weights"_a, "expert_offsets"_a, "activation"_a, "out"_a, "a_rows"_a.none(), "stream"_a,
      "tessera::moe_grouped_gemm (see tessera.moe_grouped_gemm for the Python API).");

  m.def(
      "moe_combine",
      [](nb::handle expert_out, nb::handle inverse, nb::handle topk_weights, nb::handle shared_out, nb::handle out,
         uintptr_t stream) {
        ArgConverter conv("moe_combine");
        MoeCombineArgs args;
        args.expert_out = conv.tensor(expert_out, "expert_out");
        args.inverse = conv.tensor(inverse, "inverse");
        args.topk_weights = conv.tensor(topk_weights, "topk_weights");
        args.shared_out = conv.optional(shared_out, "shared_out");
        args.out = conv.tensor(out, "out");
        DeviceGuard guard(conv.cuda_device());
        moe_combine(args, as_stream(stream));
      },
      "expert_out"_a, "inverse"_a, "topk_weights"_a, "shared_out"_a.none(), "out"_a, "stream"_a,
      "tessera::moe_combine (see tessera.moe_combine for the Python API).");

  m.def(
      "fused_moe",
      [](nb::handle x, nb::handle w1, nb::handle w2, nb::handle router_logits, int top_k, int score, bool renormalize,
         int num_groups, int topk_groups, float routed_scaling, nb::handle selection_bias, nb::handle topk_ids,
         nb::handle topk_weights, nb::handle shared_w1, nb::handle shared_w2, nb::handle out, nb::handle workspace,
         uintptr_t stream) {
        ArgConverter conv("fused_moe");
        FusedMoeArgs a;
        a.x = conv.tensor(x, "x");
        a.w1 = conv.tensor(w1, "w1");
        a.w2 = conv.tensor(w2, "w2");
        a.router_logits = conv.optional(router_logits, "router_logits");
        a.top_k = top_k;
        a.score = static_cast<MoeScore>(score);
        a.renormalize = renormalize;
        a.num_groups = num_groups;
        a.topk_groups = topk_groups;
        a.routed_scaling = routed_scaling;
        a.selection_bias = conv.optional(selection_bias, "selection_bias");
        a.topk_ids = conv.optional(topk_ids, "topk_ids");
        a.topk_weights = conv.optional(topk_weights, "topk_weights");
        a.shared_w1 = conv.optional(shared_w1, "shared_w1");
        a.shared_w2 = conv.optional(shared_w2, "shared_w2");
        a.out = conv.tensor(out, "out");
        std::tie(a.workspace, a.workspace_size) = device_workspace(conv, workspace);
        DeviceGuard guard(conv.cuda_device());
        fused_moe(a, as_stream(stream));
      },
      "x"_a, "w1"_a, "w2"_a, "router_logits"_a.none(), "top_k"_a, "score"_a, "renormalize"_a, "num_groups"_a,
      "topk_groups"_a, "routed_scaling"_a, "selection_bias"_a.none(), "topk_ids"_a.none(), "topk_weights"_a.none(),
      "shared_w1"_a.none(), "shared_w2"_a.none(), "out"_a, "workspace"_a, "stream"_a,
      "tessera::fused_moe (see tessera.fused_moe for the Python API).");
  m.def("fused_moe_workspace_bytes", &fused_moe_workspace_bytes, "tokens"_a, "hidden"_a, "inter"_a, "num_experts"_a,
        "top_k"_a, "shared_inter"_a = 0, "Bytes of device workspace fused_moe needs (16-byte aligned).");
}

void bind_device(nb::module_& m) {
  nb::enum_<KernelPath>(m, "KernelPath", "The kernel family the dispatcher uses on a GPU.")
      .value("NONE", KernelPath::kNone)
      .value("PORTABLE_SM80", KernelPath::kPortableSm80)
      .value("HOPPER_SM90A", KernelPath::kHopperSm90a);

  nb::class_<DeviceInfo>(m, "DeviceInfo", "What the library sees of a GPU (tessera::DeviceInfo).")
      .def_ro("present", &DeviceInfo::present)
      .def_ro("device", &DeviceInfo::device)
      .def_ro("name", &DeviceInfo::name)
      .def_ro("cc_major", &DeviceInfo::cc_major)
      .def_ro("cc_minor", &DeviceInfo::cc_minor)
      .def_ro("sm_count", &DeviceInfo::sm_count)
      .def_ro("registers_per_sm", &DeviceInfo::registers_per_sm)
      .def_ro("max_registers_per_block", &DeviceInfo::max_registers_per_block)
      .def_ro("shared_memory_per_sm", &DeviceInfo::shared_memory_per_sm)
      .def_ro("shared_memory_per_block", &DeviceInfo::shared_memory_per_block)
      .def_ro("shared_memory_per_block_optin", &DeviceInfo::shared_memory_per_block_optin)
      .def_ro("l2_bytes", &DeviceInfo::l2_bytes)
      .def_ro("global_memory_bytes", &DeviceInfo::global_memory_bytes)
      .def_ro("memory_bus_width_bits", &DeviceInfo::memory_bus_width_bits)
      .def_ro("memory_clock_khz", &DeviceInfo::memory_clock_khz)
      .def_ro("sm_clock_khz", &DeviceInfo::sm_clock_khz)
      .def_ro("path", &DeviceInfo::path)
      .def_ro("reason", &DeviceInfo::reason)
      .def("__repr__", [](const DeviceInfo& d) {
        return d.present ? "DeviceInfo(device=" + std::to_string(d.device) + ", name='" + d.name +
                               "', cc=" + std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor) + ")"
                         : "DeviceInfo(present=False, reason='" + d.reason + "')";
      });

  m.def("device_count", &device_count, "Number of CUDA devices; 0 without a GPU or driver (never raises).");
  m.def("device_info", &device_info, "device"_a = -1,
        "Properties of `device` (the current one when -1); present is False, with a reason, "
        "without a usable GPU.");
  m.def(
      "info_text", [](int device) { return info_text(device_info(device)); }, "device"_a = -1,
      "The text `tessera info` prints: version, GPU, memory hierarchy, kernel path.");
  m.def("kernel_path_name", &kernel_path_name, "path"_a, "A kernel path's description.");
}

void bind_enums(nb::module_& m) {
  nb::enum_<DType>(m, "DType", "Element types (tessera::DType).")
      .value("BF16", DType::kBF16)
      .value("FP16", DType::kFP16)
      .value("FP32", DType::kFP32)
      .value("INT32", DType::kInt32);
  nb::enum_<KVLayout>(m, "KVLayout",
                      "Paged KV layout: NHD [pages, page_size, kv_heads, head_dim] or HND "
                      "[pages, kv_heads, page_size, head_dim].")
      .value("NHD", KVLayout::kNHD)
      .value("HND", KVLayout::kHND);
  nb::enum_<AttentionPath>(m, "AttentionPath",
                           "Kernel family of prefill: AUTO lets the dispatcher choose; PORTABLE and "
                           "HOPPER force one (an unavailable one is an error).")
      .value("AUTO", AttentionPath::kAuto)
      .value("PORTABLE", AttentionPath::kPortable)
      .value("HOPPER", AttentionPath::kHopper);
}

}  // namespace

PagedPrefillArgs paged_prefill_args(ArgConverter& conv, nb::handle q, nb::handle qo_indptr, nb::handle host_qo_indptr,
                                    nb::handle k_pages, nb::handle v_pages, nb::handle layout, nb::handle kv_indptr,
                                    nb::handle kv_indices, nb::handle kv_last_page_len, nb::handle host_kv_indptr,
                                    nb::handle host_kv_indices, nb::handle host_kv_last_page_len, nb::handle o,
                                    nb::handle lse, bool causal, int window_left, float scale, float soft_cap,
                                    AttentionPath path) {
  PagedPrefillArgs a;
  a.q = conv.tensor(q, "q");
  a.qo_indptr = conv.tensor(qo_indptr, "qo_indptr");
  a.host_qo_indptr = conv.host_indices(host_qo_indptr, "host_qo_indptr", a.qo_indptr.size(0));
  a.cache = conv.paged_cache(k_pages, v_pages, parse_layout(layout, conv.entry_point(), "layout"));
  a.table = page_table(conv, kv_indptr, kv_indices, kv_last_page_len, host_kv_indptr, host_kv_indices,
                       host_kv_last_page_len);
  a.o = conv.tensor(o, "o");
  a.lse = conv.optional(lse, "lse");
  a.causal = causal;
  a.window_left = window_left;
  a.scale = scale;
  a.soft_cap = soft_cap;
  a.path = path;
  return a;
}

PageTable page_table(ArgConverter& conv, nb::handle indptr, nb::handle indices,
                     nb::handle last_page_len, nb::handle host_indptr, nb::handle host_indices,
                     nb::handle host_last_page_len) {
  PageTable t;
  t.indptr = conv.tensor(indptr, "kv_indptr");
  t.indices = conv.tensor(indices, "kv_indices");
  t.last_page_len = conv.tensor(last_page_len, "kv_last_page_len");
  t.host_indptr = conv.host_indices(host_indptr, "host_kv_indptr", t.indptr.size(0));
  t.host_indices = conv.host_indices(host_indices, "host_kv_indices", t.indices.size(0));
  t.host_last_page_len = conv.host_indices(host_last_page_len, "host_kv_last_page_len", t.last_page_len.size(0));
  return t;
}

}  // namespace tessera::python

NB_MODULE(_tessera, m) {
  using namespace tessera::python;
  m.doc() = "tessera's C++ library (the extension behind the tessera package).";
  m.attr("__version__") = tessera::version();
  nb::exception<tessera::Error>(m, "Error", PyExc_ValueError);
  m.attr("Error").attr("__doc__") =
      "A rejected argument or a CUDA failure (tessera::Error): the message names the entry point, the "
      "argument and the rule, e.g. \"tessera::merge_state: argument 's_a': dtype must be fp32, got bf16\". "
      "Nothing is written when a call raises it during validation.";
  bind_enums(m);
  bind_device(m);
  bind_prefill(m);
  bind_kv_and_merge(m);
  bind_moe(m);
  bind_memory(m);
  bind_decoder(m);
  bind_prefill_paged(m);
}
