#!/usr/bin/env bash
# Builds, on a machine without a GPU, every binary scripts/run_gpu_pending.sh times or tests, and
# writes them xz-compressed into BINDIR (about 45 MB in all):
#   tessera_tests, tessera_bench, tessera_plan_bench   this tree, sm_90 only (build-gpu/)
#   bench_NAME                                         the Hopper prefill's A/B switches, hd128 bf16
#                                                      (scripts/build_prefill_variants.sh)
#   tests_wfkar32, benchfull_wfkar32                   this tree with the gathered source's writer-side
#                                                      fence, K ahead of V and 32 producer registers
#                                                      (build-wfkar32/)
#   tests_dec, benchfull_dec                           branch decode-parts (a worktree in
#                                                      build-decode-parts/; skipped without the branch)
#   tests_mk, benchfull_mk                             branch decode-merge-kernel (on top of it), built
#                                                      after it in the same worktree and build folder
#   scripts/build_gpu_pending.sh BINDIR
# Two cores: ~30 minutes from nothing, minutes when the build folders are there.
set -euo pipefail
bin=${1:?usage: build_gpu_pending.sh BINDIR}
cd "$(dirname "$0")/.."
root=$PWD
mkdir -p "$bin"
bin=$(cd "$bin" && pwd)
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DTESSERA_PORTABLE_ARCHS=90-real -DTESSERA_BUILD_PYTHON=OFF -DTESSERA_BUILD_FUZZERS=OFF)
pack() { xz -T0 -6 -c "$1" > "$bin/$2.xz"; }

build() {  # build() SOURCE BUILD_DIR CUDA_FLAGS: tests and bench of one tree
  cmake -S "$1" -B "$2" "${cmake_args[@]}" -DCMAKE_CUDA_FLAGS="$3" > /dev/null
  cmake --build "$2" -j "$(nproc)" --target tessera_tests tessera_bench tessera_plan_bench > "$2/pending.log" 2>&1 ||
    { echo "build of $2 failed (see $2/pending.log)" >&2; exit 1; }
}

build . build-gpu ""
pack build-gpu/tests/tessera_tests tessera_tests
pack build-gpu/bench/tessera_bench tessera_bench
pack build-gpu/bench/tessera_plan_bench tessera_plan_bench

scripts/build_prefill_variants.sh "$bin" \
  'wfkar32=-DTESSERA_SM90_GATHER_WRITER_FENCE=1 -DTESSERA_SM90_K_AHEAD_OF_V=1 -DTESSERA_SM90_PRODUCER_REGISTERS_2C=32' \
  'kar32=-DTESSERA_SM90_K_AHEAD_OF_V=1 -DTESSERA_SM90_PRODUCER_REGISTERS_2C=32' \
  'wf=-DTESSERA_SM90_GATHER_WRITER_FENCE=1' 'ka=-DTESSERA_SM90_K_AHEAD_OF_V=1' \
  'r32=-DTESSERA_SM90_PRODUCER_REGISTERS_2C=32' 'nf=-DTESSERA_SM90_GATHER_FENCE=0' \
  's3=-DTESSERA_SM90_HD128_STAGES=3' \
  'wfr32=-DTESSERA_SM90_GATHER_WRITER_FENCE=1 -DTESSERA_SM90_PRODUCER_REGISTERS_2C=32' \
  't=-DTESSERA_SM90_BOUNDARY_TURNS=0' 'kp=-DTESSERA_SM90_K_BEFORE_Q=1 -DTESSERA_SM90_PREFETCH_NEXT_Q=1' \
  'kpt=-DTESSERA_SM90_K_BEFORE_Q=1 -DTESSERA_SM90_PREFETCH_NEXT_Q=1 -DTESSERA_SM90_BOUNDARY_TURNS=0'

build . build-wfkar32 "-DTESSERA_SM90_GATHER_WRITER_FENCE=1 -DTESSERA_SM90_K_AHEAD_OF_V=1 -DTESSERA_SM90_PRODUCER_REGISTERS_2C=32"
pack build-wfkar32/tests/tessera_tests tests_wfkar32
pack build-wfkar32/bench/tessera_bench benchfull_wfkar32

if git rev-parse -q --verify decode-parts > /dev/null; then
  tree=$root/build-decode-parts/src
  [ -d "$tree" ] || git worktree add -q "$tree" decode-parts
  git -C "$tree" checkout -q --detach decode-parts
  [ -e "$tree/.deps" ] || ln -s "$root/.deps" "$tree/.deps"
  build "$tree" "$root/build-decode-parts/build" ""
  pack build-decode-parts/build/tests/tessera_tests tests_dec
  pack build-decode-parts/build/bench/tessera_bench benchfull_dec
  if git rev-parse -q --verify decode-merge-kernel > /dev/null; then
    git -C "$tree" checkout -q --detach decode-merge-kernel
    build "$tree" "$root/build-decode-parts/build" ""
    pack build-decode-parts/build/tests/tessera_tests tests_mk
    pack build-decode-parts/build/bench/tessera_bench benchfull_mk
  fi
else
  echo "no branch decode-parts: tests_dec / benchfull_dec not built" >&2
fi
git rev-parse HEAD > "$bin/commit"
ls -la "$bin"
