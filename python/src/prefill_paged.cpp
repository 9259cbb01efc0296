// tessera.BatchPrefillPaged's C++ side: PagedPrefillConfig, PagedPrefillPlanInfo and the planner
// object over a workspace the Python side allocates (python/tessera/attention.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>

#include "bindings.h"
#include "tensor_args.h"
#include "tessera/tessera.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace tessera::python {
namespace {

// A BatchPrefillPaged over a workspace tensor it keeps alive.
class PagedPrefiller {
 public:
  PagedPrefiller(const PagedPrefillConfig& config, nb::handle workspace) : workspace_(nb::borrow(workspace)) {
    ArgConverter conv("BatchPrefillPaged");
    const TensorView ws = conv.tensor(workspace, "workspace");
    if (!ws.is_contiguous()) conv.fail("workspace", "must be contiguous, got " + ws.describe());
    device_ = conv.cuda_device();
    DeviceGuard guard(device_);
    impl_ = std::make_unique<BatchPrefillPaged>(config, ws.data, std::size_t(ws.numel()) * dtype_size(ws.dtype));
  }

  void plan(nb::handle host_qo_indptr, nb::handle kv_indptr, nb::handle kv_indices, nb::handle kv_last_page_len,
            nb::handle host_kv_indptr, nb::handle host_kv_indices, nb::handle host_kv_last_page_len, int64_t num_pages,
            uintptr_t stream) {
    ArgConverter conv("BatchPrefillPaged::plan");
    const PageTable table = page_table(conv, kv_indptr, kv_indices, kv_last_page_len, host_kv_indptr,
                                       host_kv_indices, host_kv_last_page_len);
    const int32_t* qo = conv.host_indices(host_qo_indptr, "host_qo_indptr", table.indptr.size(0));
    DeviceGuard guard(device_);
    impl_->plan(qo, table, as_stream(stream), num_pages);
  }

  void run(nb::handle q, nb::handle qo_indptr, nb::handle host_qo_indptr, nb::handle k_pages, nb::handle v_pages,
           nb::handle layout, nb::handle kv_indptr, nb::handle kv_indices, nb::handle kv_last_page_len,
           nb::handle host_kv_indptr, nb::handle host_kv_indices, nb::handle host_kv_last_page_len, nb::handle o,
           nb::handle lse, bool causal, int window_left, float scale, float soft_cap, AttentionPath path,
           uintptr_t stream) {
    ArgConverter conv("BatchPrefillPaged::run");
    const PagedPrefillArgs a = paged_prefill_args(conv, q, qo_indptr, host_qo_indptr, k_pages, v_pages, layout,
                                                  kv_indptr, kv_indices, kv_last_page_len, host_kv_indptr,
                                                  host_kv_indices, host_kv_last_page_len, o, lse, causal, window_left,
                                                  scale, soft_cap, path);
    DeviceGuard guard(device_);
    impl_->run(a, as_stream(stream));
  }

  PagedPrefillPlanInfo last_plan() const { return impl_->last_plan(); }

 private:
  nb::object workspace_;
  int device_ = 0;
  std::unique_ptr<BatchPrefillPaged> impl_;
};

}  // namespace

