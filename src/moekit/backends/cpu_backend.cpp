#include "moekit/backends/cpu_backend.h"

#include "moekit/common/error.h"
#include "moekit/experts/experts_cpu.h"
#include "moekit/oracle/layer_checks.h"
#include "moekit/pipeline/modular.h"
#include "moekit/routing/routing.h"

namespace moekit {

void route_or_copy(const MoeModel& m, const LayerInput& in, LayerOutput* out) {
  const int64_t T = in.tokens;
  if (!in.bypass) {
    const int k = m.cfg.top_k;
    out->ids.assign(size_t(T * k), -1);
    out->weights.assign(size_t(T * k), 0.0f);
    route_cpu(routing_params(m.cfg, m.score_bias), in.logits, T, out->ids.data(),
              out->weights.data());
  } else {
    out->ids.assign(in.ids, in.ids + T * in.k);
    out->weights.assign(in.weights, in.weights + T * in.k);
  }
}

namespace {

template <class L, class PF>
class CpuRunner final : public LayerRunner {
 public:
  CpuRunner(const MoeModel& m, PF pf) : m_(m), pf_(std::move(pf)), experts_(m) {}
  void run(const LayerInput& in, LayerOutput* out) override {
    validate_layer_input(m_.cfg, in);
    out->y.assign(size_t(in.tokens * m_.cfg.hidden), 0);
    if (in.tokens == 0) {  // nothing to route; empty outputs
      out->ids.clear();
      out->weights.clear();
      return;
    }
    route_or_copy(m_, in, out);
    const int k = int(out->ids.size() / size_t(in.tokens));
    ModularPipeline<L>(pf_, experts_)
        .run(in.x, in.tokens, m_.cfg.hidden, out->ids.data(), out->weights.data(), k,
             m_.cfg.num_experts, out->y.data());
    if (in.check_values) check_layer_output(*out, in.tokens, m_.cfg.hidden);
  }

 private:
  const MoeModel& m_;
  PF pf_;
  CpuExperts<L> experts_;
};

const std::vector<WeightFormat> kAllFormats = {WeightFormat::kMxfp4, WeightFormat::kNvfp4,
                                               WeightFormat::kMxfp8, WeightFormat::kBf16};
const std::vector<Activation> kAllActivations = {Activation::kSilu, Activation::kSwigluOai,
                                                 Activation::kSiluClamped};

class CpuBackend final : public Backend {
 public:
  const BackendCaps& caps() const override {
    static const BackendCaps c{"cpu", "CPU reference, multithreaded, on-the-fly dequantization",
                               ActivationFormat::kStandard, kAllFormats, kAllActivations, false, 10};
    return c;
  }
  std::unique_ptr<LayerRunner> create(const MoeModel& m, const DeviceInfo&) const override {
    return std::make_unique<CpuRunner<StandardLayout, StandardPrepareFinalize>>(
        m, StandardPrepareFinalize(1));
  }
};

class CpuBatchedBackend final : public Backend {
 public:
  const BackendCaps& caps() const override {
    static const BackendCaps c{"cpu_batched", "CPU reference on the batched (masked) format",
                               ActivationFormat::kBatched, kAllFormats, kAllActivations, false, 9};
    return c;
  }
  std::unique_ptr<LayerRunner> create(const MoeModel& m, const DeviceInfo&) const override {
    return std::make_unique<CpuRunner<BatchedLayout, BatchedPrepareFinalize>>(
        m, BatchedPrepareFinalize());
  }
};

}  // namespace

const Backend& cpu_backend() {
  static const CpuBackend b;
  return b;
}
const Backend& cpu_batched_backend() {
  static const CpuBatchedBackend b;
  return b;
}

}  // namespace moekit
