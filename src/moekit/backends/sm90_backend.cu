#include "moekit/backends/sm90_backend.h"

#include <cuda_runtime.h>

#include <limits>

#include "moekit/backends/sm90_layer.h"
#include "moekit/common/error.h"
#include "moekit/experts/sm90_fp8_gemm.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/oracle/tuning.h"
#include "moekit/pipeline/prepare_batched_sm90.cuh"

namespace moekit {

namespace {

// Runs calls on the caller's device: the CUDA runtime's current device is switched to it for the
// call (a no-op when it is current already).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&old_) == cudaSuccess && old_ != device && cudaSetDevice(device) == cudaSuccess) set_ = true;
  }
  ~DeviceScope() {
    if (set_) cudaSetDevice(old_);
  }

 private:
  int old_ = 0;
  bool set_ = false;
};

// Which GEMM kernel a backend runs: the crossover's choice per call, or one of the two.
enum class KernelPolicy { kAuto, kDecode, kPrefill };

class Sm90LayerImpl final : public LayerImpl {
 public:
  Sm90LayerImpl(const MoeConfig& c, ActivationFormat fmt, KernelPolicy policy, const std::vector<PackedBuffer>& packed,
                int device)
      : device_(device) {
    const DeviceScope scope(device);
    layer_ = std::make_unique<Sm90Layer>(c, fmt, packed);
    if (layer_->fp8_activations()) {
      // The FP8 chain at every token count (the backend's caps list fp8 for the crossover backends only).
      MOEKIT_REQUIRE(policy == KernelPolicy::kAuto, "sm90 backends that pin a bf16 GEMM kernel take no fp8 "
                     "activations; use sm90 or sm90_batched");
      return;
    }
    switch (policy) {
      case KernelPolicy::kDecode: layer_->set_prefill_from(-1); break;
      case KernelPolicy::kPrefill:
        MOEKIT_REQUIRE(layer_->prefill_supported(), "backend sm90_prefill: these ", format_name(c.format),
                       " weights have E8M0 scale bytes above the one-multiply range, which only the decode kernel "
                       "runs; use sm90 or sm90_decode");
        layer_->set_prefill_from(0);
        break;
      case KernelPolicy::kAuto: {
        const KernelCrossover x = sm90_crossover(c, DeviceInfo::detect(device));
        layer_->set_prefill_from(x.prefill_from);
        layer_->set_device_choice(x.band_from, x.band_to, x.stream_ratio, x.stream_ratio_slope);
        break;
      }
    }
  }

  int64_t workspace_bytes(ForwardCall::Entry e, int64_t T, int k) const override {
    return layer_->workspace_bytes(e, T, k);
  }
  void forward(const ForwardCall& c) override {
    const DeviceScope scope(device_);
    layer_->enqueue(c);
  }
  int error_flag(void* stream) override {
    const DeviceScope scope(device_);
    return layer_->plan_error(static_cast<cudaStream_t>(stream));
  }

 private:
  int device_;
  std::unique_ptr<Sm90Layer> layer_;
};

const std::vector<WeightFormat> kFormats = {WeightFormat::kMxfp4, WeightFormat::kNvfp4,
                                            WeightFormat::kMxfp8, WeightFormat::kBf16};
const std::vector<Activation> kActs = {Activation::kSilu, Activation::kSwigluOai, Activation::kSiluClamped};

