// Hugging Face checkpoint directories (model/hf_checkpoint.h): every published layout, sharded
// with an index, read back exactly; every MoE layer run from hidden_states alone (the router from
// the checkpoint) on the CPU backends against the double-precision reference; the CLI's
// `run --model HF_DIR --layer N`; a GPT-OSS-20B-shaped layer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "hf_testutil.h"
#include "moe_testutil.h"
#include "moekit/api/host_runner.h"
#include "moekit/common/bf16.h"
#include "moekit/experts/reference.h"
#include "moekit/io/safetensors.h"
#include "moekit/model/hf_config.h"
#include "moekit/model/layer_io.h"
#include "testutil.h"

namespace moekit {
namespace {

using test::HfCase;

// hidden_states alone: the checkpoint's router computes the logits.
std::string write_hidden_states(const std::string& path, const MoeConfig& cfg, int64_t T, uint64_t seed) {
  const LayerInputData in = make_synthetic_input(cfg, T, seed);
  SafetensorsWriter w;
  w.add("hidden_states", DType::kBF16, {T, int64_t(cfg.hidden)}, in.x);
  w.write(path);
  return path;
}

// Router logits in double from the same bf16 x and weights.
void expect_router_logits(const LayerInputData& in, const RouterWeights& r) {
  const int64_t H = r.hidden;
  double worst = 0;
  for (int64_t t = 0; t < in.tokens; ++t)
    for (int e = 0; e < r.num_experts; ++e) {
      double acc = 0, mag = 0;
      for (int64_t h = 0; h < H; ++h) {
        const double p = double(bf16_to_float(in.x[size_t(t * H + h)])) * r.weight[size_t(e * H + h)];
        acc += p;
        mag += std::fabs(p);
      }
      if (!r.bias.empty()) acc += r.bias[size_t(e)];
      worst = std::max(worst, std::fabs(in.logits[size_t(t * r.num_experts + e)] - acc) / (mag + 1e-30));
    }
  EXPECT_LT(worst, 1e-5) << "router logits (error relative to the sum of |products|)";
}

class HfLayouts : public ::testing::TestWithParam<HfCase> {};

TEST_P(HfLayouts, EveryMoeLayerReadsBackExactlyAndRunsOnEveryCpuBackend) {
  const HfCase c = GetParam();
  const auto ck = test::build_hf_checkpoint(c);
  const HfModelConfig hc = load_hf_config(ck->path());
  const MoeConfig want = test::hf_case_config(c);
  EXPECT_EQ(hc.num_layers, c.num_layers);
  ASSERT_EQ(hc.moe_layers.size(), ck->layers.size());
  EXPECT_EQ(hc.moe_layers.front(), c.first_dense);
  EXPECT_EQ(hc.spec.num_experts, want.num_experts);
  EXPECT_EQ(hc.spec.top_k, want.top_k);
  EXPECT_EQ(hc.spec.hidden, want.hidden);
  EXPECT_EQ(hc.spec.intermediate, want.intermediate);
  EXPECT_EQ(hc.spec.format, want.format);
  EXPECT_EQ(hc.spec.act, want.act);
  EXPECT_EQ(hc.spec.scoring, want.scoring);
  EXPECT_EQ(hc.spec.norm_topk_prob, want.norm_topk_prob);
  EXPECT_EQ(hc.spec.n_group, want.n_group);
  EXPECT_EQ(hc.spec.topk_group, want.topk_group);
  EXPECT_EQ(hc.spec.routed_scaling_factor, want.routed_scaling_factor);
  EXPECT_EQ(hc.spec.swiglu_limit, want.swiglu_limit);

  // The default layer is the first MoE layer.
  EXPECT_EQ(MoeModel::load(ck->path()).layer, c.first_dense);
  for (size_t i = 0; i < ck->layers.size(); ++i) {
    const int layer = c.first_dense + int(i);
    SCOPED_TRACE("layer " + std::to_string(layer));
    MoeModel m = MoeModel::load(ck->path(), layer);
    EXPECT_EQ(m.layer, layer);
    if (c.bf16_fp8_scales)  // as Qwen3's FP8 releases store them
      EXPECT_EQ(m.shards.get("model.layers." + std::to_string(layer) + ".mlp.experts.1.up_proj.weight_scale_inv").dtype,
                DType::kBF16);
    EXPECT_EQ(m.cfg.biases, ck->layers[i].cfg.biases);
    EXPECT_EQ(m.cfg.score_bias, ck->layers[i].cfg.score_bias);
    test::expect_same_weights(m, ck->layers[i]);
    EXPECT_EQ(m.router.weight, ck->routers[i].weight);
    EXPECT_EQ(m.router.bias, ck->routers[i].bias);

    const std::string input = write_hidden_states(ck->dir / "x.safetensors", m.cfg, 37, 5 + i);
    const LayerInputData in = load_layer_input(input, m.cfg, &m.router);
    expect_router_logits(in, m.router);
    for (const char* backend : {"cpu", "cpu_batched"}) {
      SCOPED_TRACE(backend);
      LayerOutput out;
      HostRunner(m, backend).run(in.view(), &out);
      const std::vector<double> ref = reference_layer(ck->layers[i], in.x.data(), in.tokens, out.ids.data(),
                                                      out.weights.data(), m.cfg.top_k);
      EXPECT_LE(rel_l2(test::bf16_to_floats(out.y), ref), 1e-2);
      // The same weights as a synthetic layer in memory give the same bits.
      LayerOutput same;
      HostRunner(ck->layers[i], backend).run(in.view(), &same);
      EXPECT_EQ(out.y, same.y);
      EXPECT_EQ(out.ids, same.ids);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Hf, HfLayouts, ::testing::ValuesIn(test::hf_cases()),
                         [](const ::testing::TestParamInfo<HfCase>& i) { return std::string(i.param.name); });

TEST(HfCheckpoint, OnlyTheLayersShardsAreOpened) {
  HfCase c = test::hf_cases()[4];  // qwen3_moe bf16
  c.num_layers = 4;
  c.shards = 4;
  const auto ck = test::build_hf_checkpoint(c);
  const MoeModel m = MoeModel::load(ck->path(), 3);
  // The last layer's tensors sit in the last shard or two; the first shard is never opened.
  const std::vector<std::string> opened = m.shards.opened_paths();
  EXPECT_LE(opened.size(), 2u);
  for (const std::string& p : opened) EXPECT_EQ(p.find("model-00001-of"), std::string::npos) << p;
}

TEST(HfCheckpoint, CliRunsALayerFromHiddenStatesAlone) {
  const HfCase c = test::hf_cases()[1];  // deepseek_v3 fp8, dense layer 0
  const auto ck = test::build_hf_checkpoint(c);
  const MoeModel m = MoeModel::load(ck->path(), 2);
  const std::string x = write_hidden_states(ck->dir / "x.safetensors", m.cfg, 9, 3);
  const std::string y = ck->dir / "y.safetensors";
  const test::RunResult r =
      test::run_cli("run --model " + ck->path() + " --layer 2 --input " + x + " --output " + y + " --backend cpu");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("deepseek_v3 layer 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("shared expert"), std::string::npos) << r.out;
  // The same as the layer through the library.
  const LayerInputData in = load_layer_input(x, m.cfg, &m.router);
  LayerOutput out;
  HostRunner(m, "cpu").run(in.view(), &out);
  const SafetensorsFile f = SafetensorsFile::open(y);
  EXPECT_EQ(test::tensor_as<uint16_t>(f, "y", DType::kBF16, {9, c.H}), out.y);
  EXPECT_EQ(test::tensor_as<int32_t>(f, "topk_ids", DType::kI32, {9, c.k}), out.ids);
  // backends --model HF_DIR --layer N explains the same layer.
  const test::RunResult b = test::run_cli("backends --model " + ck->path() + " --layer 1 --tokens 4");
  EXPECT_EQ(b.code, 0) << b.out;
  EXPECT_NE(b.out.find("layer 1"), std::string::npos) << b.out;
}

// A GPT-OSS-20B-shaped layer (E = 32, k = 4, H = I = 2880, MXFP4 with biases) in two shards.
TEST(HfCheckpoint, GptOss20bShapedLayer) {
  const HfCase c{"gpt_oss_20b", "gpt_oss", WeightFormat::kMxfp4, false, 32, 4, 2880, 2880, 1, 0, 2};
  const auto ck = test::build_hf_checkpoint(c, 20);
  const MoeModel m = MoeModel::load(ck->path());
  EXPECT_EQ(m.layer, 0);
  test::expect_same_weights(m, ck->layers[0]);
  const std::string x = write_hidden_states(ck->dir / "x.safetensors", m.cfg, 5, 1);
  const LayerInputData in = load_layer_input(x, m.cfg, &m.router);
  LayerOutput out;
  HostRunner(m, "cpu").run(in.view(), &out);
  const std::vector<double> ref =
      reference_layer(ck->layers[0], in.x.data(), in.tokens, out.ids.data(), out.weights.data(), 4);
  const double err = rel_l2(test::bf16_to_floats(out.y), ref);
  RecordProperty("rel_l2", test::fmt_e(err));
  EXPECT_LE(err, 1e-2);
}

}  // namespace
}  // namespace moekit
