// The SM90 GEMM's CTA-shape rule (experts/sm90_shape.h) on the devices and shapes it was
// measured on (docs/perf/log.md).
#include <gtest/gtest.h>

#include "moekit/experts/sm90_shape.h"

namespace moekit::sm90 {
namespace {

// Peak HBM bytes per SM clock: 2 x memory clock x bus bytes / (132 SMs x 1.98 GHz).
constexpr double kH100 = 2.0 * 2619e6 * 640 / (132 * 1980e6);  // 12.8
constexpr double kH200 = 2.0 * 3201e6 * 768 / (132 * 1980e6);  // 18.8

ShapeQuery query(double bw, int64_t tokens, int64_t k) {
  ShapeQuery q;
  q.rows = tokens * k;
  q.hbm_bytes_per_sm_cycle = bw;
  return q;
}

TEST(Sm90Shape, DevicesAreOnTheirSideOfTheThreshold) {
  EXPECT_LT(kH100, kWideMinBytesPerSmCycle);
  EXPECT_GT(kH200, kWideMinBytesPerSmCycle);
}

TEST(Sm90Shape, H100StaysNarrowWithEightRowChunks) {
  for (int64_t T : {1, 8, 64, 4096}) {
    EXPECT_EQ(choose_gemm_shape(query(kH100, T, 4)), GemmShape::kNarrow) << T;
    EXPECT_EQ(choose_gemm_shape(query(kH100, T, 8)), GemmShape::kNarrow) << T;
  }
}

TEST(Sm90Shape, SixteenRowChunksRunWideOnBothGpus) {
  for (double bw : {kH100, kH200}) {
    ShapeQuery q = query(bw, 128, 8);
    q.chunk_rows = 16;
    EXPECT_EQ(choose_gemm_shape(q), GemmShape::kWide) << bw;
    q.format = WeightFormat::kNvfp4;
    EXPECT_EQ(choose_gemm_shape(q), GemmShape::kNarrow) << bw;
    q.format = WeightFormat::kMxfp4;
    q.single_multiply = false;
    EXPECT_EQ(choose_gemm_shape(q), GemmShape::kNarrow) << bw;
  }
}

TEST(Sm90Shape, H200WideFrom64Rows) {
  // GPT-OSS-120B (k 4): wide from 16 tokens (8 tokens measured 1.4% slower wide).
  EXPECT_EQ(choose_gemm_shape(query(kH200, 1, 4)), GemmShape::kNarrow);
  EXPECT_EQ(choose_gemm_shape(query(kH200, 8, 4)), GemmShape::kNarrow);
  EXPECT_EQ(choose_gemm_shape(query(kH200, 16, 4)), GemmShape::kWide);
  EXPECT_EQ(choose_gemm_shape(query(kH200, 64, 4)), GemmShape::kWide);
  // DeepSeek-V3 and Qwen3-30B-A3B (k 8): wide from 8 tokens.
  EXPECT_EQ(choose_gemm_shape(query(kH200, 4, 8)), GemmShape::kNarrow);
  EXPECT_EQ(choose_gemm_shape(query(kH200, 8, 8)), GemmShape::kWide);
}

TEST(Sm90Shape, OnlyMxfp4WithOneMultiply) {
  for (WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16}) {
    ShapeQuery q = query(kH200, 64, 4);
    q.format = f;
    EXPECT_EQ(choose_gemm_shape(q), GemmShape::kNarrow) << format_name(f);
  }
  ShapeQuery q = query(kH200, 64, 4);
  q.single_multiply = false;
  EXPECT_EQ(choose_gemm_shape(q), GemmShape::kNarrow);
}

}  // namespace
}  // namespace moekit::sm90
