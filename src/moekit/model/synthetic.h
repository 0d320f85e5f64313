// moekit/model/synthetic.h — random models for the demo, tests and benchmarks, and writing a
// model directory in the SPEC layout.
#pragma once

#include <cstdint>
#include <string>

#include "moekit/model/layer_io.h"
#include "moekit/model/model.h"

namespace moekit {

struct SyntheticOptions {
  uint64_t seed = 1;
  bool biases = false;
  bool score_bias = false;      // e_score_correction_bias (sigmoid routing)
  bool split_scale_2 = false;   // nvfp4: w13_weight_scale_2 [E, 2]
  bool pow2_fp8_scales = false; // fp8: power-of-two block scales (E8M0-representable)
};

// Random non-zero codes and realistic scales (weights of magnitude ~2^-6), held in memory.
MoeModel make_synthetic_model(const MoeConfig& cfg, const SyntheticOptions& opt);

// config.json + experts.safetensors in the checkpoint layout of cfg.format (GPT-OSS names and
// gate/up interleave for mxfp4, ModelOpt-style for nvfp4, w13/w2 otherwise).
void write_model_dir(const MoeModel& m, const std::string& dir);

// Random hidden states (N(0,1) in bf16) and router logits (N(0, 2)).
LayerInputData make_synthetic_input(const MoeConfig& cfg, int64_t tokens, uint64_t seed);

// Refuses (moekit::Error naming the shape and size) a synthetic input of `tokens` tokens and
// its layer buffers that would not fit in host memory; make_synthetic_input and
// make_synthetic_model check their own allocations the same way.
void require_synthetic_memory(const MoeConfig& cfg, int64_t tokens);

}  // namespace moekit
