// The SM90 backends' convert step (experts/sm90_convert.cpp) on the host: the fast path (atoms read
// pair by pair from the row bytes) writes the same bytes as the element-by-element definition, for
// every SM90 format, padded and unpadded H and I, stacked and per-expert (Hugging Face) weights.
// Built with the CUDA backends only (the step lives in moekit_cuda).
#include <gtest/gtest.h>

#ifdef MOEKIT_WITH_CUDA
#include "hf_testutil.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/model/synthetic.h"

namespace moekit::sm90 {
namespace {

void expect_same(const ConvertedMatrix& a, const ConvertedMatrix& b) {
  EXPECT_EQ(a.codes, b.codes);
  EXPECT_EQ(a.scales, b.scales);
  EXPECT_EQ(a.row_scale, b.row_scale);
  EXPECT_EQ(a.bias, b.bias);
  EXPECT_EQ(a.single_multiply, b.single_multiply);
}

void expect_fast_is_definition(const LayerWeights& m) {
  expect_same(convert_w13(m, true), convert_w13(m, false));
  expect_same(convert_w2(m, true), convert_w2(m, false));
}

TEST(Sm90Convert, FastPathWritesTheDefinitionsBytes) {
  uint64_t seed = 1;
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16})
    for (auto [H, I] : {std::pair{256, 128}, std::pair{320, 160}, std::pair{96, 224}}) {
      SCOPED_TRACE(std::string(format_name(f)) + " H=" + std::to_string(H) + " I=" + std::to_string(I));
      MoeConfig c;
      c.num_experts = 3;
      c.top_k = 2;
      c.hidden = H;
      c.intermediate = I;
      c.format = f;
      c.act = Activation::kSwigluOai;
      SyntheticOptions so;
      so.seed = ++seed;
      so.biases = true;
      so.split_scale_2 = f == WeightFormat::kNvfp4;
      expect_fast_is_definition(make_synthetic_model(c, so));
    }
}

TEST(Sm90Convert, PerExpertCheckpointTensors) {
  for (int i : {0, 2, 3, 6, 7}) {  // gpt_oss, deepseek bf16 / nvfp4, qwen3 nvfp4, mixtral bf16
    const test::HfCase c = test::hf_cases()[size_t(i)];
    SCOPED_TRACE(c.name);
    const auto ck = test::build_hf_checkpoint(c);
    expect_fast_is_definition(MoeModel::load(ck->path()));
  }
}

}  // namespace
}  // namespace moekit::sm90
#endif
