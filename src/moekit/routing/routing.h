// moekit/routing/routing.h — router logits [T, E] -> top-k expert ids [T, k] and weights [T, k].
//
// softmax: p = softmax(logits); the k largest p (ties: lower expert id first); weights = p,
//          divided by their sum when renormalize.
// sigmoid: s = sigmoid(logits); choice by s + score_bias with group-limited selection: groups of
//          E / n_group contiguous experts, group score = sum of its two largest biased scores
//          (its one score for groups of one), keep the topk_group best groups (ties: lower
//          group), then the k best experts inside them; weights = s (no bias), renormalized when
//          asked.
// sqrtsoftplus (DeepSeek-V4's Gate): s = sqrt(softplus(logits)) (sqrt_softplus below); choice by
//          s + score_bias over all experts (no groups); weights = s (no bias), renormalized when
//          asked.
// hash (DeepSeek-V4's first num_hash_layers layers, RoutingParams::hash_table): the experts of
//          token t are row token_id[t] of the table [hash_vocab, k], in its order; the weights
//          are their scores s under the scoring above (softmax: p), renormalized when asked. No
//          choice, so no bias and no groups. A token id outside [0, hash_vocab) is an error
//          (route_cpu throws before writing; the GPU kernels write -1 ids and 0 weights for its
//          row and raise a flag, Layer::check()).
// All then multiply the weights by routed_scaling_factor. All arithmetic is fp32; the GPU
// kernels follow the same steps (their sums may round differently in the last bit, and their
// exp / log1p differ from the host's by an ulp or two).
// Renormalization divides by (sum + kRenormEpsilon), as the reference models do (DeepSeek-V3's
// `topk_weight.sum() + 1e-20`): chosen sigmoid scores that all underflow to 0 give weights 0
// (a zero expert output), not 0/0 = NaN. The epsilon is far below one ulp of any sum a softmax
// can give (at least 1/E), so it changes nothing else there.
// Given ids/weights (the "bypass" input) are used as they are: -1 ids are empty slots.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "moekit/common/hd.h"
#include "moekit/spec.hpp"

namespace moekit {

inline constexpr float kRenormEpsilon = 1e-20f;

// softplus as torch's F.softplus (beta 1, threshold 20: x itself above 20, where log1p(exp(x))
// is x in fp32 already and exp would overflow from 88.7), then its square root; fp32.
MOEKIT_HD float sqrt_softplus(float x) { return sqrtf(x > 20.0f ? x : log1pf(expf(x))); }
// The score of one logit under sigmoid or sqrtsoftplus scoring (softmax needs the whole row).
MOEKIT_HD float gate_score(Scoring s, float x) {
  return s == Scoring::kSqrtSoftplus ? sqrt_softplus(x) : 1.0f / (1.0f + expf(-x));
}

struct RoutingParams {
  Scoring scoring = Scoring::kSoftmax;
  int num_experts = 0;
  int top_k = 0;
  float routed_scaling_factor = 1.0f;
  int n_group = 1;
  int topk_group = 1;
  const float* score_bias = nullptr;    // [E] or null
  const int32_t* hash_table = nullptr;  // [hash_vocab, top_k] entries in [0, E), or null: no hash
  int64_t hash_vocab = 0;
  bool renormalize = false;
  // No implicit padding: the SM90 layer compares its kernels' arguments bytewise
  // (pipeline/launch_sm90.cuh), and a compiler may leave any bytes in implicit padding.
  uint8_t pad_[7] = {};
};

// The token ids of a call's rows (hash routing): int32 or int64 [T], host or device memory.
struct TokenIds {
  const void* data = nullptr;
  bool wide = false;  // int64
  uint8_t pad_[7] = {};  // no implicit padding (a kernel argument, compared bytewise)
  MOEKIT_HD int64_t at(int64_t t) const {
    return wide ? static_cast<const int64_t*>(data)[t] : int64_t(static_cast<const int32_t*>(data)[t]);
  }
};

// hash_table: the layer's table (c.hash_vocab > 0), else empty.
RoutingParams routing_params(const LayerSpec& c, const std::vector<float>& score_bias,
                             const std::vector<int32_t>& hash_table = {});

// logits [T, E]; writes ids [T, k] and weights [T, k]. Hash routing (p.hash_table) reads the
// rows' token ids; one outside the table throws moekit::Error before anything is written.
void route_cpu(const RoutingParams& p, const float* logits, int64_t T, int32_t* ids,
               float* weights, const TokenIds& token_ids = {});

// Throws moekit::Error ("NAME: token t has id X, outside the hash table's V rows") for the first
// token id outside [0, hash_vocab); `name` is the tensor's (token_ids, or input_ids in files).
void check_token_ids(const TokenIds& token_ids, int64_t T, int64_t hash_vocab, const char* name = "token_ids");

// A tid2eid table [V, k] of int32 (wide: int64) entries as the layer keeps it (int32), checked:
// every entry in [0, E) and no expert twice in a row; messages start with `what` and name the
// row. Throws moekit::Error.
std::vector<int32_t> hash_table_from(const void* data, bool wide, int64_t V, int k, int E,
                                     const std::string& what);

}  // namespace moekit
