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
            lse = T.empty(T.shape(q, entry, "q")[:2], _ext.DType.FP32, like=q)
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


def _page_table(entry: str, kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any, host_kv_indptr: Optional[Any],
                host_kv_indices: Optional[Any], host_kv_last_page_len: Optional[Any], q: Any, stream: int):
    """The page table's device arrays and host copies (each given on either side, see T.index_pair)."""
    indptr, indptr_host = T.index_pair(entry, "kv_indptr", kv_indptr, host_kv_indptr, q, stream)
    indices, indices_host = T.index_pair(entry, "kv_indices", kv_indices, host_kv_indices, q, stream)
    last, last_host = T.index_pair(entry, "kv_last_page_len", kv_last_page_len, host_kv_last_page_len, q, stream)
    return indptr, indices, last, indptr_host, indices_host, last_host


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
    indptr, indices, last, indptr_host, indices_host, last_host = _page_table(
        entry, kv_indptr, kv_indices, kv_last_page_len, host_kv_indptr, host_kv_indices, host_kv_last_page_len, q,
        a.stream)
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


class BatchPrefillPaged:
    """Paged prefill / extend with plan / run and a KV split for under-filled steps
    (tessera::BatchPrefillPaged): a short chunk of new tokens over a long history, few requests.

        prefill = tessera.BatchPrefillPaged(tessera.PagedPrefillConfig(num_qo_heads=32, num_kv_heads=8,
                                            head_dim=128, page_size=16, max_q_rows=4096))
        prefill.plan(host_qo_indptr, kv_indptr, kv_indices, kv_last_page_len)   # once per step
        o = prefill.run(q, qo_indptr, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len)  # per layer

    plan() reads host copies (the indptr / index arrays on the host, or host_* copies of device
    ones); run() takes batch_prefill_paged's arguments for the planned step (its page table must be
    the planned one) and returns o, or (o, lse). Where the Hopper family reads the pages it runs the
    split too, its count from that family's cost model (the config's causal / window_left are the
    mask that estimate assumes; run() applies its own arguments'); elsewhere the portable family
    splits (last_plan().path / kv_splits / estimated_us say what was chosen). The workspace
    (paged_prefill_workspace_bytes(config) bytes) is allocated unless one is given.

    CUDA graphs: with PagedPrefillConfig(cuda_graph=True, max_batch_size=...), plan() copies the
    step into the workspace on its stream and run() launches fixed grids that read it, so a run()
    captured once replays any later planned step (q, o, lse, the pages and kv_indices keep their
    addresses; once captured, plan() needs num_pages). See tessera::BatchPrefillPaged.

    The fixed grid in eager mode: PagedPrefillConfig(max_batch_size=...) without cuda_graph lets
    plan() put steps whose requests differ (in query rows or keys) on the same fixed grid and
    longest-first schedule (1.10-1.53x on mixed serving steps on the H200); steps of equal
    requests keep the one-tile grid. last_plan().fixed_grid says which ran.

    Batch invariance: PagedPrefillConfig(batch_invariant=True) splits every step into exactly
    max_kv_splits runs (1: none) and keeps one grid on the portable family, so a request's output
    bits do not depend on the other requests of its step.
    """

    def __init__(self, config: Any, workspace: Optional[Any] = None, device: Optional[int] = None) -> None:
        if workspace is None:
            nbytes = _ext.paged_prefill_workspace_bytes(config)
            dev = _ext.current_device() if device is None else device
            workspace = _ext.empty([max((nbytes + 3) // 4, 64)], _ext.DType.INT32, max(dev, 0))
        self.config = config
        self._workspace = workspace
        self._impl = _ext.PagedPrefiller(config, workspace)

    def plan(self, host_qo_indptr: Any, kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any, *,
             host_kv_indptr: Optional[Any] = None, host_kv_indices: Optional[Any] = None,
             host_kv_last_page_len: Optional[Any] = None, num_pages: Optional[int] = None,
             stream: Optional[Any] = None) -> Any:
        """Decides the step's split from the host copies; returns last_plan(). num_pages (the
        cache's pages) has every page id checked here (required once a cuda_graph run() was
        captured); stream: where a cuda_graph config copies the step (default: PyTorch's current
        stream for a torch workspace, else the default stream)."""
        entry = "BatchPrefillPaged::plan"

        def both(name: str, given: Any, host: Optional[Any]) -> Tuple[Any, Any]:
            # plan() reads host copies only; a device array is copied once (synchronizes).
            given = T.host_array(given)
            if host is not None:
                return given, T.host_array(host)
            return given, (T.to_host(given, 0) if T.on_device(given, entry, name) else given)

        indptr, indptr_host = both("kv_indptr", kv_indptr, host_kv_indptr)
        indices, indices_host = both("kv_indices", kv_indices, host_kv_indices)
        last, last_host = both("kv_last_page_len", kv_last_page_len, host_kv_last_page_len)
        self._impl.plan(T.host_array(host_qo_indptr), indptr, indices, last, indptr_host, indices_host, last_host,
                        -1 if num_pages is None else int(num_pages), T.resolve_stream(stream, self._workspace))
        return self._impl.last_plan()

    def last_plan(self) -> Any:
        return self._impl.last_plan()

    def run(self, q: Any, qo_indptr: Any, k_pages: Any, v_pages: Optional[Any], kv_indptr: Any, kv_indices: Any,
            kv_last_page_len: Any, *, layout: str = "NHD", host_qo_indptr: Optional[Any] = None,
            host_kv_indptr: Optional[Any] = None, host_kv_indices: Optional[Any] = None,
            host_kv_last_page_len: Optional[Any] = None, causal: bool = False, window_left: int = -1,
            soft_cap: float = 0.0, scale: Optional[float] = None, return_lse: bool = False,
            out: Optional[Any] = None, lse: Optional[Any] = None, path: Union[str, Any] = "auto",
            stream: Optional[Any] = None) -> Union[Any, Tuple[Any, Any]]:
        """batch_prefill_paged for the planned step (see tessera.batch_prefill_paged)."""
        entry = "BatchPrefillPaged::run"
        a = _QuerySide(entry, q, qo_indptr, host_qo_indptr, out, lse, return_lse, path, stream)
        stream_handle = T.resolve_stream(stream, q)
        indptr, indices, last, indptr_host, indices_host, last_host = _page_table(
            entry, kv_indptr, kv_indices, kv_last_page_len, host_kv_indptr, host_kv_indices, host_kv_last_page_len,
            q, stream_handle)
        self._impl.run(q, a.qo, a.qo_host, k_pages, v_pages, layout, indptr, indices, last, indptr_host,
                       indices_host, last_host, a.o, a.lse, causal, window_left, float(scale or 0.0),
                       float(soft_cap), a.path, stream_handle)
        return a.result()