void bind_prefill_paged(nb::module_& m) {
  const PagedPrefillConfig d;
  nb::class_<PagedPrefillConfig>(m, "PagedPrefillConfig",
                                 "A BatchPrefillPaged's fixed configuration (tessera::PagedPrefillConfig).")
      .def("__init__",
           [](PagedPrefillConfig* self, int num_qo_heads, int head_dim, int page_size, int max_q_rows,
              int max_kv_splits, AttentionPath path, bool causal, int window_left, bool cuda_graph,
              int max_batch_size, bool batch_invariant, int num_kv_heads) {
             new (self) PagedPrefillConfig{num_qo_heads, head_dim,    page_size,  max_q_rows,     max_kv_splits,   path,
                                           causal,       window_left, cuda_graph, max_batch_size, batch_invariant, num_kv_heads};
           },
           nb::kw_only(), "num_qo_heads"_a = d.num_qo_heads, "head_dim"_a = d.head_dim, "page_size"_a = d.page_size,
           "max_q_rows"_a = d.max_q_rows, "max_kv_splits"_a = d.max_kv_splits, "path"_a = d.path,
           "causal"_a = d.causal, "window_left"_a = d.window_left, "cuda_graph"_a = d.cuda_graph,
           "max_batch_size"_a = d.max_batch_size, "batch_invariant"_a = d.batch_invariant,
           "num_kv_heads"_a = d.num_kv_heads)
      .def_rw("num_qo_heads", &PagedPrefillConfig::num_qo_heads)
      .def_rw("head_dim", &PagedPrefillConfig::head_dim)
      .def_rw("page_size", &PagedPrefillConfig::page_size)
      .def_rw("max_q_rows", &PagedPrefillConfig::max_q_rows)
      .def_rw("max_kv_splits", &PagedPrefillConfig::max_kv_splits)
      .def_rw("path", &PagedPrefillConfig::path)
      .def_rw("causal", &PagedPrefillConfig::causal, "the mask run() will take (plan()'s cost estimate only)")
      .def_rw("window_left", &PagedPrefillConfig::window_left)
      .def_rw("cuda_graph", &PagedPrefillConfig::cuda_graph,
              "run() may be captured into a CUDA graph (fixed grids reading the step plan() copied)")
      .def_rw("max_batch_size", &PagedPrefillConfig::max_batch_size, "requests per step, at most (required with cuda_graph; without it, lets plan() put steps whose "
              "requests differ on the fixed grid)")
      .def_rw("num_kv_heads", &PagedPrefillConfig::num_kv_heads,
              "the cache's KV heads (0: not given); given, the Hopper fixed grid packs each KV head's query heads "
              "into one tile (fewer tiles for decode-like requests)")
      .def_rw("batch_invariant", &PagedPrefillConfig::batch_invariant,
              "every step splits into exactly max_kv_splits runs and the portable family keeps one grid: a "
              "request's output bits do not depend on the rest of the batch");
  nb::class_<PagedPrefillPlanInfo>(m, "PagedPrefillPlanInfo", "What BatchPrefillPaged::plan decided.")
      .def_ro("kv_splits", &PagedPrefillPlanInfo::kv_splits)
      .def_ro("query_tiles", &PagedPrefillPlanInfo::query_tiles)
      .def_ro("path", &PagedPrefillPlanInfo::path)
      .def_ro("estimated_us", &PagedPrefillPlanInfo::estimated_us)
      .def_ro("fixed_grid", &PagedPrefillPlanInfo::fixed_grid, "run() takes the fixed grid over plan()'s schedule")
      .def_ro("gqa_pack", &PagedPrefillPlanInfo::gqa_pack,
              "log2 of the query heads a Hopper tile packs per token (0: none)");
  m.def("paged_prefill_workspace_bytes", &BatchPrefillPaged::workspace_bytes, "config"_a,
        "Bytes of device workspace a BatchPrefillPaged of this config needs.");
  nb::class_<PagedPrefiller>(m, "PagedPrefiller", "tessera::BatchPrefillPaged over a workspace tensor.")
      .def(nb::init<const PagedPrefillConfig&, nb::handle>(), "config"_a, "workspace"_a)
      .def("plan", &PagedPrefiller::plan, "host_qo_indptr"_a, "kv_indptr"_a, "kv_indices"_a, "kv_last_page_len"_a,
           "host_kv_indptr"_a.none(), "host_kv_indices"_a.none(), "host_kv_last_page_len"_a.none(), "num_pages"_a,
           "stream"_a)
      .def("run", &PagedPrefiller::run, "q"_a, "qo_indptr"_a, "host_qo_indptr"_a.none(), "k_pages"_a,
           "v_pages"_a.none(), "layout"_a, "kv_indptr"_a, "kv_indices"_a, "kv_last_page_len"_a,
           "host_kv_indptr"_a.none(), "host_kv_indices"_a.none(), "host_kv_last_page_len"_a.none(), "o"_a,
           "lse"_a.none(), "causal"_a, "window_left"_a, "scale"_a, "soft_cap"_a, "path"_a, "stream"_a)
      .def("last_plan", &PagedPrefiller::last_plan);
}

}  // namespace tessera::python
