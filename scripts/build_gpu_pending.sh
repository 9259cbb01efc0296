#!/usr/bin/env bash
# Builds, on a machine without a GPU, every binary scripts/run_gpu_pending.sh times or tests, and
# writes them xz-compressed into BINDIR (about 45 MB in all):
#   tessera_tests, tessera_bench, tessera_plan_bench   this tree, sm_90 only (build-gpu/)
#   bench_NAME                                         the Hopper prefill's A/B switches, hd128 bf16
#                                                      (p56: hd64; scripts/build_prefill_variants.sh)
#   tests_ho                                           tessera_tests with the tile hand-over
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

# The A/B owed (steps 16, 3, 17 and 14): the work tiles handed over through shared memory
# (tile_handover_sm90.cuh; the 128 x 128 kernels), hd64's gathered producer at 56 registers, and the
# GPU tests of a build with the hand-over. (The gathered source's line copies and 40 producer
# registers became the defaults on 2026-12-07; rl / rg / rlrg / rlrgall built them as switches.
# ru, O's rescale under S, measured even; build it the same way to time it again.)
scripts/build_prefill_variants.sh "$bin" 'ho=-DTESSERA_SM90_TILE_HANDOVER=1'
VARIANT_CMAKE_ARGS=-DTESSERA_HEAD_DIMS=64 scripts/build_prefill_variants.sh "$bin" \
  'p56=-DTESSERA_SM90_GATHER_PRODUCER_REGISTERS_3C=56'
cmake -S . -B build-gpu-next "${cmake_args[@]}" "-DCMAKE_CUDA_FLAGS=-DTESSERA_SM90_TILE_HANDOVER=1" > /dev/null
cmake --build build-gpu-next -j "$(nproc)" --target tessera_tests > build-gpu-next/pending.log 2>&1 ||
  { echo "build of build-gpu-next failed (see build-gpu-next/pending.log)" >&2; exit 1; }
pack build-gpu-next/tests/tessera_tests tests_ho

VARIANT_CMAKE_ARGS=-DTESSERA_PLAN_PHASES=ON scripts/build_prefill_variants.sh "$bin" 'pp='
VARIANT_CMAKE_ARGS=-DTESSERA_SM90_TIMELINE=ON scripts/build_prefill_variants.sh "$bin" 'tl='
git rev-parse HEAD > "$bin/commit"
ls -la "$bin"
