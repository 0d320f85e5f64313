// The routing and plan of decode and small-prefill sizes (launch_route_plan up to 1024 entries:
// route_plan_fused, one CTA or a cluster of 2-16) against the CPU router and the host plan, every
// output poisoned first: ids and weights (learned: the same expert sets, weights by id within
// 1e-5; hash: the same ids slot by slot), dest, row_src, the counts, the work list and the error
// word, with the ticket and the hash flag left at 0. T = 1, 3, 5, 6, 8, 33, 64, 127, 128, 129
// for E = 256 and 384, k = 6 and 8, learned sqrtsoftplus (with its selection-only bias) and hash
// routing; bypass ids with -1 and bad ids; every token on the same experts; token ids outside
// the hash table (error 3); batched capacity overflow (error 2); softmax and sigmoid routers,
// E = 100 and 101 (not a multiple of 4: the logits staged 4 bytes a copy), E = 512 (a cluster
// of 8). RoutePlanSmall.* is the compute-sanitizer set (memcheck, racecheck).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gpu_util.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"
#include "plan_testutil.h"

namespace moekit {
namespace {

using test::DeviceBuffer;
using test::set_plan_outputs;

enum class Kind { kLearned, kHash, kBypass };

struct Case {
  int E, k;
  int64_t T;
  Kind kind;
  Scoring scoring = Scoring::kSqrtSoftplus;
  const char* pattern = "random";  // random | one (every token on the same experts) | holes
                                   // (bypass: -1 and bad ids) | badtok (hash: ids outside the table)
  bool batched = false;
  int capacity = 0;  // batched; 0: T
  bool wide_ids = false;  // hash: int64 token ids
};

std::string name_of(const Case& c) {
  const char* kind = c.kind == Kind::kLearned ? "learned" : c.kind == Kind::kHash ? "hash" : "bypass";
  const char* sc = c.scoring == Scoring::kSoftmax ? "softmax" : c.scoring == Scoring::kSigmoid ? "sigmoid" : "sqrtsoftplus";
  return std::string(kind) + " " + sc + " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) + " T=" +
         std::to_string(c.T) + " " + c.pattern + (c.batched ? " batched" : "");
}

void expect_same_id_sets(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int64_t T, int k) {
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t) {
    const std::multiset<int32_t> x(a.begin() + t * k, a.begin() + (t + 1) * k),
        y(b.begin() + t * k, b.begin() + (t + 1) * k);
    bad += x != y;
  }
  EXPECT_EQ(bad, 0) << "tokens whose expert sets differ";
}

void run_case(const Case& c) {
  SCOPED_TRACE(name_of(c));
  const int E = c.E, k = c.k;
  const int64_t T = c.T, N = T * k;
  const std::string pat = c.pattern;
  const int64_t V = 1000;
  std::mt19937 rng(uint32_t(E * 131 + k * 17 + T));
  // Inputs: logits N(0, 2); bias small (it moves choices) or +100 on experts 7.. (pattern one);
  // a table of k distinct experts per row; token ids (some outside the table for badtok).
  std::vector<float> logits = test::random_logits(std::max<int64_t>(N / k, 1) * E, uint64_t(E + 7 * T + k));
  std::vector<float> bias(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) bias[size_t(e)] = float(int(rng() % 200) - 100) * 1e-3f;
  if (pat == "one")
    for (int j = 0; j < k; ++j) bias[size_t((7 + 3 * j) % E)] = 100.0f;
  std::vector<int32_t> table(static_cast<size_t>(V * k));
  for (int64_t r = 0; r < V; ++r) {
    std::vector<int32_t> all(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) all[size_t(e)] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < k; ++j) table[size_t(r * k + j)] = pat == "one" ? (7 + 3 * j) % E : all[size_t(j)];
  }
  std::vector<int64_t> tok64(size_t(std::max<int64_t>(T, 1)));
  std::vector<bool> tok_bad(tok64.size(), false);
  for (int64_t t = 0; t < T; ++t) {
    tok64[size_t(t)] = int64_t(rng() % uint32_t(V));
    if (pat == "badtok" && t % 3 == 1) {
      tok64[size_t(t)] = t % 2 ? V + t : -1 - t;
      tok_bad[size_t(t)] = true;
    }
  }
  std::vector<int32_t> tok32(tok64.begin(), tok64.end());
  std::vector<int32_t> given(static_cast<size_t>(N));  // bypass ids
  for (int64_t i = 0; i < N; ++i) {
    int32_t id = int32_t(rng() % uint32_t(E));
    if (pat == "one") id = 5;
    if (pat == "holes" && rng() % 5 == 0) id = -1;
    if (pat == "holes" && i % 97 == 3) id = i % 2 ? E : -2;
    given[size_t(i)] = id;
  }

