#include "moekit/model/hf_synthetic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>

#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/formats/quantize.h"
#include "moekit/formats/synthetic_bytes.h"
#include "moekit/io/files.h"
#include "moekit/io/safetensors.h"

namespace moekit {

namespace {

using Fill = std::function<void(uint64_t, uint8_t*, size_t)>;

struct Out {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  Fill fill;
  uint64_t bytes = 0;
};

// Bytes of nrows rows of row_bytes each, row i at get_row(i).
Fill rows_fill(int64_t row_bytes, std::function<const uint8_t*(int64_t)> get_row) {
  return [row_bytes, get_row = std::move(get_row)](uint64_t off, uint8_t* dst, size_t n) {
    while (n > 0) {
      const int64_t i = int64_t(off / uint64_t(row_bytes)), in = int64_t(off % uint64_t(row_bytes));
      const size_t take = std::min<size_t>(n, size_t(row_bytes - in));
      std::memcpy(dst, get_row(i) + in, take);
      dst += take;
      off += take;
      n -= take;
    }
  };
}

Fill bytes_fill(std::vector<uint8_t> v) {
  auto p = std::make_shared<std::vector<uint8_t>>(std::move(v));
  return [p](uint64_t off, uint8_t* dst, size_t n) { std::memcpy(dst, p->data() + off, n); };
}

Fill synthetic_fill(uint64_t seed, SyntheticKind kind) {
  return [seed, kind](uint64_t off, uint8_t* dst, size_t n) {
    for (size_t i = 0; i < n; ++i) dst[i] = synthetic_byte(int64_t(off + i), seed, kind);
  };
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = float_to_bf16(v[i]);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
  return b;
}
std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

struct Writer {
  const HfCheckpointOptions& opt;
  std::vector<Out> out;
  uint64_t seed = 1000;

  void add(const std::string& name, DType d, std::vector<int64_t> shape, Fill fill) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    out.push_back({name, d, std::move(shape), std::move(fill), uint64_t(n) * dtype_size(d)});
  }
  // A small stand-in tensor of bf16 values (weights of the rest of the model).
  void filler(const std::string& name, std::vector<int64_t> shape) {
    add(name, DType::kBF16, std::move(shape), synthetic_fill(++seed, SyntheticKind::kBf16));
  }

  // One projection of one expert ([N, K] rows first_row.. of w, expert e) in the format's
  // per-expert tensors: .weight (+ .weight_scale_inv | .weight_scale, .weight_scale_2, .input_scale).
  void projection(const std::string& base, const WeightMatrix& w, int64_t e, int64_t first_row, int64_t N) {
    const int64_t K = w.K;
    const WeightFormat f = w.format;
    const std::vector<int64_t> cshape = f == WeightFormat::kNvfp4 ? std::vector<int64_t>{N, K / 2}
                                                                  : std::vector<int64_t>{N, K};
    const DType cd = f == WeightFormat::kBf16 ? DType::kBF16 : f == WeightFormat::kNvfp4 ? DType::kU8 : DType::kF8E4M3;
    add(base + ".weight", cd, cshape, rows_fill(w.code_row, [&w, e, first_row](int64_t i) { return w.row_codes(e, first_row + i); }));
    if (f == WeightFormat::kFp8) {
      MOEKIT_REQUIRE(w.scale_row_group == kFp8Block && first_row % kFp8Block == 0,
                     "write_hf_checkpoint: fp8 weights need scales shared by 128 rows");
      const std::vector<int64_t> sshape = {(N + kFp8Block - 1) / kFp8Block, K / kFp8Block};
      Fill f32 = rows_fill(w.scale_row, [&w, e, first_row](int64_t i) { return w.row_scales(e, first_row + i * kFp8Block); });
      if (!opt.bf16_fp8_scales) {
        add(base + ".weight_scale_inv", DType::kF32, sshape, std::move(f32));
      } else {  // the fp32 scales rounded to bf16, two bytes of output per four of input
        add(base + ".weight_scale_inv", DType::kBF16, sshape, [f32](uint64_t off, uint8_t* dst, size_t n) {
          std::vector<uint8_t> in(n * 2);
          f32(off * 2, in.data(), in.size());
          for (size_t i = 0; i < n / 2; ++i) {
            float v;
            std::memcpy(&v, in.data() + 4 * i, 4);
            const uint16_t h = float_to_bf16(v);
            std::memcpy(dst + 2 * i, &h, 2);
          }
        });
      }
    } else if (f == WeightFormat::kNvfp4) {
      add(base + ".weight_scale", DType::kF8E4M3, {N, K / 16},
          rows_fill(w.scale_row, [&w, e, first_row](int64_t i) { return w.row_scales(e, first_row + i); }));
      add(base + ".weight_scale_2", DType::kF32, {}, bytes_fill(f32_bytes({w.row_scale_2(e, first_row)})));
      add(base + ".input_scale", DType::kF32, {}, bytes_fill(f32_bytes({1.0f / 448.0f})));
    }
  }

