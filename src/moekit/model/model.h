// moekit/model/model.h — a model directory (config.json + experts.safetensors), loaded and
// validated, with the expert weights left in the checkpoint's bytes (memory-mapped): the layer
// description and weight views of experts/weights.h, plus the storage they point into.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/experts/weights.h"
#include "moekit/io/safetensors.h"
#include "moekit/model/config.h"

namespace moekit {

struct MoeModel : LayerWeights {
  std::string dir;
  SafetensorsFile file;      // owns the mapping the WeightMatrix views point into (loaded)
  std::vector<std::vector<uint8_t>> storage;  // or the bytes themselves (synthetic models)

  // Loads DIR/config.json and DIR/experts.safetensors; throws moekit::Error naming the file,
  // tensor and problem on anything missing or inconsistent.
  static MoeModel load(const std::string& dir);

  MoeModel() = default;
  MoeModel(MoeModel&&) = default;
  MoeModel& operator=(MoeModel&&) = default;
};

// The tensors of a safetensors file as checkpoint tensors (views of its mapping).
std::vector<CheckpointTensor> checkpoint_tensors(const SafetensorsFile& f);

}  // namespace moekit
