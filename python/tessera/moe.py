"""Mixture-of-Experts layer: routing, permutation, grouped GEMM, combine, and the whole layer.

moe_route turns router logits [tokens, num_experts] into the top-k experts and their weights;
moe_permute groups the (token, k) copies by expert into aligned segments, with the offsets
computed on the device (no host synchronisation, CUDA-graph safe) and results deterministic;
moe_grouped_gemm multiplies every expert's segment by its weights (optionally with the SwiGLU
epilogue, optionally reading the segment rows straight from x through permuted_token: a_rows);
moe_combine sums each token's expert outputs with the routing weights; fused_moe runs
the whole layer in one call.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

from . import _ops
from . import _tensors as T
from . import _tessera as _ext

_SCORES = {"softmax": 0, "sigmoid": 1}


# ---- buffer sizes --------------------------------------------------------------------------------------
# The library's sizing functions validate their arguments; torch.compile cannot trace a call into
# the extension, and with dynamic shapes the sizes are symbolic, so under compilation the wrappers
# use the same arithmetic in Python (tests/test_bindings.py checks it against the library; the
# entry points still check every buffer's size when they run).

def _permute_capacity(tokens: Any, top_k: int, num_experts: int, align: int) -> Any:
    if _ops.is_compiling():
        return tokens * top_k + num_experts * (align - 1)
    return _ext.moe_permute_capacity(tokens, top_k, num_experts, align)


def _permute_workspace_bytes_py(tokens: Any, top_k: int, num_experts: int) -> Any:
    entries = tokens * top_k
    return ((entries + 63) // 64 * 64 + (entries + 1023) // 1024 * num_experts) * 4


def _permute_workspace_bytes(tokens: Any, top_k: int, num_experts: int) -> Any:
    if _ops.is_compiling():
        return _permute_workspace_bytes_py(tokens, top_k, num_experts)
    return _ext.moe_permute_workspace_bytes(tokens, top_k, num_experts)


def _fused_moe_workspace_bytes_py(tokens: Any, hidden: Any, inter: Any, num_experts: int, top_k: int,
                                  shared_inter: Any = 0) -> Any:
    """fused_moe's workspace layout (src/api/moe_api.cpp, fused_moe_layout): each buffer rounded up to
    256 bytes; the permuted copy of x only where the first GEMM does not gather x's rows itself
    (inter > 1024, dispatch::fused_moe_rows)."""
    rows = tokens * top_k
    parts = [rows * 4, rows * 4, (num_experts + 1) * 4, rows * 4, rows * 4,
             _permute_workspace_bytes_py(tokens, top_k, num_experts)]
    if inter > 1024:
        parts.append(rows * hidden * 2)
    parts += [rows * inter * 2, rows * hidden * 2]
    if shared_inter > 0:
        parts += [tokens * shared_inter * 2, tokens * hidden * 2]
    return sum((b + 255) // 256 * 256 for b in parts)


@T.stream_scope("logits", 0)
def moe_route(logits: Any, top_k: int, *, score: str = "softmax", renormalize: bool = False,
              selection_bias: Optional[Any] = None, num_groups: int = 1, topk_groups: int = 1,
              routed_scaling: float = 1.0, topk_ids: Optional[Any] = None,
              topk_weights: Optional[Any] = None, stream: Optional[Any] = None) -> Tuple[Any, Any]:
    """Router: logits [tokens, num_experts] (fp32 / bf16 / fp16) -> (topk_ids int32 [tokens, top_k],
    topk_weights fp32 [tokens, top_k]), experts by decreasing selection score.

    score 'softmax' (over the experts) or 'sigmoid' (per expert); selection by score +
    selection_bias[e] when a bias [num_experts] fp32 is given (it steers the choice only); ties go
    to the lower expert id. num_groups > 1: DeepSeek-V3's grouped top-k (a group scores the sum of
    its two best selection scores, the topk_groups best groups are eligible). Weights are the
    unbiased scores, divided by their sum when renormalize, times routed_scaling. Outputs are
    written when given, else allocated. Raises tessera.Error for invalid arguments.
    """
    entry = "moe_route"
    if score not in _SCORES:
        T.fail(entry, "score", "must be 'softmax' or 'sigmoid', got %r" % (score,))
    tokens = T.shape(logits, entry, "logits")[0]
    if topk_ids is None:
        topk_ids = T.empty((tokens, top_k), _ext.DType.INT32, like=logits)
    if topk_weights is None:
        topk_weights = T.empty((tokens, top_k), _ext.DType.FP32, like=logits)
    args = (logits, selection_bias, int(top_k), _SCORES[score], bool(renormalize), int(num_groups),
            int(topk_groups), float(routed_scaling), topk_ids, topk_weights)
    if _ops.use_torch_op(logits):
        _ops.torch_ops().moe_route(*args, _ops.stream_arg(stream))
    else:
        _ext.moe_route(*args, T.resolve_stream(stream, logits))
    return topk_ids, topk_weights


class MoePermutation(NamedTuple):
    """moe_permute's outputs: expert e's rows are [expert_offsets[e], expert_offsets[e + 1])."""
    expert_offsets: Any  # int32 [num_experts + 1]
    permuted_token: Any  # int32 [capacity]: the token of each row, -1 on padding and past the end
    inverse: Any         # int32 [tokens, top_k]: the row of each (token, k) copy, -1 when dropped
    permuted_x: Optional[Any]  # [capacity, hidden] when x was given


def moe_permute_capacity(tokens: int, top_k: int, num_experts: int, align: int = 1) -> int:
    """Rows the permuted outputs must hold: tokens x top_k + num_experts x (align - 1)."""
    return _permute_capacity(tokens, top_k, num_experts, align)


@T.stream_scope("topk_ids", 0)
def moe_permute(topk_ids: Any, num_experts: int, *, align: int = 1, x: Optional[Any] = None,
                permuted_x: Optional[Any] = None, expert_offsets: Optional[Any] = None,
                permuted_token: Optional[Any] = None, inverse: Optional[Any] = None,
                workspace: Optional[Any] = None, stream: Optional[Any] = None) -> MoePermutation:
    """Groups the (token, k) copies of topk_ids [tokens, top_k] int32 by expert.

    Stable: (token, k) order within an expert. Every segment starts at a multiple of align (the
    grouped GEMM's M tile) and is padded to one; ids outside [0, num_experts) are dropped (an
    expert-parallel rank passes -1 for the experts it does not hold). With x [tokens, hidden]
    (bf16 / fp16) its rows are copied into permuted_x in that order (padding rows zeroed). Outputs
    (and the int32 workspace) are written when given, else allocated with
    moe_permute_capacity(...) rows. Raises tessera.Error for invalid arguments.
    """
    entry = "moe_permute"
    tokens, top_k = T.shape(topk_ids, entry, "topk_ids")[:2]
    capacity = moe_permute_capacity(tokens, top_k, num_experts, align)
    if expert_offsets is None:
        expert_offsets = T.empty((num_experts + 1,), _ext.DType.INT32, like=topk_ids)
    if permuted_token is None:
        permuted_token = T.empty((capacity,), _ext.DType.INT32, like=topk_ids)
    if inverse is None:
        inverse = T.empty((tokens, top_k), _ext.DType.INT32, like=topk_ids)
    if x is not None and permuted_x is None:
        permuted_x = T.empty_like(x, entry, "x", rows=capacity)
    if workspace is None:
        words = (_permute_workspace_bytes(tokens, top_k, num_experts) + 3) // 4
        workspace = T.empty((max(words, 1),), _ext.DType.INT32, like=topk_ids)
    args = (topk_ids, int(num_experts), int(align), x, permuted_x, expert_offsets, permuted_token, inverse,
            workspace)
    if _ops.use_torch_op(topk_ids):
        _ops.torch_ops().moe_permute(*args, _ops.stream_arg(stream))
    else:
        _ext.moe_permute(*args, T.resolve_stream(stream, topk_ids))
    return MoePermutation(expert_offsets, permuted_token, inverse, permuted_x)


_ACTIVATIONS = {None: 0, "none": 0, "swiglu": 1}


@T.stream_scope("a", 0)
def moe_grouped_gemm(a: Any, weights: Any, expert_offsets: Any, *, activation: Optional[str] = None,
                     out: Optional[Any] = None, a_rows: Optional[Any] = None, stream: Optional[Any] = None) -> Any:
    """Grouped GEMM: for every expert e, rows [expert_offsets[e], expert_offsets[e + 1]) of
    a [rows, K] times weights[e] [N, K] transposed -> out [rows, N].

    activation 'swiglu': out [rows, N / 2] = silu(gate) * up, the gate being the first N / 2 rows
    of each expert's weights and up the rest (vLLM's w13 layout). bf16 / fp16, fp32 accumulation;
    the offsets are read on the device (CUDA-graph safe); rows outside every segment are not
    written.

    a_rows (optional int32 [rows], 1-D, contiguous, device memory): gathered rows. Product row r
    then reads a[a_rows[r]], a being [tokens, K] with any number of rows (the tokens themselves),
    so moe_permute's permuted_token can feed the GEMM without the permuted copy of x; rows =
    a_rows.shape[0] = out.shape[0], and an entry outside [0, a.shape[0]) (moe_permute's -1 on
    padding rows) reads a row of zeros. Like the offsets it is read on the device.

    out is allocated when not given, with the rows of a (of a_rows when given). Raises
    tessera.Error for invalid arguments.
    """
    entry = "moe_grouped_gemm"
    if activation not in _ACTIVATIONS:
        T.fail(entry, "activation", "must be None, 'none' or 'swiglu', got %r" % (activation,))
    act = _ACTIVATIONS[activation]
    if out is None:
        rows = T.shape(a_rows, entry, "a_rows")[0] if a_rows is not None else T.shape(a, entry, "a")[0]
        n = T.shape(weights, entry, "weights")[1]
        out = T.empty_like(a, entry, "a", cols=n // 2 if act == 1 else n, rows=rows)
    args = (a, weights, expert_offsets, act, out, a_rows)
    if _ops.use_torch_op(a):
        _ops.torch_ops().moe_grouped_gemm(*args, _ops.stream_arg(stream))
    else:
        _ext.moe_grouped_gemm(*args, T.resolve_stream(stream, a))
    return out


@T.stream_scope("expert_out", 0)
def moe_combine(expert_out: Any, inverse: Any, topk_weights: Any, *, shared_out: Optional[Any] = None,
                out: Optional[Any] = None, stream: Optional[Any] = None) -> Any:
    """out[t] = sum_k topk_weights[t, k] * expert_out[inverse[t, k]] (+ shared_out[t]), fp32 sums
    in k order; copies with inverse -1 are skipped. out [tokens, hidden] is allocated when not
    given. Raises tessera.Error for invalid arguments."""
    entry = "moe_combine"
    if out is None:
        tokens = T.shape(inverse, entry, "inverse")[0]
        out = T.empty_like(expert_out, entry, "expert_out", rows=tokens)
    args = (expert_out, inverse, topk_weights, shared_out, out)
    if _ops.use_torch_op(expert_out):
        _ops.torch_ops().moe_combine(*args, _ops.stream_arg(stream))
    else:
        _ext.moe_combine(*args, T.resolve_stream(stream, expert_out))
    return out


def fused_moe_workspace_bytes(tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                              shared_inter: int = 0) -> int:
    """Bytes of device workspace fused_moe needs."""
    if _ops.is_compiling():
        return _fused_moe_workspace_bytes_py(tokens, hidden, inter, num_experts, top_k, shared_inter)
    return _ext.fused_moe_workspace_bytes(tokens, hidden, inter, num_experts, top_k, shared_inter)


@T.stream_scope("x", 0)
def fused_moe(x: Any, w1: Any, w2: Any, router_logits: Optional[Any] = None, *, top_k: int,
              topk_ids: Optional[Any] = None, topk_weights: Optional[Any] = None, score: str = "softmax",
              renormalize: bool = False, selection_bias: Optional[Any] = None, num_groups: int = 1,
              topk_groups: int = 1, routed_scaling: float = 1.0, shared_w1: Optional[Any] = None,
              shared_w2: Optional[Any] = None, out: Optional[Any] = None, workspace: Optional[Any] = None,
              stream: Optional[Any] = None) -> Any:
    """The whole MoE layer: x [tokens, hidden] -> out [tokens, hidden].

    w1 [num_experts, 2 * inter, hidden] (gate rows, then up rows), w2 [num_experts, hidden, inter].
    Routing from router_logits [tokens, num_experts] (moe_route's options; topk_ids / topk_weights,
    when given, receive it) or, without logits, from the given topk_ids / topk_weights. Shared
    experts: shared_w1 [2 * shared_inter, hidden] and shared_w2 [hidden, shared_inter], a dense
    SwiGLU MLP over every token added to the result. The workspace (a 1-D device buffer of
    fused_moe_workspace_bytes(...) bytes, 16-byte aligned) is allocated when not given.
    Raises tessera.Error for invalid arguments.
    """
    entry = "fused_moe"
    if score not in _SCORES:
        T.fail(entry, "score", "must be 'softmax' or 'sigmoid', got %r" % (score,))
    tokens, hidden = T.shape(x, entry, "x")[:2]
    num_experts, two_inter = T.shape(w1, entry, "w1")[:2]
    shared_inter = T.shape(shared_w1, entry, "shared_w1")[0] // 2 if shared_w1 is not None else 0
    if out is None:
        out = T.empty_like(x, entry, "x")
    if workspace is None:
        nbytes = fused_moe_workspace_bytes(tokens, hidden, two_inter // 2, num_experts, top_k, shared_inter)
        workspace = T.empty((max((nbytes + 3) // 4, 1),), _ext.DType.INT32, like=x)
    args = (x, w1, w2, router_logits, int(top_k), _SCORES[score], bool(renormalize), int(num_groups),
            int(topk_groups), float(routed_scaling), selection_bias, topk_ids, topk_weights, shared_w1, shared_w2,
            out, workspace)
    if _ops.use_torch_op(x):
        _ops.torch_ops().fused_moe(*args, _ops.stream_arg(stream))
    else:
        _ext.fused_moe(*args, T.resolve_stream(stream, x))
    return out
