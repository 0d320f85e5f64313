// moekit/routing/router.h — the router ("gate") of a MoE layer: hidden states -> router logits,
// for checkpoints that carry the router's weights (Hugging Face directories), so that an input
// file may hold hidden_states alone.
//
//   logits[t, e] = sum_h x[t, h] * W[e, h]  (+ b[e])
// x is bf16 and W holds the checkpoint's values (bf16 in every published MoE checkpoint), so each
// product is exact in fp32; the sum runs in fp32 in h order (one fixed order: the same bits every
// run), the bias is added last in fp32.
#pragma once

#include <cstdint>
#include <vector>

namespace moekit {

struct RouterWeights {
  int num_experts = 0;
  int64_t hidden = 0;
  std::vector<float> weight;  // [E, H]; empty: no router
  std::vector<float> bias;    // [E] or empty

  bool empty() const { return weight.empty(); }
  // x [T, H] bf16 -> logits [T, E] fp32 (multithreaded over tokens and experts).
  std::vector<float> logits(const uint16_t* x, int64_t T) const;
};

}  // namespace moekit
