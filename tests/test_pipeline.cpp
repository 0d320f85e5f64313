// The CPU MoE layer on synthetic models: every weight format x activation, with and without
// biases, against the double-precision reference_layer (rel. L2 <= 1e-2), with `cpu_batched`
// held to the bits of `cpu`; then awkward sizes and routings (T = 0, 1, 3, 118; one expert for
// every token; experts without tokens; -1 ids; H and I multiples of 32 but not of 64), and the
// two activation layouts of the modular pipeline on their own.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "moe_testutil.h"
#include "moekit/api/host_runner.h"
#include "moekit/backends/cpu_backend.h"
#include "moekit/common/error.h"
#include "moekit/experts/experts_cpu.h"
#include "moekit/experts/reference.h"
#include "moekit/model/synthetic.h"
#include "moekit/oracle/layer_checks.h"
#include "moekit/oracle/oracle.h"
#include "moekit/pipeline/modular.h"
#include "moekit/routing/routing.h"
#include "testutil.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;

constexpr uint16_t kPoison = 0x7fc0;  // bf16 NaN

MoeConfig make_config(WeightFormat f, Activation a, int E, int k, int H, int I) {
  MoeConfig c;
  c.num_experts = E;
  c.top_k = k;
  c.hidden = H;
  c.intermediate = I;
  c.act = a;
  c.format = f;
  c.norm_topk_prob = true;
  // A small limit, so that the clamps of swiglu_oai / silu_clamped change the result (the
  // synthetic bf16 weights are smaller than the block-format ones).
  c.swiglu_limit = f == WeightFormat::kBf16 ? 0.15f : 0.5f;
  // Not the defaults, so that a backend that ignores the config's values shows.
  c.swiglu_alpha = 1.25f;
  c.swiglu_beta = 0.5f;
  return c;
}

LayerOutput run_backend(const Backend& b, const MoeModel& m, const LayerInput& in) {
  auto runner = std::make_unique<HostRunner>(m, b.caps().name);
  LayerOutput out;
  out.y.assign(7, kPoison);  // wrong size and NaN: the runner must replace all of it
  out.ids.assign(3, 99);
  out.weights.assign(3, NAN);
  runner->run(in, &out);
  return out;
}

struct Checked {
  LayerOutput out;         // the cpu backend's
  std::vector<double> ref; // reference_layer on its ids/weights
  double err = 0;
  double err_rounded = 0;  // against the reference rounded to bf16
};

// Runs `in` on cpu and cpu_batched; checks shapes, bit-identity of the two, the routing against
// route_cpu, and y against reference_layer. Tokens whose ids are all -1 must give y == 0.
Checked check_layer(const MoeModel& m, const LayerInputData& in, double tol = 1e-2) {
  Checked c;
  const int64_t T = in.tokens, H = m.cfg.hidden;
  const int k = in.ids.empty() ? m.cfg.top_k : in.k;
  const LayerOutput a = run_backend(cpu_backend(), m, in.view());
  const LayerOutput b = run_backend(cpu_batched_backend(), m, in.view());
  EXPECT_EQ(a.y.size(), size_t(T * H));
  EXPECT_EQ(a.ids.size(), size_t(T * k));
  EXPECT_EQ(a.weights.size(), size_t(T * k));
  if (a.y.size() != size_t(T * H) || a.ids.size() != size_t(T * k)) return c;
  EXPECT_EQ(b.y.size(), a.y.size());
  EXPECT_TRUE(b.y.size() == a.y.size() && std::memcmp(a.y.data(), b.y.data(), a.y.size() * 2) == 0)
      << "cpu_batched y is not bit-identical to cpu";
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.weights, b.weights);

  if (!in.ids.empty()) {
    EXPECT_EQ(a.ids, in.ids);
    EXPECT_EQ(a.weights, in.weights);
  } else {
    std::vector<int32_t> ids(size_t(T * k), -5);
    std::vector<float> w(size_t(T * k), NAN);
    route_cpu(routing_params(m.cfg, m.score_bias), in.logits.data(), T, ids.data(), w.data());
    EXPECT_EQ(a.ids, ids);
    EXPECT_EQ(a.weights, w);
  }

  const std::vector<float> y = test::bf16_to_floats(a.y);
  for (size_t i = 0; i < y.size(); ++i)
    if (!std::isfinite(y[i])) {
      ADD_FAILURE() << "y[" << i << "] is not finite";
      break;
    }
  c.ref = reference_layer(m, in.x.data(), T, a.ids.data(), a.weights.data(), k);
  if (T > 0) {
    EXPECT_GT(test::l2(c.ref), 0.0);
    c.err = test::rel_l2_err(y, c.ref);
    EXPECT_LE(c.err, tol) << "rel. L2 error of y against reference_layer";
    std::vector<float> ref_bf16(c.ref.size());
    for (size_t i = 0; i < ref_bf16.size(); ++i) ref_bf16[i] = round_bf16(float(c.ref[i]));
    c.err_rounded = test::rel_l2_err(y, ref_bf16);
    // Tighter: the same numerics in fp32 give the reference's bf16 rounding, up to rare
    // one-ulp flips where an fp32 sum lands on the other side of a rounding boundary.
    EXPECT_LE(c.err_rounded, 1e-3) << "y is not the bf16 rounding of the reference";
  }
  for (int64_t t = 0; t < T; ++t) {
    bool empty = true;
    for (int j = 0; j < k; ++j) empty = empty && a.ids[size_t(t * k + j)] < 0;
    if (!empty) continue;
    for (int64_t h = 0; h < H; ++h)
      if (a.y[size_t(t * H + h)] != 0) {
        ADD_FAILURE() << "token " << t << " has no expert but y[" << h << "] = " << y[size_t(t * H + h)];
        break;
      }
  }
  c.out = a;
  return c;
}

