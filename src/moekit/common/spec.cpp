#include "moekit/common/spec.h"

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

}  // namespace moekit
