"""tessera's entry points as PyTorch custom ops (torch.library), for torch.compile and tracing.

Registered when torch is importable (tessera works without it). The wrappers call the extension
directly for plain torch tensors in eager mode (the fastest path), and these ops under
torch.compile (fullgraph: no graph break) and for tensor subclasses (FakeTensor and friends, e.g.
torch.export). Every op writes its outputs in place (mutates_args) and returns nothing, so its
fake (meta) implementation has nothing to compute; the wrappers allocate outputs with torch.empty,
which traces. An op resolves the stream when it runs: stream -1 is PyTorch's current stream then
(the capture stream inside a CUDA graph), any other value a cudaStream_t.
"""
# No `from __future__ import annotations` here: torch.library reads the op signatures' annotations
# as types.
from typing import Any, Optional

from . import _tensors as T
from . import _tessera as _ext

_registered = False
_is_compiling = None  # torch.compiler.is_compiling, looked up once



def is_compiling() -> bool:
    """Whether torch.compile is tracing the caller (False without torch)."""
    return _registered and _is_compiling()


def use_torch_op(x: Any) -> bool:
    """Whether a call on tensor x goes through torch.ops.tessera rather than straight to C++."""
    if not _registered:
        return False
    torch = T.torch_module()
    if type(x) is torch.Tensor:  # the common eager case, decided without a call
        return _is_compiling()
    return isinstance(x, torch.Tensor)


def torch_ops() -> Any:
    return T.torch_module().ops.tessera


def stream_arg(stream: Optional[Any]) -> int:
    return -1 if stream is None else T.stream_handle(stream)


def _stream(stream: int, like: Any) -> int:
    return T.resolve_stream(None, like) if stream < 0 else stream


