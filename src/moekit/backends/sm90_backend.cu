#include "moekit/backends/sm90_backend.h"

#include <cuda_runtime.h>

#include "moekit/backends/cpu_backend.h"
#include "moekit/backends/sm90_layer.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/oracle/layer_checks.h"
#include "moekit/oracle/tuning.h"

namespace moekit {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("CUDA error in ", what, ": ", cudaGetErrorString(e));
}

// Which GEMM kernel a backend runs: the crossover's choice per call, or one of the two.
enum class KernelPolicy { kAuto, kDecode, kPrefill };

class Sm90Runner final : public LayerRunner {
 public:
  Sm90Runner(const MoeModel& m, ActivationFormat fmt, KernelPolicy policy, const DeviceInfo& d)
      : m_(m), fmt_(fmt), layer_(m, fmt) {
    switch (policy) {
      case KernelPolicy::kDecode: layer_.set_prefill_from(-1); break;
      case KernelPolicy::kPrefill:
        MOEKIT_REQUIRE(layer_.prefill_supported(), "backend sm90_prefill: these ", format_name(m.cfg.format),
                       " weights have E8M0 scale bytes above the one-multiply range, which only the decode kernel "
                       "runs; use sm90 or sm90_decode");
        layer_.set_prefill_from(0);
        break;
      case KernelPolicy::kAuto: layer_.set_prefill_from(sm90_crossover(m.cfg, d).prefill_from); break;
    }
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream create");
  }
  ~Sm90Runner() override { cudaStreamDestroy(stream_); }

  void run(const LayerInput& in, LayerOutput* out) override {
    validate_layer_input(m_.cfg, in);
    const int64_t T = in.tokens, H = m_.cfg.hidden, E = m_.cfg.num_experts;
    const bool bypass = in.bypass;
    const int k = bypass ? in.k : m_.cfg.top_k;
    out->y.assign(size_t(T * H), 0);
    if (T == 0) {
      out->ids.clear();
      out->weights.clear();
      return;
    }
    layer_.reserve(T, k);
    auto h2d = [&](void* dst, const void* src, size_t bytes) {
      check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "copy in");
    };
    check(cudaMemcpy2DAsync(layer_.x(), size_t(layer_.x_stride()) * 2, in.x, size_t(H) * 2, size_t(H) * 2, size_t(T),
                            cudaMemcpyHostToDevice, stream_),
          "copy in");
    if (bypass) {
      h2d(layer_.ids(), in.ids, size_t(T * k) * 4);
      h2d(layer_.weights(), in.weights, size_t(T * k) * 4);
    } else {
      h2d(layer_.logits(), in.logits, size_t(T * E) * 4);
    }
    layer_.enqueue(stream_, T, bypass);
    out->ids.resize(size_t(T * k));
    out->weights.resize(size_t(T * k));
    check(cudaMemcpyAsync(out->y.data(), layer_.y(), size_t(T * H) * 2, cudaMemcpyDeviceToHost, stream_), "copy out");
    check(cudaMemcpyAsync(out->ids.data(), layer_.ids(), size_t(T * k) * 4, cudaMemcpyDeviceToHost, stream_), "copy out");
    check(cudaMemcpyAsync(out->weights.data(), layer_.weights(), size_t(T * k) * 4, cudaMemcpyDeviceToHost, stream_),
          "copy out");
    check(cudaStreamSynchronize(stream_), "layer");
    const int err = layer_.plan_error(stream_);
    MOEKIT_REQUIRE(err == 0, "sm90 layer: ", err == 1 ? "expert id out of range" : "batched capacity exceeded");
    if (in.check_values) check_layer_output(*out, T, H);
  }

 private:
  const MoeModel& m_;
  ActivationFormat fmt_;
  Sm90Layer layer_;
  cudaStream_t stream_ = nullptr;
};

const std::vector<WeightFormat> kFormats = {WeightFormat::kMxfp4, WeightFormat::kNvfp4,
                                            WeightFormat::kMxfp8, WeightFormat::kBf16};
