#!/usr/bin/env bash
# Builds, on a machine without a GPU, every binary scripts/run_gpu_pending.sh times or tests, and
# writes them xz-compressed into BINDIR (about 45 MB in all):
#   tessera_tests, tessera_bench, tessera_plan_bench   this tree, sm_90 only (build-gpu/)
#   bench_NAME                                         the Hopper prefill's A/B switches, hd128 bf16
#                                                      (p56: hd64; scripts/build_prefill_variants.sh)
#   (step 18 runs compute-sanitizer on tessera_tests)
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

# The A/B of step 16: the work-tile hand-over off (nho), against this tree's default (on for the
# ragged 128 x 128 kernels since 2026-12-07). (The gathered source's line copies and 40 producer
# registers became the defaults the same day: rl / rg / rlrg built them as switches. O's rescale
# under S and hd64's gathered producer at 56 registers measured even and 0.81x; their switches are
# in f0bc230.)
scripts/build_prefill_variants.sh "$bin" 'nho=-DTESSERA_SM90_TILE_HANDOVER=0'

VARIANT_CMAKE_ARGS=-DTESSERA_PLAN_PHASES=ON scripts/build_prefill_variants.sh "$bin" 'pp='
VARIANT_CMAKE_ARGS=-DTESSERA_SM90_TIMELINE=ON scripts/build_prefill_variants.sh "$bin" 'tl='
git rev-parse HEAD > "$bin/commit"
ls -la "$bin"
