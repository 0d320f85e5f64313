// Helpers of the DeepSeek-V4 tests (CPU: tests/test_dsv4.cpp; SM90: tests/gpu/test_dsv4_gpu.cpp):
// the router goldens of tests/golden/dsv4_router (float64 NumPy after DeepSeek's Gate,
// tests/golden/dsv4_router.py), DeepSeek-V4 checkpoints in the published layout written from
// synthetic layers (model/hf_synthetic.h), and the float64 reference of a layer with its shared
// expert (experts/reference.h on the weights the checkpoint was written from).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moekit/api/host_runner.h"
#include "moekit/common/bf16.h"
#include "moekit/experts/reference.h"
#include "moekit/io/safetensors.h"
#include "moekit/model/hf_synthetic.h"
#include "moekit/model/layer_io.h"
#include "moekit/model/model.h"
#include "moekit/model/synthetic.h"
#include "moekit/routing/routing.h"
#include "testutil.h"

namespace moekit::test {

// tests/golden of the source tree: $MOEKIT_GOLDEN, else where it was when the tests were built,
// else tests/golden under the current directory (a GPU machine running from the repo root).
inline std::string golden(const std::string& rel) {
  const char* env = std::getenv("MOEKIT_GOLDEN");
  std::string root = env && *env ? env : MOEKIT_GOLDEN;
  if (!(env && *env) && !std::filesystem::exists(root)) root = "tests/golden";
  return root + "/" + rel;
}

// A DeepSeek-V4 layer's description (what config.json maps to): clamped SiLU, sqrtsoftplus
// scores, top-k renormalized and scaled by rsf; hash-routed (a tid2eid table of `hash_vocab`
// rows) when hash_vocab > 0, else learned with a score bias.
inline LayerSpec v4_layer_spec(int64_t E, int64_t k, int64_t H, int64_t I, WeightFormat format, float rsf,
                               int64_t hash_vocab) {
  LayerSpec s;
  s.num_experts = E;
  s.top_k = k;
  s.hidden = H;
  s.intermediate = I;
  s.format = format;
  s.act = Activation::kSiluClamped;
  s.swiglu_limit = 10.0f;
  s.scoring = Scoring::kSqrtSoftplus;
  s.norm_topk_prob = true;
  s.routed_scaling_factor = rsf;
  s.score_bias = hash_vocab == 0;
  s.hash_vocab = hash_vocab;
  return s;
}

// ---- the router goldens ----------------------------------------------------------------------

struct RouterGolden {
  std::string name;
  bool hash = false;
  int E = 0, k = 0;
  float rsf = 1.0f;
  int64_t V = 0, T = 0;
  std::vector<float> logits, bias;  // [T, E], [E] (learned)
  std::vector<int32_t> table;       // [V, k] (hash), as int32
  bool table_i64 = false;
  std::vector<uint8_t> table_bytes; // as the file stores it
  std::vector<int64_t> input_ids;   // [T] (hash)
  std::vector<int32_t> ids;         // expected [T, k]
  std::vector<double> weights;      // expected [T, k]

