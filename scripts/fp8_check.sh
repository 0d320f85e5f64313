#!/usr/bin/env bash
# The FP8 activations' GPU checks (issue 49): the SM90 FP8 grouped GEMM and the quantizer, on the
# GPU machine from the repo root, building nothing: the GPU test binary comes from
# scripts/device_prep.sh on the build machine
#   DEVPREP_ONLY="moekit_gpu_tests" ./scripts/device_prep.sh        (then carry .devbuild)
# Steps: the tests (FP8Fold.*, FP8Gemm.*, FP8Quant.* the quantizer bit for bit, FP8Chain.* quantize ->
# GEMM1 -> quantize -> GEMM2 against the CPU's fp8 layer, FP8Sanitize.*), compute-sanitizer memcheck,
# racecheck and synccheck on the small cases (FP8Sanitize.*), and the timings at 4096 / 8192 tokens
# of the presets (FP8Bench.*, MOEKIT_FP8_BENCH=1: the GEMMs and the quantizer).
# $OUT gets at most 7 files: env.txt, tests.log, memcheck.log, racecheck.log, synccheck.log,
# bench.log, bench_summary.txt. Logs under $OUT (./fp8-out); the exit status is
# non-zero when a step fails. Usage: scripts/fp8_check.sh [tests] [sanitize] [bench]
set -uo pipefail
OUT="${OUT:-fp8-out}"
mkdir -p "$OUT"
B=.devbuild
for z in $B/moekit_gpu_tests.gz; do [ -e "$z" ] && gunzip -f "$z" && chmod +x "${z%.gz}"; done
BIN="$B/moekit_gpu_tests"
[ -x "$BIN" ] || { echo "no $BIN: run DEVPREP_ONLY=moekit_gpu_tests scripts/device_prep.sh and carry .devbuild" >&2; exit 2; }
export MOEKIT_TESTDATA="$PWD/$B/testdata"
{
  date -u +%FT%TZ
  git rev-parse --short HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
rc=0
step() {  # step NAME COMMAND...: runs it, log in $OUT/NAME.log, prints its tail
  local name=$1
  shift
  echo "== $name"
  "$@" >"$OUT/$name.log" 2>&1
  local r=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: exit $r"
  [ $r -eq 0 ] || rc=1
}
for s in ${*:-tests sanitize bench}; do
  case "$s" in
    tests) step tests "$BIN" --gtest_filter='FP8Fold.*:FP8Gemm.*:FP8Quant.*:FP8Chain.*:FP8Sanitize.*' ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        step "$tool" "$CS" --tool "$tool" --error-exitcode 1 "$BIN" --gtest_filter='FP8Sanitize.*'
      done ;;
    bench)
      step bench env MOEKIT_FP8_BENCH=1 "$BIN" --gtest_filter='FP8Bench.*'
      grep FP8BENCH "$OUT/bench.log" >"$OUT/bench_summary.txt" 2>/dev/null
      cat "$OUT/bench_summary.txt" ;;
    *) echo "unknown step $s" >&2; rc=1 ;;
  esac
done
exit $rc
