// route_cpu: softmax and group-limited sigmoid top-k routing (SPEC section 7, routing/routing.h),
// on hand-built logits whose answer is known, and against an independent double-precision
// implementation on random logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "moe_testutil.h"
#include "moekit/routing/routing.h"

namespace moekit {
namespace {

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> w;
};

// Runs route_cpu with poisoned outputs, so that a slot it forgets to write shows.
Routed route(const RoutingParams& p, const std::vector<float>& logits) {
  const int64_t T = int64_t(logits.size()) / p.num_experts;
  Routed r;
  r.ids.assign(size_t(T * p.top_k), -7);
  r.w.assign(size_t(T * p.top_k), NAN);
  route_cpu(p, logits.data(), T, r.ids.data(), r.w.data());
  return r;
}

std::set<int> id_set(const Routed& r, int64_t t, int k) {
  std::set<int> s;
  for (int j = 0; j < k; ++j) s.insert(r.ids[size_t(t * k + j)]);
  return s;
}

// Weight of expert e for token t (fails when e was not chosen).
float weight_of(const Routed& r, int64_t t, int k, int e) {
  for (int j = 0; j < k; ++j)
    if (r.ids[size_t(t * k + j)] == e) return r.w[size_t(t * k + j)];
  ADD_FAILURE() << "expert " << e << " not chosen for token " << t;
  return NAN;
}

std::vector<double> softmax_d(const float* l, int E) {
  double mx = l[0];
  for (int i = 1; i < E; ++i) mx = std::max(mx, double(l[i]));
  std::vector<double> p(static_cast<size_t>(E));
  double s = 0;
  for (int i = 0; i < E; ++i) s += (p[size_t(i)] = std::exp(double(l[i]) - mx));
  for (auto& v : p) v /= s;
  return p;
}

double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }

void expect_rel(double got, double want, double tol, const std::string& what) {
  EXPECT_LE(std::abs(got - want), tol * std::abs(want)) << what << ": got " << got << ", want " << want;
}

RoutingParams softmax_params(int E, int k, bool renorm, float rsf) {
  RoutingParams p;
  p.scoring = Scoring::kSoftmax;
  p.num_experts = E;
  p.top_k = k;
  p.renormalize = renorm;
  p.routed_scaling_factor = rsf;
  return p;
}

RoutingParams sigmoid_params(int E, int k, int n_group, int topk_group, bool renorm, float rsf,
                             const float* bias) {
  RoutingParams p;
  p.scoring = Scoring::kSigmoid;
  p.num_experts = E;
  p.top_k = k;
  p.renormalize = renorm;
  p.routed_scaling_factor = rsf;
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.score_bias = bias;
  return p;
}

TEST(Routing, SoftmaxPicksLargestWithTiesToLowerId) {
  const int E = 8, k = 3;
  // token 0: plain order; token 1: three-way tie at the top for two places after a clear
  // winner; token 2: exact tie at the boundary (ids 1, 4, 6 equal, k-th place); token 3: all equal.
  const std::vector<float> logits = {
      0.1f, 2.0f, -1.0f, 3.5f, 0.7f, 2.5f, -3.0f, 1.0f,   // -> {3, 5, 1}
      4.0f, 1.0f, 3.0f, -2.0f, 3.0f, 0.0f, 3.0f, 5.0f,    // -> {7, 0, 2} (2, 4, 6 tie at 3.0)
      -1.0f, 1.5f, 2.0f, 0.0f, 1.5f, 9.0f, 1.5f, -4.0f,   // -> {5, 2, 1} (1, 4, 6 tie)
      0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f,     // -> {0, 1, 2}
  };
  const std::vector<std::set<int>> want = {{3, 5, 1}, {7, 0, 2}, {5, 2, 1}, {0, 1, 2}};
  for (float rsf : {1.0f, 2.5f}) {
    const auto r = route(softmax_params(E, k, false, rsf), logits);
    for (int64_t t = 0; t < 4; ++t) {
      SCOPED_TRACE("token " + std::to_string(t) + " rsf " + std::to_string(rsf));
      EXPECT_EQ(id_set(r, t, k), want[size_t(t)]);
      const auto p = softmax_d(logits.data() + t * E, E);
      for (int e : want[size_t(t)]) expect_rel(weight_of(r, t, k, e), p[size_t(e)] * rsf, 1e-6, "weight");
    }
  }
}

