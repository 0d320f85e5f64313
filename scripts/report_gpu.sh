#!/usr/bin/env bash
# The performance report's GPU run (docs/REPORT.md), on one SM90 GPU (H100 or H200), from the repo
# root of the GPU machine after scripts/device_prep.sh on the build machine; `scripts/gpu_check.sh
# report` calls it. About 3-6 minutes on an H100; a deadline ($REPORT_DEADLINE_S, default 540 s)
# skips what is left, and the report is made from what was measured.
#   1. tune:  `moekit tune` of every preset x format, into $OUT/report/tuning.json
#   2. bench: `moekit bench --backend sm90` (the oracle's kernel with that fresh table) of every
#             preset x format, uniform and Zipf routing, token counts up to 16384, both kernels
#             timed (the oracle's regret), the time split at 1, 64, 1024, 8192 tokens
#   3. peers: bench/peers.py on every preset and routing (torch._grouped_mm bf16; triton_kernels
#             and FlashInfer where importable, from the wheels in $PEER_WHEELS if given)
#   4. $OUT/report/report.json: the above in one file (scripts/report.py collect)
# Then, on the build machine: copy report.json to data/report/<gpu>.json and tuning.json to
# data/tuning/<gpu>.json (<gpu> as `moekit tune` names it, e.g. nvidia_h100_80gb_hbm3), rebuild,
# and run "$(scripts/python_env.sh)" scripts/report.py.
# Environment: B (binaries, .devbuild), OUT (gpu-out), REPORT_PRESETS, REPORT_FORMATS,
# REPORT_TOKENS, REPORT_TUNE_TOKENS, REPORT_REPS, REPORT_BUDGET_MS, REPORT_STEPS (tune bench peers),
# REPORT_SPLIT (1,64,1024,8192), REPORT_DEADLINE_S, PEER_WHEELS (a directory of wheels for the peers), REPORT_BACKEND (sm90; the
# CPU test of this script runs it with cpu on a small shape).
set -uo pipefail
cd "$(dirname "$0")/.."
B="${B:-.devbuild}"
OUT="${OUT:-gpu-out}"
R="$OUT/report"
mkdir -p "$R"
PRESETS="${REPORT_PRESETS:-$("$B/moekit" bench --list-shapes | awk '{print $1}' | tr '\n' ' ')}"
FORMATS="${REPORT_FORMATS:-mxfp4 bf16 nvfp4 mxfp8}"
TOKENS="${REPORT_TOKENS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384}"
# The crossover lies at 8 to 16 routed rows per expert (tokens x k / E): 32 to 512 tokens here.
TUNE_TOKENS="${REPORT_TUNE_TOKENS:-1,2,4,8,16,32,64,96,128,192,256,384,512,768,1024,2048}"
REPS="${REPORT_REPS:-20}"
BUDGET="${REPORT_BUDGET_MS:-40}"
STEPS="${REPORT_STEPS:-tune bench peers}"
DEADLINE="${REPORT_DEADLINE_S:-540}"
BACKEND="${REPORT_BACKEND:-sm90}"
SPLIT="${REPORT_SPLIT-1,64,1024,8192}"  # empty: no time split
start=$(date +%s)
rc=0
elapsed() { echo $(($(date +%s) - start)); }
late() {  # true (and says so) past the deadline
  if [ "$(elapsed)" -ge "$DEADLINE" ]; then
    echo "report: past the ${DEADLINE} s deadline, skipping $*" | tee -a "$R/skipped.log"
    return 0
  fi
  return 1
}
clocks() {
  command -v nvidia-smi >/dev/null || { echo "n/a (no nvidia-smi)"; return; }
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader 2>&1 | head -1
}
n_presets=$(echo $PRESETS | wc -w)
n_formats=$(echo $FORMATS | wc -w)
total=$((n_presets * n_formats))
echo "report: presets $PRESETS; formats $FORMATS; tokens $TOKENS; reps $REPS, budget ${BUDGET} ms per quantity"
clocks_before="$(clocks)"

if [[ " $STEPS " == *" tune "* ]]; then
  rm -f "$R/tuning.json"
  i=0
  for p in $PRESETS; do
    for f in $FORMATS; do
      i=$((i + 1))
      late "tune $p $f" && continue
      "$B/moekit" tune --shape "$p" --format "$f" --tokens "$TUNE_TOKENS" --reps 10 --budget-ms "$BUDGET" \
        --out "$R/tuning.json" --progress >>"$R/tune.log" 2>&1 || { rc=1; echo "report: tune $p $f failed (tune.log)"; }
      echo "[tune $i/$total, $(elapsed) s] $p $f: $(grep crossover "$R/tune.log" | tail -1 | cut -d';' -f1)"
    done
  done
fi

if [[ " $STEPS " == *" bench "* ]]; then
  # Formats outermost: past the deadline, every preset has the first formats.
  i=0
  for f in $FORMATS; do
    for p in $PRESETS; do
      i=$((i + 1))
      late "bench $p $f" && continue
      tuning=()  # the table just measured, read before the compiled-in ones
      [ -f "$R/tuning.json" ] && tuning=(MOEKIT_TUNING="$(cd "$R" && pwd)/tuning.json")
      env "${tuning[@]}" "$B/moekit" bench --shape "$p" --format "$f" --backend "$BACKEND" \
        --tokens "$TOKENS" --routing uniform,zipf ${SPLIT:+--split "$SPLIT"} --reps "$REPS" --budget-ms "$BUDGET" \
        --progress --json "$R/bench_${p}_${f}.json" --csv "$R/bench_${p}_${f}.csv" >>"$R/bench.log" 2>&1 ||
        { rc=1; echo "report: bench $p $f failed (bench.log)"; }
      echo "[bench $i/$total, $(elapsed) s] $p $f"
    done
  done
fi

if [[ " $STEPS " == *" peers "* ]] && ! late "peers"; then
  shapes=()
  for p in $PRESETS; do shapes+=(--shape "$p"); done
  PYTHONUNBUFFERED=1 python3 bench/peers.py "${shapes[@]}" --moekit "$B/moekit" --tokens "$TOKENS" \
    --routing uniform,zipf --reps "$REPS" --budget-ms "$BUDGET" ${PEER_WHEELS:+--wheels "$PEER_WHEELS"} \
    --json "$R/peers_all.json" >>"$R/peers.log" 2>&1 || { rc=1; echo "report: peers failed (peers.log)"; }
  grep -E "^peer|^peers:" "$R/peers.log" | sort -u
  echo "[peers, $(elapsed) s] $(grep -c '"us"' "$R/peers.log") rows"
fi

# What ran: versions and clocks, for the report's header.
python3 - "$R/versions.json" "$clocks_before" "$(clocks)" "$(elapsed)" <<'EOF' || rc=1
import json, platform, sys
v = {"python": platform.python_version(), "clocks before (SM, memory, power, temperature, throttle)": sys.argv[2],
     "clocks after": sys.argv[3], "wall time of the GPU run (s)": sys.argv[4]}
try:
    import torch
    v["torch"] = torch.__version__
except ImportError:
    pass
json.dump(v, open(sys.argv[1], "w"), indent=1)
EOF
python3 scripts/report.py collect "$R" -o "$R/report.json" || rc=1
echo "report: $(elapsed) s; $R/report.json, $R/tuning.json (exit $rc)"
exit $rc
