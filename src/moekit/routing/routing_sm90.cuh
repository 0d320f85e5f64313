// moekit/routing/routing_sm90.cuh — routing of one token by one warp (same steps as
// routing_cpu.cpp; see routing.h). Scores live in registers (route_token_regs: up to 256
// experts, 384 in the decode kernel, groups of whole lanes) or in shared memory
// (route_token_warp: the rest); selections are warp argmax reductions with ties to the lower
// index. Hash routing (route_token_hash) reads its experts from the table and scores only those.
#pragma once

#include <climits>
#include <cstdint>

#include "moekit/routing/routing.h"

namespace moekit::sm90 {

struct RouteArgs {
  RoutingParams p;          // score_bias, hash_table are device pointers here
  const float* logits = nullptr;  // [T, E]
  TokenIds token_ids;       // [T], device memory (hash routing)
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

// The k choices of a token as they are made: lane j keeps weight j (the first 32) in a register
// until their sum is known; lane 0 writes the ids (and the weights past 32).
struct TopkWeights {
  float sum = 0.0f, mine = 0.0f;
  __device__ __forceinline__ void add(int j, int id, float w, int lane, int32_t* ids, int32_t* ids_copy,
                                      float* weights) {
    sum += w;
    if (lane == j) mine = w;
    if (lane == 0) {
      ids[j] = id;
      if (ids_copy) ids_copy[j] = id;
      if (j >= 32) weights[j] = w;
    }
  }
  // Renormalized (when asked) and scaled weights; call after the last add.
  __device__ __forceinline__ void finish(const RoutingParams& p, float* weights, int lane) const {
    __syncwarp();
    for (int j = lane; j < p.top_k; j += 32) {
      float w = j < 32 ? mine : weights[j];
      if (p.renormalize) w = w / (sum + kRenormEpsilon);  // routing.h: all-zero scores give 0
      weights[j] = w * p.routed_scaling_factor;
    }
    __syncwarp();
  }
};

// ---- register routing (E <= 32 * kRegExperts) ----------------------------------------------
// Lane l holds experts [l J, l J + J), J = ceil(E / 32) <= kJ, in registers, and a warp-wide
// argmax is two redux.sync: the largest ordered key, then the lowest index holding it. Same
// selections as route_token_warp below (ties to the lower index, NaN never chosen), with no
// shared-memory round trip and no shuffle chain per choice. The block kernel instantiates it for
// J <= kRegExperts; the one-warp decode kernel also for J <= kRegExpertsSmall (DeepSeek-V4-Pro's
// and V4.1-Flash's 384 experts; in the block kernel that instantiation spills registers).
constexpr int kRegExperts = 8;
constexpr int kRegExpertsSmall = 12;

// Integer key with the order of the float (after -0 -> +0, so that -0 ties +0).
__device__ __forceinline__ int ordered_key(float v) {
  const int b = __float_as_int(v + 0.0f);
  return b ^ ((b >> 31) & 0x7fffffff);
}
// Index with the largest key over the warp, the lowest index among equal keys. Lanes without a
// candidate pass key INT_MIN and index INT_MAX.
__device__ __forceinline__ int warp_argmax_key(int key, int idx) {
  const int m = __reduce_max_sync(0xffffffffu, key);
  return __reduce_min_sync(0xffffffffu, key == m ? idx : INT_MAX);
}

// True when route_token_regs<max_j> handles these parameters: E <= 32 max_j and, with groups,
// groups made of whole lanes (E = 32 J, E / n_group a power-of-two number of lanes' J experts).
__host__ __device__ inline bool regs_routing_ok(const RoutingParams& p, int max_j = kRegExperts) {
  const int E = p.num_experts, J = (E + 31) / 32;
  if (E < 1 || J > max_j) return false;
  if (p.scoring == Scoring::kSoftmax || p.n_group <= 1) return true;
  if (E != 32 * J || E % p.n_group != 0) return false;
  const int gsize = E / p.n_group;
  if (gsize % J != 0) return false;
  const int L = gsize / J;
  return L >= 1 && L <= 32 && (L & (L - 1)) == 0;
}

template <int kJ>
__device__ inline void route_token_regs(const RouteArgs& a, const float* logits, int32_t* ids,
                                        float* weights, int32_t* ids_copy = nullptr) {
  const RoutingParams& p = a.p;
  const int E = p.num_experts, lane = threadIdx.x & 31;
  const int J = (E + 31) / 32, i0 = lane * J;
  float prob[kJ], choice[kJ];
  uint32_t allowed = 0;  // bit j: expert i0 + j may be chosen
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const bool v = j < J && i0 + j < E;
    prob[j] = v ? logits[i0 + j] : -INFINITY;
    choice[j] = v && p.scoring != Scoring::kSoftmax && p.score_bias ? p.score_bias[i0 + j] : 0.0f;
    allowed |= uint32_t(v) << j;
  }
  if (p.scoring == Scoring::kSoftmax) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kJ; ++j)
      if (allowed >> j & 1u) mx = fmaxf(mx, prob[j]);
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kJ; ++j)
      if (allowed >> j & 1u) sum += (prob[j] = expf(prob[j] - mx));
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      if (allowed >> j & 1u) prob[j] = prob[j] / sum;
      choice[j] = (allowed >> j & 1u) ? prob[j] : -INFINITY;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      if (allowed >> j & 1u) prob[j] = gate_score(p.scoring, prob[j]);  // sigmoid or sqrtsoftplus
      choice[j] = (allowed >> j & 1u) ? prob[j] + choice[j] : -INFINITY;
    }
    if (p.n_group > 1) {
      // Group g is lanes [g L, g L + L): the two largest choices of each lane, merged over the
      // group's lanes (as multisets: the same two values as a scan of the group), summed.
      const int gsize = E / p.n_group, L = gsize / J;
      float x = -INFINITY, y = -INFINITY;
#pragma unroll
      for (int j = 0; j < kJ; ++j)
        if (j < J) {
          const float c = choice[j];
          if (c > x)
            y = x, x = c;
          else if (c > y)
            y = c;
        }
      for (int off = 1; off < L; off <<= 1) {
        const float ox = __shfl_xor_sync(0xffffffffu, x, off),
                    oy = __shfl_xor_sync(0xffffffffu, y, off);
        y = fmaxf(fminf(x, ox), fmaxf(y, oy));
        x = fmaxf(x, ox);
      }
      const float score = gsize == 1 ? x : x + y;
      const int group = lane / L;
      bool kept = false;
      const bool nan = score != score;  // never chosen, as in the scans
      for (int t = 0; t < p.topk_group; ++t) {
        const bool cand = !kept && !nan;
        const int g = warp_argmax_key(cand ? ordered_key(score) : INT_MIN, cand ? group : INT_MAX);
        kept |= g == group;
      }
      if (!kept) allowed = 0;
    }
  }
  // This lane's best allowed choice (value, index, prob); only the lane that loses its best to a
  // selection rescans.
  float bv = -INFINITY, bp = 0.0f;
  int bi = INT_MAX;
  auto rescan = [&]() {
    bv = -INFINITY, bp = 0.0f, bi = INT_MAX;
#pragma unroll
    for (int j = 0; j < kJ; ++j)
      if ((allowed >> j & 1u) && (choice[j] > bv || (choice[j] == bv && i0 + j < bi)))
        bv = choice[j], bp = prob[j], bi = i0 + j;
  };
  rescan();
  TopkWeights tw;
  for (int j = 0; j < p.top_k; ++j) {
    const int win = warp_argmax_key(bi == INT_MAX ? INT_MIN : ordered_key(bv), bi);
    const int owner = win == INT_MAX ? 0 : win / J;
    const float w = win == INT_MAX ? 0.0f : __shfl_sync(0xffffffffu, bp, owner);
    if (win != INT_MAX && lane == owner) {
      allowed &= ~(1u << (win - i0));
      rescan();
    }
    tw.add(j, win, w, lane, ids, ids_copy, weights);
  }
  tw.finish(p, weights, lane);
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
      prob[i] = gate_score(p.scoring, prob[i]);  // sigmoid or sqrtsoftplus
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
  TopkWeights tw;
  for (int j = 0; j < p.top_k; ++j) {
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = lane; i < E; i += 32)
      if (allowed[i] && (choice[i] > best || (choice[i] == best && i < bi))) best = choice[i], bi = i;
    warp_argmax(best, bi);
    __syncwarp();
    if (lane == 0) allowed[bi] = 0;
    __syncwarp();
    tw.add(j, bi, prob[bi], lane, ids, ids_copy, weights);
  }
  tw.finish(p, weights, lane);
}

