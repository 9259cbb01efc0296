"""The package against the GPU kernels: results against the fp64 reference under the tolerance
rule and against torch SDPA, paged == ragged, append, merges, the decoder's plan / run, CUDA-graph
capture and replay, torch.compile(fullgraph=True), DLPack round trips with CuPy / JAX, and the
Python call overhead. Every test skips with a reason without a GPU and torch."""
import os

import numpy as np
import pytest

import tessera
from conftest import HAVE_TORCH_GPU, REPO, requires_gpu, run_python
import reference as ref

pytestmark = requires_gpu

if HAVE_TORCH_GPU:
    import torch

TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}


def rand(shape, dtype="bf16", seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * scale).to(getattr(torch, TORCH_DTYPE.get(dtype, dtype)))


def host(t):
    return t.detach().double().cpu().numpy()


def compiled_or_skip(fn):
    try:
        return fn()
    except tessera.Error as e:
        if "not compiled" in str(e) or "compiled head dims" in str(e):
            pytest.skip(str(e))
        raise


def lengths_to_indptr(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# ---- prefill ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("variant", [dict(), dict(causal=True), dict(causal=True, window_left=20),
                                     dict(soft_cap=20.0, scale=0.05)])
def test_prefill_matches_fp64_reference(dtype, head_dim, hq, hkv, variant):
    qo_lens, kv_lens = [1, 7, 54, 0], [97, 7, 100, 5]
    qo, kv = lengths_to_indptr(qo_lens), lengths_to_indptr(kv_lens)
    q, k, v = rand((qo[-1], hq, head_dim), dtype, 1), rand((kv[-1], hkv, head_dim), dtype, 2), rand((kv[-1], hkv, head_dim), dtype, 3)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((qo[-1], hq), float("nan"), device="cuda")
    compiled_or_skip(lambda: tessera.batch_prefill(q, k, v, qo, kv, out=out, lse=lse, **variant))
    torch.cuda.synchronize()
    o_ref, lse_ref = ref.attention(host(q), host(k), host(v), qo, kv, **variant)
    o_naive, _ = ref.attention(host(q), host(k), host(v), qo, kv, lowp=dtype, **variant)
    ref.check_rule(host(out), o_ref, ref.max_err(o_naive, o_ref), 1e-4, "o")
    ref.check_rule(host(lse), lse_ref, 0.0, 2e-4, "lse")


def test_prefill_against_sdpa_and_allocated_outputs():
    b, s, hq, d = 3, 200, 8, 128
    q, k, v = rand((b * s, hq, d), seed=4), rand((b * s, hq, d), seed=5), rand((b * s, hq, d), seed=6)
    indptr = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)  # host (CPU) indptr
    o, lse = tessera.batch_prefill(q, k, v, indptr, indptr, causal=True, return_lse=True)
    assert o.dtype == q.dtype and o.is_cuda and lse.dtype == torch.float32 and lse.shape == (b * s, hq)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.view(b, s, hq, d).transpose(1, 2), k.view(b, s, hq, d).transpose(1, 2),
        v.view(b, s, hq, d).transpose(1, 2), is_causal=True).transpose(1, 2).reshape(b * s, hq, d)
    idx = indptr.numpy()
    o_ref, _ = ref.attention(host(q), host(k), host(v), idx, idx, causal=True)
    o_naive, _ = ref.attention(host(q), host(k), host(v), idx, idx, causal=True, lowp="bf16")
    naive = ref.max_err(o_naive, o_ref)
    ref.check_rule(host(o), o_ref, naive, 1e-4, "o")
    sdpa_err = ref.max_err(host(sdpa), o_ref)
    assert ref.max_err(host(o), host(sdpa)) <= 2 * naive + sdpa_err + 1e-4


def test_prefill_packed_qkv_slices_equal_contiguous_inputs():
    t, hq, hkv, d = 300, 8, 2, 128
    qkv = rand((t, hq + 2 * hkv, d), seed=7)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    indptr = np.array([0, 100, 300], np.int32)
    strided = tessera.batch_prefill(q, k, v, indptr, indptr, causal=True)
    dense = tessera.batch_prefill(q.contiguous(), k.contiguous(), v.contiguous(), indptr, indptr, causal=True)
    assert torch.equal(strided, dense)


