#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: ctest (C++; the tests labelled `gpu`
# report themselves as skipped without a GPU) and pytest (the Python package, twice: installed
# with `pip install .` as a user would, CPU-only, and the CUDA-built binding of build/ on the same
# tests). pytest's "no tests collected" (exit 5) counts as a failure.
# Usage: scripts/test.sh [ctest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
set -e
PY="$(./scripts/python_env.sh)"
MOEKIT_PYTHON_EXE="$PY" ./scripts/setup.sh build
set +e
(cd build && ctest --output-on-failure -j "${MOEKIT_JOBS:-2}" "$@")
ctest_rc=$?

pytest_run() {  # label, env...
  local label="$1"
  shift
  echo "=== pytest: $label"
  env "$@" "$PY" -m pytest -q -p no:cacheprovider tests/python
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
echo "ctest: exit $ctest_rc; pip install .: exit $pip_rc; pytest: exit $py_rc (installed), $cuda_rc (CUDA-built)"
[ $ctest_rc -eq 0 ] && [ $pip_rc -eq 0 ] && [ $py_rc -eq 0 ] && [ $cuda_rc -eq 0 ]