// ---- every format x activation x bias ----------------------------------------------------------

enum class Fmt { kMxfp4, kNvfp4, kNvfp4Split, kMxfp8, kBf16 };

WeightFormat weight_format(Fmt f) {
  switch (f) {
    case Fmt::kMxfp4: return WeightFormat::kMxfp4;
    case Fmt::kNvfp4:
    case Fmt::kNvfp4Split: return WeightFormat::kNvfp4;
    case Fmt::kMxfp8: return WeightFormat::kMxfp8;
    case Fmt::kBf16: return WeightFormat::kBf16;
  }
  return WeightFormat::kBf16;
}

const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::kMxfp4: return "mxfp4";
    case Fmt::kNvfp4: return "nvfp4";
    case Fmt::kNvfp4Split: return "nvfp4_split_scale_2";
    case Fmt::kMxfp8: return "mxfp8";
    case Fmt::kBf16: return "bf16";
  }
  return "?";
}

void PrintTo(Fmt f, std::ostream* os) { *os << fmt_name(f); }

using MatrixParam = std::tuple<Fmt, Activation, bool>;

class LayerMatrix : public ::testing::TestWithParam<MatrixParam> {};

TEST_P(LayerMatrix, CpuMatchesReferenceAndBatchedMatchesCpu) {
  const auto [fmt, act, biases] = GetParam();
  const MoeConfig cfg = make_config(weight_format(fmt), act, 8, 2, 128, 64);
  SyntheticOptions opt;
  opt.seed = 100 + 10 * uint64_t(fmt) + 3 * uint64_t(act) + (biases ? 1 : 0);
  opt.biases = biases;
  opt.split_scale_2 = fmt == Fmt::kNvfp4Split;
  const MoeModel m = make_synthetic_model(cfg, opt);
  ASSERT_EQ(m.w13.halves, fmt == Fmt::kNvfp4Split ? 2 : 1);
  ASSERT_EQ(m.b13.empty(), !biases);
  const LayerInputData in = make_synthetic_input(cfg, 24, opt.seed + 1);
  const Checked c = check_layer(m, in);
  RecordProperty("rel_l2", test::fmt_e(c.err));
  RecordProperty("rel_l2_rounded", test::fmt_e(c.err_rounded));
  EXPECT_GT(c.err, 0.0) << "y is rounded to bf16: some error must remain";

  if (act != Activation::kSilu) {
    // The clamps matter on this data: the same weights without them give another y.
    MoeConfig wide = cfg;
    wide.swiglu_limit = 1e30f;
    const MoeModel mw = make_synthetic_model(wide, opt);
    const auto ref_wide = reference_layer(mw, in.x.data(), in.tokens, c.out.ids.data(),
                                          c.out.weights.data(), cfg.top_k);
    EXPECT_GT(test::rel_l2_err(ref_wide, c.ref), 1e-2) << "the activation's limit never bit";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Moe, LayerMatrix,
    ::testing::Combine(::testing::Values(Fmt::kMxfp4, Fmt::kNvfp4, Fmt::kNvfp4Split, Fmt::kMxfp8, Fmt::kBf16),
                       ::testing::Values(Activation::kSilu, Activation::kSwigluOai, Activation::kSiluClamped),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<MatrixParam>& info) {
      return std::string(fmt_name(std::get<0>(info.param))) + "_" + activation_name(std::get<1>(info.param)) +
             (std::get<2>(info.param) ? "_bias" : "_nobias");
    });

// The split nvfp4 tensor scale really is per half: gate and up use different scale_2.
TEST(Pipeline, SplitScale2IsUsedPerHalf) {
  const MoeConfig cfg = make_config(WeightFormat::kNvfp4, Activation::kSilu, 4, 1, 64, 64);
  SyntheticOptions opt;
  opt.seed = 3;
  opt.split_scale_2 = true;
  const MoeModel m = make_synthetic_model(cfg, opt);
  ASSERT_EQ(m.w13.scale_2.size(), 8u);
  ASSERT_NE(m.w13.scale_2[0], m.w13.scale_2[1]);
  EXPECT_EQ(m.w13.row_scale_2(0, 0), m.w13.scale_2[0]);
  EXPECT_EQ(m.w13.row_scale_2(0, 63), m.w13.scale_2[0]);
  EXPECT_EQ(m.w13.row_scale_2(0, 64), m.w13.scale_2[1]);
  EXPECT_EQ(m.w13.row_scale_2(3, 127), m.w13.scale_2[7]);
}

// ---- token counts ------------------------------------------------------------------------------

struct SizeCase {
  WeightFormat fmt;
  Activation act;
  Scoring scoring;
  bool biases;
};

class TokenCounts : public ::testing::TestWithParam<int> {};

TEST_P(TokenCounts, EveryFormatAtThisTokenCount) {
  const int T = GetParam();
  const SizeCase cases[] = {
      {WeightFormat::kMxfp4, Activation::kSwigluOai, Scoring::kSoftmax, true},
      {WeightFormat::kNvfp4, Activation::kSilu, Scoring::kSigmoid, false},
      {WeightFormat::kMxfp8, Activation::kSiluClamped, Scoring::kSoftmax, true},
      {WeightFormat::kBf16, Activation::kSilu, Scoring::kSigmoid, true},
  };
  for (const SizeCase& sc : cases) {
    SCOPED_TRACE(format_name(sc.fmt));
    MoeConfig cfg = make_config(sc.fmt, sc.act, 16, 4, 128, 96);
    cfg.scoring = sc.scoring;
    if (sc.scoring == Scoring::kSigmoid) {
      cfg.n_group = 4;
      cfg.topk_group = 2;
      cfg.routed_scaling_factor = 2.5f;
    }
    SyntheticOptions opt;
    opt.seed = 1000 + uint64_t(T);
    opt.biases = sc.biases;
    opt.score_bias = sc.scoring == Scoring::kSigmoid;
    const MoeModel m = make_synthetic_model(cfg, opt);
    const LayerInputData in = make_synthetic_input(cfg, T, 2000 + uint64_t(T));
    check_layer(m, in);
  }
}

INSTANTIATE_TEST_SUITE_P(Moe, TokenCounts, ::testing::Values(1, 3, 118));

MoeModel small_model(WeightFormat f, uint64_t seed, bool biases, int E = 8, int H = 64, int I = 64, int k = 2) {
  const MoeConfig cfg = make_config(f, Activation::kSwigluOai, E, k, H, I);
  SyntheticOptions opt;
  opt.seed = seed;
  opt.biases = biases;
  return make_synthetic_model(cfg, opt);
}

// T = 0 is a valid input (an engine's empty step): y [0, H], ids [0, k], no error.
TEST(Pipeline, ZeroTokensThroughTheApi) {
  const MoeModel m = small_model(WeightFormat::kMxfp4, 9, true);
  LayerInputData in = make_synthetic_input(m.cfg, 0, 1);
  ASSERT_TRUE(in.logits.empty());
  for (const Backend* b : {&cpu_backend(), &cpu_batched_backend()}) {
    SCOPED_TRACE(b->caps().name);
    LayerOutput out;
    try {
      out = run_backend(*b, m, in.view());
    } catch (const Error& e) {
      ADD_FAILURE() << "T = 0 with router logits rejected: " << e.what();
      continue;
    }
    EXPECT_TRUE(out.y.empty());
    EXPECT_TRUE(out.ids.empty());
    EXPECT_TRUE(out.weights.empty());
  }
  // Bypass input with no tokens.
  LayerInputData bp = in;
  bp.logits.clear();
  bp.bypass = true;
  bp.k = 2;
  for (const Backend* b : {&cpu_backend(), &cpu_batched_backend()}) {
    SCOPED_TRACE(b->caps().name + " bypass");
    try {
      const LayerOutput out = run_backend(*b, m, bp.view());
      EXPECT_TRUE(out.y.empty());
    } catch (const Error& e) {
      ADD_FAILURE() << "T = 0 with topk_ids rejected: " << e.what();
    }
  }
}

// write_layer_input / load_layer_input round-trip an empty input.
TEST(Pipeline, ZeroTokensInputFileRoundTrip) {
  const MoeModel m = small_model(WeightFormat::kMxfp4, 9, true);
  test::TempDir dir;
  write_layer_input(dir / "in.safetensors", make_synthetic_input(m.cfg, 0, 1), m.cfg.hidden,
                    m.cfg.num_experts);
  try {
    const LayerInputData in = load_layer_input(dir / "in.safetensors", m.cfg);
    EXPECT_EQ(in.tokens, 0);
    EXPECT_EQ(in.k, m.cfg.top_k);
  } catch (const Error& e) {
    ADD_FAILURE() << "an input written by write_layer_input with T = 0 does not load: " << e.what();
  }
}

TEST(Pipeline, ZeroTokensThroughTheCli) {
  const MoeModel m = small_model(WeightFormat::kMxfp4, 9, true);
  test::TempDir dir;
  write_model_dir(m, dir / "model");
  {
    // Written by hand: hidden_states [0, H] and router_logits [0, E].
    SafetensorsWriter w;
    w.add("hidden_states", DType::kBF16, {0, m.cfg.hidden}, nullptr, 0);
    w.add("router_logits", DType::kF32, {0, m.cfg.num_experts}, nullptr, 0);
    w.write(dir / "in.safetensors");
  }
  for (const char* b : {"cpu", "cpu_batched"}) {
    SCOPED_TRACE(b);
    const std::string out = dir / (std::string(b) + ".safetensors");
    const auto r = test::run_cli("run --model " + (dir / "model") + " --input " + (dir / "in.safetensors") +
                                 " --output " + out + " --backend " + b);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto f = SafetensorsFile::open(out);
    EXPECT_EQ(f.get("y").shape, (std::vector<int64_t>{0, m.cfg.hidden}));
    EXPECT_EQ(f.get("topk_ids").shape, (std::vector<int64_t>{0, m.cfg.top_k}));
  }
}

// hidden_states may come as F32: rounded to bf16 (nearest, ties to even) on use, so the layer
// sees exactly the bf16 input. The perturbations below round back up or down; truncation
// would get half of them wrong.
TEST(Pipeline, F32HiddenStatesAreRoundedToBf16) {
  const MoeModel m = small_model(WeightFormat::kMxfp8, 11, true);
  test::TempDir dir;
  write_model_dir(m, dir / "model");
  const LayerInputData in = make_synthetic_input(m.cfg, 6, 12);
  write_layer_input(dir / "bf16.safetensors", in, m.cfg.hidden, m.cfg.num_experts);
  std::vector<float> xf(in.x.size());
  for (size_t i = 0; i < xf.size(); ++i)
    xf[i] = bf16_to_float(in.x[i]) * (i % 2 ? 1.0f + 0x1p-10f : 1.0f - 0x1p-10f);
  {
    SafetensorsWriter w;
    w.add("hidden_states", DType::kF32, {in.tokens, m.cfg.hidden}, xf);
    w.add("router_logits", DType::kF32, {in.tokens, m.cfg.num_experts}, in.logits);
    w.write(dir / "f32.safetensors");
  }
  const LayerInputData back = load_layer_input(dir / "f32.safetensors", m.cfg);
  EXPECT_EQ(back.x, in.x);
  std::vector<std::vector<uint16_t>> ys;
  for (const char* name : {"bf16", "f32"}) {
    const std::string out = dir / (std::string(name) + "_out.safetensors");
    const auto r = test::run_cli("run --model " + (dir / "model") + " --input " + (dir / (std::string(name) + ".safetensors")) +
                                 " --output " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    ys.push_back(test::tensor_as<uint16_t>(SafetensorsFile::open(out), "y", DType::kBF16, {in.tokens, m.cfg.hidden}));
  }
  EXPECT_EQ(ys[0], ys[1]);
  EXPECT_FALSE(ys[0].empty());
}

// ---- routings the router would not produce -----------------------------------------------------

LayerInputData bypass_input(const MoeModel& m, int64_t T, int k, uint64_t seed,
                            const std::function<int32_t(int64_t t, int j)>& id) {
  LayerInputData in = make_synthetic_input(m.cfg, T, seed);
  in.logits.clear();
  in.bypass = true;
  in.k = k;
  std::mt19937 rng{uint32_t(seed)};
  std::uniform_real_distribution<float> u(0.1f, 1.5f);
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int32_t e = id(t, j);
      in.ids.push_back(e);
      // Empty slots carry a huge weight: it must be ignored, not multiplied by anything.
      in.weights.push_back(e < 0 ? 1e30f : u(rng));
    }
  return in;
}

TEST(Pipeline, AllTokensToOneExpert) {
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16}) {
    SCOPED_TRACE(format_name(f));
    const MoeModel m = small_model(f, 31, true);
    // Expert 5 in slot 0 of even tokens and slot 1 of odd ones; the other slot empty.
    const auto in = bypass_input(m, 41, 2, 32, [](int64_t t, int j) { return j == int(t % 2) ? 5 : -1; });
    check_layer(m, in);
  }
  // Every token on expert 2, in a different slot each (k = 3; an expert appears once per token).
  const MoeModel m = small_model(WeightFormat::kMxfp4, 33, false, 8, 64, 64, 3);
  const auto in = bypass_input(m, 20, 3, 34, [](int64_t t, int j) { return j == int(t % 3) ? 2 : -1; });
  check_layer(m, in);
}

