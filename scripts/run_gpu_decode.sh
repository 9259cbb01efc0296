#!/usr/bin/env bash
# On a machine with a GPU: the decode GPU tests, the decode suite's benchmark (optionally a second
# binary alongside, for an A/B of two builds in the same run) and its peers, in one go.
#   scripts/run_gpu_decode.sh OUTDIR [BIN_DIR] [BASELINE_BENCH]
# BIN_DIR holds tessera_tests, tessera_bench and tessera (default build/: build/tests, build/bench,
# build/tools); BASELINE_BENCH is another tessera_bench run over the same cases after this one.
# Writes OUTDIR/{info.txt,tests.log,decode.json,baseline.json,bench.log}.
# Environment: TEST_FILTER (gtest filter, default the decode suites), SUITES (default decode),
# SKIP_TESTS=1, SKIP_PEERS=1, PEER_ARGS (extra bench/peers.py arguments), COMMIT.
set -uo pipefail
out=${1:?usage: run_gpu_decode.sh OUTDIR [BIN_DIR] [BASELINE_BENCH]}
bin=${2:-}
baseline=${3:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
tests=${bin:+$bin/}tessera_tests; bench=${bin:+$bin/}tessera_bench; tool=${bin:+$bin/}tessera
[ -n "$bin" ] || { tests=build/tests/tessera_tests; bench=build/bench/tessera_bench; tool=build/tools/tessera; }
suites=${SUITES:-decode}
status=0

"$tool" info | tee "$out/info.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv >> "$out/info.txt" 2>&1

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== tests"
  timeout "${TEST_TIMEOUT:-900}" "$tests" --gtest_filter="${TEST_FILTER:-GpuDecode*}" > "$out/tests.log" 2>&1 ||
    { echo "tests FAILED (exit $?)"; status=1; }
  tail -3 "$out/tests.log"
  grep -E "^\[  (FAILED|SKIPPED) |Failure|error" "$out/tests.log" | head -30
fi

echo "== bench"
python3 bench/run_bench.py --bench "$bench" --suites "$suites" --out "$out/decode.json" ${COMMIT:+--commit $COMMIT} \
  > "$out/bench.log" 2>&1 || { echo "bench FAILED"; status=1; }
if [ -n "$baseline" ]; then
  python3 bench/run_bench.py --bench "$baseline" --suites "$suites" --out "$out/baseline.json" \
    >> "$out/bench.log" 2>&1 || { echo "baseline bench FAILED"; status=1; }
fi
if [ "${SKIP_PEERS:-0}" != 1 ]; then
  echo "== peers"
  python3 bench/peers.py --cases bench/cases --suites "$suites" --merge-into "$out/decode.json" --out "$out/decode.json" ${PEER_ARGS:-} \
    >> "$out/bench.log" 2>&1 || { echo "peers FAILED"; status=1; }
fi
tail -5 "$out/bench.log"
exit $status
