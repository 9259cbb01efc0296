#!/usr/bin/env python3
"""Soak: thousands of randomized serving steps through append + BatchDecoder plan / run (CUDA-graph
replay of run() on fixed buffers), checked against a PyTorch reference at sampled steps, with the
device and host memory tracked. Bounded in time; writes OUT/soak.json and exits non-zero on any
error, mismatch or memory growth.

    python3 scripts/soak_decode.py OUT [--seconds 300] [--check-every 25]     # needs a GPU + torch

Each step: some requests finish (their pages go back to the pool), new ones arrive with a prompt
already in the cache, every active request appends one token (tessera.append_paged_kv into its
pages, a new page when the last one is full), then plan() on the host and a graph replay of run().
The reference gathers each request's keys from the pages and runs softmax attention in fp32.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

import tessera

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak_memory import MemoryTrack  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
MAX_BATCH, NUM_PAGES = 64, 8192


def reference(q, k_pages, v_pages, pages, kv_len):
    """fp32 attention of one query row [HQ, D] over the request's keys (its pages, in order)."""
    k = k_pages[pages].reshape(-1, HKV, D)[:kv_len].float()
    v = v_pages[pages].reshape(-1, HKV, D)[:kv_len].float()
    group = HQ // HKV
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, HQ, D]
    s = torch.einsum("hd,lhd->hl", q.float(), k) / D ** 0.5
    return torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--check-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)

    cache = torch.randn((NUM_PAGES, 2, PAGE, HKV, D), device="cuda", dtype=torch.bfloat16)
    k_pages, v_pages = cache[:, 0], cache[:, 1]
    free = list(range(NUM_PAGES))
    requests = []  # dicts: pages (list), kv_len

    cfg = tessera.DecodeConfig(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE, dtype="bf16",
                               max_batch_size=MAX_BATCH, max_qo_len=1)
    dec = tessera.BatchDecoder(cfg, kv_indices_capacity=NUM_PAGES)
    q_buf = torch.zeros((MAX_BATCH, HQ, D), device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q_buf)
    graph = None

    def admit():
        prompt = int(rng.choice([rng.integers(1, 300), rng.integers(300, 4000), rng.integers(4000, 20000)],
                                p=[0.6, 0.35, 0.05]))
        need = (prompt + PAGE - 1) // PAGE + 1
        if len(free) < need + 8:
            return
        pages = [free.pop() for _ in range((prompt + PAGE - 1) // PAGE)]
        requests.append({"pages": pages, "kv_len": prompt})

    step, checks, max_err, errors = 0, 0, 0.0, []
    memory = MemoryTrack(warmup=200)
    start = time.time()
    while time.time() - start < args.seconds:
        step += 1
        # Finish some, admit some (batch size drifts between 1 and MAX_BATCH).
        for r in [r for r in requests if rng.random() < 0.03]:
            free.extend(r["pages"])
            requests.remove(r)
        while len(requests) < MAX_BATCH and (not requests or rng.random() < 0.3):
            before = len(requests)
            admit()
            if len(requests) == before:
                break
        if not requests:
            continue
        # Append one token to every request (a new page when its last one is full); when the
        # pool runs short, the longest requests are preempted (their pages freed) first.
        while requests and len(free) < len(requests):
            longest = max(requests, key=lambda r: r["kv_len"])
            free.extend(longest["pages"])
            requests.remove(longest)
        if not requests:
            continue
        for r in requests:
            if r["kv_len"] % PAGE == 0:
                r["pages"].append(free.pop())
            r["kv_len"] += 1
        batch = len(requests)
        pages_per = [len(r["pages"]) for r in requests]
        indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
        ids = np.concatenate([r["pages"] for r in requests]).astype(np.int32)
        last = np.array([r["kv_len"] - (len(r["pages"]) - 1) * PAGE for r in requests], np.int32)
        k_new = torch.randn((batch, HKV, D), device="cuda", dtype=torch.bfloat16)
        v_new = torch.randn_like(k_new)
        append = np.arange(batch + 1, dtype=np.int32)
        try:
            tessera.append_paged_kv(cache, None, indptr, ids, last, append, k_new, v_new)
            qo = np.arange(batch + 1, dtype=np.int32)
            q_buf[:batch].copy_(torch.randn((batch, HQ, D), device="cuda", dtype=torch.bfloat16))
            dec.plan(qo, indptr, ids, last, num_pages=NUM_PAGES)
            if graph is None:
                dec.run(q_buf, cache, out=out)  # warm-up outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    dec.run(q_buf, cache, out=out)
            graph.replay()
            if step % args.check_every == 0:
                torch.cuda.synchronize()
                for i in rng.choice(batch, size=min(batch, 4), replace=False):
                    r = requests[int(i)]
                    want = reference(q_buf[int(i)], k_pages, v_pages, torch.tensor(r["pages"], device="cuda"),
                                     r["kv_len"])
                    err = (out[int(i)].float() - want).abs().max().item()
                    max_err = max(max_err, err)
                    if not err <= 2e-2:
                        errors.append("step %d request %d (kv_len %d): max error %.4g" % (step, int(i), r["kv_len"], err))
                checks += 1
        except Exception as e:  # any error ends the soak, recorded
            errors.append("step %d: %s: %s" % (step, type(e).__name__, e))
            break
        if memory.due(step):  # this step's inputs and reference released first
            k_new = v_new = want = None
            memory.sample()
        if len(errors) > 10:
            break
    mem_errors, mem_summary = memory.verdict()
    errors.extend(mem_errors)
    result = {"steps": step, "checks": checks, "max_err": max_err, "errors": errors, "seconds": time.time() - start,
              "memory": mem_summary, "gpu": torch.cuda.get_device_name(),
              "tessera": tessera.__version__}
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
