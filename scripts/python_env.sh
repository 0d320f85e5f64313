#!/usr/bin/env bash
# A virtual environment for the Python package's build and tests: build/venv with pip's
# scikit-build-core, apache-tvm-ffi (0.1.11, the version the package is built against),
# nlohmann-json (headers, where the system has none), numpy and pytest from PyPI, and matplotlib
# for the performance report (scripts/report.py; optional: the other tests do without it).
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
if ! "$VENV/bin/python" -c "import matplotlib" 2>/dev/null; then
  echo "moekit python env: installing matplotlib (the performance report) into $VENV" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check matplotlib >&2 ||
    echo "moekit python env: matplotlib not installed; scripts/report.py and its test will be skipped" >&2
fi
case "$VENV" in /*) echo "$VENV/bin/python" ;; *) echo "$PWD/$VENV/bin/python" ;; esac
