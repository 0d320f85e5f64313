// moekit/model/layer_io.h — input and output files of `moekit run` (SPEC section 7).
//   input:  hidden_states BF16|F32 [T, H] (rounded to bf16 on use) and router_logits F32 [T, E];
//           or topk_ids I32 [T, k] + topk_weights F32 [T, k] to skip routing; input_ids I32|I64
//           [T], the rows' token ids, which a hash-routed layer (DeepSeek-V4) routes by.
//   output: y BF16 [T, H], topk_ids I32 [T, k], topk_weights F32 [T, k].
#pragma once

#include <string>
#include <vector>

#include "moekit/model/config.h"
#include "moekit/oracle/backend.h"
#include "moekit/routing/router.h"

namespace moekit {

struct LayerInputData {
  int64_t tokens = 0;
  std::vector<uint16_t> x;       // [T, H] bf16
  std::vector<float> logits;     // [T, E] or empty
  std::vector<int64_t> token_ids;  // [T] (input_ids) or empty
  std::vector<int32_t> ids;      // [T, k] or empty
  std::vector<float> weights;    // [T, k] or empty
  int k = 0;
  bool bypass = false;           // ids/weights given instead of logits

  LayerInput view() const;
};

// Validates names, dtypes, shapes and values: hidden_states finite in bf16; router_logits F32
// [T, E] and finite (also when topk_ids are given beside them); topk_ids/topk_weights [T, top_k];
// then validate_layer_input (oracle/layer_checks.h), with messages prefixed by the file. Refuses
// inputs whose layer would not fit in host memory before allocating anything for them.
// With a router (a checkpoint's, routing/router.h), hidden_states alone will do: the logits are
// computed from them (router_logits, when present, are used as given).
LayerInputData load_layer_input(const std::string& path, const MoeConfig& cfg,
                                const RouterWeights* router = nullptr);
void write_layer_input(const std::string& path, const LayerInputData& in, int64_t H, int E);
void write_layer_output(const std::string& path, const LayerOutput& out, int64_t T, int64_t H,
                        int k);

}  // namespace moekit
