#!/usr/bin/env bash
# Installs FlashInfer, the optional "flashinfer" peer of bench/peers.py, on a machine without
# network access, from its published wheels copied there beforehand:
#   bash bench/flashinfer/install.sh [WHEEL_DIR] [TARGET]    (defaults: .whl /tmp/site)
#   export PYTHONPATH=TARGET
# WHEEL_DIR holds flashinfer_python-0.7.0-py3-none-any.whl and apache_tvm_ffi-0.1.15.post2-*.whl
# (see bench/flashinfer/README.md). If WHEEL_DIR/flashinfer_modules/ holds prebuilt kernel modules,
# NAME/NAME.so or NAME/NAME.so.xz, they are placed in TARGET/flashinfer/data/aot/NAME/NAME.so,
# where FlashInfer loads a module before it would JIT-compile it.
set -euo pipefail
wheels=${1:-.whl}
target=${2:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
  "$wheels"/flashinfer_python-*.whl "$wheels"/apache_tvm_ffi-*.whl
aot="$target/flashinfer/data/aot"
n=0
if [ -d "$wheels/flashinfer_modules" ]; then
  for f in "$wheels"/flashinfer_modules/*/*.so "$wheels"/flashinfer_modules/*/*.so.xz; do
    [ -e "$f" ] || continue
    name=$(basename "$(dirname "$f")")
    mkdir -p "$aot/$name"
    case "$f" in
      *.xz) python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
              "$f" "$aot/$name/$name.so" ;;
      *) cp "$f" "$aot/$name/$name.so" ;;
    esac
    n=$((n + 1))
  done
fi
echo "flashinfer installed in $target ($n prebuilt modules in $aot); export PYTHONPATH=$target"
