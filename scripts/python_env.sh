#!/usr/bin/env bash
# A virtual environment for the Python package's build and tests: build/venv with pip's
# scikit-build-core, apache-tvm-ffi (0.1.11, the version the package is built against),
# nlohmann-json (headers, where the system has none), numpy and pytest from PyPI, matplotlib
# for the performance report (scripts/report.py; optional: the other tests do without it), and
# the transformers experts backend's test stack, pinned: torch 2.11.0 and transformers 5.17.0 (the
# GPU machine's versions) with accelerate 1.15.0 (transformers' FP8 loader wants it). PyPI's Linux
# torch wheel is the CUDA build (~2.4 GB with its nvidia-* wheels; it runs on the CPU): PyTorch's
# CPU-only index is not reachable from here or CI (only PyPI is), so the CPU wheel is not an option.
# Idempotent; prints the environment's python.  Usage: scripts/python_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MOEKIT_VENV:-build/venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY" -m venv --help >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  fi
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV" >&2
fi
want=(scikit-build-core apache-tvm-ffi==0.1.11 nlohmann-json numpy pytest)
if ! "$VENV/bin/python" -c "import scikit_build_core, tvm_ffi, nlohmann_json, numpy, pytest" 2>/dev/null; then
  echo "moekit python env: installing ${want[*]} into $VENV" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check "${want[@]}" >&2
fi
engines=(torch==2.11.0 transformers==5.17.0 accelerate==1.15.0)
if ! "$VENV/bin/python" -c "import torch, transformers, accelerate; assert torch.__version__.startswith('2.11.0') \
    and transformers.__version__ == '5.17.0'" 2>/dev/null; then
  echo "moekit python env: installing ${engines[*]} into $VENV" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir "${engines[@]}" >&2
fi
if ! "$VENV/bin/python" -c "import matplotlib" 2>/dev/null; then
  echo "moekit python env: installing matplotlib (the performance report) into $VENV" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check matplotlib >&2 ||
    echo "moekit python env: matplotlib not installed; scripts/report.py and its test will be skipped" >&2
fi
case "$VENV" in /*) echo "$VENV/bin/python" ;; *) echo "$PWD/$VENV/bin/python" ;; esac
