#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cub/block/block_scan.cuh>

#include "moekit/common/kernel_attr.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"
#include "moekit/pipeline/route_plan_fused_sm90.cuh"

namespace moekit::sm90 {

namespace {

// Shared memory of route_plan: per routing warp 2E floats + E bytes; the planner reuses it as
// hist[kRouteWarps][E] ints and E + 1 ints of padded offsets.
__host__ __device__ size_t route_smem_bytes(int E) {
  const size_t route = size_t(kRouteWarps) * (size_t(E) * 9 + 16);
  const size_t plan = ((size_t(kRouteWarps) + 2) * size_t(E) + 1) * 4;
  return route > plan ? route : plan;
}

// The plan of up to 32 (token, slot) entries by one warp, entry i in lane i (id -1: empty or
// lane >= N): the same rows as the block plan below (stable by entry within an expert, experts
// in id order), with warp intrinsics and no block barrier. E <= kPlanWarpExperts; smem: E + 6 * 32
// ints.
constexpr int kPlanWarpExperts = 1024;
// tok_bad: a routed token's id was outside the hash table (error word 3).
__device__ void plan_warp(const PlanArgs& a, int id, int* smem, bool tok_bad = false) {
  const int E = a.route.p.num_experts, lane = threadIdx.x & 31;
  const int N = int(a.T * a.k);
  int* ecount = smem;                                      // [E] rows of each expert
  uint32_t* bits = reinterpret_cast<uint32_t*>(smem + E);  // [32] active experts, one bit each
  int* s_e = smem + E + 32;  // [32] per active slot: expert, rows, padded rows, chunks, first row
  int* s_cnt = s_e + 32;
  int* s_span = s_cnt + 32;
  int* s_ch = s_span + 32;
  int* s_start = s_ch + 32;
  const bool bad = lane < N && (id < -1 || id >= E);
  if (bad || lane >= N) id = -1;
  for (int e = lane; e < E; e += 32) ecount[e] = 0;
  bits[lane] = 0;
  const uint32_t lt = (1u << lane) - 1u;
  const uint32_t peers = __match_any_sync(0xffffffffu, id);
  const int rank = __popc(peers & lt), cnt = __popc(peers);
  const bool leader = id >= 0 && (peers & lt) == 0;
  __syncwarp();
  if (leader) {
    ecount[id] = cnt;
    atomicOr(bits + (id >> 5), 1u << (id & 31));
  }
  __syncwarp();
  // Slot of this entry's expert among the active ones: active experts with a smaller id.
  int pos = 0;
  if (id >= 0) {
    for (int w = 0; w < (id >> 5); ++w) pos += __popc(bits[w]);
    pos += __popc(bits[id >> 5] & ((1u << (id & 31)) - 1u));
  }
  const int active = __popc(__ballot_sync(0xffffffffu, leader));
  if (leader) {
    s_e[pos] = id;
    s_cnt[pos] = cnt;
    s_span[pos] = a.batched ? 0 : (cnt + kRowAlign - 1) / kRowAlign * kRowAlign;
    s_ch[pos] = (cnt + kTokens - 1) / kTokens;
  }
  __syncwarp();
  // Lane p < active: inclusive scans of padded rows and chunks over slots 0..p.
  int span = lane < active ? s_span[lane] : 0, ch = lane < active ? s_ch[lane] : 0;
  int rows = span, chunks = ch;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int r = __shfl_up_sync(0xffffffffu, rows, off),
              c = __shfl_up_sync(0xffffffffu, chunks, off);
    if (lane >= off) rows += r, chunks += c;
  }
  if (lane < active) {
    const int e = s_e[lane], c = s_cnt[lane];
    const int start = a.batched ? e * a.capacity : rows - span;
    s_start[lane] = start;
    a.b.expert[lane] = e;
    a.b.count[lane] = c;
    a.b.row_start[lane] = start;
    a.b.chunk_prefix[lane + 1] = chunks;
    for (int r = start + c; r < start + span; ++r) a.b.row_src[r] = -1;  // padding rows
  }
  for (int e = lane; e < E; e += 32) a.b.expert_count[e] = ecount[e];
  __syncwarp();
  bool overflow = false;
  if (lane < N) {
    int32_t row = -1;
    if (id >= 0) {
      row = s_start[pos] + rank;
      if (a.batched && rank >= a.capacity)
        row = -1, overflow = true;
      else
        a.b.row_src[row] = lane;
    }
    a.b.dest[lane] = row;
  }
  const bool any_bad = __any_sync(0xffffffffu, bad),
             any_overflow = __any_sync(0xffffffffu, overflow);
  if (lane == 0) {
    a.b.chunk_prefix[0] = 0;
    *a.b.num_active = active;
    *a.b.error = any_bad ? 1 : tok_bad ? 3 : any_overflow ? 2 : 0;
  }
}

// The experts' part of a plan, one thread per expert (blocks of kThreads = blockDim.x experts):
// count(e), called once by expert e's thread, gives its rows. Writes expert_count, the work list
// (expert, count, row_start, chunk_prefix, num_active) and seg_start[0..E]: each expert's first
// row, then the rows of all segments with their padding. Returns whether this thread's expert
// has more rows than a batched expert holds.
template <int kThreads, typename Count>
__device__ bool plan_experts(const PlanArgs& a, int E, int* seg_start, Count count) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  bool over = false;
  int row = 0, active = 0, chunks = 0;
  for (int e0 = 0; e0 < E; e0 += kThreads) {
    const int e = e0 + threadIdx.x;
    int c = 0;
    if (e < E) {
      c = count(e);
      a.b.expert_count[e] = c;
      over = over || (a.batched && c > a.capacity);
    }
    const int span = a.batched ? 0 : (c + kRowAlign - 1) / kRowAlign * kRowAlign;
    const int ch = (c + kTokens - 1) / kTokens;
    int x_span, x_act, x_ch, t_span, t_act, t_ch;
    Scan(scan_tmp).ExclusiveSum(span, x_span, t_span);
    __syncthreads();
    Scan(scan_tmp).ExclusiveSum(c > 0 ? 1 : 0, x_act, t_act);
    __syncthreads();
    Scan(scan_tmp).ExclusiveSum(ch, x_ch, t_ch);
    __syncthreads();
    if (e < E) {
      const int start = a.batched ? e * a.capacity : row + x_span;
      seg_start[e] = start;
      if (c > 0) {
        const int ai = active + x_act;
        a.b.expert[ai] = e;
        a.b.count[ai] = c;
        a.b.row_start[ai] = start;
        a.b.chunk_prefix[ai + 1] = chunks + x_ch + ch;
      }
    }
    row += t_span, active += t_act, chunks += t_ch;
  }
  if (threadIdx.x == 0) {
    a.b.chunk_prefix[0] = 0;
    *a.b.num_active = active;
    seg_start[E] = row;
  }
  return over;
}

__global__ void __launch_bounds__(kRouteWarps * 32) route_plan_kernel(const PlanArgs a) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int E = a.route.p.num_experts;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t N = a.T * a.k;
  ptx::grid_dependency_wait();
  // The GEMM kernel that follows may start now: its CTAs set up while this one routes, and its
  // griddepcontrol.wait returns once this grid has completed and its writes are visible.
  ptx::launch_dependents();

  // One CTA with few (token, expert) rows keeps ids and ranks in shared memory: no round trips.
  constexpr int kFewRows = 256;
  __shared__ int32_t s_ids[kFewRows], s_rank[kFewRows];
  const bool few = gridDim.x == 1 && !a.bypass && N <= kFewRows;

  // ---- routing: one warp per token ----
  if (!a.bypass) {
    const int64_t t = int64_t(blockIdx.x) * kRouteWarps + warp;
    float* prob = reinterpret_cast<float*>(smem) + size_t(warp) * 2 * E;
    float* choice = prob + E;
    uint8_t* allowed = smem + size_t(kRouteWarps) * 8 * E + size_t(warp) * (E + 16);
    if (t < a.T) {
      if (a.route.p.hash_table) {
        if (route_token_hash(a.route, t, a.route.logits + t * E, a.b.ids + t * a.k, a.b.weights + t * a.k,
                             few ? s_ids + t * a.k : nullptr) &&
            lane == 0 && a.b.route_error)
          atomicExch(a.b.route_error, 1);  // turned into the error word by the plan
      } else if (regs_routing_ok(a.route.p)) {
        route_token_regs<kRegExperts>(a.route, a.route.logits + t * E, a.b.ids + t * a.k,
                                      a.b.weights + t * a.k, few ? s_ids + t * a.k : nullptr);
      } else {  // (a 12-per-lane instantiation here makes ptxas spill: the decode kernel has it)
        route_token_warp(a.route, a.route.logits + t * E, prob, choice, allowed, a.b.ids + t * a.k,
                         a.b.weights + t * a.k, few ? s_ids + t * a.k : nullptr);
      }
    }
  }
  if (a.wide) return;  // the plan grids plan
  // The last CTA to finish routing plans (one CTA: no ticket needed).
  if (gridDim.x > 1) {
    __threadfence();
    __syncthreads();
    __shared__ int is_last;
    if (threadIdx.x == 0) {
      const int ticket = atomicAdd(a.b.done, 1);
      is_last = ticket == int(gridDim.x) - 1;
      if (is_last) *a.b.done = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
  }
  __syncthreads();

  // ---- plan (last CTA): stable counting sort by expert ----
  int* hist = reinterpret_cast<int*>(smem);           // [kRouteWarps][E]
  for (int i = threadIdx.x; i < kRouteWarps * E; i += blockDim.x) hist[i] = 0;
  if (threadIdx.x == 0) *a.b.error = 0;
  __syncthreads();
  // This one CTA walks all T k entries twice (here and below): the loads of kPlanU rounds are
  // issued before any is used, or the walk is one L2 round trip per 32 entries per warp (H100,
  // 8192 tokens: the layer's routing part 164 -> 115 us for GPT-OSS-120B, 328 -> 234 DeepSeek-V3).
  constexpr int kPlanU = 8;
  const int64_t per_warp = (N + kRouteWarps - 1) / kRouteWarps;
  const int64_t w0 = min(N, warp * per_warp), w1 = min(N, w0 + per_warp);
  for (int64_t base = w0; base < w1; base += 32 * kPlanU) {
    int ids[kPlanU];
#pragma unroll
    for (int u = 0; u < kPlanU; ++u) {
      const int64_t i = base + 32 * u + lane;
      ids[u] = i >= w1 ? -1 : few ? s_ids[i] : __ldcg(a.b.ids + i);
    }
#pragma unroll
    for (int u = 0; u < kPlanU; ++u) {
      const int64_t i = base + 32 * u + lane;
      int id = ids[u];
      if (id < -1 || id >= E) {
        atomicExch(a.b.error, 1);
        id = -1;
      }
      const unsigned peers = __match_any_sync(0xffffffffu, id);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      if (id >= 0) {
        const int r = hist[warp * E + id] + rank;
        if (few) s_rank[i] = r; else a.b.rank[i] = r;
      }
      __syncwarp();
      if (id >= 0 && rank == 0) hist[warp * E + id] += __popc(peers);
      __syncwarp();
    }
  }
  __syncthreads();
  // One thread per expert: its rows per routing warp become offsets, then the experts' scans.
  int* seg_start = hist + size_t(kRouteWarps) * E;    // [E + 1] first row of each expert
  const bool over = plan_experts<kRouteWarps * 32>(a, E, seg_start, [&](int e) {
    int c = 0;
    for (int w = 0; w < kRouteWarps; ++w) {
      const int h = hist[w * E + e];
      hist[w * E + e] = c;
      c += h;
    }
    return c;
  });
  if (over) atomicExch(a.b.error, 2);
  __syncthreads();
  // A token id outside the hash table (the routing CTAs' flag, visible after the ticket's
  // fences): error word 3 unless an id was out of range; the flag is reset for the next call.
  if (a.b.route_error && threadIdx.x == 0 && atomicExch(a.b.route_error, 0) != 0 && atomicAdd(a.b.error, 0) != 1)
    atomicExch(a.b.error, 3);
  if (!a.batched)  // padding rows of the standard format are marked -1
    for (int r = threadIdx.x; r < seg_start[E]; r += blockDim.x) a.b.row_src[r] = -1;
  __syncthreads();
  for (int64_t i0 = threadIdx.x; i0 < N; i0 += int64_t(blockDim.x) * kPlanU) {
    int ids[kPlanU], rks[kPlanU];
#pragma unroll
    for (int u = 0; u < kPlanU; ++u) {
      const int64_t i = i0 + int64_t(u) * blockDim.x;
      ids[u] = i >= N ? -1 : few ? s_ids[i] : __ldcg(a.b.ids + i);
      rks[u] = i >= N ? 0 : few ? s_rank[i] : __ldcg(a.b.rank + i);  // meaningful for valid ids only
    }
#pragma unroll
    for (int u = 0; u < kPlanU; ++u) {
      const int64_t i = i0 + int64_t(u) * blockDim.x;
      if (i >= N) break;
      const int id = ids[u];
      int32_t row = -1;
      if (id >= 0 && id < E) {
        const int w = N <= INT32_MAX ? int(uint32_t(i) / uint32_t(per_warp)) : int(i / per_warp);  // no 64-bit divide
        row = seg_start[id] + hist[w * E + id] + rks[u];
        if (a.batched && row >= seg_start[id] + a.capacity) row = -1;  // overflow (error flagged)
        else a.b.row_src[row] = int32_t(i);
      }
      a.b.dest[i] = row;
    }
  }
}

// ---- the wide plan (PlanArgs::wide; prepare_finalize_sm90.cuh) ----
// plan_count: CTA g counts slice g (kPlanSlice entries) per expert, kPlanCountWarps warps of
// kPlanSlice / kPlanCountWarps consecutive entries each (all loads in flight at once), and
// stores each entry's rank among its expert's entries of the slice; slice_rows[g] gets the
// counts and a bad-id flag. The last CTA (ticket) sums the slices per expert, runs the experts'
// scans, turns slice_rows[g][e] into slice g's first row of expert e, marks the padding rows
// and writes the error word.
constexpr int kPlanCountWarps = 16;
constexpr int kPlanCountThreads = kPlanCountWarps * 32;
constexpr int kWidePlanMaxExperts = 2048;  // shared memory: kPlanCountWarps x E ints
__global__ void __launch_bounds__(kPlanCountThreads) plan_count_kernel(const PlanArgs a) {
  extern __shared__ __align__(16) int hist[];  // [kPlanCountWarps][E]
  constexpr int kU = kPlanSlice / kPlanCountThreads;
  const int E = a.route.p.num_experts;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t N = a.T * a.k;
  int* const sr = a.b.slice_rows;
  __shared__ int s_bad, is_last;
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  for (int i = threadIdx.x; i < kPlanCountWarps * E; i += kPlanCountThreads) hist[i] = 0;
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  const int64_t base = int64_t(blockIdx.x) * kPlanSlice + int64_t(warp) * 32 * kU + lane;
  int ids[kU], rks[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) ids[u] = base + 32 * u < N ? __ldcg(a.b.ids + base + 32 * u) : -1;
  bool bad = false;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    if (ids[u] < -1 || ids[u] >= E) bad = true, ids[u] = -1;
    const int id = ids[u];
    const unsigned peers = __match_any_sync(0xffffffffu, id);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    rks[u] = id >= 0 ? hist[warp * E + id] + rank : 0;
    __syncwarp();
    if (id >= 0 && rank == 0) hist[warp * E + id] += __popc(peers);
    __syncwarp();
  }
  if (bad) s_bad = 1;
  __syncthreads();
  int* const mine = sr + int64_t(blockIdx.x) * (E + 1);
  for (int e = threadIdx.x; e < E; e += kPlanCountThreads) {  // per warp: offsets; the slice: counts
    int c = 0;
    for (int w = 0; w < kPlanCountWarps; ++w) {
      const int h = hist[w * E + e];
      hist[w * E + e] = c;
      c += h;
    }
    mine[e] = c;
  }
  if (threadIdx.x == 0) mine[E] = s_bad;
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (ids[u] >= 0) a.b.rank[base + 32 * u] = hist[warp * E + ids[u]] + rks[u];

  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atomicAdd(a.b.done, 1) == int(gridDim.x) - 1;
    if (is_last) *a.b.done = 0;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int G = int(gridDim.x);
  int* seg_start = hist;  // [E + 1]
  const bool over = plan_experts<kPlanCountThreads>(a, E, seg_start, [&](int e) {
    int c = 0;
    for (int g0 = 0; g0 < G; g0 += 8) {
      int v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = g0 + u < G ? __ldcg(sr + int64_t(g0 + u) * (E + 1) + e) : 0;
#pragma unroll
      for (int u = 0; u < 8; ++u) c += v[u];
    }
    return c;
  });
  bool any = false;
  for (int g = threadIdx.x; g < G; g += kPlanCountThreads) any = any || __ldcg(sr + int64_t(g) * (E + 1) + E) != 0;
  const int any_bad = __syncthreads_or(any), any_over = __syncthreads_or(over);  // and seg_start is whole
  for (int e = threadIdx.x; e < E; e += kPlanCountThreads) {
    int row = seg_start[e];
    for (int g = 0; g < G; ++g) {
      int* p = sr + int64_t(g) * (E + 1) + e;
      const int c = __ldcg(p);
      *p = row;
      row += c;
    }
    if (!a.batched)  // padding rows of the standard format are marked -1
      for (int r = row; r < seg_start[e + 1]; ++r) a.b.row_src[r] = -1;
  }
  if (threadIdx.x == 0) {
    // route_plan (wide) has completed before this grid's wait returned: its token-id flag is here.
    const bool tok_bad = a.b.route_error && atomicExch(a.b.route_error, 0) != 0;
    *a.b.error = any_bad ? 1 : tok_bad ? 3 : any_over ? 2 : 0;
  }
}