  // ---- DeepSeek-V4 (model/hf_checkpoint.cpp's comment has the names) -------------------------
  // A routed projection [N, K] (rows first_row.. of expert e) in DeepSeek's names.
  void v4_projection(const std::string& base, const WeightMatrix& w, int64_t e, int64_t first_row, int64_t N) {
    const int64_t K = w.K;
    auto codes = [&w, e, first_row](int64_t i) { return w.row_codes(e, first_row + i); };
    switch (w.format) {
      case WeightFormat::kMxfp4:  // packed E2M1 as I8, E8M0 scales per 32
        add(base + ".weight", DType::kI8, {N, K / 2}, rows_fill(w.code_row, codes));
        add(base + ".scale", DType::kF8E8M0, {N, K / 32},
            rows_fill(w.scale_row, [&w, e, first_row](int64_t i) { return w.row_scales(e, first_row + i); }));
        break;
      case WeightFormat::kFp8:  // Flash-Base: F32 scales of 128x128 blocks
        MOEKIT_REQUIRE(w.scale_row_group == kFp8Block && first_row % kFp8Block == 0,
                       "write_hf_checkpoint: fp8 weights need scales shared by 128 rows");
        add(base + ".weight", DType::kF8E4M3, {N, K}, rows_fill(w.code_row, codes));
        add(base + ".scale", DType::kF32, {(N + kFp8Block - 1) / kFp8Block, K / kFp8Block},
            rows_fill(w.scale_row, [&w, e, first_row](int64_t i) { return w.row_scales(e, first_row + i * kFp8Block); }));
        break;
      case WeightFormat::kBf16:
        add(base + ".weight", DType::kBF16, {N, K}, rows_fill(w.code_row, codes));
        break;
      default:
        fail("write_hf_checkpoint: deepseek_v4 experts are MXFP4, FP8 or BF16");
    }
  }

  // A shared-expert projection: FP8 with its power-of-two scales as E8M0 blocks, or BF16.
  void v4_shared(const std::string& base, const WeightMatrix& w, int64_t first_row, int64_t N) {
    const int64_t K = w.K;
    auto codes = [&w, first_row](int64_t i) { return w.row_codes(0, first_row + i); };
    if (w.format == WeightFormat::kBf16) {
      add(base + ".weight", DType::kBF16, {N, K}, rows_fill(w.code_row, codes));
      return;
    }
    MOEKIT_REQUIRE(w.format == WeightFormat::kFp8 && first_row % kFp8Block == 0,
                   "write_hf_checkpoint: a deepseek_v4 shared expert is FP8 (power-of-two scales) or BF16");
    add(base + ".weight", DType::kF8E4M3, {N, K}, rows_fill(w.code_row, codes));
    const int64_t rb = (N + kFp8Block - 1) / kFp8Block, cb = K / kFp8Block;
    std::vector<uint8_t> e8(size_t(rb * cb));
    for (int64_t i = 0; i < rb; ++i)
      for (int64_t j = 0; j < cb; ++j) {
        float v;
        std::memcpy(&v, w.row_scales(0, first_row + i * kFp8Block) + 4 * j, 4);
        int ex = 0;
        MOEKIT_REQUIRE(v > 0 && std::frexp(v, &ex) == 0.5f, "write_hf_checkpoint: shared-expert scale ", v,
                       " is not a power of two (E8M0)");
        e8[size_t(i * cb + j)] = uint8_t(ex - 1 + 127);
      }
    add(base + ".scale", DType::kF8E8M0, {rb, cb}, bytes_fill(std::move(e8)));
  }

  void v4_layer(int layer, const HfLayerSource& src) {
    const LayerWeights& m = *src.weights;
    const int64_t E = m.cfg.num_experts, H = m.cfg.hidden, I = m.cfg.intermediate;
    const bool own = !opt.v4_transformers_names;
    const std::string L = std::to_string(layer);
    const std::string P = own ? "layers." + L + ".ffn." : "model.layers." + L + ".mlp.";
    if (own) {
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = P + "experts." + std::to_string(e) + ".";
        v4_projection(x + "w1", m.w13, e, 0, I);
        v4_projection(x + "w3", m.w13, e, I, I);
        v4_projection(x + "w2", m.w2, e, 0, H);
      }
    } else {  // transformers: BF16 experts stacked, gate rows then up rows
      MOEKIT_REQUIRE(m.cfg.format == WeightFormat::kBf16, "write_hf_checkpoint: transformers' names hold BF16 experts");
      const WeightMatrix& w13 = m.w13;
      const WeightMatrix& w2 = m.w2;
      add(P + "experts.gate_up_proj", DType::kBF16, {E, 2 * I, H},
          rows_fill(w13.code_row, [&w13, I](int64_t i) { return w13.row_codes(i / (2 * I), i % (2 * I)); }));
      add(P + "experts.down_proj", DType::kBF16, {E, H, I},
          rows_fill(w2.code_row, [&w2, H](int64_t i) { return w2.row_codes(i / H, i % H); }));
    }
    add(P + "gate.weight", DType::kBF16, {E, H}, bytes_fill(bf16_bytes(src.router->weight)));
    if (m.cfg.hash_vocab > 0) {
      const int64_t k = m.cfg.top_k;
      std::vector<uint8_t> b(m.hash_table.size() * (opt.table_i32 ? 4 : 8));
      for (size_t i = 0; i < m.hash_table.size(); ++i) {
        if (opt.table_i32) std::memcpy(b.data() + 4 * i, &m.hash_table[i], 4);
        else {
          const int64_t v = m.hash_table[i];
          std::memcpy(b.data() + 8 * i, &v, 8);
        }
      }
      add(P + "gate.tid2eid", opt.table_i32 ? DType::kI32 : DType::kI64, {m.cfg.hash_vocab, k}, bytes_fill(std::move(b)));
    } else {
      std::vector<float> sb = m.score_bias;
      sb.resize(size_t(E), 0.0f);
      add(P + (own ? "gate.bias" : "gate.e_score_correction_bias"), DType::kF32, {E}, bytes_fill(f32_bytes(sb)));
    }
    if (src.shared) {
      const LayerWeights& sh = *src.shared;
      const int64_t Is = sh.cfg.intermediate;
      const std::string S = P + "shared_experts.";
      v4_shared(S + (own ? "w1" : "gate_proj"), sh.w13, 0, Is);
      v4_shared(S + (own ? "w3" : "up_proj"), sh.w13, Is, Is);
      v4_shared(S + (own ? "w2" : "down_proj"), sh.w2, 0, H);
    }
    // Stand-ins for the rest of the block.
    const std::string B = own ? "layers." + L + "." : "model.layers." + L + ".";
    filler(B + (own ? "attn_norm.weight" : "input_layernorm.weight"), {H});
    filler(B + (own ? "ffn_norm.weight" : "post_attention_layernorm.weight"), {H});
    filler(B + (own ? "attn.wq_a.weight" : "self_attn.q_a_proj.weight"), {64, H});
    filler(B + (own ? "attn.wo_b.weight" : "self_attn.o_b_proj.weight"), {H, 64});
  }

