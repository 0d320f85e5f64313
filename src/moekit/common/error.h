// moekit/common/error.h — one exception type for every host-side failure.
//
// Host code throws moekit::Error with a one-line message that names the file, tensor and
// problem; the CLI prints it and exits non-zero. Kernels and launchers never throw: they
// return cudaError_t (see common/cuda_check.h).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moekit {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<< and throws moekit::Error.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  detail::append(os, args...);
  throw Error(os.str());
}

}  // namespace moekit

// Checks a condition that depends on user input; throws moekit::Error otherwise.
#define MOEKIT_REQUIRE(cond, ...)        \
  do {                                   \
    if (!(cond)) ::moekit::fail(__VA_ARGS__); \
  } while (0)