// plan_assign: one thread per entry: its row (its slice's first row of its expert + its rank),
// dest and row_src; past a batched expert's capacity, -1 (the error word says so).
constexpr int kPlanAssignThreads = 256;
__global__ void __launch_bounds__(kPlanAssignThreads) plan_assign_kernel(const PlanArgs a) {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const int E = a.route.p.num_experts;
  const int64_t i = int64_t(blockIdx.x) * kPlanAssignThreads + threadIdx.x;
  if (i >= a.T * a.k) return;
  const int id = __ldcg(a.b.ids + i);
  int32_t row = -1;
  if (id >= 0 && id < E) {
    row = __ldcg(a.b.slice_rows + (i / kPlanSlice) * (E + 1) + id) + __ldcg(a.b.rank + i);
    if (a.batched && row >= (id + 1) * a.capacity)
      row = -1;
    else
      a.b.row_src[row] = int32_t(i);
  }
  a.b.dest[i] = row;
}

// Decode: up to 32 (token, slot) entries, so at most 32 tokens (here at most kRouteWarps, one
// warp each) and one warp's plan. Its own kernel, T warps wide, with only the code it runs: at
// one token the layer's overhead is this kernel, and much of that is fetching its instructions.
// kJ = 0: hash routing (route_token_hash), no scores in registers.
template <int kJ>
__global__ void route_plan_small_kernel(const PlanArgs a) {
  extern __shared__ __align__(16) int smem_i[];
  __shared__ int32_t s_ids[32];
  __shared__ int s_tok_bad[kRouteWarps];  // per routing warp: its token id was outside the table
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int N = int(a.T * a.k);
  ptx::grid_dependency_wait();
  ptx::launch_dependents();  // as in route_plan_kernel
  if (!a.bypass && warp < a.T) {
    const float* logits = a.route.logits + int64_t(warp) * a.route.p.num_experts;
    if constexpr (kJ == 0) {
      const bool bad = route_token_hash(a.route, warp, logits, a.b.ids + warp * a.k, a.b.weights + warp * a.k,
                                        s_ids + warp * a.k);
      if (lane == 0) s_tok_bad[warp] = bad;
    } else {
      route_token_regs<kJ>(a.route, logits, a.b.ids + warp * a.k, a.b.weights + warp * a.k, s_ids + warp * a.k);
    }
  }
  if (blockDim.x > 32) __syncthreads();  // the other warps' ids
  if (warp != 0) return;
  __syncwarp();
  bool tok_bad = false;
  if constexpr (kJ == 0) tok_bad = __any_sync(0xffffffffu, !a.bypass && lane < a.T && s_tok_bad[lane] != 0);
  const int id = lane < N ? (a.bypass ? __ldcg(a.b.ids + lane) : s_ids[lane]) : -1;
  plan_warp(a, id, smem_i, tok_bad);
}

