#!/usr/bin/env bash
# On a machine with a GPU: ncu profiles (--set full, source counters, clocks not locked) of
# tessera's Hopper prefill and FlashInfer's FA3 prefill on the same shapes, one launch each (the
# eleventh of bench/prefill_launches.py), written as ONE archive so that nothing is left behind by
# a transfer that caps the number of files:
#   scripts/profile_prefill.sh OUTDIR [CASES]
# CASES: "SEQ:CAUSAL ..." (default "8192:0 8192:1 1024:0") for ragged prefill, or
# "paged:QO_LEN:KV_LEN:BATCH" for chunked prefill over pages of 16 (bench/prefill_launches.py's
# paged workload, 32 / 8 heads, hd128, causal). Needs tessera importable (PYTHONPATH)
# and FlashInfer installed (bench/flashinfer/README.md). Writes OUTDIR/profiles.tar.xz holding, per
# case and library, NAME.ncu-rep, NAME.csv (the details page), NAME_raw.csv (every metric) and
# NAME_sass.csv (per-instruction counts and stall samples), and prints the headline metrics.
set -uo pipefail
out=${1:?usage: profile_prefill.sh OUTDIR [CASES]}
cases=${2:-"8192:0 8192:1 1024:0"}
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "profile_prefill.sh: no ncu found" >&2; exit 1; }
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
for c in $cases; do
  case $c in
    paged:*) IFS=: read -r _ qo kv batch <<< "$c"; suffix=_paged; args="$qo $kv $batch"; tag=q${qo}_kv${kv}_b${batch} ;;
    *) seq=${c%%:*}; causal=${c##*:}; suffix=; args="$seq $causal"; tag=s${seq}_c${causal} ;;
  esac
  for lib in tessera flashinfer; do
    name=${lib}${suffix}_${tag}
    filter="regex:prefill_sm90"; [ $lib = flashinfer ] && filter="regex:Prefill"
    "$ncu" --clock-control none --set full --import-source yes -k "$filter" --launch-skip 10 --launch-count 1 \
      -f -o "$work/$name" python3 "$here/bench/prefill_launches.py" $lib$suffix $args > "$work/$name.log" 2>&1
    "$ncu" -i "$work/$name.ncu-rep" --page details --csv > "$work/$name.csv" 2>/dev/null
    # Every collected metric, the per-pipe ones (sm__pipe_*_cycles_active, sm__inst_executed_pipe_*)
    # included: the details page shows the pipe utilisation only as a chart.
    "$ncu" -i "$work/$name.ncu-rep" --page raw --csv > "$work/${name}_raw.csv" 2>/dev/null
    "$ncu" -i "$work/$name.ncu-rep" --page source --csv --print-source sass > "$work/${name}_sass.csv" 2>/dev/null
    python3 - "$work/$name.csv" "$name" <<'PY'
import csv, sys
keep = ("Duration", "SM Frequency", "Issued Instructions", "Executed Ipc Active", "Compute (SM) Throughput", "L2 Hit Rate")
got = {}
for r in csv.DictReader(open(sys.argv[1])):
    n = r.get("Metric Name")
    if n in keep and n not in got: got[n] = r.get("Metric Value", "") + " " + r.get("Metric Unit", "")
print(sys.argv[2], "; ".join("%s %s" % (k, got.get(k, "-")) for k in keep))
PY
  done
done
mkdir -p "$out"
tar -C "$work" -cJf "$out/profiles.tar.xz" . && rm -rf "$work"
ls -la "$out/profiles.tar.xz"
