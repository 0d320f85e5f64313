// moekit/spec.hpp — the description of one MoE layer's expert part (public; no files, no
// framework, no CUDA). Everything below the file readers takes its problem from here: the
// kernels, routing, the oracle and the backends. Plain C++17 so that device code can include it.
//
// The layer computes, for T tokens x [T, H] (bf16):
//   routing   router logits [T, E] -> top-k expert ids [T, k] (-1 = no expert) and weights [T, k]
//   experts   per chosen expert e: GEMM1 x W13_e^T (+ bias) -> gated activation -> bf16 ->
//             GEMM2 with W2_e^T (+ bias)
//   finalize  y = bf16(sum_k weight_k * expert_k(x) [+ shared]), one rounding
#pragma once

#include <cstdint>
#include <string>

namespace moekit {

// Expert weight formats (docs/FORMATS.md): MXFP4 (E2M1 + E8M0 per 32), NVFP4 (E2M1 + E4M3 per 16
// + an fp32 tensor scale), MXFP8 (E4M3 + E8M0 per 32), BF16, and FP8 (E4M3 + an fp32 scale per
// 128 along K: DeepSeek-V3's and Qwen3-FP8's 128x128 blocks, whose 128 rows share their scales;
// the CPU backends run it exactly, the SM90 ones after an explicit conversion).
enum class WeightFormat { kMxfp4, kMxfp8, kNvfp4, kBf16, kFp8 };
// How a checkpoint's MX scales were chosen (informative; dequantization does not depend on it).
enum class ScaleRule { kFloor, kRceil };
// Gated activations, fp32 math (SPEC section 3):
//   silu          silu(gate) * up
//   swiglu_oai    g = min(gate, limit); u = clamp(up, +-limit); g * sigmoid(alpha g) * (u + beta)
//   silu_clamped  silu(min(gate, limit)) * clamp(up, +-limit)
enum class Activation { kSilu, kSwigluOai, kSiluClamped };
// Router scoring: softmax over E, sigmoid with group-limited selection (DeepSeek-V3), or
// sqrt(softplus(logit)) (DeepSeek-V4; no groups).
enum class Scoring { kSoftmax, kSigmoid, kSqrtSoftplus };
// The experts' activation format (SPEC section 1): standard (contiguous segments per expert) or
// batched ([E, max_tokens, H] plus per-expert counts). It selects the backend family; every
// backend serves all three forward calls.
enum class ActivationFormat { kStandard, kBatched };
// The precision of the experts' GEMM inputs ("activations" as in W4A16 / W4A8; not the gated
// activation function, `act`). bf16 (the default): the permuted token rows and the bf16-rounded
// intermediate feed the GEMMs as they are. fp8: both GEMMs' inputs are first quantized to E4M3,
// one scale per token row per 128 elements along K (DeepSeek-V3/V4's activation format), and the
// GEMMs run on the dequantized values. The exact rule (docs/FORMATS.md, "FP8 activations"):
//   amax = max(max |x| over the group, 1e-4f)      (a group is 128 elements of a row along K; the
//                                                   last one holds K % 128 when K is not a multiple)
//   s    = amax / 448                              fp32 division (ActivationScale::kFp32), or
//          the smallest power of two >= amax / 448 (ActivationScale::kUe8m0, DeepSeek-V4's
//                                                   inference rule: an E8M0 scale)
//   q    = E4M3_RNE(clamp(x / s, -448, 448))       x / s in fp32, then round to nearest even
//   used = fp32(e4m3(q) * s)                       what the GEMM multiplies
// A group holding NaN or Inf dequantizes to NaN throughout.
enum class ActivationDtype { kBf16, kFp8 };
enum class ActivationScale { kFp32, kUe8m0 };

struct LayerSpec {
  int num_experts = 0;   // E
  int top_k = 0;         // k
  int hidden = 0;        // H
  int intermediate = 0;  // I, per expert
  WeightFormat format = WeightFormat::kBf16;
  ScaleRule scale_rule = ScaleRule::kFloor;
  // Activation and its parameters (alpha/beta: swiglu_oai; limit: swiglu_oai, silu_clamped).
  Activation act = Activation::kSilu;
  float swiglu_alpha = 1.702f;
  float swiglu_beta = 1.0f;
  float swiglu_limit = 7.0f;
  // Routing function and its parameters. The top-k weights are renormalized to sum 1 when
  // norm_topk_prob, then multiplied by routed_scaling_factor. Sigmoid scoring keeps the best
  // topk_group of n_group contiguous expert groups; score_bias: an e_score_correction_bias [E]
  // (added to the scores for the choice only; sigmoid and sqrtsoftplus) comes with the weights.
  Scoring scoring = Scoring::kSoftmax;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  int n_group = 1;
  int topk_group = 1;
  bool score_bias = false;
  // Hash routing (DeepSeek-V4's first layers): > 0 makes the layer choose the experts of a row
  // from a frozen table, tid2eid [hash_vocab, top_k] (a weight of the layer), by the row's token
  // id; the weights are still the scores of those experts (scoring), renormalized and scaled as
  // above. Forward calls then take the rows' token ids. 0: the experts are the top-k scores.
  int64_t hash_vocab = 0;
  // GEMM biases (GPT-OSS): w13 [E, 2I] and w2 [E, H] come with the weights.
  bool biases = false;
  ActivationFormat activation_format = ActivationFormat::kStandard;
  // The experts' input precision (above) and, for fp8, the kind of its per-128 scales
  // (activation_scale is fp32 unless activation_dtype is fp8). The CLI's --activations and
  // --activation-scale, config.json's activation_dtype and activation_scale. Backends declare which
  // they run; one that cannot run fp8 refuses the layer (never runs bf16 activations in its place).
  ActivationDtype activation_dtype = ActivationDtype::kBf16;
  ActivationScale activation_scale = ActivationScale::kFp32;
  // Tokens per forward call at most (the batched call: rows per expert at most). Sizes the
  // layer's state; 0 in descriptions that only name a problem (config files).
  int64_t max_tokens = 0;
};

// One buffer of a layer's packed weights (the backend's own layout; its size is all a caller
// needs to know). Packing fills every buffer, the layer's small device state included.
struct BufferDesc {
  std::string name;
  int64_t bytes = 0;
  int64_t alignment = 256;  // of the buffer's start
};

}  // namespace moekit
