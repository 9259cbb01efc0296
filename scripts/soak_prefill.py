#!/usr/bin/env python3
"""Soak of chunked prefill under CUDA graphs: thousands of randomized serving steps through
append_paged_kv + BatchPrefillPaged (cuda_graph) plan / graph replay of run() on fixed buffers, the
batch's composition changing every step (prefill chunks of 1-512 new tokens beside decode-like
requests of one), checked against a PyTorch reference at sampled steps, with the device and host
memory tracked. Bounded in time; writes OUT/soak_prefill.json and exits non-zero on any error,
mismatch or memory growth.

    python3 scripts/soak_prefill.py OUT [--seconds 300] [--check-every 20]     # needs a GPU + torch

Each step: some requests finish (their pages go back to the pool), new ones arrive with an empty
cache and a prompt to prefill, every active request appends its new tokens (the next prompt chunk,
or one decoded token) with tessera.append_paged_kv, then plan() on the host (num_pages given: the
page ids are checked there, as a replay checks nothing) and a replay of the one captured run().
The reference gathers a request's keys from its pages and runs causal softmax attention in fp32
for its new rows (bottom-right aligned).
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
MAX_BATCH, MAX_ROWS, NUM_PAGES = 32, 2048, 8192


def reference(q, k_pages, v_pages, pages, kv_len):
    """fp32 causal attention of the request's last q.shape[0] positions ([n, HQ, D]) over its keys."""
    k = k_pages[pages].reshape(-1, HKV, D)[:kv_len].float()
    v = v_pages[pages].reshape(-1, HKV, D)[:kv_len].float()
    group = HQ // HKV
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, HQ, D]
    n = q.shape[0]
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) / D ** 0.5
    rows = torch.arange(n, device=q.device)[:, None] + (kv_len - n)
    s = s.masked_fill(torch.arange(kv_len, device=q.device)[None, :] > rows, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--check-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)

    cache = torch.randn((NUM_PAGES, 2, PAGE, HKV, D), device="cuda", dtype=torch.bfloat16)
    k_pages, v_pages = cache[:, 0], cache[:, 1]
    free = list(range(NUM_PAGES))
    requests = []  # dicts: pages (list), kv_len, prompt_left (tokens still to prefill)

    cfg = tessera.PagedPrefillConfig(num_qo_heads=HQ, head_dim=D, page_size=PAGE, max_q_rows=MAX_ROWS, causal=True,
                                     cuda_graph=True, max_batch_size=MAX_BATCH)
    prefill = tessera.BatchPrefillPaged(cfg)
    q_buf = torch.zeros((MAX_ROWS, HQ, D), device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q_buf)
    ids_buf = torch.zeros(NUM_PAGES, dtype=torch.int32, device="cuda")
    ids_host = np.zeros(NUM_PAGES, np.int32)
    graph = None

    step, checks, max_err, errors, split_steps = 0, 0, 0.0, [], 0
    memory = MemoryTrack(warmup=100)
    start = time.time()
    while time.time() - start < args.seconds:
        step += 1
        for r in [r for r in requests if rng.random() < 0.04 and r["prompt_left"] == 0]:
            free.extend(r["pages"])
            requests.remove(r)
        while len(requests) < MAX_BATCH and (not requests or rng.random() < 0.3):
            prompt = int(rng.choice([rng.integers(1, 300), rng.integers(300, 4000), rng.integers(4000, 16000)],
                                    p=[0.5, 0.4, 0.1]))
            requests.append({"pages": [], "kv_len": 0, "prompt_left": prompt})
        # This step's new tokens: the next chunk of a prompt (at most 512) or one decoded token,
        # within MAX_ROWS for the step; requests that do not fit wait (0 new tokens).
        budget, new = MAX_ROWS, []
        for r in requests:
            n = min(r["prompt_left"], int(rng.integers(1, 513))) if r["prompt_left"] else 1
            n = min(n, budget)
            budget -= n
            new.append(n)
        # Pages for the new tokens; when the pool runs short the longest request is preempted.
        need = lambda: sum((r["kv_len"] + n + PAGE - 1) // PAGE - len(r["pages"]) for r, n in zip(requests, new))
        while requests and need() > len(free):
            i = max(range(len(requests)), key=lambda j: requests[j]["kv_len"])
            free.extend(requests[i]["pages"])
            del requests[i], new[i]
        if not requests or sum(new) == 0:
            continue
        for r, n in zip(requests, new):
            while len(r["pages"]) * PAGE < r["kv_len"] + n:
                r["pages"].append(free.pop())
            r["kv_len"] += n
            r["prompt_left"] = max(0, r["prompt_left"] - n)
        batch = len(requests)
        pages_per = [len(r["pages"]) for r in requests]
        indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
        ids = np.concatenate([r["pages"] for r in requests]).astype(np.int32) if indptr[-1] else np.zeros(0, np.int32)
        last = np.array([r["kv_len"] - (len(r["pages"]) - 1) * PAGE if r["pages"] else 0 for r in requests], np.int32)
        qo = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
        rows = int(qo[-1])
        try:
            k_new = torch.randn((rows, HKV, D), device="cuda", dtype=torch.bfloat16)
            v_new = torch.randn_like(k_new)
            tessera.append_paged_kv(cache, None, indptr, ids, last, qo, k_new, v_new)
            q_buf[:rows].copy_(torch.randn((rows, HQ, D), device="cuda", dtype=torch.bfloat16))
            ids_host[:] = 0
            ids_host[:len(ids)] = ids
            ids_buf.copy_(torch.from_numpy(ids_host))
            plan = prefill.plan(qo, indptr, ids, last, num_pages=NUM_PAGES)
            split_steps += plan.kv_splits > 1
            if graph is None:  # capture once, on this step's arguments over the fixed buffers
                dev = [torch.from_numpy(a).cuda() for a in (qo, indptr, last)]
                run = lambda: prefill.run(q_buf, dev[0], cache, None, dev[1], ids_buf, dev[2], host_qo_indptr=qo,
                                          host_kv_indptr=indptr, host_kv_indices=ids_host, host_kv_last_page_len=last,
                                          causal=True, out=out)
                run()  # warm-up outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
            graph.replay()
            if step % args.check_every == 0:
                torch.cuda.synchronize()
                for i in rng.choice(batch, size=min(batch, 3), replace=False):
                    r, i = requests[int(i)], int(i)
                    if new[i] == 0:
                        continue
                    want = reference(q_buf[qo[i]:qo[i + 1]], k_pages, v_pages,
                                     torch.tensor(r["pages"], device="cuda"), r["kv_len"])
                    err = (out[qo[i]:qo[i + 1]].float() - want).abs().max().item()
                    max_err = max(max_err, err)
                    if not err <= 2e-2:
                        errors.append("step %d request %d (%d new over %d keys): max error %.4g" %
                                      (step, i, new[i], r["kv_len"], err))
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
    result = {"steps": step, "checks": checks, "split_steps": split_steps, "max_err": max_err, "errors": errors,
              "seconds": time.time() - start, "memory": mem_summary,
              "gpu": torch.cuda.get_device_name(), "tessera": tessera.__version__}
    with open(os.path.join(args.out, "soak_prefill.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
