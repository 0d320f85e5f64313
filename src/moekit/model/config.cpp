#include "moekit/model/config.h"

#include <cfloat>
#include <climits>
#include <cmath>
#include <nlohmann/json.hpp>

#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/io/files.h"
#include "moekit/io/json_file.h"
#include "moekit/oracle/layer_checks.h"

namespace moekit {

namespace {
// A layer's config.json is a few hundred bytes; a model's config.json a few kilobytes.
constexpr uint64_t kMaxConfigBytes = 1u << 20;
}  // namespace

MoeConfig load_config(const std::string& path) {
  using nlohmann::json;
  const json j = read_json_object(path, kMaxConfigBytes);

  MoeConfig c;
  auto get_int = [&](const char* key, int* out, bool required) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
      MOEKIT_REQUIRE(!required, path, ": missing field ", key);
      return;
    }
    MOEKIT_REQUIRE(it->is_number_integer(), path, ": field ", key, " must be an integer");
    // Read in full width (JSON integers may be unsigned 64-bit), then range-checked: 2^32 + 8
    // must not pass as 8.
    const bool fits = it->is_number_unsigned()
                          ? it->get<uint64_t>() <= uint64_t(INT_MAX)
                          : it->get<int64_t>() >= INT_MIN && it->get<int64_t>() <= INT_MAX;
    MOEKIT_REQUIRE(fits, path, ": field ", key, " = ", it->dump(), " does not fit a 32-bit integer");
    *out = int(it->get<int64_t>());
  };
  auto get_float = [&](const char* key, float* out) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return;
    MOEKIT_REQUIRE(it->is_number(), path, ": field ", key, " must be a number");
    // Read as double: a value beyond float's range must not become Inf.
    const double v = it->get<double>();
    MOEKIT_REQUIRE(std::isfinite(v) && std::fabs(v) <= double(FLT_MAX), path, ": field ", key, " = ",
                   it->dump(), " is outside the float range");
    *out = float(v);
  };
  auto get_string = [&](const json& obj, const char* key, std::string* out) {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return false;
    MOEKIT_REQUIRE(it->is_string(), path, ": field ", key, " must be a string");
    *out = it->get<std::string>();
    return true;
  };
  get_int("num_experts", &c.num_experts, true);
  get_int("num_experts_per_tok", &c.top_k, true);
  get_int("hidden_size", &c.hidden, true);
  get_int("intermediate_size", &c.intermediate, true);
  get_int("n_group", &c.n_group, false);
  get_int("topk_group", &c.topk_group, false);
  get_float("swiglu_alpha", &c.swiglu_alpha);
  get_float("swiglu_beta", &c.swiglu_beta);
  get_float("swiglu_limit", &c.swiglu_limit);
  get_float("routed_scaling_factor", &c.routed_scaling_factor);
  if (auto it = j.find("norm_topk_prob"); it != j.end() && !it->is_null()) {
    MOEKIT_REQUIRE(it->is_boolean(), path, ": field norm_topk_prob must be true or false");
    c.norm_topk_prob = it->get<bool>();
  }
  std::string s;
  if (get_string(j, "hidden_act", &s)) {
    if (!parse_activation(s, &c.act))
      fail(path, ": unknown hidden_act '", s, "' (expected silu, swiglu_oai or silu_clamped)");
  }
  if (get_string(j, "scoring_func", &s)) {
    if (!parse_scoring(s, &c.scoring))
      fail(path, ": unknown scoring_func '", s, "' (expected softmax, sigmoid or sqrtsoftplus)");
  }
  // Hash routing (DeepSeek-V4): the rows of the layer's tid2eid table.
  if (auto it = j.find("hash_vocab"); it != j.end() && !it->is_null()) {
    MOEKIT_REQUIRE(it->is_number_integer() && (it->is_number_unsigned() ? it->get<uint64_t>() <= uint64_t(INT32_MAX)
                                                                         : it->get<int64_t>() >= 0 &&
                                                                               it->get<int64_t>() <= INT32_MAX),
                   path, ": field hash_vocab must be an integer in [0, ", INT32_MAX, "] (the rows of tid2eid)");
    c.hash_vocab = it->get<int64_t>();
  }
  // The experts' input precision (spec.hpp): optional, bf16 when absent.
  if (get_string(j, "activation_dtype", &s) && !parse_activation_dtype(s, &c.activation_dtype))
    fail(path, ": unknown activation_dtype '", s, "' (expected bf16 or fp8)");
  if (get_string(j, "activation_scale", &s) && !parse_activation_scale(s, &c.activation_scale))
    fail(path, ": unknown activation_scale '", s, "' (expected fp32 or ue8m0)");
  auto q = j.find("quantization");
  MOEKIT_REQUIRE(q != j.end() && q->is_object(), path, ": missing object quantization");
  MOEKIT_REQUIRE(get_string(*q, "format", &s), path, ": missing field quantization.format");
  try {
    c.format = parse_format(s);
    if (get_string(*q, "scale_rule", &s)) c.scale_rule = parse_scale_rule(s);
  } catch (const Error& e) {
    fail(path, ": quantization: ", e.what());
  }
  validate_spec(c, path);
  return c;
}

std::string config_json(const MoeConfig& c) {
  nlohmann::ordered_json j;
  j["num_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.top_k;
  j["hidden_size"] = c.hidden;
  j["intermediate_size"] = c.intermediate;
  j["hidden_act"] = activation_name(c.act);
  j["swiglu_alpha"] = c.swiglu_alpha;
  j["swiglu_beta"] = c.swiglu_beta;
  j["swiglu_limit"] = c.swiglu_limit;
  j["scoring_func"] = scoring_name(c.scoring);
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["routed_scaling_factor"] = c.routed_scaling_factor;
  j["n_group"] = c.n_group;
  j["topk_group"] = c.topk_group;
  if (c.hash_vocab > 0) j["hash_vocab"] = c.hash_vocab;
  if (c.activation_dtype != ActivationDtype::kBf16) {  // bf16 layers' files stay as they were
    j["activation_dtype"] = activation_dtype_name(c.activation_dtype);
    j["activation_scale"] = activation_scale_name(c.activation_scale);
  }
  j["quantization"] = {{"format", format_name(c.format)},
                       {"scale_rule", scale_rule_name(c.scale_rule)}};
  return j.dump(1);
}

}  // namespace moekit
