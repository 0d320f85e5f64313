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

bool is_deepseek_v4(const std::string& model_type) { return model_type.rfind("deepseek_v4", 0) == 0; }

bool known_model_type(const std::string& t) {
  for (const char* k : {"gpt_oss", "deepseek_v3", "kimi_k2", "qwen3_moe", "qwen2_moe", "mixtral"})
    if (t == k) return true;
  return is_deepseek_v4(t);
}

// A config whose text model's fields sit in text_config (DeepSeek-V4.1): those fields fill in
// what the top level lacks, and text_config's model_type is taken when the top level's is not
// one we know.
json with_text_config(const json& j, const std::string& path) {
  const auto tc = j.find("text_config");
  if (tc == j.end() || tc->is_null()) return j;
  MOEKIT_REQUIRE(tc->is_object(), path, ": field text_config must be an object");
  json m = j;
  for (auto it = tc->begin(); it != tc->end(); ++it) {
    if (it.key() == "model_type") {
      const std::string top = j.value("model_type", "");
      if (!known_model_type(top) && it->is_string()) m["model_type"] = *it;
      continue;
    }
    if (!m.contains(it.key()) || m[it.key()].is_null()) m[it.key()] = *it;
  }
  return m;
}

// The fields DeepSeek's MoE configs share (V3, V4): routed experts, top-k, per-expert I, the
// router's scaling, renormalization, scoring (default `scoring`), groups and topk_method.
void deepseek_moe_fields(HfModelConfig& c, const Fields& f, const char* scoring_default) {
  LayerSpec& s = c.spec;
  s.num_experts = f.need_int("n_routed_experts");
  s.top_k = f.need_int("num_experts_per_tok");
  s.intermediate = f.need_int("moe_intermediate_size");
  s.n_group = f.opt_int("n_group", 1);
  s.topk_group = f.opt_int("topk_group", 1);
  s.routed_scaling_factor = f.opt_float("routed_scaling_factor", 1.0f);
  s.norm_topk_prob = f.opt_bool("norm_topk_prob", true);
  const std::string scoring = f.opt_string("scoring_func", scoring_default);
  MOEKIT_REQUIRE(parse_scoring(scoring, &s.scoring), c.path, ": scoring_func '", scoring,
                 "' is not supported (sigmoid, softmax or sqrtsoftplus)");
  const std::string method = f.opt_string("topk_method", "noaux_tc");
  MOEKIT_REQUIRE(method == "noaux_tc" || (method == "greedy" && s.n_group == 1), c.path, ": topk_method '",
                 method, "' is not supported (noaux_tc)");
}

