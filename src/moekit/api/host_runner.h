// moekit/api/host_runner.h — one layer run on host data through the public API: what `moekit
// run`, the demo and the tests use. It packs the weights for the chosen backend on its device
// (the GPU for GPU backends), copies inputs in, runs forward_logits or forward_topk, and copies
// the outputs back. A client of moekit.hpp like any other: no second path to the kernels.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moekit/experts/weights.h"
#include "moekit/moekit.hpp"
#include "moekit/oracle/backend.h"  // LayerInput, LayerOutput

namespace moekit {

// A layer's weights as the checkpoint tensors pack_weights takes (host memory, exact biases).
struct HostCheckpoint {
  CheckpointBytes bytes;
  std::vector<NamedTensor> tensors;  // views of bytes
  explicit HostCheckpoint(const LayerWeights& m);
  HostCheckpoint(const HostCheckpoint&) = delete;
  HostCheckpoint& operator=(const HostCheckpoint&) = delete;
};

class HostRunner {
 public:
  // backend: a name, or "" for the oracle's choice ($MOEKIT_BACKEND applies). Throws
  // moekit::Error when no backend can run the layer here.
  HostRunner(const LayerWeights& m, const std::string& backend);
  ~HostRunner();
  const std::string& backend() const;
  // The oracle's decision for `tokens` tokens (backend, every rejection).
  std::string explain(int64_t tokens) const;
  // Packs the layer for up to `tokens` tokens of k slots (run() does when it must).
  void prepare(int64_t tokens, int k);
  // Runs in on the layer (packed on first use and again when T outgrows it): checks the input
  // first (validate_layer_input: the same for every backend) and, with in.check_values, y after;
  // throws on errors, including the device's error flag after the call.
  void run(const LayerInput& in, LayerOutput* out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A shared expert (a one-expert layer: MoeModel::shared_expert, model/model.h) on x [T, H] bf16
// through `runner` (made over those weights): every row to its one expert with weight 1, so the
// result is the expert's output rounded to bf16 once, the `shared` rows a routed layer adds
// before its own rounding (LayerInput::shared).
std::vector<uint16_t> run_shared_expert(HostRunner& runner, const uint16_t* x, int64_t T);

}  // namespace moekit
