#include "moekit/model/hf_checkpoint.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "moekit/common/error.h"
#include "moekit/formats/quantize.h"
#include "moekit/model/hf_config.h"

namespace moekit {

namespace {

// The config.json field that counts the routed experts.
const char* experts_field(HfArch a) {
  switch (a) {
    case HfArch::kDeepseekV3: return "n_routed_experts";
    case HfArch::kQwenMoe: return "num_experts";
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
  // shard and the tensor. `missing_note` follows the message of a tensor the index lacks.
  const TensorView& need(const std::string& name, const std::string& dtypes,
                         const std::vector<std::vector<int64_t>>& shapes, const std::string& missing_note = "") {
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
                   format_name(fmt), " weights: ", hc.quant, ")");
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
           experts_axis ? " " + experts_note() : "");
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
  void check_expert_count() {
    const std::string P = hc.experts_prefix(layer);
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

  void per_expert() {
    check_expert_count();
    const std::string P = hc.experts_prefix(layer);
    const bool mixtral = hc.layout == HfLayout::kMixtral;
    const char* gate = mixtral ? "w1" : "gate_proj";
    const char* up = mixtral ? "w3" : "up_proj";
    const char* down = mixtral ? "w2" : "down_proj";
    auto setup = [&](WeightMatrix& w, int64_t N, int64_t K, int parts) {
      matrix_common(w, N, K);
      w.parts = parts;
      w.part_codes.assign(size_t(E * parts), nullptr);
      if (fmt != WeightFormat::kBf16) w.part_scales.assign(size_t(E * parts), nullptr);
      if (fmt == WeightFormat::kFp8) w.scale_row_group = kFp8Block;
      if (fmt == WeightFormat::kNvfp4) {
        w.halves = parts;  // gate and up keep their own tensor scales
        w.scale_2.assign(size_t(E * parts), 1.0f);
      }
    };
    setup(m.w13, 2 * I, H, 2);
    setup(m.w2, H, I, 1);
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = P + std::to_string(e) + ".";
      projection(m.w13, e, 0, x + gate, I, H);
      projection(m.w13, e, 1, x + up, I, H);
      projection(m.w2, e, 0, x + down, H, I);
    }
    for (WeightMatrix* w : {&m.w13, &m.w2}) {
      w->codes = w->part_codes[0];
      w->scales = w->part_scales.empty() ? nullptr : w->part_scales[0];
    }
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
  if (hc.layout == HfLayout::kGptOssFused) L.gpt_oss();
  else L.per_expert();
  L.router();
  m.cfg.biases = !m.b13.empty() || !m.b2.empty();
  m.cfg.score_bias = !m.score_bias.empty();
  std::ostringstream os;
  os << hc.model_type << " layer " << layer << " of " << dir << " (" << hc.num_layers << " layers; " << hc.quant << ")";
  m.source = os.str();
  if (hc.shared_experts > 0)
    m.notes.push_back("the model's shared experts (" + std::to_string(hc.shared_experts) +
                      ") are outside the routed layer: their output is not in y (the library adds it when given "
                      "as `shared`)");
  if (L.input_scales)
    m.notes.push_back("ModelOpt input_scale tensors are read and checked but unused: activations stay bf16 (W4A16)");
  return m;
}

}  // namespace moekit
