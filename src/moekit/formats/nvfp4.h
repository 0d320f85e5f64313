// moekit/formats/nvfp4.h — NVFP4: 16 E2M1 codes + one E4M3 scale per block, and one fp32 scale
// per tensor. 4.5 bits/weight (+ 32 bits per tensor).
//
// Quantization, all in fp32 with IEEE rounding, in this order:
//   g = 448*6 / amax(tensor)                 (g = 1 when amax == 0)
//   s = E4M3_RNE(clamp(amax(block) / 6 * g, 0, 448))
//   q = E2M1_RNE(clamp((x * g) / float(s), ±6))      (+0 codes where s == 0)
// Dequantization: value = q * float(s) * (1/g); the checkpoint stores scale_2 = 1/g.
// (vLLM's kernel uses approximate reciprocals; this is the exact form we define.)
//   storage (ModelOpt): codes [..., K/2] U8 (even element in the low nibble), scales
//   [..., K/16] F8_E4M3, scale_2 F32.
#pragma once

#include <cstdint>

#include "moekit/formats/codes.h"

namespace moekit {

inline constexpr int kNvfp4Block = 16;

struct block_nvfp4 {
  uint8_t s;      // E4M3 block scale
  uint8_t qs[8];  // 16 E2M1 codes, two per byte
};
static_assert(sizeof(block_nvfp4) == 9, "NVFP4 block: 1 scale byte + 8 code bytes");

// g from the tensor's largest magnitude.
float nvfp4_global_scale(float tensor_amax);

// One block of 16 finite values: 8 code bytes and the E4M3 block scale, for the tensor's g (host
// and device).
MOEKIT_HD uint8_t quantize_block_nvfp4(const float* x, float g, uint8_t* codes) {
  float amax = 0.0f;
  for (int i = 0; i < kNvfp4Block; ++i) amax = ::fmaxf(amax, ::fabsf(x[i]));
  float s_val = amax / kE2M1Max;
  s_val = s_val * g;
  s_val = ::fminf(::fmaxf(s_val, 0.0f), kE4M3Max);
  const uint8_t s = float_to_e4m3(s_val);
  const float sf = e4m3_to_float(s);
  for (int i = 0; i < kNvfp4Block; i += 2) {
    uint8_t q[2] = {0, 0};
    if (sf != 0.0f) {
      for (int j = 0; j < 2; ++j) {
        float v = x[i + j] * g;
        v = v / sf;
        q[j] = float_to_e2m1(::fminf(::fmaxf(v, -kE2M1Max), kE2M1Max));
      }
    }
    codes[i / 2] = uint8_t(q[0] | (q[1] << 4));
  }
  return s;
}

// x: K finite values, K % 16 == 0. codes: K/2 bytes. scales: K/16 bytes.
void quantize_row_nvfp4(const float* x, int64_t K, float g, uint8_t* codes, uint8_t* scales);
// scale_2 = 1/g as stored in the checkpoint.
void dequantize_row_nvfp4(const uint8_t* codes, const uint8_t* scales, float scale_2, int64_t K,
                          float* out);

}  // namespace moekit
