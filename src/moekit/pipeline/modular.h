// moekit/pipeline/modular.h — the modular pipeline, drawn:
//
//   x [T,H] bf16, ids/weights [T,k]
//     -> PrepareFinalize<L>::prepare   permute rows into layout L (standard or batched)
//     -> ExpertsKernel<L>::apply       per expert: GEMM1 -> +bias -> activation -> bf16 -> GEMM2 -> +bias
//     -> PrepareFinalize<L>::finalize  un-permute, weight by top-k weights, sum over k in slot
//                                      order (fp32), add the shared expert's row (optional),
//                                      round to bf16 once
//   -> y [T,H] bf16
//
// Host-memory halves (the CPU backend); GPU backends keep the same split on the device.
#pragma once

#include <cstdint>

#include "moekit/pipeline/activation_format.h"

namespace moekit {

// Where finalize writes: rows of y with stride `stride` (elements); `shared` rows (optional, bf16,
// stride shared_stride) are added to the fp32 sum before its one rounding.
struct FinalOut {
  uint16_t* y = nullptr;
  int64_t stride = 0;
  const uint16_t* shared = nullptr;
  int64_t shared_stride = 0;
};

template <class L>
class PrepareFinalize {
 public:
  virtual ~PrepareFinalize() = default;
  // x: [T, H] bf16; ids: [T, k] (-1 = empty). Fills `out` (layout and rows).
  virtual void prepare(const uint16_t* x, int64_t T, int64_t H, const int32_t* ids, int k,
                       int num_experts, Activations<L>* out) const = 0;
  // y[t] = bf16(sum_j weights[t, j] * out[dest(t, j)] + shared[t]) over non-empty slots, j
  // ascending.
  virtual void finalize(const L& layout, const ExpertOutput<L>& out, const float* weights,
                        int64_t T, int k, const FinalOut& y) const = 0;
};

template <class L>
class ExpertsKernel {
 public:
  virtual ~ExpertsKernel() = default;
  virtual void apply(const Activations<L>& in, ExpertOutput<L>* out) const = 0;
};

template <class L>
class ModularPipeline {
 public:
  ModularPipeline(const PrepareFinalize<L>& pf, const ExpertsKernel<L>& experts)
      : pf_(pf), experts_(experts) {}
  void run(const uint16_t* x, int64_t T, int64_t H, const int32_t* ids, const float* weights,
           int k, int num_experts, const FinalOut& y) const {
    Activations<L> a;
    pf_.prepare(x, T, H, ids, k, num_experts, &a);
    ExpertOutput<L> o;
    experts_.apply(a, &o);
    pf_.finalize(a.layout, o, weights, T, k, y);
  }
  void run(const uint16_t* x, int64_t T, int64_t H, const int32_t* ids, const float* weights,
           int k, int num_experts, uint16_t* y) const {
    run(x, T, H, ids, weights, k, num_experts, FinalOut{y, H});
  }

 private:
  const PrepareFinalize<L>& pf_;
  const ExpertsKernel<L>& experts_;
};

class StandardPrepareFinalize final : public PrepareFinalize<StandardLayout> {
 public:
  explicit StandardPrepareFinalize(int align) : align_(align) {}
  void prepare(const uint16_t* x, int64_t T, int64_t H, const int32_t* ids, int k,
               int num_experts, Activations<StandardLayout>* out) const override;
  void finalize(const StandardLayout& layout, const ExpertOutput<StandardLayout>& out,
                const float* weights, int64_t T, int k, const FinalOut& y) const override;

 private:
  int align_;
};

class BatchedPrepareFinalize final : public PrepareFinalize<BatchedLayout> {
 public:
  void prepare(const uint16_t* x, int64_t T, int64_t H, const int32_t* ids, int k,
               int num_experts, Activations<BatchedLayout>* out) const override;
  void finalize(const BatchedLayout& layout, const ExpertOutput<BatchedLayout>& out,
                const float* weights, int64_t T, int k, const FinalOut& y) const override;
};

}  // namespace moekit
