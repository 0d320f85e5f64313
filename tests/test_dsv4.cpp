// DeepSeek-V4 on the CPU backends: its router (sqrtsoftplus with the selection-only expert bias;
// hash routing by token id) against the float64 goldens of tests/golden/dsv4_router (NumPy after
// DeepSeek's Gate, never moekit), through route_cpu and the public API; a hash layer's errors;
// checkpoints in the published layout (DeepSeek's names with MXFP4 experts as published, FP8
// Flash-Base experts, transformers' names, V4.1's text_config, an int32 table) read back exactly
// and run with their shared expert against the float64 reference (experts/reference.h on the
// weights they were written from); bad checkpoints; the independent golden checkpoint of
// tests/golden/dsv4_checkpoint (NumPy float64); `moekit run / convert / backends` on them.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "dsv4_testutil.h"
#include "hf_testutil.h"
#include "moe_testutil.h"
#include "moekit/api/host_runner.h"
#include "moekit/common/error.h"
#include "moekit/model/convert.h"
#include "moekit/model/hf_config.h"
#include "moekit/moekit.hpp"
#include "st_edit.h"
#include "testutil.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;
using test::Dsv4Case;
using test::RouterGolden;

// ---- the router against the goldens ----------------------------------------------------------

RoutingParams golden_params(const RouterGolden& g) {
  RoutingParams p;
  p.scoring = Scoring::kSqrtSoftplus;
  p.num_experts = g.E;
  p.top_k = g.k;
  p.renormalize = true;
  p.routed_scaling_factor = g.rsf;
  p.score_bias = g.hash ? nullptr : g.bias.data();
  p.hash_table = g.hash ? g.table.data() : nullptr;
  p.hash_vocab = g.hash ? g.V : 0;
  return p;
}

TEST(Dsv4Router, GoldensThroughRouteCpu) {
  const std::vector<std::string> names = test::router_golden_names();
  ASSERT_GE(names.size(), 7u);
  for (const std::string& n : names) {
    SCOPED_TRACE(n);
    const RouterGolden g = test::load_router_golden(n);
    std::vector<int32_t> ids(size_t(g.T * g.k), -7);
    std::vector<float> w(ids.size(), NAN);
    route_cpu(golden_params(g), g.logits.data(), g.T, ids.data(), w.data(), TokenIds{g.input_ids.data(), true});
    test::expect_golden_routing(g, ids, w);
    if (g.hash) {  // int32 token ids: the same
      const std::vector<int32_t> ids32(g.input_ids.begin(), g.input_ids.end());
      std::vector<int32_t> ids2(ids.size(), -7);
      std::vector<float> w2(ids.size(), NAN);
      route_cpu(golden_params(g), g.logits.data(), g.T, ids2.data(), w2.data(), TokenIds{ids32.data(), false});
      EXPECT_EQ(ids2, ids);
      EXPECT_EQ(w2, w);
    }
  }
}

