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

#ifdef __CUDA_ARCH__
// 1 / d for d >= 1, rounded as rcp.rn.f32 rounds it, without rcp.rn's slow-path call (a call
// with the GEMM accumulators live makes ptxas spill them all around it): the approximate
// reciprocal and one Newton step, rcp.rn's own fast path, exact for every d below 2^126; above
// (sigmoid of x < -87, results below 2^-126) d is scaled into range first.
__device__ __forceinline__ float rcp_ge1(float d) {
  const bool big = d >= 0x1p126f;
  const float x = big ? d * 0x1p-126f : d;
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  r = fmaf(r, fmaf(-x, r, 1.0f), r);
  return big ? r * 0x1p-126f : r;  // inf -> 0
}
MOEKIT_HD float sigmoid_f32(float x) { return rcp_ge1(1.0f + expf(-x)); }
#else
MOEKIT_HD float sigmoid_f32(float x) { return 1.0f / (1.0f + expf(-x)); }
#endif

// One activation, chosen at compile time (the GPU epilogues hoist the choice out of their
// per-element loops); apply_activation picks it at run time. Both are the same arithmetic.
template <Activation A>
MOEKIT_HD float activation_of(const ActivationParams& p, float gate, float up) {
  if constexpr (A == Activation::kSwigluOai) {
    const float g = fminf(gate, p.limit);
    const float u = fminf(fmaxf(up, -p.limit), p.limit);
    return g * sigmoid_f32(p.alpha * g) * (u + p.beta);
  } else if constexpr (A == Activation::kSiluClamped) {
    const float g = fminf(gate, p.limit);
    const float u = fminf(fmaxf(up, -p.limit), p.limit);
    return g * sigmoid_f32(g) * u;
  } else {
    return gate * sigmoid_f32(gate) * up;
  }
}

MOEKIT_HD float apply_activation(const ActivationParams& p, float gate, float up) {
  switch (p.kind) {
    case Activation::kSwigluOai: return activation_of<Activation::kSwigluOai>(p, gate, up);
    case Activation::kSiluClamped: return activation_of<Activation::kSiluClamped>(p, gate, up);
    case Activation::kSilu:
    default: return activation_of<Activation::kSilu>(p, gate, up);
  }
}

}  // namespace moekit