  const int capacity = c.batched ? (c.capacity > 0 ? c.capacity : int(T)) : 0;
  const int64_t rows = c.batched ? int64_t(E) * capacity : N + int64_t(E) * (sm90::kRowAlign - 1);
  DeviceBuffer<float> d_logits(logits), d_bias(bias), weights{size_t(std::max<int64_t>(N, 1))};
  DeviceBuffer<int32_t> d_table(table), d_tok32(tok32), ids{size_t(std::max<int64_t>(N, 1))},
      dest{size_t(std::max<int64_t>(N, 1))}, rank{size_t(std::max<int64_t>(N, 1))},
      row_src{size_t(std::max<int64_t>(rows, 1))};
  DeviceBuffer<int64_t> d_tok64(tok64);
  DeviceBuffer<int> work{size_t(5 * E + 2)}, misc{size_t(3)};
  if (c.kind == Kind::kBypass) {
    CUDA_OK(cudaMemcpy(ids.ptr, given.data(), size_t(N) * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(weights.ptr, 0x3c, size_t(std::max<int64_t>(N, 1)) * 4));
  } else {
    ids.poison(0xf9);
    weights.poison(0xff);
  }
  dest.poison(0xf9);
  row_src.poison(0xf9);
  work.poison(0xf9);
  CUDA_OK(cudaMemset(misc.ptr, 0, 4));          // ticket
  CUDA_OK(cudaMemset(misc.ptr + 1, 0x5a, 4));   // error word: written by every plan
  CUDA_OK(cudaMemset(misc.ptr + 2, 0, 4));      // the hash flag

  RoutingParams hp;  // host copy (route_cpu)
  hp.scoring = c.scoring;
  hp.num_experts = E;
  hp.top_k = k;
  hp.routed_scaling_factor = 2.5f;
  hp.renormalize = true;
  hp.score_bias = c.scoring != Scoring::kSoftmax ? bias.data() : nullptr;
  hp.hash_table = c.kind == Kind::kHash ? table.data() : nullptr;
  hp.hash_vocab = c.kind == Kind::kHash ? V : 0;
  sm90::PlanArgs a;
  a.route.p = hp;
  a.route.p.score_bias = hp.score_bias ? d_bias.ptr : nullptr;
  a.route.p.hash_table = hp.hash_table ? d_table.ptr : nullptr;
  a.route.logits = d_logits.ptr;
  a.route.token_ids = TokenIds{c.wide_ids ? static_cast<const void*>(d_tok64.ptr) : d_tok32.ptr, c.wide_ids};
  a.bypass = c.kind == Kind::kBypass;
  set_plan_outputs(a, T, k, c.batched, capacity, E, ids.ptr, weights.ptr, dest.ptr, rank.ptr, row_src.ptr, work.ptr,
                   misc.ptr);
  a.b.route_error = misc.ptr + 2;
  CUDA_OK(sm90::launch_route_plan(a, nullptr, false));
  CUDA_OK(cudaDeviceSynchronize());

  const std::vector<int32_t> g_ids = ids.to_host();
  const std::vector<float> g_w = weights.to_host();
  std::vector<int32_t> got_ids(g_ids.begin(), g_ids.begin() + N);
  if (c.kind != Kind::kBypass) {
    // The CPU router (bad token ids: routed as token 0, then -1 ids and 0 weights, as the GPU).
    std::vector<int64_t> tok_cpu = tok64;
    for (size_t t = 0; t < tok_cpu.size(); ++t)
      if (tok_bad[t]) tok_cpu[t] = 0;
    std::vector<int32_t> want_ids(static_cast<size_t>(N));
    std::vector<float> want_w(static_cast<size_t>(N));
    route_cpu(hp, logits.data(), T, want_ids.data(), want_w.data(), TokenIds{tok_cpu.data(), true});
    for (int64_t t = 0; t < T; ++t)
      if (tok_bad[size_t(t)])
        for (int j = 0; j < k; ++j) want_ids[size_t(t * k + j)] = -1, want_w[size_t(t * k + j)] = 0.0f;
    if (c.kind == Kind::kHash)
      EXPECT_EQ(got_ids, want_ids);
    else
      expect_same_id_sets(got_ids, want_ids, T, k);
    int64_t bad_w = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j)
        for (int q = 0; q < k; ++q)
          if (got_ids[size_t(t * k + j)] == want_ids[size_t(t * k + q)]) {
            const float x = g_w[size_t(t * k + j)], y = want_w[size_t(t * k + q)];
            bad_w += !(std::fabs(x - y) <= 1e-5f * std::fabs(y) + 1e-7f);
          }
    EXPECT_EQ(bad_w, 0) << "weights that differ";
  } else {
    for (int64_t i = 0; i < N; ++i) ASSERT_EQ(g_w[size_t(i)], g_w[0]) << "bypass: weights are not written";
  }

