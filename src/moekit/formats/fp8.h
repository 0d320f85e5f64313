// moekit/formats/fp8.h — FP8 with fp32 block scales (DeepSeek-V3, Qwen3-FP8): E4M3 codes and one
// fp32 scale per 128 elements along K. 8.25 bits.
//
//   value[i] = fp32(e4m3(q[i]) * scale[i / 128])       (one fp32 rounding: the product of a
//                                                       4-bit and a 24-bit significand)
//   storage (a moekit layer directory): codes [..., K] F8_E4M3, scales [..., K/128] F32, one row of
//   scales per row of codes. Checkpoints publish [N/128, K/128] scales per weight
//   (`weight_scale_inv`, the multiplier despite its name): 128 consecutive rows share a row of
//   scales (experts/weights.h WeightMatrix::scale_row_group).
// The definition is the checkpoints' own dequantization (x.float() * s in fp32), so it is exact.
#pragma once

#include <cstdint>

namespace moekit {

inline constexpr int kFp8Block = 128;

// codes: K bytes; scales: K/128 fp32 (little-endian bytes, any alignment); out: K floats.
void dequantize_row_fp8(const uint8_t* codes, const uint8_t* scales, int64_t K, float* out);

}  // namespace moekit
