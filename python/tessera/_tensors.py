"""Framework plumbing shared by the wrappers: streams, output allocation, index arrays.

Tensors are any DLPack producer (PyTorch, JAX, CuPy, NumPy, ...); torch tensors get torch's own
allocator and current stream. torch is optional: imported when installed (a module global, which
torch.compile traces through), and None otherwise.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np

from . import _tessera as _ext

try:
    import torch as _torch
except ImportError:
    _torch = None
# torch.compiler.is_compiling (torch >= 2.3), read once: the wrappers ask it while Dynamo traces them.
_is_compiling = getattr(getattr(_torch, "compiler", None), "is_compiling", None)

Error = _ext.Error

# DType name -> (torch dtype attribute, numpy dtype or None)
_DTYPE_NAMES = {
    _ext.DType.BF16: ("bfloat16", None),
    _ext.DType.FP16: ("float16", np.float16),
    _ext.DType.FP32: ("float32", np.float32),
    _ext.DType.INT32: ("int32", np.int32),
}


def torch_module():
    """The torch module, or None where it is not installed."""
    return _torch


def is_torch(x: Any) -> bool:
    return _torch is not None and isinstance(x, _torch.Tensor)


def fail(entry: str, arg: str, rule: str) -> None:
    """Raises tessera.Error in the library's format: tessera::entry: argument 'arg': rule."""
    raise Error("tessera::%s: argument '%s': %s" % (entry, arg, rule))


# ---- streams ------------------------------------------------------------------------------------

def stream_handle(stream: Any) -> int:
    """A cudaStream_t as an int from an int, a torch.cuda.Stream, an object with __cuda_stream__
    (the CUDA stream protocol) or a CuPy stream (.ptr)."""
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream / ExternalStream
    if isinstance(handle, int):
        return handle
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    handle = getattr(stream, "ptr", None)  # cupy.cuda.Stream
    if isinstance(handle, int):
        return handle
    raise TypeError("stream must be an int (cudaStream_t), a torch.cuda.Stream, a CuPy stream or an "
                    "object with __cuda_stream__, got %r" % type(stream).__name__)


def _torch_raw_stream(torch, device_index: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: ~10x cheaper
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def resolve_stream(stream: Any, like: Any) -> int:
    """The stream a call runs on: `stream` when given; else PyTorch's current stream for a torch
    CUDA tensor `like`; else 0 (the default stream)."""
    if stream is not None:
        return stream_handle(stream)
    if _torch is not None and isinstance(like, _torch.Tensor) and like.is_cuda:
        return _torch_raw_stream(_torch, like.get_device())
    return 0


def torch_stream(stream: Any, like: Any) -> Any:
    """A torch stream object for `stream` on `like`'s device."""
    if isinstance(stream, _torch.cuda.Stream):
        return stream
    return _torch.cuda.ExternalStream(stream_handle(stream), device=like.device)


def stream_scope(like_name: str, like_index: int) -> Callable:
    """Decorates a wrapper whose keyword `stream` may name a stream other than PyTorch's current
    one: for torch tensors the call then runs with that stream made current, so that the
    temporaries and outputs it allocates (index copies, out) belong to it, as for any torch op
    issued on a side stream."""
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, stream: Optional[Any] = None, **kwargs: Any) -> Any:
            if stream is not None and _torch is not None:
                like = args[like_index] if len(args) > like_index else kwargs.get(like_name)
                if isinstance(like, _torch.Tensor) and like.is_cuda:
                    # Under torch.compile a torch stream goes to torch.cuda.stream() as it is: Dynamo
                    # traces that context (measured on the H200, torch 2.11), but not the probing
                    # of the object in torch_stream ("Unsupported hasattr call").
                    if _is_compiling is not None and _is_compiling() and not isinstance(stream, int):
                        with _torch.cuda.stream(stream):
                            return fn(*args, **kwargs)
                    with _torch.cuda.stream(torch_stream(stream, like)):
                        return fn(*args, **kwargs)
            return fn(*args, stream=stream, **kwargs)
        return wrapper
    return decorate


# ---- allocation ---------------------------------------------------------------------------------

def describe(x: Any, entry: str = "tensor_info", arg: str = "x") -> Tuple[Any, bool, int, Tuple[int, ...]]:
    """(DType, on a CUDA device, device id, shape) of any tensor tessera reads; a tensor it cannot
    read raises tessera.Error naming entry and arg."""
    return _ext.tensor_info(x, entry, arg)


