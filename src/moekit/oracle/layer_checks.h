// moekit/oracle/layer_checks.h — what every backend accepts, checked in one place.
//
// validate_spec(): the layer description itself (every reader of a config, the public API and the
// backends check it here; it needs the formats' blocks, so it lives above formats/, not in common/).
//
// validate_layer_input() is the first thing every LayerRunner::run does (CPU and SM90 alike), so
// that all backends accept and refuse the same inputs with the same messages:
//   - tokens >= 0; zero tokens is valid (empty outputs); T * k (token, slot) pairs fit int32;
//   - routing: router_logits present and finite (a NaN logit would be chosen by one backend's
//     argmax and skipped by another's); a hash-routed layer's token ids present and within its
//     table;
//   - given top-k ("bypass"): k == num_experts_per_tok; ids in [-1, E); no expert twice within a
//     token (-1, the empty slot, may repeat); finite topk_weights;
//   - the host memory of the layer's buffers (layer_host_bytes) within the machine's;
//   - with LayerInput::check_values: hidden_states finite (a NaN can pass through the
//     activations' clamps as a finite, wrong value). One pass over T x H values, so it is an
//     option, off by default; load_layer_input checks every value of its file anyway.
// Messages name the tensor (hidden_states, router_logits, topk_ids, topk_weights) and the first
// bad position; load_layer_input prefixes them with the file.
//
// check_layer_output(): every y value finite. A non-finite y from finite inputs is the layer
// overflowing (fp32 sums or the bf16 result); the message names the first position and that
// cause. Runners run it when LayerInput::check_values is set (the CLI sets it; it is one pass over
// y, so it is off by default, off the hot path).
#pragma once

#include <cstdint>
#include <string>

#include "moekit/common/spec.h"
#include "moekit/oracle/backend.h"

namespace moekit {

// Throws moekit::Error (prefixed with `what`) when the numbers are inconsistent: E, k, H, I
// positive, H and I multiples of the format's block, groups dividing E, k within the kept
// groups, a positive limit, max_tokens not negative, an activation_scale only with fp8 activations.
void validate_spec(const LayerSpec& c, const std::string& what);

// "E=.. k=.. H=.. I=.. mxfp4 swiglu_oai" (+ " fp8 (ue8m0 scales) activations" when not bf16)
std::string describe_spec(const LayerSpec& c);

void validate_layer_input(const MoeConfig& cfg, const LayerInput& in);
// The part of it any top-k input needs (the public API's CPU calls too): ids in [-1, E), finite
// weights; T x k of each.
void validate_topk(const int32_t* ids, const float* weights, int64_t T, int k, int E);
void check_layer_output(const LayerOutput& out, int64_t T, int64_t H);

// Host bytes of one layer call on T tokens beyond its inputs: y, top-k ids and weights, permuted
// rows, fp32 activations and expert outputs (the CPU pipeline's buffers, the largest of any
// backend's host side). Saturates at UINT64_MAX.
uint64_t layer_host_bytes(const MoeConfig& cfg, int64_t T);

}  // namespace moekit
