#!/usr/bin/env python3
"""Time PyTorch peers (cuDNN / FlashAttention-2 / FlexAttention SDPA, torch._grouped_mm, plain torch
ops), FlashInfer's batch prefill and paged decode where it is installed, and ceilings (copy, read,
dense GEMM) on the cases in bench/cases/*.json, and write them in the results format shared with
tessera's C++ benchmark (see docs/CONVENTIONS.md):

  {"commit", "gpu", "date", "records": [{"suite", "case", "metric", "tessera", "peers", "ceiling",
                                         "params", "notes"}]}

Usage:
  python3 bench/peers.py --cases bench/cases --out RESULTS.json [--merge-into EXISTING.json]
                         [--suites prefill,decode] [--commit SHA] [--no-flex] [--no-flashinfer]
  python3 bench/peers.py --cases bench/cases --dry-run      # CPU only, does not import torch
  python3 bench/peers.py --cases bench/cases --out RESULTS.json --tessera-python
        # also times tessera itself through the Python package (import tessera), in this process,
        # with the same timers: a results file from one Python process (record["tessera"], with
        # notes["tessera"] saying so; merged into C++ results it becomes peer "tessera_python")

Timing: CUDA events around every call, after warm-up; the median of at least 20 calls (more while
they fit in --time-per-peer seconds). Calls are enqueued in batches behind a GPU spin kernel
(torch.cuda._sleep), so the events time GPU work even where torch's host overhead per call is
longer than the kernel (small decode/append cases). Inputs are random (never zeros) and, when one
input set is smaller than ROTATE_BYTES, several sets are rotated so that the L2 (60 MB on H200)
does not hold them. Every peer runs inside try/except: a peer that fails records null and an error
string in notes["<peer>_error"], and the others still run.

FlashInfer (prefill suites, decode; peer "flashinfer") is optional: where `import flashinfer`
fails, the peer records null with the reason, and --no-flashinfer skips it. Its version, the
prebuilt kernel modules it found (flashinfer/data/aot/) and the time of each module's first plan (a
module load, or a JIT build) go to peers_env["flashinfer"].

Units: ceilings "gemm*" are TFLOP/s, "copy*" and "read*" are TB/s (read + write both counted for
copy). Peers use the metric of their suite.
"""
import argparse
import datetime
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time

torch = None  # imported in main(), so that --dry-run runs on machines without torch
F = None

L2_BYTES = 60e6
ROTATE_BYTES = 128 * 2**20   # rotate input sets until the working set is at least this (> 2x L2)
MAX_SETS = 256
CEILING_BUFFER_BYTES = 4 * 2**30
GEMM_CEILING_SIZE = 8192

DTYPE_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


# ----------------------------------------------------------------------------------------------
# Case description: pure Python, shared by --dry-run and the real run.
# ----------------------------------------------------------------------------------------------

SUITES = {
    # required params, peers, ceilings measured once per run and attached to every record
    "prefill": dict(params=["batch", "seq", "num_qo_heads", "num_kv_heads", "head_dim", "causal"],
                    peers=["cudnn", "torch_flash", "flex", "flashinfer"], ceilings=["gemm"]),
    "prefill_portable": dict(params=["batch", "seq", "num_qo_heads", "num_kv_heads", "head_dim", "causal"],
                             peers=["cudnn", "torch_flash", "flex", "flashinfer"], ceilings=["gemm"]),
    # Paged K/V; the SDPA peers read the same tokens from contiguous K/V (they have no paged
    # prefill), flashinfer reads them from its own paged cache (same page size, layout, page order).
    "prefill_paged": dict(params=["batch", "seq", "num_qo_heads", "num_kv_heads", "head_dim", "causal"],
                          peers=["cudnn", "torch_flash", "flashinfer"], ceilings=["gemm"]),
    # Chunked prefill: qo_len new queries, the last positions of kv_len keys in a paged cache
    # (uniform qo_len / kv_len, or lengths="list" with qo_lens / kv_lens); causal (default true)
    # is bottom-right aligned.
    "prefill_plan": dict(params=["batch", "num_qo_heads", "num_kv_heads", "head_dim", "page_size"],
                         peers=["cudnn", "torch_flash", "flashinfer"], ceilings=["gemm"]),
    # kv_len is the length (uniform) or the mean (zipf); lengths="list" gives kv_lens instead.
    "decode": dict(params=["batch", "num_qo_heads", "num_kv_heads", "head_dim", "page_size"],
                   peers=["cudnn", "cudnn_stream", "torch_flash", "flashinfer"], ceilings=["read", "copy"]),
    # The grouped GEMM alone on a routed layout (rows = tokens * top_k; routing balanced or seeded
    # random, moe_routing); "gemm" is a per-case ceiling: one dense torch.mm of the same FLOPs
    # [rows, K] x [K, N]. SwiGLU cases also time grouped_mm + silu * up (torch_grouped_mm_swiglu).
    "moe_gemm": dict(params=["experts", "tokens", "K", "N"],
                     peers=["torch_grouped_mm", "torch_grouped_mm_swiglu", "cublas_loop"], ceilings=["read"]),
    # The whole MoE layer from router logits (moe_router_logits) to the combined output.
    "moe_layer": dict(params=["experts", "top_k", "tokens", "hidden", "inter"],
                      peers=["torch_moe_layer"], ceilings=["read"]),
    "append": dict(params=["batch", "append_len", "num_kv_heads", "head_dim", "page_size", "layout"],
                   peers=["torch_index"], ceilings=["copy"]),
    "merge": dict(params=["rows", "heads", "head_dim", "n"],
                  peers=["torch_ops"], ceilings=["copy", "read"]),
}


# Per-request KV lengths of a decode case: all kv_len, (lengths="zipf") a skewed batch whose mean
# is kv_len, or (lengths="list") the case's own kv_lens. The zipf generator is the one of
# bench/bench_main.cpp (zipf_lengths there), bit for bit: splitmix64 and a Fisher-Yates shuffle on
# 64-bit integers, and double arithmetic with plain left-to-right sums (not sum(), which
# compensates since Python 3.12) and no fused multiply-add. Both sides report the total as
# "kv_tokens"; merge_into() flags a mismatch.

M64 = 0xFFFFFFFFFFFFFFFF


def splitmix64_next(state):
    """Returns (new state, output): splitmix64 (Steele, Lea & Flood 2014)."""
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def zipf_lengths(batch, mean, s, seed):
    """w[r] = (r + 1) ** -s for rank r; cap = 16 * mean; the smallest k with w[k] * scale_k <= cap,
    scale_k = (mean * batch - k * cap) / (w[k] + ... + w[batch - 1]), caps ranks < k and gives the
    others floor(w[r] * scale_k + 0.5) clamped to [1, cap] (mean = `mean` up to rounding); then the
    lengths are shuffled over the batch: for i = batch-1 .. 1, swap [i] with [next() % (i + 1)],
    next() being splitmix64 seeded with `seed`."""
    cap = 16 * mean
    w = [math.pow(r + 1, -s) for r in range(batch)]
    target = float(mean) * float(batch)
    k, scale = 0, 0.0
    while k < batch:
        rest = 0.0
        for r in range(k, batch):
            rest += w[r]
        scale = (target - float(k) * float(cap)) / rest
        if w[k] * scale <= cap:
            break
        k += 1
    lengths = [cap if r < k else min(cap, max(1, math.floor(w[r] * scale + 0.5))) for r in range(batch)]
    return shuffle(lengths, seed)


def shuffle(values, seed):
    """Fisher-Yates in place, as shuffle() in bench/bench_main.cpp: for i = n-1 .. 1, swap [i] with
    [next() % (i + 1)], next() being splitmix64 seeded with `seed`. Returns values."""
    state = seed & M64
    for i in range(len(values) - 1, 0, -1):
        state, x = splitmix64_next(state)
        j = x % (i + 1)
        values[i], values[j] = values[j], values[i]
    return values


def decode_lengths(p):
    kind = p.get("lengths", "uniform")
    if kind == "uniform":
        return [p["kv_len"]] * p["batch"]
    if kind == "zipf":
        return zipf_lengths(p["batch"], p["kv_len"], float(p.get("zipf_s", 1.1)), int(p.get("seed", 1)))
    if kind == "list":
        return list_lengths(p, "kv_lens", 1)
    raise ValueError("lengths must be uniform, zipf or list, got %r" % kind)


def list_lengths(p, key, min_value):
    """A case's explicit per-request lengths (lengths="list"): `batch` integers >= min_value, as
    arg_lengths() in bench/bench_main.cpp requires them."""
    values = p.get(key)
    if not isinstance(values, list) or len(values) != p["batch"]:
        raise ValueError("%s must be a list of batch (%d) lengths" % (key, p["batch"]))
    if any(not isinstance(v, int) or v < min_value for v in values):
        raise ValueError("%s must hold integers >= %d" % (key, min_value))
    return list(values)


def plan_lengths(p):
    """(qo_lens, kv_lens) of a prefill_plan case: uniform qo_len / kv_len, or the lists."""
    if p.get("lengths", "uniform") == "list":
        qo, kv = list_lengths(p, "qo_lens", 1), list_lengths(p, "kv_lens", 1)
    elif p.get("lengths", "uniform") == "uniform":
        qo, kv = [p["qo_len"]] * p["batch"], [p["kv_len"]] * p["batch"]
    else:
        raise ValueError("lengths must be uniform or list, got %r" % p["lengths"])
    if any(q > k for q, k in zip(qo, kv)):
        raise ValueError("every request needs qo_len <= kv_len (its queries are its last positions)")
    return qo, kv


def visible_pairs(qo, kv, causal):
    """(query, key) pairs a request computes: all, or bottom-right causal (query i sees keys
    j <= kv - qo + i): sum_{i<qo} (kv - qo + i + 1); visible_pairs() in bench/bench_main.cpp."""
    return qo * (kv - qo) + qo * (qo + 1) // 2 if causal else qo * kv


def shuffled_page_table(lengths, page_size, seed):
    """Host page table as shuffled_page_table() in bench/bench_main.cpp builds it: CSR in request
    order, request i owning ceil(len_i / page_size) pages (the last holding the rest), page ids a
    permutation of the pool drawn with shuffle(seed). Returns (indptr, ids, last_page_len)."""
    indptr, last = [0], []
    for n in lengths:
        pages = (n + page_size - 1) // page_size
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * page_size)
    return indptr, shuffle(list(range(indptr[-1])), seed), last


DECODE_PAGES_SEED_XOR = 0x7061676573  # "pages": bench_decode's page ids come from seed ^ this


def merge_dtypes(p):
    return p.get("in_dtype", p.get("dtype")), p.get("out_dtype", p.get("dtype"))


# MoE routing, kept identical to bench/bench_main.cpp (moe_routing, moe_router_logits,
# expert_rows there), so that tessera and the peers run the same rows per expert; both record
# expert_rows_fnv and merge_into() flags a mismatch.

def moe_rows(p):
    return p["tokens"] * p.get("top_k", 1)


def moe_routing(p):
    """Expert of each (token, j) copy, token-major, of a moe_gemm case (top_k default 1):
    routing "balanced" (default): copy i goes to expert i % experts; "random": one splitmix64
    stream seeded with `seed` (default 1); for each token in order and j < top_k, draw
    e = next() % experts until e differs from the token's earlier picks."""
    e_count, tokens, k = p["experts"], p["tokens"], p.get("top_k", 1)
    if not 1 <= k <= e_count:
        raise ValueError("top_k must be in 1..experts")
    kind = p.get("routing", "balanced")
    if kind == "balanced":
        if (tokens * k) % e_count:
            raise ValueError("balanced routing needs tokens * top_k % experts == 0")
        return [i % e_count for i in range(tokens * k)]
    if kind != "random":
        raise ValueError("routing must be balanced or random, got %r" % kind)
    state, ids = int(p.get("seed", 1)) & M64, []
    for _ in range(tokens):
        picked = []
        while len(picked) < k:
            state, z = splitmix64_next(state)
            e = z % e_count
            if e not in picked:
                picked.append(e)
        ids.extend(picked)
    return ids