  // The plan of the ids the kernel chose (its own routing: near-ties may order a token's
  // experts differently from the CPU by an ulp; the plan is a function of the ids).
  test::PlanResult want = test::host_plan(got_ids, E, c.batched, capacity, rows);
  if (want.error == 0 && std::find(tok_bad.begin(), tok_bad.begin() + T, true) != tok_bad.begin() + T) want.error = 3;
  test::PlanResult got;
  got.dest = dest.to_host();
  got.row_src = row_src.to_host();
  for (int32_t& v : got.row_src)
    if (v == int32_t(0xf9f9f9f9u)) v = -7;
  got.dest.resize(size_t(N));
  got.row_src.resize(size_t(rows));
  got.work = work.to_host();
  const std::vector<int> m = misc.to_host();
  EXPECT_EQ(m[0], 0) << "the ticket is left at 0";
  EXPECT_EQ(m[2], 0) << "the hash flag is left at 0";
  got.error = m[1];
  const int active = got.work[0];
  if (active >= 0 && active <= E) {  // the work list past num_active is not part of the contract
    int* w = got.work.data();
    for (int j = active; j < E; ++j) w[1 + j] = w[1 + E + j] = w[1 + 2 * E + j] = 0;
    for (int j = active + 1; j <= E; ++j) w[1 + 3 * E + j] = 0;
  }
  test::expect_same(want, got, "plan");
}

const int64_t kTokens[] = {1, 3, 5, 6, 8, 33, 64, 127, 128, 129};

TEST(RoutePlan, DeepSeekV4SizesMatchTheCpu) {
  NEED_SM90();
  for (const int E : {256, 384})
    for (const int k : {6, 8})
      for (const Kind kind : {Kind::kLearned, Kind::kHash})
        for (const int64_t T : kTokens) {
          Case c{E, k, T, kind};
          c.wide_ids = T % 2 == 1;
          run_case(c);
          if (T == 8 || T == 128) {
            c.batched = true;
            run_case(c);
          }
        }
}

TEST(RoutePlan, SkewBadIdsAndOverflow) {
  NEED_SM90();
  for (const int E : {256, 384})
    for (const int k : {6, 8})
      for (const int64_t T : {int64_t(1), int64_t(6), int64_t(33), int64_t(128)}) {
        run_case(Case{E, k, T, Kind::kLearned, Scoring::kSqrtSoftplus, "one"});
        run_case(Case{E, k, T, Kind::kHash, Scoring::kSqrtSoftplus, "one"});
        run_case(Case{E, k, T, Kind::kHash, Scoring::kSqrtSoftplus, "badtok"});
        run_case(Case{E, k, T, Kind::kHash, Scoring::kSqrtSoftplus, "badtok", true});
        run_case(Case{E, k, T, Kind::kBypass, Scoring::kSqrtSoftplus, "holes"});
        run_case(Case{E, k, T, Kind::kBypass, Scoring::kSqrtSoftplus, "holes", true});
        run_case(Case{E, k, T, Kind::kBypass, Scoring::kSqrtSoftplus, "one"});
        run_case(Case{E, k, T, Kind::kBypass, Scoring::kSqrtSoftplus, "one", true, 3});  // overflow
      }
}

TEST(RoutePlan, OtherRoutersAndSizes) {
  NEED_SM90();
  for (const int64_t T : {int64_t(1), int64_t(4), int64_t(9), int64_t(32), int64_t(100), int64_t(128)}) {
    run_case(Case{128, 4, T, Kind::kLearned, Scoring::kSoftmax});              // GPT-OSS
    run_case(Case{128, 8, T, Kind::kLearned, Scoring::kSoftmax});              // Qwen3
    run_case(Case{8, 2, T, Kind::kLearned, Scoring::kSoftmax});                // Mixtral
    run_case(Case{256, 8, T, Kind::kLearned, Scoring::kSigmoid});              // no groups
    run_case(Case{100, 5, T, Kind::kLearned, Scoring::kSqrtSoftplus});         // E = 100
    run_case(Case{101, 5, T, Kind::kLearned, Scoring::kSqrtSoftplus});         // E % 4 != 0: 4-byte copies
    run_case(Case{512, 8, T, Kind::kLearned, Scoring::kSqrtSoftplus});         // a cluster of 8
    run_case(Case{100, 5, T, Kind::kHash, Scoring::kSigmoid, "badtok", false, 0, true});
    run_case(Case{384, 6, T, Kind::kLearned, Scoring::kSqrtSoftplus, "random", true});
  }
}

// Every cluster size and both plans' edges: T at each cluster step of 384 experts.
TEST(RoutePlan, ClusterSteps) {
  NEED_SM90();
  for (int64_t T = 1; T <= 170; T += 3) run_case(Case{384, 6, T, Kind::kLearned});
}

// The compute-sanitizer set: one CTA and a cluster of 8, hash with bad token ids, bypass.
TEST(RoutePlanSmall, Sanitize) {
  NEED_SM90();
  for (const int64_t T : {int64_t(1), int64_t(6), int64_t(128)}) run_case(Case{384, 6, T, Kind::kLearned});
  run_case(Case{384, 6, 40, Kind::kLearned, Scoring::kSqrtSoftplus, "random", true});
  run_case(Case{128, 4, 33, Kind::kLearned, Scoring::kSoftmax});
  run_case(Case{384, 6, 1, Kind::kHash, Scoring::kSqrtSoftplus, "badtok"});
  run_case(Case{384, 6, 33, Kind::kHash, Scoring::kSqrtSoftplus, "badtok", false, 0, true});
  run_case(Case{384, 6, 64, Kind::kBypass, Scoring::kSqrtSoftplus, "holes"});
}

}  // namespace
}  // namespace moekit
