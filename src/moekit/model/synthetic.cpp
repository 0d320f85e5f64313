#include "moekit/model/synthetic.h"

#include <filesystem>
#include <random>

#include "moekit/common/bf16.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/formats/codes.h"
#include "moekit/io/files.h"
#include "moekit/oracle/layer_checks.h"

namespace moekit {

namespace {

void fill_matrix(MoeModel& m, WeightMatrix& w, int64_t N, int64_t K, std::mt19937_64& rng,
                 int halves) {
  const WeightFormat f = m.cfg.format;
  w.format = f;
  w.E = m.cfg.num_experts;
  w.N = N;
  w.K = K;
  w.code_row = format_code_bytes(f, K);
  w.scale_row = format_scale_bytes(f, K);
  auto& codes = m.storage.emplace_back(size_t(w.E * N * w.code_row));
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  switch (f) {
    case WeightFormat::kMxfp4:
    case WeightFormat::kNvfp4:
      for (auto& b : codes) b = uint8_t(byte(rng));
      break;
    case WeightFormat::kMxfp8:
      for (auto& b : codes) {
        uint8_t c;
        do c = uint8_t(byte(rng)); while ((c & 0x7f) == 0x7f || (c & 0x78) > 0x50);  // |v| <= 2^3
        b = c;
      }
      break;
    case WeightFormat::kBf16:
      for (size_t i = 0; i < codes.size(); i += 2) {
        const uint16_t v = float_to_bf16(nd(rng));
        codes[i] = uint8_t(v & 0xff);
        codes[i + 1] = uint8_t(v >> 8);
      }
      break;
  }
  w.codes = codes.data();
  if (w.scale_row > 0) {
    auto& scales = m.storage.emplace_back(size_t(w.E * N * w.scale_row));
    std::uniform_int_distribution<int> mx_exp(119, 123), nv_scale(0x30, 0x48);
    for (auto& s : scales) s = uint8_t(f == WeightFormat::kNvfp4 ? nv_scale(rng) : mx_exp(rng));
    if (f == WeightFormat::kMxfp8)
      for (auto& s : scales) s = uint8_t(s - 2);
    w.scales = scales.data();
  }
  if (f == WeightFormat::kNvfp4) {
    std::uniform_real_distribution<float> u(0.5f, 2.0f);
    w.halves = halves;
    w.scale_2.resize(size_t(w.E * halves));
    for (auto& s : w.scale_2) s = u(rng) * 0.01f;
  }
}

}  // namespace

MoeModel make_synthetic_model(const MoeConfig& cfg, const SyntheticOptions& opt) {
  cfg.validate("synthetic model");
  {
    const int64_t E = cfg.num_experts, H = cfg.hidden, I = cfg.intermediate;
    const WeightFormat f = cfg.format;
    const uint64_t w13 = sat_mul({E, 2 * I, format_code_bytes(f, H) + format_scale_bytes(f, H)});
    const uint64_t w2 = sat_mul({E, H, format_code_bytes(f, I) + format_scale_bytes(f, I)});
    require_host_memory("synthetic model E=" + std::to_string(E) + " H=" + std::to_string(H) + " I=" +
                            std::to_string(I) + " weights",
                        sat_add(w13, w2));
  }
  MoeModel m;
  m.dir = "(synthetic)";
  m.cfg = cfg;
  std::mt19937_64 rng(opt.seed);
  const int64_t E = cfg.num_experts, H = cfg.hidden, I = cfg.intermediate;
  m.storage.reserve(4);
  fill_matrix(m, m.w13, 2 * I, H, rng, opt.split_scale_2 ? 2 : 1);
  fill_matrix(m, m.w2, H, I, rng, 1);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  if (opt.biases) {
    m.b13.resize(size_t(E * 2 * I));
    m.b2.resize(size_t(E * H));
    for (auto& b : m.b13) b = round_bf16(nd(rng));
    for (auto& b : m.b2) b = round_bf16(nd(rng));
  }
  if (opt.score_bias) {
    m.score_bias.resize(size_t(E));
    for (auto& b : m.score_bias) b = nd(rng);
  }
  return m;
}

void write_model_dir(const MoeModel& m, const std::string& dir) {
  std::filesystem::create_directories(dir);
  const MoeConfig& c = m.cfg;
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  SafetensorsWriter w;
  // Rows in checkpoint order: GPT-OSS interleaves gate/up for mxfp4.
  auto rows = [&](const WeightMatrix& wm, bool interleave, bool scales) {
    const int64_t rb = scales ? wm.scale_row : wm.code_row;
    std::vector<uint8_t> out(size_t(wm.E * wm.N * rb));
    for (int64_t e = 0; e < wm.E; ++e)
      for (int64_t r = 0; r < wm.N; ++r) {
        const int64_t phys = interleave ? (r < wm.N / 2 ? 2 * r : 2 * (r - wm.N / 2) + 1) : r;
        const uint8_t* src = scales ? wm.row_scales(e, r) : wm.row_codes(e, r);
        std::copy(src, src + rb, out.begin() + (e * wm.N + phys) * rb);
      }
    return out;
  };
  auto bias = [&](const std::vector<float>& b, int64_t N, bool interleave) {
    std::vector<uint16_t> out(b.size());
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < N; ++r) {
        const int64_t phys = interleave ? (r < N / 2 ? 2 * r : 2 * (r - N / 2) + 1) : r;
        out[size_t(e * N + phys)] = float_to_bf16(b[size_t(e * N + r)]);
      }
    return out;
  };
  const bool mx4 = c.format == WeightFormat::kMxfp4;
  switch (c.format) {
    case WeightFormat::kMxfp4:
      w.add("gate_up_proj_blocks", DType::kU8, {E, 2 * I, H / 32, 16}, rows(m.w13, true, false));
      w.add("gate_up_proj_scales", DType::kU8, {E, 2 * I, H / 32}, rows(m.w13, true, true));
      w.add("down_proj_blocks", DType::kU8, {E, H, I / 32, 16}, rows(m.w2, false, false));
      w.add("down_proj_scales", DType::kU8, {E, H, I / 32}, rows(m.w2, false, true));
      break;
    case WeightFormat::kNvfp4:
      w.add("w13_weight", DType::kU8, {E, 2 * I, H / 2}, rows(m.w13, false, false));
      w.add("w13_weight_scale", DType::kF8E4M3, {E, 2 * I, H / 16}, rows(m.w13, false, true));
      if (m.w13.halves == 2)
        w.add("w13_weight_scale_2", DType::kF32, {E, 2}, m.w13.scale_2);
      else
        w.add("w13_weight_scale_2", DType::kF32, {E}, m.w13.scale_2);
      w.add("w2_weight", DType::kU8, {E, H, I / 2}, rows(m.w2, false, false));
      w.add("w2_weight_scale", DType::kF8E4M3, {E, H, I / 16}, rows(m.w2, false, true));
      w.add("w2_weight_scale_2", DType::kF32, {E}, m.w2.scale_2);
      break;
    case WeightFormat::kMxfp8:
      w.add("w13_weight", DType::kF8E4M3, {E, 2 * I, H}, rows(m.w13, false, false));
      w.add("w13_weight_scale", DType::kU8, {E, 2 * I, H / 32}, rows(m.w13, false, true));
      w.add("w2_weight", DType::kF8E4M3, {E, H, I}, rows(m.w2, false, false));
      w.add("w2_weight_scale", DType::kU8, {E, H, I / 32}, rows(m.w2, false, true));
      break;
    case WeightFormat::kBf16:
      w.add("w13_weight", DType::kBF16, {E, 2 * I, H}, rows(m.w13, false, false));
      w.add("w2_weight", DType::kBF16, {E, H, I}, rows(m.w2, false, false));
      break;
  }
  if (!m.b13.empty()) {
    w.add(mx4 ? "gate_up_proj_bias" : "w13_bias", DType::kBF16, {E, 2 * I}, bias(m.b13, 2 * I, mx4));
    w.add(mx4 ? "down_proj_bias" : "w2_bias", DType::kBF16, {E, H}, bias(m.b2, H, false));
  }
  if (!m.score_bias.empty()) w.add("e_score_correction_bias", DType::kF32, {E}, m.score_bias);
  w.write(dir + "/experts.safetensors");
  write_file_atomic(dir + "/config.json", config_json(c) + "\n");
}

void require_synthetic_memory(const MoeConfig& cfg, int64_t tokens) {
  const uint64_t input = sat_mul({tokens, int64_t(cfg.hidden) * 2 + int64_t(cfg.num_experts) * 4});
  require_host_memory(std::to_string(tokens) + " tokens of E=" + std::to_string(cfg.num_experts) +
                          " H=" + std::to_string(cfg.hidden) + " I=" + std::to_string(cfg.intermediate),
                      sat_add(input, layer_host_bytes(cfg, tokens)));
}

LayerInputData make_synthetic_input(const MoeConfig& cfg, int64_t tokens, uint64_t seed) {
  require_synthetic_memory(cfg, tokens);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nx(0.0f, 1.0f), nl(0.0f, 2.0f);
  LayerInputData d;
  d.tokens = tokens;
  d.k = cfg.top_k;
  d.x.resize(size_t(tokens * cfg.hidden));
  for (auto& v : d.x) v = float_to_bf16(nx(rng));
  d.logits.resize(size_t(tokens * cfg.num_experts));
  for (auto& v : d.logits) v = nl(rng);
  return d;
}

}  // namespace moekit