  void moe_layer(const std::string& P, const HfLayerSource& src) {
    const LayerWeights& m = *src.weights;
    const int64_t E = m.cfg.num_experts, H = m.cfg.hidden, I = m.cfg.intermediate;
    if (opt.model_type == "gpt_oss") {
      const std::string X = P + "mlp.experts.";
      // Physical row p of the interleaved gate_up axis holds logical row lr(p).
      auto lr = [I](int64_t p) { return p % 2 == 0 ? p / 2 : I + p / 2; };
      const WeightMatrix& w13 = m.w13;
      const WeightMatrix& w2 = m.w2;
      add(X + "gate_up_proj_blocks", DType::kU8, {E, 2 * I, H / 32, 16},
          rows_fill(w13.code_row, [&w13, lr, I](int64_t i) { return w13.row_codes(i / (2 * I), lr(i % (2 * I))); }));
      add(X + "gate_up_proj_scales", DType::kU8, {E, 2 * I, H / 32},
          rows_fill(w13.scale_row, [&w13, lr, I](int64_t i) { return w13.row_scales(i / (2 * I), lr(i % (2 * I))); }));
      if (!m.b13.empty()) {
        std::vector<float> b(m.b13.size());
        for (int64_t e = 0; e < E; ++e)
          for (int64_t p = 0; p < 2 * I; ++p) b[size_t(e * 2 * I + p)] = m.b13[size_t(e * 2 * I + lr(p))];
        add(X + "gate_up_proj_bias", DType::kBF16, {E, 2 * I}, bytes_fill(bf16_bytes(b)));
      }
      add(X + "down_proj_blocks", DType::kU8, {E, H, I / 32, 16},
          rows_fill(w2.code_row, [&w2, H](int64_t i) { return w2.row_codes(i / H, i % H); }));
      add(X + "down_proj_scales", DType::kU8, {E, H, I / 32},
          rows_fill(w2.scale_row, [&w2, H](int64_t i) { return w2.row_scales(i / H, i % H); }));
      if (!m.b2.empty()) add(X + "down_proj_bias", DType::kBF16, {E, H}, bytes_fill(bf16_bytes(m.b2)));
      add(P + "mlp.router.weight", DType::kBF16, {E, H}, bytes_fill(bf16_bytes(src.router->weight)));
      add(P + "mlp.router.bias", DType::kBF16, {E}, bytes_fill(bf16_bytes(src.router->bias)));
      return;
    }
    const bool mixtral = opt.model_type == "mixtral";
    const std::string X = P + (mixtral ? "block_sparse_moe.experts." : "mlp.experts.");
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = X + std::to_string(e) + ".";
      projection(x + (mixtral ? "w1" : "gate_proj"), m.w13, e, 0, I);
      projection(x + (mixtral ? "w3" : "up_proj"), m.w13, e, I, I);
      projection(x + (mixtral ? "w2" : "down_proj"), m.w2, e, 0, H);
    }
    const std::string R = P + (mixtral ? "block_sparse_moe.gate." : "mlp.gate.");
    add(R + "weight", DType::kBF16, {E, H}, bytes_fill(bf16_bytes(src.router->weight)));
    if (opt.model_type == "deepseek_v3") {
      std::vector<float> sb = m.score_bias;
      sb.resize(size_t(E), 0.0f);
      add(R + "e_score_correction_bias", DType::kF32, {E}, bytes_fill(f32_bytes(sb)));
      // The shared expert, a dense MLP of I columns beside the routed ones.
      filler(P + "mlp.shared_experts.gate_proj.weight", {I, H});
      filler(P + "mlp.shared_experts.up_proj.weight", {I, H});
      filler(P + "mlp.shared_experts.down_proj.weight", {H, I});
    }
  }

  // Attention and norms of a layer: small stand-ins (64 rows) under the real names.
  void layer_rest(const std::string& P, int64_t H) {
    filler(P + "input_layernorm.weight", {H});
    filler(P + "post_attention_layernorm.weight", {H});
    for (const char* p : {"q_proj", "k_proj", "v_proj"}) filler(P + "self_attn." + p + ".weight", {64, H});
    filler(P + "self_attn.o_proj.weight", {H, 64});
  }
};