__global__ void permute_kernel(const uint16_t* x, int k, int64_t H, int64_t K_pad,
                               const int32_t* dest, uint16_t* act, const int* run) {
  // x rows have stride K_pad too (the layer keeps its input padded).
  ptx::grid_dependency_wait();
  const int64_t i = blockIdx.x;
  const int32_t row = run && *run == 0 ? -1 : dest[i];  // run: the device chose the decode kernel
  ptx::launch_dependents();
  if (row < 0) return;
  const uint4* src = reinterpret_cast<const uint4*>(x + (i / k) * K_pad);
  uint4* dst = reinterpret_cast<uint4*>(act + int64_t(row) * K_pad);
  // The padding columns [H, K_pad) are zeroed here: act may be a caller's workspace.
  for (int64_t c = threadIdx.x; c < K_pad / 8; c += blockDim.x) dst[c] = c < H / 8 ? src[c] : make_uint4(0, 0, 0, 0);
}

// 64 threads of 60 registers (cuobjdump -res-usage; a 64-register cap makes ptxas spill): 4096
// registers once rounded, what three GEMM CTAs leave free on an SM (3 x 160 threads x 128), so
// finalize's CTAs become resident as soon as the GEMM triggers them and wait in
// griddepcontrol.wait instead of launching after the GEMM's CTAs have left. If either kernel
// grows, finalize only launches later; nothing else depends on it.
// At prefill sizes (T >= kFinalizeWideFrom) a CTA takes kFinalizeWide tokens, one 64-thread row
// each (threadIdx.y): one CTA per token was ~100k CTAs of 64 threads at 8192 GPT-OSS tokens.
// There each thread keeps kU x kCols = 8 float4 loads in flight: kU rows (slots) of kCols
// column groups 256 columns apart, so that k = 2 or 4 reads as many bytes at once as k = 8.
constexpr int kFinalizeThreads = 64;
constexpr int kFinalizeWide = 8, kFinalizeWideFrom = 1024;
template <int kRows, int kU, int kCols>  // tokens per CTA, slots and column groups per step
__global__ void __launch_bounds__(kFinalizeThreads * kRows)
    finalize_kernel(const float* out, const int32_t* dest, int64_t T, int k, int64_t H, uint16_t* y,
                    int64_t y_stride, const uint16_t* shared, int64_t shared_stride) {
  const int64_t t = kRows == 1 ? int64_t(blockIdx.y) : int64_t(blockIdx.y) * kRows + threadIdx.y;
  const int64_t c0 = (int64_t(blockIdx.x) * kCols * kFinalizeThreads + threadIdx.x) * 4;
  constexpr int64_t kStep = 4 * kFinalizeThreads;  // columns between a thread's groups
  if (kRows > 1 && t >= T) return;
  // kU rows at a time: their indices, then their values, all in flight together; summed in
  // j order (rows of -1 skipped). The first kU indices are read before waiting for the GEMM:
  // dest comes from route_plan, and the GEMM launches this kernel only after its own wait for
  // route_plan (and permute) has returned (sm90_moe_gemm.cuh), so dest is complete already.
  int32_t row[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) row[u] = u < k && c0 < H ? dest[t * k + u] : -1;
  ptx::grid_dependency_wait();
  if (c0 >= H) return;
  float4 acc[kCols];
#pragma unroll
  for (int j = 0; j < kCols; ++j) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j0 = 0; j0 < k; j0 += kU) {
    if (j0 > 0)
#pragma unroll
      for (int u = 0; u < kU; ++u) row[u] = j0 + u < k ? dest[t * k + j0 + u] : -1;
    float4 v[kU][kCols];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int j = 0; j < kCols; ++j)
        if (row[u] >= 0 && c0 + j * kStep < H)
          v[u][j] = *reinterpret_cast<const float4*>(out + int64_t(row[u]) * H + c0 + j * kStep);
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int j = 0; j < kCols; ++j)
        if (row[u] >= 0 && c0 + j * kStep < H)
          acc[j].x += v[u][j].x, acc[j].y += v[u][j].y, acc[j].z += v[u][j].z, acc[j].w += v[u][j].w;
  }
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    const int64_t c = c0 + j * kStep;
    if (c >= H) break;
    float4 a = acc[j];
    if (shared) {  // a shared expert's output, added before the one rounding
      const uint2 sv = *reinterpret_cast<const uint2*>(shared + t * shared_stride + c);
      const float2 s01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sv.x));
      const float2 s23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sv.y));
      a.x += s01.x, a.y += s01.y, a.z += s23.x, a.w += s23.y;
    }
    __nv_bfloat162 lo = __floats2bfloat162_rn(a.x, a.y), hi = __floats2bfloat162_rn(a.z, a.w);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t*>(&lo);
    packed.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(y + t * y_stride + c) = packed;
  }
}

}  // namespace

