// moekit/common/carve.h — hands out 256-byte aligned pieces of one buffer (workspaces, a rank's
// local buffers); with base == nullptr it only counts the bytes.
#pragma once

#include <algorithm>
#include <cstdint>

namespace moekit {

struct Carve {
  uint8_t* base = nullptr;
  int64_t off = 0;
  template <typename T>
  T* take(int64_t n) {
    off = (off + 255) / 256 * 256;
    T* p = base ? reinterpret_cast<T*>(base + off) : nullptr;
    off += std::max<int64_t>(n, 1) * int64_t(sizeof(T));
    return p;
  }
};

}  // namespace moekit
