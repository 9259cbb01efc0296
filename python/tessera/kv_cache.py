"""Writing new K/V rows into a paged cache (tessera::append_paged_kv)."""
from __future__ import annotations

from typing import Any, Optional

from . import _ops
from . import _tensors as T
from . import _tessera as _ext


@T.stream_scope("k_new", 6)
def append_paged_kv(k_pages: Any, v_pages: Optional[Any], kv_indptr: Any, kv_indices: Any,
                    kv_last_page_len: Any, append_indptr: Any, k_new: Any, v_new: Any, *,
                    layout: str = "NHD", host_kv_indptr: Optional[Any] = None,
                    host_kv_indices: Optional[Any] = None,
                    host_kv_last_page_len: Optional[Any] = None,
                    host_append_indptr: Optional[Any] = None, stream: Optional[Any] = None) -> None:
    """Writes a ragged batch of new K/V rows into the paged cache, in place.

    k_pages / v_pages: the cache as in batch_prefill_paged (separate tensors, or the combined
    [num_pages, 2, ...] tensor as k_pages with v_pages None). The page table (kv_indptr,
    kv_indices, kv_last_page_len) already describes the cache *after* the append, as in FlashInfer:
    request i's n_i = append_indptr[i+1] - append_indptr[i] new rows of k_new / v_new
    ([nnz, num_kv_heads, head_dim], the pages' dtype) go to positions kv_len_i - n_i ..
    kv_len_i - 1. Index arrays are int32, on the device or the host (see batch_prefill); their host
    copies are checked (n_i <= kv_len_i, page ids inside the cache, no page written from two places)
    before anything is written.
    """
    entry = "append_paged_kv"
    like = k_new
    torch_op = _ops.use_torch_op(like)
    s = -1 if torch_op else T.resolve_stream(stream, like)
    indptr, indptr_host = T.index_pair(entry, "kv_indptr", kv_indptr, host_kv_indptr, like, s, "k_new")
    indices, indices_host = T.index_pair(entry, "kv_indices", kv_indices, host_kv_indices, like, s, "k_new")
    last, last_host = T.index_pair(entry, "kv_last_page_len", kv_last_page_len, host_kv_last_page_len, like, s, "k_new")
    append, append_host = T.index_pair(entry, "append_indptr", append_indptr, host_append_indptr, like, s, "k_new")
    if torch_op:
        _ops.torch_ops().append_paged_kv(k_pages, v_pages, layout, indptr, indices, last, indptr_host,
                                        indices_host, last_host, append, append_host, k_new, v_new,
                                        _ops.stream_arg(stream))
    else:
        _ext.append_paged_kv(k_pages, v_pages, layout, indptr, indices, last, indptr_host, indices_host,
                             last_host, append, append_host, k_new, v_new, s)
