// moekit/experts/reference.h — a slow, obviously correct layer in double precision.
//
// Dequantizes one expert at a time to fp32 (exact), does the GEMMs and the activation in double,
// rounds the activation output to bf16 (where every kernel stores it), and returns y before the
// final bf16 rounding. With fp8 activations (m.cfg.activation_dtype) both GEMMs' input rows are
// first rounded by formats/fp8_act.h, as every backend rounds them. Used by the demo and tests as
// an independent check of every backend.
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/experts/weights.h"

namespace moekit {

std::vector<double> reference_layer(const LayerWeights& m, const uint16_t* x, int64_t T,
                                    const int32_t* ids, const float* weights, int k);

// The layer's activation in double (the reference's; experts/activation.h is the fp32 one).
double reference_activation(const MoeConfig& c, double gate, double up);

// ||a - b|| / ||b||
double rel_l2(const std::vector<float>& a, const std::vector<double>& b);

}  // namespace moekit
