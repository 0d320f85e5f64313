// moekit/formats/bf16.h — BF16 weights and activations: 1 sign, 8 exponent, 7 mantissa bits.
// 16 bits/weight, no block scale. fp32 -> bf16 rounds to nearest even (common/bf16.h).
//   storage: BF16 in safetensors, little-endian uint16 bit patterns.
#pragma once

#include <cstdint>

#include "moekit/common/bf16.h"

namespace moekit {

inline void bf16_row_to_float(const uint16_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
}
inline void float_row_to_bf16(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

}  // namespace moekit