TEST(Routing, SoftmaxTieOrderDoesNotDependOnPosition) {
  // The tied experts sit at the end of the row; only the lower ids of the tie may win.
  const int E = 16, k = 2;
  std::vector<float> logits(size_t(E), -1.0f);
  logits[15] = logits[13] = logits[9] = 2.0f;
  const auto r = route(softmax_params(E, k, true, 1.0f), logits);
  EXPECT_EQ(id_set(r, 0, k), (std::set<int>{9, 13}));
  EXPECT_FLOAT_EQ(r.w[0], 0.5f);
  EXPECT_FLOAT_EQ(r.w[1], 0.5f);
}

TEST(Routing, SoftmaxRenormalisedWeightsSumToScalingFactor) {
  const int E = 32, k = 4, T = 50;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> logits(size_t(T * E));
  for (auto& v : logits) v = nd(rng);
  for (float rsf : {1.0f, 2.5f, 0.125f}) {
    const auto r = route(softmax_params(E, k, true, rsf), logits);
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0, psum = 0;
      const auto p = softmax_d(logits.data() + t * E, E);
      for (int j = 0; j < k; ++j) {
        sum += r.w[size_t(t * k + j)];
        psum += p[size_t(r.ids[size_t(t * k + j)])];
      }
      expect_rel(sum, rsf, 1e-6, "sum of weights, token " + std::to_string(t));
      for (int j = 0; j < k; ++j) {
        const int e = r.ids[size_t(t * k + j)];
        expect_rel(r.w[size_t(t * k + j)], p[size_t(e)] / psum * rsf, 1e-6, "renormalised weight");
      }
    }
  }
}

TEST(Routing, SoftmaxWithoutRenormalisationGivesProbabilitiesTimesScale) {
  const int E = 24, k = 5, T = 40;
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> logits(size_t(T * E));
  for (auto& v : logits) v = nd(rng);
  const float rsf = 2.5f;
  const auto r = route(softmax_params(E, k, false, rsf), logits);
  for (int64_t t = 0; t < T; ++t) {
    const auto p = softmax_d(logits.data() + t * E, E);
    double sum = 0;
    for (int j = 0; j < k; ++j) {
      const int e = r.ids[size_t(t * k + j)];
      ASSERT_GE(e, 0);
      ASSERT_LT(e, E);
      expect_rel(r.w[size_t(t * k + j)], p[size_t(e)] * rsf, 1e-6, "weight");
      sum += r.w[size_t(t * k + j)];
    }
    EXPECT_LT(sum, rsf * (1 - 1e-4)) << "not renormalised: weights must not sum to rsf";
  }
}

// Chosen sigmoid scores that all underflow to 0: the renormalization divides by sum + 1e-20
// (routing.h, as the reference models do), so the weights are 0, not 0/0 = NaN.
TEST(Routing, RenormalizationOfAllZeroScoresGivesZeroWeights) {
  const std::vector<float> logits = {-200.0f, -150.0f, -300.0f, -120.0f};
  const auto r = route(sigmoid_params(4, 2, 1, 1, true, 2.5f, nullptr), logits);
  EXPECT_EQ(id_set(r, 0, 2), (std::set<int>{0, 1}));  // every score is 0: ties to the lower ids
  for (float w : r.w) EXPECT_EQ(w, 0.0f);
  // Ordinary sums are unchanged by the epsilon: softmax weights still sum to the scale exactly.
  const auto s = route(softmax_params(4, 2, true, 1.0f), {0.5f, 0.25f, -1.0f, 2.0f});
  EXPECT_FLOAT_EQ(s.w[0] + s.w[1], 1.0f);
}

