#!/usr/bin/env bash
# Installs what a fresh machine is missing to build tessera, and nothing it already has:
#   - Debian packages: cmake, g++, make, ninja-build, GoogleTest/GoogleMock (libgtest-dev,
#     libgmock-dev), python3-pip, clang and libclang-rt-dev (the libFuzzer targets)
#   - the pinned nvidia-cutlass package (CUTLASS/CuTe headers) into .deps/python
#   - for the Python package (python/): the pinned build packages (scikit-build-core, nanobind) into
#     .deps/pybuild and the pinned test packages (pytest, numpy) into .deps/pytest-<version>, for
#     $PYTHON (default python3); Debian's python3-dev where that interpreter lacks Python.h
# The CUDA 13 toolkit (nvcc) must already be installed: it is not a Debian package at that version.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(g++)
command -v make >/dev/null || need_apt+=(make)
command -v ninja >/dev/null || need_apt+=(ninja-build)  # pip's builds use it (else they fetch it)
# The fuzz targets (tests/fuzz/) build with clang's libFuzzer: clang and its sanitizer runtimes.
command -v clang++ >/dev/null || need_apt+=(clang)
ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 || need_apt+=(libclang-rt-dev)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
[ -f /usr/include/gmock/gmock.h ] || need_apt+=(libgmock-dev)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  2>/dev/null || need_apt+=(python3-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13/bin; do
    [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
  done
fi
command -v nvcc >/dev/null || { echo "setup: nvcc (CUDA toolkit 13) not found; install it first" >&2; exit 1; }

if [ ! -f .deps/python/cutlass_library/source/include/cutlass/cutlass.h ]; then
  echo "setup: installing $(grep -v '^#' scripts/requirements.txt | xargs) into .deps/python"
  python3 -m pip install -q --no-deps --no-compile --disable-pip-version-check --root-user-action=ignore \
    --target .deps/python -r scripts/requirements.txt
fi
# Installs a pinned requirements file into a target folder, again only when the pins changed (the
# file's copy in the folder says what is there).
install_pinned() {
  local requirements=$1 target=$2
  if ! cmp -s "$requirements" "$target/.requirements.txt"; then
    echo "setup: installing $(grep -v '^#' "$requirements" | xargs) into $target"
    rm -rf "$target"
    "$PYTHON" -m pip install -q --no-deps --no-compile --disable-pip-version-check --root-user-action=ignore \
      --target "$target" -r "$requirements"
    cp "$requirements" "$target/.requirements.txt"
  fi
}
install_pinned scripts/requirements-python-build.txt .deps/pybuild
pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
install_pinned scripts/requirements-python-test.txt ".deps/pytest-$pyver"

echo "setup: ok (nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), cmake $(cmake --version | head -1 | awk '{print $3}'))"
