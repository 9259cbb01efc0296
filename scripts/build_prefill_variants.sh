#!/usr/bin/env bash
# Builds tessera_bench once per ablation variant of the Hopper prefill (compile-time switches of
# src/kernels/attention/sm90/), narrowed to hd128 bf16 (~1 min each on two cores), and writes each
# binary xz-compressed (~1.5 MB) into OUTDIR as bench_NAME.xz, for bench/prefill_ablation.py --builds
# on a GPU machine (unpack with xz -dc).
#   scripts/build_prefill_variants.sh OUTDIR 'NAME=-DSWITCH=1 -DOTHER=0' ['NAME2=...' ...]
# Example: scripts/build_prefill_variants.sh out/variants 'base=' 'ka=-DTESSERA_SM90_K_AHEAD_OF_V=1' \
#   'r32=-DTESSERA_SM90_PRODUCER_REGISTERS_2C=32'
# Build folders: build-variant-NAME (kept, so a rebuild after an edit is incremental). Extra CMake
# arguments for every variant: VARIANT_CMAKE_ARGS (e.g. -DTESSERA_SM90_TIMELINE=ON).
set -euo pipefail
out=${1:?usage: build_prefill_variants.sh OUTDIR NAME=FLAGS ...}
shift
[ $# -gt 0 ] || { echo "build_prefill_variants.sh: name at least one variant (NAME=FLAGS)" >&2; exit 2; }
cd "$(dirname "$0")/.."
mkdir -p "$out"
for spec in "$@"; do
  name=${spec%%=*}
  flags=${spec#*=}
  case "$name" in ''|*[!A-Za-z0-9_]*) echo "build_prefill_variants.sh: bad variant name '$name'" >&2; exit 2 ;; esac
  dir=build-variant-$name
  mkdir -p "$dir"
  start=$(date +%s)
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DTESSERA_HEAD_DIMS=128 -DTESSERA_DTYPES=bf16 \
    -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_PYTHON=OFF -DTESSERA_BUILD_FUZZERS=OFF \
    -DTESSERA_PORTABLE_ARCHS=90-real -DCMAKE_CUDA_FLAGS="$flags" ${VARIANT_CMAKE_ARGS:-} > "$dir/variant.log" 2>&1 ||
    { echo "$name: configure failed (see $dir/variant.log)" >&2; exit 1; }
  cmake --build "$dir" -j "$(nproc)" --target tessera_bench >> "$dir/variant.log" 2>&1 ||
    { echo "$name: build failed (see $dir/variant.log)" >&2; exit 1; }
  xz -T0 -6 -c "$dir/bench/tessera_bench" > "$out/bench_$name.xz"
  echo "$name ($flags): $(( $(date +%s) - start )) s -> $out/bench_$name.xz"
done
