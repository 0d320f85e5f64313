#include "moekit/model/synthetic.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "moekit/common/bf16.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/formats/codes.h"
#include "moekit/formats/synthetic_bytes.h"
#include "moekit/io/files.h"
#include "moekit/oracle/layer_checks.h"

namespace moekit {

namespace {

void fill_matrix(MoeModel& m, WeightMatrix& w, int64_t N, int64_t K, std::mt19937_64& rng,
                 int halves, bool pow2) {
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
    case WeightFormat::kFp8:
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
  if (f == WeightFormat::kFp8) {
    // fp32 scales shared by 128 rows, as DeepSeek-V3 publishes them: [E, ceil(N/128), K/128].
    w.scale_row_group = kFp8Block;
    auto& scales = m.storage.emplace_back(size_t(w.E * ((N + kFp8Block - 1) / kFp8Block) * w.scale_row));
    std::uniform_real_distribution<float> u(1.0f, 2.0f);
    for (size_t i = 0; i < scales.size(); i += 4) {
      const float s = pow2 ? std::ldexp(1.0f, -10 + int(rng() % 3)) : u(rng) * 0x1p-9f;
      std::memcpy(&scales[i], &s, 4);
    }
    w.scales = scales.data();
  } else if (w.scale_row > 0) {
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
  validate_spec(cfg, "synthetic model");
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
  fill_matrix(m, m.w13, 2 * I, H, rng, opt.split_scale_2 ? 2 : 1, opt.pow2_fp8_scales);
  fill_matrix(m, m.w2, H, I, rng, 1, opt.pow2_fp8_scales);
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
  m.cfg.biases = opt.biases;
  m.cfg.score_bias = opt.score_bias;
  // Hash routing: a table of distinct experts per row (synthetic_bytes.h).
  m.hash_table.resize(size_t(cfg.hash_vocab * cfg.top_k));
  for (size_t i = 0; i < m.hash_table.size(); ++i)
    m.hash_table[i] = synthetic_hash_entry(int64_t(i), cfg.top_k, cfg.num_experts, opt.seed);
  return m;
}

void write_model_dir(const MoeModel& m, const std::string& dir) {
  std::filesystem::create_directories(dir);
  const MoeConfig& c = m.cfg;
  SafetensorsWriter w;
  for (const CheckpointTensor& t : checkpoint_of(m, true).tensors) {
    DType d;
    MOEKIT_REQUIRE(parse_dtype(t.dtype, &d), "write_model_dir: dtype ", t.dtype);
    w.add(t.name, d, t.shape, t.data, t.nbytes);
  }
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
  if (cfg.hash_vocab > 0) {  // the rows' token ids, uniform over the table
    std::uniform_int_distribution<int64_t> tok(0, cfg.hash_vocab - 1);
    d.token_ids.resize(size_t(tokens));
    for (auto& v : d.token_ids) v = tok(rng);
  }
  return d;
}

}  // namespace moekit