def moe_router_logits(tokens, experts, seed):
    """Router logits [tokens * experts] (row-major, Python floats, exact in fp32) of a moe_layer
    case: one splitmix64 stream seeded with `seed`, one draw per (token, expert); u = (draw >> 48)
    << 8 | expert, logit = (u - 2^23) / 2^21 in [-4, 4): never equal within a token (experts <=
    256), so the top-k has no ties."""
    if experts > 256:
        raise ValueError("router logits are generated for at most 256 experts")
    state, out = seed & M64, [0.0] * (tokens * experts)
    for i in range(tokens * experts):
        state = (state + 0x9E3779B97F4A7C15) & M64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        z ^= z >> 31
        out[i] = (((z >> 48) << 8 | (i % experts)) - 8388608) * 2.0 ** -21
    return out


def expert_rows(ids, experts):
    """Rows per expert, and their FNV-1a 64 digest (h ^= count; h *= 1099511628211, over the experts
    in order) as 16 hex digits: what both sides record as expert_rows_fnv."""
    rows = [0] * experts
    for e in ids:
        rows[e] += 1
    h = 14695981039346656037
    for n in rows:
        h = ((h ^ n) * 1099511628211) & M64
    return rows, "%016x" % h


def routing_notes(rows, fnv):
    return {"rows": sum(rows), "touched_experts": sum(1 for n in rows if n), "max_expert_rows": max(rows),
            "expert_rows_fnv": fnv}


def case_work(suite, p):
    """FLOPs (TFLOP/s suites) or bytes (TB/s suites) that one call does."""
    if suite in ("prefill", "prefill_portable", "prefill_paged"):
        flops = 4 * p["batch"] * p["num_qo_heads"] * p["seq"] * p["seq"] * p["head_dim"]
        return flops / 2 if p["causal"] else flops
    if suite == "prefill_plan":  # exact visible pairs, the causal-masked ones excluded
        causal = p.get("causal", True)
        return 4 * p["num_qo_heads"] * p["head_dim"] * sum(
            visible_pairs(q, k, causal) for q, k in zip(*plan_lengths(p)))
    if suite == "decode":  # K and V rows of every request read once (real lengths, no padding)
        return (sum(decode_lengths(p)) * p["num_kv_heads"] * p["head_dim"] * 2
                * DTYPE_SIZE[p.get("dtype", "bf16")])
    if suite == "moe_gemm":  # useful FLOPs: real rows only; SwiGLU counts its whole N = 2 * inter
        return 2 * moe_rows(p) * p["K"] * p["N"]
    if suite == "moe_layer":  # the two GEMMs: 2 T k H 2I + 2 T k I H
        return 6 * moe_rows(p) * p["hidden"] * p["inter"]
    if suite == "append":
        tokens = p["batch"] * p["append_len"]
        return 2 * 2 * tokens * p["num_kv_heads"] * p["head_dim"] * 2
    if suite == "merge":
        in_dt, out_dt = merge_dtypes(p)
        rh = p["rows"] * p["heads"]
        read = p["n"] * (rh * p["head_dim"] * DTYPE_SIZE[in_dt] + rh * 4)
        write = rh * p["head_dim"] * DTYPE_SIZE[out_dt] + rh * 4
        return read + write
    raise ValueError("unknown suite " + suite)


def set_bytes(suite, p):
    """Device bytes of one input set (what one call touches), used to decide rotation."""
    if suite in ("prefill", "prefill_portable", "prefill_paged"):
        q = p["batch"] * p["num_qo_heads"] * p["seq"] * p["head_dim"] * 2
        kv = p["batch"] * p["num_kv_heads"] * p["seq"] * p["head_dim"] * 2
        return 2 * q + 2 * kv
    if suite == "prefill_plan":  # q and o, the real K and V rows
        qo, kv = plan_lengths(p)
        return (2 * sum(qo) * p["num_qo_heads"] * p["head_dim"] * 2
                + 2 * sum(kv) * p["num_kv_heads"] * p["head_dim"] * 2)
    if suite == "decode":
        return case_work(suite, p) + 2 * p["batch"] * p["num_qo_heads"] * p["head_dim"] * DTYPE_SIZE[
            p.get("dtype", "bf16")]
    if suite == "moe_gemm":
        return 2 * (moe_rows(p) * p["K"] + p["experts"] * p["K"] * p["N"] + moe_rows(p) * p["N"])
    if suite == "moe_layer":
        return 2 * (3 * p["experts"] * p["hidden"] * p["inter"] + 2 * p["tokens"] * p["hidden"])
    return case_work(suite, p)  # append, merge: everything read and written


def num_sets(nbytes):
    return int(min(MAX_SETS, max(1, math.ceil(ROTATE_BYTES / nbytes))))


def load_cases(case_dir, only_suites):
    """Returns [(suite, metric, [case dict, ...])] from case_dir/*.json, in file-name order."""
    out = []
    for path in sorted(glob.glob(os.path.join(case_dir, "*.json"))):
        with open(path) as f:
            doc = json.load(f)
        suite = doc["suite"]
        if only_suites and suite not in only_suites:
            continue
        if suite not in SUITES:
            print("warning: %s: unknown suite %r, skipped" % (path, suite), file=sys.stderr)
            continue
        for c in doc["cases"]:
            missing = [k for k in ["name"] + SUITES[suite]["params"] if k not in c]
            if suite == "merge":
                in_dt, out_dt = merge_dtypes(c)
                if in_dt not in DTYPE_SIZE or out_dt not in DTYPE_SIZE:
                    missing.append("dtype or in_dtype/out_dtype (bf16|fp16|fp32)")
            if suite == "decode":
                kind = c.get("lengths", "uniform")
                if kind not in ("uniform", "zipf", "list"):
                    missing.append("lengths uniform|zipf|list")
                elif kind == "list":
                    try:
                        list_lengths(c, "kv_lens", 1)
                    except (KeyError, ValueError) as e:
                        missing.append("kv_lens (%s)" % e)
                elif "kv_len" not in c:
                    missing.append("kv_len")
                if c.get("dtype", "bf16") not in ("bf16", "fp16"):
                    missing.append("dtype bf16|fp16")
            if suite in ("moe_gemm", "moe_layer"):
                missing += moe_case_problems(suite, c)
            if suite == "prefill_plan":
                try:
                    plan_lengths(c)
                except (KeyError, ValueError) as e:
                    missing.append("qo_len and kv_len, or lengths list with qo_lens and kv_lens (%s)" % e)
            if missing:
                raise ValueError("%s: case %r lacks %s" % (path, c.get("name"), ", ".join(missing)))
        out.append((suite, doc["metric"], doc["cases"]))
    if only_suites:
        found = {s for s, _, _ in out}
        for s in only_suites:
            if s not in found:
                print("warning: no case file for suite %r" % s, file=sys.stderr)
    return out


def moe_case_problems(suite, c):
    """What a moe_gemm / moe_layer case gets wrong, as load_cases lists it."""
    problems = []
    if not all(isinstance(c.get(k), int) for k in SUITES[suite]["params"]):
        return problems  # the missing keys are listed already
    if suite == "moe_gemm":
        act = c.get("activation", "none")
        if act not in ("none", "swiglu"):
            problems.append("activation none|swiglu")
        elif act == "swiglu" and c["N"] % 16:
            problems.append("N = 2 * inter, inter a multiple of 8 (swiglu)")
        try:
            moe_routing(dict(c, tokens=0))  # checks top_k and the routing kind without drawing
            if c.get("routing", "balanced") == "balanced" and (c["tokens"] * c.get("top_k", 1)) % c["experts"]:
                problems.append("tokens * top_k divisible by experts (balanced routing)")
        except ValueError as e:
            problems.append("routing (%s)" % e)
    else:
        if c["experts"] > 256 or not 1 <= c["top_k"] <= c["experts"]:
            problems.append("experts <= 256 and top_k in 1..experts")
        if c.get("score", "softmax") not in ("softmax", "sigmoid"):
            problems.append("score softmax|sigmoid")
    return problems


def params_of(case):
    return {k: v for k, v in case.items() if k != "name"}


def print_plan(suites):
    for suite, metric, cases in suites:
        spec = SUITES[suite]
        unit = "TFLOP" if metric == "TFLOP/s" else "GB"
        print("suite %s (%s): peers %s; ceilings %s" % (
            suite, metric, ", ".join(spec["peers"]), ", ".join(
                spec["ceilings"] + (["gemm (dense mm, same FLOPs)"] if suite == "moe_gemm" else []))))
        for c in cases:
            p = params_of(c)
            work = case_work(suite, p)
            sb = set_bytes(suite, p)
            print("  %-30s work %9.3f %-5s  set %8.1f MB x %3d sets  %s" % (
                c["name"], work / 1e12 if unit == "TFLOP" else work / 1e9, unit, sb / 1e6, num_sets(sb),
                json.dumps(p, sort_keys=True)))
            if suite == "moe_gemm":
                rows, fnv = expert_rows(moe_routing(p), p["experts"])
                r = routing_notes(rows, fnv)
                print("  %-30s routing: %d rows, %d experts touched (%.1f MB of weights), at most %d rows, fnv %s" % (
                    "", r["rows"], r["touched_experts"], r["touched_experts"] * p["N"] * p["K"] * 2 / 1e6,
                    r["max_expert_rows"], fnv))
    print("ceilings once per run: copy (torch copy_ of %d GiB, read+write), read (torch.sum over %d GiB, "
          "bf16 and fp32; torch's reduction), gemm (torch.mm bf16 %d^3)" % (
              CEILING_BUFFER_BYTES >> 30, CEILING_BUFFER_BYTES >> 30, GEMM_CEILING_SIZE))


# ----------------------------------------------------------------------------------------------
# Timing helper
# ----------------------------------------------------------------------------------------------

def hold_gpu(seconds):
    """Keeps the GPU busy for about `seconds` (a spin kernel), so that the calls enqueued behind it
    run back to back and the events around them time GPU work, not Python and launch overhead."""
    if seconds > 0 and hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(seconds * 2.0e9))  # cycles; the H200 runs at up to 1.98 GHz


