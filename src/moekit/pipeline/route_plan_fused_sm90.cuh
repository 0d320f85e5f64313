// moekit/pipeline/route_plan_fused_sm90.cuh — route_plan_fused: the routing and the plan of up
// to kFusedEntries (token, slot) entries in one launch (prepare_finalize_sm90.cu includes it;
// launch_route_plan picks it, fused_shape below says when). Its kernels are defined here: include
// it in that one translation unit only.
//
// Why (reasoned, to be measured): every timed replay follows an L2 flush, so a kernel's code and
// data come from HBM; the routing part's time at decode sizes is its serial memory round trips
// and the instruction bytes it runs, not its arithmetic (docs/perf/notebook.md, 2026-11-22
// fifth). The older kernels route one token per warp with the experts' scores unrolled per lane
// (route_token_regs<12>: twelve inlined sqrt_softplus, ~57 KB of SASS in route_plan_small<12>)
// or staged in rounds of 256 (route_token_warp: two round trips for the logits and two for the
// bias at 384 experts), and from 6 tokens (k = 6) plan in the block kernel (124 KB of SASS, cub
// scans, a second walk of the entries). Here:
//   - the CTA stages its tokens' logits (and the bias, once) with cp.async (16 bytes a copy
//     where the sizes and the tensor's alignment allow), all in flight at once (one round
//     trip), then scores every (token, expert) in one flat loop over the whole CTA (one copy
//     of the scoring code; at one token 384 threads score one expert each);
//   - one warp per token selects the k best from shared memory: each lane keeps its best and
//     second-best candidate, a choice is two redux.sync, and only a lane that gives its second
//     choice rescans its experts (a rolled loop);
//   - hash routing is one thread per entry (token id, table entry, logit: three dependent loads
//     for all entries at once);
//   - the plan is one thread per entry and one per expert in shared memory: match_any per warp
//     of 32 consecutive entries, per-warp counts turned into offsets per expert, one scan over
//     the experts (warp shuffles), then each entry's row. The same rows as plan_warp and the
//     block plan: stable by entry within an expert, experts in id order, padding rows -1.
//   - from 5 tokens of 384 experts (T * ceil(E / 32) > 2 kFusedUnitsPerCta, fused_shape) the
//     learned routing is spread over a thread-block cluster of 2-16 CTAs (one SM each; 16 is a
//     non-portable size, taken where the device runs it): each routes a
//     contiguous range of tokens and writes its ids into CTA 0's shared memory (distributed
//     shared memory); one cluster barrier, and CTA 0 plans. No global ticket, no fence.
// Bypass ids (kTopk calls) of 33-1024 entries are planned here too (up to 32: route_plan_small).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "moekit/common/ptx_sm90.cuh"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"
#include "moekit/routing/routing_sm90.cuh"