// The golden's router in a whole layer through the public API (both CPU backends): routing
// outputs against the golden, the table given as the golden stores it (int64 or int32), y against
// the float64 reference on the layer's own routing, and the layer's bits the same for int32 and
// int64 token ids.
TEST(Dsv4Router, GoldensThroughThePublicApi) {
  for (const std::string& n : test::router_golden_names()) {
    const RouterGolden g = test::load_router_golden(n);
    LayerSpec spec = g.spec(g.T);
    SyntheticOptions so;
    so.seed = 11;
    so.score_bias = !g.hash;
    MoeModel m = make_synthetic_model(spec, so);
    if (g.hash) m.hash_table = g.table;
    else m.score_bias = g.bias;
    const HostCheckpoint hc(m);
    std::vector<NamedTensor> ck = hc.tensors;
    std::vector<int64_t> table_shape = {g.V, g.k};
    for (NamedTensor& t : ck)
      if (t.name == "tid2eid") {  // as the golden stores it
        t.tensor.data = const_cast<uint8_t*>(g.table_bytes.data());
        t.tensor.dtype = g.table_i64 ? kI64 : kI32;
        t.tensor.shape = table_shape.data();
      }
    const LayerInputData in = make_synthetic_input(spec, g.T, 5);
    for (const char* backend : {"cpu", "cpu_batched"}) {
      SCOPED_TRACE(n + " " + backend);
      OwnedLayer L;
      const Status st = make_layer(spec, {{kDLCPU, 0}, backend}, ck, &L);
      ASSERT_TRUE(st.ok()) << st.message;
      const int64_t T = g.T, H = spec.hidden, k = g.k;
      std::vector<uint16_t> y(size_t(T * H), 0x7fc0);
      std::vector<int32_t> ids(size_t(T * k), -7);
      std::vector<float> w(ids.size(), NAN);
      std::vector<uint8_t> ws(size_t(L.layer->workspace_bytes(T)));
      const TensorRef x(const_cast<uint16_t*>(in.x.data()), kBF16, {T, H}), out(y.data(), kBF16, {T, H});
      const TensorRef lg(const_cast<float*>(g.logits.data()), kF32, {T, g.E});
      const TensorRef ti(ids.data(), kI32, {T, k}), tw(w.data(), kF32, {T, k}), wsr(ws.data(), kU8, {int64_t(ws.size())});
      const TensorRef tok(const_cast<int64_t*>(g.input_ids.data()), kI64, {T});
      const Status f = L.layer->forward_logits(x, lg, out, wsr, nullptr, nullptr, &ti.dl(), &tw.dl(),
                                               g.hash ? &tok.dl() : nullptr);
      ASSERT_TRUE(f.ok()) << f.message;
      test::expect_golden_routing(g, ids, w);
      const std::vector<double> ref = reference_layer(m, in.x.data(), T, ids.data(), w.data(), int(k));
      EXPECT_LE(rel_l2(test::bf16_to_floats(y), ref), 1e-2);
      if (g.hash) {
        const std::vector<int32_t> t32(g.input_ids.begin(), g.input_ids.end());
        const TensorRef tok32(const_cast<int32_t*>(t32.data()), kI32, {T});
        std::vector<uint16_t> y32(y.size(), 0x7fc0);
        const TensorRef out32(y32.data(), kBF16, {T, H});
        ASSERT_TRUE(L.layer->forward_logits(x, lg, out32, wsr, nullptr, nullptr, nullptr, nullptr, &tok32.dl()).ok());
        EXPECT_EQ(y32, y);
      }
    }
  }
}

TEST(Dsv4Router, SpecChecks) {
  LayerSpec s;
  s.num_experts = 16;
  s.top_k = 4;
  s.hidden = 64;
  s.intermediate = 64;
  s.scoring = Scoring::kSqrtSoftplus;
  EXPECT_TRUE(check_spec(s).ok());
  auto refused = [](LayerSpec x, const std::string& needle) {
    const Status st = check_spec(x);
    EXPECT_FALSE(st.ok()) << needle;
    EXPECT_NE(st.message.find(needle), std::string::npos) << st.message;
  };
  LayerSpec g = s;
  g.n_group = 4;
  g.topk_group = 2;
  refused(g, "sqrtsoftplus routing chooses over all experts");
  LayerSpec h = s;
  h.hash_vocab = 100;
  EXPECT_TRUE(check_spec(h).ok());
  h.score_bias = true;
  refused(h, "no expert bias");
  h.score_bias = false;
  h.scoring = Scoring::kSigmoid;
  h.n_group = 4;
  refused(h, "takes its experts from its table (n_group must be 1)");
  h = s;
  h.hash_vocab = -1;
  refused(h, "hash_vocab = -1");
  // Softmax and sigmoid weights work with a table too (DeepSeek's Gate takes any score function).
  h = s;
  h.hash_vocab = 10;
  h.scoring = Scoring::kSoftmax;
  EXPECT_TRUE(check_spec(h).ok());
}

// Hash routing with the other score functions: the weights are those experts' scores (softmax:
// over the whole row), renormalized when asked.
TEST(Dsv4Router, HashRoutingWithSoftmaxAndSigmoidScores) {
  const int E = 8, k = 3;
  const std::vector<int32_t> table = {0, 1, 2, 7, 6, 5, 3, 0, 4};  // 3 rows
  const std::vector<float> logits = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f, -2.0f, 3.0f, 0.25f};
  const std::vector<int64_t> tok = {1};
  for (Scoring sc : {Scoring::kSoftmax, Scoring::kSigmoid})
    for (bool renorm : {false, true}) {
      RoutingParams p;
      p.scoring = sc;
      p.num_experts = E;
      p.top_k = k;
      p.renormalize = renorm;
      p.routed_scaling_factor = 2.0f;
      p.hash_table = table.data();
      p.hash_vocab = 3;
      std::vector<int32_t> ids(k);
      std::vector<float> w(k);
      route_cpu(p, logits.data(), 1, ids.data(), w.data(), TokenIds{tok.data(), true});
      EXPECT_EQ(ids, (std::vector<int32_t>{7, 6, 5}));
      std::vector<double> s(E);
      double z = 0;
      for (int e = 0; e < E; ++e) z += std::exp(double(logits[size_t(e)]) - 3.0);
      for (int e = 0; e < E; ++e)
        s[size_t(e)] = sc == Scoring::kSoftmax ? std::exp(double(logits[size_t(e)]) - 3.0) / z
                                               : 1.0 / (1.0 + std::exp(-double(logits[size_t(e)])));
      const double sum = s[7] + s[6] + s[5];
      for (int j = 0; j < k; ++j) {
        const double want = s[size_t(ids[size_t(j)])] / (renorm ? sum : 1.0) * 2.0;
        EXPECT_NEAR(w[size_t(j)], want, 1e-6 * want) << scoring_name(sc) << " renorm " << renorm;
      }
    }
}

