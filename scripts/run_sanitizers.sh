#!/usr/bin/env bash
# On a machine with a GPU: compute-sanitizer's four tools over the GPU test suites, one process a
# tool, each bounded in time. Writes OUTDIR/sanitizer_<tool>.log and OUTDIR/sanitizers.json (per
# tool: the error summary, the tests that ran and passed, whether it finished in time).
#   scripts/run_sanitizers.sh OUTDIR [BUILD_DIR]
# Environment: TOOLS (default "memcheck racecheck initcheck synccheck"), FILTER (gtest filter,
# default Gpu*), SECONDS_PER_TOOL (default 900), RACECHECK_FILTER (default: FILTER; racecheck
# models shared memory only and is the slowest, so a run may narrow it to the kernels that use it).
# Notes: racecheck does not model cp.async.bulk / TMA completing on an mbarrier and reports the
# decode tree merge's staging rounds as write-write hazards (notes/reliability.md, "Sanitizers");
# initcheck sees device memory written by the copy engine or by kernels, not host-pinned staging.
set -uo pipefail
out=${1:?usage: run_sanitizers.sh OUTDIR [BUILD_DIR]}
build=${2:-build}
mkdir -p "$out"
cd "$(dirname "$0")/.."
tools=${TOOLS:-memcheck racecheck initcheck synccheck}
filter=${FILTER:-Gpu*}
budget=${SECONDS_PER_TOOL:-900}
bin="$build/tests/tessera_tests"
[ -x "$bin" ] || { echo "run_sanitizers.sh: $bin not built"; exit 2; }
command -v compute-sanitizer >/dev/null || { echo "run_sanitizers.sh: compute-sanitizer not found"; exit 2; }
status=0
summary="$out/sanitizers.json"
echo "{" > "$summary"
first=1
for tool in $tools; do
  f=$filter
  [ "$tool" = racecheck ] && f=${RACECHECK_FILTER:-$filter}
  log="$out/sanitizer_$tool.log"
  start=$(date +%s)
  timeout --signal=INT "$budget" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 50 \
    "$bin" --gtest_filter="$f" > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  ran=$(grep -c '^\[       OK \]\|^\[  FAILED  \]\|^\[  SKIPPED \]' "$log")
  ok=$(grep -c '^\[       OK \]' "$log")
  failed=$(grep -c '^\[  FAILED  \] [A-Za-z]*\.[A-Za-z]* (' "$log")
  errors=$(grep -Eo '(ERROR|RACECHECK) SUMMARY: [0-9]+' "$log" | tail -1 | grep -Eo '[0-9]+$')
  finished=true
  [ $rc -eq 124 ] || [ $rc -eq 130 ] && finished=false
  [ $rc -ne 0 ] && status=1
  echo "$tool: rc $rc, ${secs}s, tests run $ran (ok $ok, failed $failed), errors ${errors:-?}, finished $finished"
  [ $first -eq 1 ] || echo "," >> "$summary"
  first=0
  printf '  "%s": {"rc": %d, "seconds": %d, "filter": "%s", "tests_run": %d, "tests_ok": %d, "tests_failed": %d, "errors": %s, "finished": %s}' \
    "$tool" "$rc" "$secs" "$f" "$ran" "$ok" "$failed" "${errors:-null}" "$finished" >> "$summary"
done
printf '\n}\n' >> "$summary"
exit $status
