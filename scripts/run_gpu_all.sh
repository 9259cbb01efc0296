#!/usr/bin/env bash
# On a machine with a GPU: every GPU test, the benchmarks and the peers in one go.
#   scripts/run_gpu_all.sh OUTDIR [BUILD_DIR]
# Writes into OUTDIR: info.txt, run.txt, tests.log (+ tests.xml), sanitizer.log (the summary;
# sanitizer_<tool>.log and sanitizers.json from scripts/run_sanitizers.sh), host_calls.txt and
# plan_bench.txt (host costs of plan()), bench.log, results.json (tessera and peers from this one run). Reuses BUILD_DIR (default build/) when it
# holds a build; otherwise configures and builds it (needs CUTLASS headers: scripts/setup.sh).
# Environment: TESSERA_COMMIT (recorded in results.json), BENCH_SUITES / PEER_SUITES (comma lists,
# default all), TEST_FILTER (gtest filter, default all), SKIP_SANITIZER=1, SKIP_BENCH=1,
# PEER_ARGS (extra bench/peers.py arguments, e.g. --no-flex, --tessera-python).
# Where the Python package is installed (pip install of a scripts/build_wheel.sh wheel), its pytest
# suite and the run() overhead benchmark run too: python_tests.log, python_overhead.log.
set -uo pipefail
out=${1:?usage: run_gpu_all.sh OUTDIR [BUILD_DIR]}
build=${2:-build}
mkdir -p "$out"
cd "$(dirname "$0")/.."
status=0

if [ ! -x "$build/tests/tessera_tests" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release && cmake --build "$build" -j "$(nproc)" || exit 1
fi

"$build/tools/tessera" info | tee "$out/info.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv >> "$out/info.txt" 2>&1
"$build/tools/tessera" run > "$out/run.txt" 2>&1 || { echo "tessera run FAILED"; status=1; }

echo "== tests"
"$build/tests/tessera_tests" ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} --gtest_output=xml:"$out/tests.xml" > "$out/tests.log" 2>&1 || { echo "tests FAILED"; status=1; }
tail -3 "$out/tests.log"
grep -E "^\[  (FAILED|SKIPPED) " "$out/tests.log" | head -20

if command -v compute-sanitizer >/dev/null && [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  # racecheck sees shared-memory hazards only: it is run on the kernels that use shared memory.
  echo "== compute-sanitizer (memcheck, racecheck) on the GPU suites"
  TOOLS="memcheck racecheck" FILTER='Gpu*' SECONDS_PER_TOOL=${SECONDS_PER_TOOL:-86400} \
    RACECHECK_FILTER='GpuPrefill.ForcedPaths:GpuPrefill.GqaGroupsStridesAndScale:GpuPrefill.CompactTileShapeForLessSharedMemory:GpuDecode.PageSizesAndLayouts:GpuDecode.OneCtaPerSmShape:GpuDecodeSplit.LongRequestAlone:GpuPrefillPaged.PagedEqualsRagged:GpuPrefillPaged.CompactTileShapeForLessSharedMemory:GpuMoeGemm.StridedViews:GpuMoeGemm.OffsetsFromMoePermute:GpuFusedMoe.SharedExpert' \
    scripts/run_sanitizers.sh "$out" "$build" | tee "$out/sanitizer.log"
fi

if (cd /tmp && python3 -c "import tessera" 2>/dev/null); then
  echo "== python package"
  python3 -m pytest -q -rs python/tests > "$out/python_tests.log" 2>&1 || { echo "python tests FAILED"; status=1; }
  tail -3 "$out/python_tests.log"
  python3 bench/python_overhead.py > "$out/python_overhead.log" 2>&1 || { echo "python overhead over target or FAILED"; status=1; }
  cat "$out/python_overhead.log"
else
  echo "== python package: not installed (scripts/build_wheel.sh, then pip install the wheel), skipped"
fi

[ "${SKIP_BENCH:-0}" = 1 ] && exit $status
# The host side of plan(): the CUDA calls' cost on this host (copy enqueue by size) and the
# planners alone (hot and after evicting the caches), for the plan-time targets.
if [ -x "$build/bench/tessera_plan_bench" ]; then
  echo "== host costs"
  "$build/bench/tessera_bench" host_calls > "$out/host_calls.txt" 2>&1 || { echo "host_calls FAILED"; status=1; }
  "$build/bench/tessera_plan_bench" 2000 > "$out/plan_bench.txt" 2>&1 || { echo "plan_bench FAILED"; status=1; }
fi
echo "== benchmarks"
python3 bench/run_bench.py --bench "$build/bench/tessera_bench" --cases bench/cases \
  --out "$out/results.json" ${TESSERA_COMMIT:+--commit $TESSERA_COMMIT} ${BENCH_SUITES:+--suites $BENCH_SUITES} > "$out/bench.log" 2>&1 || { echo "bench FAILED"; status=1; }
tail -12 "$out/bench.log"
echo "== peers"
python3 bench/peers.py --cases bench/cases --out "$out/results.json" --merge-into "$out/results.json" \
  ${PEER_SUITES:+--suites $PEER_SUITES} ${PEER_ARGS:-} > "$out/peers.log" 2>&1 || { echo "peers FAILED"; status=1; }
tail -40 "$out/peers.log"
exit $status
