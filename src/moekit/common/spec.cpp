#include "moekit/common/spec.h"

#include <cmath>
#include <cstdint>
#include <sstream>

#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/formats/quantize.h"

namespace moekit {

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::kSilu: return "silu";
    case Activation::kSwigluOai: return "swiglu_oai";
    case Activation::kSiluClamped: return "silu_clamped";
  }
  return "?";
}
const char* scoring_name(Scoring s) {
  switch (s) {
    case Scoring::kSoftmax: return "softmax";
    case Scoring::kSigmoid: return "sigmoid";
    case Scoring::kSqrtSoftplus: return "sqrtsoftplus";
  }
  return "?";
}

bool parse_activation(const std::string& s, Activation* out) {
  for (Activation a : {Activation::kSilu, Activation::kSwigluOai, Activation::kSiluClamped})
    if (s == activation_name(a)) return *out = a, true;
  return false;
}
bool parse_scoring(const std::string& s, Scoring* out) {
  for (Scoring x : {Scoring::kSoftmax, Scoring::kSigmoid, Scoring::kSqrtSoftplus})
    if (s == scoring_name(x)) return *out = x, true;
  return false;
}

void validate_spec(const LayerSpec& c, const std::string& what) {
  MOEKIT_REQUIRE(c.num_experts > 0, what, ": num_experts = ", c.num_experts, " must be positive");
  MOEKIT_REQUIRE(c.top_k > 0, what, ": num_experts_per_tok = ", c.top_k, " must be positive");
  MOEKIT_REQUIRE(c.top_k <= c.num_experts, what, ": num_experts_per_tok = ", c.top_k,
                 " exceeds num_experts = ", c.num_experts);
  MOEKIT_REQUIRE(c.hidden > 0, what, ": hidden_size = ", c.hidden, " must be positive");
  MOEKIT_REQUIRE(c.intermediate > 0, what, ": intermediate_size = ", c.intermediate, " must be positive");
  const int block = format_block(c.format);
  MOEKIT_REQUIRE(c.hidden % block == 0, what, ": hidden_size ", c.hidden,
                 " is not a multiple of the ", format_name(c.format), " block (", block, ")");
  MOEKIT_REQUIRE(c.intermediate % block == 0, what, ": intermediate_size ", c.intermediate,
                 " is not a multiple of the ", format_name(c.format), " block (", block, ")");
  MOEKIT_REQUIRE(c.n_group > 0, what, ": n_group = ", c.n_group, " must be positive");
  MOEKIT_REQUIRE(c.num_experts % c.n_group == 0, what, ": num_experts = ", c.num_experts,
                 " is not divisible by n_group = ", c.n_group);
  MOEKIT_REQUIRE(c.topk_group > 0 && c.topk_group <= c.n_group, what, ": topk_group = ",
                 c.topk_group, " must be in [1, n_group = ", c.n_group, "]");
  MOEKIT_REQUIRE(c.top_k <= c.topk_group * (c.num_experts / c.n_group), what,
                 ": num_experts_per_tok = ", c.top_k, " exceeds the experts in topk_group groups (",
                 c.topk_group * (c.num_experts / c.n_group), ")");
  // Weight bytes are computed in 64 bits: E x 2I x H elements (and the bf16 bytes) must fit.
  MOEKIT_REQUIRE(sat_mul({c.num_experts, 2 * int64_t(c.intermediate), c.hidden, 2}) <= uint64_t(INT64_MAX),
                 what, ": num_experts x 2 intermediate_size x hidden_size = ", c.num_experts, " x ",
                 2 * int64_t(c.intermediate), " x ", c.hidden, " weights overflow 64-bit sizes");
  MOEKIT_REQUIRE(std::isfinite(c.swiglu_limit) && c.swiglu_limit > 0.0f, what, ": swiglu_limit = ",
                 c.swiglu_limit, " must be finite and positive");
  MOEKIT_REQUIRE(std::isfinite(c.swiglu_alpha), what, ": swiglu_alpha = ", c.swiglu_alpha, " must be finite");
  MOEKIT_REQUIRE(std::isfinite(c.swiglu_beta), what, ": swiglu_beta = ", c.swiglu_beta, " must be finite");
  MOEKIT_REQUIRE(std::isfinite(c.routed_scaling_factor) && c.routed_scaling_factor > 0.0f, what,
                 ": routed_scaling_factor = ", c.routed_scaling_factor, " must be finite and positive");
  MOEKIT_REQUIRE(c.max_tokens >= 0, what, ": max_tokens = ", c.max_tokens, " must not be negative");
  // DeepSeek-V4's routing (SPEC section 7): sqrtsoftplus chooses over all experts; a hash layer
  // takes its experts from its table, so it has neither groups nor an expert bias.
  MOEKIT_REQUIRE(c.scoring != Scoring::kSqrtSoftplus || c.n_group == 1, what, ": n_group = ", c.n_group,
                 ": sqrtsoftplus routing chooses over all experts (n_group must be 1)");
  MOEKIT_REQUIRE(c.hash_vocab >= 0 && c.hash_vocab <= INT32_MAX, what, ": hash_vocab = ", c.hash_vocab,
                 " must be in [0, ", INT32_MAX, "]");
  if (c.hash_vocab > 0) {
    MOEKIT_REQUIRE(c.n_group == 1, what, ": n_group = ", c.n_group,
                   ": a hash-routed layer takes its experts from its table (n_group must be 1)");
    MOEKIT_REQUIRE(!c.score_bias, what,
                   ": a hash-routed layer takes its experts from its table and has no expert bias "
                   "(score_bias must be false)");
  }
}

std::string describe_spec(const LayerSpec& c) {
  std::ostringstream os;
  os << "E=" << c.num_experts << " k=" << c.top_k << " H=" << c.hidden << " I=" << c.intermediate
     << " " << format_name(c.format) << " " << activation_name(c.act);
  if (c.hash_vocab > 0) os << " hash-routed (" << scoring_name(c.scoring) << " weights)";
  else if (c.scoring == Scoring::kSqrtSoftplus) os << " sqrtsoftplus";
  return os.str();
}

}  // namespace moekit