def test_prefill_device_index_arrays_and_explicit_stream():
    q, k, v = rand((10, 4, 128), seed=8), rand((20, 4, 128), seed=9), rand((20, 4, 128), seed=10)
    qo, kv = np.array([0, 4, 10], np.int32), np.array([0, 9, 20], np.int32)
    stream = torch.cuda.Stream()
    with_host = tessera.batch_prefill(q, k, v, qo, kv)
    dev = tessera.batch_prefill(q, k, v, torch.from_numpy(qo).cuda(), torch.from_numpy(kv).cuda())
    given = tessera.batch_prefill(q, k, v, torch.from_numpy(qo).cuda(), torch.from_numpy(kv).cuda(),
                                  host_qo_indptr=qo, host_kv_indptr=kv)
    stream.wait_stream(torch.cuda.current_stream())
    on_stream = tessera.batch_prefill(q, k, v, qo, kv, stream=stream)
    stream.synchronize()
    assert torch.equal(with_host, dev) and torch.equal(with_host, given) and torch.equal(with_host, on_stream)


def make_paged(k, v, kv_lens, page_size, layout, combined, seed=11):
    """Scatters ragged K/V rows into randomly numbered pages. Returns the cache tensors and the
    host page table."""
    rng = np.random.default_rng(seed)
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    num_pages = sum(pages) + 3
    ids = rng.permutation(num_pages)[:sum(pages)].astype(np.int32)
    hkv, d = k.shape[1], k.shape[2]
    shape = (num_pages, page_size, hkv, d) if layout == "NHD" else (num_pages, hkv, page_size, d)
    kv_cache = rand((num_pages, 2) + shape[1:], seed=seed)
    k_pages, v_pages = kv_cache[:, 0], kv_cache[:, 1]
    row, at = 0, 0
    for n, p in zip(kv_lens, pages):
        for t in range(n):
            page, slot = ids[at + t // page_size], t % page_size
            if layout == "NHD":
                k_pages[page, slot], v_pages[page, slot] = k[row + t], v[row + t]
            else:
                k_pages[page, :, slot], v_pages[page, :, slot] = k[row + t], v[row + t]
        row, at = row + n, at + p
    last = np.array([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], np.int32)
    indptr = lengths_to_indptr(pages)
    cache = (kv_cache, None) if combined else (k_pages, v_pages)
    return cache, indptr, ids, last, num_pages


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_prefill_equals_ragged(layout, combined, page_size):
    qo_lens, kv_lens = [3, 1, 20], [40, 1, 33]
    qo, kv = lengths_to_indptr(qo_lens), lengths_to_indptr(kv_lens)
    q, k, v = rand((qo[-1], 8, 128), seed=12), rand((kv[-1], 2, 128), seed=13), rand((kv[-1], 2, 128), seed=14)
    (kp, vp), indptr, ids, last, _ = make_paged(k, v, kv_lens, page_size, layout, combined)
    paged = tessera.batch_prefill_paged(q, qo, kp, vp, indptr, ids, last, layout=layout, causal=True)
    o_ref, _ = ref.attention(host(q), host(k), host(v), qo, kv, causal=True)
    o_naive, _ = ref.attention(host(q), host(k), host(v), qo, kv, causal=True, lowp="bf16")
    ref.check_rule(host(paged), o_ref, ref.max_err(o_naive, o_ref), 1e-4, "o")


def test_append_paged_kv_writes_the_new_rows_and_nothing_else():
    page_size, hkv, d = 4, 2, 128
    kv_lens_after, new = [6, 9], [2, 5]
    pages = [(n + page_size - 1) // page_size for n in kv_lens_after]
    num_pages = sum(pages) + 2
    kv_cache = rand((num_pages, 2, page_size, hkv, d), seed=14)
    expected = kv_cache.clone()
    ids = np.array([4, 0, 2, 1, 5], np.int32)
    last = np.array([n - (p - 1) * page_size for n, p in zip(kv_lens_after, pages)], np.int32)
    k_new, v_new = rand((sum(new), hkv, d), seed=15), rand((sum(new), hkv, d), seed=16)
    row, at = 0, 0
    for n_after, n_new, p in zip(kv_lens_after, new, pages):
        for j in range(n_new):
            pos = n_after - n_new + j
            page, slot = ids[at + pos // page_size], pos % page_size
            expected[page, 0, slot], expected[page, 1, slot] = k_new[row + j], v_new[row + j]
        row, at = row + n_new, at + p
    tessera.append_paged_kv(kv_cache, None, lengths_to_indptr(pages), ids, last, lengths_to_indptr(new), k_new, v_new)
    assert torch.equal(kv_cache, expected)


def test_merge_state_and_merge_states_match_fp64():
    rows, heads, d = 33, 4, 128
    o_a, o_b = rand((rows, heads, d), "float32", 17), rand((rows, heads, d), "float32", 18)
    s_a, s_b = rand((rows, heads), "float32", 19, 3.0), rand((rows, heads), "float32", 20, 3.0)
    s_b[0] = float("-inf")
    o, s = tessera.merge_state(o_a, s_a, o_b, s_b, out_dtype="bf16")
    o_ref, s_ref = ref.merge(host(o_a), host(s_a), host(o_b), host(s_b))
    assert o.dtype == torch.bfloat16
    assert ref.max_err(host(o), o_ref) <= 2 * ref.max_err(ref.round_mantissa(o_ref, 7), o_ref) + 1e-6
    assert ref.max_err(host(s), s_ref) <= 1e-5
    parts, s_parts = torch.stack([o_a, o_b], dim=1), torch.stack([s_a, s_b], dim=1)
    o_n, s_n = tessera.merge_states(parts, s_parts)
    assert ref.max_err(host(o_n), o_ref) <= 1e-5 and ref.max_err(host(s_n), s_ref) <= 1e-5
    o_ip, s_ip = o_a.clone(), s_a.clone()
    tessera.merge_state_in_place(o_ip, s_ip, o_b, s_b)
    assert ref.max_err(host(o_ip), o_ref) <= 1e-5


# ---- decode -------------------------------------------------------------------------------------------

def decode_problem(kv_lens, qo_lens, page_size=16, hq=32, hkv=8, d=128, seed=21, layout="NHD"):
    kv = lengths_to_indptr(kv_lens)
    k, v = rand((kv[-1], hkv, d), seed=seed), rand((kv[-1], hkv, d), seed=seed + 1)
    (kv_cache, _), indptr, ids, last, num_pages = make_paged(k, v, kv_lens, page_size, layout, True, seed)
    qo = lengths_to_indptr(qo_lens)
    q = rand((qo[-1], hq, d), seed=seed + 2)
    o_ref, lse_ref = ref.attention(host(q), host(k), host(v), qo, kv, causal=True)
    o_naive, _ = ref.attention(host(q), host(k), host(v), qo, kv, causal=True, lowp="bf16")
    return dict(q=q, kv_cache=kv_cache, qo=qo, indptr=indptr, ids=ids, last=last, num_pages=num_pages,
                o_ref=o_ref, lse_ref=lse_ref, naive=ref.max_err(o_naive, o_ref))


def decoder_for(max_batch=8, max_qo_len=4, page_size=16, kv_indices_capacity=0):
    cfg = tessera.DecodeConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=page_size,
                               dtype="bf16", max_batch_size=max_batch, max_qo_len=max_qo_len)
    return tessera.BatchDecoder(cfg, kv_indices_capacity=kv_indices_capacity)


@pytest.mark.parametrize("qo_lens", [[1, 1, 1, 1], [1, 3, 4, 2]])
def test_decoder_plan_run_matches_reference(qo_lens):
    p = decode_problem([1, 37, 300, 2000], qo_lens)
    dec = decoder_for()
    dec.plan(p["qo"], p["indptr"], p["ids"], p["last"], num_pages=p["num_pages"])
    o, lse = dec.run(p["q"], p["kv_cache"], return_lse=True)
    ref.check_rule(host(o), p["o_ref"], p["naive"], 1e-4, "o")
    ref.check_rule(host(lse), p["lse_ref"], 0.0, 2e-4, "lse")
    assert dec.last_plan.num_work_items >= 1


def test_decoder_cuda_graph_replays_later_steps():
    max_batch, rows = 4, 4
    dec = decoder_for(max_batch=max_batch, max_qo_len=1, kv_indices_capacity=512)
    steps = [decode_problem([5, 100, 40, 1], [1] * 4, seed=30), decode_problem([300, 17, 1000, 64], [1] * 4, seed=40),
             decode_problem([2, 2], [1, 1], seed=50)]
    num_pages = max(s["num_pages"] for s in steps)
    q_buf = torch.zeros((rows, 32, 128), dtype=torch.bfloat16, device="cuda")
    cache_buf = torch.zeros((num_pages, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    out = torch.zeros_like(q_buf)

    def load(step):
        q_buf[:step["q"].shape[0]].copy_(step["q"])
        cache_buf[:step["kv_cache"].shape[0]].copy_(step["kv_cache"])
        dec.plan(step["qo"], step["indptr"], step["ids"], step["last"], num_pages=num_pages)

    load(steps[0])
    dec.run(q_buf, cache_buf, out=out)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.run(q_buf, cache_buf, out=out)
    for step in steps:
        load(step)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = step["q"].shape[0]
        ref.check_rule(host(out[:n]), step["o_ref"], step["naive"], 1e-4, "o")
    with pytest.raises(tessera.Error, match="num_pages"):
        dec.plan(steps[0]["qo"], steps[0]["indptr"], steps[0]["ids"], steps[0]["last"])


def test_batch_prefill_paged_cuda_graph_replays_later_steps():
    """One run() captured in a CUDA graph, replayed for later steps (split and unsplit), each copied
    into the captured buffers; rows past a step stay as they were."""
    steps = [decode_problem([700, 300, 2000], [64, 1, 1], hq=8, hkv=2, seed=60),
             decode_problem([6000], [128], hq=8, hkv=2, seed=61),
             decode_problem([40, 1000], [40, 3], hq=8, hkv=2, seed=62),
             decode_problem([30, 20], [30, 20], hq=8, hkv=2, seed=63)]
    max_rows, ids_cap = 256, 1024
    num_pages = max(s["num_pages"] for s in steps)
    cfg = tessera.PagedPrefillConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, max_q_rows=max_rows,
                                     causal=True, cuda_graph=True, max_batch_size=4)
    prefill = tessera.BatchPrefillPaged(cfg)
    q_buf = torch.zeros((max_rows, 8, 128), dtype=torch.bfloat16, device="cuda")
    out = torch.zeros_like(q_buf)
    cache_buf = torch.zeros((num_pages, 2, 16, 2, 128), dtype=torch.bfloat16, device="cuda")
    ids_buf = torch.zeros(ids_cap, dtype=torch.int32, device="cuda")

    def load(step):
        q_buf[:step["q"].shape[0]].copy_(step["q"])
        cache_buf[:step["kv_cache"].shape[0]].copy_(step["kv_cache"])
        ids_buf[:len(step["ids"])].copy_(torch.from_numpy(step["ids"]))
        return prefill.plan(step["qo"], step["indptr"], step["ids"], step["last"], num_pages=num_pages)

    def run(step, device_arrays):  # the step's arguments over the captured buffers
        ids_host = np.zeros(ids_cap, np.int32)
        ids_host[:len(step["ids"])] = step["ids"]
        qo, indptr, last = device_arrays
        prefill.run(q_buf, qo, cache_buf, None, indptr, ids_buf, last, host_qo_indptr=step["qo"],
                    host_kv_indptr=step["indptr"], host_kv_indices=ids_host, host_kv_last_page_len=step["last"],
                    causal=True, out=out)

    first = steps[0]
    arrays = tuple(torch.from_numpy(np.asarray(first[name], np.int32)).cuda() for name in ("qo", "indptr", "last"))
    load(first)
    run(first, arrays)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(first, arrays)
    splits = set()
    for step in steps + [first]:
        splits.add(load(step).kv_splits > 1)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = step["q"].shape[0]
        ref.check_rule(host(out[:n]), step["o_ref"], step["naive"], 1e-4, "o")
        assert torch.isnan(out[n:]).all(), "rows past the step were written"
    assert True in splits, "no step was split: the merge's replay went untested"
    with pytest.raises(tessera.Error, match="num_pages"):
        prefill.plan(first["qo"], first["indptr"], first["ids"], first["last"])


# ---- MoE -----------------------------------------------------------------------------------------------

def moe_torch_reference(x, w1, w2, ids, weights):
    """The layer in fp64 from torch ops: every (token, k) copy through its expert's SwiGLU MLP."""
    xd, w1d, w2d = x.double(), w1.double(), w2.double()
    inter = w1.shape[1] // 2
    out = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = xd[t] @ w1d[e].T
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, j]) * (act @ w2d[e].T)
    return out


@pytest.mark.parametrize("activation", [None, "swiglu"])
@pytest.mark.parametrize("rows_per_expert", [3, 40, 300])
def test_moe_grouped_gemm_matches_torch(activation, rows_per_expert):
    experts, k, n = 6, 136, 272
    counts = [rows_per_expert * (e % 3) for e in range(experts)]  # some experts empty
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32, device="cuda")
    rows = int(offsets[-1]) + 5  # rows past the last segment stay as they were
    a = rand((rows, k), seed=90)
    w = rand((experts, n, k), seed=91, scale=0.1)
    out_cols = n // 2 if activation else n
    out = torch.full((rows, out_cols), 7.0, dtype=torch.bfloat16, device="cuda")
    tessera.moe_grouped_gemm(a, w, offsets, activation=activation, out=out)
    torch.cuda.synchronize()
    expect = torch.full((rows, out_cols), 7.0, dtype=torch.float64, device="cuda")
    for e in range(experts):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        h = a[lo:hi].double() @ w[e].double().T
        expect[lo:hi] = torch.nn.functional.silu(h[:, :n // 2]) * h[:, n // 2:] if activation else h
    err = (out.double() - expect).abs().max().item()
    assert err <= 0.02 * max(1.0, expect.abs().max().item()), err


def gathered_rows_problem(tokens, experts=6, k=136, n=272, per_expert=17, seed=110):
    """x [tokens, k], weights, offsets with some experts empty and 5 rows past the last segment,
    and a_rows [rows]: a random token per row, some entries -1, tokens and 2^31 - 1 (zero rows)."""
    counts = [per_expert * (e % 3) for e in range(experts)]
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32, device="cuda")
    rows = int(offsets[-1]) + 5
    x = rand((tokens, k), seed=seed)
    w = rand((experts, n, k), seed=seed + 1, scale=0.1)
    g = torch.Generator().manual_seed(seed + 2)
    a_rows = torch.randint(0, tokens, (rows,), generator=g, dtype=torch.int32)
    a_rows[::7] = -1
    a_rows[3::11] = tokens
    a_rows[5::13] = 2**31 - 1
    return x, w, offsets, a_rows.cuda()


def explicit_gather(x, a_rows):
    """x[a_rows], with a row of zeros where an entry is outside x's rows."""
    valid = (a_rows >= 0) & (a_rows < x.shape[0])
    picked = x[a_rows.clamp(0, x.shape[0] - 1).long()]
    return torch.where(valid[:, None], picked, torch.zeros((), dtype=x.dtype, device=x.device)).contiguous(), valid


@pytest.mark.parametrize("activation", [None, "swiglu"])
@pytest.mark.parametrize("tokens", [80, 120])
def test_moe_grouped_gemm_gathered_rows_equal_the_explicit_gather(activation, tokens):
    # tokens 80 (fewer than the 107 rows) and 120 (more); either way x's rows per expert select
    # the same tile shape as the product rows', so the two calls must agree bit for bit.
    n = 272
    x, w, offsets, a_rows = gathered_rows_problem(tokens, n=n)
    rows, seg = a_rows.shape[0], int(offsets[-1])
    gathered, valid = explicit_gather(x, a_rows)
    out_cols = n // 2 if activation else n
    out = torch.full((rows, out_cols), 7.0, dtype=x.dtype, device="cuda")
    want = torch.full_like(out, 7.0)
    assert tessera.moe_grouped_gemm(x, w, offsets, activation=activation, out=out, a_rows=a_rows) is out
    tessera.moe_grouped_gemm(gathered, w, offsets, activation=activation, out=want)
    torch.cuda.synchronize()
    assert torch.equal(out, want), (out.double() - want.double()).abs().max().item()
    assert (out[seg:] == 7.0).all(), "rows past the last segment were written"
    assert (out[:seg][~valid[:seg]] == 0).all(), "rows with an entry outside x are not 0"
    # Against fp64 torch on the gathered rows (as test_moe_grouped_gemm_matches_torch).
    expect = torch.full((rows, out_cols), 7.0, dtype=torch.float64, device="cuda")
    for e in range(w.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        h = gathered[lo:hi].double() @ w[e].double().T
        expect[lo:hi] = torch.nn.functional.silu(h[:, :n // 2]) * h[:, n // 2:] if activation else h
    err = (out.double() - expect).abs().max().item()
    assert err <= 0.02 * max(1.0, expect.abs().max().item()), err
    # out allocated: a_rows' rows, x's dtype.
    alloc = tessera.moe_grouped_gemm(x, w, offsets, activation=activation, a_rows=a_rows)
    torch.cuda.synchronize()
    assert alloc.shape == (rows, out_cols) and alloc.dtype == x.dtype and alloc.is_cuda
    assert torch.equal(alloc[:seg], want[:seg])


def test_moe_grouped_gemm_gathered_rows_from_moe_permute_and_under_torch_compile():
    tokens, top_k, experts, k, n = 40, 2, 8, 64, 128
    x = rand((tokens, k), seed=120)
    w = rand((experts, n, k), seed=121, scale=0.1)
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(122),
                        dtype=torch.int32).cuda()
    perm = tessera.moe_permute(ids, experts, align=16, x=x)  # padding rows: permuted_token -1
    seg = int(perm.expert_offsets[-1])
    assert (perm.permuted_token[:seg] < 0).any()
    want = tessera.moe_grouped_gemm(perm.permuted_x, w, perm.expert_offsets)
    got = tessera.moe_grouped_gemm(x, w, perm.expert_offsets, a_rows=perm.permuted_token)
    torch.cuda.synchronize()
    assert got.shape == want.shape == (perm.permuted_token.shape[0], n)
    assert torch.equal(got[:seg], want[:seg])

    # The torch op (Optional a_rows) under torch.compile(fullgraph=True).
    def up(x, a_rows):
        return tessera.moe_grouped_gemm(x, w, perm.expert_offsets, activation="swiglu", a_rows=a_rows)[:seg] * 2

    eager = up(x, perm.permuted_token)
    compiled = torch.compile(up, fullgraph=True)(x, perm.permuted_token)
    assert torch.equal(eager, compiled)
    expect = tessera.moe_grouped_gemm(perm.permuted_x, w, perm.expert_offsets, activation="swiglu")[:seg] * 2
    assert torch.equal(eager, expect)


def test_fused_moe_matches_torch_and_replays_in_a_graph():
    tokens, hidden, inter, experts, top_k = 24, 128, 64, 8, 2
    x = rand((tokens, hidden), seed=92)
    w1 = rand((experts, 2 * inter, hidden), seed=93, scale=0.1)
    w2 = rand((experts, hidden, inter), seed=94, scale=0.1)
    logits = rand((tokens, experts), "float32", seed=95)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device="cuda")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device="cuda")
    out = tessera.fused_moe(x, w1, w2, logits, top_k=top_k, renormalize=True, topk_ids=ids, topk_weights=weights)
    torch.cuda.synchronize()
    probs = torch.softmax(logits.double(), dim=-1)
    top_w, top_i = probs.topk(top_k, dim=-1)
    assert torch.equal(top_i.int(), ids)
    expect = moe_torch_reference(x, w1, w2, ids, weights)
    err = (out.double() - expect).abs().max().item()
    assert err <= 0.02 * max(1.0, expect.abs().max().item()), err
    # The same call captured in a CUDA graph, replayed on new x, equals eager.
    ws = torch.empty((tessera.fused_moe_workspace_bytes(tokens, hidden, inter, experts, top_k) + 3) // 4,
                     dtype=torch.int32, device="cuda")
    graph_out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tessera.fused_moe(x, w1, w2, logits, top_k=top_k, renormalize=True, out=graph_out, workspace=ws)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            tessera.fused_moe(x, w1, w2, logits, top_k=top_k, renormalize=True, out=graph_out, workspace=ws)
    x.copy_(rand((tokens, hidden), seed=96))
    graph.replay()
    torch.cuda.synchronize()
    eager = tessera.fused_moe(x, w1, w2, logits, top_k=top_k, renormalize=True)
    torch.cuda.synchronize()
    assert torch.equal(graph_out, eager)


def test_fused_moe_under_torch_compile():
    tokens, hidden, inter, experts, top_k = 8, 64, 32, 4, 2
    x = rand((tokens, hidden), seed=97)
    w1 = rand((experts, 2 * inter, hidden), seed=98, scale=0.1)
    w2 = rand((experts, hidden, inter), seed=99, scale=0.1)
    logits = rand((tokens, experts), "float32", seed=100)

    def layer(x, logits):
        return tessera.fused_moe(x, w1, w2, logits, top_k=top_k) + 1

    eager = layer(x, logits)
    compiled = torch.compile(layer, fullgraph=True)(x, logits)
    assert torch.equal(eager, compiled)
    # Dynamic shapes: the workspace is sized from a symbolic token count.
    dynamic = torch.compile(layer, fullgraph=True, dynamic=True)
    for n in (5, 8, 13):
        assert torch.equal(layer(x[:n], logits[:n]), dynamic(x[:n], logits[:n]))


def test_torch_compile_fullgraph_no_graph_break():
    p = decode_problem([50, 200], [1, 1], seed=60)
    dec = decoder_for(max_batch=2, max_qo_len=1)
    dec.plan(p["qo"], p["indptr"], p["ids"], p["last"], num_pages=p["num_pages"])
    q, k, v = rand((64, 8, 128), seed=61), rand((64, 2, 128), seed=62), rand((64, 2, 128), seed=63)
    qo = torch.tensor([0, 30, 64], dtype=torch.int32)

    def block(q, k, v, qo, q_dec, kv_cache):
        o = tessera.batch_prefill(q, k, v, qo, qo, causal=True)
        d = dec.run(q_dec, kv_cache)
        return o * 2, d + 1

    eager = block(q, k, v, qo, p["q"], p["kv_cache"])
    compiled = torch.compile(block, fullgraph=True)(q, k, v, qo, p["q"], p["kv_cache"])
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_stream_argument_under_torch_compile():
    # Written after measuring that `with torch.cuda.stream(s)` traces under fullgraph and that
    # stream=s did not (Dynamo: "Unsupported hasattr call"); the wrapper's fix is not yet run here.
    q, k, v = rand((64, 8, 128), seed=80), rand((64, 2, 128), seed=81), rand((64, 2, 128), seed=82)
    qo = torch.tensor([0, 30, 64], dtype=torch.int32)
    want = tessera.batch_prefill(q, k, v, qo, qo, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def block(q, k, v, qo):
        return tessera.batch_prefill(q, k, v, qo, qo, causal=True, stream=side)

    got = torch.compile(block, fullgraph=True)(q, k, v, qo)
    side.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_torch_library_opcheck():
    q, k, v = rand((16, 4, 128), seed=70), rand((16, 4, 128), seed=71), rand((16, 4, 128), seed=72)
    qo = torch.tensor([0, 16], dtype=torch.int32)
    args = (q, k, v, qo.cuda(), qo.cuda(), qo, qo, torch.empty_like(q), None, True, -1, 0.0, 0.0, 0, -1)
    torch.library.opcheck(torch.ops.tessera.batch_prefill.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_dlpack_fast_path_equals_generic_path():
    x = rand((6, 8, 128), seed=73)[:, 2:6]
    from tessera import _tessera
    assert _tessera.view_description(x) == _tessera.view_description(torch.utils.dlpack.to_dlpack(x))


def test_tessera_arrays_export_through_dlpack_more_than_once():
    """The arrays tessera allocates for non-torch inputs carry __dlpack__ / __dlpack_device__ (not
    a bare capsule, which the first consumer uses up): a call may write one as `out`, and any
    framework may then import it, as often as it likes."""
    from tessera import _tessera
    o = _tessera.empty([8, 2, 64], tessera.DType.FP32, 0)
    assert hasattr(o, "__dlpack__") and tuple(o.__dlpack_device__()) == (2, 0)
    o_a, o_b = rand((8, 2, 64), "float32", 80), rand((8, 2, 64), "float32", 81)
    s_a, s_b = rand((8, 2), "float32", 82), rand((8, 2), "float32", 83)
    out = tessera.merge_state(o_a, s_a, o_b, s_b, out=o)[0]
    assert out is o
    first, second = torch.from_dlpack(o), torch.from_dlpack(o)
    assert first.data_ptr() == second.data_ptr() and tuple(first.shape) == (8, 2, 64)
    tessera.merge_state(o_a, s_a, o_b, s_b, out=o)  # written again through a second import
    torch.cuda.synchronize()
    o_ref, _ = ref.merge(host(o_a), host(s_a), host(o_b), host(s_b))
    assert ref.max_err(host(second), o_ref) <= 1e-5


def test_cupy_round_trip():
    cupy = pytest.importorskip("cupy")
    o_a, o_b = cupy.random.standard_normal((8, 2, 64), dtype=cupy.float32), cupy.random.standard_normal((8, 2, 64), dtype=cupy.float32)
    s_a, s_b = cupy.random.standard_normal((8, 2), dtype=cupy.float32), cupy.random.standard_normal((8, 2), dtype=cupy.float32)
    o, s = tessera.merge_state(o_a, s_a, o_b, s_b, stream=cupy.cuda.get_current_stream())
    o, s = cupy.from_dlpack(o), cupy.from_dlpack(s)
    o_ref, s_ref = ref.merge(*(cupy.asnumpy(x).astype(np.float64) for x in (o_a, s_a, o_b, s_b)))
    assert ref.max_err(cupy.asnumpy(o), o_ref) <= 1e-5 and ref.max_err(cupy.asnumpy(s), s_ref) <= 1e-5


def test_jax_round_trip():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU device here")
    import jax.numpy as jnp
    key = jax.random.PRNGKey(0)
    o_a, o_b = jax.random.normal(key, (8, 2, 64), jnp.float32), jax.random.normal(jax.random.PRNGKey(1), (8, 2, 64), jnp.float32)
    s_a, s_b = jax.random.normal(jax.random.PRNGKey(2), (8, 2), jnp.float32), jax.random.normal(jax.random.PRNGKey(3), (8, 2), jnp.float32)
    for x in (o_a, o_b, s_a, s_b):
        x.block_until_ready()
    o, s = tessera.merge_state(o_a, s_a, o_b, s_b)
    tessera._tessera.stream_synchronize(0)
    o_ref, s_ref = ref.merge(*(np.asarray(x, np.float64) for x in (o_a, s_a, o_b, s_b)))
    assert ref.max_err(np.asarray(jnp.from_dlpack(o)), o_ref) <= 1e-5


def test_python_overhead_of_decoder_run_is_under_10us():
    """Host time per run() through Python against the C++ call, both timed while a spin kernel
    holds the GPU (the launches queue up instead of waiting for the GPU): see
    bench/python_overhead.py, which this test runs."""
    r = run_python([os.path.join(REPO, "bench", "python_overhead.py"), "--repeats", "5"])
    assert r.returncode == 0, r.stdout + r.stderr
