#include "moekit/model/config.h"

#include <cfloat>
#include <climits>
#include <cmath>
#include <nlohmann/json.hpp>

#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/io/files.h"

namespace moekit {

namespace {
// A layer's config.json is a few hundred bytes; a model's config.json a few kilobytes.
constexpr uint64_t kMaxConfigBytes = 1u << 20;
}  // namespace

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::kSilu: return "silu";
    case Activation::kSwigluOai: return "swiglu_oai";
    case Activation::kSiluClamped: return "silu_clamped";
  }
  return "?";
}
const char* scoring_name(Scoring s) { return s == Scoring::kSoftmax ? "softmax" : "sigmoid"; }

void MoeConfig::validate(const std::string& what) const {
  MOEKIT_REQUIRE(num_experts > 0, what, ": num_experts = ", num_experts, " must be positive");
  MOEKIT_REQUIRE(top_k > 0, what, ": num_experts_per_tok = ", top_k, " must be positive");
  MOEKIT_REQUIRE(top_k <= num_experts, what, ": num_experts_per_tok = ", top_k,
                 " exceeds num_experts = ", num_experts);
  MOEKIT_REQUIRE(hidden > 0, what, ": hidden_size = ", hidden, " must be positive");
  MOEKIT_REQUIRE(intermediate > 0, what, ": intermediate_size = ", intermediate, " must be positive");
  const int block = format_block(format);
  MOEKIT_REQUIRE(hidden % block == 0, what, ": hidden_size ", hidden,
                 " is not a multiple of the ", format_name(format), " block (", block, ")");
  MOEKIT_REQUIRE(intermediate % block == 0, what, ": intermediate_size ", intermediate,
                 " is not a multiple of the ", format_name(format), " block (", block, ")");
  MOEKIT_REQUIRE(n_group > 0, what, ": n_group = ", n_group, " must be positive");
  MOEKIT_REQUIRE(num_experts % n_group == 0, what, ": num_experts = ",
                 num_experts, " is not divisible by n_group = ", n_group);
  MOEKIT_REQUIRE(topk_group > 0 && topk_group <= n_group, what, ": topk_group = ", topk_group,
                 " must be in [1, n_group = ", n_group, "]");
  MOEKIT_REQUIRE(top_k <= topk_group * (num_experts / n_group), what, ": num_experts_per_tok = ",
                 top_k, " exceeds the experts in topk_group groups (",
                 topk_group * (num_experts / n_group), ")");
  // Weight bytes are computed in 64 bits: E x 2I x H elements (and the bf16 bytes) must fit.
  MOEKIT_REQUIRE(sat_mul({num_experts, 2 * int64_t(intermediate), hidden, 2}) <= uint64_t(INT64_MAX), what,
                 ": num_experts x 2 intermediate_size x hidden_size = ", num_experts, " x ",
                 2 * int64_t(intermediate), " x ", hidden, " weights overflow 64-bit sizes");
  MOEKIT_REQUIRE(std::isfinite(swiglu_limit) && swiglu_limit > 0.0f, what, ": swiglu_limit = ",
                 swiglu_limit, " must be finite and positive");
  MOEKIT_REQUIRE(std::isfinite(swiglu_alpha), what, ": swiglu_alpha = ", swiglu_alpha, " must be finite");
  MOEKIT_REQUIRE(std::isfinite(swiglu_beta), what, ": swiglu_beta = ", swiglu_beta, " must be finite");
  MOEKIT_REQUIRE(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0.0f, what,
                 ": routed_scaling_factor = ", routed_scaling_factor, " must be finite and positive");
}

MoeConfig load_config(const std::string& path) {
  using nlohmann::json;
  json j;
  try {
    j = json::parse(read_file(path, kMaxConfigBytes));
  } catch (const json::exception& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 9: ..." without its tag
    std::string what = e.what();
    if (const size_t tag = what.find("] "); tag != std::string::npos) what = what.substr(tag + 2);
    fail(path, ": not valid JSON (", what, ")");
  }
  MOEKIT_REQUIRE(j.is_object(), path, ": not a JSON object");

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
    if (s == "silu") c.act = Activation::kSilu;
    else if (s == "swiglu_oai") c.act = Activation::kSwigluOai;
    else if (s == "silu_clamped") c.act = Activation::kSiluClamped;
    else fail(path, ": unknown hidden_act '", s, "' (expected silu, swiglu_oai or silu_clamped)");
  }
  if (get_string(j, "scoring_func", &s)) {
    if (s == "softmax") c.scoring = Scoring::kSoftmax;
    else if (s == "sigmoid") c.scoring = Scoring::kSigmoid;
    else fail(path, ": unknown scoring_func '", s, "' (expected softmax or sigmoid)");
  }
  auto q = j.find("quantization");
  MOEKIT_REQUIRE(q != j.end() && q->is_object(), path, ": missing object quantization");
  MOEKIT_REQUIRE(get_string(*q, "format", &s), path, ": missing field quantization.format");
  try {
    c.format = parse_format(s);
    if (get_string(*q, "scale_rule", &s)) c.scale_rule = parse_scale_rule(s);
  } catch (const Error& e) {
    fail(path, ": quantization: ", e.what());
  }
  c.validate(path);
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
  j["quantization"] = {{"format", format_name(c.format)},
                       {"scale_rule", scale_rule_name(c.scale_rule)}};
  return j.dump(1);
}

}  // namespace moekit