TEST(Routing, SigmoidGroupLimitDropsBestExpertOfWeakGroup) {
  // E = 8 in 4 groups of 2; keep 2 groups, k = 2.
  // group 0: {6, -6}: holds the best single expert (0), but its top-2 sum is ~1.0
  // group 1: {2, 2}: ~1.76    group 2: {1.5, 1.4}: ~1.62    group 3: {-1, -1}: ~0.54
  const std::vector<float> logits = {6.0f, -6.0f, 2.0f, 2.0f, 1.5f, 1.4f, -1.0f, -1.0f};
  const auto plain = route(sigmoid_params(8, 2, 1, 1, false, 1.0f, nullptr), logits);
  EXPECT_EQ(id_set(plain, 0, 2), (std::set<int>{0, 2}));  // without groups expert 0 wins
  const auto grouped = route(sigmoid_params(8, 2, 4, 2, false, 1.0f, nullptr), logits);
  EXPECT_EQ(id_set(grouped, 0, 2), (std::set<int>{2, 3}));
  for (int e : {2, 3}) expect_rel(weight_of(grouped, 0, 2, e), sigmoid_d(logits[size_t(e)]), 1e-6, "weight");
  // k = 3 with two kept groups: the third pick comes from group 2, never from group 0.
  const auto k3 = route(sigmoid_params(8, 3, 4, 2, false, 1.0f, nullptr), logits);
  EXPECT_EQ(id_set(k3, 0, 3), (std::set<int>{2, 3, 4}));
}

TEST(Routing, SigmoidGroupScoreIsSumOfTopTwo) {
  // E = 16 in 4 groups of 4, keep 1 group, k = 2. Each rival rule picks a different group:
  //   max score        -> group 0 ({6, -6, -6, -6})
  //   sum of all four  -> group 2 ({0.5 x 4}: 4 * 0.62 = 2.49)
  //   sum of top two   -> group 1 ({1, 1, -6, -6}: 1.46 vs group 0's 1.0 and group 2's 1.25)
  const std::vector<float> logits = {6.0f, -6.0f, -6.0f, -6.0f,  1.0f, 1.0f, -6.0f, -6.0f,
                                     0.5f, 0.5f,  0.5f,  0.5f,   -6.0f, -6.0f, -6.0f, -5.0f};
  const auto r = route(sigmoid_params(16, 2, 4, 1, false, 1.0f, nullptr), logits);
  EXPECT_EQ(id_set(r, 0, 2), (std::set<int>{4, 5}));
  // The group's score is taken over the biased scores: a bias on expert 9 lifts group 2 above
  // group 1 (0.62 + 0.5 + 0.62 = 1.74 > 1.46), and expert 8 joins 9 (both beat group 2's others
  // only by id tie-break: 8, 10, 11 are equal).
  std::vector<float> bias(16, 0.0f);
  bias[9] = 0.5f;
  const auto b = route(sigmoid_params(16, 2, 4, 1, false, 1.0f, bias.data()), logits);
  EXPECT_EQ(id_set(b, 0, 2), (std::set<int>{8, 9}));
  for (int e : {8, 9}) expect_rel(weight_of(b, 0, 2, e), sigmoid_d(0.5), 1e-6, "weight without bias");
}

TEST(Routing, SigmoidGroupTiesGoToLowerGroup) {
  // Groups 1 and 3 tie exactly; topk_group = 1 keeps group 1.
  const std::vector<float> logits = {-1.0f, -1.0f, 2.0f, 1.0f, 0.0f, 0.0f, 2.0f, 1.0f};
  const auto r = route(sigmoid_params(8, 2, 4, 1, true, 1.0f, nullptr), logits);
  EXPECT_EQ(id_set(r, 0, 2), (std::set<int>{2, 3}));
}