def time_cuda(fn, sets, budget_s, min_reps=20, max_reps=1000, warmup_s=0.05, batch=20):
    """Median seconds of fn(sets[i % len(sets)]), timed per call with CUDA events, after at least
    3 warm-up calls and warmup_s seconds of them (clocks up, plans and caches built). Calls are
    enqueued in batches behind hold_gpu(), long enough for the host to enqueue the batch."""
    n = len(sets)
    warmup = 0
    t0 = time.perf_counter()
    while warmup < 3 or time.perf_counter() - t0 < warmup_s:
        fn(sets[warmup % n])
        torch.cuda.synchronize()
        warmup += 1
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for i in range(3):
        fn(sets[(warmup + i) % n])
    host_s = (time.perf_counter() - t0) / 3
    end.record()
    end.synchronize()
    per_call_s = max(start.elapsed_time(end) / 3e3, host_s, 1e-6)
    reps = int(min(max_reps, max(min_reps, budget_s / per_call_s)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for b0 in range(0, reps, batch):
        hold_gpu(min(0.05, 1.5 * batch * host_s + 1e-4))
        for i in range(b0, min(reps, b0 + batch)):
            starts[i].record()
            fn(sets[(warmup + 3 + i) % n])
            ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def time_cuda_stream(fn, sets, budget_s, calls=20, min_reps=5, max_reps=100):
    """Seconds per call of `calls` back-to-back calls between two events (none between the calls),
    the median over repetitions: a stream of steps as an engine issues them. tessera's decode
    records the same figure as stream_tbs (bench/timing.h, stream_ms)."""
    n = len(sets)
    for i in range(max(3, calls)):
        fn(sets[i % n])
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    for i in range(calls):
        fn(sets[i % n])
    host_s = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    per_call = []
    reps = min_reps
    i = 0
    t0 = time.perf_counter()
    while len(per_call) < max_reps and (len(per_call) < reps or time.perf_counter() - t0 < budget_s):
        hold_gpu(min(0.05, 1.5 * calls * host_s + 1e-4))
        start.record()
        for _ in range(calls):
            fn(sets[i % n])
            i += 1
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(per_call)


def error_text(e):
    text = ("%s: %s" % (type(e).__name__, e)).strip().replace("\n", " | ")
    return text[:400]


def measure(name, fn, peers, notes):
    """Run one peer; fn() returns (value, note or None). A failure records null and the error."""
    try:
        value, note = fn()
        peers[name] = value
        if note:
            notes[name] = note
    except Exception as e:  # one failing peer must not stop the others
        peers[name] = None
        notes[name + "_error"] = error_text(e)
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:
            pass


def randn(*shape, dtype=None):
    return torch.randn(*shape, device="cuda", dtype=dtype or torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Prefill: [batch, heads, seq, dim] bf16
# ----------------------------------------------------------------------------------------------

FLEX = {"compiled": None, "compile_s": 0.0}


def prefill_sets(p):
    b, s, d = p["batch"], p["seq"], p["head_dim"]
    n = num_sets(set_bytes("prefill", p))
    return [(randn(b, p["num_qo_heads"], s, d), randn(b, p["num_kv_heads"], s, d),
             randn(b, p["num_kv_heads"], s, d)) for _ in range(n)]


def peer_sdpa_prefill(backend, sets, p, budget_s):
    from torch.nn.attention import sdpa_kernel
    gqa = p["num_kv_heads"] != p["num_qo_heads"]

    def call(x):
        return F.scaled_dot_product_attention(x[0], x[1], x[2], is_causal=p["causal"], enable_gqa=gqa)

    with sdpa_kernel(backend):
        t = time_cuda(call, sets, budget_s)
    return case_work("prefill", p) / t / 1e12, None


def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def peer_flex_prefill(sets, p, budget_s, compile_budget_s):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if FLEX["compile_s"] > compile_budget_s:
        raise RuntimeError("skipped: flex compile budget of %.0f s already spent" % compile_budget_s)
    if FLEX["compiled"] is None:
        FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    s = p["seq"]
    block_mask = None
    t0 = time.perf_counter()
    if p["causal"]:
        block_mask = create_block_mask(causal_mask_mod, None, None, s, s, device="cuda")
    gqa = p["num_kv_heads"] != p["num_qo_heads"]

    def call(x):
        return FLEX["compiled"](x[0], x[1], x[2], block_mask=block_mask, enable_gqa=gqa)

    try:
        call(sets[0])  # compiles for this shape (the block mask's build is counted too)
        torch.cuda.synchronize()
    finally:
        compile_s = time.perf_counter() - t0
        FLEX["compile_s"] += compile_s
    t = time_cuda(call, sets, budget_s)
    return case_work("prefill", p) / t / 1e12, "torch.compile(flex_attention); first call %.1f s" % compile_s


# FlashInfer (optional; installed from its published wheels where it runs): ragged prefill through
# BatchPrefillWithRaggedKVCacheWrapper, paged prefill (prefill_paged) through
# BatchPrefillWithPagedKVCacheWrapper. Its kernel modules come prebuilt from flashinfer/data/aot/
# or are JIT-compiled on first use (20-80 s per head dim on the H200 machine).

FLASHINFER = {"module": None, "error": None, "workspace": None, "planned": set(), "first_plan_s": {}, "failed": {}}
FLASHINFER_WORKSPACE_BYTES = 128 * 2**20


def flashinfer_module(args):
    """Returns (flashinfer, None), or (None, why it is not measured); imports it once."""
    if args.no_flashinfer:
        return None, "skipped: --no-flashinfer"
    if FLASHINFER["module"] is None and FLASHINFER["error"] is None:
        try:
            import flashinfer
            FLASHINFER["workspace"] = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
            FLASHINFER["module"] = flashinfer
        except Exception as e:  # not installed, or its import fails: the other peers still run
            FLASHINFER["error"] = "unavailable: " + error_text(e)
    return FLASHINFER["module"], FLASHINFER["error"]


def flashinfer_env():
    """What peers_env records of FlashInfer: version and prebuilt modules, or why it was not used."""
    fi = FLASHINFER["module"]
    if fi is None:
        return FLASHINFER["error"]
    env = {"version": getattr(fi, "__version__", "unknown"), "first_plan_s": FLASHINFER["first_plan_s"]}
    try:
        aot = fi.jit.env.FLASHINFER_AOT_DIR
        env["aot_dir"] = str(aot)
        env["aot_modules"] = sorted(os.listdir(aot)) if os.path.isdir(aot) else []
        env["jit_dir"] = str(fi.jit.env.FLASHINFER_JIT_DIR)
    except Exception as e:
        env["aot_error"] = error_text(e)
    return env


def flashinfer_pages(p):
    """Page table of a paged case, as bench_main.cpp's prefill_paged builds it: request i owns
    ceil(seq / page_size) pages of a pool shuffled with shuffle(seed 7)."""
    b, s, ps = p["batch"], p["seq"], p["page_size"]
    per_req = (s + ps - 1) // ps
    ids = shuffle(list(range(b * per_req)), 7)
    return per_req, ids, s - (per_req - 1) * ps


def flashinfer_paged_cache(k, per_req, ids, p):
    """K or V [b, Hkv, seq, d] (an SDPA peer's input) written into pages [num_pages, P, Hkv, d]
    (NHD) or [num_pages, Hkv, P, d] (HND), request i's pages at ids[i * per_req:(i + 1) * per_req]."""
    b, h, s, d = k.shape
    ps = p["page_size"]
    hnd = p.get("layout", "NHD") == "HND"
    pages = torch.zeros((b * per_req, h, ps, d) if hnd else (b * per_req, ps, h, d), device="cuda", dtype=k.dtype)
    padded = F.pad(k, (0, 0, 0, per_req * ps - s))  # [b, h, per_req * P, d]
    for i in range(b):
        rows = padded[i].view(h, per_req, ps, d)
        page_ids = torch.tensor(ids[i * per_req:(i + 1) * per_req], device="cuda", dtype=torch.long)
        pages[page_ids] = rows.permute(1, 0, 2, 3) if hnd else rows.permute(1, 2, 0, 3)
    return pages


def flashinfer_plan(key, label, plan):
    """Runs a wrapper's plan() and returns its seconds. The first plan of a kernel (`key`) loads its
    module (or JIT-builds it): its time goes to FLASHINFER["first_plan_s"][label], and a failure is
    remembered so that later cases skip that kernel."""
    first = key not in FLASHINFER["planned"]
    t0 = time.perf_counter()
    try:
        plan()
        torch.cuda.synchronize()
    except Exception as e:
        if first:
            FLASHINFER["failed"][key] = error_text(e)[:200]
        raise
    plan_s = time.perf_counter() - t0
    if first:
        FLASHINFER["planned"].add(key)
        FLASHINFER["first_plan_s"][label] = round(plan_s, 1)
    return plan_s


def peer_flashinfer_prefill(fi, sets, p, args):
    """FlashInfer's batch prefill over the SDPA peers' inputs, copied once into its layouts: q
    [b * seq, Hq, d]; K/V ragged [b * seq, Hkv, d] (NHD), or paged (prefill_paged: page_size,
    layout and page order of tessera's benchmark). plan() once, run() timed; the output of
    request 0 is checked against SDPA first."""
    b, s, hq, hkv, d = p["batch"], p["seq"], p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]
    paged = "page_size" in p
    key = (d, paged)
    if key in FLASHINFER["failed"]:
        raise RuntimeError("skipped: its first plan at head_dim %d failed: %s" % (d, FLASHINFER["failed"][key]))

    def nhd(x):
        return x.transpose(1, 2).reshape(b * s, x.shape[1], d)

    qo_indptr = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s
    if paged:
        per_req, ids, last = flashinfer_pages(p)
        layout = p.get("layout", "NHD")
        fi_sets = [(nhd(q), (flashinfer_paged_cache(k, per_req, ids, p), flashinfer_paged_cache(v, per_req, ids, p)))
                   for q, k, v in sets]
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(FLASHINFER["workspace"], layout,
                                                         backend=args.flashinfer_backend)
        kv_indptr = torch.arange(b + 1, device="cuda", dtype=torch.int32) * per_req
        kv_indices = torch.tensor(ids, device="cuda", dtype=torch.int32)
        last_page_len = torch.full((b,), last, device="cuda", dtype=torch.int32)

        def plan():
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hkv, d, p["page_size"],
                         causal=p["causal"], q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

        what = "BatchPrefillWithPagedKVCacheWrapper %s, page_size %d, shuffled pages" % (layout, p["page_size"])

        def call(x):
            return wrapper.run(x[0], x[1])
    else:
        fi_sets = [tuple(nhd(t) for t in x) for x in sets]
        wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(FLASHINFER["workspace"], "NHD",
                                                          backend=args.flashinfer_backend)

        def plan():
            wrapper.plan(qo_indptr, qo_indptr, hq, hkv, d, causal=p["causal"], q_data_type=torch.bfloat16)

        what = "BatchPrefillWithRaggedKVCacheWrapper NHD"

        def call(x):
            return wrapper.run(x[0], x[1], x[2])

    first = key not in FLASHINFER["planned"]
    plan_s = flashinfer_plan(key, "hd%d%s" % (d, "_paged" if paged else ""), plan)
    q, k, v = sets[0]
    ref = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], is_causal=p["causal"], enable_gqa=hq != hkv)
    err = (call(fi_sets[0])[:s].float() - ref[0].transpose(0, 1).float()).abs().max().item()
    del ref
    if not err < 3e-2:
        raise RuntimeError("flashinfer output differs from SDPA on request 0: max abs error %.3g" % err)
    t = time_cuda(call, fi_sets, args.time_per_peer)
    return case_work("prefill", p) / t / 1e12, (
        "flashinfer %s %s, backend %s (asked %s); plan once, run() timed; plan %.1f s%s; max abs err vs SDPA %.2g" % (
            getattr(fi, "__version__", "?"), what, getattr(wrapper, "_backend", "?"), args.flashinfer_backend,
            plan_s, " (module load or JIT)" if first else "", err))


PREFILL_CACHE = {}  # prefill and prefill_portable share cases: measure the peers once


def run_prefill(p, args):
    from torch.nn.attention import SDPBackend
    key = json.dumps(p, sort_keys=True)
    if key in PREFILL_CACHE:
        peers, notes = PREFILL_CACHE[key]
        return dict(peers), dict(notes, shared="peers measured once for prefill and prefill_portable"), {}
    peers, notes = {}, {}
    sets = prefill_sets(p)
    measure("cudnn", lambda: peer_sdpa_prefill(SDPBackend.CUDNN_ATTENTION, sets, p, args.time_per_peer),
            peers, notes)
    measure("torch_flash", lambda: peer_sdpa_prefill(SDPBackend.FLASH_ATTENTION, sets, p, args.time_per_peer),
            peers, notes)
    if args.no_flex:
        peers["flex"] = None
        notes["flex_error"] = "skipped: --no-flex"
    else:
        measure("flex", lambda: peer_flex_prefill(sets, p, args.time_per_peer, args.flex_budget), peers, notes)
    fi, why_not = flashinfer_module(args)
    if fi is None:
        peers["flashinfer"] = None
        notes["flashinfer_error"] = why_not
    else:
        measure("flashinfer", lambda: peer_flashinfer_prefill(fi, sets, p, args), peers, notes)
    PREFILL_CACHE[key] = (dict(peers), dict(notes))
    return peers, notes, {}


# ----------------------------------------------------------------------------------------------
# Decode: q [b, Hq, 1, d], contiguous K/V [b, Hkv, kv_len, d], bf16
# ----------------------------------------------------------------------------------------------

