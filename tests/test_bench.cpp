// `moekit bench` on the CPU: the presets, the routing distributions (uniform, Zipf) through the
// CPU router, and the stamped JSON / CSV output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moekit/bench/bench.h"
#include "moekit/routing/routing.h"
#include "testutil.h"

namespace moekit {
namespace {

TEST(BenchPresets, EveryModelOfTheReportIsNamed) {
  struct Want {
    const char* name;
    int E, k, H, I;
  };
  const Want want[] = {{"gpt-oss-120b", 128, 4, 2880, 2880},  {"gpt-oss-20b", 32, 4, 2880, 2880},
                       {"deepseek-v3", 256, 8, 7168, 2048},   {"qwen3-30b-a3b", 128, 8, 2048, 768},
                       {"qwen3-235b-a22b", 128, 8, 4096, 1536}, {"mixtral-8x7b", 8, 2, 4096, 14336},
                       {"deepseek-v4-pro", 384, 6, 7168, 3072}, {"deepseek-v4-flash", 256, 6, 4096, 2048},
                       {"deepseek-v4.1-flash", 384, 6, 5120, 2304}};
  ASSERT_EQ(bench_shape_names().size(), std::size(want));
  for (const Want& w : want) {
    SCOPED_TRACE(w.name);
    for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16}) {
      const MoeConfig c = bench_shape(w.name, f);
      EXPECT_EQ(c.num_experts, w.E);
      EXPECT_EQ(c.top_k, w.k);
      EXPECT_EQ(c.hidden, w.H);
      EXPECT_EQ(c.intermediate, w.I);
      EXPECT_EQ(c.format, f);
    }
    EXPECT_NE(bench_shape_help().find(w.name), std::string::npos);
  }
  EXPECT_EQ(bench_shape("deepseek-v3", WeightFormat::kMxfp4).scoring, Scoring::kSigmoid);
  EXPECT_EQ(bench_shape("gpt-oss-20b", WeightFormat::kMxfp4).act, Activation::kSwigluOai);
  EXPECT_EQ(bench_shape("mixtral-8x7b", WeightFormat::kMxfp4).act, Activation::kSilu);
  // DeepSeek-V4 (../shared/notes/deepseek_v4.md): sqrtsoftplus over all experts, silu_clamped at 10.
  for (const char* v4 : {"deepseek-v4-pro", "deepseek-v4-flash", "deepseek-v4.1-flash"}) {
    const MoeConfig c = bench_shape(v4, WeightFormat::kMxfp4);
    EXPECT_EQ(c.scoring, Scoring::kSqrtSoftplus) << v4;
    EXPECT_EQ(c.n_group, 1) << v4;
    EXPECT_EQ(c.act, Activation::kSiluClamped) << v4;
    EXPECT_EQ(c.swiglu_limit, 10.0f) << v4;
    EXPECT_TRUE(c.norm_topk_prob) << v4;
    EXPECT_EQ(c.hash_vocab, 0) << v4;
    BenchOptions o;
    o.shape = v4;
    o.hash_layer = true;
    EXPECT_EQ(bench_config(o).hash_vocab, kBenchHashVocab) << v4;
  }
  EXPECT_EQ(bench_shape("deepseek-v4-pro", WeightFormat::kMxfp4).routed_scaling_factor, 2.5f);
  EXPECT_EQ(bench_shape("deepseek-v4-flash", WeightFormat::kMxfp4).routed_scaling_factor, 1.5f);
  EXPECT_EQ(bench_shape("gpt-oss-120b", WeightFormat::kMxfp4).swiglu_limit, 7.0f);
}

TEST(BenchRouting, ZipfProbabilitiesFollowTheRanks) {
  const int E = 16;
  const double s = 1.2;
  const auto p = bench_expert_probabilities(E, BenchRouting::kZipf, s, 3);
  double h = 0;
  for (int r = 1; r <= E; ++r) h += std::pow(r, -s);
  std::vector<double> sorted = p;
  std::sort(sorted.rbegin(), sorted.rend());
  for (int r = 1; r <= E; ++r) EXPECT_NEAR(sorted[size_t(r - 1)], std::pow(r, -s) / h, 1e-12);
  // The same seed, the same hot experts; another seed, another permutation.
  EXPECT_EQ(p, bench_expert_probabilities(E, BenchRouting::kZipf, s, 3));
  EXPECT_NE(p, bench_expert_probabilities(E, BenchRouting::kZipf, s, 4));
  for (double u : bench_expert_probabilities(E, BenchRouting::kUniform, s, 3)) EXPECT_EQ(u, 1.0 / E);
}

// The experts the CPU router picks from the logits, counted over T tokens.
std::vector<int> routed_counts(const MoeConfig& c, int64_t T, BenchRouting r, double s, uint64_t seed) {
  const std::vector<float> lg = bench_router_logits(c, T, r, s, seed);
  EXPECT_EQ(lg.size(), size_t(T) * size_t(c.num_experts));
  std::vector<int32_t> ids(size_t(T) * size_t(c.top_k));
  std::vector<float> w(ids.size());
  route_cpu(routing_params(c, {}), lg.data(), T, ids.data(), w.data());
  std::vector<int> n(size_t(c.num_experts), 0);
  for (int32_t id : ids) {
    EXPECT_GE(id, 0);
    ++n[size_t(id)];
  }
  return n;
}

TEST(BenchRouting, TopOneOfTheLogitsIsADrawFromTheDistribution) {
  // k = 1: the Gumbel-max trick makes expert e the choice with probability p_e exactly.
  const MoeConfig c = bench_shape("8,1,64,64", WeightFormat::kBf16);
  const int64_t T = 40000;
  for (BenchRouting r : {BenchRouting::kUniform, BenchRouting::kZipf}) {
    SCOPED_TRACE(bench_routing_name(r));
    const auto p = bench_expert_probabilities(8, r, 1.0, 5);
    const auto n = routed_counts(c, T, r, 1.0, 5);
    for (int e = 0; e < 8; ++e) {
      const double sd = std::sqrt(T * p[size_t(e)] * (1 - p[size_t(e)]));
      EXPECT_NEAR(n[size_t(e)], T * p[size_t(e)], 5 * sd) << "expert " << e;
    }
  }
}

