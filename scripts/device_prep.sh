#!/usr/bin/env bash
# Gathers what a GPU run needs into .devbuild/ (git-ignored): the built binaries, the Python
# binding (libmoekit_ffi.so, built with the SM90 kernels by scripts/test.sh) with the
# apache-tvm-ffi wheel for the GPU machine's Python (scripts/fetch_tvm_ffi_wheel.sh), and the
# golden test data, so that a remote GPU machine with only the working tree can run them.
# A device call carries at most 64 MiB: the binaries travel gzipped (scripts/gpu_check.sh
# unpacks them), and only the apache-tvm-ffi wheel (the GPU image has numpy and pytest).
# DEVPREP_ONLY="moekit moekit_ep_gpu_tests ...": only those binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .devbuild && mkdir -p .devbuild
# The commit the binaries are built from (the device's copy of the tree may carry an older .git):
# gpu_check.sh prints it into env.txt.
{ git rev-parse --short HEAD; git diff --quiet HEAD -- src include tests bench cmake CMakeLists.txt || echo dirty; } \
  2>/dev/null | paste -sd- > .devbuild/BUILD_COMMIT || true
for b in build/moekit build/tests/moekit_gpu_tests build/tests/moekit_ep_gpu_tests build/tests/moekit_ep_rank_tests build/tests/moekit_tests \
         build/bench/moekit_consumer_rate build/bench/moekit_copy_probe build/bench/moekit_host_overhead build/bench/moekit_checkpoint_load \
         build/bench/moekit_swap_ab_probe \
         build/libmoekit_ffi.so; do
  n=$(basename "$b")
  if [ -n "${DEVPREP_ONLY:-}" ] && ! [[ " $DEVPREP_ONLY " == *" $n "* ]]; then continue; fi
  [ -e "$b" ] && gzip -c "$b" > ".devbuild/$n.gz"
done
if [ -f build/libmoekit_ffi.so ]; then
  ls .whl/apache_tvm_ffi-*cp312*.whl >/dev/null 2>&1 || ./scripts/fetch_tvm_ffi_wheel.sh 3.12 >/dev/null
  mkdir -p .devbuild/wheels && cp .whl/apache_tvm_ffi-*cp312*.whl .devbuild/wheels/
fi
cp -r ../shared/testdata .devbuild/testdata
du -sh .devbuild
