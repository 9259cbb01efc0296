#!/usr/bin/env python3
"""Twelve launches of one bf16 prefill, through tessera's Python package or FlashInfer's FA3
prefill, on the same shapes: the workload scripts/profile_prefill.sh hands to ncu (which profiles
the eleventh launch of each).

  python3 bench/prefill_launches.py tessera|flashinfer SEQ CAUSAL(0|1) [BATCH [HEADS [HEAD_DIM]]]
  python3 bench/prefill_launches.py tessera_paged|flashinfer_paged QO_LEN KV_LEN BATCH

Ragged: BATCH defaults to 16384 / SEQ (16K tokens), HEADS to 16, HEAD_DIM to 128. Paged (chunked
prefill, the prefill_plan suite's shape): BATCH requests of QO_LEN queries that are the last
positions of KV_LEN keys (bottom-right causal), 32 query / 8 KV heads, hd128, pages of 16 tokens in
a shuffled order (NHD). Random N(0, 1) inputs.
"""
import sys

import torch


def paged(lib, qo_len, kv_len, batch):
    """Returns the paged case's call (see the module docstring)."""
    hq, hk, d, page = 32, 8, 128, 16
    pages_per = (kv_len + page - 1) // page
    gen = torch.Generator().manual_seed(7)
    ids = torch.randperm(batch * pages_per, generator=gen).to(torch.int32)
    k_pages, v_pages = (torch.randn(batch * pages_per, page, hk, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    q = torch.randn(batch * qo_len, hq, d, device="cuda", dtype=torch.bfloat16)
    qo_indptr = torch.arange(0, (batch + 1) * qo_len, qo_len, dtype=torch.int32)
    kv_indptr = torch.arange(0, (batch + 1) * pages_per, pages_per, dtype=torch.int32)
    last = torch.full((batch,), kv_len - (pages_per - 1) * page, dtype=torch.int32)
    dev = [x.cuda() for x in (qo_indptr, kv_indptr, ids, last)]
    out = torch.empty_like(q)
    if lib == "tessera_paged":
        import tessera

        def call():
            tessera.batch_prefill_paged(q, dev[0], k_pages, v_pages, dev[1], dev[2], dev[3], host_qo_indptr=qo_indptr,
                                        host_kv_indptr=kv_indptr, host_kv_indices=ids, host_kv_last_page_len=last,
                                        causal=True, out=out)
        return call
    import flashinfer
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
    wrapper.plan(dev[0], dev[1], dev[2], dev[3], hq, hk, d, page, causal=True, q_data_type=torch.bfloat16)

    def call():
        wrapper.run(q, (k_pages, v_pages), out=out)
    return call


def main():
    if sys.argv[1] in ("tessera_paged", "flashinfer_paged"):
        call = paged(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        for _ in range(12):
            call()
        torch.cuda.synchronize()
        return
    lib, seq, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    batch = int(sys.argv[4]) if len(sys.argv) > 4 else max(1, 16384 // seq)
    heads = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    head_dim = int(sys.argv[6]) if len(sys.argv) > 6 else 128
    shape = (batch * seq, heads, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    indptr = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
    dev_indptr = indptr.cuda()
    if lib == "tessera":
        import tessera
        out = torch.empty_like(q)

        def call():
            tessera.batch_prefill(q, k, v, dev_indptr, dev_indptr, host_qo_indptr=indptr, host_kv_indptr=indptr,
                                  causal=causal, out=out)
    elif lib == "flashinfer":
        import flashinfer
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
        wrapper.plan(dev_indptr, dev_indptr, heads, heads, head_dim, causal=causal, q_data_type=torch.bfloat16)

        def call():
            wrapper.run(q, k, v)
    else:
        sys.exit("the library is tessera or flashinfer, got %r" % lib)
    for _ in range(12):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