  // The layer description of the golden's router (E, k, scaling; small H and I).
  LayerSpec spec(int64_t max_tokens) const {
    LayerSpec s = v4_layer_spec(E, k, 64, 64, WeightFormat::kBf16, rsf, hash ? V : 0);
    s.max_tokens = max_tokens;
    return s;
  }
};

inline std::vector<std::string> router_golden_names() {
  std::vector<std::string> v;
  for (const auto& e : std::filesystem::directory_iterator(golden("dsv4_router")))
    if (e.path().extension() == ".safetensors") v.push_back(e.path().stem().string());
  std::sort(v.begin(), v.end());
  return v;
}

template <typename T>
std::vector<T> golden_tensor(const SafetensorsFile& f, const std::string& name, DType d) {
  const TensorView& t = f.get(name);
  EXPECT_EQ(t.dtype, d) << f.path() << " " << name;
  std::vector<T> v(t.nbytes / sizeof(T));
  if (t.nbytes) std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

inline RouterGolden load_router_golden(const std::string& name) {
  const SafetensorsFile f = SafetensorsFile::open(golden("dsv4_router/" + name + ".safetensors"));
  RouterGolden g;
  g.name = name;
  const auto& meta = f.metadata();
  g.hash = meta.at("kind") == "hash";
  g.E = std::stoi(meta.at("num_experts"));
  g.k = std::stoi(meta.at("top_k"));
  g.rsf = std::stof(meta.at("routed_scaling_factor"));
  g.V = std::stoll(meta.at("hash_vocab"));
  g.logits = golden_tensor<float>(f, "logits", DType::kF32);
  g.T = int64_t(g.logits.size()) / g.E;
  g.ids = golden_tensor<int32_t>(f, "topk_ids", DType::kI32);
  g.weights = golden_tensor<double>(f, "topk_weights", DType::kF64);
  if (g.hash) {
    const TensorView& t = f.get("tid2eid");
    g.table_i64 = t.dtype == DType::kI64;
    g.table_bytes.assign(t.data, t.data + t.nbytes);
    g.table = hash_table_from(t.data, g.table_i64, g.V, g.k, g.E, name);
    g.input_ids = golden_tensor<int64_t>(f, "input_ids", DType::kI64);
  } else {
    g.bias = golden_tensor<float>(f, "bias", DType::kF32);
  }
  return g;
}

// Routing ids and weights against a golden: learned, the same expert sets per token; hash, the
// same ids in the table's order; weights within 1e-6 relative of the float64 ones (fp32 math,
// exp/log1p within an ulp or two).
inline void expect_golden_routing(const RouterGolden& g, const std::vector<int32_t>& ids, const std::vector<float>& w,
                                  double tol = 1e-6) {
  ASSERT_EQ(ids.size(), g.ids.size());
  ASSERT_EQ(w.size(), g.weights.size());
  int64_t bad_ids = 0, bad_w = 0;
  double worst = 0;
  for (int64_t t = 0; t < g.T; ++t) {
    for (int j = 0; j < g.k; ++j) {
      const size_t i = size_t(t * g.k + j);
      // The golden's slot of this id (hash: the same slot).
      int jj = -1;
      for (int q = 0; q < g.k; ++q)
        if (g.ids[size_t(t * g.k + q)] == ids[i]) jj = q;
      if (jj < 0 || (g.hash && jj != j)) {
        ++bad_ids;
        continue;
      }
      const double want = g.weights[size_t(t * g.k + jj)];
      const double err = std::fabs(double(w[i]) - want) / std::fabs(want);
      worst = std::max(worst, err);
      bad_w += err > tol;
    }
  }
  EXPECT_EQ(bad_ids, 0) << g.name << ": slots whose expert is not the golden's";
  EXPECT_EQ(bad_w, 0) << g.name << ": weights off by more than " << tol << " (worst " << worst << ")";
}

// ---- DeepSeek-V4 checkpoints ------------------------------------------------------------------

struct Dsv4Case {
  const char* name;
  WeightFormat format;  // routed experts: mxfp4 (published), fp8 (Flash-Base), bf16 (transformers)
  int E, k, H, I;
  int num_layers, num_hash_layers;
  int64_t vocab;
  bool transformers_names = false, text_config = false, table_i32 = false;
  WeightFormat shared = WeightFormat::kFp8;  // fp8 (E8M0 blocks: H, I multiples of 128) or bf16
};

inline std::vector<Dsv4Case> dsv4_cases() {
  using W = WeightFormat;
  return {
      {"published_mxfp4", W::kMxfp4, 16, 4, 256, 128, 3, 2, 96},
      {"flash_base_fp8", W::kFp8, 8, 2, 256, 256, 2, 1, 40},
      {"transformers_bf16", W::kBf16, 8, 3, 128, 64, 3, 1, 50, true, false, false, W::kBf16},
      {"v41_text_config", W::kMxfp4, 8, 2, 128, 128, 2, 0, 32, false, true},
      {"table_i32", W::kMxfp4, 8, 2, 64, 96, 2, 1, 40, false, false, true, W::kBf16},
  };
}

// A checkpoint case's layer description.
inline LayerSpec dsv4_spec(const Dsv4Case& c, bool hash) {
  return v4_layer_spec(c.E, c.k, c.H, c.I, c.format, 1.5f, hash ? c.vocab : 0);
}

struct Dsv4Checkpoint {
  TempDir dir;
  Dsv4Case c;
  std::vector<MoeModel> layers;   // routed experts (and table / score bias), layer order
  std::vector<MoeModel> shared;   // each layer's shared expert (E = 1)
  std::vector<RouterWeights> routers;
  std::string path() const { return dir.path() + "/ckpt"; }
};

inline std::unique_ptr<Dsv4Checkpoint> build_dsv4_checkpoint(const Dsv4Case& c, uint64_t seed = 1) {
  auto ck = std::make_unique<Dsv4Checkpoint>();
  ck->c = c;
  HfCheckpointOptions opt;
  opt.model_type = "deepseek_v4";
  opt.num_layers = c.num_layers;
  opt.shards = 2;
  opt.num_hash_layers = c.num_hash_layers;
  opt.vocab = c.vocab;
  opt.v4_transformers_names = c.transformers_names;
  opt.text_config = c.text_config;
  opt.table_i32 = c.table_i32;
  for (int l = 0; l < c.num_layers; ++l) {
    const bool hash = l < c.num_hash_layers;
    SyntheticOptions so;
    so.seed = seed * 100 + uint64_t(l);
    so.score_bias = !hash;
    ck->layers.push_back(make_synthetic_model(dsv4_spec(c, hash), so));
    LayerSpec sc = dsv4_spec(c, false);
    sc.num_experts = 1;
    sc.top_k = 1;
    sc.format = c.shared;
    sc.score_bias = false;
    sc.scoring = Scoring::kSoftmax;
    SyntheticOptions ss;
    ss.seed = so.seed + 50;
    ss.pow2_fp8_scales = true;
    ck->shared.push_back(make_synthetic_model(sc, ss));
    ck->routers.push_back(make_synthetic_router(c.E, c.H, so.seed + 7, false));
  }
  std::vector<HfLayerSource> src;
  for (int l = 0; l < c.num_layers; ++l) src.push_back({&ck->layers[size_t(l)], &ck->routers[size_t(l)], &ck->shared[size_t(l)]});
  write_hf_checkpoint(ck->path(), opt, src);
  return ck;
}

// x bf16 [T, H] and token ids for a layer of the checkpoint, routed by its router (logits from x).
inline LayerInputData dsv4_input(const MoeModel& m, int64_t T, uint64_t seed) {
  LayerInputData in = make_synthetic_input(m.cfg, T, seed);
  in.logits = m.router.logits(in.x.data(), T);
  if (in.token_ids.empty()) {  // a learned layer ignores them (an input file of a model has them all the same)
    std::mt19937_64 rng(seed + 1);
    in.token_ids.resize(size_t(T));
    for (int64_t& v : in.token_ids) v = int64_t(rng() % 97);
  }
  return in;
}

// A DeepSeek-V4 layer run as `moekit run` runs it: its shared expert on `shared_backend`
// (api/host_runner.h run_shared_expert), then the routed layer on `backend` with that output added.
inline LayerOutput run_with_shared(const MoeModel& m, const LayerInputData& in, const std::string& backend,
                                   const std::string& shared_backend = "cpu") {
  HostRunner sr(m.shared_expert, shared_backend);
  const std::vector<uint16_t> sy = run_shared_expert(sr, in.x.data(), in.tokens);
  LayerInput v = in.view();
  v.shared = sy.data();
  LayerOutput out;
  HostRunner(m, backend).run(v, &out);
  return out;
}

// y's float64 reference of layer l (the weights the checkpoint was written from): the routed
// experts on the given routing, plus the shared expert's output rounded to bf16.
inline std::vector<double> dsv4_reference(const Dsv4Checkpoint& ck, int l, const LayerInputData& in,
                                          const std::vector<int32_t>& ids, const std::vector<float>& w) {
  std::vector<double> y = reference_layer(ck.layers[size_t(l)], in.x.data(), in.tokens, ids.data(), w.data(), ck.c.k);
  const std::vector<int32_t> one(size_t(in.tokens), 0);
  const std::vector<float> unit(size_t(in.tokens), 1.0f);
  const std::vector<double> s = reference_layer(ck.shared[size_t(l)], in.x.data(), in.tokens, one.data(), unit.data(), 1);
  for (size_t i = 0; i < y.size(); ++i) y[i] += double(round_bf16(float(s[i])));
  return y;
}

}  // namespace moekit::test
