#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "moekit/pipeline/prepare_finalize_sm90.cuh"

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
__device__ void plan_warp(const PlanArgs& a, int id, int* smem) {
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
    *a.b.error = any_bad ? 1 : any_overflow ? 2 : 0;
  }
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
      if (regs_routing_ok(a.route.p))
        route_token_regs<kRegExperts>(a.route, a.route.logits + t * E, a.b.ids + t * a.k,
                                      a.b.weights + t * a.k, few ? s_ids + t * a.k : nullptr);
      else
        route_token_warp(a.route, a.route.logits + t * E, prob, choice, allowed, a.b.ids + t * a.k,
                         a.b.weights + t * a.k, few ? s_ids + t * a.k : nullptr);
    }
  }
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
  int* seg_start = hist + size_t(kRouteWarps) * E;    // [E + 1] first row of each expert
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
  // One thread per expert (blocks of blockDim experts): its rows per routing warp become
  // offsets, then three block-wide scans give padded row offsets, active-expert slots and chunk
  // prefix sums.
  using Scan = cub::BlockScan<int, kRouteWarps * 32>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int row = 0, active = 0, chunks = 0;
  for (int e0 = 0; e0 < E; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    int c = 0;
    if (e < E) {
      for (int w = 0; w < kRouteWarps; ++w) {
        const int h = hist[w * E + e];
        hist[w * E + e] = c;
        c += h;
      }
      a.b.expert_count[e] = c;
      if (a.batched && c > a.capacity) atomicExch(a.b.error, 2);
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
    seg_start[E] = row;  // standard: total rows including padding
  }
  __syncthreads();
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

// Decode: up to 32 (token, slot) entries, so at most 32 tokens (here at most kRouteWarps, one
// warp each) and one warp's plan. Its own kernel, T warps wide, with only the code it runs: at
// one token the layer's overhead is this kernel, and much of that is fetching its instructions.
template <int kJ>
__global__ void route_plan_small_kernel(const PlanArgs a) {
  extern __shared__ __align__(16) int smem_i[];
  __shared__ int32_t s_ids[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int N = int(a.T * a.k);
  ptx::grid_dependency_wait();
  ptx::launch_dependents();  // as in route_plan_kernel
  if (!a.bypass && warp < a.T)
    route_token_regs<kJ>(a.route, a.route.logits + int64_t(warp) * a.route.p.num_experts,
                         a.b.ids + warp * a.k, a.b.weights + warp * a.k, s_ids + warp * a.k);
  if (blockDim.x > 32) __syncthreads();  // the other warps' ids
  if (warp != 0) return;
  const int id = lane < N ? (a.bypass ? __ldcg(a.b.ids + lane) : s_ids[lane]) : -1;
  plan_warp(a, id, smem_i);
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
constexpr int kFinalizeThreads = 64;
constexpr int kFinalizeWide = 8, kFinalizeWideFrom = 1024;
template <int kRows>  // tokens per CTA
__global__ void __launch_bounds__(kFinalizeThreads * kRows)
    finalize_kernel(const float* out, const int32_t* dest, int64_t T, int k, int64_t H, uint16_t* y,
                    int64_t y_stride, const uint16_t* shared, int64_t shared_stride) {
  const int64_t t = kRows == 1 ? int64_t(blockIdx.y) : int64_t(blockIdx.y) * kRows + threadIdx.y;
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (kRows > 1 && t >= T) return;
  // Eight rows at a time: their indices, then their values, all in flight together; summed in
  // j order (rows of -1 skipped). The first eight indices are read before waiting for the GEMM:
  // dest comes from route_plan, and the GEMM launches this kernel only after its own wait for
  // route_plan (and permute) has returned (sm90_moe_gemm.cuh), so dest is complete already.
  constexpr int kU = 8;
  int32_t row[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) row[u] = u < k && c < H ? dest[t * k + u] : -1;
  ptx::grid_dependency_wait();
  if (c >= H) return;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j0 = 0; j0 < k; j0 += kU) {
    if (j0 > 0)
#pragma unroll
      for (int u = 0; u < kU; ++u) row[u] = j0 + u < k ? dest[t * k + j0 + u] : -1;
    float4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (row[u] >= 0) v[u] = *reinterpret_cast<const float4*>(out + int64_t(row[u]) * H + c);
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (row[u] >= 0) acc.x += v[u].x, acc.y += v[u].y, acc.z += v[u].z, acc.w += v[u].w;
  }
  if (shared) {  // a shared expert's output, added before the one rounding
    const uint2 sv = *reinterpret_cast<const uint2*>(shared + t * shared_stride + c);
    const float2 s01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sv.x));
    const float2 s23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sv.y));
    acc.x += s01.x, acc.y += s01.y, acc.z += s23.x, acc.w += s23.y;
  }
  __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x, acc.y), hi = __floats2bfloat162_rn(acc.z, acc.w);
  uint2 packed;
  packed.x = *reinterpret_cast<uint32_t*>(&lo);
  packed.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(y + t * y_stride + c) = packed;
}

}  // namespace

size_t route_plan_smem(int E) { return route_smem_bytes(E); }

cudaError_t launch_route_plan(const PlanArgs& a, cudaStream_t s, bool pdl) {
  const int E = a.route.p.num_experts;
  if (a.T * a.k <= 32 && a.T <= kRouteWarps && E <= kPlanWarpExperts &&
      (a.bypass || regs_routing_ok(a.route.p))) {
    const int J = (E + 31) / 32;
    const dim3 block(unsigned(a.bypass ? 32 : 32 * std::max<int64_t>(1, a.T)));
    const size_t smem = (size_t(E) + 6 * 32) * 4;
    auto go = [&](auto kernel) { return launch(kernel, dim3(1), block, smem, s, pdl, a); };
    if (a.bypass || J <= 1) return go(route_plan_small_kernel<1>);
    if (J <= 2) return go(route_plan_small_kernel<2>);
    if (J <= 4) return go(route_plan_small_kernel<4>);
    return go(route_plan_small_kernel<8>);
  }
  const unsigned grid = a.bypass ? 1u : unsigned(std::max<int64_t>(1, (a.T + kRouteWarps - 1) / kRouteWarps));
  const size_t smem = route_smem_bytes(a.route.p.num_experts) + 16;
  static bool configured = false;
  if (!configured) {
    cudaFuncSetAttribute(route_plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
    configured = true;
  }
  return launch(route_plan_kernel, dim3(grid), dim3(kRouteWarps * 32), smem, s, pdl, a);
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
  const unsigned bx = unsigned((H / 4 + kFinalizeThreads - 1) / kFinalizeThreads);
  const int64_t ys = y_stride > 0 ? y_stride : H;
  if (T < kFinalizeWideFrom)
    return launch(finalize_kernel<1>, dim3(bx, unsigned(T)), dim3(kFinalizeThreads), 0, s, pdl, out, dest, T, k,
                  H, y, ys, shared, shared_stride);
  return launch(finalize_kernel<kFinalizeWide>, dim3(bx, unsigned((T + kFinalizeWide - 1) / kFinalizeWide)),
                dim3(kFinalizeThreads, kFinalizeWide), 0, s, pdl, out, dest, T, k, H, y, ys, shared,
                shared_stride);
}

}  // namespace moekit::sm90