// DeepSeek-V4 (its own config.json, or transformers'): the routed experts, the router, the hash
// layers, the shared expert. Formats: weight_format's comment in hf_config.h.
void deepseek_v4(HfModelConfig& c, const json& j, const Fields& f) {
  LayerSpec& s = c.spec;
  deepseek_moe_fields(c, f, "sqrtsoftplus");
  MOEKIT_REQUIRE(s.n_group == 1, c.path, ": n_group = ", s.n_group,
                 ": DeepSeek-V4's router chooses over all experts (no groups)");
  // silu(min(gate, limit)) * clamp(up, +-limit); DeepSeek's own code reads a limit of 0 as none.
  const float limit = f.opt_float("swiglu_limit", 10.0f);
  if (limit > 0) {
    s.act = Activation::kSiluClamped;
    s.swiglu_limit = limit;
  } else {
    s.act = Activation::kSilu;
  }
  const std::string act = f.opt_string("hidden_act", "silu");
  MOEKIT_REQUIRE(act == "silu", c.path, ": hidden_act '", act, "' is not supported for ", c.model_type, " (silu)");
  c.vocab_size = f.opt_int("vocab_size", 0);
  c.shared_experts = f.opt_int("n_shared_experts", 1);
  MOEKIT_REQUIRE(c.shared_experts >= 0, c.path, ": n_shared_experts = ", c.shared_experts, " must not be negative");
  c.shared_intermediate = c.shared_experts * s.intermediate;
  for (int l = 0; l < c.num_layers; ++l) c.moe_layers.push_back(l);  // every layer has experts
  // The hash layers: mlp_layer_types (transformers), else num_hash_layers / n_hash_layers.
  if (const json* t = f.at("mlp_layer_types")) {
    MOEKIT_REQUIRE(t->is_array() && int(t->size()) == c.num_layers, c.path,
                   ": field mlp_layer_types must be a list of num_hidden_layers = ", c.num_layers, " strings");
    for (int l = 0; l < c.num_layers; ++l) {
      const json& v = (*t)[size_t(l)];
      MOEKIT_REQUIRE(v.is_string() && (v == "hash_moe" || v == "moe"), c.path, ": mlp_layer_types[", l,
                     "] must be \"hash_moe\" or \"moe\"");
      if (v == "hash_moe") c.hash_layers.push_back(l);
    }
    c.hash_source = "mlp_layer_types";
  } else if (f.has("num_hash_layers") || f.has("n_hash_layers")) {
    const char* key = f.has("num_hash_layers") ? "num_hash_layers" : "n_hash_layers";
    const int n = f.need_int(key);
    MOEKIT_REQUIRE(n >= 0 && n <= c.num_layers, c.path, ": ", key, " = ", n, " must be in [0, num_hidden_layers = ",
                   c.num_layers, "]");
    for (int l = 0; l < n; ++l) c.hash_layers.push_back(l);
    c.hash_source = std::string(key) + " = " + std::to_string(n);
  } else {
    c.hash_from_checkpoint = true;
    c.hash_source = "the layer's tensors (config.json names no num_hash_layers)";
  }
  if (!c.hash_layers.empty())
    MOEKIT_REQUIRE(c.vocab_size > 0, c.path,
                   ": missing field vocab_size (the hash layers' tid2eid tables have one row per token id)");
  // The routed experts' format.
  const std::string ed = f.opt_string("expert_dtype", "");
  const auto qc = j.find("quantization_config");
  const bool has_qc = qc != j.end() && !qc->is_null();
  std::vector<int> block = {128, 128};
  if (has_qc) {
    MOEKIT_REQUIRE(qc->is_object(), c.path, ": field quantization_config must be an object");
    const Fields q{*qc, c.path};
    const std::string qm = q.opt_string("quant_method", "fp8");
    MOEKIT_REQUIRE(qm == "fp8", c.path, ": quantization_config.quant_method '", qm, "' is not supported for ",
                   c.model_type, " (fp8)");
    const std::string fmt = q.opt_string("fmt", "e4m3");
    MOEKIT_REQUIRE(fmt == "e4m3", c.path, ": quantization_config.fmt '", fmt, "' is not supported (e4m3 only)");
    if (q.has("weight_block_size")) block = q.opt_int_list("weight_block_size");
    MOEKIT_REQUIRE(block.size() == 2 && block[0] > 0 && block[1] > 0, c.path,
                   ": quantization_config.weight_block_size must be [rows, columns]");
  }
  if (ed == "fp4") {
    s.format = WeightFormat::kMxfp4;
    c.quant = "config.json expert_dtype fp4: MXFP4 experts (E2M1 + E8M0 per 32, as published)";
  } else if (ed == "fp8" || (ed.empty() && has_qc)) {
    MOEKIT_REQUIRE(block == (std::vector<int>{128, 128}), c.path,
                   ": quantization_config.weight_block_size must be [128, 128] for fp8 experts");
    s.format = WeightFormat::kFp8;
    c.quant = "config.json " + std::string(ed.empty() ? "quantization_config" : "expert_dtype") +
              " fp8: FP8 experts, 128x128 blocks";
  } else if (ed.empty() || ed == "bf16") {
    s.format = WeightFormat::kBf16;
    c.quant = ed.empty() ? "config.json has no quantization_config: BF16 experts" : "config.json expert_dtype bf16";
  } else {
    fail(c.path, ": expert_dtype '", ed, "' is not supported (fp4, fp8 or bf16)");
  }
  c.shared_format = has_qc ? WeightFormat::kFp8 : WeightFormat::kBf16;
  c.shared_block[0] = block[0];
  c.shared_block[1] = block[1];
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
  const json j = with_text_config(parse_json_file(c.path), c.path);
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
  } else if (is_deepseek_v4(c.model_type)) {
    c.arch = HfArch::kDeepseekV4;
    c.layout = HfLayout::kDeepseekV4;
  } else {
    fail(c.path, ": model_type '", c.model_type,
         "' is not supported (gpt_oss, deepseek_v3, deepseek_v4, qwen3_moe, qwen2_moe, mixtral)");
  }
  c.num_layers = f.need_int("num_hidden_layers");
  MOEKIT_REQUIRE(c.num_layers > 0, c.path, ": num_hidden_layers = ", c.num_layers, " must be positive");
  LayerSpec& s = c.spec;
  s.hidden = f.need_int("hidden_size");
  if (c.arch == HfArch::kDeepseekV4) {
    deepseek_v4(c, j, f);
    validate_spec(s, c.path);
    // A hash layer's description (what the loader gives its layers).
    if (!c.hash_layers.empty()) {
      LayerSpec h = s;
      h.hash_vocab = c.vocab_size;
      validate_spec(h, c.path + " (hash layers)");
    }
    return c;
  }
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
      deepseek_moe_fields(c, f, "sigmoid");
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
    case HfArch::kDeepseekV4:  // read above
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

bool HfModelConfig::is_hash(int layer) const {
  return std::binary_search(hash_layers.begin(), hash_layers.end(), layer);
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
// (DeepSeek-V4's layers are named by model/hf_checkpoint.cpp, which reads the naming from the index.)

std::string HfModelConfig::experts_prefix(int layer) const {
  return layer_prefix(layer) + (layout == HfLayout::kMixtral ? "block_sparse_moe.experts." : "mlp.experts.");
}

std::string HfModelConfig::router_prefix(int layer) const {
  switch (layout) {
    case HfLayout::kGptOssFused: return layer_prefix(layer) + "mlp.router.";
    case HfLayout::kMixtral: return layer_prefix(layer) + "block_sparse_moe.gate.";
    case HfLayout::kPerExpert:
    case HfLayout::kDeepseekV4: break;
  }
  return layer_prefix(layer) + "mlp.gate.";
}

std::string HfModelConfig::describe() const {
  std::ostringstream os;
  os << model_type << ", " << num_layers << " layers (MoE: " << ranges(moe_layers);
  if (arch == HfArch::kDeepseekV4)
    os << "; hash-routed: " << (hash_from_checkpoint ? "by the tensors" : hash_layers.empty() ? "none" : ranges(hash_layers));
  os << "), " << describe_spec(spec);
  return os.str();
}

}  // namespace moekit