TEST(Routing, SigmoidGroupsOfOneUseTheirOneScore) {
  // E = 4 in 4 groups of 1, keep 2: the same as plain top-2.
  const std::vector<float> logits = {0.3f, -2.0f, 1.0f, 0.9f, /* t1 */ -5.0f, 4.0f, -5.0f, 3.0f};
  const auto r = route(sigmoid_params(4, 2, 4, 2, false, 1.0f, nullptr), logits);
  EXPECT_EQ(id_set(r, 0, 2), (std::set<int>{2, 3}));
  EXPECT_EQ(id_set(r, 1, 2), (std::set<int>{1, 3}));
}

TEST(Routing, ScoreBiasChangesChoiceButNotWeights) {
  const int E = 8, k = 2;
  const std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f, -1.0f, -2.0f, -3.0f, -4.0f};
  std::vector<float> bias(size_t(E), 0.0f);
  bias[6] = 1.0f;  // sigmoid(-3) + 1 = 1.047 > sigmoid(3) = 0.953
  for (bool renorm : {false, true}) {
    SCOPED_TRACE(renorm ? "renormalised" : "raw");
    const float rsf = 2.5f;
    const auto nob = route(sigmoid_params(E, k, 1, 1, renorm, rsf, nullptr), logits);
    EXPECT_EQ(id_set(nob, 0, k), (std::set<int>{0, 1}));
    const auto wb = route(sigmoid_params(E, k, 1, 1, renorm, rsf, bias.data()), logits);
    EXPECT_EQ(id_set(wb, 0, k), (std::set<int>{0, 6}));
    const double s0 = sigmoid_d(3.0), s6 = sigmoid_d(-3.0);
    const double norm = renorm ? s0 + s6 : 1.0;
    expect_rel(weight_of(wb, 0, k, 0), s0 / norm * rsf, 1e-6, "weight of expert 0");
    expect_rel(weight_of(wb, 0, k, 6), s6 / norm * rsf, 1e-6, "weight of expert 6 (no bias)");
  }
}

// ---- an independent implementation, in double ------------------------------------------------

struct RefParams {
  Scoring scoring;
  int E, k, n_group, topk_group;
  bool renorm;
  double rsf;
  const float* bias;
};

std::vector<std::pair<int, double>> route_ref(const RefParams& p, const float* l) {
  std::vector<double> prob(size_t(p.E)), choice(size_t(p.E));
  std::vector<int> candidates;
  if (p.scoring == Scoring::kSoftmax) {
    prob = softmax_d(l, p.E);
    choice = prob;
    for (int e = 0; e < p.E; ++e) candidates.push_back(e);
  } else {
    for (int e = 0; e < p.E; ++e) {
      prob[size_t(e)] = sigmoid_d(l[e]);
      choice[size_t(e)] = prob[size_t(e)] + (p.bias ? double(p.bias[e]) : 0.0);
    }
    const int gs = p.E / p.n_group;
    std::vector<std::pair<double, int>> groups;  // (-score, g): sorts best first, ties lower g
    for (int g = 0; g < p.n_group; ++g) {
      std::vector<double> c(choice.begin() + g * gs, choice.begin() + (g + 1) * gs);
      std::sort(c.begin(), c.end(), std::greater<>());
      groups.push_back({-(gs == 1 ? c[0] : c[0] + c[1]), g});
    }
    std::sort(groups.begin(), groups.end());
    for (int i = 0; i < p.topk_group; ++i)
      for (int e = 0; e < gs; ++e) candidates.push_back(groups[size_t(i)].second * gs + e);
  }
  std::sort(candidates.begin(), candidates.end(), [&](int a, int b) {
    return choice[size_t(a)] != choice[size_t(b)] ? choice[size_t(a)] > choice[size_t(b)] : a < b;
  });
  std::vector<std::pair<int, double>> out;
  double sum = 0;
  for (int j = 0; j < p.k; ++j) {
    out.push_back({candidates[size_t(j)], prob[size_t(candidates[size_t(j)])]});
    sum += out.back().second;
  }
  for (auto& [e, w] : out) w = (p.renorm ? w / sum : w) * p.rsf;
  return out;
}

