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

// x: K finite values, K % 32 == 0. codes: K bytes. scales: K/32 bytes.
void quantize_row_mxfp8(const float* x, int64_t K, ScaleRule rule, uint8_t* codes,
                        uint8_t* scales);
void dequantize_row_mxfp8(const uint8_t* codes, const uint8_t* scales, int64_t K, float* out);

}  // namespace moekit
