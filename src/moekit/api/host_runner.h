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

namespace moekit {

struct LayerInput {
  int64_t tokens = 0;
  const uint16_t* x = nullptr;       // [T, H] bf16
  bool bypass = false;               // ids/weights given: no routing
  const float* logits = nullptr;     // [T, E] (routing)
  const int32_t* ids = nullptr;      // [T, k] (bypass)
  const float* weights = nullptr;    // [T, k] (bypass)
  int k = 0;                         // columns of ids/weights (bypass), else the config's top_k
  const uint16_t* shared = nullptr;  // [T, H] bf16, optional: a shared expert's output
};

struct LayerOutput {
  std::vector<uint16_t> y;           // [T, H] bf16
  std::vector<int32_t> ids;          // [T, k]
  std::vector<float> weights;        // [T, k]
};

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
  // Runs in on the layer (packed on first use and again when T outgrows it); throws on errors,
  // including the device's error flag after the call.
  void run(const LayerInput& in, LayerOutput* out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit
