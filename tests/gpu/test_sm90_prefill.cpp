// The SM90 prefill kernel (experts/sm90_prefill_gemm.cuh) at prefill sizes, against the CPU
// backend: every weight format on both activation formats at 256, 1024, 4096 and 16384 tokens,
// skewed routing (half the tokens on 4 experts, every token on one expert, one expert with one
// token among thousands, experts with none, -1 ids), H and I that need padding, GPT-OSS-sized
// experts, poisoned outputs, and the same bits on every run. (The smaller sizes and the golden
// cases run through the prefill backends in test_sm90_layer.cpp.)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "sm90_testutil.h"

namespace moekit {
namespace {

using IdFn = std::function<int32_t(int64_t t, int j)>;

// Distinct random experts per token (the first k of a permutation seeded by the token), -1 in
// every 7th slot.
IdFn uniform_ids(int E, int k, uint64_t seed) {
  return [=](int64_t t, int j) {
    if ((t * k + j) % 7 == 3) return -1;
    std::mt19937_64 rng(seed + uint64_t(t));
    std::vector<int32_t> p(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) p[size_t(e)] = e;
    std::shuffle(p.begin(), p.end(), rng);
    return p[size_t(j)];
  };
}

// Runs the layer with the prefill kernel forced, y poisoned first, and returns y.
std::vector<uint16_t> run_prefill(const MoeModel& m, ActivationFormat fmt, const LayerInputData& in) {
  Sm90Layer layer(m, fmt);
  EXPECT_TRUE(layer.prefill_supported());
  layer.set_prefill_from(0);
  layer.reserve(in.tokens, in.k);
  EXPECT_TRUE(layer.uses_prefill(in.tokens));
  cudaStream_t s;
  EXPECT_EQ(cudaStreamCreate(&s), cudaSuccess);
  EXPECT_EQ(upload_inputs(layer, in), cudaSuccess);
  std::vector<uint16_t> y;
  run_poisoned(layer, s, in.tokens, true, &y);
  EXPECT_EQ(layer.plan_error(s), 0);
  cudaStreamDestroy(s);
  return y;
}

void expect_matches_cpu(const MoeModel& m, const LayerInputData& in, const char* what) {
  const LayerOutput cpu = run_backend("cpu", m, in.view());
  for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched}) {
    SCOPED_TRACE(std::string(what) + (fmt == ActivationFormat::kStandard ? ", standard" : ", batched"));
    const std::vector<uint16_t> y = run_prefill(m, fmt, in);
    const std::vector<float> g = to_f32(y), c = to_f32(cpu.y);
    const double err = test::rel_l2_err(g, c);
    EXPECT_LE(err, 1e-2);
    if (err > 1e-2) {
      // Where: the elements off by more than 5% of the largest output, by token and column.
      double mx = 0;
      for (float v : c) mx = std::max(mx, double(std::fabs(v)));
      int64_t bad = 0;
      std::vector<int64_t> tok_hist(8, 0), col_hist(8, 0);
      for (size_t i = 0; i < c.size(); ++i)
        if (std::fabs(double(g[i]) - double(c[i])) > 0.05 * mx) {
          const int64_t t = int64_t(i) / m.cfg.hidden, h = int64_t(i) % m.cfg.hidden;
          if (bad < 8)
            ADD_FAILURE() << "token " << t << " column " << h << ": gpu " << g[i] << " cpu " << c[i] << " ids "
                          << in.ids[size_t(t * in.k)] << "," << in.ids[size_t(t * in.k + 1) < in.ids.size() ? size_t(t * in.k + 1) : 0];
          ++bad;
          tok_hist[size_t(std::min<int64_t>(7, t * 8 / in.tokens))]++;
          col_hist[size_t(std::min<int64_t>(7, h * 8 / m.cfg.hidden))]++;
        }
      std::string th, ch;
      for (int i = 0; i < 8; ++i) th += std::to_string(tok_hist[size_t(i)]) + " ", ch += std::to_string(col_hist[size_t(i)]) + " ";
      ADD_FAILURE() << bad << " of " << c.size() << " elements off by > 5% of max; by token eighth: " << th
                    << "; by column eighth: " << ch;
    }
    testing::Test::RecordProperty(std::string(what) + (fmt == ActivationFormat::kStandard ? " standard" : " batched"),
                   test::fmt_e(err));
    // A token whose slots are all -1 comes out exactly zero.
    for (int64_t t = 0; t < in.tokens; ++t) {
      bool empty = true;
      for (int j = 0; j < in.k; ++j) empty = empty && in.ids[size_t(t * in.k + j)] < 0;
      if (!empty) continue;
      for (int64_t h = 0; h < m.cfg.hidden; ++h) ASSERT_EQ(y[size_t(t * m.cfg.hidden + h)], 0) << "token " << t;
    }
  }
}

