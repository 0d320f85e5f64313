#include "moekit/oracle/layer_checks.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/formats/quantize.h"
#include "moekit/routing/routing.h"

namespace moekit {

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
  MOEKIT_REQUIRE(c.activation_dtype == ActivationDtype::kFp8 || c.activation_scale == ActivationScale::kFp32, what,
                 ": activation_scale = ", activation_scale_name(c.activation_scale),
                 " applies to fp8 activations only (activation_dtype = ", activation_dtype_name(c.activation_dtype), ")");
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
  if (c.activation_dtype != ActivationDtype::kBf16) os << " " << describe_activations(c) << " activations";
  return os.str();
}

uint64_t layer_host_bytes(const MoeConfig& cfg, int64_t T) {
  const int64_t H = cfg.hidden, I = cfg.intermediate, k = cfg.top_k;
  // Per token: y (bf16), ids + weights; per (token, slot) row: the permuted bf16 row, its fp32
  // copy, the bf16-rounded activation kept in fp32, and the fp32 expert output.
  const uint64_t per_token = sat_add(sat_mul({H, 2}), sat_mul({k, 8}));
  const uint64_t per_row = sat_add(sat_mul({H, 2 + 4 + 4}), sat_mul({I, 4}));
  return sat_add(sat_mul({T, int64_t(std::min<uint64_t>(per_token, INT64_MAX))}),
                 sat_mul({T, k, int64_t(std::min<uint64_t>(per_row, INT64_MAX))}));
}

void validate_layer_input(const MoeConfig& cfg, const LayerInput& in) {
  const int64_t T = in.tokens, H = cfg.hidden, E = cfg.num_experts;
  MOEKIT_REQUIRE(T >= 0, "hidden_states: ", T, " tokens");
  const int k = in.bypass ? in.k : cfg.top_k;
  if (in.bypass)
    MOEKIT_REQUIRE(k == cfg.top_k, "topk_ids: ", k, " slots per token, but num_experts_per_tok is ",
                   cfg.top_k);
  MOEKIT_REQUIRE(sat_mul({T, k}) <= uint64_t(INT_MAX), "hidden_states: ", T, " tokens x ", k,
                 " slots exceed the ", INT_MAX, " (token, slot) pairs one layer call can hold");
  require_host_memory("hidden_states: " + std::to_string(T) + " tokens", layer_host_bytes(cfg, T));
  if (T == 0) return;
  MOEKIT_REQUIRE(in.x, "hidden_states: missing");
  if (in.check_values)
    for (int64_t i = 0; i < T * H; ++i)
      MOEKIT_REQUIRE((in.x[i] & 0x7f80) != 0x7f80, "hidden_states: ", (in.x[i] & 0x7f) ? "NaN" : "Inf",
                     " at token ", i / H, ", column ", i % H);
  if (!in.bypass) {
    MOEKIT_REQUIRE(in.logits, "router_logits: missing (and no topk_ids)");
    for (int64_t i = 0; i < T * E; ++i)
      MOEKIT_REQUIRE(std::isfinite(in.logits[i]), "router_logits: non-finite value at token ", i / E,
                     ", expert ", i % E);
    if (cfg.hash_vocab > 0) {
      MOEKIT_REQUIRE(in.token_ids, "input_ids: missing (a hash-routed layer chooses its experts by token id)");
      check_token_ids({in.token_ids, true}, T, cfg.hash_vocab, "input_ids");
    }
    return;
  }
  MOEKIT_REQUIRE(in.ids && in.weights, "topk_ids and topk_weights: missing");
  validate_topk(in.ids, in.weights, T, k, int(E));
  std::vector<int32_t> row(static_cast<size_t>(k));
  for (int64_t t = 0; t < T; ++t) {
    // An expert chosen twice in one token has no meaning for the layer (and the batched format
    // holds one row per token per expert): refused on every backend.
    row.assign(in.ids + t * k, in.ids + (t + 1) * k);
    std::sort(row.begin(), row.end());
    for (int j = 1; j < k; ++j)
      MOEKIT_REQUIRE(row[size_t(j)] < 0 || row[size_t(j)] != row[size_t(j - 1)], "topk_ids: token ", t,
                     " lists expert ", row[size_t(j)], " more than once");
  }
}

void validate_topk(const int32_t* ids, const float* weights, int64_t T, int k, int E) {
  for (int64_t i = 0; i < T * k; ++i) {
    MOEKIT_REQUIRE(ids[i] >= -1 && ids[i] < E, "topk_ids: expert id ", ids[i], " at token ", i / k, ", slot ",
                   i % k, " is out of range [-1, ", E, ")");
    MOEKIT_REQUIRE(std::isfinite(weights[i]), "topk_weights: non-finite weight at token ", i / k, ", slot ", i % k);
  }
}

void check_layer_output(const LayerOutput& out, int64_t T, int64_t H) {
  MOEKIT_REQUIRE(int64_t(out.y.size()) == T * H, "y: ", out.y.size(), " values, expected ", T * H);
  for (int64_t i = 0; i < T * H; ++i)
    MOEKIT_REQUIRE((out.y[size_t(i)] & 0x7f80) != 0x7f80, "y: ", (out.y[size_t(i)] & 0x7f) ? "NaN" : "Inf",
                   " at token ", i / H, ", column ", i % H,
                   " from finite inputs: the layer overflowed (likely cause: hidden_states or expert "
                   "weights so large that a GEMM or the weighted sum exceeds fp32, or y exceeds bf16's "
                   "3.39e38)");
  for (size_t i = 0; i < out.weights.size(); ++i)
    MOEKIT_REQUIRE(std::isfinite(out.weights[i]), "topk_weights: non-finite routing weight at position ", i,
                   " (likely cause: routed_scaling_factor too large)");
}

}  // namespace moekit
