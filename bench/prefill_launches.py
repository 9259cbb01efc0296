#!/usr/bin/env python3
"""Twelve launches of one bf16 ragged prefill, through tessera's Python package or FlashInfer's
FA3 ragged prefill, on the same shapes: the workload scripts/profile_prefill.sh hands to ncu
(which profiles the eleventh launch of each).

  python3 bench/prefill_launches.py tessera|flashinfer SEQ CAUSAL(0|1) [BATCH [HEADS [HEAD_DIM]]]

BATCH defaults to 16384 / SEQ (16K tokens), HEADS to 16, HEAD_DIM to 128; random N(0, 1) inputs.
"""
import sys

import torch


def main():
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
