#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test. On a machine without a GPU the tests
# labelled `gpu` report themselves as skipped.  Usage: scripts/test.sh [ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh build
cd build
ctest --output-on-failure -j "${MOEKIT_JOBS:-2}" "$@"
