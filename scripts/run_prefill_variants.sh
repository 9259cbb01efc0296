#!/usr/bin/env bash
# On a GPU machine: times the variants built by scripts/build_prefill_variants.sh against each other
# with bench/prefill_ablation.py (interleaved rounds, medians), on the hd128 cases of the ragged and
# the paged prefill suites.
#   scripts/run_prefill_variants.sh OUTDIR VARIANT_DIR [ROUNDS]
# VARIANT_DIR holds bench_NAME.xz (or bench_NAME); the first name in sorted order is the baseline
# unless one is called base. Environment: RAGGED_FILTER (default hd128_s: the MHA hd128 cases),
# PAGED_FILTER (default s8192: the paged 8K cases, every page size), RAGGED_VARIANTS / PAGED_VARIANTS
# (comma lists of names, default all). Writes OUTDIR/ragged.{jsonl,txt}, OUTDIR/paged.{jsonl,txt}.
set -uo pipefail
out=${1:?usage: run_prefill_variants.sh OUTDIR VARIANT_DIR [ROUNDS]}
variants=${2:?usage: run_prefill_variants.sh OUTDIR VARIANT_DIR [ROUNDS]}
rounds=${3:-2}
cd "$(dirname "$0")/.."
mkdir -p "$out"
bin=$(mktemp -d)
for f in "$variants"/bench_*; do
  name=$(basename "$f"); name=${name#bench_}; name=${name%.xz}
  case "$f" in *.xz) xz -dc "$f" > "$bin/$name" ;; *) cp "$f" "$bin/$name" ;; esac
  chmod +x "$bin/$name"
done
builds_of() {  # the --builds list of a comma list of names (empty: all), base first
  local names=${1:-$(ls "$bin" | tr '\n' ',')} list=""
  [ -x "$bin/base" ] && list="base=$bin/base"
  for n in ${names//,/ }; do
    [ "$n" = base ] && continue
    [ -x "$bin/$n" ] || { echo "run_prefill_variants.sh: no variant $n" >&2; continue; }
    list="${list:+$list,}$n=$bin/$n"
  done
  echo "$list"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$out/info.txt" 2>&1
status=0
python3 bench/prefill_ablation.py --builds "$(builds_of "${RAGGED_VARIANTS:-}")" --variants auto --rounds "$rounds" \
  --cases bench/cases/prefill.json --filter "${RAGGED_FILTER:-hd128_s}" --out "$out/ragged.jsonl" > "$out/ragged.txt" 2>&1 || status=1
cat "$out/ragged.txt"
python3 bench/prefill_ablation.py --builds "$(builds_of "${PAGED_VARIANTS:-}")" --variants auto --rounds "$rounds" \
  --cases bench/cases/prefill_paged.json --filter "${PAGED_FILTER:-s8192}" --out "$out/paged.jsonl" > "$out/paged.txt" 2>&1 || status=1
cat "$out/paged.txt"
rm -rf "$bin"
exit $status
