#!/usr/bin/env bash
# Builds the safetensors fuzz target with clang's libFuzzer + ASan/UBSan and runs it for a
# bounded time. Usage: scripts/fuzz.sh [seconds=30] [build-dir=build]
# Seeds: the golden safetensors files in ../shared/testdata (small ones).
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-30}"
out="${2:-build}/fuzz"
mkdir -p "$out/corpus"
bin="$out/fuzz_safetensors"
src=(tests/fuzz/fuzz_safetensors.cpp src/moekit/io/safetensors.cpp src/moekit/io/files.cpp
     src/moekit/common/checked.cpp)
if [ ! -x "$bin" ] || [ -n "$(find "${src[@]}" src/moekit/io/safetensors.h -newer "$bin" 2>/dev/null)" ]; then
  clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Isrc "${src[@]}" -o "$bin"
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
