"""Merging partial attention states (tessera::merge_state, merge_state_in_place, merge_states).

A state is an output o [rows, heads, head_dim] (bf16, fp16 or fp32) with its natural-log LSE
s [rows, heads] (fp32). Merging (o_a, s_a) with (o_b, s_b): s = log(e^s_a + e^s_b),
o = o_a e^(s_a - s) + o_b e^(s_b - s); a state with s = -inf contributes nothing. head_dim is the
contiguous dimension; rows and heads may be strided.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

from . import _ops
from . import _tensors as T
from . import _tessera as _ext

_OUT_DTYPES = {"bf16": _ext.DType.BF16, "fp16": _ext.DType.FP16, "fp32": _ext.DType.FP32}


def _out_dtype(entry: str, o: Any, out_dtype: Optional[Any]) -> Any:
    if out_dtype is None:
        return T.describe(o, entry, "o")[0] if not T.is_torch(o) else None
    key = str(out_dtype).lower().replace("torch.", "").replace("dtype.", "")
    key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(key, key)
    if key not in _OUT_DTYPES:
        T.fail(entry, "out_dtype", "must be bf16, fp16 or fp32, got %r" % (out_dtype,))
    return _OUT_DTYPES[key]


def _alloc_state(entry: str, like_o: Any, like_s: Any, o_shape, s_shape, out_dtype: Optional[Any]):
    """An output state: o of o_shape in out_dtype (default: like_o's dtype), s fp32."""
    dtype = _out_dtype(entry, like_o, out_dtype)
    if T.is_torch(like_o) and dtype is None:
        torch = T.torch_module()
        o = torch.empty(o_shape, dtype=like_o.dtype, device=like_o.device)
    else:
        o = T.empty(o_shape, dtype, like=like_o)
    return o, T.empty(s_shape, _ext.DType.FP32, like=like_s)


@T.stream_scope("o_a", 0)
def merge_state(o_a: Any, s_a: Any, o_b: Any, s_b: Any, *, out: Optional[Any] = None,
                s_out: Optional[Any] = None, out_dtype: Optional[Any] = None,
                stream: Optional[Any] = None) -> Tuple[Any, Any]:
    """Merges two states out of place; returns (o, s).

    o_a / o_b share a dtype; the output has it too, or bf16 / fp16 (out_dtype) when the inputs
    are fp32 partials. out / s_out are written when given, else allocated (torch tensors for torch
    inputs). Raises tessera.Error for invalid arguments (nothing written then).
    """
    entry = "merge_state"
    if out is None or s_out is None:
        o_new, s_new = _alloc_state(entry, o_a, s_a, T.shape(o_a, entry, "o_a"), T.shape(s_a, entry, "s_a"), out_dtype)
        out = o_new if out is None else out
        s_out = s_new if s_out is None else s_out
    if _ops.use_torch_op(o_a):
        _ops.torch_ops().merge_state(o_a, s_a, o_b, s_b, out, s_out, _ops.stream_arg(stream))
    else:
        _ext.merge_state(o_a, s_a, o_b, s_b, out, s_out, T.resolve_stream(stream, o_a))
    return out, s_out


@T.stream_scope("o", 0)
def merge_state_in_place(o: Any, s: Any, o_other: Any, s_other: Any, *,
                         stream: Optional[Any] = None) -> None:
    """(o, s) = merge((o, s), (o_other, s_other)), in place; o and o_other share a dtype."""
    if _ops.use_torch_op(o):
        _ops.torch_ops().merge_state_in_place(o, s, o_other, s_other, _ops.stream_arg(stream))
    else:
        _ext.merge_state_in_place(o, s, o_other, s_other, T.resolve_stream(stream, o))


@T.stream_scope("o_parts", 0)
def merge_states(o_parts: Any, s_parts: Any, *, out: Optional[Any] = None, s_out: Optional[Any] = None,
                 return_lse: bool = True, out_dtype: Optional[Any] = None,
                 stream: Optional[Any] = None) -> Union[Any, Tuple[Any, Any]]:
    """Merges n states: o_parts [rows, n, heads, head_dim], s_parts [rows, n, heads] ->
    (o [rows, heads, head_dim], s [rows, heads]); with return_lse False (and no s_out) only o is
    computed and returned. Dtype rules as merge_state."""
    entry = "merge_states"
    want_lse = return_lse or s_out is not None
    if out is None or (want_lse and s_out is None):
        p = T.shape(o_parts, entry, "o_parts")
        o_shape = (p[0], p[2], p[3]) if len(p) == 4 else p
        o_new, s_new = _alloc_state(entry, o_parts, s_parts, o_shape, o_shape[:2], out_dtype)
        out = o_new if out is None else out
        if want_lse and s_out is None:
            s_out = s_new
    if _ops.use_torch_op(o_parts):
        _ops.torch_ops().merge_states(o_parts, s_parts, out, s_out, _ops.stream_arg(stream))
    else:
        _ext.merge_states(o_parts, s_parts, out, s_out, T.resolve_stream(stream, o_parts))
    return (out, s_out) if want_lse else out