// ---- a hash-routed layer through the public API: clean errors, nothing written -----------------

struct HashLayer {
  LayerSpec spec;
  MoeModel m;
  std::unique_ptr<HostCheckpoint> ck;
  HashLayer() {
    spec = test::v4_layer_spec(16, 4, 64, 64, WeightFormat::kMxfp4, 1.5f, 50);
    spec.max_tokens = 8;
    SyntheticOptions so;
    so.seed = 3;
    m = make_synthetic_model(spec, so);
    ck = std::make_unique<HostCheckpoint>(m);
  }
};

std::string pack_error(const LayerSpec& spec, const std::vector<NamedTensor>& ck) {
  OwnedLayer L;
  const Status st = make_layer(spec, {{kDLCPU, 0}, "cpu"}, ck, &L);
  return st.ok() ? "" : st.message;
}

TEST(Dsv4Layer, HashTableErrorsAtPackTime) {
  HashLayer h;
  EXPECT_EQ(pack_error(h.spec, h.ck->tensors), "");
  // An entry out of range, and an expert twice in a row: refused, naming the row.
  for (const auto& [bad, needle] : std::vector<std::pair<std::function<void(std::vector<int32_t>&)>, std::string>>{
           {[](std::vector<int32_t>& t) { t[5 * 4 + 2] = 16; }, "tid2eid row 5 (token id 5), slot 2: expert 16 is out of range [0, 16)"},
           {[](std::vector<int32_t>& t) { t[7 * 4 + 1] = -1; }, "tid2eid row 7 (token id 7), slot 1: expert -1"},
           {[](std::vector<int32_t>& t) { t[9 * 4 + 3] = t[9 * 4 + 0]; }, "tid2eid row 9 (token id 9) lists expert"},
       }) {
    std::vector<int32_t> t = h.m.hash_table;
    bad(t);
    std::vector<NamedTensor> ck = h.ck->tensors;
    for (NamedTensor& n : ck)
      if (n.name == "tid2eid") n.tensor.data = t.data();
    const std::string msg = pack_error(h.spec, ck);
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  }
  // No table; a table for a layer that routes by score; a table of the wrong shape.
  std::vector<NamedTensor> none;
  for (const NamedTensor& n : h.ck->tensors)
    if (n.name != "tid2eid") none.push_back(n);
  EXPECT_NE(pack_error(h.spec, none).find("missing tensor tid2eid"), std::string::npos) << pack_error(h.spec, none);
  LayerSpec score = h.spec;
  score.hash_vocab = 0;
  EXPECT_NE(pack_error(score, h.ck->tensors).find("unknown tensor tid2eid"), std::string::npos);
  std::vector<NamedTensor> wrong = h.ck->tensors;
  std::vector<int64_t> shape = {25, 8};
  for (NamedTensor& n : wrong)
    if (n.name == "tid2eid") n.tensor.shape = shape.data();
  EXPECT_NE(pack_error(h.spec, wrong).find("shape [25, 8], expected [50, 4]"), std::string::npos)
      << pack_error(h.spec, wrong);
}

