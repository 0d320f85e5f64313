// The SM90 GEMM's CTA-shape rule (experts/sm90_shape.h) on the devices and shapes it was
// measured on (docs/PERFORMANCE.md).
#include <gtest/gtest.h>

#include "moekit/experts/sm90_shape.h"

namespace moekit::sm90 {
namespace {

// Peak HBM bytes per SM clock: 2 x memory clock x bus bytes / (132 SMs x 1.98 GHz).
constexpr double kH100 = 2.0 * 2619e6 * 640 / (132 * 1980e6);  // 12.8
constexpr double kH200 = 2.0 * 3201e6 * 768 / (132 * 1980e6);  // 18.8

ShapeQuery query(double bw, int64_t E, int64_t groups1, int64_t tokens, int64_t k) {
  ShapeQuery q;
  q.rows = tokens * k;
  q.experts = E;
  q.gemm1_groups = groups1;
  q.wide_grid = 132 * 4;
  q.hbm_bytes_per_sm_cycle = bw;
  return q;
}

TEST(Sm90Shape, DevicesAreOnTheirSideOfTheThreshold) {
  EXPECT_LT(kH100, kWideMinBytesPerSmCycle);
  EXPECT_GT(kH200, kWideMinBytesPerSmCycle);
}

TEST(Sm90Shape, H100StaysNarrow) {
  for (int64_t T : {1, 8, 64, 4096}) {
    EXPECT_EQ(choose_gemm_shape(query(kH100, 128, 90, T, 4)), GemmShape::kNarrow) << T;
    EXPECT_EQ(choose_gemm_shape(query(kH100, 256, 64, T, 8)), GemmShape::kNarrow) << T;
  }
}

TEST(Sm90Shape, H200WideFromThreeWaves) {
  // GPT-OSS-120B (E 128, k 4, 2 I = 5760: 90 groups): wide from 8 tokens.
  EXPECT_EQ(choose_gemm_shape(query(kH200, 128, 90, 1, 4)), GemmShape::kNarrow);
  EXPECT_EQ(choose_gemm_shape(query(kH200, 128, 90, 4, 4)), GemmShape::kNarrow);
  EXPECT_EQ(choose_gemm_shape(query(kH200, 128, 90, 8, 4)), GemmShape::kWide);
  EXPECT_EQ(choose_gemm_shape(query(kH200, 128, 90, 64, 4)), GemmShape::kWide);
  // DeepSeek-V3 (E 256, k 8, 2 I = 4096: 64 groups): wide from 4 tokens.
  EXPECT_EQ(choose_gemm_shape(query(kH200, 256, 64, 2, 8)), GemmShape::kNarrow);
  EXPECT_EQ(choose_gemm_shape(query(kH200, 256, 64, 4, 8)), GemmShape::kWide);
  // Qwen3-30B-A3B (E 128, k 8, 2 I = 1536: 24 groups): wide from 16 tokens.
  EXPECT_EQ(choose_gemm_shape(query(kH200, 128, 24, 8, 8)), GemmShape::kNarrow);
  EXPECT_EQ(choose_gemm_shape(query(kH200, 128, 24, 16, 8)), GemmShape::kWide);
}

TEST(Sm90Shape, OnlyMxfp4WithOneMultiply) {
  for (WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16}) {
    ShapeQuery q = query(kH200, 128, 90, 64, 4);
    q.format = f;
    EXPECT_EQ(choose_gemm_shape(q), GemmShape::kNarrow) << format_name(f);
  }
  ShapeQuery q = query(kH200, 128, 90, 64, 4);
  q.single_multiply = false;
  EXPECT_EQ(choose_gemm_shape(q), GemmShape::kNarrow);
}

}  // namespace
}  // namespace moekit::sm90
