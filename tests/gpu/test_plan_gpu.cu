// The routing plan at prefill sizes (pipeline/prepare_finalize_sm90.cuh): the wide plan (three
// grids, from kWidePlanFrom entries) against a stable counting sort done here and against the
// one-CTA plan on the same ids, every output poisoned first: dest, row_src, the per-expert
// counts, the work list and the error word, in both activation formats, with -1 ids, ids out of
// range, every entry on one expert, a skewed load, batched capacity overflow and sizes around
// the slice and the threshold.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpu_util.h"
#include "plan_testutil.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit {
namespace {

using test::DeviceBuffer;
using test::expect_same;
using test::host_plan;
using test::PlanResult;
using test::set_plan_outputs;

// Runs launch_route_plan on the ids (bypass), with or without the wide plan's scratch.
PlanResult device_plan(const std::vector<int32_t>& ids, int E, int k, bool batched, int capacity, int64_t rows,
                       bool wide) {
  const int64_t N = int64_t(ids.size()), T = N / k;
  DeviceBuffer<int32_t> d_ids(ids), dest{size_t(N)}, rank{size_t(N)}, row_src{size_t(rows)};
  DeviceBuffer<float> weights{size_t(N)};
  DeviceBuffer<int> work{size_t(5 * E + 2)}, misc{size_t(2)},
      slices{size_t(std::max<int64_t>(1, sm90::plan_slice_ints(N, E)))};
  dest.poison(0xf9);
  rank.poison(0xf9);
  row_src.poison(0xf9);  // 0xf9f9f9f9: read back as -7 below
  work.poison(0xf9);
  slices.poison(0xf9);
  cudaMemset(misc.ptr, 0, 4);      // the ticket starts at 0 and is left at 0
  cudaMemset(misc.ptr + 1, 0x5a, 4);  // the error word: written by every plan
  sm90::PlanArgs a;
  a.route.p.num_experts = E;
  a.bypass = true;
  set_plan_outputs(a, T, k, batched, capacity, E, d_ids.ptr, weights.ptr, dest.ptr, rank.ptr, row_src.ptr, work.ptr,
                   misc.ptr);
  a.b.slice_rows = wide ? slices.ptr : nullptr;
  PlanResult r;
  EXPECT_EQ(sm90::launch_route_plan(a, nullptr, false), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  r.dest = dest.to_host();
  r.row_src = row_src.to_host();
  for (int32_t& v : r.row_src)
    if (v == int32_t(0xf9f9f9f9u)) v = -7;
  r.work = work.to_host();
  const std::vector<int> m = misc.to_host();
  EXPECT_EQ(m[0], 0) << "the ticket is left at 0";
  r.error = m[1];
  // The work list past num_active and row_src of unused rows are not part of the contract; the
  // host plan leaves them at 0 / -7, so compare only what is defined.
  const int active = r.work[0];
  if (active >= 0 && active <= E) {
    int* w = r.work.data();
    for (int j = active; j < E; ++j) w[1 + j] = w[1 + E + j] = w[1 + 2 * E + j] = 0;
    for (int j = active + 1; j <= E; ++j) w[1 + 3 * E + j] = 0;
  }
  return r;
}

TEST(Sm90Plan, WidePlanMatchesTheStableSortAndTheOneCtaPlan) {
  struct Case {
    int E, k;
    int64_t T;
    const char* pattern;
    bool batched;
    int capacity;  // batched; 0: T
  };
  const Case cases[] = {
      {128, 4, 1024, "uniform", false, 0},     // exactly kWidePlanFrom entries, two slices
      {128, 4, 1023, "uniform", false, 0},     // one below: the one-CTA plan either way
      {128, 8, 8192, "uniform", false, 0},     // 32 slices
      {256, 8, 8191, "uniform", false, 0},     // a partial last slice
      {32, 4, 16384, "skewed", false, 0},      // half the entries on 4 experts
      {128, 4, 4096, "one", false, 0},         // every entry on one expert
      {128, 4, 4096, "holes", false, 0},       // -1 ids, experts with no rows
      {128, 4, 2050, "bad", false, 0},         // ids out of range: error 1, those entries -1
      {1024, 8, 1500, "uniform", false, 0},    // many experts, few rows each
      {2048, 2, 4096, "uniform", false, 0},    // the most experts the wide plan takes
      {64, 8, 2048, "uniform", true, 0},       // batched
      {16, 8, 1024, "one", true, 700},         // batched overflow: error 2, rows past it -1
  };
  for (const Case& c : cases) {
    const std::string what = "E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) + " T=" +
                             std::to_string(c.T) + " " + c.pattern + (c.batched ? " batched" : "");
    SCOPED_TRACE(what);
    const int64_t N = c.T * c.k;
    std::mt19937 rng(uint32_t(N * 31 + c.E));
    std::vector<int32_t> ids(static_cast<size_t>(N));
    for (int64_t t = 0; t < c.T; ++t) {
      for (int j = 0; j < c.k; ++j) {
        int32_t id = int32_t(rng() % uint32_t(c.E));
        const std::string p = c.pattern;
        if (p == "one") id = 5 % c.E;
        if (p == "skewed" && rng() % 2 == 0) id = int32_t(rng() % 4);
        if (p == "holes" && (rng() % 5 == 0 || id % 3 == 0)) id = -1;
        if (p == "bad" && t % 97 == 3 && j == 1) id = t % 2 ? c.E : -2;
        ids[size_t(t * c.k + j)] = id;
      }
    }
    const int capacity = c.batched ? (c.capacity > 0 ? c.capacity : int(c.T)) : 0;
    const int64_t rows = c.batched ? int64_t(c.E) * capacity : N + int64_t(c.E) * (sm90::kRowAlign - 1);
    const PlanResult want = host_plan(ids, c.E, c.batched, capacity, rows);
    expect_same(want, device_plan(ids, c.E, c.k, c.batched, capacity, rows, true), "wide");
    const PlanResult one = device_plan(ids, c.E, c.k, c.batched, capacity, rows, false);
    if (want.error == 0) expect_same(want, one, "one CTA");  // with errors the two may differ in
                                                               // which rows of -1 they write
  }
}

}  // namespace
}  // namespace moekit
