// moekit/io/quantize_file.h — the `quantize` and `dequantize` commands on safetensors files.
//
// quantize: every F32/BF16 tensor NAME of IN is quantized along its last axis (K):
//   mxfp4  NAME_blocks U8 [..., K/32, 16] + NAME_scales U8 [..., K/32]
//   mxfp8  NAME F8_E4M3 [..., K]          + NAME_scale U8 [..., K/32]
//   nvfp4  NAME U8 [..., K/2] + NAME_scale F8_E4M3 [..., K/16] + NAME_scale_2 F32 []
// Tensors of other dtypes are copied unchanged. The header metadata records `format` and, for
// the MX formats, `scale_rule`.
// dequantize: the reverse, recognising the three layouts by names and dtypes, to F32 NAME
// tensors; anything else is copied unchanged.
// Both check all input before writing, and write OUT atomically.
#pragma once

#include <string>

#include "moekit/formats/quantize.h"

namespace moekit {

void quantize_file(const std::string& in, const std::string& out, WeightFormat f,
                   ScaleRule rule);
void dequantize_file(const std::string& in, const std::string& out);

}  // namespace moekit
