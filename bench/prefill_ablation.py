#!/usr/bin/env python3
"""Times every case of a prefill suite (the case file's "suite": prefill, prefill_paged,
prefill_plan) under each variant of the prefill kernels, in one process per (case, variant), and
prints a table of TFLOP/s with each variant's ratio to the first.

  python3 bench/prefill_ablation.py --bench build/bench/tessera_bench --out OUT.jsonl \
      [--cases bench/cases/prefill.json] [--variants auto,portable,persistent_inner,...] [--filter hd128]
      [--builds new=build/bench/tessera_bench,old=other/tessera_bench] [--rounds 2]

--columns BUILD:VARIANT,... names the columns one by one instead of every (build, variant) pair.

The suite may also be `decode` (bench/cases/decode.json; TB/s), with the merge variants below.

--builds compares benchmark binaries of other builds (ablation switches, older trees): every
(build, variant) pair is a column, timed one after another for each case, and --rounds repeats
the whole pass (interleaved rounds: clocks and power drift between rounds, not between columns);
the table shows each column's median over the rounds.

Variants (tessera_bench prefill parameters):
  auto                    what the dispatcher picks
  portable                the portable (sm_80) family forced
  hopper                  the Hopper family forced, its default schedule
  persistent_inner        Hopper, one CTA per SM, each head's query tiles together
  persistent_outer_heavy  Hopper, one CTA per SM, the last query tile of every head first
  persistent_mirror       Hopper, one CTA per SM taking a query tile and its mirror (last + first, ...)
  single_inner            Hopper, one tile per CTA, each head's query tiles together
  single_outer_heavy      Hopper, one tile per CTA, the last query tile of every head first
  gqa_packed              packed GQA wherever the group allows it (a KV head's query heads in one tile)
  gqa_unpacked            no packed GQA (one query head a tile)
  no_split                the plan's KV split forced to 1 (prefill_paged / prefill_plan suites)
  kv128, kv160, kv192     the Hopper family's K / V tile width forced (hd128 has 128 and 192;
                          the dispatcher takes 192 for long rows; 160 where the build has it)
  merge_in_decode         decode: split requests merge in the decode kernel (merge_kernel=0)
  merge_kernel            decode: split requests merge in the second merge kernel (merge_kernel=1)
Extra `key=value` arguments after `--` go to every tessera_bench call.
"""
import argparse
import json
import statistics
import subprocess
import sys

VARIANTS = {
    "auto": [],
    "portable": ["path=portable"],
    "hopper": ["path=hopper"],
    "persistent_inner": ["path=hopper", "scheduler=persistent", "order=inner", "heavy_first=false"],
    "persistent_outer_heavy": ["path=hopper", "scheduler=persistent", "order=outer", "heavy_first=true"],
    "persistent_inner_heavy": ["path=hopper", "scheduler=persistent", "order=inner", "heavy_first=true"],
    "persistent_mirror": ["path=hopper", "scheduler=persistent", "order=mirror", "run_length=2"],
    "single_inner": ["path=hopper", "scheduler=single", "order=inner", "heavy_first=false"],
    "single_outer_heavy": ["path=hopper", "scheduler=single", "order=outer", "heavy_first=true"],
    "gqa_packed": ["gqa_pack=on"],
    "gqa_unpacked": ["gqa_pack=off"],
    "no_split": ["kv_splits=1"],
    "kv128": ["kv_tile=128"],
    "kv160": ["kv_tile=160"],
    "kv192": ["kv_tile=192"],
    "merge_in_decode": ["merge_kernel=0"],
    "merge_kernel": ["merge_kernel=1"],
}


def case_args(case):
    def value(v):
        if isinstance(v, bool):
            return str(v).lower()
        return ",".join(str(x) for x in v) if isinstance(v, list) else v
    return [f"{k}={value(v)}" for k, v in case.items()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="build/bench/tessera_bench")
    ap.add_argument("--cases", default="bench/cases/prefill.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="auto,portable,persistent_inner,persistent_outer_heavy,single_inner,"
                                          "single_outer_heavy")
    ap.add_argument("--filter", default="", help="only cases whose name contains this")
    ap.add_argument("--builds", default="", help="name=tessera_bench path, comma-separated (default: --bench)")
    ap.add_argument("--columns", default="", help="BUILD:VARIANT pairs, comma-separated (default: every pair)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds one tessera_bench call may take; a call past it counts as failed")
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    with open(args.cases) as f:
        spec = json.load(f)
    builds = dict(b.split("=", 1) for b in args.builds.split(",") if b) if args.builds else {"": args.bench}
    columns = [(b, v) for b in builds for v in args.variants.split(",") if v]
    if args.columns:
        columns = [tuple(c.split(":", 1)) for c in args.columns.split(",") if c]
        for b, v in columns:
            if b not in builds or v not in VARIANTS:
                ap.error(f"--columns: unknown build or variant in {b}:{v}")
    name = {c: f"{c[0]}:{c[1]}" if c[0] else c[1] for c in columns}
    variants = [name[c] for c in columns]
    cases = [c for c in spec["cases"] if args.filter in c["name"]]
    readings = {(case["name"], name[c]): [] for case in cases for c in columns}
    with open(args.out, "w") as out:
        for rnd in range(args.rounds):
            for case in cases:
                for build, v in columns:
                    cmd = [builds[build], spec.get("suite", "prefill")] + case_args(case) + VARIANTS[v] + args.extra
                    try:
                        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                    except subprocess.TimeoutExpired:
                        proc = subprocess.CompletedProcess(cmd, -1, "", f"timed out after {args.timeout} s")
                    rec = None
                    for line in reversed(proc.stdout.strip().splitlines()):
                        if line.startswith("{"):
                            rec = json.loads(line)
                            break
                    tag = {"variant": v, "round": rnd, **({"build": build} if build else {})}
                    if proc.returncode != 0 or rec is None:
                        readings[(case["name"], name[(build, v)])].append(None)
                        out.write(json.dumps({"case": case["name"], **tag, "error": proc.stderr[-500:]}) + "\n")
                    else:
                        readings[(case["name"], name[(build, v)])].append(rec["tessera"])
                        out.write(json.dumps(dict(rec, **tag)) + "\n")
                    out.flush()
    rows = []
    for case in cases:
        row = {"case": case["name"]}
        for v in variants:
            got = readings[(case["name"], v)]
            row[v] = None if None in got else statistics.median(got)
        rows.append(row)
    base = variants[0]
    print(f"{'case':28s}" + "".join(f"{v[:22]:>24s}" for v in variants))
    for row in rows:
        cells = []
        for v in variants:
            x = row[v]
            if x is None:
                cells.append(f"{'FAILED':>24s}")
            elif v == base or not row[base]:
                cells.append(f"{x:24.4g}")
            else:
                cells.append(f"{x:15.4g} ({x / row[base]:5.3f}x)")
        print(f"{row['case']:28s}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