TEST(Pipeline, IdenticalTokensScaleWithTheirWeight) {
  const MoeModel m = small_model(WeightFormat::kMxfp8, 35, false, 8, 64, 64, 1);
  LayerInputData in = bypass_input(m, 4, 1, 36, [](int64_t, int) { return 6; });
  const int64_t H = m.cfg.hidden;
  for (int64_t t = 1; t < 4; ++t) std::copy(in.x.begin(), in.x.begin() + H, in.x.begin() + t * H);
  in.weights = {1.0f, 2.0f, 0.5f, -1.0f};
  const Checked c = check_layer(m, in);
  const auto y = test::bf16_to_floats(c.out.y);
  // Scaling by a power of two is exact in fp32 and in the bf16 rounding.
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_EQ(y[size_t(H + h)], 2.0f * y[size_t(h)]) << h;
    EXPECT_EQ(y[size_t(2 * H + h)], 0.5f * y[size_t(h)]) << h;
    EXPECT_EQ(y[size_t(3 * H + h)], -y[size_t(h)]) << h;
  }
}

TEST(Pipeline, ExpertsWithNoTokens) {
  // Router choice on few tokens: most of the 16 experts get none.
  const MoeConfig cfg = make_config(WeightFormat::kNvfp4, Activation::kSilu, 16, 2, 64, 64);
  SyntheticOptions opt;
  opt.seed = 41;
  opt.biases = true;
  const MoeModel m = make_synthetic_model(cfg, opt);
  const LayerInputData in = make_synthetic_input(cfg, 3, 42);
  const Checked c = check_layer(m, in);
  std::set<int> used(c.out.ids.begin(), c.out.ids.end());
  EXPECT_LE(used.size(), 6u);
  // Bypass: only the first and the last expert.
  const auto in2 = bypass_input(m, 9, 2, 43, [](int64_t t, int j) { return (t + j) % 2 ? 15 : 0; });
  check_layer(m, in2);
}

