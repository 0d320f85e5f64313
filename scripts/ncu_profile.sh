#!/usr/bin/env bash
# Runs on the GPU machine after scripts/device_prep.sh: Nsight Compute report of the fused
# decode GEMM kernel for one shape / format / token count, with the per-SASS-instruction
# stall samples as CSV. Logs under $OUT (./gpu-out).
# Usage: [BIN=path/to/moekit] [TAG=prefix] scripts/ncu_profile.sh [shape] [format] [tokens]
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
shape="${1:-gpt-oss-120b}" fmt="${2:-mxfp4}" tok="${3:-64}"
bin="${BIN:-.devbuild/moekit}"
tag="${TAG:-}${shape}_${fmt}_T${tok}"
# The bench's first launch of the kernel is a plain (non-graph) launch of the whole problem.
ncu --kernel-name regex:moe_gemm_kernel --launch-count 1 --set full --clock-control none --import-source no \
  -o "$OUT/ncu_$tag" -f "$bin" bench --shape "$shape" --format "$fmt" --tokens "$tok" --reps 3 \
  >"$OUT/ncu_${tag}_run.log" 2>&1
ncu -i "$OUT/ncu_$tag.ncu-rep" --page details >"$OUT/ncu_${tag}_details.txt" 2>&1
ncu -i "$OUT/ncu_$tag.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_${tag}_sass.csv" 2>&1
ncu -i "$OUT/ncu_$tag.ncu-rep" --page raw --csv >"$OUT/ncu_${tag}_raw.csv" 2>&1
ls -la "$OUT" | tail -5
grep -E "Duration|Elapsed Cycles|SM Frequency|DRAM Throughput|Memory Throughput|Issue Slots|Issued Ipc|Warp Cycles Per Issued|No Eligible|Active Warps" \
  "$OUT/ncu_${tag}_details.txt" | head -30
