// moekit/model/model.h — one MoE layer from files, loaded and validated, with the expert weights
// left in the checkpoint's bytes (memory-mapped): the layer description and weight views of
// experts/weights.h, plus the storage they point into. Two kinds of directory:
//   a moekit layer directory   config.json + experts.safetensors (SPEC section 7), and
//                              optionally shared_expert/ (a one-expert layer directory: the
//                              model's shared expert, as `moekit convert` writes DeepSeek-V4's)
//   a Hugging Face checkpoint  config.json + model.safetensors.index.json + shards, any MoE
//                              layer of it (model/hf_checkpoint.h), router weights included
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/experts/weights.h"
#include "moekit/io/safetensors.h"
#include "moekit/io/safetensors_index.h"
#include "moekit/model/config.h"
#include "moekit/routing/router.h"

namespace moekit {

struct MoeModel : LayerWeights {
  std::string dir;
  SafetensorsFile file;      // owns the mapping the WeightMatrix views point into (loaded)
  SafetensorsFile shared_file;  // a layer directory's shared_expert/experts.safetensors
  SafetensorsIndex shards;   // or the mapped shards of a Hugging Face checkpoint
  std::vector<std::vector<uint8_t>> storage;  // or the bytes themselves (synthetic models)
  RouterWeights router;      // the checkpoint's router (Hugging Face checkpoints), or empty
  int layer = -1;            // the checkpoint's layer index (Hugging Face checkpoints), or -1
  std::string source;        // "gpt_oss layer 3 of DIR (...)"; empty for layer directories
  std::vector<std::string> notes;  // what the layer leaves out (a shared expert, input scales)
  // The model's shared expert as a one-expert layer (E = 1, top-1, weight 1: its output is
  // expert(x), rounded to bf16, what the layer adds as `shared`), where the checkpoint's layer has
  // one that moekit runs (DeepSeek-V4); else shared_expert.cfg.num_experts is 0.
  LayerWeights shared_expert;
  bool has_shared_expert() const { return shared_expert.cfg.num_experts > 0; }

  // A layer directory (layer must be -1), or layer `layer` of a Hugging Face checkpoint
  // directory (-1: its first MoE layer). Throws moekit::Error naming the file, tensor and problem
  // on anything missing or inconsistent.
  static MoeModel load(const std::string& dir, int layer = -1);

  MoeModel() = default;
  MoeModel(MoeModel&&) = default;
  MoeModel& operator=(MoeModel&&) = default;
};

// The files a model directory's layer is read from (config.json, experts.safetensors; or the
// config, index and every shard of a checkpoint): the inputs an output must not replace.
std::vector<std::string> model_files(const std::string& dir);

// The tensors of a safetensors file as checkpoint tensors (views of its mapping).
std::vector<CheckpointTensor> checkpoint_tensors(const SafetensorsFile& f);

}  // namespace moekit
