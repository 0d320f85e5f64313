#include "moekit/model/model.h"

#include <cmath>
#include <filesystem>

#include "moekit/common/error.h"
#include "moekit/model/hf_checkpoint.h"
#include "moekit/model/hf_config.h"

namespace moekit {

std::vector<CheckpointTensor> checkpoint_tensors(const SafetensorsFile& f) {
  std::vector<CheckpointTensor> v;
  for (const TensorView& t : f.tensors()) v.push_back({t.name, dtype_name(t.dtype), t.shape, t.data, t.nbytes});
  return v;
}

MoeModel MoeModel::load(const std::string& dir, int layer) {
  if (is_hf_checkpoint(dir)) return load_hf_layer(dir, layer);
  MOEKIT_REQUIRE(layer < 0, dir, ": --layer ", layer,
                 " picks a layer of a Hugging Face checkpoint directory; this is a moekit layer directory "
                 "(config.json + experts.safetensors)");
  MoeModel m;
  m.dir = dir;
  const MoeConfig cfg = load_config(dir + "/config.json");
  const std::string path = dir + "/experts.safetensors";
  m.file = SafetensorsFile::open(path);
  static_cast<LayerWeights&>(m) = weights_from_checkpoint(cfg, checkpoint_tensors(m.file), path);
  // Optional: the router a converted checkpoint layer brings along (model/convert.h).
  if (const TensorView* w = m.file.find("router_weight")) {
    const int64_t E = cfg.num_experts, H = cfg.hidden;
    MOEKIT_REQUIRE(w->shape == (std::vector<int64_t>{E, H}), path, ": tensor router_weight: shape ", shape_str(w->shape),
                   ", expected [", E, ", ", H, "]");
    m.router.num_experts = int(E);
    m.router.hidden = H;
    m.router.weight = to_float(*w, path);
    if (const TensorView* b = m.file.find("router_bias")) {
      MOEKIT_REQUIRE(b->shape == (std::vector<int64_t>{E}), path, ": tensor router_bias: shape ", shape_str(b->shape),
                     ", expected [", E, "]");
      m.router.bias = to_float(*b, path);
    }
    for (const std::vector<float>* v : {&m.router.weight, &m.router.bias})
      for (size_t i = 0; i < v->size(); ++i)
        MOEKIT_REQUIRE(std::isfinite((*v)[i]), path, ": tensor ", v == &m.router.weight ? "router_weight" : "router_bias",
                       ": non-finite value at element ", i);
  }
  // Optional: the shared expert beside the layer (model/convert.h write_layer_dir).
  const std::string sdir = dir + "/shared_expert";
  if (std::filesystem::exists(sdir + "/config.json")) {
    const MoeConfig sc = load_config(sdir + "/config.json");
    const std::string spath = sdir + "/experts.safetensors";
    MOEKIT_REQUIRE(sc.num_experts == 1 && sc.top_k == 1 && sc.hidden == cfg.hidden, sdir,
                   ": a shared expert is a one-expert layer of the same hidden_size (", cfg.hidden, ")");
    m.shared_file = SafetensorsFile::open(spath);
    m.shared_expert = weights_from_checkpoint(sc, checkpoint_tensors(m.shared_file), spath);
  }
  return m;
}

std::vector<std::string> model_files(const std::string& dir) {
  std::vector<std::string> v = {dir + "/config.json"};
  if (!is_hf_checkpoint(dir)) {
    v.push_back(dir + "/experts.safetensors");
    v.push_back(dir + "/shared_expert/config.json");
    v.push_back(dir + "/shared_expert/experts.safetensors");
    return v;
  }
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.ends_with(".safetensors") || name.ends_with(".json")) v.push_back(e.path().string());
  }
  return v;
}

}  // namespace moekit
