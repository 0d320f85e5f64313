#include "moekit/common/spec.h"

#include <sstream>

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
const char* scoring_name(Scoring s) { return s == Scoring::kSoftmax ? "softmax" : "sigmoid"; }

bool parse_activation(const std::string& s, Activation* out) {
  for (Activation a : {Activation::kSilu, Activation::kSwigluOai, Activation::kSiluClamped})
    if (s == activation_name(a)) return *out = a, true;
  return false;
}
bool parse_scoring(const std::string& s, Scoring* out) {
  for (Scoring x : {Scoring::kSoftmax, Scoring::kSigmoid})
    if (s == scoring_name(x)) return *out = x, true;
  return false;
}

void validate_spec(const LayerSpec& c, const std::string& what) {
  MOEKIT_REQUIRE(c.num_experts > 0, what, ": num_experts must be positive");
  MOEKIT_REQUIRE(c.top_k > 0, what, ": num_experts_per_tok must be positive");
  MOEKIT_REQUIRE(c.top_k <= c.num_experts, what, ": num_experts_per_tok = ", c.top_k,
                 " exceeds num_experts = ", c.num_experts);
  MOEKIT_REQUIRE(c.hidden > 0 && c.intermediate > 0, what,
                 ": hidden_size and intermediate_size must be positive");
  const int block = format_block(c.format);
  MOEKIT_REQUIRE(c.hidden % block == 0, what, ": hidden_size ", c.hidden,
                 " is not a multiple of the ", format_name(c.format), " block (", block, ")");
  MOEKIT_REQUIRE(c.intermediate % block == 0, what, ": intermediate_size ", c.intermediate,
                 " is not a multiple of the ", format_name(c.format), " block (", block, ")");
  MOEKIT_REQUIRE(c.n_group > 0 && c.num_experts % c.n_group == 0, what, ": num_experts = ",
                 c.num_experts, " is not divisible by n_group = ", c.n_group);
  MOEKIT_REQUIRE(c.topk_group > 0 && c.topk_group <= c.n_group, what, ": topk_group = ",
                 c.topk_group, " must be in [1, n_group = ", c.n_group, "]");
  MOEKIT_REQUIRE(c.top_k <= c.topk_group * (c.num_experts / c.n_group), what,
                 ": num_experts_per_tok = ", c.top_k, " exceeds the experts in topk_group groups (",
                 c.topk_group * (c.num_experts / c.n_group), ")");
  MOEKIT_REQUIRE(c.swiglu_limit > 0.0f, what, ": swiglu_limit must be positive");
  MOEKIT_REQUIRE(c.max_tokens >= 0, what, ": max_tokens must not be negative");
}

std::string describe_spec(const LayerSpec& c) {
  std::ostringstream os;
  os << "E=" << c.num_experts << " k=" << c.top_k << " H=" << c.hidden << " I=" << c.intermediate
     << " " << format_name(c.format) << " " << activation_name(c.act);
  return os.str();
}

}  // namespace moekit
