// moekit/common/fastdiv.h — division by a divisor fixed on the host, in a multiply-high, an add
// and a shift (Granlund-Montgomery, rounded-up multiplier). For kernels whose setup sits on a
// latency-critical path: an integer division by a runtime value is ~20 dependent instructions.
#pragma once

#include <cstdint>

#include "moekit/common/hd.h"

namespace moekit {

struct FastDiv {
  uint32_t d = 1, mul = 1, shift = 0;

  // d >= 1.
  static FastDiv make(uint32_t d) {
    FastDiv f;
    f.d = d;
    f.shift = 0;
    while ((uint64_t(1) << f.shift) < d) ++f.shift;  // ceil(log2 d)
    f.mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << f.shift) - d)) / d + 1);
    return f;
  }
  // n < 2^31.
  MOEKIT_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t t = __umulhi(n, mul);
#else
    const uint32_t t = uint32_t((uint64_t(n) * mul) >> 32);
#endif
    return (t + n) >> shift;
  }
  MOEKIT_HD int div(int n) const { return int(div(uint32_t(n))); }
};

}  // namespace moekit
