// What the binding translation units share.
#pragma once

#include <nanobind/nanobind.h>

#include "tensor_args.h"
#include "tessera/attention.h"
#include "tessera/kv_cache.h"

namespace tessera::python {

// A page table from its device arrays and (optional) host copies; a host copy must have as many
// entries as its device array.
PageTable page_table(ArgConverter& conv, nanobind::handle indptr, nanobind::handle indices,
                     nanobind::handle last_page_len, nanobind::handle host_indptr,
                     nanobind::handle host_indices, nanobind::handle host_last_page_len);

// batch_prefill_paged's arguments (module.cpp; BatchPrefillPaged::run takes the same).
PagedPrefillArgs paged_prefill_args(ArgConverter& conv, nanobind::handle q, nanobind::handle qo_indptr,
                                    nanobind::handle host_qo_indptr, nanobind::handle k_pages, nanobind::handle v_pages,
                                    nanobind::handle layout, nanobind::handle kv_indptr, nanobind::handle kv_indices,
                                    nanobind::handle kv_last_page_len, nanobind::handle host_kv_indptr,
                                    nanobind::handle host_kv_indices, nanobind::handle host_kv_last_page_len,
                                    nanobind::handle o, nanobind::handle lse, bool causal, int window_left,
                                    float scale, float soft_cap, AttentionPath path);

void bind_memory(nanobind::module_& m);   // decoder.cpp: device buffers, copies, streams
void bind_decoder(nanobind::module_& m);  // decoder.cpp: DecodeConfig, BatchDecoder
void bind_prefill_paged(nanobind::module_& m);  // prefill_paged.cpp: PagedPrefillConfig, BatchPrefillPaged

}  // namespace tessera::python
