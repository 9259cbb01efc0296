"""A Mixture-of-Experts layer with tessera.fused_moe, checked against the same layer in PyTorch ops.

    python examples/moe_layer.py        # needs a CUDA GPU and PyTorch

A Mixtral-like layer scaled down (8 experts, top-2, SwiGLU experts): router logits -> softmax
top-k (renormalised) -> every token's two experts -> weighted sum. tessera runs it as one call
(route, permute, grouped GEMM + SwiGLU, grouped GEMM, combine); the reference loops over the
experts in fp32.
"""
import sys

import torch
import torch.nn.functional as F

import tessera

if not torch.cuda.is_available():
    sys.exit("moe_layer: needs a CUDA GPU")

torch.manual_seed(0)
tokens, hidden, inter, experts, top_k = 200, 256, 512, 8, 2
x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
w1 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5  # gate; up
w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter ** 0.5
router_logits = torch.randn(tokens, experts, device="cuda", dtype=torch.float32)

out = tessera.fused_moe(x, w1, w2, router_logits, top_k=top_k, renormalize=True)

# The same layer from PyTorch ops, in fp32.
weights, ids = torch.softmax(router_logits, dim=-1).topk(top_k, dim=-1)
weights = weights / weights.sum(dim=-1, keepdim=True)
ref = torch.zeros(tokens, hidden, device="cuda")
for e in range(experts):
    token, slot = (ids == e).nonzero(as_tuple=True)
    if token.numel() == 0:
        continue
    h = x[token].float() @ w1[e].float().T
    act = F.silu(h[:, :inter]) * h[:, inter:]
    ref.index_add_(0, token, weights[token, slot, None] * (act @ w2[e].float().T))

worst = (out.float() - ref).abs().max().item()
scale = ref.abs().max().item()
print("fused_moe against the PyTorch layer: max error %.4f (outputs up to %.2f)" % (worst, scale))
assert worst <= 0.02 * max(scale, 1.0), worst
print("ok")
