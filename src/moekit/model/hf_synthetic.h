// moekit/model/hf_synthetic.h — Hugging Face checkpoint directories written from layer weights,
// in the layouts the models publish (model/hf_checkpoint.h): config.json with the model's own
// fields, sharded safetensors with model.safetensors.index.json, the experts' tensors by their
// real names, dtypes and shapes, the router, and small stand-ins for the rest of the model
// (embeddings, attention, norms, dense MLPs) under their real names. For tests and benchmarks.
#pragma once

#include <string>
#include <vector>

#include "moekit/experts/weights.h"
#include "moekit/routing/router.h"

namespace moekit {

struct HfLayerSource {
  const LayerWeights* weights = nullptr;  // the layer's experts (its cfg describes them; a
                                          // hash-routed one brings its table)
  const RouterWeights* router = nullptr;  // bf16-representable values
  // deepseek_v4: the shared expert (E = 1), FP8 with power-of-two scales (written as E8M0 blocks
  // of 128x128) or BF16.
  const LayerWeights* shared = nullptr;
};

struct HfCheckpointOptions {
  std::string model_type = "mixtral";  // gpt_oss | deepseek_v3 | deepseek_v4 | qwen3_moe | mixtral
  int num_layers = 2;
  int first_dense = 0;       // deepseek_v3: first_k_dense_replace (dense layers 0..first_dense-1)
  int shards = 2;            // 1 with single_file: model.safetensors, no index
  bool single_file = false;
  bool modelopt = false;     // nvfp4 weights: ModelOpt's names and hf_quant_config.json
  bool bf16_fp8_scales = false;  // fp8 weights: weight_scale_inv in BF16 (Qwen3's FP8 releases)
  // deepseek_v4: the first num_hash_layers layers route by gate.tid2eid (their sources' tables,
  // hash_vocab = vocab rows); DeepSeek's names (layers.L.ffn...) or transformers'
  // (model.layers.L.mlp..., BF16 experts stacked as gate_up_proj); the table as I64 or I32; the
  // MoE fields in config.json's text_config (V4.1).
  int num_hash_layers = 0;
  int64_t vocab = 64;
  bool v4_transformers_names = false;
  bool table_i32 = false;
  bool text_config = false;
};

// Writes DIR (created if needed). moe[i] is the i-th MoE layer (all the same format; the first
// gives config.json its numbers); there must be as many as the options make MoE layers. Tensor
// bytes are streamed from the sources while the shards are written (nothing is copied whole).
void write_hf_checkpoint(const std::string& dir, const HfCheckpointOptions& opt,
                         const std::vector<HfLayerSource>& moe);

// A random router [E, H] of bf16 values (N(0, 0.05)), with a bias [E] when `bias`.
RouterWeights make_synthetic_router(int num_experts, int64_t hidden, uint64_t seed, bool bias);

}  // namespace moekit
