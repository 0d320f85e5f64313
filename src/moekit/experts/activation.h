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
// The GPU's sigmoid: 1 / (1 + 2^(-x log2(e))) with the hardware's approximate exp2 and reciprocal
// (ex2.approx, rcp.approx: a few ulp of fp32; the argument's own rounding adds about |x| 2^-24,
// ~7e-6 relative at |x| = 88), against expf and an exact reciprocal on the CPU: far below
// the bf16 rounding of the epilogue's result (2^-9 relative), so the stored bits differ from the
// CPU's only where a value lies that close to a rounding boundary. Two MUFU and two FP32
// instructions where expf and a correctly rounded reciprocal took ~17: the GEMM1 epilogue runs
// while its warpgroup's tensor work waits (docs/perf/log.md). Limits: x -> -inf gives 0
// (1 / inf), x -> +inf gives 1; for x below about -87 the result is flushed to 0 where the CPU
// gives a subnormal (an activation of magnitude below 1e-36).
__device__ __forceinline__ float sigmoid_f32(float x) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
}
#else
MOEKIT_HD float sigmoid_f32(float x) { return 1.0f / (1.0f + expf(-x)); }
#endif

// One activation, chosen at compile time (the GPU epilogues hoist the choice out of their
// per-element loops); apply_activation picks it at run time. Both are the same arithmetic (the
// sigmoid: see above for the GPU's).
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
