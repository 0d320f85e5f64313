#!/usr/bin/env bash
# A virtual environment with one inference engine from PyPI, pinned, for the engine adapters'
# tests (tests/engines): build/venv-<engine> with the engine (it brings and pins its own torch:
# vLLM 0.33.0 torch 2.14.0, SGLang 0.5.23 torch 2.14.1, both apache-tvm-ffi 0.1.11 exactly, the
# version moekit's binding is built against) and pytest. moekit itself comes from the working tree
# (PYTHONPATH=python, MOEKIT_FFI_LIBRARY=build/libmoekit_ffi.so), so nothing is rebuilt here.
# Measured on the 2-core build machine from PyPI: vLLM ~5 min and 9.4 GB, SGLang ~7 min and 10 GB
# (PyPI's Linux torch is the CUDA build; the PyTorch CPU index is not reachable from CI).
# Disk: pip's cache is not used (it would hold a second, compressed copy of every wheel, ~4-5 GB an
# engine), and when the disk under build/ has less than MOEKIT_ENGINE_MIN_FREE_GB (default 16) free,
# the other engines' environments are removed first (they are rebuilt on their next use): CI's
# fresh machine ran out of disk installing SGLang beside vLLM (2026-11-28).
# Idempotent; prints the environment's python.  Usage: scripts/engine_env.sh vllm|sglang
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  vllm) want=(vllm==0.33.0 pytest) ;;
  sglang) want=(sglang==0.5.23 pytest) ;;
  *) echo "usage: scripts/engine_env.sh vllm|sglang" >&2; exit 2 ;;
esac
VENV="build/venv-$1"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p build
  "$PY" -m venv "$VENV" >&2
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '${want[0]#*==}')" 2>/dev/null \
   || ! "$VENV/bin/python" -c "import pytest" 2>/dev/null; then
  free_gb=$(df -Pk build | awk 'NR == 2 { print int($4 / 1048576) }')
  if [ "$free_gb" -lt "${MOEKIT_ENGINE_MIN_FREE_GB:-16}" ]; then
    for other in build/venv-vllm build/venv-sglang; do
      if [ "$other" = "$VENV" ] || [ ! -d "$other" ]; then continue; fi
      echo "moekit engine env: ${free_gb} GB free under build/: removing $other first" >&2
      rm -rf "$other"
    done
  fi
  echo "moekit engine env: installing ${want[*]} into $VENV ($(df -Ph build | awk 'NR == 2 { print $4 }') free)" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir --no-compile "${want[@]}" >&2
fi
echo "$PWD/$VENV/bin/python"
