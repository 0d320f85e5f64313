#include "moekit/model/hf_checkpoint.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/formats/codes.h"
#include "moekit/formats/quantize.h"
#include "moekit/model/hf_config.h"
#include "moekit/routing/routing.h"
#include "moekit/oracle/layer_checks.h"

namespace moekit {

namespace {

// The config.json field that counts the routed experts.
const char* experts_field(HfArch a) {
  switch (a) {
    case HfArch::kDeepseekV3: return "n_routed_experts";
    case HfArch::kQwenMoe: return "num_experts";
    case HfArch::kDeepseekV4: return "n_routed_experts";
    case HfArch::kGptOss:
    case HfArch::kMixtral: break;
  }
  return "num_local_experts";
}

struct Loader {
  const HfModelConfig& hc;
  MoeModel& m;
  int layer;
  int64_t E, H, I;
  WeightFormat fmt;

  // "(config.json n_routed_experts = 8)"
  std::string experts_note() const {
    std::ostringstream os;
    os << "(" << hc.path << ": " << experts_field(hc.arch) << " = " << E << ")";
    return os.str();
  }

  // The tensor, of one of `dtypes` ("BF16|F32") and one of `shapes`; every message names the
  // shard and the tensor. `missing_note` follows the message of a tensor the index lacks (and of
  // a wrong shape); `what` says what the dtypes belong to (default: the experts' format).
  const TensorView& need(const std::string& name, const std::string& dtypes,
                         const std::vector<std::vector<int64_t>>& shapes, const std::string& missing_note = "",
                         const std::string& what = "") {
    const TensorView* t = m.shards.find(name);
    MOEKIT_REQUIRE(t, m.shards.index_path(), ": no tensor ", name, missing_note.empty() ? "" : " ", missing_note);
    const std::string where = m.shards.shard_path(name);
    const std::string dt = dtype_name(t->dtype);
    bool dtype_ok = false;
    for (size_t b = 0, e; b <= dtypes.size(); b = e + 1) {
      e = dtypes.find('|', b);
      if (e == std::string::npos) e = dtypes.size();
      dtype_ok = dtype_ok || dtypes.compare(b, e - b, dt) == 0;
    }
    std::string expect = dtypes;
    for (size_t p; (p = expect.find('|')) != std::string::npos;) expect.replace(p, 1, " or ");
    MOEKIT_REQUIRE(dtype_ok, where, ": tensor ", name, ": dtype ", dt, ", expected ", expect, " (",
                   what.empty() ? std::string(format_name(fmt)) + " weights: " + hc.quant : what, ")");
    bool shape_ok = false;
    for (const auto& s : shapes) shape_ok = shape_ok || t->shape == s;
    if (!shape_ok) {
      std::string want;
      for (const auto& s : shapes) want += (want.empty() ? "" : " or ") + shape_str(s);
      // A tensor whose expert axis (stacked experts, the router's rows) disagrees with
      // config.json says so.
      const bool experts_axis = !t->shape.empty() && shapes[0].size() == t->shape.size() && shapes[0][0] == E &&
                                t->shape[0] != E && (hc.layout == HfLayout::kGptOssFused || name.starts_with(hc.router_prefix(layer)));
      fail(where, ": tensor ", name, ": shape ", shape_str(t->shape), ", expected ", want,
           experts_axis ? " " + experts_note() : missing_note.empty() ? "" : " " + missing_note);
    }
    return *t;
  }

  std::vector<float> floats(const TensorView& t, const std::string& name) {
    const std::string where = m.shards.shard_path(name);
    std::vector<float> v = to_float(t, where);
    for (size_t i = 0; i < v.size(); ++i)
      MOEKIT_REQUIRE(std::isfinite(v[i]), where, ": tensor ", name, ": non-finite value at element ", i);
    return v;
  }

  void matrix_common(WeightMatrix& w, int64_t N, int64_t K) {
    w.format = fmt;
    w.E = E;
    w.N = N;
    w.K = K;
    w.code_row = format_code_bytes(fmt, K);
    w.scale_row = format_scale_bytes(fmt, K);
  }