TEST(Sm90Prefill, EveryFormatAtPrefillSizes) {
  uint64_t seed = 500;
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16}) {
    // 2I = 384 rows: a weight tile of 4 groups and one of 2; H = 320: one of 4 and one of 1.
    const MoeConfig cfg = small_config(f, Activation::kSwigluOai, 32, 4, 320, 192);
    SyntheticOptions so;
    so.seed = ++seed;
    so.biases = true;
    so.split_scale_2 = f == WeightFormat::kNvfp4;
    const MoeModel m = make_synthetic_model(cfg, so);
    for (int64_t T : {256, 1024, 4096, 16384}) {
      const std::string what = std::string(format_name(f)) + " T=" + std::to_string(T);
      SCOPED_TRACE(what);
      expect_matches_cpu(m, bypass_input(cfg, T, cfg.top_k, seed + uint64_t(T), uniform_ids(32, 4, seed)), what.c_str());
    }
  }
}

TEST(Sm90Prefill, SkewedRouting) {
  const int E = 32, k = 4;
  const int64_t T = 4096;
  const MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSilu, E, k, 256, 128);
  const MoeModel m = synthetic_model(cfg, 41, false);
  const IdFn uni = uniform_ids(E, k, 9);
  struct Pattern {
    const char* name;
    IdFn id;
  };
  const std::vector<Pattern> patterns = {
      // Tokens 0..T/2 put slot 0 on one of experts 0..3 and the other slots elsewhere.
      {"half the tokens on 4 experts",
       [&](int64_t t, int j) { return t < T / 2 ? (j == 0 ? int32_t(t % 4) : int32_t(4 + (t + 7 * j) % 28)) : uni(t, j); }},
      {"every token on one expert", [](int64_t, int j) { return j == 0 ? 5 : -1; }},
      {"one expert with one token among thousands",
       [&](int64_t t, int j) {
         if (t == 1234 && j == 0) return 31;
         const int32_t v = uni(t, j);
         return v == 31 ? -1 : v;
       }},
      {"experts 8..31 empty, -1 ids", [](int64_t t, int j) { return (t + j) % 5 == 0 ? -1 : int32_t((t * 3 + j) % 8); }},
  };
  for (const Pattern& p : patterns) {
    SCOPED_TRACE(p.name);
    expect_matches_cpu(m, bypass_input(cfg, T, k, 17, p.id), p.name);
  }
}

TEST(Sm90Prefill, PaddedAndGptOssSizes) {
  {
    // H = 112 -> 128 and I = 80 -> 128: padding columns and rows inside the tiles.
    const MoeConfig cfg = small_config(WeightFormat::kNvfp4, Activation::kSiluClamped, 16, 2, 112, 80);
    const MoeModel m = synthetic_model(cfg, 5, true);
    expect_matches_cpu(m, bypass_input(cfg, 1000, 2, 3, uniform_ids(16, 2, 3)), "H=112 I=80");
  }
  {
    // GPT-OSS experts: 2I = 5760 rows (22.5 weight tiles), H = 2880 (11.25), K = 2880 (45 k-blocks).
    const MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSwigluOai, 8, 2, 2880, 2880);
    const MoeModel m = synthetic_model(cfg, 6, true);
    expect_matches_cpu(m, bypass_input(cfg, 640, 2, 4, uniform_ids(8, 2, 4)), "gpt-oss experts");
  }
}

// Expert counts around the tile boundaries: short tiles (n <= 96, four groups per weight tile),
// tall tiles (97..192 rows, one wgmma N = 128, 160 or 192 per group, two groups per weight tile),
// full tall tiles followed by a short or a tall remainder; G = 5 (GEMM2) and 6 (GEMM1) leave
// partial weight tiles of both kinds.
TEST(Sm90Prefill, TileShapes) {
  const std::vector<int> counts = {0, 1, 95, 96, 97, 160, 191, 192, 193, 250, 288, 289, 400, 479, 480, 577};
  std::vector<int32_t> owner;
  for (size_t e = 0; e < counts.size(); ++e) owner.insert(owner.end(), size_t(counts[e]), int32_t(e));
  const int64_t T = int64_t(owner.size());
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kBf16}) {
    SCOPED_TRACE(format_name(f));
    const MoeConfig cfg = small_config(f, Activation::kSwigluOai, int(counts.size()), 1, 320, 192);
    const MoeModel m = synthetic_model(cfg, 77, true);
    expect_matches_cpu(m, bypass_input(cfg, T, 1, 78, [&](int64_t t, int) { return owner[size_t(t)]; }),
                       format_name(f));
  }
}

