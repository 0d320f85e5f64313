// moekit/common/bf16.h — bfloat16 on the host: bits <-> float, round to nearest even.
//
// bf16 is the upper half of an IEEE fp32: 1 sign, 8 exponent, 7 mantissa bits. Converting
// fp32 -> bf16 rounds to nearest, ties to even (as __float2bfloat16_rn does on the GPU);
// NaN stays NaN (quiet), infinities stay infinite.
#pragma once

#include <cstdint>
#include <cstring>

#include "moekit/common/hd.h"

namespace moekit {

MOEKIT_HD float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
MOEKIT_HD uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

MOEKIT_HD float bf16_to_float(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

MOEKIT_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // RNE: add half an ulp, minus one when the kept lsb is even
  return uint16_t(u >> 16);
}

// Rounds an fp32 value to the nearest bf16 value and returns it as fp32.
MOEKIT_HD float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

}  // namespace moekit
