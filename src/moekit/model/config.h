// moekit/model/config.h — config.json of a model directory <-> the layer description
// (include/moekit/spec.hpp; MoeConfig is its older name).
#pragma once

#include <string>

#include "moekit/common/spec.h"
#include "moekit/formats/quantize.h"

namespace moekit {

// Parses DIR/config.json; missing optional fields take the defaults of LayerSpec.
MoeConfig load_config(const std::string& path);
std::string config_json(const MoeConfig& c);  // the same fields, for writing a model directory

}  // namespace moekit
