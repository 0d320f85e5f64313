// moekit/formats/quantize.h — whole-tensor quantization over rows of K, with input checks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace moekit
