// Router logits of `moekit bench`: uniform or Zipf-skewed expert load.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "moekit/bench/bench.h"
#include "moekit/common/error.h"
#include "moekit/routing/routing.h"

namespace moekit {

namespace {

// splitmix64: a fast, seedable stream of 64-bit words (the logits of 16384 tokens x 256 experts
// are 4 M draws).
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double(next() >> 11) + 0.5) * 0x1.0p-53; }  // (0, 1)
};

}  // namespace

const char* bench_routing_name(BenchRouting r) { return r == BenchRouting::kZipf ? "zipf" : "uniform"; }

std::vector<double> bench_expert_probabilities(int E, BenchRouting r, double zipf_s, uint64_t seed) {
  std::vector<double> p(size_t(E), 1.0 / E);
  if (r == BenchRouting::kUniform) return p;
  MOEKIT_REQUIRE(zipf_s >= 0 && std::isfinite(zipf_s), "bench: the Zipf exponent must be >= 0, got ", zipf_s);
  // Which expert has which rank: a permutation drawn from the seed alone, so that the same
  // experts are hot at every token count of a sweep.
  std::vector<int> rank(static_cast<size_t>(E));
  std::iota(rank.begin(), rank.end(), 0);
  Rng g{seed ^ 0x5a17c0de5a17c0deull};
  for (int i = E - 1; i > 0; --i) std::swap(rank[size_t(i)], rank[size_t(g.next() % uint64_t(i + 1))]);
  double sum = 0;
  for (int e = 0; e < E; ++e) sum += p[size_t(e)] = std::pow(double(rank[size_t(e)] + 1), -zipf_s);
  for (double& x : p) x /= sum;
  return p;
}

std::vector<float> bench_router_logits(const MoeConfig& c, int64_t T, BenchRouting r, double zipf_s, uint64_t seed) {
  const int E = c.num_experts;
  std::vector<float> lg(size_t(T) * size_t(E));
  Rng g{seed * 0x2545f4914f6cdd1dull + uint64_t(T)};
  if (r == BenchRouting::kUniform) {
    // Small random logits N(0, 0.1) (Box-Muller): every expert equally likely, weights near 1/k.
    for (size_t i = 0; i < lg.size(); i += 2) {
      const double m = std::sqrt(-2.0 * std::log(g.uniform())), a = 2.0 * M_PI * g.uniform();
      lg[i] = float(0.1 * m * std::cos(a));
      if (i + 1 < lg.size()) lg[i + 1] = float(0.1 * m * std::sin(a));
    }
    return lg;
  }
  // log p + Gumbel noise: the k largest of these are k distinct experts drawn without replacement
  // with probabilities p (the Gumbel top-k trick), and both routers keep the k largest logits
  // (sigmoid is monotone; its group limit may trade a chosen expert for one of a kept group).
  const std::vector<double> p = bench_expert_probabilities(E, r, zipf_s, seed);
  std::vector<float> logp(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) logp[size_t(e)] = float(std::log(p[size_t(e)]));
  for (size_t i = 0; i < lg.size(); ++i) lg[i] = logp[i % size_t(E)] - float(std::log(-std::log(g.uniform())));
  return lg;
}

std::vector<int> bench_expert_counts(const MoeConfig& c, int64_t T, BenchRouting r, double zipf_s, uint64_t seed) {
  const std::vector<float> lg = bench_router_logits(c, T, r, zipf_s, seed);
  std::vector<int32_t> ids(size_t(T) * size_t(c.top_k));
  std::vector<float> w(ids.size());
  const std::vector<float> no_bias;  // the bench's score bias is zero
  route_cpu(routing_params(c, no_bias), lg.data(), T, ids.data(), w.data());
  std::vector<int> counts(size_t(c.num_experts), 0);
  for (int32_t e : ids)
    if (e >= 0 && e < c.num_experts) ++counts[size_t(e)];
  return counts;
}

}  // namespace moekit
