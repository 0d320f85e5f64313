// moekit/experts/activation.h — the gated activations, in fp32, shared by the CPU reference
// and the GPU epilogues (MOEKIT_HD). Inputs are GEMM1 outputs plus bias; the result is rounded
// to bf16 by the caller (as a GPU kernel stores it).
//   silu:          silu(gate) * up
//   swiglu_oai:    g = min(gate, limit); u = clamp(up, -limit, limit);
//                  g * sigmoid(alpha * g) * (u + beta)                    (GPT-OSS)
//   silu_clamped:  silu(min(gate, limit)) * clamp(up, -limit, limit)       (DeepSeek-V4 style)
#pragma once

#include <cmath>

#include "moekit/common/hd.h"
#include "moekit/spec.hpp"

namespace moekit {

struct ActivationParams {
  Activation kind = Activation::kSilu;
  float alpha = 1.702f, beta = 1.0f, limit = 7.0f;
};

inline ActivationParams activation_params(const LayerSpec& c) {
  return {c.act, c.swiglu_alpha, c.swiglu_beta, c.swiglu_limit};
}

MOEKIT_HD float sigmoid_f32(float x) { return 1.0f / (1.0f + expf(-x)); }

MOEKIT_HD float apply_activation(const ActivationParams& p, float gate, float up) {
  switch (p.kind) {
    case Activation::kSwigluOai: {
      const float g = fminf(gate, p.limit);
      const float u = fminf(fmaxf(up, -p.limit), p.limit);
      return g * sigmoid_f32(p.alpha * g) * (u + p.beta);
    }
    case Activation::kSiluClamped: {
      const float g = fminf(gate, p.limit);
      const float u = fminf(fmaxf(up, -p.limit), p.limit);
      return g * sigmoid_f32(g) * u;
    }
    case Activation::kSilu:
    default:
      return gate * sigmoid_f32(gate) * up;
  }
}

}  // namespace moekit
