// moekit/experts/sm90_shape.h — which CTA shape the SM90 decode GEMM launches with (host rule,
// no CUDA types, so the CPU tests check it).
//
// kNarrow: 3 CTAs per SM with 5-stage rings (12 consumer warps per SM), the default.
// kWide:   4 CTAs per SM with 4-stage rings (16 consumer warps per SM, registers capped at 102).
// The wide shape pays where the 4-bit dequantization of 12 warps, not HBM, sets the pace: HBM
// that delivers at least kWideMinBytesPerSmCycle per SM clock (an H200: 18.8; an H100 SXM: 12.8),
// MXFP4 weights, and a GEMM1 of at least kWideMinWaves waves of segments. Measured on both GPUs
// (docs/PERFORMANCE.md): on an H200 the wide shape is 2-6% faster from 8 (GPT-OSS-120B) or
// 4 (DeepSeek-V3) or 16 (Qwen3-30B-A3B) tokens on and 6-30% slower below; on an H100 it is slower
// almost everywhere; with NVFP4 weights it is slower on both.
#pragma once

#include <algorithm>
#include <cstdint>

#include "moekit/formats/quantize.h"

namespace moekit::sm90 {

enum class GemmShape { kNarrow, kWide };

inline constexpr double kWideMinBytesPerSmCycle = 16.0;
inline constexpr double kWideMinWaves = 3.0;

struct ShapeQuery {
  WeightFormat format = WeightFormat::kMxfp4;
  bool single_multiply = true;     // every scale in the one-multiply range (the convert step knows)
  int64_t rows = 0;                // routed rows of the launch: tokens x k
  int64_t experts = 0;             // E
  int64_t gemm1_groups = 0;        // 64-row groups of one expert's GEMM1 (2 I_pad / 64)
  int64_t wide_grid = 0;           // CTAs of the wide shape (SMs x 4)
  double hbm_bytes_per_sm_cycle = 0;  // peak HBM bytes / s over (SMs x SM clock)
};

// Segments are (8-row chunk, group) pairs; a launch of `rows` rows has at least one chunk per
// active expert and at most min(E, rows) active experts, the count the rule uses.
inline GemmShape choose_gemm_shape(const ShapeQuery& q) {
  if (q.format != WeightFormat::kMxfp4 || !q.single_multiply) return GemmShape::kNarrow;
  if (q.hbm_bytes_per_sm_cycle < kWideMinBytesPerSmCycle || q.wide_grid <= 0) return GemmShape::kNarrow;
  const double segs = double(std::min(q.experts, q.rows)) * double(q.gemm1_groups);
  return segs >= kWideMinWaves * double(q.wide_grid) ? GemmShape::kWide : GemmShape::kNarrow;
}

inline const char* shape_name(GemmShape s) { return s == GemmShape::kWide ? "4x4" : "3x5"; }

}  // namespace moekit::sm90
