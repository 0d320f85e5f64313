// moekit/pipeline/prepare_finalize_sm90.cuh — the SM90 backends' routing, prepare and finalize.
//
//   route_plan  one warp per token routes (or, with bypass ids, nothing is routed); the last CTA
//               to finish then plans: a stable counting sort of the (token, slot) entries by
//               expert gives every entry its row (dest) and every row its entry (row_src), and
//               the list of active experts the GEMMs walk.
//                 standard: expert segments in expert order, each padded to kRowAlign rows;
//                           padding rows have row_src = -1.
//                 batched:  expert e owns rows [e * capacity, e * capacity + counts[e]).
//               From kWidePlanFrom entries (prefill sizes) the plan is three grids instead of one
//               CTA (with PlanBuffers::slice_rows): route_plan routes only; plan_count counts each
//               slice of kPlanSlice entries per expert (stable ranks within the slice), its last
//               CTA turns the slice counts into row offsets and the work list; plan_assign
//               writes dest and row_src. The same rows as the one-CTA plan.
//               Decode sizes (at most 32 entries and 8 tokens, routing in registers, by hash,
//               or bypass) take route_plan_small: T warps route, one warp plans (the same
//               rows); one token's layer overhead is mostly this kernel's start and its
//               instruction fetches, so it carries only the code it runs.
//               Up to 1024 entries (learned routing without groups, hash routing without
//               softmax, bypass ids past 32) take route_plan_fused instead
//               (route_plan_fused_sm90.cuh): one launch, one CTA or a cluster of 2-8, the
//               routing and the plan in shared memory, the same rows. MOEKIT_ROUTE_PLAN=legacy
//               keeps the kernels above (A/B measurements).
//               Hash routing (RouteArgs::p.hash_table) routes by token id (route_token_hash); a
//               token id outside the table gives its row -1 ids and the error word 3.
//   permute     copies x[token] into its row of the activation buffer (stride K_pad; the
//               padding columns are written zero); with a run flag, only when it is not 0.
//   finalize    y[t] = bf16(sum over slots j, in order, of out[dest(t, j)] + shared[t]), fp32
//               sums, no atomics: the same bits on every run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moekit/experts/sm90_moe_gemm.cuh"
#include "moekit/pipeline/launch_sm90.cuh"
#include "moekit/routing/routing_sm90.cuh"

namespace moekit::sm90 {

constexpr int kRowAlign = 8;     // standard format: expert segments padded to the n8 tile
constexpr int kRouteWarps = 8;   // tokens per route_plan CTA

struct PlanBuffers {
  int32_t* ids = nullptr;         // [T, k]
  float* weights = nullptr;       // [T, k]
  int32_t* dest = nullptr;        // [T, k]
  int32_t* rank = nullptr;        // [T, k] scratch
  int32_t* row_src = nullptr;     // [rows]
  int* num_active = nullptr;      // [1]
  int* expert = nullptr;          // [E]
  int* count = nullptr;           // [E] per active expert
  int* row_start = nullptr;       // [E] per active expert
  int* chunk_prefix = nullptr;    // [E + 1]
  int* expert_count = nullptr;    // [E] per expert id
  int* done = nullptr;            // [1] CTA ticket, reset by the last CTA
  int* error = nullptr;           // [1] set when an id is out of range or a batch overflows, or a
                                  //     token id is outside the hash table (1, 2, 3; check())
  int* route_error = nullptr;     // [1] (hash routing) a token id outside the table: set while
                                  //     routing, turned into error = 3 and reset to 0 by the plan
  int* slice_rows = nullptr;      // [plan_slice_ints(T * k, E)] the wide plan's scratch (optional:
                                  // without it every size takes the one-CTA plan)

  DeviceWork work() const { return {num_active, expert, count, row_start, chunk_prefix}; }
  // The per-expert ints from one array of work_ints(E): num_active, expert[E], count[E],
  // row_start[E], chunk_prefix[E + 1], expert_count[E].
  static constexpr int64_t work_ints(int E) { return 5 * int64_t(E) + 2; }
  void set_work(int* w, int E) {
    num_active = w;
    expert = w + 1;
    count = expert + E;
    row_start = count + E;
    chunk_prefix = row_start + E;
    expert_count = chunk_prefix + E + 1;
  }
};

// No implicit padding: launch arguments are compared bytewise (launch_sm90.cuh).
struct PlanArgs {
  RouteArgs route;
  int64_t T = 0;
  PlanBuffers b;
  int k = 0;
  int capacity = 0;      // batched rows per expert
  bool bypass = false;   // ids/weights given: no routing
  bool batched = false;
  bool wide = false;     // set by launch_route_plan: route_plan routes, the plan grids plan
  uint8_t pad_[5] = {};
};

constexpr int kPlanSlice = 2048;          // entries per plan_count CTA (a slice)
constexpr int64_t kWidePlanFrom = 4096;   // entries from which the plan takes three grids
// Ints of PlanBuffers::slice_rows for N entries and E experts: per slice E counts and a bad-id flag.
inline int64_t plan_slice_ints(int64_t N, int E) { return (N + kPlanSlice - 1) / kPlanSlice * (int64_t(E) + 1); }

size_t route_plan_smem(int E);
cudaError_t launch_route_plan(const PlanArgs& a, cudaStream_t s, bool pdl);
// run (optional): a device flag; 0 makes every block return at once (kernel_choice_sm90.cuh).
cudaError_t launch_permute(const uint16_t* x, int64_t T, int k, int64_t H, int64_t K_pad,
                           const int32_t* dest, uint16_t* act, cudaStream_t s, bool pdl, const int* run = nullptr);
// y rows of y_stride elements (0: H); shared [T, H] bf16 rows of shared_stride (optional) are
// added before the rounding. y, shared and their strides: multiples of 4 elements.
cudaError_t launch_finalize(const float* out, const int32_t* dest, int64_t T, int k, int64_t H,
                            uint16_t* y, cudaStream_t s, bool pdl, int64_t y_stride = 0,
                            const uint16_t* shared = nullptr, int64_t shared_stride = 0);

}  // namespace moekit::sm90
