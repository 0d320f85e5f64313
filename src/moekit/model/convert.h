// moekit/model/convert.h — a layer's experts in another weight format, with the error measured,
// and moekit layer directories written from any layer (what `moekit convert` and `moekit run
// --convert` do).
//
// Conversion is never silent: every weight is dequantized exactly (fp32), quantized to the target
// (formats/quantize.h: MXFP4 / MXFP8 with the given scale rule, NVFP4 with one tensor scale per
// expert and projection: gate, up and down each; BF16 by round-to-nearest-even), and the rel. L2
// error of the new weights against the exact old ones is reported: ||q - w|| / ||w|| over the
// layer's w13 (gate and up), its w2 (down), and both. A conversion to the source's own format
// copies the bytes (error 0).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "moekit/model/model.h"

namespace moekit {

struct ConvertReport {
  WeightFormat from = WeightFormat::kBf16, to = WeightFormat::kBf16;
  bool copied = false;      // same format: the bytes themselves
  double err_w13 = 0, err_w2 = 0, err = 0;
  // "fp8 -> bf16: rel. L2 error of the weights 2.1e-03 (w13 2.1e-03, w2 2.0e-03)"
  std::string describe() const;
};

// progress(done, total): experts done so far, from the calling thread.
using Progress = std::function<void(int64_t done, int64_t total)>;

// src's experts in format `to` (owned storage); biases, score bias, hash table, router, the
// shared expert (in its own format, copied) and description come along. Throws moekit::Error when a value does not fit the target (a bf16 overflow) or the
// target is not one the quantizer makes (fp8), or the result would not fit in host memory.
MoeModel convert_layer(const MoeModel& src, WeightFormat to, ScaleRule rule, ConvertReport* report,
                       const Progress& progress = {});

// DIR/config.json + DIR/experts.safetensors (SPEC section 7, biases in F32) from any layer, the
// tensors streamed from the layer's views (no second copy of the layer in memory); the router,
// when the layer has one, as router_weight F32 [E, H] (+ router_bias F32 [E]); a hash-routed
// layer's table as tid2eid I32 (config.json: hash_vocab); a shared expert (DeepSeek-V4) as the
// one-expert layer directory DIR/shared_expert. `metadata` goes into the safetensors header.
// Each file is written atomically.
// A copy of w whose two matrices own their bytes (in `storage`), in logical row order.
LayerWeights owned_copy(const LayerWeights& w, std::vector<std::vector<uint8_t>>& storage);

void write_layer_dir(const MoeModel& m, const std::string& dir,
                     const std::vector<std::pair<std::string, std::string>>& metadata = {});

}  // namespace moekit
