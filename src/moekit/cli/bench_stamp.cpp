#include "moekit/cli/bench_stamp.h"

#include <ctime>
#include <fstream>
#include <sstream>

namespace moekit::cli {

std::string nvidia_driver_version() {
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu ..." (Open Kernel Module too)
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  if (!std::getline(in, line)) return "none";
  const size_t at = line.find("Kernel Module");
  if (at == std::string::npos) return "unknown";
  std::istringstream words(line.substr(at + 13));
  std::string w;
  while (words >> w)
    if (!w.empty() && w[0] >= '0' && w[0] <= '9') return w;
  return "unknown";
}

BenchStamp bench_stamp(const DeviceInfo& dev) {
  BenchStamp s;
  s.gpu = dev.name;
  s.driver = dev.gpu ? nvidia_driver_version() : "none";
#ifdef MOEKIT_WITH_CUDA
  s.cuda = bench_cuda_versions();
#else
  s.cuda = "none (built without CUDA)";
#endif
  s.commit = kBuildCommit;
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  s.date = buf;
  return s;
}

}  // namespace moekit::cli
