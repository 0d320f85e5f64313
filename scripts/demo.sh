#!/usr/bin/env bash
# Installs what is missing, builds, and runs the demo (`moekit demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh build >/dev/null
exec ./build/moekit demo "$@"
