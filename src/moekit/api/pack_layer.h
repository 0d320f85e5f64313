// moekit/api/pack_layer.h — packing a layer from weights the library already holds as views
// (experts/weights.h LayerWeights: a memory-mapped layer directory, the per-expert tensors of a
// Hugging Face checkpoint's shards, a synthetic layer), for callers inside the library
// (api/host_runner.h). The backend's pack step reads the views straight into its packed buffers,
// with no copy into the checkpoint layout of pack_weights' NamedTensors first. Not public API.
#pragma once

#include <span>

#include "moekit/experts/weights.h"
#include "moekit/moekit.hpp"

namespace moekit::api {

// pack_weights, from views (the spec's biases / score_bias must match what the weights hold).
Status pack_layer_weights(const LayerSpec& spec, const LayerPlan& plan, const LayerWeights& weights,
                          std::span<const DLTensor> packed, void* stream = nullptr);
// make_layer, from views.
Status make_layer_from_weights(const LayerSpec& spec, const Options& options, const LayerWeights& weights,
                               OwnedLayer* out);

}  // namespace moekit::api