TEST(Pipeline, MinusOneIds) {
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kBf16}) {
    SCOPED_TRACE(format_name(f));
    // biases must not leak into empty tokens
    const MoeModel m = small_model(f, 51, /*biases=*/true, 8, 64, 64, 3);
    std::mt19937 rng(52);
    std::vector<std::vector<int32_t>> ids = {{-1, -1, -1}, {-1, 3, -1}, {2, -1, 7}, {-1, -1, -1}, {0, 1, 2}};
    for (int t = 5; t < 30; ++t) {
      std::vector<int32_t> r;
      while (r.size() < 3) {
        const int32_t e = int32_t(rng() % 9) - 1;  // [-1, 8), an expert at most once per token
        if (e < 0 || std::find(r.begin(), r.end(), e) == r.end()) r.push_back(e);
      }
      ids.push_back(r);
    }
    const auto in = bypass_input(m, int64_t(ids.size()), 3, 53,
                                 [&](int64_t t, int j) { return ids[size_t(t)][size_t(j)]; });
    const Checked c = check_layer(m, in);
    const int64_t H = m.cfg.hidden;
    for (int64_t t : {0, 3})
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(c.out.y[size_t(t * H + h)], 0) << "token " << t;
    // A token with experts has non-zero output.
    int nonzero = 0;
    for (int64_t h = 0; h < H; ++h) nonzero += c.out.y[size_t(1 * H + h)] != 0;
    EXPECT_GT(nonzero, H / 2);
  }
}