def register() -> bool:
    """Defines the tessera::* ops once; False when torch is missing or too old for custom_op."""
    global _registered, _is_compiling
    if _registered:
        return True
    torch = T.torch_module()
    if torch is None:
        return False
    if not hasattr(torch.library, "custom_op"):
        return False
    from torch import Tensor
    _is_compiling = torch.compiler.is_compiling

    def no_output(*args: Any, **kwargs: Any) -> None:
        return None

    @torch.library.custom_op("tessera::batch_prefill", mutates_args=("o", "lse"))
    def batch_prefill(q: Tensor, k: Tensor, v: Tensor, qo_indptr: Tensor, kv_indptr: Tensor,
                      host_qo_indptr: Tensor, host_kv_indptr: Tensor, o: Tensor, lse: Optional[Tensor],
                      causal: bool, window_left: int, scale: float, soft_cap: float, path: int,
                      stream: int) -> None:
        _ext.batch_prefill(q, k, v, qo_indptr, kv_indptr, host_qo_indptr, host_kv_indptr, o, lse, causal,
                           window_left, scale, soft_cap, _ext.AttentionPath(path), _stream(stream, q))

    @torch.library.custom_op("tessera::batch_prefill_paged", mutates_args=("o", "lse"))
    def batch_prefill_paged(q: Tensor, qo_indptr: Tensor, host_qo_indptr: Tensor, k_pages: Tensor,
                            v_pages: Optional[Tensor], layout: str, kv_indptr: Tensor, kv_indices: Tensor,
                            kv_last_page_len: Tensor, host_kv_indptr: Tensor, host_kv_indices: Tensor,
                            host_kv_last_page_len: Tensor, o: Tensor, lse: Optional[Tensor], causal: bool,
                            window_left: int, scale: float, soft_cap: float, path: int, stream: int) -> None:
        _ext.batch_prefill_paged(q, qo_indptr, host_qo_indptr, k_pages, v_pages, layout, kv_indptr,
                                 kv_indices, kv_last_page_len, host_kv_indptr, host_kv_indices,
                                 host_kv_last_page_len, o, lse, causal, window_left, scale, soft_cap,
                                 _ext.AttentionPath(path), _stream(stream, q))

    @torch.library.custom_op("tessera::append_paged_kv", mutates_args=("k_pages", "v_pages"))
    def append_paged_kv(k_pages: Tensor, v_pages: Optional[Tensor], layout: str, kv_indptr: Tensor,
                        kv_indices: Tensor, kv_last_page_len: Tensor, host_kv_indptr: Tensor,
                        host_kv_indices: Tensor, host_kv_last_page_len: Tensor, append_indptr: Tensor,
                        host_append_indptr: Tensor, k_new: Tensor, v_new: Tensor, stream: int) -> None:
        _ext.append_paged_kv(k_pages, v_pages, layout, kv_indptr, kv_indices, kv_last_page_len,
                             host_kv_indptr, host_kv_indices, host_kv_last_page_len, append_indptr,
                             host_append_indptr, k_new, v_new, _stream(stream, k_new))

    @torch.library.custom_op("tessera::merge_state", mutates_args=("o_out", "s_out"))
    def merge_state(o_a: Tensor, s_a: Tensor, o_b: Tensor, s_b: Tensor, o_out: Tensor,
                    s_out: Optional[Tensor], stream: int) -> None:
        _ext.merge_state(o_a, s_a, o_b, s_b, o_out, s_out, _stream(stream, o_a))

    @torch.library.custom_op("tessera::merge_state_in_place", mutates_args=("o", "s"))
    def merge_state_in_place(o: Tensor, s: Tensor, o_other: Tensor, s_other: Tensor, stream: int) -> None:
        _ext.merge_state_in_place(o, s, o_other, s_other, _stream(stream, o))

    @torch.library.custom_op("tessera::merge_states", mutates_args=("o_out", "s_out"))
    def merge_states(o_parts: Tensor, s_parts: Tensor, o_out: Tensor, s_out: Optional[Tensor],
                     stream: int) -> None:
        _ext.merge_states(o_parts, s_parts, o_out, s_out, _stream(stream, o_parts))

    @torch.library.custom_op("tessera::moe_route", mutates_args=("topk_ids", "topk_weights"))
    def moe_route(logits: Tensor, selection_bias: Optional[Tensor], top_k: int, score: int, renormalize: bool,
                  num_groups: int, topk_groups: int, routed_scaling: float, topk_ids: Tensor,
                  topk_weights: Tensor, stream: int) -> None:
        _ext.moe_route(logits, selection_bias, top_k, score, renormalize, num_groups, topk_groups,
                       routed_scaling, topk_ids, topk_weights, _stream(stream, logits))

    @torch.library.custom_op("tessera::moe_permute",
                             mutates_args=("permuted_x", "expert_offsets", "permuted_token", "inverse", "workspace"))
    def moe_permute(topk_ids: Tensor, num_experts: int, align: int, x: Optional[Tensor],
                    permuted_x: Optional[Tensor], expert_offsets: Tensor, permuted_token: Tensor, inverse: Tensor,
                    workspace: Tensor, stream: int) -> None:
        _ext.moe_permute(topk_ids, num_experts, align, x, permuted_x, expert_offsets, permuted_token, inverse,
                         workspace, _stream(stream, topk_ids))

    @torch.library.custom_op("tessera::moe_grouped_gemm", mutates_args=("out",))
    def moe_grouped_gemm(a: Tensor, weights: Tensor, expert_offsets: Tensor, activation: int, out: Tensor,
                         a_rows: Optional[Tensor], stream: int) -> None:
        _ext.moe_grouped_gemm(a, weights, expert_offsets, activation, out, a_rows, _stream(stream, a))

    @torch.library.custom_op("tessera::moe_combine", mutates_args=("out",))
    def moe_combine(expert_out: Tensor, inverse: Tensor, topk_weights: Tensor, shared_out: Optional[Tensor],
                    out: Tensor, stream: int) -> None:
        _ext.moe_combine(expert_out, inverse, topk_weights, shared_out, out, _stream(stream, expert_out))

    @torch.library.custom_op("tessera::fused_moe", mutates_args=("topk_ids", "topk_weights", "out", "workspace"))
    def fused_moe(x: Tensor, w1: Tensor, w2: Tensor, router_logits: Optional[Tensor], top_k: int, score: int,
                  renormalize: bool, num_groups: int, topk_groups: int, routed_scaling: float,
                  selection_bias: Optional[Tensor], topk_ids: Optional[Tensor], topk_weights: Optional[Tensor],
                  shared_w1: Optional[Tensor], shared_w2: Optional[Tensor], out: Tensor, workspace: Tensor,
                  stream: int) -> None:
        _ext.fused_moe(x, w1, w2, router_logits, top_k, score, renormalize, num_groups, topk_groups,
                       routed_scaling, selection_bias, topk_ids, topk_weights, shared_w1, shared_w2, out,
                       workspace, _stream(stream, x))

    @torch.library.custom_op("tessera::decode_run", mutates_args=("o", "lse"))
    def decode_run(decoder: int, q: Tensor, k_pages: Tensor, v_pages: Optional[Tensor], o: Tensor,
                   lse: Optional[Tensor], stream: int) -> None:
        from .decode import _DECODERS
        d = _DECODERS.get(decoder)
        if d is None:
            raise T.Error("tessera::BatchDecoder::run: argument 'decoder': no live decoder has handle %d" % decoder)
        d._run(q, k_pages, v_pages, o, lse, _stream(stream, q))

    for op in (batch_prefill, batch_prefill_paged, append_paged_kv, merge_state, merge_state_in_place,
               merge_states, moe_route, moe_permute, moe_grouped_gemm, moe_combine, fused_moe, decode_run):
        op.register_fake(no_output)
    _registered = True
    return True
