// moekit/cli/bench_stamp.h — what a `moekit bench` run ran on (GPU, driver, CUDA, commit, date).
#pragma once

#include "moekit/bench/bench.h"
#include "moekit/oracle/backend.h"

namespace moekit::cli {

extern const char* const kBuildCommit;  // generated at build time (cmake/build_info.cmake)

// The NVIDIA driver version from /proc/driver/nvidia/version ("580.159.04"), or "none".
std::string nvidia_driver_version();
BenchStamp bench_stamp(const DeviceInfo& dev);

}  // namespace moekit::cli
