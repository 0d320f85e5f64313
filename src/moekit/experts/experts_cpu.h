// moekit/experts/experts_cpu.h — the CPU experts kernel (reference numerics, multithreaded).
//
// Per expert with rows: GEMM1 over logical w13 rows (gate j and up j together), + bias,
// activation in fp32, rounded to bf16; GEMM2 over w2 rows, + bias, fp32 out. Weight rows are
// dequantized on the fly into a per-thread fp32 row buffer and reused for all of the expert's
// tokens: no fp32 copy of the weights is ever made.
#pragma once

#include "moekit/experts/activation.h"
#include "moekit/experts/weights.h"
#include "moekit/pipeline/modular.h"

namespace moekit {

template <class L>
class CpuExperts final : public ExpertsKernel<L> {
 public:
  explicit CpuExperts(const LayerWeights& m) : m_(m), act_(activation_params(m.cfg)) {}
  void apply(const Activations<L>& in, ExpertOutput<L>* out) const override;

 private:
  const LayerWeights& m_;
  ActivationParams act_;
};

}  // namespace moekit
