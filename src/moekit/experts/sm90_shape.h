// moekit/experts/sm90_shape.h — which CTA shape the SM90 decode GEMM launches with (host rule,
// no CUDA types, so the CPU tests check it).
//
// kNarrow: 3 CTAs per SM with 5-stage rings (12 consumer warps per SM), the default.
// kWide:   4 CTAs per SM with 4-stage rings (16 consumer warps per SM, registers capped at 102).
// The wide shape pays where the 4-bit dequantization of 12 warps, not HBM, sets the pace: HBM
// that delivers at least kWideMinBytesPerSmCycle per SM clock (an H200: 18.8; an H100 SXM: 12.8),
// MXFP4 weights, and at least kWideMinRows routed rows (tokens x k). Measured on both GPUs
// (docs/perf/log.md), same-run A/B: on an H200 the wide shape is 1-6% faster from 64 routed
// rows on (GPT-OSS-120B from 16 tokens, DeepSeek-V3 and Qwen3-30B-A3B from 8) and mostly slower
// below (GPT-OSS-120B 1.4% at 8 tokens and 6-22% at 1-4, Qwen3-30B-A3B 12-30% at 1-4; DeepSeek-V3
// gained at 1 and 4 tokens, left narrow); on an H100 it is slower almost everywhere with 8-row
// token chunks; with NVFP4 weights it is slower on both. With the decode kernel's 16-row chunks
// (two n8 MMAs per dequantized fragment: more dequantizing warps pay on either GPU) the wide shape
// (4 x 3 stages) is faster on the H100 too: 2.7-4.5% on Qwen3-30B-A3B, GPT-OSS-20B and
// GPT-OSS-120B, same-run A/B in docs/perf/log.md; so MXFP4 16-row chunks always run wide.
#pragma once

#include <cstdint>

#include "moekit/formats/quantize.h"

namespace moekit::sm90 {

enum class GemmShape { kNarrow, kWide };

inline constexpr double kWideMinBytesPerSmCycle = 16.0;
inline constexpr int64_t kWideMinRows = 64;

struct ShapeQuery {
  WeightFormat format = WeightFormat::kMxfp4;
  bool single_multiply = true;        // every scale in the one-multiply range (the convert step knows)
  int64_t rows = 0;                   // routed rows of the launch: tokens x k
  double hbm_bytes_per_sm_cycle = 0;  // peak HBM bytes / s over (SMs x SM clock)
  int chunk_rows = 8;                 // the decode GEMM's token chunk (oracle/kernel_choice.h)
};

inline GemmShape choose_gemm_shape(const ShapeQuery& q) {
  const bool wide = q.format == WeightFormat::kMxfp4 && q.single_multiply &&
                    (q.chunk_rows == 16 ||
                     (q.hbm_bytes_per_sm_cycle >= kWideMinBytesPerSmCycle && q.rows >= kWideMinRows));
  return wide ? GemmShape::kWide : GemmShape::kNarrow;
}

inline const char* shape_name(GemmShape s) { return s == GemmShape::kWide ? "4x4" : "3x5"; }

}  // namespace moekit::sm90
