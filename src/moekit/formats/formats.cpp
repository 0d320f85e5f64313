// Host quantization and dequantization of the block formats (see the per-format headers).
// Compiled with -ffp-contract=off: every fp32 operation here rounds once, in source order.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "moekit/common/error.h"
#include "moekit/formats/codes.h"
#include "moekit/formats/mx.h"
#include "moekit/formats/fp8.h"
#include "moekit/formats/mxfp4.h"
#include "moekit/formats/mxfp8.h"
#include "moekit/formats/nvfp4.h"

namespace moekit {

const char* scale_rule_name(ScaleRule r) { return r == ScaleRule::kFloor ? "floor" : "rceil"; }

ScaleRule parse_scale_rule(const std::string& s) {
  if (s == "floor") return ScaleRule::kFloor;
  if (s == "rceil") return ScaleRule::kRceil;
  fail("unknown scale rule '", s, "' (expected floor or rceil)");
}

namespace {
float block_amax(const float* x, int64_t n) {
  float a = 0.0f;
  for (int64_t i = 0; i < n; ++i) a = std::fmax(a, std::fabs(x[i]));
  return a;
}
}  // namespace

void quantize_row_mxfp4(const float* x, int64_t K, ScaleRule rule, uint8_t* codes,
                        uint8_t* scales) {
  for (int64_t b = 0; b < K / kMxBlock; ++b) {
    const float* xb = x + b * kMxBlock;
    const int e = mx_shared_exponent(block_amax(xb, kMxBlock), rule, kE2M1Emax, kE2M1Max);
    scales[b] = uint8_t(e + 127);
    for (int i = 0; i < kMxBlock; i += 2) {
      const uint8_t lo = float_to_e2m1(mx_scale_down(xb[i], e, kE2M1Max));
      const uint8_t hi = float_to_e2m1(mx_scale_down(xb[i + 1], e, kE2M1Max));
      codes[b * 16 + i / 2] = uint8_t(lo | (hi << 4));
    }
  }
}

namespace {
// Decoding tables, built once: every E2M1 and E4M3 code as fp32.
struct Tables {
  float e2m1[16];
  float e4m3[256];
  Tables() {
    for (int c = 0; c < 16; ++c) e2m1[c] = e2m1_to_float(uint8_t(c));
    for (int c = 0; c < 256; ++c) e4m3[c] = e4m3_to_float(uint8_t(c));
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

// Two E2M1 codes per byte times one scale, for `bytes` bytes.
inline void dequant_fp4_bytes(const uint8_t* codes, int bytes, float scale, const float* lut,
                              float* out) {
  for (int i = 0; i < bytes; ++i) {
    out[2 * i] = lut[codes[i] & 0xf] * scale;
    out[2 * i + 1] = lut[codes[i] >> 4] * scale;
  }
}
}  // namespace

void dequantize_row_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t K, float* out) {
  const float* lut = tables().e2m1;
  for (int64_t b = 0; b < K / kMxBlock; ++b)
    dequant_fp4_bytes(codes + b * 16, 16, e8m0_to_float(scales[b]), lut, out + b * kMxBlock);
}

void quantize_row_mxfp8(const float* x, int64_t K, ScaleRule rule, uint8_t* codes,
                        uint8_t* scales) {
  for (int64_t b = 0; b < K / kMxBlock; ++b)
    scales[b] = quantize_block_mxfp8(x + b * kMxBlock, rule, codes + b * kMxBlock);
}

void dequantize_row_mxfp8(const uint8_t* codes, const uint8_t* scales, int64_t K, float* out) {
  const float* lut = tables().e4m3;
  for (int64_t b = 0; b < K / kMxBlock; ++b) {
    const float scale = e8m0_to_float(scales[b]);
    for (int i = 0; i < kMxBlock; ++i) out[b * kMxBlock + i] = lut[codes[b * kMxBlock + i]] * scale;
  }
}

void dequantize_row_fp8(const uint8_t* codes, const uint8_t* scales, int64_t K, float* out) {
  const float* lut = tables().e4m3;
  for (int64_t b = 0; b < K / kFp8Block; ++b) {
    float scale;
    std::memcpy(&scale, scales + 4 * b, 4);
    for (int i = 0; i < kFp8Block; ++i) out[b * kFp8Block + i] = lut[codes[b * kFp8Block + i]] * scale;
  }
}

float nvfp4_global_scale(float tensor_amax) {
  if (!(tensor_amax > 0.0f)) return 1.0f;
  return (kE4M3Max * kE2M1Max) / tensor_amax;
}

void quantize_row_nvfp4(const float* x, int64_t K, float g, uint8_t* codes, uint8_t* scales) {
  for (int64_t b = 0; b < K / kNvfp4Block; ++b)
    scales[b] = quantize_block_nvfp4(x + b * kNvfp4Block, g, codes + b * 8);
}

void dequantize_row_nvfp4(const uint8_t* codes, const uint8_t* scales, float scale_2, int64_t K,
                          float* out) {
  const Tables& t = tables();
  for (int64_t b = 0; b < K / kNvfp4Block; ++b) {
    float* o = out + b * kNvfp4Block;
    dequant_fp4_bytes(codes + b * 8, 8, t.e4m3[scales[b]], t.e2m1, o);  // q * s, exact
    for (int i = 0; i < kNvfp4Block; ++i) o[i] = o[i] * scale_2;
  }
}

}  // namespace moekit