namespace moekit::sm90 {

constexpr int kFusedThreads = 1024;
constexpr int kFusedWarps = kFusedThreads / 32;
constexpr int kFusedEntries = kFusedThreads;  // T k: one plan thread per entry
constexpr int kFusedMaxExperts = 512;         // one plan thread per expert; scores in shared memory
constexpr int kFusedMaxK = 32;                // lane j keeps choice j
constexpr int kFusedMaxCluster = 16;          // 8 portable; 16 where the device allows it
// Routing work one CTA takes, in tokens x ceil(E / 32) (a lane's experts): 24 is 2 tokens of
// 384 experts, 3 of 256, 6 of 128. Measured on an H200 (DeepSeek-V4-Pro / -Flash, learned, the
// layer's routing part at 1-128 tokens, perf/log.md): 24 against 96 (8 tokens of 384 experts a
// CTA), both with clusters of up to 16, 0.2-1.4 us faster at 8-64 tokens, the same at 1-4 and 128.
// $MOEKIT_ROUTE_UNITS overrides it (diagnostics).
constexpr int kFusedUnitsPerCta = 24;
constexpr size_t kFusedMaxDynSmem = 160 * 1024;

// How launch_route_plan runs a call on the fused kernel: cluster CTAs (0: not taken), each
// routing tokens_per_cta tokens, with smem bytes of dynamic shared memory.
struct FusedShape {
  int cluster = 0;
  int tokens_per_cta = 0;
  size_t smem = 0;
};

// max_cluster: the largest cluster launch_route_plan may use here (8, or 16 where the device
// runs non-portable clusters of 1024-thread CTAs); units: the routing work of one CTA.
__host__ inline FusedShape fused_shape(const PlanArgs& a, int max_cluster = 8, int units = kFusedUnitsPerCta) {
  FusedShape f;
  const RoutingParams& p = a.route.p;
  const int E = p.num_experts, k = a.k;
  const int64_t N = a.T * a.k;
  if (E < 1 || E > kFusedMaxExperts || k < 1 || k > kFusedMaxK || a.T < 0 || N > kFusedEntries) return f;
  const bool hash = !a.bypass && p.hash_table;
  if (a.bypass) {
    if (N <= 32) return f;  // route_plan_small plans up to 32 entries with one warp
  } else if (hash) {
    if (p.scoring == Scoring::kSoftmax) return f;  // needs whole rows: the older kernels
  } else if (p.scoring != Scoring::kSoftmax && p.n_group > 1) {
    return f;  // group-limited selection: the older kernels
  }
  int C = 1;
  if (!a.bypass && !hash) {
    // The first cluster from twice one CTA's work: a 2-CTA cluster over 8 tokens of 128
    // experts (32 units) was 0.2-0.5 us slower than one CTA (gpt-oss-120b, qwen3-30b-a3b, H200).
    const int64_t work = a.T * ((E + 31) / 32);
    if (work > 2 * int64_t(units))
      while (C < max_cluster && C < kFusedMaxCluster && work > int64_t(C) * units) C *= 2;
  }
  const int tc = int((a.T + C - 1) / C);
  const int nw = int((N + 31) / 32);
  size_t floats = size_t(N);                                            // hash: the entries' scores
  if (!a.bypass && !hash) floats = 2 * size_t(tc) * size_t(E) + size_t(E);  // prob, choice, bias
  floats = std::max(floats, size_t(nw) * size_t(E));                     // the plan's counts
  f.smem = std::max<size_t>(floats, 1) * 4;
  if (f.smem > kFusedMaxDynSmem) return FusedShape{};
  f.cluster = C;
  f.tokens_per_cta = tc;
  return f;
}

namespace fused {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async4(float* dst, const float* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async16(float* dst, const float* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
// n floats from src to dst (shared memory, 16-byte aligned) with cp.async: 16 bytes a copy
// where n and src allow it (E % 4 == 0 and an aligned tensor: a quarter of the copies), else 4.
__device__ __forceinline__ void stage(float* dst, const float* src, int n, int tid) {
  if ((n & 3) == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
#pragma unroll 1
    for (int i = 4 * tid; i < n; i += 4 * kFusedThreads) cp_async16(dst + i, src + i);
  } else {
#pragma unroll 1
    for (int i = tid; i < n; i += kFusedThreads) cp_async4(dst + i, src + i);
  }
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// A 32-bit store to the shared memory of CTA `rank` of the cluster at the address `local` has
// in this CTA.
__device__ __forceinline__ void st_cluster(const int32_t* local, uint32_t rank, int32_t v) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(v) : "memory");
}

// One token's k choices by one warp from its scores in shared memory (pr: the weights' scores,
// ch: the choice values; lane l owns experts l, l + 32, ...; ch is overwritten). Lane j < k
// gets choice j (its id, INT_MAX when nothing is left to choose, as route_token_regs) and its
// final weight (TopkWeights' sums and order). The order of the choices: larger value first,
// then lower index; NaN never (route_token_regs). Each lane keeps its best two candidates; a
// lane whose two have both been chosen rescans (the chosen ones marked NaN). One copy of the
// scan, two experts per step: the kernel's code comes from HBM after the bench's L2 flush.
__device__ __forceinline__ void select_topk(const RoutingParams& p, const float* pr, float* ch, int k, int lane,
                                            int& my_id, float& my_w) {
  const int E = p.num_experts;
  float bv = -INFINITY, sv = -INFINITY;
  int bi = INT_MAX, si = INT_MAX;
  // Experts are scanned in increasing index, so a tie never displaces a candidate; an empty
  // slot (index INT_MAX) takes any non-NaN value, -inf included.
  const auto offer = [&](float v, int i) {
    if (v > bv || (bi == INT_MAX && v == v)) {
      sv = bv, si = bi;
      bv = v, bi = i;
    } else if (v > sv || (si == INT_MAX && v == v)) {
      sv = v, si = i;
    }
  };
  bool scan = true, stale = false;  // stale: the best is the former second
  float sum = 0.0f, mine = 0.0f;
  int id = INT_MAX;
#pragma unroll 1
  for (int j = 0; j < k; ++j) {
    if (scan) {
      bv = sv = -INFINITY;
      bi = si = INT_MAX;
#pragma unroll 1
      for (int i = lane; i < E; i += 64) {
        const float v0 = ch[i], v1 = i + 32 < E ? ch[i + 32] : __int_as_float(0x7fffffff);
        offer(v0, i);
        offer(v1, i + 32);
      }
      scan = false;
    }
    const int win = warp_argmax_key(bi == INT_MAX ? INT_MIN : ordered_key(bv), bi);
    const float w = win == INT_MAX ? 0.0f : pr[win];
    sum += w;
    if (lane == j) mine = w, id = win;
    if (win != INT_MAX && (win & 31) == lane) {
      ch[win] = __int_as_float(0x7fffffff);  // NaN: never chosen again
      scan = stale;
      stale = !stale;
      bv = sv, bi = si;
      sv = -INFINITY, si = INT_MAX;
    }
  }
  if (p.renormalize) mine = mine / (sum + kRenormEpsilon);  // routing.h: all-zero scores give 0
  my_w = mine * p.routed_scaling_factor;
  my_id = id;
}

// The whole kernel; kC: CTAs of the cluster (1: no cluster). tc: tokens per CTA (learned).
template <int kC>
__device__ __forceinline__ void route_plan_fused(const PlanArgs& a, const int tc) {
  extern __shared__ __align__(16) float fsm[];
  __shared__ int32_t s_ids[kFusedEntries];
  __shared__ int s_seg[kFusedMaxExperts];
  __shared__ int s_tot[2][kFusedWarps];
  __shared__ int s_flags;  // bit 0: an id out of range; 1: a token id outside the table; 2: overflow
  const RoutingParams& p = a.route.p;
  const int E = p.num_experts, k = a.k;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int T = int(a.T), N = T * k;
  const uint32_t rank = kC > 1 ? cluster_rank() : 0u;
  if constexpr (kC > 1) cluster_arrive_relaxed();  // waited for before the first remote store
  if (tid == 0) s_flags = 0;
  ptx::grid_dependency_wait();
  // The GEMM kernel that follows may start now (as route_plan_kernel).
  ptx::launch_dependents();
  int id = -1;  // this thread's entry (tid) in the plan (CTA 0)
  if (a.bypass) {
    if (tid < N) id = __ldcg(a.b.ids + tid);
  } else if (p.hash_table) {
    // One thread per entry: token id -> table row -> logit; a token id outside the table gives
    // its row -1 ids and 0 weights (route_token_hash) and the error word 3.
    float* sc = fsm;  // [N] the entries' scores
    bool tok_bad = false;
    int t = 0;
    float s = 0.0f;
    if (tid < N) {
      t = tid / k;
      const int j = tid - t * k;
      const int64_t tok = a.route.token_ids.at(t);
      tok_bad = tok < 0 || tok >= p.hash_vocab;
      if (!tok_bad) {
        id = p.hash_table[tok * k + j];
        s = gate_score(p.scoring, a.route.logits[int64_t(t) * E + id]);
      }
      sc[tid] = s;
      a.b.ids[tid] = id;
    }
    __syncthreads();  // the scores; and s_flags is set to 0
    if (tok_bad) atomicOr(&s_flags, 2);
    if (tid < N) {
      float w = 0.0f;
      if (!tok_bad) {
        float sum = 0.0f;  // in slot order, as TopkWeights
#pragma unroll 1
        for (int j = 0; j < k; ++j) sum += sc[t * k + j];
        w = p.renormalize ? s / (sum + kRenormEpsilon) : s;
        w = w * p.routed_scaling_factor;
      }
      a.b.weights[tid] = w;
    }
  } else {
    // Learned: this CTA's tokens [t0, t0 + nt), staged, scored, then chosen warp by warp.
    const int t0 = int(rank) * tc;
    const int nt = max(0, min(T, t0 + tc) - t0);
    float* prob = fsm;            // [tc][E] the logits, then the scores (softmax: p)
    float* choice = prob + tc * E;  // [tc][E] the choice values
    float* bias = choice + tc * E;  // [E]
    const bool softmax = p.scoring == Scoring::kSoftmax;
    const bool has_bias = !softmax && p.score_bias;
    const int n = nt * E;
    const float* src = a.route.logits + int64_t(t0) * E;
    stage(prob, src, n, tid);
    // bias sits 2 tc E floats in: 16-byte aligned when E % 4 == 0, the only case stage copies
    // 16 bytes at a time.
    if (has_bias) stage(bias, p.score_bias, E, tid);
    cp_async_wait_all();
    __syncthreads();
    if (!softmax) {  // every (token, expert) of the CTA in one flat loop
      const int step = kFusedThreads % E;
      int c = tid % E;
#pragma unroll 1
      for (int i = tid; i < n; i += kFusedThreads) {
        const float sc = gate_score(p.scoring, prob[i]);  // sigmoid or sqrtsoftplus
        prob[i] = sc;
        choice[i] = sc + (has_bias ? bias[c] : 0.0f);
        c += step;
        if (c >= E) c -= E;
      }
      __syncthreads();
    }
    if constexpr (kC > 1) cluster_wait();  // every CTA of the cluster runs: CTA 0's s_ids is there
#pragma unroll 1
    for (int lt = warp; lt < nt; lt += kFusedWarps) {
      float* pr = prob + lt * E;
      float* ch = choice + lt * E;
      if (softmax) {  // as route_token_regs: max, exponentials and their sum, then p
        float mx = -INFINITY;
#pragma unroll 1
        for (int i = lane; i < E; i += 32) mx = fmaxf(mx, pr[i]);
        mx = warp_max(mx);
        float sum = 0.0f;
#pragma unroll 1
        for (int i = lane; i < E; i += 32) sum += (pr[i] = expf(pr[i] - mx));
        sum = warp_sum(sum);
#pragma unroll 1
        for (int i = lane; i < E; i += 32) ch[i] = pr[i] = pr[i] / sum;
      }
      __syncwarp();  // pr[win] is read by every lane
      int my_id;
      float my_w;
      select_topk(p, pr, ch, k, lane, my_id, my_w);
      if (lane < k) {
        const int e = (t0 + lt) * k + lane;
        if constexpr (kC > 1) {
          // The global stores wait for the cluster barrier: its release (MEMBAR.ALL.GPU in the
          // SASS) would otherwise wait for them to complete. ch[lane] is this lane's own
          // element (select_topk is done with it).
          s_ids[e] = my_id;
          ch[lane] = my_w;
          if (rank != 0) st_cluster(s_ids + e, 0, my_id);
        } else {
          a.b.ids[e] = my_id;
          a.b.weights[e] = my_w;
          s_ids[e] = my_id;
        }
      }
    }
    if constexpr (kC > 1) {
      cluster_arrive();  // release: this CTA's stores to CTA 0 ...
      cluster_wait();    // ... are visible to CTA 0 after its wait (acquire)
      // This CTA's ids and weights (its own s_ids range, the choice rows), before CTA 0's plan
      // reuses the dynamic shared memory (after the __syncthreads below).
#pragma unroll 1
      for (int x = tid; x < nt * k; x += kFusedThreads) {
        const int lt = x / k, e = t0 * k + x;
        a.b.ids[e] = s_ids[e];
        a.b.weights[e] = choice[lt * E + (x - lt * k)];
      }
      if (rank != 0) return;
    } else {
      __syncthreads();
    }
    if (tid < N) id = s_ids[tid];
  }

  // ---- the plan (CTA 0): entry tid, warp w holds entries [32 w, 32 w + 32) ----
  const bool bad = tid < N && (id < -1 || id >= E);
  if (bad || tid >= N) id = -1;
  const int nw = (N + 31) / 32;
  int* hist = reinterpret_cast<int*>(fsm);  // [nw][E]: the routing's scratch is no longer read
  __syncthreads();
#pragma unroll 1
  for (int x = tid; x < nw * E; x += kFusedThreads) hist[x] = 0;
  const uint32_t peers = __match_any_sync(0xffffffffu, id);
  const int wrank = __popc(peers & ((1u << lane) - 1u));
  if (bad) atomicOr(&s_flags, 1);
  __syncthreads();
  if (id >= 0 && wrank == 0) hist[warp * E + id] = __popc(peers);
  __syncthreads();
  // One thread per expert: its rows per warp become offsets; then the scans over the experts
  // of padded rows (span) and of active experts | chunks << 16.
  int c = 0;
  if (tid < E) {
#pragma unroll 4
    for (int w = 0; w < nw; ++w) {
      const int h = hist[w * E + tid];
      hist[w * E + tid] = c;
      c += h;
    }
  }
  const int span = a.batched ? 0 : (c + kRowAlign - 1) / kRowAlign * kRowAlign;
  const int ch = (c + kTokens - 1) / kTokens;
  const int ac = (c > 0 ? 1 : 0) | ch << 16;
  int x_span = span, x_ac = ac;  // inclusive within the warp
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, x_span, off), v = __shfl_up_sync(0xffffffffu, x_ac, off);
    if (lane >= off) x_span += u, x_ac += v;
  }
  if (lane == 31) s_tot[0][warp] = x_span, s_tot[1][warp] = x_ac;
  __syncthreads();
  if (warp == 0) {  // inclusive scan of the warps' totals
    int u = s_tot[0][lane], v = s_tot[1][lane];
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int uu = __shfl_up_sync(0xffffffffu, u, off), vv = __shfl_up_sync(0xffffffffu, v, off);
      if (lane >= off) u += uu, v += vv;
    }
    s_tot[0][lane] = u, s_tot[1][lane] = v;
  }
  __syncthreads();
  if (warp > 0) x_span += s_tot[0][warp - 1], x_ac += s_tot[1][warp - 1];
  if (tid < E) {
    const int e = tid;
    const int ex_span = x_span - span, ex_ac = x_ac - ac;
    const int start = a.batched ? e * a.capacity : ex_span;
    s_seg[e] = start;
    a.b.expert_count[e] = c;
    if (a.batched && c > a.capacity) atomicOr(&s_flags, 4);
    if (c > 0) {
      const int ai = ex_ac & 0xffff;
      a.b.expert[ai] = e;
      a.b.count[ai] = c;
      a.b.row_start[ai] = start;
      a.b.chunk_prefix[ai + 1] = (ex_ac >> 16) + ch;
    }
#pragma unroll 1
    for (int r = start + c; r < start + span; ++r) a.b.row_src[r] = -1;  // padding rows
  }
  __syncthreads();
  if (tid == 0) {
    const int f = s_flags;
    a.b.chunk_prefix[0] = 0;
    *a.b.num_active = s_tot[1][kFusedWarps - 1] & 0xffff;
    *a.b.error = f & 1 ? 1 : f & 2 ? 3 : f & 4 ? 2 : 0;
  }
  if (tid < N) {
    int32_t row = -1;
    if (id >= 0) {
      const int r = hist[warp * E + id] + wrank;
      if (!a.batched || r < a.capacity) {
        row = s_seg[id] + r;
        a.b.row_src[row] = tid;
      }
    }
    a.b.dest[tid] = row;
  }
}

}  // namespace fused

__global__ void __launch_bounds__(kFusedThreads, 1) route_plan_fused_kernel(const PlanArgs a, int tc) {
  fused::route_plan_fused<1>(a, tc);
}

template <int kC>
__global__ void __cluster_dims__(kC, 1, 1) __launch_bounds__(kFusedThreads, 1)
    route_plan_cluster_kernel(const PlanArgs a, int tc) {
  fused::route_plan_fused<kC>(a, tc);
}

}  // namespace moekit::sm90