size_t route_plan_smem(int E) { return route_smem_bytes(E); }

template <auto Kernel>
cudaError_t launch_fused(const PlanArgs& a, const FusedShape& f, cudaStream_t s, bool pdl) {
  // Per device (common/kernel_attr.h); a failure shows at the launch.
  max_dynamic_smem_once<Kernel>(int(kFusedMaxDynSmem));
  return launch(Kernel, dim3(unsigned(f.cluster)), dim3(kFusedThreads), f.smem, s, pdl, a, f.tokens_per_cta);
}

// The largest cluster route_plan_fused takes on the current device: 16 where a cluster of 16
// 1024-thread CTAs with the most dynamic shared memory fits (cudaOccupancyMaxActiveClusters after
// allowing non-portable sizes: H100, H200), else 8. Once per device. $MOEKIT_ROUTE_CLUSTER (8 or
// 16) caps it (diagnostics).
int fused_max_cluster() {
  static std::atomic<int> known[kMaxDevicesTracked];  // 0: not asked
  static const int cap = [] {
    const char* v = std::getenv("MOEKIT_ROUTE_CLUSTER");
    return v && std::atoi(v) >= 1 ? std::atoi(v) : kFusedMaxCluster;
  }();
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevicesTracked) return std::min(cap, 8);
  int m = known[dev].load(std::memory_order_acquire);
  if (m == 0) {
    m = 8;
    auto* k = route_plan_cluster_kernel<16>;
    if (max_dynamic_smem_once<route_plan_cluster_kernel<16>>(int(kFusedMaxDynSmem)) == cudaSuccess &&
        cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(16);
      cfg.blockDim = dim3(kFusedThreads);
      cfg.dynamicSmemBytes = kFusedMaxDynSmem;
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, k, &cfg) == cudaSuccess && clusters > 0) m = 16;
    }
    (void)cudaGetLastError();  // a refused query leaves no sticky error behind
    known[dev].store(m, std::memory_order_release);
  }
  return std::min(cap, m);
}

