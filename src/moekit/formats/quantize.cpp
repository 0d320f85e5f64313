#include "moekit/formats/quantize.h"

#include <cmath>
#include <cstring>

#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/formats/mxfp4.h"
#include "moekit/formats/mxfp8.h"
#include "moekit/formats/nvfp4.h"

namespace moekit {

const char* format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kMxfp4: return "mxfp4";
    case WeightFormat::kMxfp8: return "mxfp8";
    case WeightFormat::kNvfp4: return "nvfp4";
    case WeightFormat::kBf16: return "bf16";
    case WeightFormat::kFp8: return "fp8";
  }
  return "?";
}

WeightFormat parse_format(const std::string& s) {
  if (s == "mxfp8_e4m3") return WeightFormat::kMxfp8;  // the long name some tools record
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kMxfp8, WeightFormat::kNvfp4,
                         WeightFormat::kBf16, WeightFormat::kFp8})
    if (s == format_name(f)) return f;
  fail("unknown format '", s, "' (expected mxfp4, mxfp8, nvfp4, bf16 or fp8)");
}

int format_block(WeightFormat f) {
  switch (f) {
    case WeightFormat::kMxfp4:
    case WeightFormat::kMxfp8: return kMxBlock;
    case WeightFormat::kNvfp4: return kNvfp4Block;
    case WeightFormat::kBf16: return 1;
    case WeightFormat::kFp8: return kFp8Block;
  }
  return 1;
}

int64_t format_code_bytes(WeightFormat f, int64_t K) {
  switch (f) {
    case WeightFormat::kMxfp4:
    case WeightFormat::kNvfp4: return K / 2;
    case WeightFormat::kMxfp8:
    case WeightFormat::kFp8: return K;
    case WeightFormat::kBf16: return 2 * K;
  }
  return 0;
}

int64_t format_scale_bytes(WeightFormat f, int64_t K) {
  if (f == WeightFormat::kFp8) return K / kFp8Block * 4;  // fp32 scales
  return f == WeightFormat::kBf16 ? 0 : K / format_block(f);
}

QuantizedTensor quantize_tensor(const float* x, int64_t rows, int64_t K, WeightFormat f,
                                ScaleRule rule, const std::string& what) {
  MOEKIT_REQUIRE(f != WeightFormat::kBf16, what, ": bf16 is not a block format");
  MOEKIT_REQUIRE(f != WeightFormat::kFp8, what, ": fp8 weights come with their checkpoint's scales (no quantizer here)");
  const int block = format_block(f);
  MOEKIT_REQUIRE(K > 0 && K % block == 0, what, ": last dimension ", K,
                 " is not a multiple of the ", format_name(f), " block (", block, ")");
  float amax = 0.0f;
  for (int64_t i = 0; i < rows * K; ++i) {
    MOEKIT_REQUIRE(std::isfinite(x[i]), what, ": cannot quantize ",
                   std::isnan(x[i]) ? "NaN" : "Inf", " at row ", i / K, ", column ", i % K);
    amax = std::fmax(amax, std::fabs(x[i]));
  }
  QuantizedTensor q;
  const int64_t cb = format_code_bytes(f, K), sb = format_scale_bytes(f, K);
  q.codes.resize(size_t(rows * cb));
  q.scales.resize(size_t(rows * sb));
  float g = 1.0f;
  if (f == WeightFormat::kNvfp4) {
    g = nvfp4_global_scale(amax);
    q.scale_2 = 1.0f / g;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * K;
    uint8_t* c = q.codes.data() + r * cb;
    uint8_t* s = q.scales.data() + r * sb;
    switch (f) {
      case WeightFormat::kMxfp4: quantize_row_mxfp4(xr, K, rule, c, s); break;
      case WeightFormat::kMxfp8: quantize_row_mxfp8(xr, K, rule, c, s); break;
      case WeightFormat::kNvfp4: quantize_row_nvfp4(xr, K, g, c, s); break;
      case WeightFormat::kBf16:
      case WeightFormat::kFp8: break;
    }
  }
  return q;
}

void dequantize_tensor(WeightFormat f, const uint8_t* codes, const uint8_t* scales,
                       float scale_2, int64_t rows, int64_t K, float* out) {
  const int64_t cb = format_code_bytes(f, K), sb = format_scale_bytes(f, K);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* c = codes + r * cb;
    const uint8_t* s = scales + r * sb;
    float* o = out + r * K;
    switch (f) {
      case WeightFormat::kMxfp4: dequantize_row_mxfp4(c, s, K, o); break;
      case WeightFormat::kMxfp8: dequantize_row_mxfp8(c, s, K, o); break;
      case WeightFormat::kNvfp4: dequantize_row_nvfp4(c, s, scale_2, K, o); break;
      case WeightFormat::kBf16:
        for (int64_t i = 0; i < K; ++i) o[i] = bf16_to_float(uint16_t(c[2 * i] | (c[2 * i + 1] << 8)));
        break;
      case WeightFormat::kFp8: dequantize_row_fp8(c, s, K, o); break;
    }
  }
}

void require_finite_elements(ElementCode code, const uint8_t* d, size_t nbytes, const std::string& what,
                             const std::string& name) {
  switch (code) {
    case ElementCode::kE4M3:
      for (size_t i = 0; i < nbytes; ++i)
        MOEKIT_REQUIRE((d[i] & 0x7f) != 0x7f, what, ": tensor ", name, ": E4M3 NaN code at element ", i);
      break;
    case ElementCode::kE8M0:
      for (size_t i = 0; i < nbytes; ++i)
        MOEKIT_REQUIRE(d[i] != 0xff, what, ": tensor ", name, ": E8M0 NaN scale at element ", i);
      break;
    case ElementCode::kBF16:
      for (size_t i = 0; i < nbytes / 2; ++i) {
        const unsigned hi = d[2 * i + 1], lo = d[2 * i];  // little-endian: exponent in the high byte
        MOEKIT_REQUIRE((hi & 0x7f) != 0x7f || !(lo & 0x80), what, ": tensor ", name, ": ",
                       (lo & 0x7f) ? "NaN" : "Inf", " at element ", i);
      }
      break;
    case ElementCode::kF32:
      for (size_t i = 0; i < nbytes / 4; ++i) {
        float v;
        std::memcpy(&v, d + 4 * i, 4);
        MOEKIT_REQUIRE(std::isfinite(v), what, ": tensor ", name, ": ", std::isnan(v) ? "NaN" : "Inf",
                       " at element ", i);
      }
      break;
  }
}

void require_positive_scales(const float* v, size_t n, const std::string& what, const std::string& name) {
  for (size_t i = 0; i < n; ++i)
    MOEKIT_REQUIRE(std::isfinite(v[i]) && v[i] > 0.0f, what, ": tensor ", name, ": value ", v[i], " at element ",
                   i, " is not a finite positive tensor scale");
}

}  // namespace moekit
