#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: ctest (C++; the tests labelled `gpu`
# report themselves as skipped without a GPU), pytest (the Python package, twice: installed
# with `pip install .` as a user would, CPU-only, and the CUDA-built binding of build/ on the same
# tests; with torch and transformers, pinned by scripts/python_env.sh), and the engine adapters'
# tests against the real vLLM and SGLang (tests/engines), each in a virtual environment of its own
# (scripts/engine_env.sh; ~12 min of downloads and installs on a fresh 2-core machine, ~9-10 GB
# each: vLLM's installs in the background while the build and ctest run, SGLang's after vLLM's
# tests, so that engine_env.sh can remove vLLM's first where the disk is short; MOEKIT_ENGINES=0
# leaves them out, for a quick local run only). pytest's "no tests collected" (exit 5) counts as a
# failure, and so does a missing engine package (MOEKIT_REQUIRE_ENGINES).
# Usage: scripts/test.sh [ctest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
set -e
PY="$(./scripts/python_env.sh)"
# The engines' environments install (mostly downloads) while the build and ctest use the cores.
engines_pid=""
if [ "${MOEKIT_ENGINES:-1}" != 0 ]; then
  mkdir -p build
  rm -f build/engine-env-*.out
  engine_env() {  # engine: its environment's python into build/engine-env-<engine>.out, or no file
    ./scripts/engine_env.sh "$1" >"build/engine-env-$1.out" 2>"build/engine-env-$1.log" || rm -f "build/engine-env-$1.out"
  }
  engine_env vllm &
  engines_pid=$!
fi
MOEKIT_PYTHON_EXE="$PY" ./scripts/setup.sh build
set +e
(cd build && ctest --output-on-failure -j "${MOEKIT_JOBS:-2}" "$@")
ctest_rc=$?

export MOEKIT_REQUIRE_ENGINES=1
pytest_run() {  # label, env...
  local label="$1"
  shift
  echo "=== pytest: $label"
  env "$@" "${PYTEST_PY:-$PY}" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests/python}
  local rc=$?
  if [ $rc -eq 5 ]; then
    echo "pytest ($label): no tests were collected"
    return 1
  fi
  return $rc
}
# The package as `pip install .` builds it (CPU-only here: the kernels are the ones build/ compiled).
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
  -Cbuild-dir=build/py -Ccmake.define.MOEKIT_CUDA=OFF .
pip_rc=$?
py_rc=1
if [ $pip_rc -eq 0 ]; then
  pytest_run "installed package"
  py_rc=$?
fi
# The binding built with the CUDA kernels in build/ (when CUDA was built): imports and runs on a
# machine without a GPU.
cuda_rc=0
if [ -f build/libmoekit_ffi.so ] && grep -q "MOEKIT_CUDA:BOOL=ON" build/CMakeCache.txt; then
  pytest_run "CUDA-built binding" MOEKIT_FFI_LIBRARY="$PWD/build/libmoekit_ffi.so"
  cuda_rc=$?
fi
# The vLLM and SGLang adapters against the real engines, each with its own torch: moekit from the
# working tree and the binding of build/.
engines_rc=0
engines_done=""
if [ -n "$engines_pid" ]; then
  wait "$engines_pid"
  for e in vllm sglang; do
    [ "$e" = vllm ] || engine_env "$e"
    if [ ! -s "build/engine-env-$e.out" ]; then
      echo "engine env $e: install failed:"
      tail -20 "build/engine-env-$e.log"
      engines_rc=1
      engines_done="$engines_done $e(not installed)"
      continue
    fi
    EPY="$(cat "build/engine-env-$e.out")"
    PYTEST_PY="$EPY" PYTEST_ARGS="-rs -W ignore::UserWarning tests/engines/test_$e.py" pytest_run "$e (real package)" \
      PYTHONPATH="$PWD/python" MOEKIT_FFI_LIBRARY="$PWD/build/libmoekit_ffi.so" || { engines_rc=1; e="$e(failed)"; }
    engines_done="$engines_done $e"
  done
  df -Ph build | awk 'NR == 2 { print "disk under build/ after the engines: " $3 " used, " $4 " free" }'
fi
echo "ctest: exit $ctest_rc; pip install .: exit $pip_rc; pytest: exit $py_rc (installed), $cuda_rc (CUDA-built); \
engines (${engines_done# }): exit $engines_rc"
[ $ctest_rc -eq 0 ] && [ $pip_rc -eq 0 ] && [ $py_rc -eq 0 ] && [ $cuda_rc -eq 0 ] && [ $engines_rc -eq 0 ]