TEST(BenchRouting, ZipfLoadIsSkewedUnderEveryPresetRouter) {
  // k distinct experts per token; the hottest expert carries far more rows than under uniform
  // routing, with softmax (gpt-oss) and with DeepSeek's group-limited sigmoid router alike.
  for (const char* name : {"gpt-oss-120b", "deepseek-v3", "mixtral-8x7b", "deepseek-v4-flash"}) {
    SCOPED_TRACE(name);
    const MoeConfig c = bench_shape(name, WeightFormat::kMxfp4);
    const int64_t T = 2048;
    const auto u = routed_counts(c, T, BenchRouting::kUniform, 1.0, 1);
    const auto z = routed_counts(c, T, BenchRouting::kZipf, 1.0, 1);
    const double rows_per_expert = double(T) * c.top_k / c.num_experts;
    EXPECT_LT(*std::max_element(u.begin(), u.end()), 2.0 * rows_per_expert);
    EXPECT_GT(*std::max_element(z.begin(), z.end()), (c.num_experts > 8 ? 4.0 : 1.5) * rows_per_expert);
  }
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(BenchOutput, JsonAndCsvRowsAreStamped) {
  test::TempDir dir;
  const auto r = test::run_cli("bench --shape 8,2,64,64 --format bf16 --backend cpu --tokens 1,3 --reps 1 "
                               "--routing zipf --zipf-s 1.5 --split 1 --json " + (dir / "b.json") + " --csv " +
                               (dir / "b.csv"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(read(dir / "b.json"));
  ASSERT_EQ(j.size(), 2u);
  for (const auto& row : j) {
    for (const char* key : {"device", "driver", "cuda", "commit", "date"})
      EXPECT_FALSE(row.at(key).get<std::string>().empty()) << key;
    EXPECT_EQ(row.at("routing"), "zipf");
    EXPECT_EQ(row.at("zipf_s"), 1.5);
    EXPECT_EQ(row.at("E"), 8);
    EXPECT_EQ(row.at("I"), 64);
    EXPECT_GE(row.at("max_expert_rows").get<int>(), 1);
    EXPECT_TRUE(row.at("routing_us").is_null());  // the CPU backend has no time split
  }
  EXPECT_EQ(j[1].at("tokens"), 3);
  EXPECT_EQ(j[0].at("date").get<std::string>().size(), 20u);  // 2026-11-23T10:00:00Z
  // CSV: the JSON's keys as the header, one line per row, the same number of cells.
  std::istringstream csv(read(dir / "b.csv"));
  std::string header, line;
  std::getline(csv, header);
  std::vector<std::string> keys;
  for (auto it = j[0].begin(); it != j[0].end(); ++it) keys.push_back(it.key());
  EXPECT_EQ(std::count(header.begin(), header.end(), ','), long(keys.size()) - 1);
  for (const std::string& k : {"tokens", "gemm1_us", "commit", "driver"}) EXPECT_NE(header.find(k), std::string::npos);
  int lines = 0;
  while (std::getline(csv, line)) ++lines;
  EXPECT_EQ(lines, 2);
}

TEST(BenchRouting, ExpertCountsAreTheRoutedRows) {
  // bench_expert_counts (tune, bench --expert-counts, bench/regret_study.py) is the router's result.
  const MoeConfig c = bench_shape("deepseek-v3", WeightFormat::kMxfp4);
  for (BenchRouting r : {BenchRouting::kUniform, BenchRouting::kZipf})
    EXPECT_EQ(bench_expert_counts(c, 300, r, 1.0, 1), routed_counts(c, 300, r, 1.0, 1));
  // The CLI prints one JSON line per routing and token count, the counts summing to T x k.
  const auto out = test::run_cli("bench --expert-counts --shape 8,2,64,64 --tokens 4,16 --routing uniform,zipf");
  ASSERT_EQ(out.code, 0) << out.out;
  std::istringstream lines(out.out);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] != '{') continue;
    const auto j = nlohmann::json::parse(line);
    const auto counts = j.at("counts").get<std::vector<int>>();
    ASSERT_EQ(counts.size(), 8u);
    int sum = 0;
    for (int x : counts) sum += x;
    EXPECT_EQ(sum, 2 * j.at("tokens").get<int>());
    ++n;
  }
  EXPECT_EQ(n, 4);
}

// `bench --hash`: DeepSeek-V4's hash routing (a random table, random token ids), rows marked so.
TEST(BenchOutput, HashRoutedRows) {
  test::TempDir dir;
  const auto r = test::run_cli("bench --shape 16,4,64,64 --format bf16 --backend cpu --tokens 1,5 --reps 1 --hash "
                               "--routing uniform,zipf --json " + (dir / "h.json"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("hash (tid2eid) routing"), std::string::npos) << r.out;
  const auto j = nlohmann::json::parse(read(dir / "h.json"));
  ASSERT_EQ(j.size(), 2u);  // one routing: the table decides
  for (const auto& row : j) EXPECT_EQ(row.at("router"), "hash");
  const auto s = test::run_cli("bench --shape 8,2,64,64 --format bf16 --backend cpu --tokens 1 --reps 1 --json " +
                               (dir / "s.json"));
  ASSERT_EQ(s.code, 0) << s.out;
  EXPECT_EQ(nlohmann::json::parse(read(dir / "s.json"))[0].at("router"), "score");
}

TEST(BenchOutput, RoutingOptionsAreChecked) {
  EXPECT_EQ(test::run_cli("bench --shape 8,2,64,64 --format bf16 --routing skewed").code, 2);
  EXPECT_EQ(test::run_cli("bench --shape 8,2,64,64 --format bf16 --routing zipf --zipf-s -1").code, 2);
  EXPECT_EQ(test::run_cli("bench --shape 8,2,64,64 --format bf16 --split 1,x").code, 2);
  EXPECT_EQ(test::run_cli("bench --shape 8,2,64,64 --format bf16 --budget-ms -3").code, 2);
}

}  // namespace
}  // namespace moekit
