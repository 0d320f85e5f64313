// moekit/common/spec.h — the layer description (include/moekit/spec.hpp) as the code base uses it:
// names of its enums. Its consistency checks (validate_spec, describe_spec) need the formats'
// blocks: oracle/layer_checks.h.
#pragma once

#include <string>

#include "moekit/spec.hpp"

namespace moekit {

// The description's older name, kept for the code that grew up with it.
using MoeConfig = LayerSpec;

const char* activation_name(Activation a);
const char* scoring_name(Scoring s);
const char* activation_dtype_name(ActivationDtype a);  // bf16 | fp8
const char* activation_scale_name(ActivationScale s);  // fp32 | ue8m0
// "bf16", "fp8 (fp32 scales)", "fp8 (ue8m0 scales)": the layer's input precision for messages.
std::string describe_activations(const LayerSpec& c);
// Parse a name; false when unknown.
bool parse_activation(const std::string& s, Activation* out);
bool parse_scoring(const std::string& s, Scoring* out);
bool parse_activation_dtype(const std::string& s, ActivationDtype* out);
bool parse_activation_scale(const std::string& s, ActivationScale* out);

}  // namespace moekit