// Given top-k must mean what the layer means: k == num_experts_per_tok, no expert twice in a
// token, ids in [-1, E). Every backend refuses the same inputs with the same message
// (oracle/layer_checks.h), before it runs.
TEST(Pipeline, BypassInputsTheLayerCannotMeanAreRefused) {
  const MoeModel m = small_model(WeightFormat::kMxfp4, 61, true);
  ASSERT_EQ(m.cfg.top_k, 2);
  struct Case {
    const char* name;
    int k;
    std::function<int32_t(int64_t, int)> id;
    const char* needle;
  };
  const Case cases[] = {
      {"k > top_k", 4, [](int64_t t, int j) { return int32_t((t * 3 + j * 5) % 8); }, "4 slots per token"},
      {"k < top_k", 1, [](int64_t t, int) { return int32_t(t % 8); }, "1 slots per token"},
      {"k > E", 9, [](int64_t, int j) { return int32_t(j % 8); }, "9 slots per token"},
      {"duplicate id", 2, [](int64_t t, int) { return int32_t(t == 3 ? 5 : 1); }, "token 0 lists expert 1"},
      {"id == E", 2, [](int64_t t, int j) { return int32_t(t == 2 && j == 1 ? 8 : j); }, "out of range"},
  };
  for (const Case& c : cases) {
    const auto in = bypass_input(m, 11, c.k, 62, c.id);
    std::string first;
    for (const Backend* b : all_backends()) {
      SCOPED_TRACE(std::string(c.name) + " on " + b->caps().name);
      if (!b->supports(Problem::of(m, in.tokens), DeviceInfo::detect()).ok) continue;
      try {
        run_backend(*b, m, in.view());
        ADD_FAILURE() << "accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
        if (first.empty()) first = e.what();
        EXPECT_EQ(first, e.what()) << "backends disagree";
      }
    }
  }
  // -1 may repeat: it is the empty slot.
  check_layer(m, bypass_input(m, 5, 2, 63, [](int64_t t, int j) { return t == 1 && j == 0 ? 3 : -1; }));
}

