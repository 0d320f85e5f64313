// The FP8 activations' chain cases (issue 49) and their data, shared by the GPU test
// (tests/gpu/test_fp8_chain_gpu.cpp: quantize -> FP8 GEMM1 -> quantize -> FP8 GEMM2 -> finalize on
// the device) and its CPU emulation (tests/test_fp8_chain_numerics.cpp), so that both see the
// same weights, tokens, ids and routing weights.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "moekit/model/layer_io.h"
#include "moekit/model/synthetic.h"

namespace moekit::test {

struct Fp8ChainCase {
  const char* name;
  WeightFormat f;
  Activation act;
  int E, k, H, I;
  int64_t T;
  bool biases;
  ActivationScale rule;
};

// The cases of FP8Chain.AgainstCpuLayer for one scale rule (with_empty: the T = 0 case too).
inline std::vector<Fp8ChainCase> fp8_chain_cases(ActivationScale rule, bool with_empty) {
  std::vector<Fp8ChainCase> c = {
      {"gpt-oss dims, mxfp4, biases", WeightFormat::kMxfp4, Activation::kSwigluOai, 8, 4, 2880, 2880, 67, true, rule},
      {"qwen3 dims, mxfp4", WeightFormat::kMxfp4, Activation::kSilu, 16, 8, 2048, 768, 40, false, rule},
      {"H 224 I 96 (K % 128), mxfp4", WeightFormat::kMxfp4, Activation::kSilu, 5, 3, 224, 96, 3, false, rule},
      {"one token, mxfp8, biases", WeightFormat::kMxfp8, Activation::kSilu, 4, 2, 256, 320, 1, true, rule},
  };
  if (with_empty) c.push_back({"no tokens", WeightFormat::kMxfp4, Activation::kSilu, 4, 2, 256, 128, 0, false, rule});
  return c;
}

struct Fp8ChainData {
  MoeModel m;          // activation_dtype fp8 with the case's scale rule
  LayerInputData in;   // bypass: ids [T, k] (k distinct experts a token, 1 slot in 10 empty), weights
};

inline Fp8ChainData fp8_chain_data(const Fp8ChainCase& c) {
  MoeConfig cfg;
  cfg.num_experts = c.E;
  cfg.top_k = c.k;
  cfg.hidden = c.H;
  cfg.intermediate = c.I;
  cfg.act = c.act;
  cfg.format = c.f;
  cfg.norm_topk_prob = true;
  cfg.swiglu_limit = c.act == Activation::kSiluClamped ? 5.0f : 7.0f;
  cfg.activation_dtype = ActivationDtype::kFp8;
  cfg.activation_scale = c.rule;
  cfg.biases = c.biases;
  cfg.max_tokens = std::max<int64_t>(c.T, 1);
  SyntheticOptions so;
  so.seed = 1000 + uint64_t(c.H) + uint64_t(c.T);
  so.biases = c.biases;
  Fp8ChainData d{make_synthetic_model(cfg, so), {}};
  d.m.cfg.activation_dtype = ActivationDtype::kFp8;
  d.m.cfg.activation_scale = c.rule;
  d.m.cfg.max_tokens = cfg.max_tokens;
  // k distinct experts per token (the layer refuses a token that lists one twice), 1 slot in 10 empty.
  std::mt19937_64 rng(uint64_t(c.T) * 31 + 7);
  std::vector<int32_t> experts(static_cast<size_t>(c.E));
  const uint64_t seed = uint64_t(c.T) + 3;
  d.in = make_synthetic_input(d.m.cfg, c.T, seed);
  d.in.logits.clear();
  d.in.bypass = true;
  d.in.k = c.k;
  d.in.ids.resize(size_t(c.T * c.k));
  d.in.weights.resize(size_t(c.T * c.k));
  for (int64_t t = 0; t < c.T; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int j = 0; j < c.k; ++j) d.in.ids[size_t(t * c.k + j)] = rng() % 10 == 0 ? -1 : experts[size_t(j)];
  }
  std::mt19937 wrng(uint32_t(seed) + 1);
  std::uniform_real_distribution<float> uw(0.1f, 1.0f);
  for (auto& w : d.in.weights) w = uw(wrng);
  return d;
}

}  // namespace moekit::test