  // ---- GPT-OSS: stacked [E, ...] tensors, gate and up rows interleaved ----------------------
  void gpt_oss() {
    MOEKIT_REQUIRE(fmt == WeightFormat::kMxfp4, hc.path,
                   ": GPT-OSS experts without quantization_config (bf16 gate_up_proj [E, H, 2I]) are not "
                   "supported; use the MXFP4 checkpoint");
    const std::string P = hc.experts_prefix(layer);
    auto stacked = [&](WeightMatrix& w, const std::string& base, int64_t N, int64_t K) {
      matrix_common(w, N, K);
      const TensorView& c = need(P + base + "_blocks", "U8", {{E, N, K / 32, 16}});
      const TensorView& s = need(P + base + "_scales", "U8", {{E, N, K / 32}});
      require_finite_weights(fmt, c.data, c.nbytes, s.data, s.nbytes, m.shards.shard_path(P + base + "_scales"),
                             P + base + "_blocks", P + base + "_scales");
      w.codes = c.data;
      w.scales = s.data;
    };
    stacked(m.w13, "gate_up_proj", 2 * I, H);
    stacked(m.w2, "down_proj", H, I);
    m.w13.interleaved = true;
    if (m.shards.contains(P + "gate_up_proj_bias")) {
      const std::string n = P + "gate_up_proj_bias";
      const std::vector<float> b = floats(need(n, "BF16|F32", {{E, 2 * I}}), n);
      m.b13.resize(b.size());
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < 2 * I; ++r) m.b13[size_t(e * 2 * I + r)] = b[size_t(e * 2 * I + m.w13.physical_row(r))];
    }
    if (m.shards.contains(P + "down_proj_bias")) {
      const std::string n = P + "down_proj_bias";
      m.b2 = floats(need(n, "BF16|F32", {{E, H}}), n);
    }
  }

  // ---- one tensor per expert and projection ---------------------------------------------------
  // Refuses tensors of experts the config does not count (expert j >= E).
  std::string experts_prefix_override{};  // DeepSeek-V4: the layer's naming (v4_naming)
  std::string experts_prefix() const {
    return experts_prefix_override.empty() ? hc.experts_prefix(layer) : experts_prefix_override;
  }

  void check_expert_count() {
    const std::string P = experts_prefix();
    for (const std::string& name : m.shards.names_with_prefix(P)) {
      const size_t dot = name.find('.', P.size());
      const std::string idx = name.substr(P.size(), dot == std::string::npos ? std::string::npos : dot - P.size());
      int64_t j = -1;
      if (!idx.empty() && idx.size() < 10 && idx.find_first_not_of("0123456789") == std::string::npos) j = std::stoll(idx);
      MOEKIT_REQUIRE(j >= 0, m.shards.shard_path(name), ": tensor ", name, ": '", idx, "' is not an expert index");
      MOEKIT_REQUIRE(j < E, m.shards.shard_path(name), ": tensor ", name, ": expert ", j, " is beyond the ", E,
                     " experts ", experts_note());
    }
  }

  // One projection [N, K] of expert e: codes, scales and tensor scale into part `part` of w.
  void projection(WeightMatrix& w, int64_t e, int part, const std::string& base, int64_t N, int64_t K) {
    const std::string note = experts_note();
    const std::string wn = base + ".weight";
    const std::string where = m.shards.shard_path(wn);
    const size_t at = size_t(e * w.parts + part);
    switch (fmt) {
      case WeightFormat::kBf16: {
        const TensorView& c = need(wn, "BF16", {{N, K}}, note);
        require_finite_weights(fmt, c.data, c.nbytes, nullptr, 0, where, wn, "");
        w.part_codes[at] = c.data;
        break;
      }
      case WeightFormat::kFp8: {
        const TensorView& c = need(wn, "F8_E4M3", {{N, K}}, note);
        const std::string sn = base + ".weight_scale_inv";
        const TensorView& s = need(sn, "F32|BF16|F16", {{(N + kFp8Block - 1) / kFp8Block, K / kFp8Block}}, note);
        const uint8_t* scales = s.data;
        if (s.dtype != DType::kF32) {
          // Qwen3's FP8 releases store the block scales in BF16 (some in F16): widened to fp32,
          // exactly, as their own dequantization does (a small copy: one scale per 16384 weights).
          const std::vector<float> f = floats(s, sn);
          std::vector<uint8_t>& b = m.storage.emplace_back(f.size() * 4);
          std::memcpy(b.data(), f.data(), b.size());
          scales = b.data();
        }
        require_finite_weights(fmt, c.data, c.nbytes, scales, size_t(s.numel()) * 4, where, wn, sn);
        w.part_codes[at] = c.data;
        w.part_scales[at] = scales;
        break;
      }
      case WeightFormat::kNvfp4: {
        const TensorView& c = need(wn, "U8", {{N, K / 2}}, note);
        const std::string sn = base + ".weight_scale", s2n = base + ".weight_scale_2", in = base + ".input_scale";
        const TensorView& s = need(sn, "F8_E4M3", {{N, K / 16}}, note);
        require_finite_weights(fmt, c.data, c.nbytes, s.data, s.nbytes, where, wn, sn);
        const std::vector<float> g = floats(need(s2n, "F32", {{}, {1}}, note), s2n);
        require_positive_scales(g.data(), 1, m.shards.shard_path(s2n), s2n);
        if (m.shards.contains(in)) {  // read and checked; the layer keeps bf16 activations
          const std::vector<float> is = floats(need(in, "F32", {{}, {1}}, note), in);
          require_positive_scales(is.data(), 1, m.shards.shard_path(in), in);
          input_scales = true;
        }
        w.part_codes[at] = c.data;
        w.part_scales[at] = s.data;
        w.scale_2[size_t(e * w.halves + (w.halves == 2 ? part : 0))] = g[0];
        break;
      }
      case WeightFormat::kMxfp4:
      case WeightFormat::kMxfp8:
        fail(hc.path, ": ", format_name(fmt), " weights are not published per expert");
    }
  }