def shape(x: Any, entry: str, arg: str) -> Tuple[int, ...]:
    """x's shape (torch tensors without a call into the extension)."""
    return tuple(x.shape) if is_torch(x) else describe(x, entry, arg)[3]


def empty(shape: Sequence[int], dtype: Any, like: Any) -> Any:
    """An uninitialised tensor of `shape` and DType `dtype` where `like` lives: a torch tensor for
    torch `like`; else a CUDA array through DLPack (tessera's own allocation) or a NumPy array."""
    torch_name, numpy_dtype = _DTYPE_NAMES[dtype]
    if is_torch(like):
        torch = _torch
        return torch.empty(tuple(shape), dtype=getattr(torch, torch_name), device=like.device)
    _, on_cuda, device, _ = describe(like)
    if on_cuda:
        return _ext.empty(list(shape), dtype, device)
    if numpy_dtype is None:
        raise Error("tessera: cannot allocate a host %s array (NumPy has no such dtype); tessera's "
                    "kernels read CUDA tensors" % torch_name)
    return np.empty(tuple(shape), dtype=numpy_dtype)


def empty_like(x: Any, entry: str, arg: str, rows: Optional[int] = None, cols: Optional[int] = None) -> Any:
    """An uninitialised tensor like x (its dtype and device), with `rows` rows (dim 0) and `cols`
    columns (the last dim) if given."""
    if is_torch(x):
        torch = _torch
        dims, dtype = list(x.shape), x.dtype
    else:
        dtype, _, _, dims = describe(x, entry, arg)
        dims = list(dims)
    if rows is not None:
        dims[0] = rows
    if cols is not None:
        dims[-1] = cols
    if is_torch(x):
        return torch.empty(tuple(dims), dtype=dtype, device=x.device)
    return empty(tuple(dims), dtype, like=x)


# ---- index arrays ----------------------------------------------------------------------------------

def host_array(x: Any) -> Any:
    """Lists and tuples become int32 NumPy arrays; tensors pass as they are (the binding checks
    their dtype, so an int64 array is an error, not a silent copy)."""
    if isinstance(x, (list, tuple)):
        return np.asarray(x, dtype=np.int32)
    return x


def on_device(x: Any, entry: str, arg: str) -> bool:
    if is_torch(x):
        return x.is_cuda
    return describe(x, entry, arg)[1]


def to_host(x: Any, stream: int) -> Any:
    """A host copy of a device int32 array. Synchronizes: it waits for `stream` (for torch, the
    current stream) so that the copy holds the values the queued work wrote."""
    if is_torch(x):
        return x.cpu()
    dtype, _, _, shape = describe(x)
    if dtype != _ext.DType.INT32:
        return x  # the binding names the argument and the dtype rule
    host = np.empty(shape, dtype=np.int32)
    _ext.copy_async(host, x, stream)
    _ext.stream_synchronize(stream)
    return host


def to_device(x: Any, like: Any, stream: int, entry: str = "tensor_info", like_name: str = "x") -> Any:
    """A device copy of a host int32 array on `like`'s device (asynchronous on `stream`; the
    source may be reused as soon as this returns)."""
    if is_torch(like):
        torch = _torch
        if not is_torch(x):
            x = torch.from_numpy(np.ascontiguousarray(x))
        return x.to(like.device, non_blocking=True)
    dtype, _, _, shape = describe(x)
    _, on_cuda, device, _ = describe(like, entry, like_name)
    if dtype != _ext.DType.INT32 or not on_cuda:
        return x  # the binding reports the dtype or device rule
    dev = _ext.empty(list(shape), dtype, device)
    _ext.copy_async(dev, np.ascontiguousarray(x), stream)
    return dev


def index_pair(entry: str, name: str, given: Any, host: Optional[Any], like: Any,
               stream: int, like_name: str = "q") -> Tuple[Any, Any]:
    """(device array, host copy) of an index array given on either side.

    - `given` on the device and `host` given: both as they are (the host copy must hold the same
      values; the library checks it and launches from it).
    - `given` on the device, no `host`: a host copy is made (synchronizes the stream).
    - `given` on the host (a CPU tensor, NumPy array or list): it is the host copy, and a device
      copy is made on `like`'s device (asynchronous)."""
    if given is None:
        fail(entry, name, "is required (got None)")
    given = host_array(given)
    if host is not None:
        host = host_array(host)
    if on_device(given, entry, name):
        return given, (host if host is not None else to_host(given, stream))
    if host is not None:
        fail(entry, "host_" + name, "was given but '%s' is on the host too: pass the device array as "
             "'%s' (or only the host one)" % (name, name))
    return to_device(given, like, stream, entry, like_name), given
