// moekit/model/hf_checkpoint.h — one MoE layer of a Hugging Face checkpoint directory as a
// MoeModel: the layer description from config.json (model/hf_config.h), the experts' weights as
// views of the memory-mapped shards, the router's weights.
//
// Tensor layouts, as the models publish them (P = model.layers.L.):
//   GPT-OSS (mxfp4)    P mlp.experts.gate_up_proj_blocks U8 [E, 2I, H/32, 16], _scales U8 [E, 2I, H/32],
//                      gate_up_proj_bias [E, 2I] (rows interleaved gate, up, gate, ...);
//                      down_proj_blocks U8 [E, H, I/32, 16], _scales U8 [E, H, I/32], down_proj_bias [E, H];
//                      router P mlp.router.weight [E, H], .bias [E]
//   Qwen3-MoE, DeepSeek-V3
//                      P mlp.experts.{j}.{gate,up,down}_proj.weight, router P mlp.gate.weight [E, H]
//                      (DeepSeek: + P mlp.gate.e_score_correction_bias F32 [E])
//   Mixtral            P block_sparse_moe.experts.{j}.{w1,w3,w2}.weight (gate, up, down),
//                      router P block_sparse_moe.gate.weight [E, H]
// Per-expert weights, by format (a gate/up projection is [I, H], a down projection [H, I]):
//   bf16     .weight BF16 [N, K]
//   fp8      .weight F8_E4M3 [N, K] + .weight_scale_inv F32 [ceil(N/128), ceil(K/128)]
//            (BF16 or F16 in Qwen3's FP8 releases: widened to fp32, exactly)
//   nvfp4    .weight U8 [N, K/2] + .weight_scale F8_E4M3 [N, K/16] + .weight_scale_2 F32 []
//            (ModelOpt)          + .input_scale F32 [] (for W4A4 engines; read and checked, unused:
//                                  the layer runs with bf16 activations)
// Per-expert tensors are not copied: the WeightMatrix parts point into the mapped shards and the
// backend's pack step gathers them straight into its packed layout. Only the chosen layer's
// tensors (and the shards' headers) are read.
#pragma once

#include <string>

#include "moekit/model/model.h"

namespace moekit {

// Layer `layer` of the checkpoint in DIR (-1: its first MoE layer). Throws moekit::Error with a
// one-line message naming the file and tensor (a missing shard, a tensor the index places in a
// shard that lacks it, wrong dtypes or shapes, expert counts that disagree with config.json) or
// the layer (out of range, dense).
MoeModel load_hf_layer(const std::string& dir, int layer);

}  // namespace moekit
