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

// prob, choice: shared scratch of E floats each; allowed: E bytes. Writes k ids and weights.
__device__ inline void route_token_warp(const RouteArgs& a, const float* logits, float* prob, float* choice,
                                 uint8_t* allowed, int32_t* ids, float* weights) {
  const RoutingParams& p = a.p;
  const int E = p.num_experts, lane = threadIdx.x & 31;
  if (p.scoring == Scoring::kSoftmax) {
    float mx = -INFINITY;
    for (int i = lane; i < E; i += 32) mx = fmaxf(mx, logits[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int i = lane; i < E; i += 32) sum += (prob[i] = expf(logits[i] - mx));
    sum = warp_sum(sum);
    for (int i = lane; i < E; i += 32) {
      prob[i] = prob[i] / sum;
      choice[i] = prob[i];
      allowed[i] = 1;
    }
  } else {
    for (int i = lane; i < E; i += 32) {
      prob[i] = 1.0f / (1.0f + expf(-logits[i]));
      choice[i] = prob[i] + (p.score_bias ? p.score_bias[i] : 0.0f);
      allowed[i] = 1;
    }
    __syncwarp();
    if (p.n_group > 1) {
      const int gsize = E / p.n_group;
      // Select topk_group groups by repeated argmax over group scores (the sum of a group's two
      // largest biased scores, recomputed per pass: groups are few).
      for (int t = 0; t < p.topk_group; ++t) {
        float best = -INFINITY;
        int bi = 0x7fffffff;
        for (int gidx = lane; gidx < p.n_group; gidx += 32) {
          // a group already kept is marked by allowed[first] == 2
          if (allowed[gidx * gsize] == 2) continue;
          float x = -INFINITY, y = -INFINITY;
          for (int i = 0; i < gsize; ++i) {
            const float c = choice[gidx * gsize + i];
            if (c > x) y = x, x = c;
            else if (c > y) y = c;
          }
          const float sc = gsize == 1 ? x : x + y;
          if (sc > best || (sc == best && gidx < bi)) best = sc, bi = gidx;
        }
        warp_argmax(best, bi);
        __syncwarp();
        for (int i = lane; i < gsize; i += 32) allowed[bi * gsize + i] = 2;
        __syncwarp();
      }
      for (int i = lane; i < E; i += 32) allowed[i] = allowed[i] == 2 ? 1 : 0;
    }
  }
  __syncwarp();
  float sum = 0.0f;
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
    if (lane == 0) {
      ids[j] = bi;
      weights[j] = w;
    }
  }
  __syncwarp();
  if (lane == 0)
    for (int j = 0; j < p.top_k; ++j) {
      float w = weights[j];
      if (p.renormalize) w = w / sum;
      weights[j] = w * p.routed_scaling_factor;
    }
  __syncwarp();
}

}  // namespace moekit::sm90