  // A matrix [E, N, K] of one tensor per expert and part, its parts to be filled.
  void setup_parts(WeightMatrix& w, int64_t N, int64_t K, int parts) {
    matrix_common(w, N, K);
    w.parts = parts;
    w.part_codes.assign(size_t(E * parts), nullptr);
    if (fmt != WeightFormat::kBf16) w.part_scales.assign(size_t(E * parts), nullptr);
    if (fmt == WeightFormat::kFp8) w.scale_row_group = kFp8Block;
    if (fmt == WeightFormat::kNvfp4) {
      w.halves = parts;  // gate and up keep their own tensor scales
      w.scale_2.assign(size_t(E * parts), 1.0f);
    }
  }
  // Once the parts are filled: codes and scales point at the first part.
  static void first_part(WeightMatrix& w) {
    w.codes = w.part_codes[0];
    w.scales = w.part_scales.empty() ? nullptr : w.part_scales[0];
  }

  void per_expert() {
    check_expert_count();
    const std::string P = experts_prefix();
    const bool mixtral = hc.layout == HfLayout::kMixtral;
    const char* gate = mixtral ? "w1" : "gate_proj";
    const char* up = mixtral ? "w3" : "up_proj";
    const char* down = mixtral ? "w2" : "down_proj";
    setup_parts(m.w13, 2 * I, H, 2);
    setup_parts(m.w2, H, I, 1);
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = P + std::to_string(e) + ".";
      projection(m.w13, e, 0, x + gate, I, H);
      projection(m.w13, e, 1, x + up, I, H);
      projection(m.w2, e, 0, x + down, H, I);
    }
    first_part(m.w13);
    first_part(m.w2);
  }

  void router() {
    const std::string R = hc.router_prefix(layer);
    const std::string wn = R + "weight";
    m.router.num_experts = int(E);
    m.router.hidden = H;
    m.router.weight = floats(need(wn, "BF16|F32|F16", {{E, H}}), wn);
    if (hc.layout == HfLayout::kGptOssFused && m.shards.contains(R + "bias"))
      m.router.bias = floats(need(R + "bias", "BF16|F32|F16", {{E}}), R + "bias");
    if (hc.arch == HfArch::kDeepseekV3 && hc.spec.scoring == Scoring::kSigmoid) {
      // noaux_tc: the correction bias chooses the experts (routing/routing.h).
      const std::string bn = R + "e_score_correction_bias";
      m.score_bias = floats(need(bn, "F32|BF16", {{E}}), bn);
    }
  }

  bool input_scales = false;

