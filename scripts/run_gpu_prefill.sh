#!/usr/bin/env bash
# On a machine with a GPU: the prefill GPU tests, the prefill ablation (every kernel variant per
# case) and the PyTorch peers of the prefill suite, in one go.
#   scripts/run_gpu_prefill.sh OUTDIR [BIN_DIR]
# BIN_DIR holds tessera_tests, tessera_bench and tessera (default build/: build/tests, build/bench,
# build/tools). Writes OUTDIR/{info.txt,tests.log,ablation.jsonl,ablation.txt,peers.json,peers.log}.
# Environment: TEST_FILTER (gtest filter, default the prefill suites), VARIANTS (prefill_ablation.py
# --variants), CASE_FILTER (only cases whose name contains it), SKIP_TESTS=1, SKIP_PEERS=1,
# PEER_ARGS (extra bench/peers.py arguments; default --no-flex).
set -uo pipefail
out=${1:?usage: run_gpu_prefill.sh OUTDIR [BIN_DIR]}
bin=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
tests=${bin:+$bin/}tessera_tests; bench=${bin:+$bin/}tessera_bench; tool=${bin:+$bin/}tessera
[ -n "$bin" ] || { tests=build/tests/tessera_tests; bench=build/bench/tessera_bench; tool=build/tools/tessera; }
status=0

"$tool" info | tee "$out/info.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv >> "$out/info.txt" 2>&1

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== tests"
  timeout 900 "$tests" --gtest_filter="${TEST_FILTER:-GpuPrefill*:PrefillDispatch*}" > "$out/tests.log" 2>&1 ||
    { echo "tests FAILED (exit $?)"; status=1; }
  tail -3 "$out/tests.log"
  grep -E "^\[  (FAILED|SKIPPED) |Failure|error" "$out/tests.log" | head -30
fi

echo "== ablation"
python3 bench/prefill_ablation.py --bench "$bench" --out "$out/ablation.jsonl" \
  ${VARIANTS:+--variants $VARIANTS} ${CASE_FILTER:+--filter $CASE_FILTER} | tee "$out/ablation.txt" || status=1

if [ "${SKIP_PEERS:-0}" != 1 ]; then
  echo "== peers"
  python3 bench/peers.py --cases bench/cases --suites prefill --out "$out/peers.json" ${PEER_ARGS:---no-flex} \
    > "$out/peers.log" 2>&1 || { echo "peers FAILED"; status=1; }
  tail -25 "$out/peers.log"
fi
exit $status