// LayerInput::check_values, on every backend: hidden_states scanned before the run, y after it
// (a layer that overflows from finite inputs is an error naming the first position). Off, the
// same inputs run (the hot path pays for neither scan).
TEST(Pipeline, ValueChecksAreAnOptionOfEveryBackend) {
  const MoeConfig cfg = make_config(WeightFormat::kBf16, Activation::kSilu, 8, 2, 64, 64);  // no clamp
  const MoeModel m = make_synthetic_model(cfg, {});
  LayerInputData nan_x = make_synthetic_input(cfg, 3, 72);
  nan_x.x[70] = 0x7fc0;  // NaN at token 1, column 6
  LayerInputData huge_x = make_synthetic_input(cfg, 3, 73);
  for (auto& v : huge_x.x) v = float_to_bf16(3.0e38f);  // finite; gate x up overflows fp32
  for (const Backend* b : all_backends()) {
    if (!b->supports(Problem::of(m, 3), DeviceInfo::detect()).ok) continue;
    SCOPED_TRACE(b->caps().name);
    for (const bool check : {true, false}) {
      LayerInput a = nan_x.view(), c = huge_x.view();
      a.check_values = c.check_values = check;
      if (!check) {
        EXPECT_NO_THROW(run_backend(*b, m, a));
        const LayerOutput o = run_backend(*b, m, c);
        EXPECT_TRUE(std::any_of(o.y.begin(), o.y.end(), [](uint16_t v) { return (v & 0x7f80) == 0x7f80; }));
        continue;
      }
      try {
        run_backend(*b, m, a);
        ADD_FAILURE() << "NaN hidden_states accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("hidden_states: NaN at token 1, column 6"), std::string::npos) << e.what();
      }
      try {
        run_backend(*b, m, c);
        ADD_FAILURE() << "non-finite y returned";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("from finite inputs: the layer overflowed"), std::string::npos) << e.what();
      }
    }
  }
}

TEST(Pipeline, SizesMultipleOf32NotOf64) {
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16}) {
    for (Activation a : {Activation::kSilu, Activation::kSwigluOai}) {
      SCOPED_TRACE(std::string(format_name(f)) + " " + activation_name(a));
      const MoeConfig cfg = make_config(f, a, 8, 2, 96, 160);
      SyntheticOptions opt;
      opt.seed = 70 + uint64_t(f);
      opt.biases = a == Activation::kSwigluOai;
      opt.split_scale_2 = f == WeightFormat::kNvfp4;
      const MoeModel m = make_synthetic_model(cfg, opt);
      check_layer(m, make_synthetic_input(cfg, 17, 71));
    }
  }
  // And odd multiples of 32 both ways.
  const MoeConfig cfg = make_config(WeightFormat::kMxfp4, Activation::kSwigluOai, 4, 2, 224, 32);
  const MoeModel m = make_synthetic_model(cfg, {});
  check_layer(m, make_synthetic_input(cfg, 9, 72));
}

// A model written to disk and loaded back (memory-mapped, GPT-OSS interleave undone) gives the
// same y as the in-memory one.
TEST(Pipeline, LoadedModelGivesSameBits) {
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16}) {
    SCOPED_TRACE(format_name(f));
    const MoeConfig cfg = make_config(f, Activation::kSwigluOai, 8, 2, 64, 96);
    SyntheticOptions opt;
    opt.seed = 80;
    opt.biases = true;
    opt.split_scale_2 = f == WeightFormat::kNvfp4;
    const MoeModel m = make_synthetic_model(cfg, opt);
    test::TempDir dir;
    write_model_dir(m, dir / "model");
    const MoeModel l = MoeModel::load(dir / "model");
    const LayerInputData in = make_synthetic_input(cfg, 13, 81);
    const LayerOutput a = run_backend(cpu_backend(), m, in.view());
    const LayerOutput b = run_backend(cpu_backend(), l, in.view());
    EXPECT_EQ(a.y, b.y);
    EXPECT_EQ(a.ids, b.ids);
  }
}

