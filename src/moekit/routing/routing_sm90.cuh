// moekit/routing/routing_sm90.cuh — routing of one token by one warp (same steps as
// routing_cpu.cpp; see routing.h). Scores live in shared memory; selections are warp argmax
// reductions with ties to the lower index.
#pragma once

#include <cstdint>

#include "moekit/routing/routing.h"

namespace moekit::sm90 {

struct RouteArgs {
  RoutingParams p;          // score_bias is a device pointer here
  const float* logits = nullptr;  // [T, E]
};

// (value, index) argmax over a warp, ties to the lower index; invalid lanes pass -inf, INT_MAX.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Copies n floats from global to shared memory with eight loads in flight per lane (one round
// trip for n <= 256). Lane l writes only elements l, l + 32, ...
__device__ __forceinline__ void warp_load_row(const float* src, float* dst, int n, int lane) {
  for (int i0 = 0; i0 < n; i0 += 256) {
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * 32 + lane;
      v[u] = i < n ? src[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * 32 + lane;
      if (i < n) dst[i] = v[u];
    }
  }
}

// prob, choice: shared scratch of E floats each; allowed: E bytes. Writes k ids and weights (and
// the ids to ids_copy too, when given).
__device__ inline void route_token_warp(const RouteArgs& a, const float* logits, float* prob, float* choice,
                                 uint8_t* allowed, int32_t* ids, float* weights, int32_t* ids_copy = nullptr) {
  const RoutingParams& p = a.p;
  const int E = p.num_experts, lane = threadIdx.x & 31;
  // Each lane reads back only what it staged, so no warp barrier is needed before the math.
  warp_load_row(logits, prob, E, lane);
  if (p.scoring == Scoring::kSoftmax) {
    float mx = -INFINITY;
    for (int i = lane; i < E; i += 32) mx = fmaxf(mx, prob[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int i = lane; i < E; i += 32) sum += (prob[i] = expf(prob[i] - mx));
    sum = warp_sum(sum);
    for (int i = lane; i < E; i += 32) {
      prob[i] = prob[i] / sum;
      choice[i] = prob[i];
      allowed[i] = 1;
    }
  } else {
    if (p.score_bias) warp_load_row(p.score_bias, choice, E, lane);
    for (int i = lane; i < E; i += 32) {
      prob[i] = 1.0f / (1.0f + expf(-prob[i]));
      choice[i] = prob[i] + (p.score_bias ? choice[i] : 0.0f);
      allowed[i] = 1;
    }
    __syncwarp();
    if (p.n_group > 1) {
      const int gsize = E / p.n_group;
      // A group's score is the sum of its two largest biased scores; topk_group groups are kept
      // by repeated argmax (lowest index on ties). Up to 32 groups: one score per lane, computed
      // once; more: recomputed per pass (a group already kept is marked by allowed[first] == 2).
      auto group_score = [&](int gidx) {
        float x = -INFINITY, y = -INFINITY;
        for (int i = 0; i < gsize; ++i) {
          const float c = choice[gidx * gsize + i];
          if (c > x) y = x, x = c;
          else if (c > y) y = c;
        }
        return gsize == 1 ? x : x + y;
      };
      const bool few = p.n_group <= 32;
      const float my_score = few && lane < p.n_group ? group_score(lane) : -INFINITY;
      bool kept = false;
      for (int t = 0; t < p.topk_group; ++t) {
        float best = -INFINITY;
        int bi = 0x7fffffff;
        if (few) {
          if (lane < p.n_group && !kept) best = my_score, bi = lane;
        } else {
          for (int gidx = lane; gidx < p.n_group; gidx += 32) {
            if (allowed[gidx * gsize] == 2) continue;
            const float sc = group_score(gidx);
            if (sc > best || (sc == best && gidx < bi)) best = sc, bi = gidx;
          }
        }
        warp_argmax(best, bi);
        kept |= lane == bi;
        __syncwarp();
        for (int i = lane; i < gsize; i += 32) allowed[bi * gsize + i] = 2;
        __syncwarp();
      }
      for (int i = lane; i < E; i += 32) allowed[i] = allowed[i] == 2 ? 1 : 0;
    }
  }
  __syncwarp();
  // The first 32 weights stay in registers (lane j holds weight j) until the sum is known.
  float sum = 0.0f, mine = 0.0f;
  for (int j = 0; j < p.top_k; ++j) {
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = lane; i < E; i += 32)
      if (allowed[i] && (choice[i] > best || (choice[i] == best && i < bi))) best = choice[i], bi = i;
    warp_argmax(best, bi);
    __syncwarp();
    if (lane == 0) allowed[bi] = 0;
    __syncwarp();
    const float w = prob[bi];
    sum += w;
    if (lane == j) mine = w;
    if (lane == 0) {
      ids[j] = bi;
      if (ids_copy) ids_copy[j] = bi;
      if (j >= 32) weights[j] = w;
    }
  }
  __syncwarp();
  for (int j = lane; j < p.top_k; j += 32) {
    float w = j < 32 ? mine : weights[j];
    if (p.renormalize) w = w / sum;
    weights[j] = w * p.routed_scaling_factor;
  }
  __syncwarp();
}

}  // namespace moekit::sm90