void compare_with_reference(const RefParams& rp, int64_t T, uint64_t seed, double tol) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> logits(size_t(T * rp.E));
  for (auto& v : logits) v = nd(rng);
  RoutingParams p;
  p.scoring = rp.scoring;
  p.num_experts = rp.E;
  p.top_k = rp.k;
  p.renormalize = rp.renorm;
  p.routed_scaling_factor = float(rp.rsf);
  p.n_group = rp.n_group;
  p.topk_group = rp.topk_group;
  p.score_bias = rp.bias;
  const auto r = route(p, logits);
  double worst = 0;
  int differs_from_plain = 0;
  for (int64_t t = 0; t < T; ++t) {
    const auto want = route_ref(rp, logits.data() + t * rp.E);
    std::set<int> ws;
    for (auto& [e, w] : want) ws.insert(e);
    ASSERT_EQ(id_set(r, t, rp.k), ws) << "token " << t;
    for (auto& [e, w] : want) {
      const double got = weight_of(r, t, rp.k, e);
      worst = std::max(worst, std::abs(got - w) / std::abs(w));
      EXPECT_LE(std::abs(got - w), tol * std::abs(w)) << "token " << t << " expert " << e;
    }
    if (rp.scoring == Scoring::kSigmoid && rp.n_group > 1) {
      RefParams plain = rp;
      plain.n_group = plain.topk_group = 1;
      std::set<int> ps;
      for (auto& [e, w] : route_ref(plain, logits.data() + t * rp.E)) ps.insert(e);
      differs_from_plain += ps != ws;
    }
  }
  ::testing::Test::RecordProperty("worst_rel_weight_error", test::fmt_e(worst));
  if (rp.scoring == Scoring::kSigmoid && rp.n_group > 1) {
    EXPECT_GT(differs_from_plain, int(T / 10)) << "the group limit must matter on this data";
  }
}

TEST(Routing, GroupedSigmoidMatchesDoubleReferenceOnRandomLogits) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nb(0.0f, 0.3f);
  std::vector<float> bias(64);
  for (auto& b : bias) b = nb(rng);
  for (bool renorm : {true, false})
    for (const float* b : {static_cast<const float*>(nullptr), static_cast<const float*>(bias.data())}) {
      SCOPED_TRACE(std::string(renorm ? "renorm" : "raw") + (b ? " bias" : " no bias"));
      compare_with_reference({Scoring::kSigmoid, 64, 6, 8, 3, renorm, 2.5, b}, 200, 21, 1e-6);
    }
}

TEST(Routing, SoftmaxMatchesDoubleReferenceOnRandomLogits) {
  for (bool renorm : {true, false}) {
    SCOPED_TRACE(renorm ? "renorm" : "raw");
    compare_with_reference({Scoring::kSoftmax, 64, 6, 1, 1, renorm, 1.0, nullptr}, 200, 22, 1e-6);
    compare_with_reference({Scoring::kSoftmax, 128, 8, 1, 1, renorm, 2.5, nullptr}, 130, 23, 1e-6);
  }
}

TEST(Routing, ParamsFromConfig) {
  LayerSpec c;
  c.num_experts = 16;
  c.top_k = 4;
  c.scoring = Scoring::kSigmoid;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.5f;
  c.n_group = 4;
  c.topk_group = 2;
  std::vector<float> bias(16, 0.25f);
  const RoutingParams p = routing_params(c, bias);
  EXPECT_EQ(p.scoring, Scoring::kSigmoid);
  EXPECT_EQ(p.num_experts, 16);
  EXPECT_EQ(p.top_k, 4);
  EXPECT_TRUE(p.renormalize);
  EXPECT_EQ(p.routed_scaling_factor, 2.5f);
  EXPECT_EQ(p.n_group, 4);
  EXPECT_EQ(p.topk_group, 2);
  EXPECT_EQ(p.score_bias, bias.data());
  EXPECT_EQ(routing_params(c, {}).score_bias, nullptr);
}

}  // namespace
}  // namespace moekit
