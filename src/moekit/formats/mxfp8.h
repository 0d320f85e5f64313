// moekit/formats/mxfp8.h — MXFP8 (E4M3): 32 E4M3 codes + one E8M0 scale per block. 8.25 bits.
//
//   value[i] = e4m3(q[i]) * 2^(scale - 127)
//   storage: codes [..., K] (F8_E4M3 in safetensors), scales [..., K/32] (U8).
#pragma once

#include <cstdint>

#include "moekit/formats/mx.h"

namespace moekit {

struct block_mxfp8 {
  uint8_t e;       // E8M0 shared scale
  uint8_t qs[32];  // 32 E4M3 codes
};
static_assert(sizeof(block_mxfp8) == 33, "MXFP8 block: 1 scale byte + 32 code bytes");

// One block of 32 finite values: 32 codes and the E8M0 scale (host and device).
MOEKIT_HD uint8_t quantize_block_mxfp8(const float* x, ScaleRule rule, uint8_t* codes) {
  float amax = 0.0f;
  for (int i = 0; i < kMxBlock; ++i) amax = ::fmaxf(amax, ::fabsf(x[i]));
  const int e = mx_shared_exponent(amax, rule, kE4M3Emax, kE4M3Max);
  for (int i = 0; i < kMxBlock; ++i) codes[i] = float_to_e4m3(mx_scale_down(x[i], e, kE4M3Max));
  return uint8_t(e + 127);
}

// x: K finite values, K % 32 == 0. codes: K bytes. scales: K/32 bytes.
void quantize_row_mxfp8(const float* x, int64_t K, ScaleRule rule, uint8_t* codes,
                        uint8_t* scales);
void dequantize_row_mxfp8(const uint8_t* codes, const uint8_t* scales, int64_t K, float* out);

}  // namespace moekit
