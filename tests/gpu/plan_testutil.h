// The plan the SM90 routing kernels must make (pipeline/prepare_finalize_sm90.cuh), computed
// on the host from the ids, and its comparison (test_plan_gpu.cu, test_route_plan_gpu.cu).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::test {

// A plan launch's sizes and the tests' output buffers: ids / weights (written by routing, read
// by the plan), dest, rank, row_src, the work list packed in work (PlanBuffers::set_work), the
// done ticket and the error word in misc[0] and misc[1].
inline void set_plan_outputs(sm90::PlanArgs& a, int64_t T, int k, bool batched, int capacity, int E, int32_t* ids,
                             float* weights, int32_t* dest, int32_t* rank, int32_t* row_src, int* work, int* misc) {
  a.T = T;
  a.k = k;
  a.batched = batched;
  a.capacity = capacity;
  a.b.ids = ids;
  a.b.weights = weights;
  a.b.dest = dest;
  a.b.rank = rank;
  a.b.row_src = row_src;
  a.b.set_work(work, E);
  a.b.done = misc;
  a.b.error = misc + 1;
}

struct PlanResult {
  std::vector<int32_t> dest, row_src;
  std::vector<int> work;  // num_active, expert[E], count[E], row_start[E], chunk_prefix[E + 1], expert_count[E]
  int error = -1;
};

// The plan the kernels must make: experts in id order, each expert's entries in entry order,
// standard segments padded to kRowAlign rows (padding rows -1), batched expert e at e * capacity.
inline PlanResult host_plan(const std::vector<int32_t>& ids, int E, bool batched, int capacity, int64_t rows) {
  const int64_t N = int64_t(ids.size());
  PlanResult r;
  r.dest.assign(size_t(N), -1);
  r.row_src.assign(size_t(rows), -7);  // -7: not written (the poison, compared as such)
  r.work.assign(size_t(5 * E + 2), 0);
  std::vector<int> cnt(size_t(E), 0);
  bool bad = false, over = false;
  for (int32_t id : ids) {
    if (id < -1 || id >= E) bad = true;
    else if (id >= 0) ++cnt[size_t(id)];
  }
  std::vector<int> start(size_t(E) + 1, 0);
  int row = 0, active = 0, chunks = 0;
  int* expert = r.work.data() + 1;
  int* count = expert + E;
  int* row_start = count + E;
  int* chunk_prefix = row_start + E;
  int* expert_count = chunk_prefix + E + 1;
  for (int e = 0; e < E; ++e) {
    const int c = cnt[size_t(e)];
    start[size_t(e)] = batched ? e * capacity : row;
    expert_count[e] = c;
    over = over || (batched && c > capacity);
    if (c > 0) {
      expert[active] = e;
      count[active] = c;
      row_start[active] = start[size_t(e)];
      chunks += (c + sm90::kTokens - 1) / sm90::kTokens;
      chunk_prefix[active + 1] = chunks;
      ++active;
    }
    if (!batched) {
      const int span = (c + sm90::kRowAlign - 1) / sm90::kRowAlign * sm90::kRowAlign;
      for (int rr = row + c; rr < row + span; ++rr) r.row_src[size_t(rr)] = -1;
      row += span;
    }
  }
  r.work[0] = active;
  std::vector<int> seen(size_t(E), 0);
  for (int64_t i = 0; i < N; ++i) {
    const int32_t id = ids[size_t(i)];
    if (id < 0 || id >= E) continue;
    const int rank = seen[size_t(id)]++;
    if (batched && rank >= capacity) continue;
    const int32_t dst = start[size_t(id)] + rank;
    r.dest[size_t(i)] = dst;
    r.row_src[size_t(dst)] = int32_t(i);
  }
  r.error = bad ? 1 : over ? 2 : 0;
  return r;
}

inline void expect_same(const PlanResult& want, const PlanResult& got, const std::string& what) {
  EXPECT_EQ(got.error, want.error) << what;
  EXPECT_EQ(got.work, want.work) << what << ": counts or work list";
  size_t bad_dest = 0, bad_src = 0;
  for (size_t i = 0; i < want.dest.size(); ++i) bad_dest += got.dest[i] != want.dest[i];
  for (size_t i = 0; i < want.row_src.size(); ++i) bad_src += got.row_src[i] != want.row_src[i];
  EXPECT_EQ(bad_dest, 0u) << what << ": dest";
  EXPECT_EQ(bad_src, 0u) << what << ": row_src";
}

}  // namespace moekit::test
