// What the binding translation units share.
#pragma once

#include <nanobind/nanobind.h>

#include "tensor_args.h"
#include "tessera/kv_cache.h"

namespace tessera::python {

// A page table from its device arrays and (optional) host copies; a host copy must have as many
// entries as its device array.
PageTable page_table(ArgConverter& conv, nanobind::handle indptr, nanobind::handle indices,
                     nanobind::handle last_page_len, nanobind::handle host_indptr,
                     nanobind::handle host_indices, nanobind::handle host_last_page_len);

void bind_memory(nanobind::module_& m);   // decoder.cpp: device buffers, copies, streams
void bind_decoder(nanobind::module_& m);  // decoder.cpp: DecodeConfig, BatchDecoder
void bind_prefill_paged(nanobind::module_& m);  // prefill_paged.cpp: PagedPrefillConfig, BatchPrefillPaged

}  // namespace tessera::python
