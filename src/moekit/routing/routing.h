// moekit/routing/routing.h — router logits [T, E] -> top-k expert ids [T, k] and weights [T, k].
//
// softmax: p = softmax(logits); the k largest p (ties: lower expert id first); weights = p,
//          divided by their sum when renormalize.
// sigmoid: s = sigmoid(logits); choice by s + score_bias with group-limited selection: groups of
//          E / n_group contiguous experts, group score = sum of its two largest biased scores
//          (its one score for groups of one), keep the topk_group best groups (ties: lower
//          group), then the k best experts inside them; weights = s (no bias), renormalized when
//          asked.
// Both then multiply the weights by routed_scaling_factor. All arithmetic is fp32; the GPU
// kernels follow the same steps (their sums may round differently in the last bit).
// Renormalization divides by (sum + kRenormEpsilon), as the reference models do (DeepSeek-V3's
// `topk_weight.sum() + 1e-20`): chosen sigmoid scores that all underflow to 0 give weights 0
// (a zero expert output), not 0/0 = NaN. The epsilon is far below one ulp of any sum a softmax
// can give (at least 1/E), so it changes nothing else there.
// Given ids/weights (the "bypass" input) are used as they are: -1 ids are empty slots.
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/spec.hpp"

namespace moekit {

inline constexpr float kRenormEpsilon = 1e-20f;

struct RoutingParams {
  Scoring scoring = Scoring::kSoftmax;
  int num_experts = 0;
  int top_k = 0;
  float routed_scaling_factor = 1.0f;
  int n_group = 1;
  int topk_group = 1;
  const float* score_bias = nullptr;  // [E] or null
  bool renormalize = false;
  // No implicit padding: the SM90 layer compares its kernels' arguments bytewise
  // (pipeline/launch_sm90.cuh), and a compiler may leave any bytes in implicit padding.
  uint8_t pad_[7] = {};
};

RoutingParams routing_params(const LayerSpec& c, const std::vector<float>& score_bias);

// logits [T, E]; writes ids [T, k] and weights [T, k].
void route_cpu(const RoutingParams& p, const float* logits, int64_t T, int32_t* ids,
               float* weights);

}  // namespace moekit
