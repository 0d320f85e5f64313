#!/usr/bin/env bash
# Runs on the GPU machine from the repo root, after scripts/device_prep.sh on the build
# machine: GPU tests, compute-sanitizer passes, benchmarks. Logs go under $OUT (./gpu-out).
# Usage: scripts/gpu_check.sh [tests] [variants] [sanitize] [bench] [steady] [trace] [formats] [peer]
#        [sass] [corpus] [python] [python_bench] [tune] [tune_check] [prefill] [report] [ep] [checkpoints]
#        [choice] [stress] [probe] [ep_gpus] [ep_procs] [ep_fanout] [ep_before] [ep_python] [transformers]
#        [transformers_bench] [dsv4] [fp8]
#        (default: tests variants sanitize bench formats peer python python_bench tune_check)
# The GPU suite takes ~90 s a pass on an H100: `tests` (the device's own CTA shape, direct
# launches, small prefill tiles: ~5 min) and `variants` (five forced shape / chunk-row passes:
# ~8 min) can run as separate invocations.
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
B=.devbuild
# The binaries travel gzipped (scripts/device_prep.sh).
for z in $B/*.gz; do [ -e "$z" ] && gunzip -f "$z" && chmod +x "${z%.gz}"; done
export MOEKIT_TESTDATA="$PWD/$B/testdata"
export MOEKIT_GOLDEN="$PWD/tests/golden"  # the repo's own golden files (DeepSeek-V4)
steps="${*:-tests variants sanitize bench formats peer python python_bench tune_check}"
{
  date -u +%FT%TZ
  echo "binaries built at: $(cat $B/BUILD_COMMIT 2>/dev/null || echo unknown) (this tree: $(git rev-parse --short HEAD 2>/dev/null))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# SM / memory clocks, power, temperature and throttle reasons (0x4: software power cap), read
# around the benchmarks: a capped GPU runs its SMs slower.
clocks() {
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader 2>&1
}
# The Python package's dependencies from the carried wheels (once per run).
py_ready=0
py_env() {
  [ $py_ready = 1 ] && return 0
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-index --find-links $B/wheels apache-tvm-ffi \
    >"$OUT/pip.log" 2>&1 && py_ready=1
}
# libnccl.so.2 for the EP code (loaded at run time): the toolkit's, or a pip package's (torch's).
nccl_path() {
  for d in /usr/local/cuda/lib /usr/local/cuda/lib64 /usr/local/cuda-13.0/lib \
           "$(dirname "$(find / -name libnccl.so.2 -path '*nvidia/nccl/lib*' 2>/dev/null | head -1)")"; do
    [ -e "$d/libnccl.so.2" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
  done
  export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off
}
rc=0
# sanitize NAME BINARY FILTER TOOL...: compute-sanitizer (each tool) on the tests FILTER names, a
# log each in $OUT/NAME_sanitize_TOOL.log, and its summary line.
sanitize() {
  local name=$1 bin=$2 filter=$3 tool
  shift 3
  for tool in "$@"; do
    compute-sanitizer --tool $tool --error-exitcode 9 $bin --gtest_filter="$filter" \
      >"$OUT/${name}_sanitize_$tool.log" 2>&1 || rc=1
    echo "$name $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/${name}_sanitize_$tool.log" | tr '\n' ' ')"
  done
}
for s in $steps; do
  case "$s" in
    tests|variants)
      # tests: the device's own CTA shape and chunk rows (the rules), "direct": eager calls
      # launched kernel by kernel instead of replayed as graphs (pipeline/launch_sm90.cuh),
      # "small": the prefill kernel's small-tile variant on every prefill call of MXFP4 and NVFP4
      # weights (kernel_choice.h). variants: both CTA shapes (experts/sm90_shape.h), whichever the
      # device's rule would pick, and the decode kernel's 16-row chunks (both shapes) and 24-row
      # chunks on every call (oracle/kernel_choice.h decode_chunk_rows).
      runs="default direct small"; [ "$s" = variants ] && runs="narrow wide narrow:16 wide:16 narrow:24"
      for run in $runs; do
        shape=${run%%:*}; rows=${run#*:}; [ "$rows" = "$run" ] && rows=
        [ "$run" = default ] && shape=
        graphs=1; [ "$run" = direct ] && { shape=; graphs=0; }
        tiles=; [ "$run" = small ] && { shape=; tiles=small; }
        log="$OUT/gpu_tests_${run/:/_r}.log"
        echo "=== gpu tests, ${shape:-default} CTA shape${rows:+, $rows-row decode chunks}$([ $graphs = 0 ] && echo ', direct launches')${tiles:+, small prefill tiles}"
        MOEKIT_LAUNCH_GRAPHS=$graphs MOEKIT_GEMM_SHAPE=$shape MOEKIT_DECODE_ROWS=$rows MOEKIT_PREFILL_TILES=$tiles \
          $B/moekit_gpu_tests \
          ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} >"$log" 2>&1 || rc=1
        grep -E "^\[  (PASSED|FAILED) |FAILED|Failure|error" "$log" | head -40
        tail -3 "$log"
      done ;;
    sanitize)
      echo "=== compute-sanitizer"
      for run in narrow wide narrow:16 wide:16 narrow:24 small; do
        shape=${run%%:*}; rows=${run#*:}; [ "$rows" = "$run" ] && rows=
        tiles=; [ "$run" = small ] && { shape=; tiles=small; }
        for tool in memcheck racecheck; do
          log="$OUT/sanitize_${tool}_${shape:-$tiles}${rows:+_r$rows}.log"
          MOEKIT_GEMM_SHAPE=$shape MOEKIT_DECODE_ROWS=$rows MOEKIT_PREFILL_TILES=$tiles \
            compute-sanitizer --tool $tool --error-exitcode 9 \
            $B/moekit_gpu_tests --gtest_filter='Sm90Sanitize.*:GpuDequant.*:Dsv4Sanitize.*' >"$log" 2>&1 || rc=1
          echo "$tool (${shape:-$tiles}${rows:+, $rows-row chunks}): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$log" | tr '\n' ' ')"
        done
      done ;;
    stress)
      # The prefill kernel's hang stress (docs/perf/notebook.md, eighteenth section): the gpt-oss-120b
      # BF16 layer (and, every other process, the MXFP4 layer on the small-tile kernel) under Zipf
      # routing at 1024 and 8192 tokens with the layer split (each point
      # replays ~10 graphs in turns), 34 points per process, processes back to back for
      # STRESS_SECONDS (default 300). A hang ends as a trap record within 30 s.
      echo "=== prefill stress"
      points=$(python3 -c "print(','.join(['1024'] * 30 + ['8192'] * 4))")
      end=$((SECONDS + ${STRESS_SECONDS:-300})); n=0; failed=0
      while [ $SECONDS -lt $end ]; do
        n=$((n + 1))
        # Every other process: MXFP4 on the small-tile prefill kernel (forced at every count).
        fmt=bf16; tiles=; [ $((n % 2)) = 0 ] && { fmt=mxfp4; tiles=small; }
        MOEKIT_PREFILL_TILES=$tiles timeout 100 $B/moekit bench --shape gpt-oss-120b --format $fmt --backend sm90 \
          --tokens "$points" --routing zipf --split 1024,8192 --reps 20 --budget-ms 40 >"$OUT/stress_$n.log" 2>&1 || {
          failed=$((failed + 1)); grep -h "error" "$OUT/stress_$n.log"; }
      done
      echo "prefill stress: $failed of $n processes failed ($((n * 34)) points)" | tee "$OUT/stress.txt"
      [ $failed = 0 ] || rc=1 ;;
    bench)
      echo "=== moekit bench"
      echo "clocks before: $(clocks)" | tee -a "$OUT/bench.log"
      for shape in ${BENCH_SHAPES:-gpt-oss-120b deepseek-v3}; do
        for be in ${BENCH_BACKENDS:-sm90_decode}; do
          $B/moekit bench --shape $shape --format ${BENCH_FORMAT:-mxfp4} --tokens ${BENCH_TOKENS:-1,8,32,64} \
            --backend $be --json "$OUT/bench_${shape}_${be}.json" 2>&1 | tee -a "$OUT/bench.log" || rc=1
        done
      done
      echo "clocks after: $(clocks)" | tee -a "$OUT/bench.log" ;;
    steady)
      echo "=== steady state: 8 layers with weights of their own back to back in one graph"
      for shape in ${BENCH_SHAPES:-gpt-oss-120b deepseek-v3}; do
        $B/moekit bench --shape $shape --format ${BENCH_FORMAT:-mxfp4} --tokens ${BENCH_TOKENS:-1,8,32,64} \
          --steady 8 2>&1 | tee -a "$OUT/steady.log" || rc=1
        echo "clocks after $shape: $(clocks)" | tee -a "$OUT/steady.log"
      done ;;
    trace)
      echo "=== in-kernel trace at one token"
      for shape in ${BENCH_SHAPES:-gpt-oss-120b deepseek-v3}; do
        $B/moekit bench --shape $shape --tokens 1 --reps 20 --trace 2>&1 | tee -a "$OUT/trace.log" || rc=1
      done ;;
    corpus)
      # The bad-input corpus (tests/test_corpus.cpp) and the backend-agreement tests through each
      # SM90 backend: the same exit codes and messages as on the CPU, no GPU fault.
      for be in sm90_decode sm90_decode_batched; do
        echo "=== bad-input corpus, $be"
        MOEKIT_BIN=$PWD/$B/moekit MOEKIT_BACKEND=$be $B/moekit_tests \
          --gtest_filter='Corpus/*:CorpusSize.*:Pipeline.BypassInputsTheLayerCannotMeanAreRefused:Pipeline.ValueChecks*' \
          >"$OUT/corpus_$be.log" 2>&1 || rc=1
        grep -E "^\[  FAILED  \]|Failure" "$OUT/corpus_$be.log" | head -40
        tail -3 "$OUT/corpus_$be.log"
      done ;;
    probe)
      # The swapped-operand structure (bench/swap_ab_probe.cu): the two operand orders of one k16
      # step against the exact sum and bit for bit, then the tensor rate and the writers' rate on
      # shared-memory data (docs/perf/notebook.md, twenty-ninth and thirtieth sections).
      echo "=== swap_ab_probe"
      $B/moekit_swap_ab_probe check >"$OUT/swap_ab_probe.log" 2>&1 || rc=1
      $B/moekit_swap_ab_probe 20000 >>"$OUT/swap_ab_probe.log" 2>&1 || rc=1
      cat "$OUT/swap_ab_probe.log" ;;
    sass)
      # Every instantiation of the fused GEMM kernel (cuobjdump -fun wants the mangled name).
      cuobjdump -sass $B/moekit 2>&1 | awk '/Function : /{p = /moe_gemm_kernel/} p' >"$OUT/sass.txt" || rc=1
      cuobjdump -res-usage $B/moekit 2>&1 | grep -A1 moe_gemm_kernel >"$OUT/res_usage.txt" || rc=1
      echo "$(grep -c 'Function : ' "$OUT/sass.txt") kernels, $(wc -l <"$OUT/sass.txt") lines in sass.txt" ;;
    formats)
      echo "=== other weight formats and the batched backend (gpt-oss-120b)"
      for f in nvfp4 mxfp8 bf16; do
        $B/moekit bench --shape gpt-oss-120b --format $f --tokens 1,8,64 --reps 20 2>&1 | grep -E "sm90|bench" | tee -a "$OUT/bench.log"
      done
      $B/moekit bench --shape gpt-oss-120b --tokens 1,8,64 --backend sm90_decode_batched --reps 20 2>&1 | grep sm90 | tee -a "$OUT/bench.log"
      $B/moekit bench --shape qwen3-30b-a3b --tokens 1,8,32,64 --reps 20 2>&1 | grep -E "sm90|bench" | tee -a "$OUT/bench.log" ;;
    peer)
      echo "=== peers (bench/peers.py: torch._grouped_mm bf16, and triton_kernels / FlashInfer where importable)"
      for shape in ${BENCH_SHAPES:-gpt-oss-120b deepseek-v3}; do
        PYTHONUNBUFFERED=1 python3 bench/peers.py --shape $shape --moekit $B/moekit --tokens ${BENCH_TOKENS:-1,8,32,64} \
          ${PEER_WHEELS:+--wheels $PEER_WHEELS} --json "$OUT/peers_${shape}.json" 2>&1 | tee -a "$OUT/peer.log" || rc=1
      done ;;
    tune)
      # The decode/prefill crossover of every preset (MXFP4) and of GPT-OSS-120B in every format,
      # into one table for this GPU (committed under data/tuning/ by hand after review).
      for spec in ${TUNE_SPECS:-gpt-oss-120b:mxfp4 gpt-oss-20b:mxfp4 deepseek-v3:mxfp4 qwen3-30b-a3b:mxfp4 gpt-oss-120b:nvfp4 gpt-oss-120b:mxfp8 gpt-oss-120b:bf16}; do
        $B/moekit tune --shape ${spec%%:*} --format ${spec##*:} --out "$OUT/tuning.json" ${TUNE_TOKENS:+--tokens $TUNE_TOKENS} \
          2>&1 | tee -a "$OUT/tune.log" | grep -E "crossover|error" || rc=1
      done ;;
    tune_check)
      # The oracle's choice timed again against the table of this GPU (`moekit tune --check`: both
      # kernels at each entry's crossover and a measured count either side, uniform and Zipf, the
      # regret of the kernel the oracle picks; over 3% fails). TUNE_CHECK_TABLE: a table file instead
      # of the compiled-in ones (e.g. $OUT/report/tuning.json after `report`); TUNE_CHECK_POINTS: 1-3
      # points per entry; TUNE_CHECK_SHAPE / TUNE_CHECK_FORMAT: one preset / format only.
      echo "=== moekit tune --check"
      $B/moekit tune --check ${TUNE_CHECK_TABLE:+--table "$TUNE_CHECK_TABLE"} ${TUNE_CHECK_POINTS:+--points $TUNE_CHECK_POINTS} \
        ${TUNE_CHECK_SHAPE:+--shape $TUNE_CHECK_SHAPE} ${TUNE_CHECK_FORMAT:+--format $TUNE_CHECK_FORMAT} \
        >"$OUT/tune_check.log" 2>&1 || rc=1
      grep -E "^moekit tune|OVER|^tune --check|^  [^ ]|^re-measure|rror" "$OUT/tune_check.log" ;;
    choice)
      # The decode/prefill choice on the device (oracle/kernel_choice.h) in the band around the
      # crossover: its GPU tests (the chosen kernel's bits, both kernels against the CPU, graph
      # capture) and the sanitizers on its small case, then `moekit tune` and `moekit bench
      # --backend sm90` of every preset x format on uniform and Zipf routing through the band (both
      # kernels timed alone beside the layer's path, the launches of the one not chosen included),
      # summarized by bench/regret_study.py --bench: the measured regret of the layer's path, per
      # routing, and what the choice costs. CHOICE_PRESETS / CHOICE_FORMATS / CHOICE_TOKENS narrow
      # it (two runs of three presets each fit the 10-minute limit more surely); CHOICE_TUNE=0.
      echo "=== device choice: tests"
      $B/moekit_gpu_tests --gtest_filter='Sm90KernelChoice.*:Sm90Prefill.CrossoverBackendRoutes:Sm90.*:Api*.*' \
        >"$OUT/choice_tests.log" 2>&1 || rc=1
      grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/choice_tests.log" | head -40
      sanitize choice $B/moekit_gpu_tests 'Sm90KernelChoice.RoutedPathAndOutsideTheBand' memcheck racecheck
      mkdir -p "$OUT/choice"
      echo "clocks before: $(clocks)" | tee -a "$OUT/choice.log"
      # The table: re-tuned here (crossovers and stream ratios of this build's kernels, into
      # $OUT/choice/tuning.json, to commit as data/tuning/<gpu>.json after review), or with
      # CHOICE_TUNE=0 the compiled-in one.
      choice_env=()
      if [ "${CHOICE_TUNE:-1}" = 1 ]; then
        echo "=== device choice: tune"
        rm -f "$OUT/choice/tuning.json"
        for p in ${CHOICE_PRESETS:-$($B/moekit bench --list-shapes | awk '{print $1}')}; do
          for f in ${CHOICE_FORMATS:-mxfp4 nvfp4 mxfp8 bf16}; do
            $B/moekit tune --shape $p --format $f --tokens 1,2,4,8,16,32,64,96,128,192,256,384,512,768,1024,2048 \
              --reps 10 --budget-ms 40 --out "$OUT/choice/tuning.json" 2>&1 | tee -a "$OUT/choice_tune.log" \
              | grep -E "^crossover|rror" || rc=1
          done
        done
        choice_env=(MOEKIT_TUNING="$OUT/choice/tuning.json")
      fi
      echo "=== device choice: bench (uniform and zipf)"
      for p in ${CHOICE_PRESETS:-$($B/moekit bench --list-shapes | awk '{print $1}')}; do
        for f in ${CHOICE_FORMATS:-mxfp4 nvfp4 mxfp8 bf16}; do
          env "${choice_env[@]}" $B/moekit bench --shape $p --format $f --backend sm90 --routing uniform,zipf \
            --tokens ${CHOICE_TOKENS:-1,4,8,16,32,64,128,256,512,1024} --reps ${BENCH_REPS:-20} --budget-ms 150 \
            --json "$OUT/choice/${p}_${f}.json" >>"$OUT/choice.log" 2>&1 || { rc=1; echo "bench $p $f failed"; }
        done
      done
      echo "clocks after: $(clocks)" | tee -a "$OUT/choice.log"
      python3 bench/regret_study.py --moekit $B/moekit --bench "$OUT"/choice/*.json 2>&1 | tee "$OUT/choice_regret.txt" || rc=1 ;;
    prefill)
      # Prefill sizes against torch in the same invocation (the oracle's kernel, both kernels timed).
      for shape in ${BENCH_SHAPES:-gpt-oss-120b deepseek-v3 qwen3-30b-a3b}; do
        $B/moekit bench --shape $shape --format ${BENCH_FORMAT:-mxfp4} --tokens ${PREFILL_TOKENS:-512,2048,4096,8192} \
          --backend sm90 --reps ${BENCH_REPS:-10} --peer torch --json "$OUT/prefill_${shape}.json" 2>&1 | tee -a "$OUT/prefill.log" || rc=1
      done ;;
    report)
      # The performance report (docs/REPORT.md): tune, bench and peers of every preset x format x
      # routing, into $OUT/report/ (report.json, tuning.json); scripts/report_gpu.sh says what next.
      echo "=== performance report (scripts/report_gpu.sh)"
      echo "clocks before: $(clocks)"
      OUT="$OUT" B="$B" scripts/report_gpu.sh 2>&1 | tee "$OUT/report.log" || rc=1
      echo "clocks after: $(clocks)" ;;
    python)
      # The Python package from the working tree with the CUDA-built binding of .devbuild/ and
      # the carried apache-tvm-ffi wheel: every pytest test (the `gpu` ones included), then the
      # README's example under a CUDA graph (in the tests too).
      echo "=== python: pytest"
      py_env || rc=1
      PYTHONPATH="$PWD/python" MOEKIT_FFI_LIBRARY="$PWD/$B/libmoekit_ffi.so" \
        python3 -m pytest -q -p no:cacheprovider -rs tests/python >"$OUT/pytest.log" 2>&1 || rc=1
      tail -15 "$OUT/pytest.log" ;;
    ep)
      # Expert parallelism on virtual ranks (tests/gpu/test_ep_gpu.cpp), compute-sanitizer on
      # its reduced set, `moekit bench --ep 8` (DeepSeek-V3, 128 tokens per rank, each payload),
      # and torch's all_to_all_single on the same bytes where torch is installed. The NCCL test
      # loads libnccl.so.2: the toolkit's, or a pip package's (torch's), when the machine has one.
      echo "=== ep: tests"
      nccl_path
      $B/moekit_ep_gpu_tests >"$OUT/ep_tests.log" 2>&1 || rc=1
      grep -E "^\[  (PASSED|FAILED|  SKIPPED) |Failure|SKIPPED" "$OUT/ep_tests.log" | head -40
      tail -3 "$OUT/ep_tests.log"
      sanitize ep $B/moekit_ep_gpu_tests 'EpSanitize.*' memcheck racecheck
      echo "=== ep: bench"
      for p in bf16 mxfp8 nvfp4; do
        $B/moekit bench --ep 8 --shape deepseek-v3 --tokens ${EP_TOKENS:-1,128} --ep-payload $p --reps 30 \
          --json "$OUT/bench_ep_$p.json" 2>&1 | tee -a "$OUT/bench_ep.log" || rc=1
      done
      if python3 -c "import torch" 2>/dev/null; then
        python3 bench/ep_all_to_all.py --tokens ${EP_TOKENS:-1,128} 2>&1 | tee -a "$OUT/bench_ep.log" || rc=1
      else
        echo "torch baseline: skipped (no torch)" | tee -a "$OUT/bench_ep.log"
      fi ;;
    ep_gpus)
      # Expert parallelism over this machine's GPUs (two or more; NVLink): the EpNccl.LocalGpus*
      # tests and ApiGpu.EveryGpuOfTheProcess, then `moekit bench --ep R --ep-gpus` (R: every GPU)
      # on DeepSeek-V3 with each payload and on gpt-oss-120b (bf16), and torch's all_to_all_single
      # over the same GPUs (bench/ep_all_to_all.py: one process per GPU).
      nccl_path
      ngpu=$(nvidia-smi -L | wc -l)
      echo "=== ep over $ngpu GPUs: tests"
      $B/moekit_ep_gpu_tests --gtest_filter='EpNccl.*' >"$OUT/ep_gpus_tests.log" 2>&1 || rc=1
      $B/moekit_gpu_tests --gtest_filter='ApiGpu.EveryGpuOfTheProcess' >>"$OUT/ep_gpus_tests.log" 2>&1 || rc=1
      grep -E "^\[  (PASSED|FAILED|  SKIPPED|       OK) |Failure" "$OUT/ep_gpus_tests.log" | head -40
      echo "=== ep over $ngpu GPUs: bench"
      for spec in deepseek-v3:bf16 deepseek-v3:mxfp8 deepseek-v3:nvfp4 gpt-oss-120b:bf16; do
        $B/moekit bench --ep "$ngpu" --ep-gpus --shape ${spec%%:*} --ep-payload ${spec##*:} \
          --tokens ${EP_TOKENS:-1,8,32,128,512,2048,4096} --reps 30 --json "$OUT/bench_ep_gpus_${spec/:/_}.json" 2>&1 \
          | tee -a "$OUT/bench_ep_gpus.log" || rc=1
      done
      for shape in deepseek-v3 gpt-oss-120b; do
        python3 bench/ep_all_to_all.py --shape $shape --tokens ${EP_TOKENS:-1,8,32,128,512,2048,4096} --reps 30 2>&1 \
          | tee -a "$OUT/bench_ep_gpus.log" || rc=1
      done ;;
    ep_procs)
      # Expert parallelism one process per GPU, as engines run (two or more GPUs): the whole EP
      # suite (virtual ranks, one thread per GPU, and EpMultiProcess.*: each scenario on 2
      # processes and on every GPU), memcheck on one multi-process scenario, then
      # `moekit bench --ep R --ep-gpus --peer torch` (R processes, torch's all_to_all_single on the
      # same GPUs in the same invocation, the single-GPU layer on one rank's share) on DeepSeek-V3
      # (every payload, fp32 and bf16 combine rows) and gpt-oss-120b, with the phase trace.
      nccl_path
      ngpu=$(nvidia-smi -L | wc -l)
      if [ -z "${EP_NO_TESTS:-}" ]; then
        echo "=== ep over $ngpu GPUs, one process each: tests"
        $B/moekit_ep_gpu_tests ${EP_FILTER:+--gtest_filter=$EP_FILTER} >"$OUT/ep_procs_tests.log" 2>&1 || rc=1
        grep -E "^\[  (PASSED|FAILED|  SKIPPED) |Failure|EpMultiProcess .* s$|rel-L2" "$OUT/ep_procs_tests.log" | head -60
        tail -3 "$OUT/ep_procs_tests.log"
      fi
      if [ -z "${EP_NO_SANITIZE:-}" ]; then
        MOEKIT_EP_RANK_WRAP="compute-sanitizer --tool memcheck --error-exitcode 9" \
          $B/moekit_ep_gpu_tests --gtest_filter='EpMultiProcess.Layouts' >"$OUT/ep_procs_memcheck.log" 2>&1 || rc=1
        echo "ep processes memcheck: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/ep_procs_memcheck.log" | tr '\n' ' ')"
      fi
      [ -n "${EP_NO_BENCH:-}" ] && continue
      echo "=== ep over $ngpu GPUs, one process each: bench"
      for R in ${EP_WORLDS:-2 $ngpu}; do
        [ "$R" -gt "$ngpu" ] && continue
        for spec in ${EP_SPECS:-deepseek-v3:bf16,mxfp8,nvfp4:fp32 deepseek-v3:bf16,nvfp4:bf16 gpt-oss-120b:bf16,nvfp4:fp32}; do
          IFS=: read -r shape pay comb <<<"$spec"
          $B/moekit bench --ep "$R" --ep-gpus --peer torch --trace --shape $shape --ep-payload $pay --ep-combine $comb \
            --tokens ${EP_TOKENS:-1,8,32,128,512,2048,4096} --reps ${EP_REPS:-20} \
            --json "$OUT/bench_ep_r${R}_${shape}_${comb}.json" 2>&1 | tee -a "$OUT/bench_ep_procs.log" \
            | grep -v "^trace" || rc=1
        done
      done ;;
    ep_fanout)
      # The fan-out EP dispatch (MOEKIT_EP_DISPATCH=fanout, docs/EP.md) against the direct one and auto
      # (two or more GPUs; DEVPREP_ONLY="moekit moekit_ep_gpu_tests moekit_ep_rank_tests" is
      # enough). Tests: the whole EP suite, where every layout / layer / fault test runs under both
      # variants (virtual ranks of GPU 0, a thread per GPU, a process per GPU on 2 GPUs and on all)
      # and EpMultiProcess.MixedDispatchVariants. Bench: `moekit bench --ep R --ep-gpus` (a
      # process per GPU), DeepSeek-V3, bf16 / mxfp8 / nvfp4 payloads, bf16 combine rows, 1 / 32 /
      # 128 / 512 tokens, R = 2 and every GPU, the variants (EP_VARIANTS, default direct fanout auto)
      # alternating EP_ROUNDS times, with
      # the phase trace (fan_wait / fanned: the receiver's wait and copy). EP_NO_TESTS,
      # EP_NO_BENCH, EP_FILTER, EP_TOKENS, EP_REPS, EP_WORLDS as for ep_procs.
      nccl_path
      unset MOEKIT_EP_DISPATCH
      ngpu=$(nvidia-smi -L | wc -l)
      if [ -z "${EP_NO_TESTS:-}" ]; then
        echo "=== ep fan-out: tests, both dispatch variants, $ngpu GPUs"
        $B/moekit_ep_gpu_tests ${EP_FILTER:+--gtest_filter=$EP_FILTER} >"$OUT/ep_fanout_tests.log" 2>&1 || rc=1
        grep -E "^\[  (PASSED|FAILED|  SKIPPED) |Failure|MOEKIT_EP_DISPATCH=|EpMultiProcess .* s$" \
          "$OUT/ep_fanout_tests.log" | head -80
        tail -3 "$OUT/ep_fanout_tests.log"
      fi
      [ -n "${EP_NO_BENCH:-}" ] && continue
      echo "=== ep fan-out: bench, direct vs fanout, $ngpu GPUs"
      for R in ${EP_WORLDS:-2 $ngpu}; do
        [ "$R" -gt "$ngpu" ] && continue
        for round in $(seq 1 "${EP_ROUNDS:-1}"); do
          for v in ${EP_VARIANTS:-direct fanout auto}; do
            log="$OUT/bench_ep_fanout_r${R}_${v}_${round}.log"
            MOEKIT_EP_DISPATCH=$v $B/moekit bench --ep "$R" --ep-gpus --trace --shape deepseek-v3 \
              --ep-payload bf16,mxfp8,nvfp4 --ep-combine bf16 --tokens "${EP_TOKENS:-1,32,128,512}" \
              --reps "${EP_REPS:-20}" --json "$OUT/bench_ep_fanout_r${R}_${v}_${round}.json" >"$log" 2>&1 || rc=1
            echo "--- R=$R $v (round $round)"
            grep -v "^trace" "$log"
          done
        done
      done ;;
    ep_python)
      # The EP layer from Python, one process per GPU over a torch.distributed NCCL group
      # (tests/python/test_ep_torch.py).
      echo "=== ep: python"
      nccl_path
      py_env || rc=1
      PYTHONPATH="$PWD/python" MOEKIT_FFI_LIBRARY="$PWD/$B/libmoekit_ffi.so" \
        python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_ep_torch.py >"$OUT/pytest_ep.log" 2>&1 || rc=1
      tail -15 "$OUT/pytest_ep.log" ;;
    ep_before)
      # Where the ~1 ms of dispatch over NVLink came from (docs/perf/log.md): 28ea46f's binary
      # (.devbuild/moekit_old, when carried) as it was measured, one thread per GPU; today's
      # kernels timed the old way (threads, no device-side start: MOEKIT_EP_BENCH_ALIGN=0) with
      # the phase trace; the same with the old waits and grid (MOEKIT_EP_HOST_POLL=1,
      # MOEKIT_EP_CTAS=1000); and today's kernels with the ranks' timed regions started together,
      # threads and processes.
      nccl_path
      tok=${EP_TOKENS:-1,32,128}
      if [ -x $B/moekit_old ]; then
        echo "=== ep dispatch: 28ea46f's binary, threads"
        $B/moekit_old bench --ep 2 --ep-gpus --shape deepseek-v3 --ep-payload bf16 --tokens $tok --reps 10 2>&1 \
          | tee "$OUT/ep_before_old.log" || rc=1
      fi
      for mode in threads_unaligned threads_unaligned_oldwaits threads procs; do
        envs=""; flags="--ep-threads"
        case $mode in
          threads_unaligned) envs="MOEKIT_EP_BENCH_ALIGN=0" ;;
          threads_unaligned_oldwaits) envs="MOEKIT_EP_BENCH_ALIGN=0 MOEKIT_EP_HOST_POLL=1 MOEKIT_EP_CTAS=1000" ;;
          procs) flags="" ;;
        esac
        echo "=== ep dispatch: $mode"
        env $envs $B/moekit bench --ep 2 --ep-gpus $flags --trace --shape deepseek-v3 --ep-payload bf16 \
          --tokens $tok --reps 10 2>&1 | tee "$OUT/ep_before_$mode.log" | grep -v "^trace" || rc=1
        grep "^trace" "$OUT/ep_before_$mode.log" | grep " dispatch " | head -8
      done ;;
    checkpoints)
      # Hugging Face checkpoint layers through the SM90 backends (tests/gpu/test_checkpoints_gpu.cpp),
      # then end to end: a GPT-OSS-20B-shaped checkpoint run from hidden_states alone on each SM90
      # backend against the CPU, and one layer's load + pack on the GPU.
      echo "=== checkpoints: every published layout on every SM90 backend"
      $B/moekit_gpu_tests --gtest_filter='Checkpoints.*' >"$OUT/checkpoints_tests.log" 2>&1 || rc=1
      grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/checkpoints_tests.log" | head -20
      ck=$(mktemp -d)
      $B/moekit_checkpoint_load write "$ck/ckpt" --shape gpt-oss-20b --layers 2 --shards 3 --input "$ck/x.safetensors" \
        --tokens ${CKPT_TOKENS:-64} 2>&1 | tee -a "$OUT/checkpoints.log" || rc=1
      for be in cpu sm90 sm90_decode sm90_prefill; do
        $B/moekit run --model "$ck/ckpt" --layer 1 --input "$ck/x.safetensors" --output "$ck/y_$be.safetensors" \
          --backend $be 2>&1 | tee -a "$OUT/checkpoints.log" || rc=1
        [ $be = cpu ] || $B/moekit_checkpoint_load compare "$ck/y_$be.safetensors" "$ck/y_cpu.safetensors" 2>&1 \
          | tee -a "$OUT/checkpoints.log" || rc=1
      done
      $B/moekit_checkpoint_load load "$ck/ckpt" --layer 1 --backend sm90 --reps 3 --sm90-convert 1 2>&1 \
        | tee -a "$OUT/checkpoints.log" || rc=1
      rm -rf "$ck" ;;
    transformers|transformers_bench)
      # The "moekit" experts backend inside transformers (the GPU machine's torch and transformers):
      # `transformers`: tests/python/test_transformers_gpu.py (real layer sizes against eager,
      # static-cache generate under CUDA graphs); `transformers_bench`: decode (batch 1, 32) and
      # 2048-token prefill throughput of moekit, grouped_mm and batched_mm in one run per model
      # (TF_BENCH_ARCHS, default gpt_oss qwen3_moe deepseek_v3; TF_BENCH_ARGS: more of its options,
      # e.g. "--reps 2 --new-tokens 32").
      py_env || rc=1
      if [ "$s" = transformers ]; then
        echo "=== transformers: moekit experts backend, real layer sizes"
        PYTHONPATH="$PWD/python" MOEKIT_FFI_LIBRARY="$PWD/$B/libmoekit_ffi.so" \
          python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_transformers_gpu.py 2>&1 \
          | tee "$OUT/transformers_tests.log" | grep -E "rel-L2|generate|passed|failed|SKIPPED|Error" || rc=1
        grep -qE "[0-9]+ passed" "$OUT/transformers_tests.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/transformers_tests.log" || rc=1
      else
        for arch in ${TF_BENCH_ARCHS:-gpt_oss qwen3_moe deepseek_v3}; do
          layers=4; [ "$arch" = deepseek_v3 ] && layers=2
          echo "=== transformers throughput: $arch ($layers MoE layers)"
          PYTHONPATH="$PWD/python" MOEKIT_FFI_LIBRARY="$PWD/$B/libmoekit_ffi.so" \
            python3 bench/transformers_generate.py --arch $arch --layers $layers ${TF_BENCH_ARGS:-} --json "$OUT/transformers_$arch.json" \
            2>&1 | tee -a "$OUT/transformers_bench.log" | grep -vE "Warning|warn" || rc=1
        done
      fi ;;
    fp8)
      # FP8 activations (issue 49): the device quantizer and the FP8 grouped GEMM's tests
      # (FP8Fold / FP8Gemm / FP8Quant / FP8Chain: the chain quantize -> GEMM1 -> quantize -> GEMM2
      # -> finalize against the CPU layer with fp8 activations; Sm90Fp8Layer: the sm90 backends'
      # fp8 layer through the public API; FP8Trap: a consumer wait that cannot end fails the
      # launch with its record; FP8Stall: the timings' sizes with every wait bounded at 2 s, a
      # FP8STALL line per launch), compute-sanitizer memcheck, racecheck and synccheck on their
      # small cases (FP8Sanitize.*), then the kernels' timings at 4096 / 8192 tokens and the
      # quantizer's GB/s beside a device copy (FP8Bench.*), and the fp8 layer's bench.
      # First the probes (FP8Probe.*, test_fp8_gemm_gpu.cu): the scale box's tensor copy alone, at
      # aligned and (in child processes) misaligned first rows, per-element mismatches of small
      # GEMMs, run-to-run bit changes; their FP8PROBE lines say which failure is which.
      echo "=== fp8: probes"
      timeout 300 $B/moekit_gpu_tests --gtest_filter='FP8Probe.*' >"$OUT/fp8_probe.log" 2>&1 || rc=1
      grep -E "FP8PROBE|^\[  (PASSED|FAILED) " "$OUT/fp8_probe.log" | head -80
      echo "=== fp8: tests"
      $B/moekit_gpu_tests --gtest_filter='FP8Fold.*:FP8Gemm.*:FP8Quant.*:FP8Chain.*:Sm90Fp8Layer.*:FP8Trap.*:FP8Stall.*:FP8Sanitize.*' \
        >"$OUT/fp8_tests.log" 2>&1 || rc=1
      grep -E "^\[  (PASSED|FAILED) |Failure|rel-L2|FP8STALL" "$OUT/fp8_tests.log" | head -72
      tail -3 "$OUT/fp8_tests.log"
      sanitize fp8 $B/moekit_gpu_tests 'FP8Sanitize.*' memcheck racecheck synccheck
      echo "=== fp8: timings"
      MOEKIT_FP8_BENCH=1 $B/moekit_gpu_tests --gtest_filter='FP8Bench.*' >"$OUT/fp8_bench.log" 2>&1 || rc=1
      grep FP8BENCH "$OUT/fp8_bench.log"
      echo "=== fp8: the layer (sm90, fp8 ue8m0 activations) beside bf16 activations, the same invocation each"
      for act in "--activations fp8 --activation-scale ue8m0" ""; do
        $B/moekit bench --shape gpt-oss-120b --format mxfp4 --backend sm90 $act \
          --tokens ${FP8_TOKENS:-1,64,512,2048,4096,8192} --reps ${BENCH_REPS:-20} --budget-ms 40 \
          2>&1 | tee -a "$OUT/fp8_layer_bench.log" || rc=1
      done ;;
    dsv4)
      # DeepSeek-V4 (issue 47): its GPU tests (both routing kernels against the CPU, the router
      # goldens, token ids outside the table, the layer and the published-layout checkpoints on every
      # SM90 backend), the sanitizers on its small set, then the router alone of both kinds at 1-128
      # tokens (--split: the routing part of the layer, L2 flushed) and the presets' layer at decode
      # and prefill sizes with torch in the same invocation.
      echo "=== dsv4: tests"
      $B/moekit_gpu_tests --gtest_filter='Dsv4*:Sm90.RoutingMatchesCpu:Sm90.RenormalizationOfAllZeroScoresGivesZeroWeights' \
        >"$OUT/dsv4_tests.log" 2>&1 || rc=1
      grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/dsv4_tests.log" | head -40
      tail -3 "$OUT/dsv4_tests.log"
      sanitize dsv4 $B/moekit_gpu_tests 'Dsv4Sanitize.*' memcheck racecheck
      echo "=== dsv4: the router alone (split: routing), learned and hash"
      echo "clocks before: $(clocks)" | tee -a "$OUT/dsv4_router.log"
      for shape in deepseek-v4-flash deepseek-v4-pro deepseek-v4.1-flash; do
        for h in "" --hash; do
          $B/moekit bench --shape $shape --format mxfp4 --backend sm90 $h --tokens 1,2,4,8,16,32,64,128 \
            --split 1,2,4,8,16,32,64,128 --reps ${BENCH_REPS:-50} \
            --json "$OUT/dsv4_router_${shape}${h:+_hash}.json" 2>&1 | grep -E "^split|bench:|rror" | tee -a "$OUT/dsv4_router.log" || rc=1
        done
      done
      echo "=== dsv4: the presets' layer (decode and prefill sizes, torch in the same invocation)"
      for shape in deepseek-v4-flash deepseek-v4-pro deepseek-v4.1-flash; do
        $B/moekit bench --shape $shape --format mxfp4 --backend sm90 \
          --tokens ${DSV4_TOKENS:-1,8,16,32,64,512,2048,4096,8192} --reps ${BENCH_REPS:-20} --budget-ms 40 --peer torch \
          --json "$OUT/dsv4_bench_${shape}.json" 2>&1 | tee -a "$OUT/dsv4_bench.log" || rc=1
      done
      echo "clocks after: $(clocks)" | tee -a "$OUT/dsv4_bench.log" ;;
    python_bench)
      # Host time per forward call from Python (host_us: direct, op_host_us: torch op, bind_us:
      # no token, so no launch) and from C++ in parts (launches, tensor map, the layer through the
      # public API: moekit_host_overhead); the layer under a CUDA graph from Python vs moekit
      # bench's layer_us on a routing with as many active experts (graph_us / bench_us).
      echo "=== python: host overhead per call and the layer under a CUDA graph vs moekit bench"
      py_env || rc=1
      $B/moekit_host_overhead gpt-oss-120b 0,1,8,64,512 2>&1 | tee "$OUT/host_overhead.log" || rc=1
      for shape in ${BENCH_SHAPES:-gpt-oss-120b deepseek-v3}; do
        PYTHONPATH="$PWD/python" MOEKIT_FFI_LIBRARY="$PWD/$B/libmoekit_ffi.so" \
          python3 bench/python_layer.py --shape $shape --format ${BENCH_FORMAT:-mxfp4} --tokens ${BENCH_TOKENS:-1,8,64,512} \
          --moekit $B/moekit --json "$OUT/python_${shape}.json" 2>&1 | tee -a "$OUT/python_bench.log" || rc=1
      done ;;
    *) echo "gpu_check.sh: unknown step $s (the usage line lists them)" >&2; rc=1 ;;
  esac
done
exit $rc