  // ---- DeepSeek-V4 ------------------------------------------------------------------------
  // Its own names (P = layers.L.ffn.): P experts.{j}.{w1,w3,w2}.weight (gate, up, down) and
  // .scale, P gate.weight, gate.bias (learned layers) or gate.tid2eid (hash layers), P
  // shared_experts.{w1,w3,w2}.weight and .scale. Or transformers' (P = model.layers.L.mlp.):
  // P experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I] (or per expert
  // {j}.{gate,up,down}_proj.weight), P gate.weight, gate.e_score_correction_bias or gate.tid2eid,
  // P shared_experts.{gate,up,down}_proj.weight. Per expert, by format (a projection [N, K]):
  //   mxfp4  .weight I8 [N, K/2] (two E2M1 codes per byte, element 2i low), .scale F8_E8M0 [N, K/32]
  //   fp8    .weight F8_E4M3 [N, K], .scale F32 or F8_E8M0 [ceil(N/128), K/128] (Flash-Base)
  //   bf16   .weight BF16 [N, K]
  std::string P4{};      // the layer's prefix
  bool v4_own = true;    // DeepSeek's names (else transformers')

  void v4_naming() {
    const std::string L = std::to_string(layer);
    const std::string own = "layers." + L + ".ffn.", hf = "model.layers." + L + ".mlp.";
    if (m.shards.contains(own + "gate.weight")) {
      P4 = own;
      v4_own = true;
    } else if (m.shards.contains(hf + "gate.weight")) {
      P4 = hf;
      v4_own = false;
    } else {
      fail(m.shards.index_path(), ": no tensor ", own, "gate.weight (DeepSeek's names) nor ", hf,
           "gate.weight (transformers'): layer ", layer, " of a ", hc.model_type, " checkpoint has no router");
    }
    experts_prefix_override = P4 + "experts.";
  }

  // fp32 scales of a tensor stored as F32, or widened exactly from BF16 / F16 / F8_E8M0 into storage.
  const uint8_t* f32_scales(const TensorView& s, const std::string& name) {
    if (s.dtype == DType::kF32) return s.data;
    const std::vector<float> f = floats(s, name);
    std::vector<uint8_t>& b = m.storage.emplace_back(f.size() * 4);
    std::memcpy(b.data(), f.data(), b.size());
    return b.data();
  }

  // One routed projection [N, K] of expert e in DeepSeek's names, into part `part` of w.
  void v4_projection(WeightMatrix& w, int64_t e, int part, const std::string& base, int64_t N, int64_t K) {
    const std::string note = experts_note();
    const std::string wn = base + ".weight", sn = base + ".scale";
    const size_t at = size_t(e * w.parts + part);
    switch (fmt) {
      case WeightFormat::kMxfp4: {
        const TensorView& c = need(wn, "I8|U8", {{N, K / 2}}, note);
        const TensorView& sc = need(sn, "F8_E8M0|U8", {{N, K / 32}}, note);
        require_finite_weights(fmt, c.data, c.nbytes, sc.data, sc.nbytes, m.shards.shard_path(sn), wn, sn);
        w.part_codes[at] = c.data;
        w.part_scales[at] = sc.data;
        break;
      }
      case WeightFormat::kFp8: {
        const TensorView& c = need(wn, "F8_E4M3", {{N, K}}, note);
        const TensorView& sc = need(sn, "F32|F8_E8M0|BF16", {{(N + kFp8Block - 1) / kFp8Block, K / kFp8Block}}, note);
        const uint8_t* scales = f32_scales(sc, sn);
        require_finite_weights(fmt, c.data, c.nbytes, scales, size_t(sc.numel()) * 4, m.shards.shard_path(sn), wn, sn);
        w.part_codes[at] = c.data;
        w.part_scales[at] = scales;
        break;
      }
      case WeightFormat::kBf16: {
        const TensorView& c = need(wn, "BF16", {{N, K}}, note);
        require_finite_weights(fmt, c.data, c.nbytes, nullptr, 0, m.shards.shard_path(wn), wn, "");
        w.part_codes[at] = c.data;
        break;
      }
      default:
        fail(hc.path, ": ", format_name(fmt), " experts are not published for ", hc.model_type);
    }
  }

