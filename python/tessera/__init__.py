"""tessera: exact GPU kernels for LLM inference (attention prefill / decode over ragged and paged KV
caches, plan / run decode, KV append, attention-state merges, MoE routing and permutation), from
Python.

Tensors come in through DLPack (PyTorch, JAX, CuPy, ...) without copies, strides kept, and run on
the caller's stream (PyTorch's current stream for torch tensors). With torch installed the entry
points are also torch.library custom ops (torch.ops.tessera.*), usable under torch.compile and in
CUDA graphs. Invalid arguments raise tessera.Error (a ValueError) with the C++ library's message,
naming the entry point, the argument and the rule; nothing is written then.
"""
from __future__ import annotations

from . import _tessera
from ._tessera import (AttentionPath, DecodeConfig, DecodePlanInfo, DeviceBuffer, DeviceInfo, DType,
                       Error, KernelPath, KVLayout, PagedPrefillConfig, PagedPrefillPlanInfo, device_count,
                       device_info, paged_prefill_workspace_bytes)
from .attention import BatchPrefillPaged, batch_prefill, batch_prefill_paged
from .decode import BatchDecoder
from .kv_cache import append_paged_kv
from .merge import merge_state, merge_state_in_place, merge_states
from .moe import (MoePermutation, fused_moe, fused_moe_workspace_bytes, moe_combine, moe_grouped_gemm, moe_permute,
                  moe_permute_capacity, moe_route)

__version__: str = _tessera.__version__


def info(device: int = -1) -> str:
    """What `tessera info` prints: the version, the GPU, its memory hierarchy and the kernel path
    (or that there is no GPU). `python -m tessera info` prints it."""
    return _tessera.info_text(device)


def _register_torch_ops() -> bool:
    from . import _ops
    return _ops.register()


# torch is optional: without it the package works on DLPack tensors of any framework.
# (tessera imports torch where it is installed, to register the ops.)
torch_ops_registered: bool = _register_torch_ops()

__all__ = [
    "AttentionPath", "BatchDecoder", "BatchPrefillPaged", "PagedPrefillConfig", "PagedPrefillPlanInfo",
    "paged_prefill_workspace_bytes", "DType", "DecodeConfig", "DecodePlanInfo", "DeviceBuffer",
    "DeviceInfo", "Error", "KVLayout", "KernelPath", "__version__", "append_paged_kv",
    "batch_prefill", "batch_prefill_paged", "device_count", "device_info", "info", "merge_state",
    "merge_state_in_place", "merge_states", "MoePermutation", "fused_moe", "fused_moe_workspace_bytes", "moe_combine",
    "moe_grouped_gemm", "moe_permute", "moe_permute_capacity",
    "moe_route", "torch_ops_registered",
]
