#!/usr/bin/env bash
# scripts/nvcc_guard.sh: a compile whose ptxas output reports serialized wgmmas fails and loses
# its object; a clean one passes with its output unchanged; the override lets it through.
set -u
guard="$1"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
serialized='ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized'
# A clean compile: exit 0, stderr passed through, object kept.
out=$("$guard" bash -c 'echo "ptxas info : Used 168 registers" >&2; touch "$2"' _ -o "$dir/a.o" 2>&1) || fail "clean compile failed"
[ -f "$dir/a.o" ] || fail "clean compile lost its object"
[[ "$out" == *"Used 168 registers"* ]] || fail "stderr not passed through"
# A failing compiler keeps its exit code.
"$guard" bash -c 'exit 3' 2>/dev/null
[ $? -eq 3 ] || fail "the compiler's exit code was not kept"
# Serialized wgmmas: exit 1, the message, no object.
out=$("$guard" bash -c 'echo "$1" >&2; touch "$3"' _ "$serialized" -o "$dir/b.o" 2>&1) && fail "serialized compile passed"
[ -f "$dir/b.o" ] && fail "serialized compile kept its object"
[[ "$out" == *"(C7512)"* ]] || fail "ptxas's message not passed through: $out"
[[ "$out" == *"ptxas serialized wgmma"* ]] || fail "no error line: $out"
# C7515 (accumulators written by other instructions inside a wgmma pipeline stage) too.
c7515='ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator registers'
"$guard" bash -c 'echo "$1" >&2; touch "$3"' _ "$c7515" -o "$dir/d.o" 2>/dev/null && fail "C7515 compile passed"
[ -f "$dir/d.o" ] && fail "C7515 compile kept its object"
# The override.
MOEKIT_ALLOW_WGMMA_SERIALIZATION=1 "$guard" bash -c 'echo "$1" >&2; touch "$3"' _ "$serialized" -o "$dir/c.o" 2>/dev/null ||
  fail "override did not pass"
[ -f "$dir/c.o" ] || fail "override lost the object"
echo "nvcc_guard: ok"
