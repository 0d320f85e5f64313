#!/usr/bin/env bash
# The CUDA compiler launcher (CMakeLists.txt): runs one compile, the rest of the command line
# ([ccache] nvcc ...), and fails it when ptxas reports serialized wgmma instructions (C7510-C7515
# or any report that says so: too few registers for the wgmma pipeline, a call or a branch across
# it, other instructions writing a wgmma's accumulators inside its pipeline stage). Such a kernel
# still builds and runs correctly, only much slower, and one tile variant too many is enough to
# make ptxas serialize every wgmma of the prefill kernel (docs/perf/notebook.md, twentieth section;
# C7515: thirtieth section).
# MOEKIT_ALLOW_WGMMA_SERIALIZATION=1 lets the compile succeed (experiments).
log=$(mktemp "${TMPDIR:-/tmp}/moekit-nvcc.XXXXXX") || exit 1
"$@" 2>"$log"
rc=$?
cat "$log" >&2
if [ "$rc" -eq 0 ] && grep -qE '\(C751[0-5]\)|wgmma[.a-z_]* instructions are serialized' "$log" && [ "${MOEKIT_ALLOW_WGMMA_SERIALIZATION:-0}" != 1 ]; then
  echo "error: ptxas serialized wgmma instructions (above); the kernel would run far below its speed." >&2
  echo "       Set MOEKIT_ALLOW_WGMMA_SERIALIZATION=1 to build it anyway." >&2
  # Remove the object so that the next build compiles it again.
  prev=""
  for a in "$@"; do
    [ "$prev" = "-o" ] && rm -f -- "$a"
    prev="$a"
  done
  rc=1
fi
rm -f "$log"
exit "$rc"