// fp8 activations (LayerSpec::activation_dtype): the crossover backends run them on the FP8 chain
// (experts/sm90_fp8_chain.cuh) at every token count, with the weights the FP8 GEMM takes
// (fp8_supports: MXFP4, MXFP8); the backends that pin the decode or the bf16 prefill kernel do not.
class Sm90Backend final : public Backend {
 public:
  Sm90Backend(std::string name, ActivationFormat fmt, KernelPolicy policy, int priority, std::string summary)
      : caps_{std::move(name), std::move(summary), fmt, kFormats, kActs, true, priority}, policy_(policy) {
    if (policy == KernelPolicy::kAuto) {
      caps_.activation_dtypes = {ActivationDtype::kBf16, ActivationDtype::kFp8};
    } else {
      caps_.activation_dtype_note = std::string("it pins the ") +
                                    (policy == KernelPolicy::kDecode ? "decode" : "bf16 prefill") +
                                    " kernel; fp8 layers run on sm90 / sm90_batched, the FP8 GEMM";
    }
  }
  const BackendCaps& caps() const override { return caps_; }
  std::vector<BufferDesc> packed_buffers(const MoeConfig& c) const override { return sm90_packed_buffers(c); }
  void pack(const LayerWeights& m, const std::vector<PackedBuffer>& packed, void* stream) const override {
    sm90_pack(m, packed, static_cast<cudaStream_t>(stream));
  }
  void synthesize(const MoeConfig& c, const std::vector<PackedBuffer>& packed, uint64_t seed,
                  void* stream) const override {
    sm90_synthesize(c, packed, seed, static_cast<cudaStream_t>(stream));
  }
  std::unique_ptr<LayerImpl> create(const MoeConfig& c, const std::vector<PackedBuffer>& packed,
                                    int device) const override {
    return std::make_unique<Sm90LayerImpl>(c, caps_.activation_format, policy_, packed, device);
  }

  std::string plan(const Problem& p, const DeviceInfo& d) const override {
    if (p.cfg.activation_dtype == ActivationDtype::kFp8)
      return "the FP8 chain at every token count (quantize where rows are permuted, FP8 wgmma GEMM1, quantize, "
             "FP8 GEMM2); fp8 layers do not run the decode kernel yet, no tuning table applies";
    switch (policy_) {
      case KernelPolicy::kDecode: return "the decode GEMM kernel at every token count";
      case KernelPolicy::kPrefill: return "the prefill GEMM kernel at every token count";
      case KernelPolicy::kAuto: break;
    }
    const KernelCrossover x = sm90_crossover(p.cfg, d);
    if (x.device_choice(p.tokens)) return "the GEMM kernel chosen " + x.explain(p.tokens);
    const bool prefill = x.prefill_from >= 0 && p.tokens >= x.prefill_from;
    return std::string(prefill ? "the prefill" : "the decode") + " GEMM kernel at " + std::to_string(p.tokens) +
           " tokens (" + x.source + ")";
  }

 protected:
  Support supports_extra(const Problem& p, const DeviceInfo&) const override {
    if (p.cfg.num_experts > sm90::kMaxPlanCountsExperts) return Support::no("more than 1024 experts");
    if (p.cfg.activation_dtype == ActivationDtype::kFp8 && !sm90::fp8::fp8_supports(p.cfg.format, p.cfg.num_experts))
      return Support::no(std::string("no fp8 activations with ") + format_name(p.cfg.format) +
                         " weights (the SM90 FP8 GEMM takes mxfp4 and mxfp8 weights; bf16 activations run these)");
    // The GEMM numbers its tasks with int: both phases' segments for max_tokens routed rows.
    const int64_t rows = std::max<int64_t>(p.cfg.max_tokens, p.tokens) * p.cfg.top_k;
    const int64_t chunks = p.cfg.num_experts + (rows + sm90::kTokens - 1) / sm90::kTokens;
    const int64_t groups = (2 * sm90::pad_to(p.cfg.intermediate, sm90::kAlign) + sm90::pad_to(p.cfg.hidden, sm90::kAlign)) /
                           sm90::kGroupRows;
    if (chunks * groups > int64_t(std::numeric_limits<int>::max()) / 2)
      return Support::no("too many tokens per call for the GEMM's task numbering");
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
                                 "(oracle/tuning), the prefill kernel from it, one copy of the weights; fp8 "
                                 "activations (mxfp4, mxfp8 weights): the FP8 GEMMs at every size");
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
