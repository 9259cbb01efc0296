"""Causal prefill of a ragged batch with tessera, checked against PyTorch's SDPA.

    python examples/prefill_vs_sdpa.py        # needs a CUDA GPU and PyTorch

Three requests of different lengths are packed into one [total_tokens, heads, head_dim] tensor
(FlashAttention's varlen layout) with an int32 indptr; SDPA runs them one by one.
"""
import sys

import torch
import torch.nn.functional as F

import tessera

if not torch.cuda.is_available():
    sys.exit("prefill_vs_sdpa: needs a CUDA GPU")

lengths = [128, 77, 300]
num_heads, head_dim = 8, 128
indptr = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)  # host: no sync
total = int(indptr[-1])
q, k, v = (torch.randn(total, num_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))

out = tessera.batch_prefill(q, k, v, indptr, indptr, causal=True)

worst = 0.0
for i, n in enumerate(lengths):
    rows = slice(int(indptr[i]), int(indptr[i + 1]))
    ref = F.scaled_dot_product_attention(*(x[rows].transpose(0, 1) for x in (q, k, v)), is_causal=True)
    worst = max(worst, (out[rows].float() - ref.transpose(0, 1).float()).abs().max().item())
print("tessera vs SDPA, %d requests (%s tokens): max |diff| = %.3g" % (len(lengths), total, worst))
assert worst < 3e-2, "tessera and SDPA disagree"
print("ok")
