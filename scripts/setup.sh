#!/usr/bin/env bash
# Installs what the build needs and is missing (Debian packages), then configures and builds.
# Usage: scripts/setup.sh [build-dir]      (default: build)
# Environment: MOEKIT_CUDA=OFF builds without CUDA even where nvcc is present;
#   MOEKIT_PYTHON_EXE=path/to/python (with apache-tvm-ffi) also builds the Python binding.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for pkg in cmake ninja-build g++ nlohmann-json3-dev libcli11-dev libgtest-dev libdlpack-dev ccache clang libclang-rt-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "moekit setup: installing ${need[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

BUILD="${1:-build}"
cuda_flag=()
if [ -n "${MOEKIT_CUDA:-}" ]; then cuda_flag=(-DMOEKIT_CUDA="${MOEKIT_CUDA}"); fi
if [ -n "${MOEKIT_PYTHON_EXE:-}" ]; then
  cuda_flag+=(-DMOEKIT_PYTHON=ON -DPython_EXECUTABLE="${MOEKIT_PYTHON_EXE}")
fi
if [ ! -f "$BUILD/build.ninja" ] || [ -n "${MOEKIT_PYTHON_EXE:-}" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${cuda_flag[@]}" >/dev/null
fi
# Two cores: two jobs. nvcc is memory-hungry but 2 jobs fit in 24 GiB.
cmake --build "$BUILD" -j "${MOEKIT_JOBS:-2}"
