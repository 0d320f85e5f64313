#!/usr/bin/env bash
# Gathers what a GPU run needs into .devbuild/ (git-ignored): the built binaries and the golden
# test data, so that a remote GPU machine with only the working tree can run them.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .devbuild && mkdir -p .devbuild
for b in build/moekit build/tests/moekit_gpu_tests build/tests/moekit_tests build/bench/moekit_consumer_rate \
         build/bench/moekit_copy_probe; do
  [ -x "$b" ] && cp "$b" .devbuild/
done
cp -r ../shared/testdata .devbuild/testdata
du -sh .devbuild
