// Helpers of the Hugging Face checkpoint tests (CPU: tests/test_hf_checkpoint.cpp; SM90:
// tests/gpu/test_checkpoints_gpu.cpp): one small checkpoint per published layout, built from
// synthetic layers (model/hf_synthetic.h), sharded with an index; the weights each MoE layer was
// written from, to compare the loaded layer against.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moekit/common/bf16.h"
#include "moekit/model/hf_synthetic.h"
#include "moekit/model/model.h"
#include "moekit/model/synthetic.h"
#include "testutil.h"

namespace moekit::test {

struct HfCase {
  const char* name;
  const char* model_type;
  WeightFormat format;
  bool modelopt;
  int E, k, H, I;
  int num_layers = 3, first_dense = 0, shards = 3;
  bool single_file = false;
  bool bf16_fp8_scales = false;  // Qwen3's FP8 releases
};

// Every published layout, at small and awkward sizes (H, I not multiples of the SM90 kernels'
// 128 where the format allows it).
inline std::vector<HfCase> hf_cases() {
  using W = WeightFormat;
  return {
      {"gpt_oss_mxfp4", "gpt_oss", W::kMxfp4, false, 8, 2, 192, 160},
      {"deepseek_v3_fp8", "deepseek_v3", W::kFp8, false, 16, 4, 256, 128, 3, 1},
      {"deepseek_v3_bf16", "deepseek_v3", W::kBf16, false, 16, 4, 96, 64, 3, 1},
      {"deepseek_v3_nvfp4_modelopt", "deepseek_v3", W::kNvfp4, true, 16, 4, 256, 128, 3, 1},
      {"qwen3_moe_bf16", "qwen3_moe", W::kBf16, false, 16, 4, 128, 96},
      {"qwen3_moe_fp8", "qwen3_moe", W::kFp8, false, 8, 2, 256, 256},
      {"qwen3_moe_nvfp4_modelopt", "qwen3_moe", W::kNvfp4, true, 8, 2, 128, 96},
      {"mixtral_bf16", "mixtral", W::kBf16, false, 8, 2, 128, 224},
      {"mixtral_nvfp4_modelopt_single_file", "mixtral", W::kNvfp4, true, 8, 2, 64, 80, 2, 0, 1, true},
      {"qwen3_moe_fp8_bf16_scales", "qwen3_moe", W::kFp8, false, 8, 2, 384, 128, 2, 0, 2, false, true},
  };
}

// The layer description a case's config.json must map to.
inline MoeConfig hf_case_config(const HfCase& c) {
  MoeConfig cfg;
  cfg.num_experts = c.E;
  cfg.top_k = c.k;
  cfg.hidden = c.H;
  cfg.intermediate = c.I;
  cfg.format = c.format;
  const std::string mt = c.model_type;
  if (mt == "gpt_oss") {
    cfg.act = Activation::kSwigluOai;
    cfg.norm_topk_prob = true;
  } else if (mt == "deepseek_v3") {
    cfg.scoring = Scoring::kSigmoid;
    cfg.n_group = 4;
    cfg.topk_group = 2;
    cfg.routed_scaling_factor = 2.5f;
    cfg.norm_topk_prob = true;
  } else {
    cfg.norm_topk_prob = true;
  }
  return cfg;
}

struct HfCheckpoint {
  TempDir dir;
  HfCase c;
  HfCheckpointOptions opt;
  std::vector<MoeModel> layers;        // the MoE layers' weights, in layer order
  std::vector<RouterWeights> routers;
  int first_moe = 0;
  std::string path() const { return dir.path() + "/ckpt"; }
};

inline std::unique_ptr<HfCheckpoint> build_hf_checkpoint(const HfCase& c, uint64_t seed = 1) {
  auto ck = std::make_unique<HfCheckpoint>();
  ck->c = c;
  const MoeConfig cfg = hf_case_config(c);
  ck->opt.model_type = c.model_type;
  ck->opt.num_layers = c.num_layers;
  ck->opt.first_dense = c.first_dense;
  ck->opt.shards = c.shards;
  ck->opt.single_file = c.single_file;
  ck->opt.modelopt = c.modelopt;
  ck->opt.bf16_fp8_scales = c.bf16_fp8_scales;
  ck->first_moe = c.first_dense;
  const bool gpt = std::string(c.model_type) == "gpt_oss";
  for (int l = c.first_dense; l < c.num_layers; ++l) {
    SyntheticOptions so;
    so.seed = seed * 100 + uint64_t(l);
    so.biases = gpt;
    so.score_bias = cfg.scoring == Scoring::kSigmoid;
    so.split_scale_2 = c.format == WeightFormat::kNvfp4;
    ck->layers.push_back(make_synthetic_model(cfg, so));
    if (c.bf16_fp8_scales)  // the weights the checkpoint holds: scales rounded to bf16
      for (const WeightMatrix* w : {&ck->layers.back().w13, &ck->layers.back().w2})
        for (auto& s : ck->layers.back().storage)
          if (s.data() == w->scales)
            for (size_t i = 0; i + 4 <= s.size(); i += 4) {
              float v;
              std::memcpy(&v, &s[i], 4);
              v = round_bf16(v);
              std::memcpy(&s[i], &v, 4);
            }
    ck->routers.push_back(make_synthetic_router(c.E, c.H, so.seed + 7, gpt));
  }
  std::vector<HfLayerSource> src;
  for (size_t i = 0; i < ck->layers.size(); ++i) src.push_back({&ck->layers[i], &ck->routers[i]});
  write_hf_checkpoint(ck->path(), ck->opt, src);
  return ck;
}

// The loaded layer holds exactly the weights it was written from (codes, scales, tensor scales,
// biases, score bias), row by row in logical order.
inline void expect_same_weights(const LayerWeights& got, const LayerWeights& want) {
  auto same = [](const WeightMatrix& a, const WeightMatrix& b, const char* what) {
    ASSERT_EQ(a.format, b.format) << what;
    ASSERT_EQ(a.E, b.E) << what;
    ASSERT_EQ(a.N, b.N) << what;
    ASSERT_EQ(a.K, b.K) << what;
    int64_t bad = 0;
    for (int64_t e = 0; e < a.E; ++e)
      for (int64_t r = 0; r < a.N; ++r) {
        bad += std::memcmp(a.row_codes(e, r), b.row_codes(e, r), size_t(a.code_row)) != 0;
        if (a.scale_row > 0) bad += std::memcmp(a.row_scales(e, r), b.row_scales(e, r), size_t(a.scale_row)) != 0;
        bad += a.row_scale_2(e, r) != b.row_scale_2(e, r);
      }
    EXPECT_EQ(bad, 0) << what << ": rows that differ";
  };
  same(got.w13, want.w13, "w13");
  same(got.w2, want.w2, "w2");
  EXPECT_EQ(got.b13, want.b13);
  EXPECT_EQ(got.b2, want.b2);
  EXPECT_EQ(got.score_bias, want.score_bias);
}

}  // namespace moekit::test