// The routing work of one fused CTA ($MOEKIT_ROUTE_UNITS, diagnostics; read once).
int fused_units() {
  static const int u = [] {
    const char* v = std::getenv("MOEKIT_ROUTE_UNITS");
    return v && std::atoi(v) >= 1 ? std::atoi(v) : kFusedUnitsPerCta;
  }();
  return u;
}

// MOEKIT_ROUTE_PLAN=legacy: the kernels from before route_plan_fused (for A/B measurements;
// read once per process).
bool route_plan_legacy() {
  static const bool legacy = [] {
    const char* v = std::getenv("MOEKIT_ROUTE_PLAN");
    return v && std::strcmp(v, "legacy") == 0;
  }();
  return legacy;
}

cudaError_t launch_route_plan(const PlanArgs& a, cudaStream_t s, bool pdl) {
  const int E = a.route.p.num_experts;
  const bool hash = !a.bypass && a.route.p.hash_table;
  if (const FusedShape f = route_plan_legacy() ? FusedShape{} : fused_shape(a, fused_max_cluster(), fused_units());
      f.cluster > 0) {
    if (f.cluster == 1) return launch_fused<route_plan_fused_kernel>(a, f, s, pdl);
    if (f.cluster == 2) return launch_fused<route_plan_cluster_kernel<2>>(a, f, s, pdl);
    if (f.cluster == 4) return launch_fused<route_plan_cluster_kernel<4>>(a, f, s, pdl);
    if (f.cluster == 8) return launch_fused<route_plan_cluster_kernel<8>>(a, f, s, pdl);
    return launch_fused<route_plan_cluster_kernel<16>>(a, f, s, pdl);
  }
  if (a.T * a.k <= 32 && a.T <= kRouteWarps && E <= kPlanWarpExperts &&
      (a.bypass || hash || regs_routing_ok(a.route.p, kRegExpertsSmall))) {
    const int J = (E + 31) / 32;
    const dim3 block(unsigned(a.bypass ? 32 : 32 * std::max<int64_t>(1, a.T)));
    const size_t smem = (size_t(E) + 6 * 32) * 4;
    auto go = [&](auto kernel) { return launch(kernel, dim3(1), block, smem, s, pdl, a); };
    if (hash) return go(route_plan_small_kernel<0>);
    if (a.bypass || J <= 1) return go(route_plan_small_kernel<1>);
    if (J <= 2) return go(route_plan_small_kernel<2>);
    if (J <= 4) return go(route_plan_small_kernel<4>);
    if (J <= kRegExperts) return go(route_plan_small_kernel<kRegExperts>);
    return go(route_plan_small_kernel<kRegExpertsSmall>);
  }
  const unsigned grid = a.bypass ? 1u : unsigned(std::max<int64_t>(1, (a.T + kRouteWarps - 1) / kRouteWarps));
  const size_t smem = route_smem_bytes(a.route.p.num_experts) + 16;
  // Per device (common/kernel_attr.h); a failure shows at the launch.
  max_dynamic_smem_once<route_plan_kernel>(200 * 1024);
  max_dynamic_smem_once<plan_count_kernel>(kPlanCountWarps * kWidePlanMaxExperts * 4);
  const int64_t N = a.T * a.k;
  if (a.b.slice_rows == nullptr || N < kWidePlanFrom || E > kWidePlanMaxExperts)
    return launch(route_plan_kernel, dim3(grid), dim3(kRouteWarps * 32), smem, s, pdl, a);
  // The wide plan: route (unless bypass), count per slice, assign; each after the one before.
  PlanArgs w = a;
  w.wide = true;
  if (!a.bypass) {
    if (const cudaError_t e = launch(route_plan_kernel, dim3(grid), dim3(kRouteWarps * 32), smem, s, pdl, w))
      return e;
    pdl = true;
  }
  if (const cudaError_t e = launch(plan_count_kernel, dim3(unsigned((N + kPlanSlice - 1) / kPlanSlice)),
                                   dim3(kPlanCountThreads), size_t(kPlanCountWarps) * size_t(E) * 4, s, pdl, w))
    return e;
  return launch(plan_assign_kernel, dim3(unsigned((N + kPlanAssignThreads - 1) / kPlanAssignThreads)),
                dim3(kPlanAssignThreads), 0, s, true, w);
}

