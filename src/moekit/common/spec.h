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
// Parse a name; false when unknown.
bool parse_activation(const std::string& s, Activation* out);
bool parse_scoring(const std::string& s, Scoring* out);

}  // namespace moekit