// Three runs, the same bits: every output element is computed whole by one CTA, whichever CTA
// claims its tile.
TEST(Sm90Prefill, SameBitsEveryRun) {
  const MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSwigluOai, 32, 4, 512, 256);
  const MoeModel m = synthetic_model(cfg, 8, true);
  const LayerInputData in = bypass_input(cfg, 3000, 4, 5, uniform_ids(32, 4, 5));
  for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched}) {
    const std::vector<uint16_t> a = run_prefill(m, fmt, in), b = run_prefill(m, fmt, in), c = run_prefill(m, fmt, in);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 2), 0);
    EXPECT_EQ(std::memcmp(a.data(), c.data(), a.size() * 2), 0);
  }
}

// The routed path (no bypass) through the crossover backend at a prefill size uses the prefill
// kernel and matches the CPU.
TEST(Sm90Prefill, CrossoverBackendRoutes) {
  MoeConfig cfg = small_config(WeightFormat::kMxfp8, Activation::kSilu, 64, 6, 256, 128);
  cfg.scoring = Scoring::kSigmoid;
  cfg.n_group = 8;
  cfg.topk_group = 4;
  SyntheticOptions so;
  so.seed = 12;
  so.score_bias = true;
  const MoeModel m = make_synthetic_model(cfg, so);
  const LayerInputData in = make_synthetic_input(cfg, 2048, 13);
  const LayerOutput cpu = run_backend("cpu", m, in.view());
  for (const char* name : {"sm90", "sm90_batched"}) {
    SCOPED_TRACE(name);
    Problem pr;
    pr.cfg = cfg;
    pr.tokens = in.tokens;
    const std::string plan = find_backend(name)->plan(pr, DeviceInfo::detect());
    EXPECT_EQ(plan.rfind("the prefill GEMM kernel", 0), 0u) << plan;
    const LayerOutput gpu = run_backend(name, m, with_ids(in, cpu, cfg.top_k).view());
    EXPECT_LE(test::rel_l2_err(to_f32(gpu.y), to_f32(cpu.y)), 1e-2);
  }
}

// A reduced set for compute-sanitizer: the prefill kernel alone, every format, partial tiles.
TEST(Sm90Sanitize, PrefillSmall) {
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16}) {
    SCOPED_TRACE(format_name(f));
    const MoeConfig cfg = small_config(f, Activation::kSwigluOai, 8, 2, 192, 96);
    const MoeModel m = synthetic_model(cfg, 7, true);
    expect_matches_cpu(m, bypass_input(cfg, 150, 2, 9, uniform_ids(8, 2, 9)), format_name(f));
  }
}

// The small-tile kernel forced on (the layer reads $MOEKIT_PREFILL_TILES when it is made; the rule
// would pick the other kernel for so few experts): MXFP4 and NVFP4, weight tiles of 5 + 5 (G = 10,
// GEMM2) and 4 x 7 groups (G = 28, GEMM1) over the three consumer warpgroups (one to three groups
// each), token tiles of 1..32 rows and remainders past 32; also for the race checkers.
TEST(Sm90Sanitize, PrefillSmallTiles) {
  const test::ScopedEnv forced("MOEKIT_PREFILL_TILES", "small");
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4}) {
    SCOPED_TRACE(format_name(f));
    const MoeConfig cfg = small_config(f, Activation::kSwigluOai, 16, 2, 640, 896);
    const MoeModel m = synthetic_model(cfg, 31, true);
    {
      const test::ScopedEnv unforced("MOEKIT_PREFILL_TILES", nullptr);
      EXPECT_FALSE(Sm90Layer(m, ActivationFormat::kStandard).prefill_small_tiles(200));  // the rule: 400 rows > 24 x 16
    }
    EXPECT_TRUE(Sm90Layer(m, ActivationFormat::kStandard).prefill_small_tiles(200));
    expect_matches_cpu(m, bypass_input(cfg, 200, 2, 32, uniform_ids(16, 2, 33)), format_name(f));
  }
}

// BF16 weights (the format with the shortest ring) with 96-row tiles, for the race checkers.
TEST(Sm90Sanitize, PrefillBf16FullTiles) {
  const MoeConfig cfg = small_config(WeightFormat::kBf16, Activation::kSwigluOai, 32, 4, 320, 192);
  const MoeModel m = synthetic_model(cfg, 502, true);
  const LayerInputData in = bypass_input(cfg, 1024, 4, 1526, uniform_ids(32, 4, 502));
  const LayerOutput cpu = run_backend("cpu", m, in.view());
  const std::vector<uint16_t> y = run_prefill(m, ActivationFormat::kStandard, in);
  EXPECT_LE(test::rel_l2_err(to_f32(y), to_f32(cpu.y)), 1e-2);
}

}  // namespace
}  // namespace moekit
