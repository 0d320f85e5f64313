// moekit/model/config.h — one MoE layer's configuration (config.json of a model directory).
#pragma once

#include <string>

#include "moekit/formats/quantize.h"

namespace moekit {

enum class Activation { kSilu, kSwigluOai, kSiluClamped };
enum class Scoring { kSoftmax, kSigmoid };

const char* activation_name(Activation a);
const char* scoring_name(Scoring s);

struct MoeConfig {
  int num_experts = 0;          // E
  int top_k = 0;                // num_experts_per_tok
  int hidden = 0;               // H
  int intermediate = 0;         // I (per expert)
  Activation act = Activation::kSilu;
  float swiglu_alpha = 1.702f;
  float swiglu_beta = 1.0f;
  float swiglu_limit = 7.0f;
  Scoring scoring = Scoring::kSoftmax;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  int n_group = 1;
  int topk_group = 1;
  WeightFormat format = WeightFormat::kBf16;
  ScaleRule scale_rule = ScaleRule::kFloor;

  // Throws moekit::Error (prefixed with `what`) when the numbers are inconsistent.
  void validate(const std::string& what) const;
};

// Parses DIR/config.json; missing optional fields take the defaults above.
MoeConfig load_config(const std::string& path);
std::string config_json(const MoeConfig& c);  // the same fields, for writing a model directory

}  // namespace moekit
