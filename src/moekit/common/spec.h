// moekit/common/spec.h — the layer description (include/moekit/spec.hpp) as the code base uses it:
// names of its enums, and the consistency checks that throw moekit::Error.
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

// Throws moekit::Error (prefixed with `what`) when the numbers are inconsistent: E, k, H, I
// positive, H and I multiples of the format's block, groups dividing E, k within the kept
// groups, a positive limit, max_tokens not negative.
void validate_spec(const LayerSpec& c, const std::string& what);

// "E=.. k=.. H=.. I=.. mxfp4 swiglu_oai"
std::string describe_spec(const LayerSpec& c);

}  // namespace moekit
