"""Batch decode over a paged KV cache with plan / run (tessera::BatchDecoder).

    config = tessera.DecodeConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                  dtype="bf16", max_batch_size=256)
    decoder = tessera.BatchDecoder(config)              # owns its workspace
    for step in steps:
        decoder.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)   # host work, once a step
        for layer in layers:
            o = decoder.run(q[layer], k_pages[layer], v_pages[layer])      # one launch a layer

CUDA graphs (torch.cuda.graph, or any capture on the stream run() uses): a run() captured once
replays for later steps when
  - plan() runs outside the graph, before each replay (it copies the step's plan, on the stream,
    into the workspace the captured kernels read), with num_pages given (the cache's page count:
    a replay follows the page ids unchecked, so plan() checks them);
  - the tensors given to the captured run() keep their addresses: q, the cache, out and lse are
    fixed max-size buffers (rows past the step's total_q are not written), and the device page
    ids are the same buffer every step: pass kv_indices on the host (the decoder copies them into
    its own buffer, sized by kv_indices_capacity, which then never moves) or the same device
    tensor each step;
  - the steps fit the captured buffers (plan() rejects a step with more query rows, page-table
    entries or pages than the captured run() was given, and a device kv_indices other than the
    captured one).
plan() and run() of one decoder are ordered on one stream (or ordered streams): layers that run
concurrently need a decoder each. Under torch.compile, run() is the custom op tessera::decode_run
(no graph break); plan() is host work and runs eagerly, outside compiled regions.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional, Tuple, Union


from . import _ops
from . import _tensors as T
from . import _tessera as _ext

DecodeConfig = _ext.DecodeConfig
DecodePlanInfo = _ext.DecodePlanInfo

# handle -> decoder, for the torch op (custom ops take ints and tensors, not Python objects)
_DECODERS: "weakref.WeakValueDictionary[int, BatchDecoder]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _device_index(device: Any) -> int:
    if device is None:
        torch = T.torch_module()
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.current_device()
        return max(_ext.current_device(), 0)
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)  # torch.device
    if index is not None:
        return index
    text = str(device)
    if text.startswith("cuda:"):
        return int(text[5:])
    if text == "cuda":
        return max(_ext.current_device(), 0)
    raise ValueError("device must be an int, 'cuda:N' or a torch.device, got %r" % (device,))


class BatchDecoder:
    """Paged decode with plan / run, owning its device workspace unless one is given.

    config: a tessera.DecodeConfig (head counts, head_dim, page_size, dtype, layout, capacity:
    max_batch_size, max_qo_len; causal, window_left, scale, soft_cap). workspace: a device buffer
    of at least workspace_bytes(config) bytes (a torch tensor, any DLPack CUDA array, or a
    tessera.DeviceBuffer); None allocates one (through torch when it is imported, else with
    cudaMalloc). device: the GPU (default: the current one). kv_indices_capacity: initial size of
    the decoder's device copy of host page ids (it grows as needed until a run() is captured).
    The config is validated here: tessera.Error names the field and the rule.
    """

    def __init__(self, config: DecodeConfig, workspace: Optional[Any] = None, *,
                 device: Optional[Any] = None, kv_indices_capacity: int = 0) -> None:
        self._device = _device_index(device)
        self._config = config
        nbytes = _ext.BatchDecoder.workspace_bytes(config, self._device)
        if workspace is None:
            torch = T.torch_module()
            if torch is not None:
                workspace = torch.empty(nbytes, dtype=torch.uint8, device="cuda:%d" % self._device)
            else:
                workspace = _ext.DeviceBuffer(nbytes, self._device)
        ptr, size = _buffer_address(workspace)
        self._workspace = workspace  # kept alive: the decoder's plan lives there
        self._native = _ext.BatchDecoder(config, ptr, size, self._device)
        self._kv_indices: Any = None        # the device page ids run() reads
        self._own_indices: Any = None       # the decoder's buffer for host page ids
        self._own_capacity = 0
        self._captured_indices: Optional[int] = None  # address a captured run() read them from
        if kv_indices_capacity > 0:
            self._grow_indices(kv_indices_capacity)
        self._handle = next(_HANDLES)
        _DECODERS[self._handle] = self

    @staticmethod
    def workspace_bytes(config: DecodeConfig, device: Optional[Any] = None) -> int:
        """Device workspace bytes a decoder with this config needs on the device."""
        return _ext.BatchDecoder.workspace_bytes(config, _device_index(device))

    @property
    def config(self) -> DecodeConfig:
        return self._native.config

    @property
    def last_plan(self) -> DecodePlanInfo:
        """What the last plan() decided (work items, split requests, chunk length, grid, CTA shape)."""
        return self._native.last_plan

    @property
    def workspace(self) -> Any:
        return self._workspace

    def plan(self, qo_indptr: Any, kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any, *,
             num_pages: Optional[int] = None, stream: Optional[Any] = None) -> None:
        """Plans one step (once per step, before the layers' run() calls).

        qo_indptr [batch + 1] (each request has 1..max_qo_len query rows, the last positions of its
        sequence), the page table kv_indptr [batch + 1] / kv_indices / kv_last_page_len [batch]:
        int32, on the host (CPU tensors, NumPy arrays, lists: no synchronization) or on the device
        (copied to the host once, which synchronizes the stream). The planner runs on the host and
        its result is copied into the workspace with one asynchronous copy on `stream` (default:
        PyTorch's current stream when torch is imported). num_pages: the cache's page count, to
        check every page id against here (required once a run() was captured into a CUDA graph);
        without it the ids are checked against the cache that run() is given.
        """
        torch = T.torch_module()
        if stream is not None and torch is not None and T.is_torch(self._workspace):
            with torch.cuda.stream(T.torch_stream(stream, self._workspace)):  # see T.stream_scope
                return self.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_pages=num_pages)
        entry = "BatchDecoder::plan"
        s = self._stream(stream)
        hosts = []
        for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_last_page_len", kv_last_page_len)):
            if x is None:
                T.fail(entry, name, "is required (got None)")
            x = T.host_array(x)
            hosts.append(T.to_host(x, s) if T.on_device(x, entry, name) else x)
        device_indices = kv_indices if not isinstance(kv_indices, (list, tuple)) and T.on_device(
            kv_indices, entry, "kv_indices") else None
        if (device_indices is not None and self._captured_indices is not None
                and _buffer_address(device_indices)[0] != self._captured_indices):
            T.fail(entry, "kv_indices", "is not the device buffer the captured run() reads (a CUDA "
                   "graph replays with the captured addresses): pass that buffer, or host page ids")
        self._native.plan(hosts[0], hosts[1], hosts[2], hosts[3], -1 if num_pages is None else int(num_pages), s)
        # The library accepted the step: now the device page ids for run().
        if device_indices is not None:
            self._kv_indices = device_indices
            return
        n = len(hosts[2])
        if n > self._own_capacity:
            self._grow_indices(max(n, 2 * self._own_capacity))
        if n:
            _ext.copy_async(self._own_indices, hosts[2], s)
        self._kv_indices = self._own_indices

    def _stream(self, stream: Optional[Any]) -> int:
        """plan()'s stream: the given one, else PyTorch's current stream on the decoder's device
        when the workspace is a torch tensor, else the default stream."""
        if stream is not None:
            return T.stream_handle(stream)
        torch = T.torch_module()
        if torch is not None and T.is_torch(self._workspace):
            return T._torch_raw_stream(torch, self._device)
        return 0

    def _grow_indices(self, capacity: int) -> None:
        if self._captured_indices is not None:
            raise T.Error("tessera::BatchDecoder::plan: argument 'kv_indices': the step needs %d page "
                          "ids but the captured run() reads a buffer of %d" % (capacity, self._own_capacity))
        torch = T.torch_module()
        if torch is not None and T.is_torch(self._workspace):
            self._own_indices = torch.empty(capacity, dtype=torch.int32, device="cuda:%d" % self._device)
        else:
            self._own_indices = _ext.empty([capacity], _ext.DType.INT32, self._device)
        self._own_capacity = capacity

    def run(self, q: Any, k_pages: Any, v_pages: Optional[Any] = None, *, out: Optional[Any] = None,
            lse: Optional[Any] = None, return_lse: bool = False,
            stream: Optional[Any] = None) -> Union[Any, Tuple[Any, Any]]:
        """Runs the planned step for one layer: attention of q over the paged cache.

        q [rows, num_qo_heads, head_dim] with rows >= the plan's total_q (request i's rows start at
        qo_indptr[i]); the cache in the config's layout and dtype: k_pages and v_pages, or the
        combined [num_pages, 2, ...] tensor as k_pages with v_pages None. out (shaped like q) and
        lse ([rows, num_qo_heads] fp32) are written when given, else allocated; rows past total_q
        are not written. Asynchronous on `stream` (default: PyTorch's current stream for torch
        tensors, else the default stream); no allocation when out (and lse) are given.
        Returns out, or (out, lse) when return_lse is true or lse is given.
        """
        if stream is not None and T.is_torch(q) and q.is_cuda:
            with T.torch_module().cuda.stream(T.torch_stream(stream, q)):  # see T.stream_scope
                return self.run(q, k_pages, v_pages, out=out, lse=lse, return_lse=return_lse)
        want_lse = return_lse or lse is not None
        if out is None:
            out = T.empty_like(q, "BatchDecoder::run", "q")
        if want_lse and lse is None:
            shape = tuple(q.shape) if T.is_torch(q) else T.describe(q, "BatchDecoder::run", "q")[3]
            lse = T.empty(shape[:2], _ext.DType.FP32, like=q)
        if _ops.use_torch_op(q):
            _ops.torch_ops().decode_run(self._handle, q, k_pages, v_pages, out, lse, _ops.stream_arg(stream))
        else:
            self._run(q, k_pages, v_pages, out, lse, T.resolve_stream(stream, q))
        return (out, lse) if want_lse else out

    def _run(self, q: Any, k_pages: Any, v_pages: Optional[Any], out: Any, lse: Optional[Any],
             stream: int) -> None:
        indices = self._kv_indices
        if indices is None:
            raise T.Error("tessera::BatchDecoder::run: argument 'plan': run() needs a plan(): call "
                          "plan() once per step first")
        if self._native.run(q, k_pages, v_pages, indices, out, lse, stream) and self._captured_indices is None:
            self._captured_indices = _buffer_address(indices)[0]

    def host_seconds_per_cpp_run(self, q: Any, k_pages: Any, v_pages: Optional[Any], out: Any,
                                 lse: Optional[Any] = None, *, iterations: int = 1000,
                                 stream: Optional[Any] = None) -> float:
        """Benchmark helper: host seconds per call of the C++ run() itself (arguments converted
        once, `iterations` calls in a C++ loop), the baseline of the Python-overhead benchmark."""
        return self._native.host_seconds_per_run(q, k_pages, v_pages, self._kv_indices, out, lse,
                                                 T.resolve_stream(stream, q), iterations)


def _buffer_address(x: Any) -> Tuple[int, int]:
    """(device address, bytes) of a workspace or index buffer."""
    if isinstance(x, _ext.DeviceBuffer):
        return x.ptr, x.nbytes
    if T.is_torch(x):
        return x.data_ptr(), x.numel() * x.element_size()
    return _ext.buffer_address(x)