TEST(Dsv4Layer, TokenIdErrorsWriteNothing) {
  HashLayer h;
  OwnedLayer L;
  ASSERT_TRUE(make_layer(h.spec, {{kDLCPU, 0}, "cpu"}, h.ck->tensors, &L).ok());
  const int64_t T = 5, H = 64, E = 16;
  const LayerInputData in = make_synthetic_input(h.spec, T, 9);
  std::vector<uint16_t> y(size_t(T * H), 0x7fc0);
  std::vector<uint8_t> ws(size_t(L.layer->workspace_bytes(T)));
  const TensorRef x(const_cast<uint16_t*>(in.x.data()), kBF16, {T, H}), out(y.data(), kBF16, {T, H});
  const TensorRef lg(const_cast<float*>(in.logits.data()), kF32, {T, E}), wsr(ws.data(), kU8, {int64_t(ws.size())});
  auto call = [&](const DLTensor* tok) {
    return L.layer->forward_logits(x, lg, out, wsr, nullptr, nullptr, nullptr, nullptr, tok);
  };
  auto refused = [&](const DLTensor* tok, const std::string& needle) {
    const Status st = call(tok);
    EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(st.message.find(needle), std::string::npos) << st.message;
    for (uint16_t v : y) ASSERT_EQ(v, 0x7fc0) << "written despite the error: " << needle;
  };
  refused(nullptr, "token_ids: required: the layer is hash-routed");
  std::vector<int64_t> ids = {0, 1, 50, 2, 3};
  refused(&TensorRef(ids.data(), kI64, {T}).dl(), "token_ids: token 2 has id 50, outside the hash table's 50 rows");
  ids[2] = -1;
  refused(&TensorRef(ids.data(), kI64, {T}).dl(), "token 2 has id -1");
  std::vector<float> f(static_cast<size_t>(T), 0.0f);
  refused(&TensorRef(f.data(), kF32, {T}).dl(), "token_ids: dtype float32, expected int32 or int64");
  std::vector<int32_t> i32(size_t(T + 1), 1);
  refused(&TensorRef(i32.data(), kI32, {T + 1}).dl(), "token_ids: shape [6], expected [5]");
  std::vector<int32_t> good = {0, 1, 2, 49, 3};
  EXPECT_TRUE(call(&TensorRef(good.data(), kI32, {T}).dl()).ok());
  // A layer that routes by score refuses token ids.
  LayerSpec score = h.spec;
  score.hash_vocab = 0;
  LayerWeights sm = h.m;
  sm.cfg.hash_vocab = 0;
  sm.hash_table.clear();
  const HostCheckpoint sck(sm);
  OwnedLayer S;
  ASSERT_TRUE(make_layer(score, {{kDLCPU, 0}, "cpu"}, sck.tensors, &S).ok());
  const Status st = S.layer->forward_logits(x, lg, out, wsr, nullptr, nullptr, nullptr, nullptr,
                                            &TensorRef(good.data(), kI32, {T}).dl());
  EXPECT_NE(st.message.find("token_ids: given, but the layer routes by score"), std::string::npos) << st.message;
}

// A hash layer's rows go to tid2eid[token id], in the table's order, whatever the logits.
TEST(Dsv4Layer, HashRowsFollowTheTable) {
  HashLayer h;
  for (const char* backend : {"cpu", "cpu_batched"}) {
    const LayerInputData in = make_synthetic_input(h.spec, 8, 21);
    LayerOutput out;
    HostRunner(h.m, backend).run(in.view(), &out);
    for (int64_t t = 0; t < 8; ++t)
      for (int j = 0; j < 4; ++j)
        EXPECT_EQ(out.ids[size_t(t * 4 + j)], h.m.hash_table[size_t(in.token_ids[size_t(t)] * 4 + j)]) << backend;
    const std::vector<double> ref = reference_layer(h.m, in.x.data(), 8, out.ids.data(), out.weights.data(), 4);
    EXPECT_LE(rel_l2(test::bf16_to_floats(out.y), ref), 1e-2) << backend;
  }
}

// ---- checkpoints in the published layout --------------------------------------------------------

// The loaded shared expert holds the values it was written from (FP8 with power-of-two scales ->
// BF16 exactly; BF16 as is).
void expect_same_values(const LayerWeights& got, const LayerWeights& want) {
  ASSERT_EQ(got.cfg.num_experts, 1);
  ASSERT_EQ(got.cfg.intermediate, want.cfg.intermediate);
  for (const auto& [a, b] : {std::pair{&got.w13, &want.w13}, std::pair{&got.w2, &want.w2}}) {
    ASSERT_EQ(a->N, b->N);
    ASSERT_EQ(a->K, b->K);
    std::vector<float> x(size_t(a->K)), y(size_t(b->K));
    int64_t bad = 0;
    for (int64_t r = 0; r < a->N; ++r) {
      a->dequant_row(0, r, x.data());
      b->dequant_row(0, r, y.data());
      bad += x != y;
    }
    EXPECT_EQ(bad, 0) << "shared-expert rows that differ";
  }
}

class Dsv4Checkpoints : public ::testing::TestWithParam<Dsv4Case> {};

