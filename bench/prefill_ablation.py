#!/usr/bin/env python3
"""Times every case of the prefill suite under each variant of the prefill kernels, in one process
per (case, variant), and prints a table of TFLOP/s with each variant's ratio to the first.

  python3 bench/prefill_ablation.py --bench build/bench/tessera_bench --out OUT.jsonl \
      [--cases bench/cases/prefill.json] [--variants auto,portable,persistent_inner,...] [--filter hd128]

Variants (tessera_bench prefill parameters):
  auto                    what the dispatcher picks
  portable                the portable (sm_80) family forced
  hopper                  the Hopper family forced, its default schedule
  persistent_inner        Hopper, one CTA per SM, each head's query tiles together
  persistent_outer_heavy  Hopper, one CTA per SM, the last query tile of every head first
  persistent_mirror       Hopper, one CTA per SM taking a query tile and its mirror (last + first, ...)
  single_inner            Hopper, one tile per CTA, each head's query tiles together
  single_outer_heavy      Hopper, one tile per CTA, the last query tile of every head first
Extra `key=value` arguments after `--` go to every tessera_bench call.
"""
import argparse
import json
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
}


def case_args(case):
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in case.items()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="build/bench/tessera_bench")
    ap.add_argument("--cases", default="bench/cases/prefill.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="auto,portable,persistent_inner,persistent_outer_heavy,single_inner,"
                                          "single_outer_heavy")
    ap.add_argument("--filter", default="", help="only cases whose name contains this")
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    with open(args.cases) as f:
        spec = json.load(f)
    variants = [v for v in args.variants.split(",") if v]
    rows = []
    with open(args.out, "w") as out:
        for case in spec["cases"]:
            if args.filter not in case["name"]:
                continue
            row = {"case": case["name"]}
            for v in variants:
                cmd = [args.bench, "prefill"] + case_args(case) + VARIANTS[v] + args.extra
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                rec = None
                for line in reversed(proc.stdout.strip().splitlines()):
                    if line.startswith("{"):
                        rec = json.loads(line)
                        break
                if proc.returncode != 0 or rec is None:
                    row[v] = None
                    out.write(json.dumps({"case": case["name"], "variant": v, "error": proc.stderr[-500:]}) + "\n")
                else:
                    row[v] = rec["tessera"]
                    out.write(json.dumps(dict(rec, variant=v)) + "\n")
                out.flush()
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
                cells.append(f"{x:24.1f}")
            else:
                cells.append(f"{x:15.1f} ({x / row[base]:5.2f}x)")
        print(f"{row['case']:28s}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
