// moekit/formats/fp8_act.h — FP8 activations (LayerSpec::activation_dtype = fp8): the experts' GEMM
// inputs as E4M3 codes with one scale per token row per 128 elements along K (DeepSeek-V3's
// training and DeepSeek-V4's inference format). The rule (docs/FORMATS.md, "FP8 activations"):
//
//   group  g = elements [128 g, min(128 (g + 1), K)) of one row; the last group of a row whose K
//          is not a multiple of 128 holds the K % 128 remaining elements (the same scale as the
//          group padded with zeros would get)
//   amax   = max(max |x| over the group, 1e-4f)    the floor is DeepSeek's (act_quant): an
//          all-zero group gets a defined, finite scale and zero codes
//   s      = fp32(amax / 448)                       fp32 scales (IEEE division, round to nearest)
//          = the smallest power of two >= fp32(amax / 448)
//                                                   ue8m0 scales (DeepSeek-V4; == the smallest
//                                                   power of two p with amax <= 448 p, exactly)
//   q      = E4M3_RNE(clamp(fp32(x / s), -448, 448)) round to nearest, ties to even, sign kept
//                                                   (-0 stays 0x80); the clamp only catches the
//                                                   one-ulp overshoot of amax / s, so saturating
//                                                   and non-saturating casts agree
//   value  = fp32(e4m3(q) * s)                      what the GEMM multiplies (exact for ue8m0;
//                                                   a group whose amax is within 2^-8 of FLT_MAX
//                                                   can round up to Inf, as its GEMM would overflow)
//   NaN or Inf anywhere in a group: every code of the group is NaN (0x7F) and its scale NaN, so
//   the group dequantizes to NaN (propagated, as bf16 activations propagate it).
// Host and device code: the CPU backend rounds with it, GPU kernels quantize with the same code.
#pragma once

#include <math.h>

#include <cstdint>

#include "moekit/common/hd.h"
#include "moekit/formats/codes.h"
#include "moekit/spec.hpp"

namespace moekit {

inline constexpr int kFp8ActGroup = 128;
inline constexpr float kFp8ActAmaxFloor = 1e-4f;

// Groups (scales) per row of K elements.
MOEKIT_HD constexpr int64_t fp8_act_groups(int64_t K) { return (K + kFp8ActGroup - 1) / kFp8ActGroup; }

// The scale of a group whose largest magnitude is amax (finite, >= 0).
MOEKIT_HD float fp8_act_scale(float amax, ActivationScale rule) {
  const float a = amax > kFp8ActAmaxFloor ? amax : kFp8ActAmaxFloor;
  const float s = a / kE4M3Max;  // >= 2.2e-7: a normal fp32, so frexpf below is exact
  if (rule != ActivationScale::kUe8m0) return s;
  int e;
  const float f = ::frexpf(s, &e);  // s = f * 2^e, f in [0.5, 1)
  return f == 0.5f ? s : ::ldexpf(1.0f, e);
}

// One group of n (1..128) values: codes [n]; returns the scale (NaN for a non-finite group).
MOEKIT_HD float quantize_group_fp8_act(const float* x, int n, ActivationScale rule, uint8_t* codes) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    const float a = ::fabsf(x[i]);
    finite = finite && a <= 3.402823466e38f;  // false for NaN and Inf
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    for (int i = 0; i < n; ++i) codes[i] = 0x7f;
    return bits_to_float(0x7fc00000u);
  }
  const float s = fp8_act_scale(amax, rule);
  for (int i = 0; i < n; ++i) {
    float v = x[i] / s;
    v = v > kE4M3Max ? kE4M3Max : (v < -kE4M3Max ? -kE4M3Max : v);
    codes[i] = float_to_e4m3(v);
  }
  return s;
}

// One row: codes [K], scales [fp8_act_groups(K)].
MOEKIT_HD void quantize_row_fp8_act(const float* x, int64_t K, ActivationScale rule, uint8_t* codes, float* scales) {
  for (int64_t g = 0; g * kFp8ActGroup < K; ++g) {
    const int64_t b = g * kFp8ActGroup;
    const int n = int(K - b < kFp8ActGroup ? K - b : kFp8ActGroup);
    scales[g] = quantize_group_fp8_act(x + b, n, rule, codes + b);
  }
}

MOEKIT_HD void dequantize_row_fp8_act(const uint8_t* codes, const float* scales, int64_t K, float* out) {
  for (int64_t i = 0; i < K; ++i) out[i] = e4m3_to_float(codes[i]) * scales[i / kFp8ActGroup];
}

// Quantizes one row and replaces it with the values the GEMM multiplies (the CPU backend's and
// the reference's fp8 rounding of their inputs).
MOEKIT_HD void round_row_fp8_act(float* x, int64_t K, ActivationScale rule) {
  uint8_t q[kFp8ActGroup];
  for (int64_t b = 0; b < K; b += kFp8ActGroup) {
    const int n = int(K - b < kFp8ActGroup ? K - b : kFp8ActGroup);
    const float s = quantize_group_fp8_act(x + b, n, rule, q);
    for (int i = 0; i < n; ++i) x[b + i] = e4m3_to_float(q[i]) * s;
  }
}

}  // namespace moekit
