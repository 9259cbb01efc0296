"""A decode loop over a paged KV cache: append each step's K/V, plan once per step, run per layer,
with the layers' run() calls captured once into a CUDA graph and replayed every step.

    python examples/decode_cuda_graph.py      # needs a CUDA GPU and PyTorch

The graph contract (see tessera.BatchDecoder): plan() runs outside the graph before each replay
(with num_pages), and the tensors the captured run() reads keep their addresses: fixed q / output
buffers, the cache, and host page ids (the decoder copies them into its own fixed buffer).
"""
import sys

import torch

import tessera

if not torch.cuda.is_available():
    sys.exit("decode_cuda_graph: needs a CUDA GPU")

layers, batch, page_size, num_pages = 4, 3, 16, 64
qo_heads, kv_heads, head_dim = 32, 8, 128
config = tessera.DecodeConfig(num_qo_heads=qo_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                              page_size=page_size, dtype="bf16", max_batch_size=batch)
decoder = tessera.BatchDecoder(config, kv_indices_capacity=num_pages)
# One combined [num_pages, 2, page_size, kv_heads, head_dim] cache per layer (vLLM's layout).
caches = [torch.zeros(num_pages, 2, page_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
          for _ in range(layers)]
q = torch.randn(layers, batch, qo_heads, head_dim, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(q)

# Each request owns pages [16 * i, 16 * i + 16); it starts with `lengths[i]` tokens.
lengths = [5, 40, 100]
pages_of = [list(range(16 * i, 16 * i + 16)) for i in range(batch)]


def page_table(lengths):
    indptr, indices, last = [0], [], []
    for i, n in enumerate(lengths):
        pages = (n + page_size - 1) // page_size
        indices += pages_of[i][:pages]
        indptr.append(len(indices))
        last.append(n - (pages - 1) * page_size)
    return indptr, indices, last


def step(lengths):
    """Appends one token per request to every layer's cache and plans the step."""
    indptr, indices, last = page_table(lengths)
    for cache in caches:
        k_new, v_new = (torch.randn(batch, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        tessera.append_paged_kv(cache, None, indptr, indices, last, list(range(batch + 1)), k_new, v_new)
    decoder.plan(list(range(batch + 1)), indptr, indices, last, num_pages=num_pages)


def run_layers():
    for layer in range(layers):
        decoder.run(q[layer], caches[layer], out=out[layer])


lengths = [n + 1 for n in lengths]
step(lengths)
run_layers()  # eager warm-up
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    run_layers()

for _ in range(5):
    lengths = [n + 1 for n in lengths]
    step(lengths)
    graph.replay()
    replayed = out.clone()
    run_layers()  # the same step eagerly: the replay must agree
    assert torch.allclose(replayed.float(), out.float(), atol=1e-2), "graph replay differs from eager run()"
torch.cuda.synchronize()
print("decoded 5 steps x %d layers from one CUDA graph; kv lengths now %s" % (layers, lengths))
print("ok")
