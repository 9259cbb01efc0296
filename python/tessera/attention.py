"""Batch prefill over ragged and paged KV (tessera::batch_prefill, tessera::batch_prefill_paged)."""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

from . import _ops
from . import _tensors as T
from . import _tessera as _ext

_PATHS = {"auto": _ext.AttentionPath.AUTO, "portable": _ext.AttentionPath.PORTABLE,
          "hopper": _ext.AttentionPath.HOPPER}


def attention_path(entry: str, path: Union[str, Any]) -> Any:
    if isinstance(path, _ext.AttentionPath):
        return path
    if isinstance(path, str) and path.lower() in _PATHS:
        return _PATHS[path.lower()]
    T.fail(entry, "path", "must be 'auto', 'portable' or 'hopper' (or tessera.AttentionPath), got %r" % (path,))


class _QuerySide:
    """What both prefill wrappers set up the same way: outputs (given or allocated), the kernel
    path, whether the call goes through the torch op, the stream, and qo_indptr's two copies."""

    def __init__(self, entry: str, q: Any, qo_indptr: Any, host_qo_indptr: Optional[Any],
                 out: Optional[Any], lse: Optional[Any], return_lse: bool, path: Union[str, Any],
                 stream: Optional[Any]) -> None:
        self.want_lse = return_lse or lse is not None
        self.o = out if out is not None else T.empty_like(q, entry, "q")
        if lse is None and return_lse:
            shape = tuple(q.shape) if T.is_torch(q) else T.describe(q, entry, "q")[3]
            lse = T.empty(shape[:2], _ext.DType.FP32, like=q)
        self.lse = lse
        self.path = attention_path(entry, path)
        self.torch_op = _ops.use_torch_op(q)
        self.stream = -1 if self.torch_op else T.resolve_stream(stream, q)
        self.qo, self.qo_host = T.index_pair(entry, "qo_indptr", qo_indptr, host_qo_indptr, q, self.stream)

    def result(self) -> Union[Any, Tuple[Any, Any]]:
        return (self.o, self.lse) if self.want_lse else self.o


@T.stream_scope("q", 0)
def batch_prefill(q: Any, k: Any, v: Any, qo_indptr: Any, kv_indptr: Any, *,
                  host_qo_indptr: Optional[Any] = None, host_kv_indptr: Optional[Any] = None,
                  causal: bool = False, window_left: int = -1, soft_cap: float = 0.0,
                  scale: Optional[float] = None, return_lse: bool = False, out: Optional[Any] = None,
                  lse: Optional[Any] = None, path: Union[str, Any] = "auto",
                  stream: Optional[Any] = None) -> Union[Any, Tuple[Any, Any]]:
    """Exact attention over a ragged batch (FlashAttention's varlen prefill / chunked prefill).

    q: [total_q, num_qo_heads, head_dim], k / v: [total_kv, num_kv_heads, head_dim], bf16 or fp16,
    CUDA tensors of any DLPack framework (head_dim contiguous; rows and heads may be strided, so a
    slice of a packed qkv tensor is fine). Request i owns q rows [qo_indptr[i], qo_indptr[i+1]) and
    k / v rows [kv_indptr[i], kv_indptr[i+1]); its queries are the last qo_len positions of its
    kv_len keys. The indptr arrays are int32 [batch + 1], on the device or the host: a host array
    (CPU tensor, NumPy array, list) is copied to the device; a device one is copied to the host
    once (which synchronizes) unless its host copy is given as host_qo_indptr / host_kv_indptr.

    causal: bottom-right aligned mask (row i sees keys j <= i + kv_len - qo_len). window_left >= 0:
    also j >= i + kv_len - qo_len - window_left. soft_cap > 0: logits = cap * tanh(logits / cap).
    scale: defaults to 1 / sqrt(head_dim). path: 'auto', 'portable' or 'hopper' (an unavailable
    family is an error). out / lse: outputs to write ([total_q, num_qo_heads, head_dim] in q's
    dtype; [total_q, num_qo_heads] fp32 natural-log LSE); allocated when not given (torch tensors
    for torch inputs). stream: a cudaStream_t (int, torch.cuda.Stream, CuPy stream); default
    PyTorch's current stream for torch tensors, else the default stream. For torch tensors a
    given stream is made current for the call, so what it allocates belongs to that stream (as
    for a torch op on a side stream); under torch.compile use torch.cuda.stream() instead.

    Returns o, or (o, lse) when return_lse is true or lse is given. Raises tessera.Error (a
    ValueError) naming the argument and the rule when an argument is invalid; nothing is written
    then.
    """
    entry = "batch_prefill"
    a = _QuerySide(entry, q, qo_indptr, host_qo_indptr, out, lse, return_lse, path, stream)
    kv, kv_host = T.index_pair(entry, "kv_indptr", kv_indptr, host_kv_indptr, q, a.stream)
    if a.torch_op:
        _ops.torch_ops().batch_prefill(q, k, v, a.qo, kv, a.qo_host, kv_host, a.o, a.lse, causal, window_left,
                                      float(scale or 0.0), float(soft_cap), a.path.value, _ops.stream_arg(stream))
    else:
        _ext.batch_prefill(q, k, v, a.qo, kv, a.qo_host, kv_host, a.o, a.lse, causal, window_left,
                           float(scale or 0.0), float(soft_cap), a.path, a.stream)
    return a.result()


