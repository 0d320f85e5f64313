#!/usr/bin/env bash
# Downloads, for another Python (default: CPython 3.12 on manylinux x86-64, what the GPU machine
# runs), the wheels the Python tests need there and it may lack: apache-tvm-ffi (the version the
# package is built against), pytest and its dependencies, numpy, typing-extensions; into .whl/
# (git-ignored), to carry to a machine without PyPI and install with
#   pip install --no-index --find-links .whl apache-tvm-ffi pytest numpy
# Usage: scripts/fetch_tvm_ffi_wheel.sh [python-version=3.12] [tvm-ffi version=0.1.11]
set -euo pipefail
cd "$(dirname "$0")/.."
pyver="${1:-3.12}"
ver="${2:-0.1.11}"
PY="$(./scripts/python_env.sh)"
mkdir -p .whl
get() {
  "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$pyver" \
    --platform manylinux_2_28_x86_64 -d .whl "$@"
}
get --no-deps "apache-tvm-ffi==$ver" typing-extensions numpy
get pytest
ls -la .whl
