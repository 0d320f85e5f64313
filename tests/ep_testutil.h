// Helpers of the EP tests (tests/test_ep.cpp, tests/gpu/test_ep_gpu.cpp).
#pragma once

#include "moekit/comm/ep_layout.h"

namespace moekit::test {

// R ranks, E experts, top-k, H (rows padded to 64 as the SM90 experts read them), T tokens per
// rank, cap rows per local expert.
inline ep::Shape ep_shape(int R, int E, int k, int H, int T, int cap, ep::Payload p = ep::Payload::kBf16) {
  ep::Shape s;
  s.world = R;
  s.num_experts = E;
  s.top_k = k;
  s.hidden = H;
  s.hidden_pad = (H + 63) / 64 * 64;
  s.max_tokens = T;
  s.capacity = cap;
  s.payload = p;
  return s;
}

}  // namespace moekit::test
