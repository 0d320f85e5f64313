#include "moekit/model/model.h"

namespace moekit {

std::vector<CheckpointTensor> checkpoint_tensors(const SafetensorsFile& f) {
  std::vector<CheckpointTensor> v;
  for (const TensorView& t : f.tensors()) v.push_back({t.name, dtype_name(t.dtype), t.shape, t.data, t.nbytes});
  return v;
}

MoeModel MoeModel::load(const std::string& dir) {
  MoeModel m;
  m.dir = dir;
  const MoeConfig cfg = load_config(dir + "/config.json");
  const std::string path = dir + "/experts.safetensors";
  m.file = SafetensorsFile::open(path);
  static_cast<LayerWeights&>(m) = weights_from_checkpoint(cfg, checkpoint_tensors(m.file), path);
  return m;
}

}  // namespace moekit
