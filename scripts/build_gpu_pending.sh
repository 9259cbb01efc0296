#!/usr/bin/env bash
# Builds, on a machine without a GPU, every binary scripts/run_gpu_pending.sh times or tests, and
# writes them xz-compressed into BINDIR (about 45 MB in all):
#   tessera_tests, tessera_bench, tessera_plan_bench   this tree, sm_90 only (build-gpu/)
#   bench_NAME                                         the Hopper prefill's A/B switches, hd128 bf16
#                                                      (scripts/build_prefill_variants.sh)
#   tests_rlrg                                         tessera_tests with the gathered source's switches
#   bench_pp                                           hd128 bf16 with -DTESSERA_PLAN_PHASES=ON (plan()
#                                                      by phase)
#   bench_tl                                           hd128 bf16 with -DTESSERA_SM90_TIMELINE=ON (the
#                                                      consumers' phase timeline)
# (bench_old, an earlier commit's tessera_bench that step 6 compares against, is copied in by hand.)
#   scripts/build_gpu_pending.sh BINDIR
# Two cores: ~30 minutes from nothing, minutes when the build folders are there.
set -euo pipefail
bin=${1:?usage: build_gpu_pending.sh BINDIR}
cd "$(dirname "$0")/.."
mkdir -p "$bin"
bin=$(cd "$bin" && pwd)
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DTESSERA_PORTABLE_ARCHS=90-real -DTESSERA_BUILD_PYTHON=OFF -DTESSERA_BUILD_FUZZERS=OFF)
pack() { xz -T0 -6 -c "$1" > "$bin/$2.xz"; }

cmake -S . -B build-gpu "${cmake_args[@]}" > /dev/null
cmake --build build-gpu -j "$(nproc)" --target tessera_tests tessera_bench tessera_plan_bench > build-gpu/pending.log 2>&1 ||
  { echo "build of build-gpu failed (see build-gpu/pending.log)" >&2; exit 1; }
pack build-gpu/tests/tessera_tests tessera_tests
pack build-gpu/bench/tessera_bench tessera_bench
pack build-gpu/bench/tessera_plan_bench tessera_plan_bench

# The A/B owed (steps 3 and 14 of run_gpu_pending.sh): the gathered source's line copies and its
# producer's registers (notes/prefill_hopper.md, "The gathered source under ncu"), and the GPU
# tests of a build with both. (fl and the boundary and gathered-source switches wf, ka, nf, s3, t,
# kp, kpt were timed on 2026-12-07 and not adopted; build them the same way to time them again.
# The next-S-early walk, ns, was removed after its A/B: 441d92e has it.)
gather_flags=(-DTESSERA_SM90_GATHER_ROW_LINES=1 -DTESSERA_SM90_GATHER_PRODUCER_REGISTERS=1)
scripts/build_prefill_variants.sh "$bin" 'rl=-DTESSERA_SM90_GATHER_ROW_LINES=1' \
  'rg=-DTESSERA_SM90_GATHER_PRODUCER_REGISTERS=1' "rlrg=${gather_flags[*]}"
cmake -S . -B build-gpu-rlrg "${cmake_args[@]}" "-DCMAKE_CUDA_FLAGS=${gather_flags[*]}" > /dev/null
cmake --build build-gpu-rlrg -j "$(nproc)" --target tessera_tests > build-gpu-rlrg/pending.log 2>&1 ||
  { echo "build of build-gpu-rlrg failed (see build-gpu-rlrg/pending.log)" >&2; exit 1; }
pack build-gpu-rlrg/tests/tessera_tests tests_rlrg

VARIANT_CMAKE_ARGS=-DTESSERA_PLAN_PHASES=ON scripts/build_prefill_variants.sh "$bin" 'pp='
VARIANT_CMAKE_ARGS=-DTESSERA_SM90_TIMELINE=ON scripts/build_prefill_variants.sh "$bin" 'tl='
git rev-parse HEAD > "$bin/commit"
ls -la "$bin"
