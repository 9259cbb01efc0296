#!/usr/bin/env bash
# Builds a tessera wheel to carry to a GPU machine without network: the extension only (no C++
# tests, benchmarks or tools), kernels for sm_90 only (H100 / H200), for CPython 3.12 (an abi3 wheel,
# so any CPython >= 3.12 takes it). Also downloads the pinned test packages
# (scripts/requirements-python-test.txt) as cp312 wheels into OUTDIR/test-deps.
#   scripts/build_wheel.sh OUTDIR [PYTHON]     (PYTHON: a CPython 3.12; default python3.12, else pyenv's 3.12)
# On the GPU machine, in a checkout of the same commit:
#   python3 -m pip install --no-index --no-deps OUTDIR/tessera-*.whl
#   python3 -m pip install --no-index --no-deps OUTDIR/test-deps/*.whl   # only what is missing there
#                                                                       # (keep the machine's own numpy)
#   python3 -m pytest -q -rs python/tests                               # the package's suite, GPU tests included
#   python3 bench/python_overhead.py                                    # run() through Python vs the C++ call
set -euo pipefail
out=${1:?usage: scripts/build_wheel.sh OUTDIR [PYTHON]}
is_312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
py=${2:-}
if [ -z "$py" ]; then
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3; do
    if is_312 "$candidate"; then py=$candidate; break; fi
  done
fi
[ -n "$py" ] && is_312 "$py" || { echo "build_wheel: no CPython 3.12 found; pass one as the second argument" >&2; exit 1; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/cuda/bin

PYTHON=$py ./scripts/setup.sh   # the CUTLASS headers and .deps/pybuild (scikit-build-core, nanobind)
# The pinned build packages from .deps/pybuild (no build isolation: nothing else is downloaded).
PYTHONPATH=$PWD/.deps/pybuild "$py" -m pip wheel . --no-build-isolation --no-deps -w "$out" \
  -Cbuild-dir=build-wheel/sm90-cp312 \
  -Ccmake.define.TESSERA_PORTABLE_ARCHS=90-real \
  -Ccmake.define.TESSERA_BUILD_TESTS=OFF -Ccmake.define.TESSERA_BUILD_BENCH=OFF \
  -Ccmake.define.TESSERA_BUILD_TOOLS=OFF
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -r scripts/requirements-python-test.txt -d "$out/test-deps"
ls -l "$out"/*.whl
