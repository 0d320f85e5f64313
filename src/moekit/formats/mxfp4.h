// moekit/formats/mxfp4.h — MXFP4: 32 E2M1 codes + one E8M0 scale per block. 4.25 bits/weight.
//
//   value[i] = e2m1(q[i]) * 2^(scale - 127)
//   storage (GPT-OSS checkpoints, the `quantize` command): codes [..., K/32, 16] bytes with
//   element 2i in the low nibble and 2i+1 in the high nibble of byte i, scales [..., K/32].
#pragma once

#include <cstdint>

#include "moekit/formats/mx.h"

namespace moekit {

struct block_mxfp4 {
  uint8_t e;       // E8M0 shared scale
  uint8_t qs[16];  // 32 E2M1 codes, two per byte, even element in the low nibble
};
static_assert(sizeof(block_mxfp4) == 17, "MXFP4 block: 1 scale byte + 16 code bytes");

// x: K finite values, K % 32 == 0. codes: K/2 bytes. scales: K/32 bytes.
void quantize_row_mxfp4(const float* x, int64_t K, ScaleRule rule, uint8_t* codes,
                        uint8_t* scales);
void dequantize_row_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t K, float* out);

}  // namespace moekit
