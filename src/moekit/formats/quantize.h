// moekit/formats/quantize.h — whole-tensor quantization over rows of K, with input checks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/formats/fp8.h"
#include "moekit/formats/mx.h"
#include "moekit/spec.hpp"  // WeightFormat

namespace moekit {

const char* format_name(WeightFormat f);
WeightFormat parse_format(const std::string& s);  // throws moekit::Error on unknown names
// Elements per scale block along K (1 for bf16).
int format_block(WeightFormat f);
// Bytes of codes per row of K elements and of scales per row.
int64_t format_code_bytes(WeightFormat f, int64_t K);
int64_t format_scale_bytes(WeightFormat f, int64_t K);

struct QuantizedTensor {
  std::vector<uint8_t> codes;   // rows * format_code_bytes
  std::vector<uint8_t> scales;  // rows * format_scale_bytes
  float scale_2 = 1.0f;         // nvfp4 only: 1/g
};

// x: [rows, K] fp32. Throws (naming `what`) when K is not a multiple of the block or x holds
// NaN or Inf. bf16 is not a block format and is rejected here.
QuantizedTensor quantize_tensor(const float* x, int64_t rows, int64_t K, WeightFormat f,
                                ScaleRule rule, const std::string& what);
// out: [rows, K] fp32.
void dequantize_tensor(WeightFormat f, const uint8_t* codes, const uint8_t* scales,
                       float scale_2, int64_t rows, int64_t K, float* out);

// Value checks of checkpoint tensors (raw little-endian bytes): the first element that decodes to
// NaN or Inf is an error "WHAT: tensor NAME: NaN at element i". E4M3 is NaN only as 0x7F/0xFF,
// E8M0 as 0xFF; BF16 and F32 are NaN or Inf with every exponent bit set.
enum class ElementCode { kE4M3, kE8M0, kBF16, kF32 };
void require_finite_elements(ElementCode code, const uint8_t* data, size_t nbytes, const std::string& what,
                             const std::string& name);
// Tensor scales (NVFP4 scale_2 = 1/g): finite and positive.
void require_positive_scales(const float* v, size_t n, const std::string& what, const std::string& name);

}  // namespace moekit
