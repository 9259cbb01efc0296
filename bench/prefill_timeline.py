#!/usr/bin/env python3
"""Summarises the phase timeline of the Hopper prefill's consumer warpgroups (an experiment build:
cmake -DTESSERA_SM90_TIMELINE=ON; `tessera_bench prefill ... timeline=FILE` writes FILE, one CSV
line a work tile of a consumer, cycles of its SM's clock).

  python3 bench/prefill_timeline.py FILE [--consumers 2] [--clock-ghz 1.7]

Prints, over the records: each phase's cycles (median, mean, p90) and their share of a tile; the
KV loop's cycles a KV tile and its waits a KV tile; the gap between one tile's end and the same
consumer's next tile's start; how far the consumers of one CTA are apart at a tile's start; and
each SM's span (first start to last end), whose spread is the tail.
"""
import argparse
import csv
import statistics
import sys


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def row(name, xs, per_tile=None):
    if not xs:
        return
    mean = statistics.fmean(xs)
    share = "" if not per_tile else "  %5.1f%% of a tile" % (100.0 * mean / per_tile)
    print("  %-34s median %9.0f  mean %9.0f  p90 %9.0f%s" % (name, statistics.median(xs), mean, pct(xs, 0.9), share))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--consumers", type=int, default=2, help="consumer warpgroups a CTA (hd128 / hd256: 2, hd64: 3)")
    ap.add_argument("--clock-ghz", type=float, default=0.0, help="SM clock, to print microseconds too")
    args = ap.parse_args(argv)
    recs = []
    with open(args.file) as f:
        for r in csv.DictReader(f):
            recs.append({k: int(v) for k, v in r.items()})
    if not recs:
        sys.exit("no records in %s" % args.file)
    with_kv = [r for r in recs if r["kv_tiles"] > 0]
    tile = [r["epilogue_end"] for r in with_kv]
    per_tile = statistics.fmean(tile)
    print("%d records (%d with KV tiles), %d slots, %.1f KV tiles a tile on average" % (
        len(recs), len(with_kv), len({r["slot"] for r in recs}), statistics.fmean(r["kv_tiles"] for r in with_kv)))
    print("phases (cycles after the tile's start):")
    row("Q landed", [r["q_ready"] for r in with_kv], per_tile)
    row("first S done (after Q)", [r["first_scores"] - r["q_ready"] for r in with_kv], per_tile)
    loop = [r for r in with_kv if r["kv_tiles"] > 1]
    row("KV loop (after the first S)", [r["loop_end"] - r["first_scores"] for r in loop], per_tile)
    row("last P V (after the loop)", [r["last_values"] - r["loop_end"] for r in with_kv if r["kv_tiles"] > 1], per_tile)
    row("epilogue (after the last P V)", [r["epilogue_end"] - r["last_values"] for r in with_kv], per_tile)
    row("whole tile", tile, per_tile)
    # The epilogue's parts and the decode before a tile (columns of later builds; 0xffffffff: the
    # phase was not reached, e.g. O from registers).
    unset = 0xffffffff
    staged = [r for r in with_kv if r.get("out_staged", unset) != unset and r.get("out_normalised", unset) != unset]
    if staged:
        print("the epilogue's parts (tiles whose O went through shared memory):")
        row("O / l, LSE (after the last P V)", [r["out_normalised"] - r["last_values"] for r in staged], per_tile)
        row("O into shared memory, fence, barrier", [r["out_staged"] - r["out_normalised"] for r in staged], per_tile)
        row("stores issued, LSE, record", [r["epilogue_end"] - r["out_staged"] for r in staged], per_tile)
    decoded = [r["decode"] for r in recs if r.get("decode", unset) != unset]
    if decoded:
        row("decode of the tile (before its start)", decoded, per_tile)
    print("the KV loop, a KV tile (tiles with more than one):")
    n = lambda r: r["kv_tiles"] - 1
    row("loop cycles", [(r["loop_end"] - r["first_scores"]) / n(r) for r in loop])
    row("wait: K landed + turn", [r["wait_inputs"] / n(r) for r in loop])
    row("wait: S done", [r["wait_scores"] / n(r) for r in loop])
    row("wait: P V done", [r["wait_values"] / n(r) for r in loop])
    # Gaps between a consumer's consecutive tiles (the clock is per SM; a slot stays on one SM).
    by_slot = {}
    for r in recs:
        by_slot.setdefault(r["slot"], []).append(r)
    gaps = []
    for rs in by_slot.values():
        rs.sort(key=lambda r: r["ordinal"])
        for a, b in zip(rs, rs[1:]):
            gaps.append((b["tile_start"] - (a["tile_start"] + a["epilogue_end"])) & 0xffffffff)
    print("between tiles:")
    row("a tile's end to the next start", gaps)
    skew = []
    for slot, rs in by_slot.items():
        if slot % args.consumers:
            continue
        mates = [by_slot.get(slot + c, []) for c in range(args.consumers)]
        for i in range(min(len(m) for m in mates)):
            starts = [m[i]["tile_start"] for m in mates]
            skew.append((max(starts) - min(starts)) & 0xffffffff)
    row("consumers of a CTA apart at a start", skew)
    spans = {}
    for r in recs:
        s = spans.setdefault(r["sm"], [None, None])
        end = r["tile_start"] + r["epilogue_end"]
        s[0] = r["tile_start"] if s[0] is None else min(s[0], r["tile_start"])
        s[1] = end if s[1] is None else max(s[1], end)
    lengths = [b - a for a, b in spans.values()]
    print("per SM (first start to last end), %d SMs:" % len(lengths))
    row("span", lengths)
    print("  longest / median span: %.3f" % (max(lengths) / statistics.median(lengths)))
    if args.clock_ghz > 0:
        print("(at %.2f GHz a tile's mean is %.2f us)" % (args.clock_ghz, per_tile / (args.clock_ghz * 1e3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
