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

const char* activation_dtype_name(ActivationDtype a) { return a == ActivationDtype::kFp8 ? "fp8" : "bf16"; }
const char* activation_scale_name(ActivationScale s) { return s == ActivationScale::kUe8m0 ? "ue8m0" : "fp32"; }
std::string describe_activations(const LayerSpec& c) {
  if (c.activation_dtype == ActivationDtype::kBf16) return "bf16";
  return std::string("fp8 (") + activation_scale_name(c.activation_scale) + " scales)";
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

bool parse_activation_dtype(const std::string& s, ActivationDtype* out) {
  for (ActivationDtype x : {ActivationDtype::kBf16, ActivationDtype::kFp8})
    if (s == activation_dtype_name(x)) return *out = x, true;
  return false;
}
bool parse_activation_scale(const std::string& s, ActivationScale* out) {
  for (ActivationScale x : {ActivationScale::kFp32, ActivationScale::kUe8m0})
    if (s == activation_scale_name(x)) return *out = x, true;
  return false;
}

}  // namespace moekit
