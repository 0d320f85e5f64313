// moekit/oracle/backend.h — what a backend declares once, and what it builds.
//
// Each backend states its capabilities (BackendCaps) and answers supports(problem, device) with
// {ok, reason}; nothing else in the code base repeats those facts. Its packed weights are its own
// layout: packed_buffers() lists them, pack() converts a layer's weights into them (its `convert`
// step) and create() returns a LayerImpl that runs forward calls on raw, already-checked
// arguments (api/ checks the caller's tensors and turns exceptions into Status).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moekit/experts/weights.h"
#include "moekit/pipeline/activation_format.h"

namespace moekit {

struct DeviceInfo {
  bool gpu = false;
  int index = 0;  // CUDA device ordinal
  int gpus = 0;   // CUDA devices present (a CPU layer on a GPU machine has gpu = false, gpus > 0)
  std::string name = "CPU";
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t memory = 0;
  // CUDA device `index`, or the CPU when there is none (or CUDA was not built).
  static DeviceInfo detect(int index = 0);
  static DeviceInfo cpu() { return DeviceInfo{}; }
  std::string describe() const;
};

struct Problem {
  MoeConfig cfg;
  int64_t tokens = 0;
  bool has_biases = false;
  static Problem of(const MoeConfig& c, int64_t tokens);
  static Problem of(const LayerWeights& m, int64_t tokens);
  std::string describe() const;
};

struct Support {
  bool ok = true;
  std::string reason;
  static Support yes() { return {true, ""}; }
  static Support no(std::string why) { return {false, std::move(why)}; }
};

// The quantization an MoE layer's activations carry between prepare and the experts, and the
// side that applies it (oracle/pairing.h checks the pair).
enum class InputQuant { kNone, kMxfp8, kNvfp4 };
enum class QuantizeSide { kPrepare, kExperts };

struct BackendCaps {
  std::string name;
  std::string summary;
  ActivationFormat activation_format = ActivationFormat::kStandard;
  std::vector<WeightFormat> weight_formats;
  std::vector<Activation> activations;
  bool needs_sm90 = false;  // else: runs on the CPU
  int priority = 0;         // static order when no tuning table decides: higher first
  // Activation quantization: what the experts apply to their bf16 inputs themselves, and which
  // quantized rows (codes + scales) they read. Empty: bf16 in, no quantization (W4A16).
  std::vector<InputQuant> quantizes_inputs;
  std::vector<InputQuant> takes_quantized;
  // The layer input precisions (LayerSpec::activation_dtype) the experts run exactly as spec.hpp
  // defines them. A layer asking for another is refused, never run with bf16 activations.
  std::vector<ActivationDtype> activation_dtypes = {ActivationDtype::kBf16};
  // Added to the reason when a layer asks for another: where such a layer runs instead (or "").
  std::string activation_dtype_note;
};

// One layer call on host data (api/host_runner.h runs them through the public API).
struct LayerInput {
  int64_t tokens = 0;
  const uint16_t* x = nullptr;       // [T, H] bf16
  bool bypass = false;               // ids/weights given: no routing
  const float* logits = nullptr;     // [T, E] (routing)
  const int64_t* token_ids = nullptr;  // [T] (hash routing: the rows' token ids)
  const int32_t* ids = nullptr;      // [T, k] (bypass)
  const float* weights = nullptr;    // [T, k] (bypass)
  int k = 0;                         // columns of ids/weights (bypass), else the config's top_k
  const uint16_t* shared = nullptr;  // [T, H] bf16, optional: a shared expert's output
  // Also scan the values: hidden_states before the run, y after it, for NaN/Inf (one pass over
  // each; layer_checks.h). Off by default, off the hot path; the CLI sets it.
  bool check_values = false;
};

struct LayerOutput {
  std::vector<uint16_t> y;           // [T, H] bf16
  std::vector<int32_t> ids;          // [T, k]
  std::vector<float> weights;        // [T, k]
};

// A packed buffer as the backend sees it: device (or host) memory of at least `bytes`.
struct PackedBuffer {
  void* data = nullptr;
  int64_t bytes = 0;
};

// One forward call, its tensors checked by api/ (dtypes, shapes, devices, strides, sizes).
// Strides are in elements. Entry kLogits: route `logits`, writing ids/weights (which point into
// the workspace unless the caller asked for them); kTopk: ids/weights are given; kBatched: the
// experts on x [E, T, H] with `counts`, no routing and no finalize.
struct ForwardCall {
  enum Entry { kLogits, kTopk, kBatched };
  Entry entry = kLogits;
  int64_t T = 0;  // tokens; kBatched: rows per expert
  int k = 0;
  const uint16_t* x = nullptr;
  int64_t x_stride = 0, x_expert_stride = 0;
  const float* logits = nullptr;
  const void* token_ids = nullptr;  // kLogits of a hash-routed layer: int32 or int64 [T]
  bool token_ids_wide = false;      // int64
  int32_t* ids = nullptr;
  float* weights = nullptr;
  bool routing_out = false;  // kLogits: ids/weights are the caller's outputs
  const int32_t* counts = nullptr;
  uint16_t* y = nullptr;
  int64_t y_stride = 0, y_expert_stride = 0;
  const uint16_t* shared = nullptr;
  int64_t shared_stride = 0;
  void* workspace = nullptr;
  void* stream = nullptr;
};

class LayerImpl {
 public:
  virtual ~LayerImpl() = default;
  // Workspace bytes of a call (256-byte aligned buffer); for kLogits it includes ids/weights.
  virtual int64_t workspace_bytes(ForwardCall::Entry e, int64_t T, int k) const = 0;
  // Throws moekit::Error only for what it finds before writing anything.
  virtual void forward(const ForwardCall& c) = 0;
  // The device error flag of the last call (0: none; 1: id out of range; 2: batched overflow;
  // 3: a token id outside the hash table).
  virtual int error_flag(void* stream) { (void)stream; return 0; }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const BackendCaps& caps() const = 0;
  // The common checks (format, activation, architecture) plus the backend's own.
  Support supports(const Problem& p, const DeviceInfo& d) const;

  virtual std::vector<BufferDesc> packed_buffers(const MoeConfig& c) const = 0;
  // Converts m into `packed` (packed_buffers(m.cfg) order, device memory for GPU backends);
  // waits for its copies.
  virtual void pack(const LayerWeights& m, const std::vector<PackedBuffer>& packed, void* stream) const = 0;
  // Random but valid packed weights.
  virtual void synthesize(const MoeConfig& c, const std::vector<PackedBuffer>& packed, uint64_t seed,
                          void* stream) const = 0;
  // A layer over packed buffers the caller keeps alive; device: the CUDA ordinal they live on.
  virtual std::unique_ptr<LayerImpl> create(const MoeConfig& c, const std::vector<PackedBuffer>& packed,
                                            int device) const = 0;
  // What the backend will run for this problem and why (e.g. which GEMM kernel at this token
  // count, from which tuning-table entry), for --explain; empty when there is nothing to say.
  virtual std::string plan(const Problem&, const DeviceInfo&) const { return {}; }

 protected:
  virtual Support supports_extra(const Problem&, const DeviceInfo&) const { return Support::yes(); }
};

}  // namespace moekit