nlohmann::ordered_json config_of(const HfCheckpointOptions& opt, const LayerSpec& c, const LayerWeights* shared) {
  nlohmann::ordered_json j;
  j["model_type"] = opt.model_type;
  j["num_hidden_layers"] = opt.num_layers;
  j["hidden_size"] = c.hidden;
  j["vocab_size"] = opt.model_type == "deepseek_v4" ? opt.vocab : 64;
  j["torch_dtype"] = "bfloat16";
  if (opt.model_type == "deepseek_v4") {
    nlohmann::ordered_json t;  // the text model's fields (V4.1: in text_config)
    t["model_type"] = "deepseek_v4";
    t["num_hidden_layers"] = opt.num_layers;
    t["hidden_size"] = c.hidden;
    t["vocab_size"] = opt.vocab;
    t["n_routed_experts"] = c.num_experts;
    t["num_experts_per_tok"] = c.top_k;
    t["moe_intermediate_size"] = c.intermediate;
    t["n_shared_experts"] = shared ? 1 : 0;
    t["scoring_func"] = scoring_name(c.scoring);
    t["topk_method"] = "noaux_tc";
    t["norm_topk_prob"] = c.norm_topk_prob;
    t["routed_scaling_factor"] = c.routed_scaling_factor;
    t["swiglu_limit"] = c.act == Activation::kSiluClamped ? c.swiglu_limit : 0.0f;
    t["hidden_act"] = "silu";
    if (opt.v4_transformers_names) {
      nlohmann::ordered_json types = nlohmann::ordered_json::array();
      for (int l = 0; l < opt.num_layers; ++l) types.push_back(l < opt.num_hash_layers ? "hash_moe" : "moe");
      t["mlp_layer_types"] = types;
    } else {
      t["num_hash_layers"] = opt.num_hash_layers;
    }
    if (c.format == WeightFormat::kMxfp4) t["expert_dtype"] = "fp4";
    if (c.format == WeightFormat::kFp8) t["expert_dtype"] = "fp8";
    nlohmann::ordered_json out;
    out["architectures"] = {"DeepseekV4ForCausalLM"};
    if (opt.text_config) {
      out["model_type"] = "deepseek_v41";
      out["text_config"] = t;
    } else {
      for (auto it = t.begin(); it != t.end(); ++it) out[it.key()] = it.value();
    }
    out["torch_dtype"] = "bfloat16";
    if (c.format != WeightFormat::kBf16 || (shared && shared->cfg.format == WeightFormat::kFp8))
      out["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                    {"scale_fmt", "ue8m0"}, {"weight_block_size", {128, 128}}};
    return out;
  }
  if (opt.model_type == "gpt_oss") {
    j["architectures"] = {"GptOssForCausalLM"};
    j["num_local_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.top_k;
    j["experts_per_token"] = c.top_k;
    j["intermediate_size"] = c.intermediate;
    j["swiglu_limit"] = c.swiglu_limit;
    j["hidden_act"] = "silu";
    j["quantization_config"] = {{"modules_to_not_convert", {"model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"}},
                                {"quant_method", "mxfp4"}};
  } else if (opt.model_type == "deepseek_v3") {
    j["architectures"] = {"DeepseekV3ForCausalLM"};
    j["n_routed_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.top_k;
    j["moe_intermediate_size"] = c.intermediate;
    j["intermediate_size"] = 2 * c.intermediate;
    j["n_shared_experts"] = 1;
    j["n_group"] = c.n_group;
    j["topk_group"] = c.topk_group;
    j["routed_scaling_factor"] = c.routed_scaling_factor;
    j["scoring_func"] = "sigmoid";
    j["topk_method"] = "noaux_tc";
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["first_k_dense_replace"] = opt.first_dense;
    j["moe_layer_freq"] = 1;
    j["hidden_act"] = "silu";
    if (c.format == WeightFormat::kFp8)
      j["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                  {"weight_block_size", {128, 128}}};
  } else if (opt.model_type == "qwen3_moe") {
    j["architectures"] = {"Qwen3MoeForCausalLM"};
    j["num_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.top_k;
    j["moe_intermediate_size"] = c.intermediate;
    j["intermediate_size"] = 3 * c.intermediate;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = nlohmann::ordered_json::array();
    j["hidden_act"] = "silu";
    if (c.format == WeightFormat::kFp8)
      j["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                  {"weight_block_size", {128, 128}}};
  } else {
    j["architectures"] = {"MixtralForCausalLM"};
    j["num_local_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.top_k;
    j["intermediate_size"] = c.intermediate;
    j["hidden_act"] = "silu";
  }
  return j;
}

}  // namespace

void write_hf_checkpoint(const std::string& dir, const HfCheckpointOptions& opt, const std::vector<HfLayerSource>& moe) {
  MOEKIT_REQUIRE(!moe.empty() && moe[0].weights, "write_hf_checkpoint: no MoE layer");
  const LayerSpec& c = moe[0].weights->cfg;
  const int first_dense = opt.model_type == "deepseek_v3" ? opt.first_dense : 0;
  MOEKIT_REQUIRE(int(moe.size()) == opt.num_layers - first_dense, "write_hf_checkpoint: ", moe.size(),
                 " MoE layers given, the options make ", opt.num_layers - first_dense);
  std::filesystem::create_directories(dir);
  Writer w{opt, {}};
  const int64_t H = c.hidden;
  const bool v4_own = opt.model_type == "deepseek_v4" && !opt.v4_transformers_names;
  w.filler(v4_own ? "embed.weight" : "model.embed_tokens.weight", {64, H});
  for (int l = 0; l < opt.num_layers; ++l) {
    if (opt.model_type == "deepseek_v4") {
      w.v4_layer(l, moe[size_t(l)]);
      continue;
    }
    const std::string P = "model.layers." + std::to_string(l) + ".";
    w.layer_rest(P, H);
    if (l < first_dense) {  // a dense MLP (DeepSeek's first layers)
      for (const char* p : {"gate_proj", "up_proj"}) w.filler(P + "mlp." + p + ".weight", {2 * int64_t(c.intermediate), H});
      w.filler(P + "mlp.down_proj.weight", {H, 2 * int64_t(c.intermediate)});
      continue;
    }
    w.moe_layer(P, moe[size_t(l - first_dense)]);
  }
  w.filler(v4_own ? "norm.weight" : "model.norm.weight", {H});
  w.filler(v4_own ? "head.weight" : "lm_head.weight", {64, H});

  // Shards of about equal bytes, tensors in order (a layer may straddle two shards).
  uint64_t total = 0;
  for (const Out& o : w.out) total += o.bytes;
  const int n = std::max(1, opt.shards);
  nlohmann::ordered_json wm;
  size_t next = 0;
  uint64_t done = 0;
  for (int s = 0; s < n; ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, n);
    const std::string file = opt.single_file && n == 1 ? "model.safetensors" : name;
    SafetensorsWriter sw;
    sw.set_metadata("format", "pt");
    const uint64_t until = s + 1 == n ? total : total / uint64_t(n) * uint64_t(s + 1);
    while (next < w.out.size() && (done < until || s + 1 == n)) {
      const Out& o = w.out[next++];
      sw.add_generated(o.name, o.dtype, o.shape, o.fill);
      wm[o.name] = file;
      done += o.bytes;
    }
    sw.write(dir + "/" + file);
  }
  if (!(opt.single_file && n == 1)) {
    nlohmann::ordered_json idx;
    idx["metadata"] = {{"total_size", total}};
    idx["weight_map"] = wm;
    write_file_atomic(dir + "/model.safetensors.index.json", idx.dump(2) + "\n");
  }
  write_file_atomic(dir + "/config.json", config_of(opt, c, moe[0].shared).dump(2) + "\n");
  if (opt.modelopt)
    write_file_atomic(dir + "/hf_quant_config.json",
                      nlohmann::ordered_json{{"producer", {{"name", "modelopt"}, {"version", "0.0"}}},
                                             {"quantization", {{"quant_algo", "NVFP4"},
                                                               {"kv_cache_quant_algo", nullptr},
                                                               {"group_size", 16},
                                                               {"exclude_modules", {"lm_head"}}}}}
                              .dump(2) +
                          "\n");
}

RouterWeights make_synthetic_router(int num_experts, int64_t hidden, uint64_t seed, bool bias) {
  RouterWeights r;
  r.num_experts = num_experts;
  r.hidden = hidden;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  r.weight.resize(size_t(num_experts * hidden));
  for (float& v : r.weight) v = round_bf16(nd(rng));
  if (bias) {
    r.bias.resize(size_t(num_experts));
    for (float& v : r.bias) v = round_bf16(nd(rng));
  }
  return r;
}

}  // namespace moekit
