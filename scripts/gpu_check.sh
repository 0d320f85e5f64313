#!/usr/bin/env bash
# Runs on the GPU machine (from the repo root, after scripts/device_prep.sh here): GPU tests,
# sanitizer passes and benchmarks, with logs under $OUT (default ./gpu-out).
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export MOEKIT_TESTDATA="$PWD/.devbuild/testdata"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
step() { echo "=== $*"; }
step gpu tests
.devbuild/moekit_gpu_tests "${GTEST_ARGS[@]:-}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
