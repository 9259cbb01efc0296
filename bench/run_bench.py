#!/usr/bin/env python3
"""Runs tessera's benchmarks over the case files and writes one results file.

  python3 bench/run_bench.py --bench build/bench/tessera_bench --cases bench/cases --out OUT.json

Measures the memory ceilings (`copy`, `read`) and the per-launch floor of the timing method
(`launch_us`, an empty one-wave kernel) once with tessera_bench, then runs every case of the
suites tessera implements, one process per case, and writes
  {"commit", "gpu", "date", "records": [{suite, case, metric, tessera, peers, ceiling, params}]}.
bench/peers.py --merge-into OUT.json then adds the peers measured in the same run.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

# Suites with a tessera benchmark, and the ceilings their records are compared with. The MoE
# suites compare their touched-weight read rate (notes weight_gbs) with the read ceiling:
# notes weight_read_fraction.
TESSERA_SUITES = {"append": ["copy", "read"], "merge": ["copy", "read"], "decode": ["copy", "read", "launch_us"],
                  "prefill_portable": [], "prefill": [], "prefill_paged": [], "prefill_plan": [], "memory": [],
                  "moe_gemm": ["read"], "moe_layer": ["read"]}


def case_arg(key, value):
    """One case field as tessera_bench's key=value: booleans lower-case, lists comma-separated
    (kv_lens=32768,16,300)."""
    if isinstance(value, bool):
        value = str(value).lower()
    elif isinstance(value, list):
        value = ",".join(str(v) for v in value)
    return f"{key}={value}"


def last_json_line(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in output:\n" + text)


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}")
    return last_json_line(proc.stdout)


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - not a git checkout on the GPU machine is fine
        return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="build/bench/tessera_bench")
    ap.add_argument("--cases", default="bench/cases")
    ap.add_argument("--out", required=True)
    ap.add_argument("--suites", default=",".join(TESSERA_SUITES))
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()

    ceiling = run([args.bench, "ceiling"])
    results = {
        "commit": args.commit or os.environ.get("TESSERA_COMMIT") or git_commit(),
        "gpu": ceiling["gpu"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "records": [],
    }
    wanted = [s for s in args.suites.split(",") if s]
    for fname in sorted(os.listdir(args.cases)):
        if not fname.endswith(".json"):
            continue
        with open(os.path.join(args.cases, fname)) as f:
            spec = json.load(f)
        suite = spec["suite"]
        if suite not in TESSERA_SUITES or suite not in wanted:
            continue
        for case in spec["cases"]:
            params = {k: v for k, v in case.items()}
            kv = [case_arg(k, v) for k, v in params.items()]
            record = {"suite": suite, "case": case["name"], "metric": spec["metric"],
                      "tessera": None, "peers": {}, "params": params,
                      "ceiling": {k: ceiling[k] for k in TESSERA_SUITES[suite]}}
            try:
                out = run([args.bench, suite] + kv)
                record["tessera"] = out["tessera"]
                record["notes"] = {k: v for k, v in out.items()
                                   if k not in ("suite", "case", "metric", "tessera")}
                if "weight_gbs" in record["notes"] and ceiling.get("read"):
                    record["notes"]["weight_read_fraction"] = round(
                        record["notes"]["weight_gbs"] / 1e3 / ceiling["read"], 4)
            except Exception as e:  # noqa: BLE001 - record the failure, keep going
                record["notes"] = {"error": str(e)}
            results["records"].append(record)

    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"copy ceiling {ceiling['copy']:.2f} TB/s, read ceiling {ceiling['read']:.2f} TB/s, "
          f"launch floor {ceiling['launch_us']:.2f} us")
    for r in results["records"]:
        t = r["tessera"]
        ratio = "" if t is None or "copy" not in r["ceiling"] else f"  {t / r['ceiling']['copy']:.1%} of copy"
        if "weight_read_fraction" in r.get("notes", {}):
            ratio += f"  weights read at {r['notes']['weight_read_fraction']:.1%} of the read ceiling"
        print(f"{r['suite']:8s} {r['case']:34s} {t if t is not None else 'FAILED'} {r['metric']}{ratio}")


if __name__ == "__main__":
    main()