const std::vector<Activation> kActs = {Activation::kSilu, Activation::kSwigluOai, Activation::kSiluClamped};

class Sm90Backend final : public Backend {
 public:
  Sm90Backend(std::string name, ActivationFormat fmt, KernelPolicy policy, int priority, std::string summary)
      : caps_{std::move(name), std::move(summary), fmt, kFormats, kActs, true, priority}, policy_(policy) {}
  const BackendCaps& caps() const override { return caps_; }
  std::unique_ptr<LayerRunner> create(const MoeModel& m, const DeviceInfo& dev) const override {
    // The converted weights live in host memory first, then on the GPU: refuse what cannot fit.
    const MoeConfig& c = m.cfg;
    const int64_t Hp = sm90::pad_to(c.hidden, sm90::kAlign), Ip = sm90::pad_to(c.intermediate, sm90::kAlign);
    const sm90::LayoutDims d13{c.format, c.num_experts, 2 * Ip, Hp}, d2{c.format, c.num_experts, Hp, Ip};
    const uint64_t bytes = sat_add(sat_add(uint64_t(d13.code_bytes()), uint64_t(d13.scale_bytes())),
                                   sat_add(uint64_t(d2.code_bytes()), uint64_t(d2.scale_bytes())));
    require_host_memory("sm90: converting the expert weights", bytes);
    size_t free_b = 0, total_b = 0;
    check(cudaMemGetInfo(&free_b, &total_b), "memory info");
    MOEKIT_REQUIRE(bytes <= free_b, "sm90: the converted expert weights need ", human_bytes(bytes),
                   " of GPU memory; ", human_bytes(free_b), " of ", human_bytes(total_b), " free");
    return std::make_unique<Sm90Runner>(m, caps_.activation_format, policy_, dev);
  }

  std::string plan(const Problem& p, const DeviceInfo& d) const override {
    switch (policy_) {
      case KernelPolicy::kDecode: return "the decode GEMM kernel at every token count";
      case KernelPolicy::kPrefill: return "the prefill GEMM kernel at every token count";
      case KernelPolicy::kAuto: break;
    }
    const KernelCrossover x = sm90_crossover(p.cfg, d);
    const bool prefill = x.prefill_from >= 0 && p.tokens >= x.prefill_from;
    return std::string(prefill ? "the prefill" : "the decode") + " GEMM kernel at " + std::to_string(p.tokens) +
           " tokens (" + x.source + ")";
  }

 protected:
  Support supports_extra(const Problem& p, const DeviceInfo&) const override {
    if (p.cfg.num_experts > 1024) return Support::no("more than 1024 experts");
    return Support::yes();
  }

 private:
  BackendCaps caps_;
  KernelPolicy policy_;
};

}  // namespace

std::vector<const Backend*> sm90_backends() {
  using F = ActivationFormat;
  static const Sm90Backend autos("sm90", F::kStandard, KernelPolicy::kAuto, 22,
                                 "SM90 grouped W4A16/W8A16 GEMMs: the decode kernel below the crossover "
                                 "(oracle/tuning), the prefill kernel from it, one copy of the weights");
  static const Sm90Backend autob("sm90_batched", F::kBatched, KernelPolicy::kAuto, 21,
                                 "the same on the batched (masked) activation format");
  static const Sm90Backend decs("sm90_decode", F::kStandard, KernelPolicy::kDecode, 20,
                                "the decode kernel at every size: swap-AB mma.sync, split-K over all SMs");
  static const Sm90Backend decb("sm90_decode_batched", F::kBatched, KernelPolicy::kDecode, 19,
                                "the decode kernel on the batched (masked) activation format");
  static const Sm90Backend pres("sm90_prefill", F::kStandard, KernelPolicy::kPrefill, 18,
                                "the prefill kernel at every size: warp-specialized wgmma, 256 x 96 tiles");
  static const Sm90Backend preb("sm90_prefill_batched", F::kBatched, KernelPolicy::kPrefill, 17,
                                "the prefill kernel on the batched (masked) activation format");
  return {&autos, &autob, &decs, &decb, &pres, &preb};
}

}  // namespace moekit
