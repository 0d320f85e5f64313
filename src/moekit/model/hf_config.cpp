#include "moekit/model/hf_config.h"

#include <sys/stat.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moekit/common/error.h"
#include "moekit/formats/quantize.h"
#include "moekit/io/json_file.h"
#include "moekit/oracle/layer_checks.h"

namespace moekit {

namespace {

using nlohmann::json;

// A model's config.json is a few kilobytes.
constexpr uint64_t kMaxConfigBytes = 1u << 20;

bool exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

json parse_json_file(const std::string& path) { return read_json_object(path, kMaxConfigBytes); }

// Typed fields of a JSON object, every failure naming the file and the field.
struct Fields {
  const json& j;
  const std::string& path;

  const json* at(const char* key) const {
    const auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  bool has(const char* key) const { return at(key) != nullptr; }
  int integer(const json& v, const char* key) const {
    MOEKIT_REQUIRE(v.is_number_integer(), path, ": field ", key, " must be an integer");
    const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(INT_MAX)
                                             : v.get<int64_t>() >= INT_MIN && v.get<int64_t>() <= INT_MAX;
    MOEKIT_REQUIRE(fits, path, ": field ", key, " = ", v.dump(), " does not fit a 32-bit integer");
    return int(v.get<int64_t>());
  }
  int need_int(const char* key) const {
    const json* v = at(key);
    MOEKIT_REQUIRE(v, path, ": missing field ", key);
    return integer(*v, key);
  }
  // The first of several names (configs spell some fields two ways).
  int need_int_of(std::initializer_list<const char*> keys) const {
    for (const char* k : keys)
      if (has(k)) return need_int(k);
    std::string names;
    for (const char* k : keys) names += std::string(names.empty() ? "" : " or ") + k;
    fail(path, ": missing field ", names);
  }
  int opt_int(const char* key, int dflt) const { return has(key) ? need_int(key) : dflt; }
  float opt_float(const char* key, float dflt) const {
    const json* v = at(key);
    if (!v) return dflt;
    MOEKIT_REQUIRE(v->is_number(), path, ": field ", key, " must be a number");
    const double d = v->get<double>();
    MOEKIT_REQUIRE(std::isfinite(d) && std::fabs(d) <= double(FLT_MAX), path, ": field ", key, " = ", v->dump(),
                   " is outside the float range");
    return float(d);
  }
  bool opt_bool(const char* key, bool dflt) const {
    const json* v = at(key);
    if (!v) return dflt;
    MOEKIT_REQUIRE(v->is_boolean(), path, ": field ", key, " must be true or false");
    return v->get<bool>();
  }
  std::string opt_string(const char* key, const std::string& dflt) const {
    const json* v = at(key);
    if (!v) return dflt;
    MOEKIT_REQUIRE(v->is_string(), path, ": field ", key, " must be a string");
    return v->get<std::string>();
  }
  std::vector<int> opt_int_list(const char* key) const {
    const json* v = at(key);
    std::vector<int> out;
    if (!v) return out;
    MOEKIT_REQUIRE(v->is_array(), path, ": field ", key, " must be a list of integers");
    for (const json& x : *v) out.push_back(integer(x, key));
    return out;
  }
};

// The experts' weight format from the quantization configs; `quant` says which config decided.
WeightFormat weight_format(const HfModelConfig& c, const json& cfg, std::string* quant) {
  // ModelOpt: hf_quant_config.json {"quantization": {"quant_algo": "NVFP4", "group_size": 16, ...}}.
  const std::string mo_path = c.dir + "/hf_quant_config.json";
  if (exists(mo_path)) {
    const json mo = parse_json_file(mo_path);
    const auto q = mo.find("quantization");
    MOEKIT_REQUIRE(q != mo.end() && q->is_object(), mo_path, ": missing object quantization");
    const Fields f{*q, mo_path};
    const std::string algo = f.opt_string("quant_algo", "");
    MOEKIT_REQUIRE(algo == "NVFP4", mo_path, ": quantization.quant_algo '", algo,
                   "' is not supported (ModelOpt NVFP4 only)");
    const int group = f.opt_int("group_size", 16);
    MOEKIT_REQUIRE(group == 16, mo_path, ": quantization.group_size = ", group, " (NVFP4 blocks are 16)");
    *quant = "hf_quant_config.json: ModelOpt NVFP4";
    return WeightFormat::kNvfp4;
  }
  const auto qc = cfg.find("quantization_config");
  if (qc == cfg.end() || qc->is_null()) {
    *quant = "config.json has no quantization_config";
    return WeightFormat::kBf16;
  }
  MOEKIT_REQUIRE(qc->is_object(), c.path, ": field quantization_config must be an object");
  const Fields f{*qc, c.path};
  const std::string method = f.opt_string("quant_method", "");
  if (method == "mxfp4") {
    MOEKIT_REQUIRE(c.arch == HfArch::kGptOss, c.path, ": quantization_config.quant_method mxfp4 is GPT-OSS's; not supported for ",
                   c.model_type);
    *quant = "config.json quantization_config: mxfp4";
    return WeightFormat::kMxfp4;
  }
  if (method == "fp8") {
    const std::vector<int> block = f.opt_int_list("weight_block_size");
    MOEKIT_REQUIRE(block == (std::vector<int>{128, 128}), c.path,
                   ": quantization_config.weight_block_size must be [128, 128] (fp8 with per-tensor or other "
                   "block scales is not supported)");
    const std::string fmt = f.opt_string("fmt", "e4m3");
    MOEKIT_REQUIRE(fmt == "e4m3", c.path, ": quantization_config.fmt '", fmt, "' is not supported (e4m3 only)");
    *quant = "config.json quantization_config: fp8, 128x128 blocks";
    return WeightFormat::kFp8;
  }
  if (method == "modelopt") {
    const std::string algo = f.opt_string("quant_algo", "");
    MOEKIT_REQUIRE(algo == "NVFP4", c.path, ": quantization_config.quant_algo '", algo,
                   "' is not supported (ModelOpt NVFP4 only)");
    *quant = "config.json quantization_config: ModelOpt NVFP4";
    return WeightFormat::kNvfp4;
  }
  fail(c.path, ": quantization_config.quant_method '", method,
       "' is not supported (mxfp4, fp8 with 128x128 blocks, ModelOpt NVFP4, or none)");
}

std::string ranges(const std::vector<int>& v) {
  std::ostringstream os;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    os << (i ? "," : "") << v[i];
    if (j > i) os << "-" << v[j];
    i = j + 1;
  }
  return os.str();
}

}  // namespace

bool is_hf_checkpoint(const std::string& dir) {
  if (exists(dir + "/experts.safetensors")) return false;
  if (exists(dir + "/model.safetensors.index.json") || exists(dir + "/model.safetensors")) return true;
  // A model config.json without its weights: still a checkpoint directory (a clear error later).
  try {
    const json j = parse_json_file(dir + "/config.json");
    return j.contains("model_type");
  } catch (const Error&) {
    return false;
  }
}

HfModelConfig load_hf_config(const std::string& dir) {
  HfModelConfig c;
  c.dir = dir;
  c.path = dir + "/config.json";
  const json j = parse_json_file(c.path);
  const Fields f{j, c.path};
  c.model_type = f.opt_string("model_type", "");
  MOEKIT_REQUIRE(!c.model_type.empty(), c.path, ": missing field model_type");
  if (c.model_type == "gpt_oss") {
    c.arch = HfArch::kGptOss;
    c.layout = HfLayout::kGptOssFused;
  } else if (c.model_type == "deepseek_v3" || c.model_type == "kimi_k2") {
    c.arch = HfArch::kDeepseekV3;
    c.layout = HfLayout::kPerExpert;
  } else if (c.model_type == "qwen3_moe" || c.model_type == "qwen2_moe") {
    c.arch = HfArch::kQwenMoe;
    c.layout = HfLayout::kPerExpert;
  } else if (c.model_type == "mixtral") {
    c.arch = HfArch::kMixtral;
    c.layout = HfLayout::kMixtral;
  } else {
    fail(c.path, ": model_type '", c.model_type,
         "' is not supported (gpt_oss, deepseek_v3, qwen3_moe, qwen2_moe, mixtral)");
  }
  c.num_layers = f.need_int("num_hidden_layers");
  MOEKIT_REQUIRE(c.num_layers > 0, c.path, ": num_hidden_layers = ", c.num_layers, " must be positive");
  LayerSpec& s = c.spec;
  s.hidden = f.need_int("hidden_size");
  const std::string act = f.opt_string("hidden_act", "silu");
  switch (c.arch) {
    case HfArch::kGptOss:
      s.num_experts = f.need_int("num_local_experts");
      s.top_k = f.need_int_of({"num_experts_per_tok", "experts_per_token"});
      s.intermediate = f.need_int("intermediate_size");
      s.act = Activation::kSwigluOai;
      s.swiglu_limit = f.opt_float("swiglu_limit", 7.0f);
      s.norm_topk_prob = true;  // softmax over the top-k logits
      for (int l = 0; l < c.num_layers; ++l) c.moe_layers.push_back(l);
      break;
    case HfArch::kDeepseekV3: {
      s.num_experts = f.need_int("n_routed_experts");
      s.top_k = f.need_int("num_experts_per_tok");
      s.intermediate = f.need_int("moe_intermediate_size");
      s.n_group = f.opt_int("n_group", 1);
      s.topk_group = f.opt_int("topk_group", 1);
      s.routed_scaling_factor = f.opt_float("routed_scaling_factor", 1.0f);
      s.norm_topk_prob = f.opt_bool("norm_topk_prob", true);
      const std::string scoring = f.opt_string("scoring_func", "sigmoid");
      MOEKIT_REQUIRE(parse_scoring(scoring, &s.scoring), c.path, ": scoring_func '", scoring,
                     "' is not supported (sigmoid or softmax)");
      const std::string method = f.opt_string("topk_method", "noaux_tc");
      MOEKIT_REQUIRE(method == "noaux_tc" || (method == "greedy" && s.n_group == 1), c.path, ": topk_method '",
                     method, "' is not supported (noaux_tc)");
      c.shared_experts = f.opt_int("n_shared_experts", 0);
      const int first_dense = f.opt_int("first_k_dense_replace", 0);
      const int freq = f.opt_int("moe_layer_freq", 1);
      MOEKIT_REQUIRE(freq > 0, c.path, ": moe_layer_freq = ", freq, " must be positive");
      for (int l = first_dense; l < c.num_layers; ++l)
        if (l % freq == 0) c.moe_layers.push_back(l);
      break;
    }
    case HfArch::kQwenMoe: {
      s.num_experts = f.need_int("num_experts");
      s.top_k = f.need_int("num_experts_per_tok");
      s.intermediate = f.need_int("moe_intermediate_size");
      s.norm_topk_prob = f.opt_bool("norm_topk_prob", false);
      if (f.opt_int("shared_expert_intermediate_size", 0) > 0) c.shared_experts = 1;
      const int step = f.opt_int("decoder_sparse_step", 1);
      MOEKIT_REQUIRE(step > 0, c.path, ": decoder_sparse_step = ", step, " must be positive");
      const std::vector<int> mlp_only = f.opt_int_list("mlp_only_layers");
      for (int l = 0; l < c.num_layers; ++l)
        if (std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end() && (l + 1) % step == 0)
          c.moe_layers.push_back(l);
      break;
    }
    case HfArch::kMixtral:
      s.num_experts = f.need_int("num_local_experts");
      s.top_k = f.need_int("num_experts_per_tok");
      s.intermediate = f.need_int("intermediate_size");
      s.norm_topk_prob = true;  // Mixtral renormalizes its top-k softmax weights
      for (int l = 0; l < c.num_layers; ++l) c.moe_layers.push_back(l);
      break;
  }
  if (c.arch != HfArch::kGptOss)
    MOEKIT_REQUIRE(act == "silu", c.path, ": hidden_act '", act, "' is not supported for ", c.model_type, " (silu)");
  s.format = weight_format(c, j, &c.quant);
  MOEKIT_REQUIRE(!c.moe_layers.empty(), c.path, ": no MoE layer among the ", c.num_layers, " layers");
  validate_spec(s, c.path);
  return c;
}

bool HfModelConfig::is_moe(int layer) const {
  return std::binary_search(moe_layers.begin(), moe_layers.end(), layer);
}

std::string HfModelConfig::why_dense(int layer) const {
  std::ostringstream os;
  os << "layer " << layer << " is a dense layer, without experts";
  if (arch == HfArch::kDeepseekV3) os << " (first_k_dense_replace, moe_layer_freq in " << path << ")";
  if (arch == HfArch::kQwenMoe) os << " (mlp_only_layers, decoder_sparse_step in " << path << ")";
  os << "; its MoE layers are " << ranges(moe_layers);
  return os.str();
}

std::string HfModelConfig::layer_prefix(int layer) const { return "model.layers." + std::to_string(layer) + "."; }

std::string HfModelConfig::experts_prefix(int layer) const {
  return layer_prefix(layer) + (layout == HfLayout::kMixtral ? "block_sparse_moe.experts." : "mlp.experts.");
}

std::string HfModelConfig::router_prefix(int layer) const {
  switch (layout) {
    case HfLayout::kGptOssFused: return layer_prefix(layer) + "mlp.router.";
    case HfLayout::kMixtral: return layer_prefix(layer) + "block_sparse_moe.gate.";
    case HfLayout::kPerExpert: break;
  }
  return layer_prefix(layer) + "mlp.gate.";
}

std::string HfModelConfig::describe() const {
  std::ostringstream os;
  os << model_type << ", " << num_layers << " layers (MoE: " << ranges(moe_layers) << "), "
     << describe_spec(spec);
  return os.str();
}

}  // namespace moekit