TEST(Pipeline, RepeatedRunsAreDeterministic) {
  const MoeConfig cfg = make_config(WeightFormat::kMxfp4, Activation::kSwigluOai, 16, 4, 128, 64);
  const MoeModel m = make_synthetic_model(cfg, {});
  const LayerInputData in = make_synthetic_input(cfg, 50, 91);
  auto runner = std::make_unique<HostRunner>(m, "cpu");
  LayerOutput first;
  runner->run(in.view(), &first);
  for (int i = 0; i < 3; ++i) {
    LayerOutput again;
    runner->run(in.view(), &again);
    ASSERT_EQ(again.y, first.y) << "run " << i;
  }
}

// ---- the modular pipeline's halves -------------------------------------------------------------

struct Routing {
  int64_t T;
  int k;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Routing sample_routing(int E) {
  Routing r{7, 3, {}, {}};
  r.ids = {0, 2, -1, 2, 2, 0, -1, -1, -1, 4, 1, 0, 2, -1, 4, 1, 1, 1, 0, 4, 2};
  for (size_t i = 0; i < r.ids.size(); ++i) r.w.push_back(0.25f * float(i % 5) + 0.1f);
  EXPECT_LT(*std::max_element(r.ids.begin(), r.ids.end()), E);
  return r;
}

TEST(Pipeline, StandardLayoutPadsAndMapsRows) {
  const int E = 6, H = 32;
  const Routing r = sample_routing(E);
  std::vector<uint16_t> x(size_t(r.T * H));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(float(i) * 0.01f + 1.0f);
  Activations<StandardLayout> a;
  StandardPrepareFinalize(4).prepare(x.data(), r.T, H, r.ids.data(), r.k, E, &a);
  const StandardLayout& L = a.layout;
  EXPECT_EQ(L.counts, (std::vector<int32_t>{4, 4, 5, 0, 3, 0}));
  EXPECT_EQ(L.offsets, (std::vector<int64_t>{0, 4, 8, 16, 16, 20, 20}));
  EXPECT_EQ(L.num_rows, 20);
  EXPECT_EQ(a.width, H);
  ASSERT_EQ(a.data.size(), size_t(20 * H));
  ASSERT_EQ(L.dest.size(), r.ids.size());
  int real = 0;
  for (int64_t row = 0; row < L.num_rows; ++row) {
    const int32_t s = L.row_src[size_t(row)];
    if (s < 0) continue;
    ++real;
    EXPECT_EQ(L.dest[size_t(s)], row);
    const int e = r.ids[size_t(s)];
    EXPECT_GE(row, L.offsets[size_t(e)]);
    EXPECT_LT(row, L.offsets[size_t(e)] + L.counts[size_t(e)]);
    EXPECT_EQ(std::memcmp(a.data.data() + row * H, x.data() + (s / r.k) * H, H * 2), 0) << row;
  }
  EXPECT_EQ(real, 16);
  for (size_t i = 0; i < r.ids.size(); ++i)
    if (r.ids[i] < 0) {
      EXPECT_EQ(L.dest[i], -1);
    }
  // Rows keep (token, slot) order inside an expert.
  for (int e = 0; e < E; ++e)
    for (int64_t row = L.offsets[size_t(e)] + 1; row < L.offsets[size_t(e)] + L.counts[size_t(e)]; ++row)
      EXPECT_LT(L.row_src[size_t(row - 1)], L.row_src[size_t(row)]);
}

TEST(Pipeline, BatchedLayoutMasksRows) {
  const int E = 6, H = 32;
  const Routing r = sample_routing(E);
  std::vector<uint16_t> x(size_t(r.T * H));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(float(i) * -0.01f);
  Activations<BatchedLayout> a;
  BatchedPrepareFinalize().prepare(x.data(), r.T, H, r.ids.data(), r.k, E, &a);
  const BatchedLayout& L = a.layout;
  EXPECT_EQ(L.counts, (std::vector<int32_t>{4, 4, 5, 0, 3, 0}));
  EXPECT_EQ(L.max_tokens, 5);
  EXPECT_EQ(L.num_rows(), 30);
  ASSERT_EQ(a.data.size(), size_t(30 * H));
  for (int e = 0; e < E; ++e)
    for (int s = 0; s < L.max_tokens; ++s) {
      const int64_t row = L.row_begin(e) + s;
      const int32_t src = L.row_src[size_t(row)];
      if (s >= L.counts[size_t(e)]) {
        EXPECT_EQ(src, -1) << "expert " << e << " slot " << s;
        continue;
      }
      ASSERT_GE(src, 0);
      EXPECT_EQ(r.ids[size_t(src)], e);
      EXPECT_EQ(L.dest[size_t(src)], row);
      EXPECT_EQ(std::memcmp(a.data.data() + row * H, x.data() + (src / r.k) * H, H * 2), 0);
    }
}

// Both layouts through ModularPipeline with a poisoned y: every element is written, empty
// tokens get exactly 0, and the bits equal the cpu backend's (whatever the padding).
TEST(Pipeline, ModularPipelineWritesEveryOutputRow) {
  const MoeModel m = small_model(WeightFormat::kNvfp4, 95, true, 6, 64, 32, 3);
  Routing r = sample_routing(6);
  // The layer takes each expert once per token: tokens 1 {2, 2, 0} and 5 {1, 1, 1} made distinct.
  r.ids[4] = 5;
  r.ids[16] = 3;
  r.ids[17] = 5;
  LayerInputData in = make_synthetic_input(m.cfg, r.T, 96);
  in.logits.clear();
  in.bypass = true;
  in.ids = r.ids;
  in.weights = r.w;
  in.k = r.k;
  const Checked want = check_layer(m, in);
  const int64_t H = m.cfg.hidden;
  const CpuExperts<StandardLayout> se(m);
  const CpuExperts<BatchedLayout> be(m);
  for (int align : {1, 4, 16, 128}) {
    SCOPED_TRACE("align " + std::to_string(align));
    const StandardPrepareFinalize pf(align);
    std::vector<uint16_t> y(size_t(r.T * H), kPoison);
    ModularPipeline<StandardLayout>(pf, se).run(in.x.data(), r.T, H, r.ids.data(), r.w.data(), r.k, 6, y.data());
    EXPECT_EQ(y, want.out.y);
  }
  const BatchedPrepareFinalize bpf;
  std::vector<uint16_t> y(size_t(r.T * H), kPoison);
  ModularPipeline<BatchedLayout>(bpf, be).run(in.x.data(), r.T, H, r.ids.data(), r.w.data(), r.k, 6, y.data());
  EXPECT_EQ(y, want.out.y);
  for (int64_t h = 0; h < H; ++h) EXPECT_EQ(y[size_t(2 * H + h)], 0);  // token 2: {-1, -1, -1}
}

TEST(Pipeline, PrepareRejectsOutOfRangeIds) {
  const int E = 4, H = 32;
  std::vector<uint16_t> x(size_t(2 * H), float_to_bf16(1.0f));
  const std::vector<int32_t> ids = {0, 4};
  Activations<StandardLayout> a;
  EXPECT_THROW(StandardPrepareFinalize(1).prepare(x.data(), 2, H, ids.data(), 1, E, &a), Error);
  Activations<BatchedLayout> b;
  EXPECT_THROW(BatchedPrepareFinalize().prepare(x.data(), 2, H, ids.data(), 1, E, &b), Error);
  const MoeModel m = small_model(WeightFormat::kBf16, 97, false, 4, 32, 32, 1);
  LayerInputData in = make_synthetic_input(m.cfg, 2, 98);
  in.logits.clear();
  in.bypass = true;
  in.ids = {0, -2};
  in.weights = {1.0f, 1.0f};
  in.k = 1;
  EXPECT_THROW(run_backend(cpu_backend(), m, in.view()), Error);
  in.ids = {0, 1};
  in.weights = {1.0f, NAN};
  EXPECT_THROW(run_backend(cpu_batched_backend(), m, in.view()), Error);
}

// The oracle on a CPU: both CPU backends support every format and activation; cpu is first.
TEST(Pipeline, OracleOffersBothCpuBackends) {
  ASSERT_NE(find_backend("cpu"), nullptr);
  ASSERT_NE(find_backend("cpu_batched"), nullptr);
  EXPECT_EQ(find_backend("nosuch"), nullptr);
  EXPECT_EQ(find_backend("cpu")->caps().activation_format, ActivationFormat::kStandard);
  EXPECT_EQ(find_backend("cpu_batched")->caps().activation_format, ActivationFormat::kBatched);
  DeviceInfo cpu;  // no GPU
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16})
    for (Activation a : {Activation::kSilu, Activation::kSwigluOai, Activation::kSiluClamped}) {
      Problem p;
      p.cfg = make_config(f, a, 8, 2, 64, 64);
      p.tokens = 5;
      EXPECT_TRUE(find_backend("cpu")->supports(p, cpu).ok);
      EXPECT_TRUE(find_backend("cpu_batched")->supports(p, cpu).ok);
      const Decision d = choose_backend(p, cpu, "cpu_batched");
      EXPECT_EQ(d.chosen, find_backend("cpu_batched"));
      EXPECT_THROW(choose_backend(p, cpu, "nosuch"), Error);
    }
}

}  // namespace
}  // namespace moekit
