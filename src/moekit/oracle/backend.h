// moekit/oracle/backend.h — what a backend declares once, and the runner it builds.
//
// Each backend states its capabilities (BackendCaps) and answers supports(problem, device) with
// {ok, reason}; nothing else in the code base repeats those facts. create() converts the model's
// weights into the backend's own layout (its `convert` step) and returns a runner.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moekit/model/model.h"
#include "moekit/pipeline/activation_format.h"

namespace moekit {

struct DeviceInfo {
  bool gpu = false;
  std::string name = "CPU";
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t memory = 0;
  // The first CUDA device, or the CPU when there is none (or CUDA was not built).
  static DeviceInfo detect();
  std::string describe() const;
};

struct Problem {
  MoeConfig cfg;
  int64_t tokens = 0;
  bool has_biases = false;
  static Problem of(const MoeModel& m, int64_t tokens);
  std::string describe() const;
};

struct Support {
  bool ok = true;
  std::string reason;
  static Support yes() { return {true, ""}; }
  static Support no(std::string why) { return {false, std::move(why)}; }
};

struct BackendCaps {
  std::string name;
  std::string summary;
  ActivationFormat activation_format = ActivationFormat::kStandard;
  std::vector<WeightFormat> weight_formats;
  std::vector<Activation> activations;
  bool needs_sm90 = false;  // else: runs on the CPU
  int priority = 0;         // static order when no tuning table decides: higher first
};

struct LayerInput {
  int64_t tokens = 0;
  const uint16_t* x = nullptr;       // [T, H] bf16
  bool bypass = false;               // ids/weights given: no routing
  const float* logits = nullptr;     // [T, E] (routing)
  const int32_t* ids = nullptr;      // [T, k] (bypass)
  const float* weights = nullptr;    // [T, k] (bypass)
  int k = 0;                         // columns of ids/weights (bypass), else the config's top_k
  // Also scan the values: hidden_states before the run, y after it, for NaN/Inf (one pass over
  // each; layer_checks.h). Off by default, off the hot path; the CLI sets it.
  bool check_values = false;
};

struct LayerOutput {
  std::vector<uint16_t> y;           // [T, H] bf16
  std::vector<int32_t> ids;          // [T, k]
  std::vector<float> weights;        // [T, k]
};

class LayerRunner {
 public:
  virtual ~LayerRunner() = default;
  // Every implementation calls validate_layer_input() first and, when in.check_values is set,
  // check_layer_output() last (oracle/layer_checks.h): all backends accept the same inputs.
  virtual void run(const LayerInput& in, LayerOutput* out) = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const BackendCaps& caps() const = 0;
  // The common checks (format, activation, architecture) plus the backend's own.
  Support supports(const Problem& p, const DeviceInfo& d) const;
  virtual std::unique_ptr<LayerRunner> create(const MoeModel& m, const DeviceInfo& d) const = 0;
  // What the backend will run for this problem and why (e.g. which GEMM kernel at this token
  // count, from which tuning-table entry), for --explain; empty when there is nothing to say.
  virtual std::string plan(const Problem&, const DeviceInfo&) const { return {}; }

 protected:
  virtual Support supports_extra(const Problem&, const DeviceInfo&) const { return Support::yes(); }
};

}  // namespace moekit