@T.stream_scope("q", 0)
def batch_prefill_paged(q: Any, qo_indptr: Any, k_pages: Any, v_pages: Optional[Any],
                        kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any, *,
                        layout: str = "NHD", host_qo_indptr: Optional[Any] = None,
                        host_kv_indptr: Optional[Any] = None, host_kv_indices: Optional[Any] = None,
                        host_kv_last_page_len: Optional[Any] = None, causal: bool = False,
                        window_left: int = -1, soft_cap: float = 0.0, scale: Optional[float] = None,
                        return_lse: bool = False, out: Optional[Any] = None, lse: Optional[Any] = None,
                        path: Union[str, Any] = "auto",
                        stream: Optional[Any] = None) -> Union[Any, Tuple[Any, Any]]:
    """Prefill / extend over a paged KV cache: ragged queries against each request's pages.

    q, qo_indptr, outputs, masks, scale, soft_cap, path and stream as in batch_prefill. The cache:
    k_pages / v_pages [num_pages, page_size, num_kv_heads, head_dim] (layout 'NHD') or
    [num_pages, num_kv_heads, page_size, head_dim] ('HND'), strided pages allowed; or the combined
    tensor [num_pages, 2, ...] (FlashInfer's / vLLM's kv_cache, K at index 0, V at 1) as k_pages
    with v_pages None. The page table: kv_indptr [batch + 1] (counts pages), kv_indices (page ids),
    kv_last_page_len [batch] (1..page_size), int32, on the device or the host like batch_prefill's
    indptr arrays (host copies may be given as host_kv_*; every page id is checked against the
    cache before anything runs). kv_len = page_size * (pages - 1) + last_page_len.
    """
    entry = "batch_prefill_paged"
    a = _QuerySide(entry, q, qo_indptr, host_qo_indptr, out, lse, return_lse, path, stream)
    indptr, indptr_host = T.index_pair(entry, "kv_indptr", kv_indptr, host_kv_indptr, q, a.stream)
    indices, indices_host = T.index_pair(entry, "kv_indices", kv_indices, host_kv_indices, q, a.stream)
    last, last_host = T.index_pair(entry, "kv_last_page_len", kv_last_page_len, host_kv_last_page_len, q, a.stream)
    if a.torch_op:
        _ops.torch_ops().batch_prefill_paged(
            q, a.qo, a.qo_host, k_pages, v_pages, layout, indptr, indices, last, indptr_host, indices_host,
            last_host, a.o, a.lse, causal, window_left, float(scale or 0.0), float(soft_cap), a.path.value,
            _ops.stream_arg(stream))
    else:
        _ext.batch_prefill_paged(q, a.qo, a.qo_host, k_pages, v_pages, layout, indptr, indices, last,
                                 indptr_host, indices_host, last_host, a.o, a.lse, causal, window_left,
                                 float(scale or 0.0), float(soft_cap), a.path, a.stream)
    return a.result()