TEST_P(Dsv4Checkpoints, EveryLayerReadsBackExactlyAndRunsWithItsSharedExpert) {
  const Dsv4Case c = GetParam();
  const auto ck = test::build_dsv4_checkpoint(c);
  const HfModelConfig hc = load_hf_config(ck->path());
  EXPECT_EQ(hc.arch, HfArch::kDeepseekV4);
  EXPECT_EQ(hc.num_layers, c.num_layers);
  EXPECT_EQ(int(hc.hash_layers.size()), c.num_hash_layers);
  EXPECT_EQ(hc.spec.scoring, Scoring::kSqrtSoftplus);
  EXPECT_EQ(hc.spec.act, Activation::kSiluClamped);
  EXPECT_EQ(hc.spec.swiglu_limit, 10.0f);
  EXPECT_EQ(hc.spec.format, c.format);
  EXPECT_EQ(hc.spec.routed_scaling_factor, 1.5f);
  for (int l = 0; l < c.num_layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const bool hash = l < c.num_hash_layers;
    const MoeModel m = MoeModel::load(ck->path(), l);
    EXPECT_EQ(m.cfg.hash_vocab, hash ? c.vocab : 0);
    EXPECT_EQ(m.cfg.score_bias, !hash);
    test::expect_same_weights(m, ck->layers[size_t(l)]);
    EXPECT_EQ(m.hash_table, ck->layers[size_t(l)].hash_table);
    EXPECT_EQ(m.router.weight, ck->routers[size_t(l)].weight);
    ASSERT_TRUE(m.has_shared_expert());
    expect_same_values(m.shared_expert, ck->shared[size_t(l)]);
    const LayerInputData in = test::dsv4_input(m, 13, 40 + uint64_t(l));
    for (const char* backend : {"cpu", "cpu_batched"}) {
      SCOPED_TRACE(backend);
      const LayerOutput out = test::run_with_shared(m, in, backend);
      if (hash) {
        for (int64_t t = 0; t < in.tokens; ++t)
          for (int j = 0; j < c.k; ++j)
            ASSERT_EQ(out.ids[size_t(t * c.k + j)], m.hash_table[size_t(in.token_ids[size_t(t)] * c.k + j)]);
      }
      const std::vector<double> ref = test::dsv4_reference(*ck, l, in, out.ids, out.weights);
      const double err = rel_l2(test::bf16_to_floats(out.y), ref);
      RecordProperty("rel_l2_layer" + std::to_string(l), test::fmt_e(err));
      EXPECT_LE(err, 1e-2);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dsv4, Dsv4Checkpoints, ::testing::ValuesIn(test::dsv4_cases()),
                         [](const ::testing::TestParamInfo<Dsv4Case>& i) { return std::string(i.param.name); });

// config.json without a hash-layer field: each layer's gate decides (a table: a hash layer).
TEST(Dsv4Checkpoint, HashLayersFromTheTensorsWhenConfigIsSilent) {
  const auto ck = test::build_dsv4_checkpoint(test::dsv4_cases()[0]);
  test::edit_config(ck->path(), [](nlohmann::json& j) { j.erase("num_hash_layers"); });
  const HfModelConfig hc = load_hf_config(ck->path());
  EXPECT_TRUE(hc.hash_from_checkpoint);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(MoeModel::load(ck->path(), l).cfg.hash_vocab > 0, l < 2) << l;
}

// The checkpoint of tests/golden/dsv4_checkpoint (NumPy float64, DeepSeek's layout and
// conventions, never moekit): each layer from hidden_states and input_ids, with its shared
// expert, on both CPU backends and through `moekit run`, against its float64 expected outputs.
TEST(Dsv4Checkpoint, IndependentGoldenCheckpoint) {
  const std::string dir = test::golden("dsv4_checkpoint/ckpt"), input = test::golden("dsv4_checkpoint/input.safetensors");
  test::TempDir tmp;
  for (int l = 0; l < 2; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const MoeModel m = MoeModel::load(dir, l);
    EXPECT_EQ(m.cfg.hash_vocab, l == 0 ? 48 : 0);
    ASSERT_TRUE(m.has_shared_expert());
    const SafetensorsFile exp = SafetensorsFile::open(test::golden("dsv4_checkpoint/expected_layer" + std::to_string(l) + ".safetensors"));
    const std::vector<float> y_ref = test::tensor_as<float>(exp, "y_ref", DType::kF32, {9, 64});
    const std::vector<int32_t> ids_ref = test::tensor_as<int32_t>(exp, "topk_ids", DType::kI32, {9, 3});
    const std::vector<float> w_ref = test::tensor_as<float>(exp, "topk_weights", DType::kF32, {9, 3});
    const LayerInputData in = load_layer_input(input, m.cfg, &m.router);
    LayerOutput lib;
    for (const char* backend : {"cpu", "cpu_batched"}) {
      SCOPED_TRACE(backend);
      const LayerOutput out = test::run_with_shared(m, in, backend);
      for (int64_t t = 0; t < 9; ++t) {
        std::set<int32_t> a(out.ids.begin() + t * 3, out.ids.begin() + t * 3 + 3),
            b(ids_ref.begin() + t * 3, ids_ref.begin() + t * 3 + 3);
        EXPECT_EQ(a, b) << "token " << t;
        if (l == 0) {
          for (int j = 0; j < 3; ++j) EXPECT_EQ(out.ids[size_t(t * 3 + j)], ids_ref[size_t(t * 3 + j)]);
        }
      }
      for (size_t i = 0; i < out.weights.size(); ++i)
        for (size_t q = i / 3 * 3; q < i / 3 * 3 + 3; ++q)
          if (ids_ref[q] == out.ids[i]) {
            EXPECT_NEAR(out.weights[i], w_ref[q], 2e-6 * std::fabs(w_ref[q]));
          }
      const double err = test::rel_l2_err(test::bf16_to_floats(out.y), y_ref);
      RecordProperty(std::string("rel_l2_layer") + std::to_string(l) + "_" + backend, test::fmt_e(err));
      EXPECT_LE(err, 5e-3);
      lib = out;
    }
    // The CLI: the same bits as the library (the shared expert added).
    const std::string y = tmp / ("y" + std::to_string(l) + ".safetensors");
    const test::RunResult r = test::run_cli("run --model " + dir + " --layer " + std::to_string(l) + " --input " + input +
                                            " --output " + y + " --backend cpu");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("deepseek_v4 layer " + std::to_string(l)), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("shared expert"), std::string::npos) << r.out;
    if (l == 0) {
      EXPECT_NE(r.out.find("hash-routed"), std::string::npos) << r.out;
    }
    const SafetensorsFile f = SafetensorsFile::open(y);
    EXPECT_EQ(test::tensor_as<uint16_t>(f, "y", DType::kBF16, {9, 64}), lib.y);
    EXPECT_EQ(test::tensor_as<int32_t>(f, "topk_ids", DType::kI32, {9, 3}), lib.ids);
  }
}

// ---- bad checkpoints and inputs: one line naming the file and tensor ----------------------------

struct BadDsv4 {
  const char* name;
  int layer;
  std::vector<std::string> needles;
  std::function<void(const std::string& dir)> damage;
};

// The shard the index gives a tensor.
std::string shard_of(const std::string& dir, const std::string& tensor) {
  std::ifstream in(dir + "/model.safetensors.index.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return dir + "/" + nlohmann::json::parse(ss.str())["weight_map"][tensor].get<std::string>();
}
void edit_tensor(const std::string& dir, const std::string& name, const std::function<void(test::Tensor&)>& fn) {
  test::edit(shard_of(dir, name), [&](std::vector<test::Tensor>& v) { fn(test::tensor(v, name)); });
}

std::vector<BadDsv4> bad_dsv4() {
  const std::string G0 = "layers.0.ffn.gate.", G2 = "layers.2.ffn.gate.";
  return {
      {"missing_table_on_a_hash_layer", 0, {"no tensor " + G0 + "tid2eid", "layer 0 is hash-routed", "num_hash_layers = 2"},
       [G0](const std::string& d) {
         test::edit(shard_of(d, G0 + "tid2eid"), [&](std::vector<test::Tensor>& v) { test::drop(v, G0 + "tid2eid"); });
         std::ifstream in(d + "/model.safetensors.index.json");  // and out of the index
         std::stringstream ss;
         ss << in.rdbuf();
         nlohmann::json j = nlohmann::json::parse(ss.str());
         j["weight_map"].erase(G0 + "tid2eid");
         std::ofstream(d + "/model.safetensors.index.json") << j.dump(1);
       }},
      {"table_of_the_wrong_shape", 0, {"tensor " + G0 + "tid2eid: shape [96, 3], expected [96, 4]", "vocab_size = 96"},
       [G0](const std::string& d) {
         edit_tensor(d, G0 + "tid2eid", [](test::Tensor& t) {
           t.shape = {96, 3};
           t.bytes.resize(96 * 3 * 8);
         });
       }},
      {"bias_on_a_hash_layer", 1, {"tensor layers.1.ffn.gate.bias", "layer 1 is hash-routed", "no expert bias"},
       [](const std::string& d) {
         const std::string shard = shard_of(d, "layers.1.ffn.gate.weight");
         test::edit(shard, [](std::vector<test::Tensor>& v) {
           v.push_back({"layers.1.ffn.gate.bias", DType::kF32, {16}, std::vector<uint8_t>(64, 0)});
         });
         std::ifstream in(d + "/model.safetensors.index.json");
         std::stringstream ss;
         ss << in.rdbuf();
         nlohmann::json j = nlohmann::json::parse(ss.str());
         j["weight_map"]["layers.1.ffn.gate.bias"] = fs::path(shard).filename().string();
         std::ofstream(d + "/model.safetensors.index.json") << j.dump(1);
       }},
      {"table_entry_out_of_range", 0, {"tensor " + G0 + "tid2eid", "tid2eid row 7 (token id 7), slot 1: expert 16 is out of range [0, 16)"},
       [G0](const std::string& d) {
         edit_tensor(d, G0 + "tid2eid", [](test::Tensor& t) {
           const int64_t v = 16;
           std::memcpy(t.bytes.data() + (7 * 4 + 1) * 8, &v, 8);
         });
       }},
      {"table_row_repeats_an_expert", 1, {"tid2eid row 3 (token id 3) lists expert"},
       [](const std::string& d) {
         edit_tensor(d, "layers.1.ffn.gate.tid2eid", [](test::Tensor& t) {
           std::memcpy(t.bytes.data() + (3 * 4 + 2) * 8, t.bytes.data() + (3 * 4 + 0) * 8, 8);
         });
       }},
      {"table_on_a_learned_layer", 2, {"tensor " + G2 + "tid2eid", "layer 2 routes by score", "num_hash_layers = 2"},
       [G2](const std::string& d) {
         const std::string shard = shard_of(d, G2 + "weight");
         test::edit(shard, [&](std::vector<test::Tensor>& v) {
           v.push_back({G2 + "tid2eid", DType::kI64, {96, 4}, std::vector<uint8_t>(96 * 4 * 8, 0)});
         });
         std::ifstream in(d + "/model.safetensors.index.json");
         std::stringstream ss;
         ss << in.rdbuf();
         nlohmann::json j = nlohmann::json::parse(ss.str());
         j["weight_map"][G2 + "tid2eid"] = fs::path(shard).filename().string();
         std::ofstream(d + "/model.safetensors.index.json") << j.dump(1);
       }},
      {"fp4_weight_of_the_wrong_shape", 2, {"tensor layers.2.ffn.experts.3.w1.weight: shape [128, 64], expected [128, 128]"},
       [](const std::string& d) {
         edit_tensor(d, "layers.2.ffn.experts.3.w1.weight", [](test::Tensor& t) {
           t.shape = {128, 64};
           t.bytes.resize(128 * 64);
         });
       }},
      {"nan_scale", 2, {"layers.2.ffn.experts.5.w2.scale"},
       [](const std::string& d) { edit_tensor(d, "layers.2.ffn.experts.5.w2.scale", [](test::Tensor& t) { t.bytes[3] = 0xff; }); }},
      {"shared_scale_of_the_wrong_shape", 2, {"tensor layers.2.ffn.shared_experts.w2.scale: shape [3, 1], expected [2, 1]"},
       [](const std::string& d) {
         edit_tensor(d, "layers.2.ffn.shared_experts.w2.scale", [](test::Tensor& t) {
           t.shape = {3, 1};
           t.bytes.resize(3);
         });
       }},
      {"missing_vocab_size", 0, {"config.json: missing field vocab_size"},
       [](const std::string& d) { test::edit_config(d, [](nlohmann::json& j) { j.erase("vocab_size"); }); }},
      {"unknown_expert_dtype", 0, {"config.json: expert_dtype 'fp6' is not supported"},
       [](const std::string& d) { test::edit_config(d, [](nlohmann::json& j) { j["expert_dtype"] = "fp6"; }); }},
  };
}

TEST(Dsv4Checkpoint, BadCheckpointsAreOneLineErrors) {
  for (const BadDsv4& b : bad_dsv4()) {
    SCOPED_TRACE(b.name);
    const auto ck = test::build_dsv4_checkpoint(test::dsv4_cases()[0], 3);
    b.damage(ck->path());
    std::string msg;
    try {
      MoeModel::load(ck->path(), b.layer);
    } catch (const Error& e) {
      msg = e.what();
    }
    ASSERT_FALSE(msg.empty()) << "loaded";
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const std::string& n : b.needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
    // The CLI: exit 1, the one line, no output file.
    const std::string x = ck->dir / "x.safetensors", y = ck->dir / "y.safetensors";
    const test::RunResult r = test::run_cli("run --model " + ck->path() + " --layer " + std::to_string(b.layer) +
                                            " --input " + x + " --output " + y);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_FALSE(fs::exists(y));
  }
}

TEST(Dsv4Checkpoint, InputFilesOfAHashLayer) {
  const auto ck = test::build_dsv4_checkpoint(test::dsv4_cases()[0], 4);
  const MoeModel m = MoeModel::load(ck->path(), 0);
  const LayerInputData in = test::dsv4_input(m, 6, 2);
  auto write = [&](const std::string& path, const std::function<void(SafetensorsWriter&)>& ids) {
    SafetensorsWriter w;
    w.add("hidden_states", DType::kBF16, {6, int64_t(m.cfg.hidden)}, in.x);
    ids(w);
    w.write(path);
    return path;
  };
  auto error_of = [&](const std::string& path) {
    try {
      load_layer_input(path, m.cfg, &m.router);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string none = write(ck->dir / "none.safetensors", [](SafetensorsWriter&) {});
  EXPECT_NE(error_of(none).find("none.safetensors: missing tensor input_ids (I32 or I64 [6])"), std::string::npos)
      << error_of(none);
  const std::string f32 = write(ck->dir / "f32.safetensors", [](SafetensorsWriter& w) {
    w.add("input_ids", DType::kF32, {6}, std::vector<float>(6, 1.0f));
  });
  EXPECT_NE(error_of(f32).find("tensor input_ids: dtype F32, expected I32 or I64"), std::string::npos) << error_of(f32);
  const std::string shape = write(ck->dir / "shape.safetensors", [](SafetensorsWriter& w) {
    w.add("input_ids", DType::kI32, {5}, std::vector<int32_t>(5, 1));
  });
  EXPECT_NE(error_of(shape).find("tensor input_ids: shape [5], expected [6]"), std::string::npos) << error_of(shape);
  const std::string out = write(ck->dir / "out.safetensors", [](SafetensorsWriter& w) {
    w.add("input_ids", DType::kI64, {6}, std::vector<int64_t>{0, 1, 2, 96, 4, 5});
  });
  EXPECT_NE(error_of(out).find("out.safetensors: tensor input_ids: token 3 has id 96, outside the hash table's 96 rows"),
            std::string::npos)
      << error_of(out);
  // I32 and I64 ids: the same layer output.
  const std::string i32 = write(ck->dir / "i32.safetensors", [&](SafetensorsWriter& w) {
    w.add("input_ids", DType::kI32, {6}, std::vector<int32_t>(in.token_ids.begin(), in.token_ids.end()));
  });
  const std::string i64 = write(ck->dir / "i64.safetensors", [&](SafetensorsWriter& w) {
    w.add("input_ids", DType::kI64, {6}, in.token_ids);
  });
  const std::string y32 = ck->dir / "y32.safetensors", y64 = ck->dir / "y64.safetensors";
  ASSERT_EQ(test::run_cli("run --model " + ck->path() + " --layer 0 --input " + i32 + " --output " + y32).code, 0);
  ASSERT_EQ(test::run_cli("run --model " + ck->path() + " --layer 0 --input " + i64 + " --output " + y64).code, 0);
  EXPECT_EQ(test::read_all(y32)[0].bytes, test::read_all(y64)[0].bytes);
}

// `moekit convert` writes a hash layer's table and its shared expert, and the layer directory runs
// as the checkpoint's layer did; `moekit backends` explains a DeepSeek-V4 layer.
TEST(Dsv4Checkpoint, ConvertAndBackendsKnowIt) {
  const auto ck = test::build_dsv4_checkpoint(test::dsv4_cases()[0], 5);
  const std::string out = ck->dir / "conv";
  test::RunResult r = test::run_cli("convert --model " + ck->path() + " --layer 0 --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(out + "/shared_expert/config.json"));
  const MoeModel a = MoeModel::load(ck->path(), 0), b = MoeModel::load(out);
  EXPECT_EQ(b.cfg.hash_vocab, 96);
  EXPECT_EQ(b.hash_table, a.hash_table);
  ASSERT_TRUE(b.has_shared_expert());
  expect_same_values(b.shared_expert, a.shared_expert);
  const LayerInputData in = test::dsv4_input(a, 7, 3);
  write_layer_input(ck->dir / "x.safetensors", in, a.cfg.hidden, a.cfg.num_experts);
  const std::string ya = ck->dir / "ya.safetensors", yb = ck->dir / "yb.safetensors";
  ASSERT_EQ(test::run_cli("run --model " + ck->path() + " --layer 0 --input " + (ck->dir / "x.safetensors") +
                          " --output " + ya + " --backend cpu").code, 0);
  r = test::run_cli("run --model " + out + " --input " + (ck->dir / "x.safetensors") + " --output " + yb + " --backend cpu");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(test::read_all(ya)[0].bytes, test::read_all(yb)[0].bytes) << "y";
  // To BF16: the error printed, the table and the shared expert kept.
  r = test::run_cli("convert --model " + ck->path() + " --layer 2 --to bf16 --out " + (ck->dir / "bf16"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("mxfp4 -> bf16"), std::string::npos) << r.out;
  EXPECT_TRUE(MoeModel::load(ck->dir / "bf16").has_shared_expert());
  r = test::run_cli("backends --model " + ck->path() + " --layer 1 --tokens 4");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("deepseek_v4 layer 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hash-routed"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace moekit
