#!/usr/bin/env bash
# Compiler launcher of the Hopper kernels (CUDA_COMPILER_LAUNCHER of tessera_kernels_hopper): runs
# the compile and fails it when ptxas reports that it serialised a kernel's wgmma ("wgmma.mma_async
# instructions are serialized due to ...": C7520, a branch it thinks divergent between wgmma issues
# (a C++ `if (lane == 0)`, a loop bound read from memory); C7515, a non-wgmma instruction that
# defines an in-flight wgmma's accumulators on some path, e.g. a register copy where an
# accumulator in flight crosses a loop's back edge). The kernel stays correct and loses ~20-30%
# (notes/prefill_hopper.md), so the build stops instead. TESSERA_WGMMA_CHECK=OFF turns the
# launcher off.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" 2>"$log"
status=$?
cat "$log" >&2
if grep -q "C7520" "$log"; then
  echo "error: ptxas serialised the wgmma of a Hopper kernel (C7520 above): a branch between wgmma issues is divergent to the compiler; predicate it inside the instruction or make its condition warp-uniform (__shfl_sync)" >&2
  exit 1
fi
if grep -q "C7515" "$log"; then
  echo "error: ptxas serialised the wgmma of a Hopper kernel (C7515 above): on some path (as ptxas sees the branches, not correlating them) an instruction defines the accumulators of a wgmma in flight; wait for it (wgmma_wait) on every such path first" >&2
  exit 1
fi
exit $status
