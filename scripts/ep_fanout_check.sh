#!/usr/bin/env bash
# The fan-out EP dispatch (MOEKIT_EP_DISPATCH=fanout: one copy per (token, destination rank), the
# destination fans it out to its experts' rows; docs/EP.md) against the direct one (default), on
# this machine's GPUs (2 or more, NVLink). Logs under $OUT (./gpu-out).
# Build machine first: DEVPREP_ONLY="moekit moekit_ep_gpu_tests moekit_ep_rank_tests" scripts/device_prep.sh
# Usage (GPU machine, repo root): scripts/ep_fanout_check.sh [tests] [bench]   (default: both)
#   tests  the whole EP suite (moekit_ep_gpu_tests): virtual ranks of GPU 0, one thread per GPU
#          (EpNccl.LocalGpus*) and one process per GPU (EpMultiProcess.*, 2 GPUs and every GPU),
#          each test under both variants (they set MOEKIT_EP_DISPATCH themselves), and
#          EpMultiProcess.MixedDispatchVariants (a clean error on every rank)
#   bench  `moekit bench --ep R --ep-gpus` (one process per GPU), DeepSeek-V3, bf16 / mxfp8 /
#          nvfp4 payloads, bf16 combine rows, 1 / 32 / 128 / 512 tokens per rank, R = 2 and every
#          GPU, the variants alternating EP_ROUNDS times (default 1), with the phase trace.
#          Environment: EP_TOKENS, EP_REPS (20), EP_WORLDS ("2 <every GPU>"), EP_ROUNDS.
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
B=.devbuild
for z in $B/*.gz; do [ -e "$z" ] && gunzip -f "$z" && chmod +x "${z%.gz}"; done
export MOEKIT_TESTDATA="$PWD/$B/testdata"
steps="${*:-tests bench}"
# libnccl.so.2 for the EP code: the toolkit's, or a pip package's (as scripts/gpu_check.sh).
for d in /usr/local/cuda/lib /usr/local/cuda/lib64 /usr/local/cuda-13.0/lib \
         "$(dirname "$(find / -name libnccl.so.2 -path '*nvidia/nccl/lib*' 2>/dev/null | head -1)")"; do
  [ -e "$d/libnccl.so.2" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off
unset MOEKIT_EP_DISPATCH
ngpu=$(nvidia-smi -L | wc -l)
{
  date -u +%FT%TZ
  git rev-parse --short HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
} >"$OUT/env.txt" 2>&1
head -8 "$OUT/env.txt"
rc=0
for s in $steps; do
  case "$s" in
    tests)
      echo "=== ep tests, both dispatch variants, $ngpu GPUs"
      t0=$(date +%s)
      $B/moekit_ep_gpu_tests ${EP_FILTER:+--gtest_filter=$EP_FILTER} >"$OUT/ep_fanout_tests.log" 2>&1 || rc=1
      grep -E "^\[  (PASSED|FAILED|  SKIPPED) |Failure|MOEKIT_EP_DISPATCH=|EpMultiProcess .* s$" \
        "$OUT/ep_fanout_tests.log" | head -80
      tail -3 "$OUT/ep_fanout_tests.log"
      echo "tests: $(( $(date +%s) - t0 )) s" ;;
    bench)
      echo "=== ep bench, direct vs fanout, $ngpu GPUs"
      for R in ${EP_WORLDS:-2 $ngpu}; do
        [ "$R" -gt "$ngpu" ] && continue
        for round in $(seq 1 "${EP_ROUNDS:-1}"); do
          for v in direct fanout; do
            log="$OUT/bench_ep_r${R}_${v}_${round}.log"
            MOEKIT_EP_DISPATCH=$v $B/moekit bench --ep "$R" --ep-gpus --trace --shape deepseek-v3 \
              --ep-payload bf16,mxfp8,nvfp4 --ep-combine bf16 --tokens "${EP_TOKENS:-1,32,128,512}" \
              --reps "${EP_REPS:-20}" --json "$OUT/bench_ep_r${R}_${v}_${round}.json" >"$log" 2>&1 || rc=1
            echo "--- R=$R $v (round $round)"
            grep -v "^trace" "$log"
          done
        done
      done ;;
    *) echo "unknown step $s"; rc=1 ;;
  esac
done
exit $rc