// ---- hash routing (RoutingParams::hash_table; routing.h) -------------------------------------
// Token t's experts are row token_ids[t] of the table [hash_vocab, k] (entries checked at pack
// time: in [0, E), none twice in a row), in the table's order; its weights are those experts'
// scores (softmax: over the whole row), summed in slot order, renormalized and scaled as the
// top-k ones (TopkWeights). Only the k chosen logits are scored: lane j reads slot j's expert and
// logit (the first 32 slots at once). A token id outside [0, hash_vocab) writes -1 ids and 0
// weights (its row gets no expert, never a wrong one) and returns true: the caller raises the
// layer's flag (check()).
__device__ inline bool route_token_hash(const RouteArgs& a, int64_t t, const float* logits, int32_t* ids,
                                        float* weights, int32_t* ids_copy = nullptr) {
  const RoutingParams& p = a.p;
  const int k = p.top_k, lane = threadIdx.x & 31;
  const int64_t tok = a.token_ids.at(t);
  if (tok < 0 || tok >= p.hash_vocab) {
    for (int j = lane; j < k; j += 32) {
      ids[j] = -1;
      if (ids_copy) ids_copy[j] = -1;
      weights[j] = 0.0f;
    }
    __syncwarp();
    return true;
  }
  float mx = 0.0f, denom = 1.0f;  // softmax scoring: the row's max and sum of exponentials
  if (p.scoring == Scoring::kSoftmax) {
    const int E = p.num_experts;
    mx = -INFINITY;
    for (int i = lane; i < E; i += 32) mx = fmaxf(mx, logits[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int i = lane; i < E; i += 32) sum += expf(logits[i] - mx);
    denom = warp_sum(sum);
  }
  const int32_t* row = p.hash_table + tok * k;
  TopkWeights tw;
  for (int j0 = 0; j0 < k; j0 += 32) {
    const int j = j0 + lane;
    int e = 0;
    float s = 0.0f;
    if (j < k) {
      e = row[j];
      const float l = logits[e];
      s = p.scoring == Scoring::kSoftmax ? expf(l - mx) / denom : gate_score(p.scoring, l);
    }
    const int n = k - j0 < 32 ? k - j0 : 32;
    for (int jj = 0; jj < n; ++jj)
      tw.add(j0 + jj, __shfl_sync(0xffffffffu, e, jj), __shfl_sync(0xffffffffu, s, jj), lane, ids, ids_copy,
             weights);
  }
  tw.finish(p, weights, lane);
  return false;
}

}  // namespace moekit::sm90
