#!/usr/bin/env bash
# On a machine with a GPU: each GPU test of a filter in its own process under a timeout, so a test
# that hangs is named (with the last step it started, timestamped: TESSERA_TEST_PROGRESS=1 in the
# prefill tests) and the others still run.
#   scripts/run_gpu_tests_each.sh OUTDIR [FILTER] [SECONDS_PER_TEST] [TESTS_BINARY]
# FILTER: a gtest filter (default GpuPrefill*); SECONDS_PER_TEST: default 300; TESTS_BINARY:
# default build/tests/tessera_tests. Writes OUTDIR/tests.txt (name, PASS / SKIP / FAIL / TIMEOUT,
# milliseconds) and OUTDIR/<test>.log for each test that did not pass. Exit status 1 if any did not.
set -uo pipefail
out=${1:?usage: run_gpu_tests_each.sh OUTDIR [FILTER] [SECONDS_PER_TEST] [TESTS_BINARY]}
filter=${2:-GpuPrefill*}
limit=${3:-300}
tests=${4:-build/tests/tessera_tests}
mkdir -p "$out"
: > "$out/tests.txt"
status=0
names=$("$tests" --gtest_filter="$filter" --gtest_list_tests | awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}')
for name in $names; do
  log="$out/${name//[^A-Za-z0-9_.]/_}.log"
  start=$(date +%s%N)
  TESSERA_TEST_PROGRESS=1 timeout -k 5 "$limit" "$tests" --gtest_filter="$name" > "$log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  result=PASS
  [ $rc -eq 0 ] && grep -q '^\[  SKIPPED \]' "$log" && result=SKIP
  [ $rc -ne 0 ] && result=FAIL
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && result=TIMEOUT
  printf '%-72s %-8s %8d ms\n' "$name" "$result" "$ms" | tee -a "$out/tests.txt"
  if [ $result = PASS ] || [ $result = SKIP ]; then rm -f "$log"; else status=1; grep -E '^ *[0-9.]+ s (run|reference)' "$log" | tail -1; fi
done
exit $status