cudaError_t launch_permute(const uint16_t* x, int64_t T, int k, int64_t H, int64_t K_pad,
                           const int32_t* dest, uint16_t* act, cudaStream_t s, bool pdl, const int* run) {
  if (T * k == 0) return cudaSuccess;
  return launch(permute_kernel, dim3(unsigned(T * k)), dim3(128), 0, s, pdl, x, k, H, K_pad, dest, act, run);
}

cudaError_t launch_finalize(const float* out, const int32_t* dest, int64_t T, int k, int64_t H,
                            uint16_t* y, cudaStream_t s, bool pdl, int64_t y_stride, const uint16_t* shared,
                            int64_t shared_stride) {
  if (T == 0) return cudaSuccess;
  const int64_t ys = y_stride > 0 ? y_stride : H;
  const auto go = [&](auto kernel, int rows, int cols) {
    const unsigned bx = unsigned((H / 4 + kFinalizeThreads * cols - 1) / (kFinalizeThreads * cols));
    return launch(kernel, dim3(bx, unsigned((T + rows - 1) / rows)), dim3(kFinalizeThreads, rows), 0, s, pdl, out,
                  dest, T, k, H, y, ys, shared, shared_stride);
  };
  if (T < kFinalizeWideFrom) return go(finalize_kernel<1, 8, 1>, 1, 1);
  if (k <= 2) return go(finalize_kernel<kFinalizeWide, 2, 4>, kFinalizeWide, 4);
  if (k <= 4) return go(finalize_kernel<kFinalizeWide, 4, 2>, kFinalizeWide, 2);
  return go(finalize_kernel<kFinalizeWide, 8, 1>, kFinalizeWide, 1);
}

}  // namespace moekit::sm90
