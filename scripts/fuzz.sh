#!/usr/bin/env bash
# Builds the safetensors fuzz target with clang's libFuzzer + ASan/UBSan and runs it for a
# bounded time. Usage: scripts/fuzz.sh [seconds=30] [build-dir=build]
#   seconds = 0: build the target only (CTest runs this as its own test, with a long timeout, so
#   that a slow compile on a loaded 2-core machine never eats the fuzzing test's time).
# Seeds: the golden safetensors files in ../shared/testdata (small ones).
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-30}"
out="${2:-build}/fuzz"
mkdir -p "$out/corpus" "$out/obj"
bin="$out/fuzz_safetensors"
src=(tests/fuzz/fuzz_safetensors.cpp src/moekit/io/safetensors.cpp src/moekit/io/files.cpp
     src/moekit/common/checked.cpp)
# -gline-tables-only: stack traces with file:line at a fraction of -g's compile time (the
# nlohmann/json instantiations under ASan/UBSan dominate the build).
flags=(-std=c++20 -O1 -gline-tables-only -fsanitize=address,undefined
       -fno-sanitize-recover=undefined -Isrc)
stale() {
  [ ! -x "$bin" ] && return 0
  [ -n "$( { find "${src[@]}" -newer "$bin"; find src/moekit -name '*.h' -newer "$bin"; } 2>/dev/null | head -1)" ]
}
if stale; then
  pids=()
  objs=()
  for s in "${src[@]}"; do
    o="$out/obj/$(basename "$s" .cpp).o"
    objs+=("$o")
    clang++ "${flags[@]}" -fsanitize=fuzzer-no-link -c "$s" -o "$o" & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  clang++ "${flags[@]}" -fsanitize=fuzzer "${objs[@]}" -o "$bin.tmp"
  mv -f "$bin.tmp" "$bin"
fi
if [ "$secs" = 0 ]; then
  echo "fuzz_safetensors: target built ($bin)"
  exit 0
fi
if [ -d ../shared/testdata ]; then
  find ../shared/testdata -name '*.safetensors' -size -64k -exec cp -n {} "$out/corpus/" \;
fi
set +e
"$bin" -max_total_time="$secs" -max_len=4096 -timeout=10 -print_final_stats=1 \
  -artifact_prefix="$out/" "$out/corpus" >"$out/log" 2>&1
rc=$?
set -e
grep -E "^(Done|stat::number_of_executed_units)" "$out/log" || true
if [ $rc -ne 0 ]; then
  tail -40 "$out/log"
  echo "fuzz_safetensors: FAILED (exit $rc; crash input saved under $out/)"
  exit 1
fi
echo "fuzz_safetensors: no crash in ${secs}s"