def peer_sdpa_decode(backend, sets, p, budget_s, timer=None):
    """SDPA with enable_gqa=True; if the backend refuses GQA, fold the query heads of one KV head
    into the query-length dimension (q [b, Hkv, group, d]), which computes the same attention and
    reads K/V once (expand() would read them group times or copy them)."""
    from torch.nn.attention import sdpa_kernel
    b, hq, hkv, d = p["batch"], p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]

    def call_gqa(x):
        return F.scaled_dot_product_attention(x[0], x[1], x[2], enable_gqa=(hq != hkv))

    def call_folded(x):
        q = x[0].view(b, hkv, hq // hkv, d)
        return F.scaled_dot_product_attention(q, x[1], x[2]).view(b, hq, 1, d)

    timer = timer or time_cuda
    with sdpa_kernel(backend):
        try:
            t = timer(call_gqa, sets, budget_s)
            note = "enable_gqa=True" if hq != hkv else None
        except Exception as e:
            torch.cuda.synchronize()
            t = timer(call_folded, sets, budget_s)
            note = ("enable_gqa refused (%s); query heads folded into q_len: q [b, %d, %d, %d]"
                    % (error_text(e)[:200], hkv, hq // hkv, d))
    return case_work("decode", p) / t / 1e12, note


def peer_sdpa_decode_loop(backend, sets, p, budget_s):
    """Ragged batch through SDPA, which has no ragged (varlen) entry for cuDNN: one call per request
    (q [1, Hq, 1, d], K/V [1, Hkv, kv_len_i, d], each contiguous), the whole loop timed as one call.
    Padding to the longest request instead would read max_len * batch K/V rows (16x the real rows
    for the zipf case), so the loop is the fairer simple choice; it still serialises the requests
    (a short one fills few SMs), so it understates what a ragged cuDNN call could reach."""
    from torch.nn.attention import sdpa_kernel
    hq, hkv, d = p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]

    def call_gqa(reqs):
        for q, k, v in reqs:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=(hq != hkv))

    def call_folded(reqs):
        for q, k, v in reqs:
            F.scaled_dot_product_attention(q.view(1, hkv, hq // hkv, d), k, v)

    loop = "one SDPA call per request (%d calls) timed as a whole" % p["batch"]
    with sdpa_kernel(backend):
        # batch=1: the spin kernel ahead of each timed loop covers the host's launches of that loop
        try:
            t = time_cuda(call_gqa, sets, budget_s, batch=1)
            note = loop + ("; enable_gqa=True" if hq != hkv else "")
        except Exception as e:
            torch.cuda.synchronize()
            t = time_cuda(call_folded, sets, budget_s, batch=1)
            note = loop + ("; enable_gqa refused (%s); query heads folded into q_len" % error_text(e)[:200])
    return case_work("decode", p) / t / 1e12, note


def peer_flash_varlen_decode(sets, cu_q, cu_k, starts, p, budget_s):
    """FlashAttention-2's varlen forward (torch.ops.aten._flash_attention_forward with cumulative
    sequence lengths, the kernel SDPA uses for jagged nested tensors): one launch over the packed
    ragged batch, q [batch, Hq, d] (one row per request), K/V [sum(kv_len), Hkv, d], GQA native,
    reading exactly the real K/V rows. Checked against fp32 SDPA on the longest and the shortest
    request before timing."""
    hq, hkv, d = p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    op = torch.ops.aten._flash_attention_forward

    def call(x):
        return op(x[0], x[1], x[2], cu_q, cu_k, 1, max(lengths), 0.0, False, False)

    q, k, v = sets[0]
    out = call(sets[0])[0]
    for i in {lengths.index(max(lengths)), lengths.index(min(lengths))}:
        kv = slice(starts[i], starts[i + 1])
        ref = F.scaled_dot_product_attention(  # GQA as query heads folded into q_len: same attention
            q[i].view(1, hkv, hq // hkv, d).float(), k[kv].transpose(0, 1).unsqueeze(0).float(),
            v[kv].transpose(0, 1).unsqueeze(0).float()).reshape(hq, d)
        err = (out[i].float() - ref).abs().max().item()
        if not err < 3e-2:
            raise RuntimeError("varlen flash output differs from SDPA on request %d (kv_len %d): max abs "
                               "error %.3g" % (i, lengths[i], err))
    del out
    t = time_cuda(call, sets, budget_s)
    return case_work("decode", p) / t / 1e12, ("aten._flash_attention_forward varlen (cu_seqlens_k over "
                                               "the real lengths), one launch")


def peer_flashinfer_decode(fi, p, lengths, args, notes):
    """FlashInfer's paged decode, BatchDecodeWithPagedKVCacheWrapper(workspace, LAYOUT,
    use_tensor_cores=...), on tessera's page table: shuffled_page_table() with bench_decode's page
    seed (same page size, layout, page ids and order), over random K/V pools [num_pages, P, Hkv, d]
    (NHD) or [num_pages, Hkv, P, d] (HND), as many rotated sets as the other peers. Both of its
    kernels are timed: use_tensor_cores=False (the CUDA-core batch-decode module) and True
    (planned through its prefill path, backend fa2 for bf16/fp16), each planned once, run(out=)
    timed; their figures go to notes["flashinfer_cuda_cores"] / ["flashinfer_tensor_cores"] and the
    faster is the peer's. Before timing, each one's output on the longest and the shortest request
    is checked against fp32 SDPA over the same pages."""
    b, hq, hkv, d, ps = p["batch"], p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], p["page_size"]
    layout = p.get("layout", "NHD")
    dtype = TORCH_DTYPE[p.get("dtype", "bf16")]
    indptr, ids, last = shuffled_page_table(lengths, ps, int(p.get("seed", 1)) ^ DECODE_PAGES_SEED_XOR)
    shape = (indptr[-1], ps, hkv, d) if layout == "NHD" else (indptr[-1], hkv, ps, d)
    sets = [(randn(b, hq, d, dtype=dtype), (randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)))
            for _ in range(num_sets(set_bytes("decode", p)))]
    out = torch.empty(b, hq, d, device="cuda", dtype=dtype)
    kv_indptr, kv_indices, kv_last = (torch.tensor(x, device="cuda", dtype=torch.int32) for x in (indptr, ids, last))

    def reference(i):
        q, (k_pages, v_pages) = sets[0]
        page_ids = kv_indices[indptr[i]:indptr[i + 1]].long()

        def rows(pages):  # request i's K or V rows, [1, Hkv, len_i, d]
            x = pages[page_ids]
            x = x.reshape(-1, hkv, d) if layout == "NHD" else x.transpose(1, 2).reshape(-1, hkv, d)
            return x[:lengths[i]].transpose(0, 1).unsqueeze(0).float()

        return F.scaled_dot_product_attention(  # GQA as query heads folded into q_len
            q[i].view(1, hkv, hq // hkv, d).float(), rows(k_pages), rows(v_pages)).reshape(hq, d)

    checked = sorted({lengths.index(max(lengths)), lengths.index(min(lengths))})
    refs = {i: reference(i) for i in checked}
    values, parts = {}, []
    for tensor_cores in (False, True):
        label = "tensor_cores" if tensor_cores else "cuda_cores"
        key = ("decode_" + label, d, p.get("dtype", "bf16"))
        if key in FLASHINFER["failed"]:
            notes["flashinfer_%s_error" % label] = "skipped: its first plan failed: " + FLASHINFER["failed"][key]
            continue
        try:
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(FLASHINFER["workspace"], layout,
                                                            use_tensor_cores=tensor_cores)
            first = key not in FLASHINFER["planned"]
            plan_s = flashinfer_plan(key, "hd%d_decode_%s" % (d, label), lambda: wrapper.plan(
                kv_indptr, kv_indices, kv_last, hq, hkv, d, ps, pos_encoding_mode="NONE",
                q_data_type=dtype, kv_data_type=dtype))

            def call(x, wrapper=wrapper):
                return wrapper.run(x[0], x[1], out=out)

            res = call(sets[0])
            err = max((res[i].float() - refs[i]).abs().max().item() for i in checked)
            if not err < 3e-2:
                raise RuntimeError("output differs from SDPA on requests %s: max abs error %.3g" % (checked, err))
            t = time_cuda(call, sets, args.time_per_peer)
            values[label] = case_work("decode", p) / t / 1e12
            notes["flashinfer_" + label] = values[label]
            parts.append("use_tensor_cores=%s %.3f TB/s (backend %s, plan %.1f s%s, max abs err vs SDPA %.2g)" % (
                tensor_cores, values[label], getattr(wrapper, "_backend", "?"), plan_s,
                " module load or JIT" if first else "", err))
        except Exception as e:  # one kernel failing leaves the other's figure
            notes["flashinfer_%s_error" % label] = error_text(e)
            torch.cuda.synchronize()
    if not values:
        raise RuntimeError("neither decode kernel ran (see flashinfer_cuda_cores_error, flashinfer_tensor_cores_error)")
    best = max(values, key=values.get)
    return values[best], (
        "flashinfer %s BatchDecodeWithPagedKVCacheWrapper %s, page_size %d, tessera's page table (CSR in request "
        "order, page ids shuffled as bench_main.cpp's decode); plan once, run() timed; the faster of: %s" % (
            getattr(fi, "__version__", "?"), layout, ps, "; ".join(parts)))


DECODE_CACHE = {}  # page_size / layout variants share the contiguous-K/V peers' figures


def run_decode(p, args):
    key = json.dumps({k: v for k, v in p.items() if k not in ("page_size", "layout")}, sort_keys=True)
    if key in DECODE_CACHE:
        peers, notes = DECODE_CACHE[key]
        peers, notes = dict(peers), dict(notes, shared="cudnn / torch_flash measured once for every page_size / layout")
    else:
        peers, notes = run_decode_contiguous(p, args)
        DECODE_CACHE[key] = (dict(peers), dict(notes))
    # flashinfer reads the case's own pages: measured for every case
    fi, why_not = flashinfer_module(args)
    if fi is None:
        peers["flashinfer"] = None
        notes["flashinfer_error"] = why_not
    else:
        measure("flashinfer", lambda: peer_flashinfer_decode(fi, p, decode_lengths(p), args, notes), peers, notes)
    return peers, notes, {}


def run_decode_contiguous(p, args):
    """The SDPA peers of a decode case, on contiguous K/V. Returns (peers, notes)."""
    from torch.nn.attention import SDPBackend
    lengths = decode_lengths(p)
    b, hq, hkv, d = p["batch"], p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]
    dtype = TORCH_DTYPE[p.get("dtype", "bf16")]
    n = num_sets(set_bytes("decode", p))
    peers = {}
    notes = {"kv": "cudnn, torch_flash read contiguous K/V (page_size and layout do not apply); flashinfer "
                   "reads tessera's page table",
             "kv_tokens": sum(lengths)}
    if p.get("lengths", "uniform") == "uniform":
        kv = p["kv_len"]
        sets = [(randn(b, hq, 1, d, dtype=dtype), randn(b, hkv, kv, d, dtype=dtype),
                 randn(b, hkv, kv, d, dtype=dtype)) for _ in range(n)]
        measure("cudnn", lambda: peer_sdpa_decode(SDPBackend.CUDNN_ATTENTION, sets, p, args.time_per_peer),
                peers, notes)
        # The same calls back to back without events between them (compare with stream_tbs).
        measure("cudnn_stream", lambda: peer_sdpa_decode(SDPBackend.CUDNN_ATTENTION, sets, p, args.time_per_peer,
                                                         timer=time_cuda_stream), peers, notes)
        measure("torch_flash", lambda: peer_sdpa_decode(SDPBackend.FLASH_ATTENTION, sets, p, args.time_per_peer),
                peers, notes)
        del sets
    else:
        # Ragged batch (the same per-request lengths as tessera, from decode_lengths): SDPA's dense
        # [b, H, kv_len, d] tensors cannot hold it without padding, which would read extra rows
        # while the TB/s counts the real ones. torch_flash: FlashAttention-2 varlen, one launch
        # (the fair peer). cudnn: one SDPA call per request (no ragged cuDNN entry in torch's
        # SDPA), a lower bound for cuDNN. Both count case_work = the real rows only.
        total = sum(lengths)
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        notes["max_kv_len"] = max(lengths)

        def cudnn_loop():
            sets = []
            for _ in range(n):
                q = randn(b, hq, 1, d, dtype=dtype)
                k, v = randn(total * hkv * d, dtype=dtype), randn(total * hkv * d, dtype=dtype)
                sets.append([(q[i:i + 1], k[starts[i] * hkv * d:starts[i + 1] * hkv * d].view(1, hkv, length, d),
                              v[starts[i] * hkv * d:starts[i + 1] * hkv * d].view(1, hkv, length, d))
                             for i, length in enumerate(lengths)])
            return peer_sdpa_decode_loop(SDPBackend.CUDNN_ATTENTION, sets, p, args.time_per_peer)

        def flash_varlen():
            cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32)
            cu_k = torch.tensor(starts, device="cuda", dtype=torch.int32)
            sets = [(randn(b, hq, d, dtype=dtype), randn(total, hkv, d, dtype=dtype),
                     randn(total, hkv, d, dtype=dtype)) for _ in range(n)]
            return peer_flash_varlen_decode(sets, cu_q, cu_k, starts, p, args.time_per_peer)

        measure("cudnn", cudnn_loop, peers, notes)
        measure("torch_flash", flash_varlen, peers, notes)
    return peers, notes


# ----------------------------------------------------------------------------------------------
# Chunked prefill (prefill_plan): request r's qo_r queries are the last positions of its kv_r keys;
# packed q [sum(qo), Hq, d], K/V [sum(kv), Hkv, d], bf16; causal is bottom-right aligned
# ----------------------------------------------------------------------------------------------

def prefix_sums(values):
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def plan_error(out, x, qo, kv, p):
    """Max abs error of `out` (packed [sum(qo), Hq, d]) against fp32 SDPA on the first, middle and
    last query rows of the first and the last request, each over the keys it sees (bottom-right
    causal: row i of request r sees its first kv_r - qo_r + i + 1 keys)."""
    q, k, v = x
    hq, hkv, d = p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]
    causal = p.get("causal", True)
    cu_q, cu_k = prefix_sums(qo), prefix_sums(kv)
    err = 0.0
    for r in sorted({0, len(qo) - 1}):
        for i in sorted({0, qo[r] // 2, qo[r] - 1}):
            keys = slice(cu_k[r], cu_k[r] + (kv[r] - qo[r] + i + 1 if causal else kv[r]))
            ref = F.scaled_dot_product_attention(  # GQA as query heads folded into q_len
                q[cu_q[r] + i].view(1, hkv, hq // hkv, d).float(), k[keys].transpose(0, 1).unsqueeze(0).float(),
                v[keys].transpose(0, 1).unsqueeze(0).float()).reshape(hq, d)
            err = max(err, (out[cu_q[r] + i].float() - ref).abs().max().item())
    return err


def check_plan(out, x, qo, kv, p, what):
    err = plan_error(out, x, qo, kv, p)
    if not err < 3e-2:
        raise RuntimeError("%s differs from bottom-right causal attention (fp32 SDPA on the visible keys): max "
                           "abs error %.3g" % (what, err))
    return err


def bottom_right_bias(qo, kv, dtype):
    """Additive mask [qo, kv] (q's dtype) of a chunked prefill's causal attention: 0 where query
    row i sees key j (j <= kv - qo + i), -inf elsewhere."""
    visible = torch.ones(qo, kv, dtype=torch.bool, device="cuda").tril(kv - qo)
    return torch.zeros(qo, kv, device="cuda", dtype=dtype).masked_fill(~visible, float("-inf"))


def peer_cudnn_plan(sets, qo, kv, p, budget_s):
    """cuDNN through SDPA with the bottom-right causal mask given as a precomputed additive bf16
    attn_mask [qo, kv] (broadcast over batch and heads): one call on [b, H, qo, d] / [b, H, kv, d]
    copies when every request has the same lengths, else one call per request (its own mask) timed
    as a whole. SDPA's is_causal cannot express the mask: it is top-left aligned, and cuDNN
    through SDPA applies it so on the H200 (max abs error ~3.7 against the bottom-right
    reference); torch.nn.attention.bias.causal_lower_right reaches cuDNN only through a mask
    materialised on every call. cuDNN reads the mask (qo * kv * 2 bytes per request shape) and
    runs the masked tiles too, which the FLOPs (visible pairs only) do not count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, hq, hkv, d = p["batch"], p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]
    gqa = hq != hkv
    causal = p.get("causal", True)
    cu_q, cu_k = prefix_sums(qo), prefix_sums(kv)
    masks = {}
    for shape in set(zip(qo, kv)):
        masks[shape] = bottom_right_bias(*shape, sets[0][0].dtype) if causal else None
    uniform = len(masks) == 1
    if uniform:
        mask = masks[(qo[0], kv[0])]
        cudnn_sets = [tuple(t.view(b, -1, t.shape[1], d).transpose(1, 2).contiguous() for t in x) for x in sets]

        def call(x):
            return F.scaled_dot_product_attention(x[0], x[1], x[2], attn_mask=mask, enable_gqa=gqa)

        def packed(o):
            return o.transpose(1, 2).reshape(-1, hq, d)
        how = "one SDPA call, q [b, Hq, qo, d], K/V [b, Hkv, kv, d]"
    else:
        cudnn_sets = [[tuple(t[c[r]:c[r + 1]].transpose(0, 1).unsqueeze(0).contiguous() for t, c in
                             zip(x, (cu_q, cu_k, cu_k))) + (masks[(qo[r], kv[r])],) for r in range(b)] for x in sets]

        def call(reqs):
            return [F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa) for q, k, v, m in reqs]

        def packed(outs):
            return torch.cat([o[0].transpose(0, 1) for o in outs])
        how = "one SDPA call per request (%d calls) timed as a whole" % b
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        first = packed(call(cudnn_sets[0]))
    err = check_plan(first, sets[0], qo, kv, p, "cuDNN SDPA")  # its fp32 reference is not a cuDNN call
    del first
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t = time_cuda(call, cudnn_sets, budget_s, batch=20 if uniform else 1)
    return case_work("prefill_plan", p) / t / 1e12, "%s, %s; max abs err %.2g" % (
        how, "additive bf16 bottom-right mask [qo, kv]" if causal else "no mask", err)


def peer_flash_varlen_plan(sets, qo, kv, p, budget_s):
    """FlashAttention-2's varlen forward (aten._flash_attention_forward, cu_seqlens_q / _k over the
    real lengths): its causal mask is bottom-right aligned when seqlen_q < seqlen_k, the chunked
    prefill's mask; one launch over the packed batch, GQA native."""
    cu_q = torch.tensor(prefix_sums(qo), device="cuda", dtype=torch.int32)
    cu_k = torch.tensor(prefix_sums(kv), device="cuda", dtype=torch.int32)
    causal = p.get("causal", True)
    op = torch.ops.aten._flash_attention_forward

    def call(x):
        return op(x[0], x[1], x[2], cu_q, cu_k, max(qo), max(kv), 0.0, causal, False)[0]

    err = check_plan(call(sets[0]), sets[0], qo, kv, p, "varlen flash")
    t = time_cuda(call, sets, budget_s)
    return case_work("prefill_plan", p) / t / 1e12, (
        "aten._flash_attention_forward varlen, is_causal=%s (bottom-right); max abs err %.2g" % (causal, err))


def peer_flashinfer_plan(fi, sets, qo, kv, p, args):
    """FlashInfer's paged prefill, BatchPrefillWithPagedKVCacheWrapper(workspace, LAYOUT,
    backend=B).plan(qo_indptr, ..., causal) once, run(out=) timed, over the peers' K/V rows
    written into pages with tessera's page table for this suite (shuffled_page_table, seed 7:
    page size, layout, page ids and order of bench_main.cpp's prefill_plan)."""
    hq, hkv, d, ps = p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], p["page_size"]
    layout = p.get("layout", "NHD")
    causal = p.get("causal", True)
    indptr, ids, last = shuffled_page_table(kv, ps, 7)
    key = (d, "plan")
    if key in FLASHINFER["failed"]:
        raise RuntimeError("skipped: its first plan at head_dim %d failed: %s" % (d, FLASHINFER["failed"][key]))
    ids_t = torch.tensor(ids, device="cuda", dtype=torch.long)
    # token t of request r lives in page ids[indptr[r] + t // P], row t % P
    token = [torch.arange(n, device="cuda") for n in kv]
    slots = torch.cat([ids_t[indptr[r] + t // ps] * ps + t % ps for r, t in enumerate(token)])

    def paged(rows):
        pages = torch.zeros(indptr[-1] * ps, hkv, d, device="cuda", dtype=rows.dtype)
        pages[slots] = rows
        pages = pages.view(indptr[-1], ps, hkv, d)
        return pages.transpose(1, 2).contiguous() if layout == "HND" else pages

    fi_sets = [(q, (paged(k), paged(v))) for q, k, v in sets]
    out = torch.empty_like(sets[0][0])
    dev = [torch.tensor(x, device="cuda", dtype=torch.int32) for x in (prefix_sums(qo), indptr, ids, last)]
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(FLASHINFER["workspace"], layout, backend=args.flashinfer_backend)
    first = key not in FLASHINFER["planned"]
    plan_s = flashinfer_plan(key, "hd%d_paged_plan" % d, lambda: wrapper.plan(
        dev[0], dev[1], dev[2], dev[3], hq, hkv, d, ps, causal=causal,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16))

    def call(x):
        return wrapper.run(x[0], x[1], out=out)

    err = check_plan(call(fi_sets[0]), sets[0], qo, kv, p, "flashinfer")
    t = time_cuda(call, fi_sets, args.time_per_peer)
    return case_work("prefill_plan", p) / t / 1e12, (
        "flashinfer %s BatchPrefillWithPagedKVCacheWrapper %s, page_size %d, tessera's page table (seed 7), causal=%s; "
        "backend %s (asked %s); plan once, run() timed; plan %.1f s%s; max abs err %.2g" % (
            getattr(fi, "__version__", "?"), layout, ps, causal, getattr(wrapper, "_backend", "?"),
            args.flashinfer_backend, plan_s, " (module load or JIT)" if first else "", err))


def run_prefill_plan(p, args):
    qo, kv = plan_lengths(p)
    hq, hkv, d = p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]
    n = num_sets(set_bytes("prefill_plan", p))
    sets = [(randn(sum(qo), hq, d), randn(sum(kv), hkv, d), randn(sum(kv), hkv, d)) for _ in range(n)]
    peers = {}
    notes = {"q_tokens": sum(qo), "kv_tokens": sum(kv),
             "kv": "cudnn, torch_flash read contiguous K/V; flashinfer reads tessera's page table"}
    measure("cudnn", lambda: peer_cudnn_plan(sets, qo, kv, p, args.time_per_peer), peers, notes)
    measure("torch_flash", lambda: peer_flash_varlen_plan(sets, qo, kv, p, args.time_per_peer), peers, notes)
    fi, why_not = flashinfer_module(args)
    if fi is None:
        peers["flashinfer"] = None
        notes["flashinfer_error"] = why_not
    else:
        measure("flashinfer", lambda: peer_flashinfer_plan(fi, sets, qo, kv, p, args), peers, notes)
    return peers, notes, {}


# ----------------------------------------------------------------------------------------------
# MoE: moe_gemm (the grouped GEMM on a routed layout) and moe_layer (the layer from router logits)
# ----------------------------------------------------------------------------------------------
# torch._grouped_mm(mat_a, mat_b, offs=offs), as PyTorch's source has it (aten/src/ATen/native/
# GroupedMMUtils.h, cuda/GroupedBlas.cpp, cuda/GroupMM.cu, cuda/GroupMMCommon.cuh):
#   mat_a [rows, K] row-major; mat_b [E, K, N], either row-major or a transposed view of a
#   contiguous [E, N, K] (nn.Linear's layout, tessera's weights): CUTLASS is instantiated for both;
#   offs int32 [E]: the cumulative END row of each group (group g is rows offs[g-1]:offs[g]); for
#   2d x 3d empty groups are allowed, rows need no alignment (the 16-byte checks are for the
#   K-grouped 2d x 2d and the 3d x 2d cases) and rows past offs[-1] are ignored; at most 1023
#   groups; out ([rows, N], mat_a's dtype) is allocated by the call; no host synchronisation.
#   bf16 a, b and out on sm_90 / sm_100 take the CUTLASS ptr-array kernels (sm_90: 64x128x128
#   ping-pong when rows / E <= 128 or N <= 128, else 128x256x64 cooperative); anything else a
#   loop of mm.

MOE_WEIGHTS = {"key": None, "tensors": None}


def moe_weights(key, make):
    """Weights of the current MoE shape, made once and reused by the following cases of the same
    shape (the T sweep of one model; DeepSeek-V3's layer is 22.5 GB); another shape frees them."""
    if MOE_WEIGHTS["key"] != key:
        release_moe_weights()
        MOE_WEIGHTS["tensors"] = make()
        MOE_WEIGHTS["key"] = key
    return MOE_WEIGHTS["tensors"]


def release_moe_weights():
    MOE_WEIGHTS["key"] = MOE_WEIGHTS["tensors"] = None
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def scaled_randn(*shape):
    """randn / sqrt(fan-in): weights under which activations stay O(1) through both GEMMs."""
    return randn(*shape).mul_(shape[-1] ** -0.5)


def grouped_mm_layouts(w_kn, w_nk):
    """mat_b as [E, K, N] row-major, and as the transposed view of [E, N, K] (tessera's layout)."""
    return (("w[E,K,N]", w_kn), ("w[E,N,K].mT", w_nk.transpose(-2, -1)))


def check_grouped_mm(out, x, w, ends):
    """Relative error of the largest group's rows against an fp32 mm: checks the offs convention."""
    starts = [0] + ends[:-1]
    g = max(range(len(ends)), key=lambda i: ends[i] - starts[i])
    s, e = starts[g], ends[g]
    ref = x[s:e].float() @ w[g].float()
    return ((out[s:e].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def peer_grouped_mm(x, layouts, offs, ends, p, budget_s, swiglu=False):
    """torch._grouped_mm(x, w, offs=offs) over each weight layout, alone or (swiglu) followed by
    F.silu(gate) * up as torch writes SwiGLU (gate = the first N / 2 output columns, up the rest);
    reports the faster layout. The plain call is first checked against an fp32 mm."""
    inter = p["N"] // 2

    def make_call(w):
        if not swiglu:
            return lambda x_: torch._grouped_mm(x_, w, offs=offs)

        def call(x_):
            h = torch._grouped_mm(x_, w, offs=offs)
            return F.silu(h[:, :inter]) * h[:, inter:]
        return call

    results, errors, checks = {}, {}, {}
    for label, w in layouts:
        try:
            if not swiglu:
                checks[label] = check_grouped_mm(torch._grouped_mm(x, w, offs=offs), x, w, ends)
                if checks[label] > 2e-2:
                    raise RuntimeError("relative error %.3g against an fp32 mm" % checks[label])
            t = time_cuda(make_call(w), [x], budget_s)
            results[label] = case_work("moe_gemm", p) / t / 1e12
        except Exception as e:
            errors[label] = error_text(e)[:200]
            torch.cuda.synchronize()
    if not results:
        raise RuntimeError("; ".join("%s: %s" % kv for kv in errors.items()))
    best = max(results, key=results.get)
    note = "best layout %s; " % best + ", ".join("%s %.1f" % kv for kv in results.items())
    if checks:
        note += "; rel. error vs fp32 " + ", ".join("%s %.1e" % kv for kv in checks.items())
    if errors:
        note += "; failed: " + "; ".join("%s: %s" % kv for kv in errors.items())
    return results[best], note


def peer_cublas_loop(x, w_kn, out, ends, p, budget_s):
    """A Python loop of torch.mm (cuBLAS) over the experts that have rows, timed as one step."""
    parts, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            parts.append((x[start:end], w_kn[g], out[start:end]))
        start = end

    def call(_):
        for xe, we, oe in parts:
            torch.mm(xe, we, out=oe)

    t = time_cuda(call, [None], budget_s)
    return case_work("moe_gemm", p) / t / 1e12, (
        "python loop of torch.mm over the %d experts with rows (w[E,K,N]), timed as a whole; "
        "the GEMM only" % len(parts))


def dense_gemm_tflops(m, k, n, budget_s):
    a, b = randn(m, k), randn(k, n)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    t = time_cuda(lambda _: torch.mm(a, b, out=c), [None], budget_s)
    return 2 * m * k * n / t / 1e12


def run_moe_gemm(p, args):
    e, k, n = p["experts"], p["K"], p["N"]
    rows_of, fnv = expert_rows(moe_routing(p), e)
    ends = prefix_sums(rows_of)[1:]
    rows = ends[-1]
    peers, notes = {}, routing_notes(rows_of, fnv)
    notes["touched_weight_bytes"] = notes["touched_experts"] * n * k * 2
    w_kn, w_nk = moe_weights(("moe_gemm", e, n, k), lambda: (randn(e, k, n), randn(e, n, k)))
    layouts = grouped_mm_layouts(w_kn, w_nk)
    x = randn(rows, k)  # the permuted rows: expert g's are x[ends[g-1]:ends[g]]
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor(ends, device="cuda", dtype=torch.int32)
    budget = args.time_per_peer
    measure("torch_grouped_mm", lambda: peer_grouped_mm(x, layouts, offs, ends, p, budget), peers, notes)
    if p.get("activation", "none") == "swiglu":
        measure("torch_grouped_mm_swiglu", lambda: peer_grouped_mm(x, layouts, offs, ends, p, budget, swiglu=True),
                peers, notes)
    measure("cublas_loop", lambda: peer_cublas_loop(x, w_kn, out, ends, p, budget), peers, notes)
    del x, out, offs, layouts
    torch.cuda.empty_cache()
    ceiling = {}
    try:
        ceiling["gemm"] = dense_gemm_tflops(rows, k, n, budget)
        notes["gemm"] = "dense torch.mm bf16 [%d,%d]x[%d,%d], same FLOPs" % (rows, k, k, n)
    except Exception as ex:
        notes["gemm_error"] = error_text(ex)
    return peers, notes, ceiling


def moe_layer_call(x, logits, w1t, w2t, p, combine):
    """The MoE layer composed from torch ops, as a torch user writes it without a fused kernel:
    scores (softmax, or sigmoid) -> topk -> renormalise -> stable sort of the copies by expert ->
    offs by searchsorted (no host sync) -> gather x -> grouped_mm up -> silu(gate) * up ->
    grouped_mm down -> combine: "index_add" (scale each row by its weight, index_add_ into the
    tokens) or "gather" (unpermute with index_copy_, weighted sum over the k copies of a token)."""
    tokens, k, inter = p["tokens"], p["top_k"], p["inter"]
    experts = torch.arange(p["experts"], device="cuda")
    sigmoid = p.get("score", "softmax") == "sigmoid"
    renormalize = p.get("renormalize", True)

    def call(_):
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(scores, k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        sorted_ids, order = torch.sort(ids.view(-1), stable=True)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
        token = order // k
        h = torch._grouped_mm(x[token], w1t, offs=offs)
        y = torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], w2t, offs=offs)
        if combine == "index_add":
            y = y * weights.view(-1)[order].unsqueeze(1).to(y.dtype)
            return torch.zeros_like(x).index_add_(0, token, y)
        unsorted = torch.empty_like(y).index_copy_(0, order, y)
        return (unsorted.view(tokens, k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)

    return call


def moe_layer_reference(x, logits, w1, w2, p, tokens):
    """fp32 outputs of a few tokens: sum_j weight_j * w2[e_j] (silu(gate) * up), [gate; up] = w1[e_j] x."""
    k, inter = p["top_k"], p["inter"]
    rows = []
    for t in tokens:
        s = logits[t].float()
        scores = torch.sigmoid(s) if p.get("score", "softmax") == "sigmoid" else torch.softmax(s, dim=-1)
        weights, ids = torch.topk(scores, k)
        if p.get("renormalize", True):
            weights = weights / weights.sum()
        xt = x[t].float()
        acc = torch.zeros(x.shape[1], device="cuda", dtype=torch.float32)
        for wj, e in zip(weights.tolist(), ids.tolist()):
            h = w1[e].float() @ xt
            acc += wj * (w2[e].float() @ (F.silu(h[:inter]) * h[inter:]))
        rows.append(acc)
    return torch.stack(rows)


def peer_torch_moe_layer(x, logits, w1, w2, p, budget_s):
    """The torch composition with both combines, each checked on three tokens against an fp32
    reference; reports the faster."""
    w1t, w2t = w1.transpose(-2, -1), w2.transpose(-2, -1)  # [E, H, 2I], [E, I, H]: grouped_mm's mat_b
    probe = sorted({0, p["tokens"] // 2, p["tokens"] - 1})
    ref = moe_layer_reference(x, logits, w1, w2, p, probe)
    results, errors, checks = {}, {}, {}
    for combine in ("index_add", "gather"):
        try:
            call = moe_layer_call(x, logits, w1t, w2t, p, combine)
            got = call(None)[probe].float()
            checks[combine] = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if checks[combine] > 5e-2:
                raise RuntimeError("relative error %.3g against the fp32 reference" % checks[combine])
            t = time_cuda(call, [None], budget_s)
            results[combine] = case_work("moe_layer", p) / t / 1e12
        except Exception as e:
            errors[combine] = error_text(e)[:200]
            torch.cuda.synchronize()
    if not results:
        raise RuntimeError("; ".join("%s: %s" % kv for kv in errors.items()))
    best = max(results, key=results.get)
    note = ("softmax/sigmoid, topk, renormalise, sort, searchsorted offs, gather, grouped_mm up, silu*up, "
            "grouped_mm down, combine; best combine %s; " % best + ", ".join("%s %.1f" % kv for kv in results.items())
            + "; rel. error vs fp32 on 3 tokens " + ", ".join("%s %.1e" % kv for kv in checks.items()))
    if errors:
        note += "; failed: " + "; ".join("%s: %s" % kv for kv in errors.items())
    return results[best], note


def run_moe_layer(p, args):
    e, k, tokens, hidden, inter = p["experts"], p["top_k"], p["tokens"], p["hidden"], p["inter"]
    flat = moe_router_logits(tokens, e, int(p.get("seed", 1)))
    logits = torch.tensor(flat, dtype=torch.float32).view(tokens, e).cuda()
    host_ids = []
    for t in range(tokens):
        row = flat[t * e:(t + 1) * e]
        host_ids += sorted(range(e), key=row.__getitem__, reverse=True)[:k]
    scores = torch.sigmoid(logits) if p.get("score", "softmax") == "sigmoid" else torch.softmax(logits, dim=-1)
    rows_of, fnv = expert_rows(torch.topk(scores, k, dim=-1).indices.view(-1).tolist(), e)
    notes = routing_notes(rows_of, fnv)
    notes["routing_matches_host"] = fnv == expert_rows(host_ids, e)[1]
    notes["touched_weight_bytes"] = notes["touched_experts"] * 3 * hidden * inter * 2
    w1, w2 = moe_weights(("moe_layer", e, hidden, inter),
                         lambda: (scaled_randn(e, 2 * inter, hidden), scaled_randn(e, hidden, inter)))
    x = randn(tokens, hidden)
    peers = {}
    measure("torch_moe_layer", lambda: peer_torch_moe_layer(x, logits, w1, w2, p, args.time_per_peer), peers, notes)
    return peers, notes, {}


# ----------------------------------------------------------------------------------------------
# Append: new K/V [tokens, Hkv, d] written into paged K/V (NHD or HND), page_size tokens a page
# ----------------------------------------------------------------------------------------------

def append_sets(p):
    """Each request starts at a random offset in its first page; pages are a random permutation of
    one pool, disjoint between requests and between rotated input sets."""
    b, length, h, d, ps = p["batch"], p["append_len"], p["num_kv_heads"], p["head_dim"], p["page_size"]
    n = num_sets(set_bytes("append", p))
    pages_per_req = (ps - 1 + length + ps - 1) // ps
    total_pages = n * b * pages_per_req
    shape = (total_pages, ps, h, d) if p["layout"] == "NHD" else (total_pages, h, ps, d)
    k_pages, v_pages = randn(*shape), randn(*shape)
    perm = torch.randperm(total_pages, device="cuda").view(n, b, pages_per_req)
    sets = []
    for i in range(n):
        pos = torch.randint(0, ps, (b, 1), device="cuda") + torch.arange(length, device="cuda")[None, :]
        page = torch.gather(perm[i], 1, pos // ps).reshape(-1)
        offset = (pos % ps).reshape(-1)
        sets.append(dict(page=page, offset=offset, slot=page * ps + offset,
                         k=randn(b * length, h, d), v=randn(b * length, h, d)))
    return k_pages, v_pages, sets


def peer_torch_index_append(k_pages, v_pages, sets, p, budget_s):
    h, d = p["num_kv_heads"], p["head_dim"]
    if p["layout"] == "NHD":
        k_flat, v_flat = k_pages.view(-1, h, d), v_pages.view(-1, h, d)

        def call(x):
            k_flat[x["slot"]] = x["k"]
            v_flat[x["slot"]] = x["v"]
        note = "k_pages.view(-1, H, D)[slot] = k_new (and V)"
    else:
        def call(x):
            k_pages[x["page"], :, x["offset"]] = x["k"]
            v_pages[x["page"], :, x["offset"]] = x["v"]
        note = "k_pages[page, :, offset] = k_new (and V)"
    t = time_cuda(call, sets, budget_s)
    return case_work("append", p) / t / 1e12, note


def run_append(p, args):
    if p["layout"] not in ("NHD", "HND"):
        raise ValueError("layout must be NHD or HND")
    k_pages, v_pages, sets = append_sets(p)
    peers, notes = {}, {}
    measure("torch_index", lambda: peer_torch_index_append(k_pages, v_pages, sets, p, args.time_per_peer),
            peers, notes)
    return peers, notes, {}


# ----------------------------------------------------------------------------------------------
# Merge of n attention states: o [n, rows, heads, d] (in dtype), lse [n, rows, heads] fp32
# ----------------------------------------------------------------------------------------------

TORCH_DTYPE = {}


def merge2(o_a, s_a, o_b, s_b, out_dtype):
    s = torch.logaddexp(s_a, s_b)
    o = (o_a.float() * torch.exp(s_a - s).unsqueeze(-1) + o_b.float() * torch.exp(s_b - s).unsqueeze(-1))
    return o.to(out_dtype), s


def merge_n(o, s, out_dtype):
    s_all = torch.logsumexp(s, dim=0)
    w = torch.exp(s - s_all.unsqueeze(0))
    return (o.float() * w.unsqueeze(-1)).sum(dim=0).to(out_dtype), s_all


def peer_torch_merge(sets, p, budget_s):
    out_dtype = TORCH_DTYPE[merge_dtypes(p)[1]]
    if p["n"] == 2:
        def call(x):
            return merge2(x[0][0], x[1][0], x[0][1], x[1][1], out_dtype)
        note = "logaddexp + exp weights, fp32 math"
    else:
        def call(x):
            return merge_n(x[0], x[1], out_dtype)
        note = "logsumexp over n + exp weights, fp32 math"
    t = time_cuda(call, sets, budget_s)
    return case_work("merge", p) / t / 1e12, note


def run_merge(p, args):
    in_dtype = TORCH_DTYPE[merge_dtypes(p)[0]]
    n, rows, heads, d = p["n"], p["rows"], p["heads"], p["head_dim"]
    sets = [(randn(n, rows, heads, d, dtype=in_dtype), 4 * randn(n, rows, heads, dtype=torch.float32))
            for _ in range(num_sets(set_bytes("merge", p)))]
    peers, notes = {}, {}
    measure("torch_ops", lambda: peer_torch_merge(sets, p, args.time_per_peer), peers, notes)
    return peers, notes, {}


# ----------------------------------------------------------------------------------------------
# tessera through its Python package (--tessera-python): the same cases, timers and input sizes
# ----------------------------------------------------------------------------------------------

TESSERA = {"module": None}


def tessera_prefill(p, budget_s, paged):
    """batch_prefill (or batch_prefill_paged, page_size from the case) on the case as a ragged
    batch of `batch` requests of `seq` tokens, q [b * s, Hq, d]."""
    ts = TESSERA["module"]
    b, s, hq, hkv, d = p["batch"], p["seq"], p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]
    indptr = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    n = num_sets(set_bytes("prefill", p))
    sets = [(randn(b * s, hq, d), randn(b * s, hkv, d), randn(b * s, hkv, d)) for _ in range(n)]
    out = torch.empty_like(sets[0][0])
    dev_indptr = indptr.cuda()
    if not paged:
        def call(x):
            ts.batch_prefill(x[0], x[1], x[2], dev_indptr, dev_indptr, host_qo_indptr=indptr,
                             host_kv_indptr=indptr, causal=p["causal"], out=out)
        note = "tessera.batch_prefill (Python package), host indptr given"
    else:
        ps = p["page_size"]
        pages = (s + ps - 1) // ps
        page_indptr = torch.arange(0, (b + 1) * pages, pages, dtype=torch.int32)
        ids = torch.arange(b * pages, dtype=torch.int32)
        last = torch.full((b,), s - (pages - 1) * ps, dtype=torch.int32)
        dev = [t.cuda() for t in (page_indptr, ids, last)]
        if s % ps:
            raise RuntimeError("seq %d is not a multiple of page_size %d" % (s, ps))
        # request r's token t sits in page r * pages + t // ps: K/V rows viewed as pages, stacked
        # into the combined [num_pages, 2, page_size, kv_heads, head_dim] cache
        sets = [(x[0], torch.stack([x[1].view(b * pages, ps, hkv, d), x[2].view(b * pages, ps, hkv, d)], dim=1))
                for x in sets]

        def call(x):
            ts.batch_prefill_paged(x[0], dev_indptr, x[1], None, dev[0], dev[1], dev[2],
                                   host_qo_indptr=indptr, host_kv_indptr=page_indptr, host_kv_indices=ids,
                                   host_kv_last_page_len=last, causal=p["causal"], out=out)
        note = "tessera.batch_prefill_paged (Python package), combined NHD cache"
    t = time_cuda(call, sets, budget_s)
    return case_work("prefill", p) / t / 1e12, note


def tessera_decode(p, budget_s):
    """BatchDecoder plan once, run() timed per call and as a stream, over a combined NHD cache."""
    ts = TESSERA["module"]
    lengths = decode_lengths(p)
    b, hq, hkv, d, ps = p["batch"], p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], p["page_size"]
    dtype = TORCH_DTYPE[p.get("dtype", "bf16")]
    pages = [(n + ps - 1) // ps for n in lengths]
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total_pages = int(indptr[-1])
    ids = torch.arange(total_pages, dtype=torch.int32)
    last = torch.tensor([n - (k - 1) * ps for n, k in zip(lengths, pages)], dtype=torch.int32)
    qo = torch.arange(b + 1, dtype=torch.int32)
    cfg = ts.DecodeConfig(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, dtype=p.get("dtype", "bf16"),
                          layout=p.get("layout", "NHD"), max_batch_size=b)
    decoder = ts.BatchDecoder(cfg)
    decoder.plan(qo, indptr, ids, last, num_pages=total_pages)
    n = num_sets(set_bytes("decode", p))
    sets = [(randn(b, hq, d, dtype=dtype), randn(total_pages, 2, ps, hkv, d, dtype=dtype)) for _ in range(n)]
    out = torch.empty_like(sets[0][0])

    def call(x):
        decoder.run(x[0], x[1], out=out)

    t = time_cuda(call, sets, budget_s)
    t_stream = time_cuda_stream(call, sets, budget_s)
    work = case_work("decode", p)
    return work / t / 1e12, work / t_stream / 1e12


def tessera_append(p, budget_s):
    ts = TESSERA["module"]
    b, length, h, d, ps = p["batch"], p["append_len"], p["num_kv_heads"], p["head_dim"], p["page_size"]
    pages = (length + ps - 1) // ps
    shape = (b * pages, ps, h, d) if p["layout"] == "NHD" else (b * pages, h, ps, d)
    k_pages, v_pages = randn(*shape), randn(*shape)
    indptr = torch.arange(0, (b + 1) * pages, pages, dtype=torch.int32)
    ids = torch.arange(b * pages, dtype=torch.int32)
    last = torch.full((b,), length - (pages - 1) * ps, dtype=torch.int32)
    append = torch.arange(0, (b + 1) * length, length, dtype=torch.int32)
    dev = [t.cuda() for t in (indptr, ids, last, append)]
    sets = [(randn(b * length, h, d), randn(b * length, h, d)) for _ in range(num_sets(set_bytes("append", p)))]

    def call(x):
        ts.append_paged_kv(k_pages, v_pages, dev[0], dev[1], dev[2], dev[3], x[0], x[1], layout=p["layout"],
                           host_kv_indptr=indptr, host_kv_indices=ids, host_kv_last_page_len=last,
                           host_append_indptr=append)

    t = time_cuda(call, sets, budget_s)
    return case_work("append", p) / t / 1e12


def tessera_merge(p, budget_s):
    ts = TESSERA["module"]
    in_dt, out_dt = merge_dtypes(p)
    n, rows, heads, d = p["n"], p["rows"], p["heads"], p["head_dim"]
    sets = [(randn(rows, n, heads, d, dtype=TORCH_DTYPE[in_dt]), 4 * randn(rows, n, heads, dtype=torch.float32))
            for _ in range(num_sets(set_bytes("merge", p)))]
    out = torch.empty(rows, heads, d, dtype=TORCH_DTYPE[out_dt], device="cuda")
    s_out = torch.empty(rows, heads, dtype=torch.float32, device="cuda")
    if n == 2:
        def call(x):
            ts.merge_state(x[0][:, 0], x[1][:, 0], x[0][:, 1], x[1][:, 1], out=out, s_out=s_out)
    else:
        def call(x):
            ts.merge_states(x[0], x[1], out=out, s_out=s_out)
    t = time_cuda(call, sets, budget_s)
    return case_work("merge", p) / t / 1e12


def bracket_readings(key, before, after, notes):
    """A tessera figure (key: tessera_python, tessera_python_stream) from its readings before and
    after the peers: their mean, both kept in notes (<key>_before / _after); one reading alone when
    the other failed."""
    notes[key + "_before"], notes[key + "_after"] = before, after
    readings = [v for v in (before, after) if v is not None]
    return sum(readings) / len(readings) if readings else None


def measure_tessera_python(suite, p, budget_s, notes, peers):
    """Fills peers["tessera_python"] (and, for decode, "tessera_python_stream") or an error note."""
    try:
        if suite in ("prefill", "prefill_portable"):
            value, _ = tessera_prefill(p, budget_s, paged=False)
        elif suite == "prefill_paged":
            value, _ = tessera_prefill(p, budget_s, paged=True)
        elif suite == "decode":
            value, stream = tessera_decode(p, budget_s)
            peers["tessera_python_stream"] = stream
        elif suite == "append":
            value = tessera_append(p, budget_s)
        elif suite == "merge":
            value = tessera_merge(p, budget_s)
        else:
            raise RuntimeError("no Python-package runner for suite %s" % suite)
        peers["tessera_python"] = value
        notes["tessera_python"] = "tessera through its Python package (tessera %s), same process and timers as the peers" % (
            TESSERA["module"].__version__)
    except Exception as e:
        peers["tessera_python"] = None
        notes["tessera_python_error"] = error_text(e)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


RUNNERS = {"prefill": run_prefill, "prefill_portable": run_prefill, "prefill_paged": run_prefill,
           "prefill_plan": run_prefill_plan, "decode": run_decode, "moe_gemm": run_moe_gemm, "moe_layer": run_moe_layer,
           "append": run_append, "merge": run_merge}


# ----------------------------------------------------------------------------------------------
# Ceilings, measured once per run
# ----------------------------------------------------------------------------------------------

def measure_ceilings(names, budget_s):
    """Returns ({name: value}, {name: note or error})."""
    values, notes = {}, {}
    if "copy" in names or "read" in names:
        try:
            src = torch.randn(CEILING_BUFFER_BYTES // 2, device="cuda", dtype=torch.bfloat16)
            if "copy" in names:
                try:
                    dst = torch.empty_like(src)
                    t = time_cuda(lambda _: dst.copy_(src), [None], budget_s)
                    values["copy"] = 2 * CEILING_BUFFER_BYTES / t / 1e12
                    notes["copy"] = "torch copy_ of a %d GiB buffer, read + write counted" % (
                        CEILING_BUFFER_BYTES >> 30)
                    del dst
                except Exception as e:
                    notes["copy_error"] = error_text(e)
            if "read" in names:
                try:
                    as_fp32 = src.view(torch.float32)  # random bf16 pairs are finite fp32 values
                    t16 = time_cuda(lambda _: torch.sum(src), [None], budget_s)
                    t32 = time_cuda(lambda _: torch.sum(as_fp32), [None], budget_s)
                    r16, r32 = CEILING_BUFFER_BYTES / t16 / 1e12, CEILING_BUFFER_BYTES / t32 / 1e12
                    values["read"] = max(r16, r32)
                    notes["read"] = ("torch.sum (torch's reduction kernel, not a pure streaming read) over "
                                     "%d GiB: bf16 %.2f, fp32 %.2f TB/s; the higher is used" % (
                                         CEILING_BUFFER_BYTES >> 30, r16, r32))
                except Exception as e:
                    notes["read_error"] = error_text(e)
            del src
        except Exception as e:
            for k in ("copy", "read"):
                if k in names:
                    notes[k + "_error"] = error_text(e)
        torch.cuda.empty_cache()
    if "gemm" in names:
        try:
            s = GEMM_CEILING_SIZE
            values["gemm"] = dense_gemm_tflops(s, s, s, budget_s)
            notes["gemm"] = "torch.mm bf16 %d^3 (cuBLAS)" % s
        except Exception as e:
            notes["gemm_error"] = error_text(e)
        torch.cuda.empty_cache()
    return values, notes


def gpu_clocks():
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:
        return "nvidia-smi failed: " + error_text(e)


# ----------------------------------------------------------------------------------------------
# Run, merge, report
# ----------------------------------------------------------------------------------------------

def git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        r = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "unknown"
    except Exception:
        return "unknown"


def run_all(suites, args):
    needed = sorted({c for suite, _, _ in suites for c in SUITES[suite]["ceilings"]})
    t0 = time.perf_counter()
    ceil_values, ceil_notes = measure_ceilings(needed, args.time_per_peer)
    print("ceilings: %s (%.1f s)" % (", ".join("%s %.2f" % kv for kv in sorted(ceil_values.items())),
                                     time.perf_counter() - t0), flush=True)
    records = []
    for suite, metric, cases in suites:
        for case in cases:
            p = params_of(case)
            t_case = time.perf_counter()
            # --tessera-python: tessera is timed before and after the peers and the two readings
            # averaged, so that its figure brackets the thermal state the peers ran in (timed only
            # after them, it ran hottest: the power limit lowers the clock over a suite).
            before_peers, before_notes = {}, {}
            if args.tessera_python:
                measure_tessera_python(suite, p, args.time_per_peer, before_notes, before_peers)
            try:
                peers, notes, ceiling = RUNNERS[suite](p, args)
            except Exception as e:  # the case's own setup failed (e.g. out of memory)
                peers = {name: None for name in SUITES[suite]["peers"]}
                notes, ceiling = {"setup_error": error_text(e)}, {}
            tessera_value = None
            if args.tessera_python:
                peers, notes = dict(peers), dict(notes)
                measure_tessera_python(suite, p, args.time_per_peer, notes, peers)
                if "tessera_python_error" in before_notes:
                    notes["tessera_python_before_error"] = before_notes["tessera_python_error"]
                tessera_value = bracket_readings("tessera_python", before_peers.get("tessera_python"),
                                                 peers.pop("tessera_python"), notes)
                if suite == "decode" and "tessera_python_stream" in peers:
                    notes["stream_tbs"] = bracket_readings("tessera_python_stream", before_peers.get("tessera_python_stream"),
                                                           peers.pop("tessera_python_stream"), notes)
                if "tessera_python" in notes:
                    notes["tessera"] = notes.pop("tessera_python")
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            for name in SUITES[suite]["ceilings"]:
                if name in ceil_values:
                    ceiling[name] = ceil_values[name]
                for key in (name, name + "_error"):
                    if key in ceil_notes:
                        notes[key] = ceil_notes[key]
            records.append({"suite": suite, "case": case["name"], "metric": metric, "tessera": tessera_value,
                            "peers": peers, "ceiling": ceiling, "params": p, "notes": notes})
            print("%-16s %-30s %s  (%.1f s)" % (suite, case["name"], ", ".join(
                "%s %s" % (k, fmt(v)) for k, v in peers.items()), time.perf_counter() - t_case), flush=True)
        release_moe_weights()  # held across one suite's cases of a shape, not beyond
    return records


def merge_into(existing, records):
    """Fills peers/ceilings of the existing (tessera) records; adds records tessera did not write."""
    index = {(r["suite"], r["case"]): r for r in existing.get("records", [])}
    for rec in records:
        old = index.get((rec["suite"], rec["case"]))
        if old is None:
            existing.setdefault("records", []).append(rec)
            continue
        old.setdefault("peers", {}).update(rec["peers"])
        if rec.get("tessera") is not None:  # --tessera-python: the package's figure beside the C++ one
            old["peers"]["tessera_python"] = rec["tessera"]
            if "stream_tbs" in rec["notes"]:
                old["peers"]["tessera_python_stream"] = rec["notes"].pop("stream_tbs")
            rec["notes"]["tessera_python"] = rec["notes"].pop("tessera", "")
        # decode: tessera and the peers must have run the same per-request lengths; MoE: the same
        # rows per expert
        for key, what in (("kv_tokens", "KV tokens: the length generators disagree"),
                          ("expert_rows_fnv", "rows per expert (FNV-1a of the counts): the routings disagree")):
            ours, theirs = old.get("notes", {}).get(key), rec["notes"].get(key)
            if ours is not None and theirs is not None and ours != theirs:
                old["notes"][key + "_error"] = "tessera %s, the peers %s %s" % (ours, theirs, what)
        ceiling = old.setdefault("ceiling", {})
        renamed = {}  # torch ceiling name -> name used in the record (tessera's own value keeps its key)
        for k, v in rec["ceiling"].items():
            renamed[k] = k + "_torch" if k in ceiling else k
            ceiling[renamed[k]] = v
        notes = old.setdefault("notes", {})
        for k, v in rec["notes"].items():
            base, suffix = (k[:-6], "_error") if k.endswith("_error") else (k, "")
            key = renamed.get(base, base) + suffix
            notes[key + "_torch" if key in notes else key] = v
        for k, v in rec["params"].items():
            old.setdefault("params", {}).setdefault(k, v)
        old.setdefault("metric", rec["metric"])
        old.setdefault("tessera", None)
    return existing


def fmt(v):
    if v is None:
        return "-"
    return "%.1f" % v if abs(v) >= 10 else "%.2f" % v


def print_table(doc):
    by_suite = {}
    for r in doc["records"]:
        by_suite.setdefault(r["suite"], []).append(r)
    for suite, recs in by_suite.items():
        peer_names = []
        for r in recs:
            peer_names += [k for k in r.get("peers", {}) if k not in peer_names]
        print("\n%s (%s)" % (suite, recs[0].get("metric", "")))
        # tessera/best: tessera's own benchmark (another process, another moment) over the best peer;
        # python/best: tessera through its package, timed in the peers' process between them
        # (--tessera-python), over the best peer: the comparison over equal conditions.
        same_process = "tessera_python" in peer_names
        header = ["case", "tessera"] + peer_names + ["tessera/best"] + (["python/best"] if same_process else [])
        rows = []
        for r in recs:
            peers = r.get("peers", {})
            # Per-launch peers only: *_stream peers compare with tessera's stream_tbs, not its figure.
            vals = [v for k, v in peers.items() if v and not k.endswith("_stream") and not k.startswith("tessera")]
            ratio = r.get("tessera") / max(vals) if r.get("tessera") and vals else None
            row = [r["case"], fmt(r.get("tessera"))] + [fmt(peers.get(k)) for k in peer_names] + [
                "-" if ratio is None else "%.2f" % ratio]
            if same_process:
                py = peers.get("tessera_python")
                row.append("-" if not py or not vals else "%.2f" % (py / max(vals)))
            rows.append(row)
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        for row in [header] + rows:
            print("  " + "  ".join(str(x).rjust(w) if i else str(x).ljust(w)
                                   for i, (x, w) in enumerate(zip(row, widths))))
    errors = [(r["suite"], r["case"], k, v) for r in doc["records"]
              for k, v in r.get("notes", {}).items() if k.endswith("_error")]
    if errors:
        print("\nerrors:")
        for e in errors:
            print("  %s %s %s: %s" % e)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases"))
    ap.add_argument("--out", help="results JSON to write")
    ap.add_argument("--merge-into", help="existing results JSON (from tessera's benchmark) to fill in")
    ap.add_argument("--suites", help="comma-separated suites to run (default: every case file)")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--dry-run", action="store_true", help="parse the cases and print the plan; no torch")
    ap.add_argument("--time-per-peer", type=float, default=0.25,
                    help="seconds of timed calls per measurement beyond the minimum of 20 (default 0.25)")
    ap.add_argument("--flex-budget", type=float, default=75.0,
                    help="seconds of flex_attention compilation after which flex is skipped (default 75)")
    ap.add_argument("--no-flex", action="store_true", help="skip the flex peer")
    ap.add_argument("--no-flashinfer", action="store_true", help="skip the flashinfer peer (prefill suites, decode)")
    ap.add_argument("--flashinfer-backend", default="auto", choices=["auto", "fa2", "fa3"],
                    help="FlashInfer prefill backend of the prefill suites (default auto: fa3, its FlashAttention-3 "
                         "template, on sm_90); the decode peer times its own two kernels")
    ap.add_argument("--tessera-python", action="store_true",
                    help="also time tessera through its Python package (import tessera) in this process")
    args = ap.parse_args(argv)
    args.suites = [s.strip() for s in args.suites.split(",") if s.strip()] if args.suites else None
    if not args.dry_run and not args.out:
        ap.error("--out is required (or --dry-run)")
    return args


def main(argv=None):
    args = parse_args(argv)
    suites = load_cases(args.cases, args.suites)
    if args.dry_run:
        print_plan(suites)
        return 0

    global torch, F
    import torch as torch_module
    import torch.nn.functional as functional
    torch, F = torch_module, functional
    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 1
    TORCH_DTYPE.update(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)
    if args.tessera_python:
        import tessera
        TESSERA["module"] = tessera
    # flex_attention compiles once per shape: keep dynamo from falling back to eager (which
    # materialises the scores) when the number of shapes passes its recompile limit.
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 1024)
    torch.manual_seed(0)

    t0 = time.perf_counter()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": str(torch.backends.cudnn.version()), "clocks_start": gpu_clocks()}
    records = run_all(suites, args)
    if FLASHINFER["module"] is not None or FLASHINFER["error"] is not None:
        env["flashinfer"] = flashinfer_env()
    env["clocks_end"] = gpu_clocks()
    env["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env["gpu"] = torch.cuda.get_device_name()
    env["seconds"] = round(time.perf_counter() - t0, 1)
    env["units"] = "peers in the record's metric; ceilings gemm* TFLOP/s, copy*/read* TB/s"
    env["timing"] = ("median of per-call CUDA-event times over >= 20 calls and >= --time-per-peer seconds "
                     "after >= 3 calls and 50 ms of warm-up (tessera_bench's median_ms is the same protocol); "
                     "each batch of 20 calls is enqueued behind a torch.cuda._sleep spin kernel, so host/launch "
                     "overhead is excluded" + ("; tessera_python is the mean of its readings before and after "
                                               "the peers of each case" if args.tessera_python else ""))

    if args.merge_into:
        with open(args.merge_into) as f:
            doc = merge_into(json.load(f), records)
    else:
        doc = {"commit": args.commit or git_commit(), "gpu": env["gpu"], "date": env["date"], "records": records}
    if args.merge_into:  # keep tessera's commit, gpu and date; fill them only when absent
        doc.setdefault("commit", args.commit or git_commit())
        doc.setdefault("gpu", env["gpu"])
        doc.setdefault("date", env["date"])
    doc["peers_env"] = env
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print_table(doc)
    print("\nwrote %s (%.0f s)" % (args.out, env["seconds"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