  void v4_experts() {
    if (v4_own) {
      check_expert_count();
      setup_parts(m.w13, 2 * I, H, 2);
      setup_parts(m.w2, H, I, 1);
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = P4 + "experts." + std::to_string(e) + ".";
        v4_projection(m.w13, e, 0, x + "w1", I, H);  // gate
        v4_projection(m.w13, e, 1, x + "w3", I, H);  // up
        v4_projection(m.w2, e, 0, x + "w2", H, I);   // down
      }
      first_part(m.w13);
      first_part(m.w2);
      return;
    }
    const std::string fused = P4 + "experts.gate_up_proj";
    if (!m.shards.contains(fused)) return per_expert();  // transformers' per-expert names
    MOEKIT_REQUIRE(fmt == WeightFormat::kBf16, m.shards.shard_path(fused), ": tensor ", fused, ": ",
                   format_name(fmt), " experts stacked as gate_up_proj are not supported (BF16 only; ", hc.quant, ")");
    auto stacked = [&](WeightMatrix& w, const std::string& name, int64_t N, int64_t K) {
      matrix_common(w, N, K);
      const TensorView& c = need(name, "BF16", {{E, N, K}});
      require_finite_weights(fmt, c.data, c.nbytes, nullptr, 0, m.shards.shard_path(name), name, "");
      w.codes = c.data;
    };
    stacked(m.w13, fused, 2 * I, H);  // gate rows, then up rows
    stacked(m.w2, P4 + "experts.down_proj", H, I);
  }

  void v4_router() {
    const std::string R = P4 + "gate.";
    const std::string wn = R + "weight", bn = R + (v4_own ? "bias" : "e_score_correction_bias"), tn = R + "tid2eid";
    m.router.num_experts = int(E);
    m.router.hidden = H;
    m.router.weight = floats(need(wn, "BF16|F32|F16", {{E, H}}, experts_note(), "the router's weight"), wn);
    const bool has_table = m.shards.contains(tn), has_bias = m.shards.contains(bn);
    const bool hash = hc.hash_from_checkpoint ? has_table : hc.is_hash(layer);
    const std::string why = "layer " + std::to_string(layer) + (hash ? " is hash-routed" : " routes by score") +
                            " (" + hc.path + ": " + hc.hash_source + ")";
    if (!hash) {
      MOEKIT_REQUIRE(!has_table, m.shards.shard_path(tn), ": tensor ", tn, ": ", why, ", but its gate has a tid2eid table");
      m.score_bias = floats(need(bn, "F32|BF16", {{E}}, "(the expert bias: " + why + ")", "the expert bias"), bn);
      return;
    }
    MOEKIT_REQUIRE(has_table, m.shards.index_path(), ": no tensor ", tn, ": ", why, ": its experts are tid2eid[token id]");
    MOEKIT_REQUIRE(!has_bias, m.shards.shard_path(bn), ": tensor ", bn, ": ", why,
                   ": it chooses no experts by score and has no expert bias");
    const TensorView* t = m.shards.find(tn);
    const int64_t V = hc.vocab_size > 0 ? hc.vocab_size : (t && !t->shape.empty() ? t->shape[0] : 0);
    const TensorView& tab = need(tn, "I64|I32", {{V, int64_t(hc.spec.top_k)}},
                                 "(" + hc.path + ": vocab_size = " + std::to_string(V) + ", num_experts_per_tok = " +
                                     std::to_string(hc.spec.top_k) + ")",
                                 "the hash table");
    MOEKIT_REQUIRE(V > 0, m.shards.shard_path(tn), ": tensor ", tn, ": an empty table");
    m.hash_table = hash_table_from(tab.data, tab.dtype == DType::kI64, V, hc.spec.top_k, int(E),
                                   m.shards.shard_path(tn) + ": tensor " + tn);
    m.cfg.hash_vocab = V;
  }

  // The shared expert as a one-expert layer (MoeModel::shared_expert). FP8 weights with
  // power-of-two (E8M0) block scales become BF16 exactly (an E4M3 value times 2^s has 4
  // significant bits), whatever the block; with F32 scales of 128x128 blocks they stay FP8; BF16
  // weights stay BF16.
  void v4_shared() {
    if (hc.shared_experts == 0) return;
    const int64_t Is = hc.shared_intermediate;
    const std::string S = P4 + "shared_experts.";
    const std::string names[3] = {S + (v4_own ? "w1" : "gate_proj"), S + (v4_own ? "w3" : "up_proj"),
                                  S + (v4_own ? "w2" : "down_proj")};
    const int64_t rows[3] = {Is, Is, H}, cols[3] = {H, H, Is};
    const std::string note = "(" + hc.path + ": n_shared_experts = " + std::to_string(hc.shared_experts) +
                             ", moe_intermediate_size = " + std::to_string(I) + ")";
    const std::string scale_suffix = v4_own ? ".scale" : ".weight_scale_inv";
    const TensorView* w0 = m.shards.find(names[0] + ".weight");
    MOEKIT_REQUIRE(w0, m.shards.index_path(), ": no tensor ", names[0], ".weight (the layer's shared expert) ", note);
    const bool f8 = w0->dtype == DType::kF8E4M3;
    const TensorView* s0 = f8 ? m.shards.find(names[0] + scale_suffix) : nullptr;
    const bool pow2 = s0 && (s0->dtype == DType::kF8E8M0 || s0->dtype == DType::kU8);
    const int bn = f8 ? hc.shared_block[0] : 1, bk = f8 ? hc.shared_block[1] : 1;
    LayerWeights& sh = m.shared_expert;
    sh.cfg = hc.spec;
    sh.cfg.num_experts = 1;
    sh.cfg.top_k = 1;
    sh.cfg.intermediate = int(Is);
    sh.cfg.scoring = Scoring::kSoftmax;
    sh.cfg.norm_topk_prob = false;
    sh.cfg.routed_scaling_factor = 1.0f;
    sh.cfg.score_bias = sh.cfg.biases = false;
    sh.cfg.hash_vocab = 0;
    sh.cfg.format = f8 && !pow2 ? WeightFormat::kFp8 : WeightFormat::kBf16;
    if (f8 && !pow2)
      MOEKIT_REQUIRE(bn == kFp8Block && bk == kFp8Block, hc.path, ": quantization_config.weight_block_size [", bn, ", ",
                     bk, "]: a shared expert with F32 block scales must have 128x128 blocks");
    const std::string what = f8 ? "the shared expert's FP8 weights" : "the shared expert's weights";
    // bf16 bytes [N, K] of projection i (dequantized when fp8), or the fp8 codes and f32 scales.
    std::vector<uint8_t> bf[3];
    const uint8_t* codes[3] = {};
    const uint8_t* scales[3] = {};
    for (int i = 0; i < 3; ++i) {
      const int64_t N = rows[i], K = cols[i];
      const std::string wn = names[i] + ".weight";
      if (!f8) {
        const TensorView& c = need(wn, "BF16", {{N, K}}, note, what);
        require_finite_weights(WeightFormat::kBf16, c.data, c.nbytes, nullptr, 0, m.shards.shard_path(wn), wn, "");
        codes[i] = c.data;
        continue;
      }
      const std::string sn = names[i] + scale_suffix;
      const TensorView& c = need(wn, "F8_E4M3", {{N, K}}, note, what);
      const TensorView& sc = need(sn, pow2 ? "F8_E8M0|U8" : "F32|BF16", {{(N + bn - 1) / bn, (K + bk - 1) / bk}},
                                  "(" + hc.path + ": weight_block_size [" + std::to_string(bn) + ", " +
                                      std::to_string(bk) + "])",
                                  what);
      require_finite_elements(ElementCode::kE4M3, c.data, c.nbytes, m.shards.shard_path(wn), wn);
      if (!pow2) {
        codes[i] = c.data;
        scales[i] = f32_scales(sc, sn);
        require_finite_elements(ElementCode::kF32, scales[i], size_t(sc.numel()) * 4, m.shards.shard_path(sn), sn);
        continue;
      }
      require_finite_elements(ElementCode::kE8M0, sc.data, sc.nbytes, m.shards.shard_path(sn), sn);
      bf[i].resize(size_t(N * K * 2));
      const int64_t sk = (K + bk - 1) / bk;
      for (int64_t r = 0; r < N; ++r)
        for (int64_t k = 0; k < K; ++k) {
          const float v = e4m3_to_float(c.data[r * K + k]) * e8m0_to_float(sc.data[(r / bn) * sk + k / bk]);
          const uint16_t b = float_to_bf16(v);
          MOEKIT_REQUIRE(bf16_to_float(b) == v, m.shards.shard_path(sn), ": tensor ", sn, ": weight (", r, ", ", k,
                         ") of ", wn, " times its scale (", v, ") is not exact in bf16 (a scale below 2^-120?)");
          std::memcpy(bf[i].data() + 2 * (r * K + k), &b, 2);
        }
      codes[i] = bf[i].data();
    }
    const WeightFormat sf = sh.cfg.format;
    auto matrix = [&](WeightMatrix& w, int64_t N, int64_t K, int parts) {
      w.format = sf;
      w.E = 1;
      w.N = N;
      w.K = K;
      w.code_row = format_code_bytes(sf, K);
      w.scale_row = format_scale_bytes(sf, K);
      w.parts = parts;
      if (sf == WeightFormat::kFp8) w.scale_row_group = kFp8Block;
    };
    matrix(sh.w13, 2 * Is, H, 2);
    matrix(sh.w2, H, Is, 1);
    for (int i = 0; i < 3; ++i)
      if (!bf[i].empty()) {  // owned: moved into storage (the bytes stay where they are)
        m.storage.push_back(std::move(bf[i]));
        codes[i] = m.storage.back().data();
      }
    sh.w13.part_codes = {codes[0], codes[1]};
    sh.w2.part_codes = {codes[2]};
    if (sf == WeightFormat::kFp8) {
      sh.w13.part_scales = {scales[0], scales[1]};
      sh.w2.part_scales = {scales[2]};
    }
    first_part(sh.w13);
    first_part(sh.w2);
    validate_spec(sh.cfg, "the shared expert of layer " + std::to_string(layer));
  }

  void deepseek_v4() {
    v4_naming();
    v4_experts();
    v4_router();
    v4_shared();
  }
};

}  // namespace

