// moekit/cli/progress.h — a progress bar on stderr for long conversions: drawn only when stderr
// is a terminal, at most ten times a second, and cleared when done (logs and pipes get none).
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace moekit::cli {

class ProgressBar {
 public:
  explicit ProgressBar(std::string label) : label_(std::move(label)), on_(isatty(2) == 1) {}
  ~ProgressBar() {
    if (drawn_) std::fprintf(stderr, "\r\033[K");
  }
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  void operator()(int64_t done, int64_t total) {
    if (!on_ || total <= 0) return;
    const auto now = std::chrono::steady_clock::now();
    if (drawn_ && done < total && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    drawn_ = true;
    constexpr int kWidth = 30;
    const int fill = int(kWidth * done / total);
    const double s = std::chrono::duration<double>(now - start_).count();
    std::fprintf(stderr, "\r\033[K%s [%s%s] %3d%% %lld/%lld experts, %.1f s", label_.c_str(),
                 std::string(size_t(fill), '#').c_str(), std::string(size_t(kWidth - fill), '.').c_str(),
                 int(100 * done / total), (long long)done, (long long)total, s);
    std::fflush(stderr);
  }

 private:
  std::string label_;
  bool on_ = false, drawn_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_{};
};

}  // namespace moekit::cli
