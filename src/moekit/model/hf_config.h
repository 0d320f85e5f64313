// moekit/model/hf_config.h — a Hugging Face model directory's config.json (and ModelOpt's
// hf_quant_config.json) mapped to the layer description of its MoE layers, per architecture.
//
// model_type     experts / top-k / I                          routing                  MoE layers
// gpt_oss        num_local_experts, num_experts_per_tok       softmax, renormalized    all
//                (experts_per_token), intermediate_size;      (softmax of the top-k
//                swiglu_oai with swiglu_limit; biases          logits)
// deepseek_v3    n_routed_experts, num_experts_per_tok,       sigmoid + e_score_       first_k_dense_replace..,
//                moe_intermediate_size                        correction_bias, n_group, every moe_layer_freq
//                                                             topk_group, norm_topk_prob,
//                                                             routed_scaling_factor
// qwen3_moe,     num_experts, num_experts_per_tok,            softmax, norm_topk_prob  not in mlp_only_layers,
// qwen2_moe      moe_intermediate_size                                                 (L+1) % decoder_sparse_step == 0
// mixtral        num_local_experts, num_experts_per_tok,      softmax, renormalized    all
//                intermediate_size
// deepseek_v4    n_routed_experts, num_experts_per_tok,       sqrtsoftplus (scoring_   all; the first
//                moe_intermediate_size; silu_clamped with     func) + gate.bias, or     num_hash_layers
//                swiglu_limit (10; 0: silu); the shared       hash (tid2eid by token   (n_hash_layers,
//                expert (n_shared_experts) is read too        id), norm_topk_prob,      mlp_layer_types
//                                                             routed_scaling_factor     "hash_moe") hash
//                (V4.1: the fields may sit in config.json's text_config; model_type deepseek_v4*)
// Weight formats: quantization_config.quant_method "mxfp4" (GPT-OSS) -> mxfp4; "fp8" with
// weight_block_size [128, 128] -> fp8 (DeepSeek-V3, Qwen3-FP8); ModelOpt NVFP4
// (hf_quant_config.json quantization.quant_algo "NVFP4", or quantization_config quant_method
// "modelopt") -> nvfp4; none -> bf16. DeepSeek-V4's experts by expert_dtype: "fp4" -> mxfp4 (as
// published: packed E2M1 with E8M0 scales per 32, used as they are), "fp8" -> fp8 (Flash-Base,
// 128x128 blocks), absent -> as above; its shared expert by quantization_config (fp8 blocks of
// weight_block_size, or bf16). Anything else is refused by name.
#pragma once

#include <string>
#include <vector>

#include "moekit/common/spec.h"

namespace moekit {

enum class HfArch { kGptOss, kDeepseekV3, kQwenMoe, kMixtral, kDeepseekV4 };
// How the experts' tensors are named and stacked (model/hf_checkpoint.cpp).
enum class HfLayout {
  kGptOssFused,  // mlp.experts.gate_up_proj_{blocks,scales,bias}, down_proj_{...} [E, ...]
  kPerExpert,    // mlp.experts.{j}.{gate,up,down}_proj.weight (+ scales)
  kMixtral,      // block_sparse_moe.experts.{j}.{w1,w3,w2}.weight (+ scales)
  kDeepseekV4,   // DeepSeek's names (layers.L.ffn.experts.{j}.{w1,w3,w2}) or transformers'
                 // (model.layers.L.mlp.experts...): model/hf_checkpoint.cpp tells them apart
};

struct HfModelConfig {
  std::string dir, path;  // path: DIR/config.json
  std::string model_type;
  HfArch arch = HfArch::kMixtral;
  HfLayout layout = HfLayout::kMixtral;
  std::string quant;      // what set the format: "config.json quantization_config: fp8, 128x128 blocks", ...
  int num_layers = 0;
  // The MoE layers' description. format: the experts' weight format; biases / score_bias are set
  // by the loader from what the layer holds.
  LayerSpec spec;
  std::vector<int> moe_layers;  // ascending
  int shared_experts = 0;       // n_shared_experts / a Qwen2-MoE shared expert: not run here
                                // (DeepSeek-V4's: read and run, model/hf_checkpoint.h)

  // DeepSeek-V4. hash_layers: the layers routed by gate.tid2eid (ascending), as config.json
  // says (hash_source names the field); when it names none, each layer's checkpoint decides
  // (hash_from_checkpoint: a gate with tid2eid is a hash layer). vocab_size: the table's rows.
  std::vector<int> hash_layers;
  bool hash_from_checkpoint = false;
  std::string hash_source;
  int64_t vocab_size = 0;
  // The shared expert: intermediate size, weight format (fp8 or bf16) and fp8 block [rows, cols].
  int shared_intermediate = 0;
  WeightFormat shared_format = WeightFormat::kBf16;
  int shared_block[2] = {128, 128};
  bool is_hash(int layer) const;

  bool is_moe(int layer) const;
  // Why a layer in range has no experts ("first_k_dense_replace = 3", ...).
  std::string why_dense(int layer) const;
  // "model.layers.L." and the experts' and router's prefixes below it.
  std::string layer_prefix(int layer) const;
  std::string experts_prefix(int layer) const;  // "...mlp.experts." or "...block_sparse_moe.experts."
  std::string router_prefix(int layer) const;   // "...mlp.router." / "...mlp.gate." / "...block_sparse_moe.gate."
  // "gpt_oss, 24 layers (MoE: 0-23), E=32 k=4 H=2880 I=2880 mxfp4"
  std::string describe() const;
};

// True when DIR is a Hugging Face checkpoint directory rather than a moekit layer directory: it
// has no experts.safetensors, and has model.safetensors.index.json, model.safetensors, or a
// config.json with a model_type.
bool is_hf_checkpoint(const std::string& dir);

// Reads DIR/config.json (and DIR/hf_quant_config.json). Throws moekit::Error naming the file and
// field: unknown model_type, missing or malformed fields, unsupported quantization.
HfModelConfig load_hf_config(const std::string& dir);

}  // namespace moekit