MoeModel load_hf_layer(const std::string& dir, int layer) {
  const HfModelConfig hc = load_hf_config(dir);
  if (layer < 0) layer = hc.moe_layers.front();
  MOEKIT_REQUIRE(layer < hc.num_layers, dir, ": layer ", layer, " is out of range (", hc.path,
                 ": num_hidden_layers = ", hc.num_layers, ", layers 0-", hc.num_layers - 1, ")");
  MOEKIT_REQUIRE(hc.is_moe(layer), dir, ": ", hc.why_dense(layer));
  MoeModel m;
  m.dir = dir;
  m.layer = layer;
  m.cfg = hc.spec;
  m.shards = SafetensorsIndex::open(dir);
  Loader L{hc, m, layer, hc.spec.num_experts, hc.spec.hidden, hc.spec.intermediate, hc.spec.format};
  if (hc.arch == HfArch::kDeepseekV4) {
    L.deepseek_v4();
  } else {
    if (hc.layout == HfLayout::kGptOssFused) L.gpt_oss();
    else L.per_expert();
    L.router();
  }
  m.cfg.biases = !m.b13.empty() || !m.b2.empty();
  m.cfg.score_bias = !m.score_bias.empty();
  std::ostringstream os;
  os << hc.model_type << " layer " << layer << " of " << dir << " (" << hc.num_layers << " layers; " << hc.quant << ")";
  m.source = os.str();
  if (m.cfg.hash_vocab > 0)
    m.notes.push_back("hash-routed (" + hc.hash_source + "): its experts are tid2eid[input_ids] (the input file's "
                      "input_ids), weighted by their " + std::string(scoring_name(m.cfg.scoring)) + " scores");
  if (m.has_shared_expert()) {
    const LayerSpec& sc = m.shared_expert.cfg;
    m.notes.push_back("the shared expert (I = " + std::to_string(sc.intermediate) + ", " + format_name(sc.format) +
                      (hc.shared_format == WeightFormat::kFp8 && sc.format == WeightFormat::kBf16
                           ? " from FP8 with power-of-two block scales, exact"
                           : "") +
                      ") runs as a one-expert layer; its output, rounded to bf16, is added to y before the rounding");
  } else if (hc.shared_experts > 0) {
    m.notes.push_back("the model's shared experts (" + std::to_string(hc.shared_experts) +
                      ") are outside the routed layer: their output is not in y (the library adds it when given "
                      "as `shared`)");
  }
  if (hc.arch == HfArch::kDeepseekV4)
    m.notes.push_back("activations are bf16 (W4A16 / W8A16) unless the layer asks for fp8 (`--activations fp8 "
                      "--activation-scale ue8m0`: DeepSeek's reference, FP8 per 128 with power-of-two scales before "
                      "each GEMM, W4A8)");
  if (L.input_scales)
    m.notes.push_back("ModelOpt input_scale tensors are read and checked but unused: activations stay bf16 (W4A16)");
  return m;
}

}  // namespace moekit
