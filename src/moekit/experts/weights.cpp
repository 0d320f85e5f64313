#include "moekit/experts/weights.h"

#include <cmath>
#include <cstring>

#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/routing/routing.h"

namespace moekit {

void WeightMatrix::dequant_row(int64_t e, int64_t r, float* out) const {
  if (format == WeightFormat::kBf16) {
    const uint8_t* c = row_codes(e, r);
    for (int64_t i = 0; i < K; ++i) out[i] = bf16_to_float(uint16_t(c[2 * i] | (c[2 * i + 1] << 8)));
    return;
  }
  dequantize_tensor(format, row_codes(e, r), row_scales(e, r), row_scale_2(e, r), 1, K, out);
}

namespace {

// Names of the checkpoint tensors by role, per format (SPEC section 7).
struct Names {
  const char *w13, *s13, *w2, *s2, *b13, *b2;
  const char *code_dtype, *scale_dtype;
};
Names names_of(WeightFormat f) {
  switch (f) {
    case WeightFormat::kMxfp4:
      return {"gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales",
              "gate_up_proj_bias",   "down_proj_bias",      "U8",               "U8"};
    case WeightFormat::kNvfp4:
      return {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale",
              "w13_bias",   "w2_bias",          "U8",        "F8_E4M3"};
    case WeightFormat::kMxfp8:
      return {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale",
              "w13_bias",   "w2_bias",          "F8_E4M3",   "U8"};
    case WeightFormat::kFp8:
      return {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale",
              "w13_bias",   "w2_bias",          "F8_E4M3",   "F32"};
    case WeightFormat::kBf16:
    default:
      return {"w13_weight", nullptr, "w2_weight", nullptr, "w13_bias", "w2_bias", "BF16", nullptr};
  }
}

// Checkpoint shape of codes and scales of a [E, N, K] matrix.
std::vector<int64_t> code_shape(WeightFormat f, int64_t E, int64_t N, int64_t K) {
  switch (f) {
    case WeightFormat::kMxfp4: return {E, N, K / 32, 16};
    case WeightFormat::kNvfp4: return {E, N, K / 2};
    default: return {E, N, K};
  }
}
std::vector<int64_t> scale_shape(WeightFormat f, int64_t E, int64_t N, int64_t K) {
  return {E, N, K / format_block(f)};
}

size_t dtype_bytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "BF16" || d == "F16" || d == "I16" || d == "U16") return 2;
  return 1;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

struct Reader {
  const std::vector<CheckpointTensor>& t;
  const std::string& what;

  const CheckpointTensor* find(const std::string& name) const {
    for (const CheckpointTensor& x : t)
      if (x.name == name) return &x;
    return nullptr;
  }
  // dtypes: one name, or two separated by '|'.
  const CheckpointTensor& need(const std::string& name, const std::string& dtypes,
                               const std::vector<int64_t>& shape) const {
    const CheckpointTensor* x = find(name);
    MOEKIT_REQUIRE(x, what, ": missing tensor ", name, " (expected ", shape_text(shape), ")");
    const size_t bar = dtypes.find('|');
    const bool ok = bar == std::string::npos
                        ? x->dtype == dtypes
                        : x->dtype == dtypes.substr(0, bar) || x->dtype == dtypes.substr(bar + 1);
    std::string expect = dtypes;
    if (bar != std::string::npos) expect.replace(bar, 1, " or ");
    MOEKIT_REQUIRE(ok, what, ": tensor ", name, ": dtype ", x->dtype, ", expected ", expect);
    MOEKIT_REQUIRE(x->shape == shape, what, ": tensor ", name, ": shape ", shape_text(x->shape),
                   ", expected ", shape_text(shape));
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    MOEKIT_REQUIRE(x->data && x->nbytes == size_t(n) * dtype_bytes(x->dtype), what, ": tensor ",
                   name, ": ", x->nbytes, " bytes for shape ", shape_text(shape));
    return *x;
  }
  std::vector<float> floats(const CheckpointTensor& x) const {
    const size_t n = x.nbytes / dtype_bytes(x.dtype);
    std::vector<float> v(n);
    if (x.dtype == "F32") {
      std::memcpy(v.data(), x.data, n * 4);
    } else {
      for (size_t i = 0; i < n; ++i) v[i] = bf16_to_float(uint16_t(x.data[2 * i] | (x.data[2 * i + 1] << 8)));
    }
    for (size_t i = 0; i < n; ++i)
      MOEKIT_REQUIRE(std::isfinite(v[i]), what, ": tensor ", x.name, ": non-finite value at ", i);
    return v;
  }
  std::vector<float> optional_floats(const std::string& name, const std::vector<int64_t>& shape,
                                     const std::string& dtypes) const {
    if (!find(name)) return {};
    return floats(need(name, dtypes, shape));
  }
  // Value checks (formats/quantize.h): NaN codes of E4M3 and E8M0, non-finite bf16 weights.
  void reject_nan_codes(WeightFormat f, const CheckpointTensor& codes, const CheckpointTensor* scales) const {
    require_finite_weights(f, codes.data, codes.nbytes, scales ? scales->data : nullptr, scales ? scales->nbytes : 0,
                           what, codes.name, scales ? scales->name : "");
  }
  // Tensor scales (NVFP4 scale_2 = 1/g): finite and positive.
  std::vector<float> positive(const CheckpointTensor& x) const {
    std::vector<float> v(x.nbytes / 4);
    std::memcpy(v.data(), x.data, v.size() * 4);
    require_positive_scales(v.data(), v.size(), what, x.name);
    return v;
  }
};

}  // namespace

void require_finite_weights(WeightFormat f, const uint8_t* codes, size_t code_bytes, const uint8_t* scales,
                            size_t scale_bytes, const std::string& what, const std::string& code_name,
                            const std::string& scale_name) {
  if (f == WeightFormat::kMxfp8 || f == WeightFormat::kFp8)
    require_finite_elements(ElementCode::kE4M3, codes, code_bytes, what, code_name);
  if (f == WeightFormat::kBf16) require_finite_elements(ElementCode::kBF16, codes, code_bytes, what, code_name);
  if (!scales) return;
  const ElementCode sc = f == WeightFormat::kNvfp4 ? ElementCode::kE4M3
                         : f == WeightFormat::kFp8 ? ElementCode::kF32
                                                   : ElementCode::kE8M0;
  require_finite_elements(sc, scales, scale_bytes, what, scale_name);
}

std::vector<CheckpointSlot> checkpoint_slots(const MoeConfig& cfg) {
  const int64_t E = cfg.num_experts, H = cfg.hidden, I = cfg.intermediate;
  const WeightFormat f = cfg.format;
  const Names n = names_of(f);
  std::vector<CheckpointSlot> v;
  v.push_back({n.w13, n.code_dtype, code_shape(f, E, 2 * I, H)});
  if (n.s13) v.push_back({n.s13, n.scale_dtype, scale_shape(f, E, 2 * I, H)});
  if (f == WeightFormat::kNvfp4) v.push_back({"w13_weight_scale_2", "F32", {E}});
  v.push_back({n.w2, n.code_dtype, code_shape(f, E, H, I)});
  if (n.s2) v.push_back({n.s2, n.scale_dtype, scale_shape(f, E, H, I)});
  if (f == WeightFormat::kNvfp4) v.push_back({"w2_weight_scale_2", "F32", {E}});
  v.push_back({n.b13, "BF16|F32", {E, 2 * I}, true});
  v.push_back({n.b2, "BF16|F32", {E, H}, true});
  v.push_back({"e_score_correction_bias", "F32", {E}, true});
  if (cfg.hash_vocab > 0) v.push_back({"tid2eid", "I32|I64", {cfg.hash_vocab, int64_t(cfg.top_k)}});
  return v;
}

CheckpointBytes checkpoint_of(const LayerWeights& m, bool bf16_biases) {
  const MoeConfig& c = m.cfg;
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  const Names n = names_of(c.format);
  CheckpointBytes out;
  out.storage.reserve(10);
  auto add = [&](const char* name, const char* dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes) {
    out.storage.push_back(std::move(bytes));
    const std::vector<uint8_t>& b = out.storage.back();
    out.tensors.push_back({name, dtype, std::move(shape), b.data(), b.size()});
  };
  // GPT-OSS (mxfp4) interleaves w13's gate and up rows: logical row r at this checkpoint row.
  const bool ilv = c.format == WeightFormat::kMxfp4;
  auto phys = [](bool interleave, int64_t r, int64_t N) {
    return interleave ? (r < N / 2 ? 2 * r : 2 * (r - N / 2) + 1) : r;
  };
  // Codes or scales of every logical row, at its checkpoint row.
  auto rows = [&](const WeightMatrix& w, bool scales, bool interleave) {
    const int64_t rb = scales ? w.scale_row : w.code_row;
    std::vector<uint8_t> b(size_t(w.E * w.N * rb));
    for (int64_t e = 0; e < w.E; ++e)
      for (int64_t r = 0; r < w.N; ++r) {
        const uint8_t* src = scales ? w.row_scales(e, r) : w.row_codes(e, r);
        std::memcpy(b.data() + (e * w.N + phys(interleave, r, w.N)) * rb, src, size_t(rb));
      }
    return b;
  };
  auto floats = [&](const std::vector<float>& v, int64_t N, bool interleave) {
    std::vector<uint8_t> b(v.size() * (bf16_biases ? 2 : 4));
    for (size_t i = 0; i < v.size(); ++i) {
      const int64_t e = int64_t(i) / N, r = int64_t(i) % N;
      const size_t at = size_t(e * N + phys(interleave, r, N));
      if (bf16_biases) {
        const uint16_t h = float_to_bf16(v[i]);
        std::memcpy(b.data() + 2 * at, &h, 2);
      } else {
        std::memcpy(b.data() + 4 * at, &v[i], 4);
      }
    }
    return b;
  };
  auto f32 = [](const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  add(n.w13, n.code_dtype, code_shape(c.format, E, 2 * I, H), rows(m.w13, false, ilv));
  if (n.s13) add(n.s13, n.scale_dtype, scale_shape(c.format, E, 2 * I, H), rows(m.w13, true, ilv));
  if (c.format == WeightFormat::kNvfp4)
    add("w13_weight_scale_2", "F32", m.w13.halves == 2 ? std::vector<int64_t>{E, 2} : std::vector<int64_t>{E},
        f32(m.w13.scale_2));
  add(n.w2, n.code_dtype, code_shape(c.format, E, H, I), rows(m.w2, false, false));
  if (n.s2) add(n.s2, n.scale_dtype, scale_shape(c.format, E, H, I), rows(m.w2, true, false));
  if (c.format == WeightFormat::kNvfp4) add("w2_weight_scale_2", "F32", {E}, f32(m.w2.scale_2));
  const char* bias_dtype = bf16_biases ? "BF16" : "F32";
  if (!m.b13.empty()) add(n.b13, bias_dtype, {E, 2 * I}, floats(m.b13, 2 * I, ilv));
  if (!m.b2.empty()) add(n.b2, bias_dtype, {E, H}, floats(m.b2, H, false));
  if (!m.score_bias.empty()) add("e_score_correction_bias", "F32", {E}, f32(m.score_bias));
  if (!m.hash_table.empty()) {
    std::vector<uint8_t> b(m.hash_table.size() * 4);
    std::memcpy(b.data(), m.hash_table.data(), b.size());
    add("tid2eid", "I32", {c.hash_vocab, int64_t(c.top_k)}, std::move(b));
  }
  return out;
}

LayerWeights weights_from_checkpoint(const MoeConfig& cfg_in, const std::vector<CheckpointTensor>& t,
                                     const std::string& what) {
  LayerWeights m;
  m.cfg = cfg_in;
  const Reader L{t, what};
  const int64_t E = m.cfg.num_experts, H = m.cfg.hidden, I = m.cfg.intermediate;
  const WeightFormat fmt = m.cfg.format;
  const Names n = names_of(fmt);

  auto setup = [&](WeightMatrix& w, int64_t N, int64_t K, const char* codes, const char* scales) {
    w.format = fmt;
    w.E = E;
    w.N = N;
    w.K = K;
    w.code_row = format_code_bytes(fmt, K);
    w.scale_row = format_scale_bytes(fmt, K);
    const CheckpointTensor& c = L.need(codes, n.code_dtype, code_shape(fmt, E, N, K));
    const CheckpointTensor* s = scales ? &L.need(scales, n.scale_dtype, scale_shape(fmt, E, N, K)) : nullptr;
    L.reject_nan_codes(fmt, c, s);
    w.codes = c.data;
    w.scales = s ? s->data : nullptr;
  };
  setup(m.w13, 2 * I, H, n.w13, n.s13);
  setup(m.w2, H, I, n.w2, n.s2);
  m.w13.interleaved = fmt == WeightFormat::kMxfp4;  // GPT-OSS: gate, up, gate, up, ...
  if (fmt == WeightFormat::kNvfp4) {
    const CheckpointTensor* g1 = L.find("w13_weight_scale_2");
    MOEKIT_REQUIRE(g1, what, ": missing tensor w13_weight_scale_2 (expected [", E, "] or [", E, ", 2])");
    if (g1->shape == std::vector<int64_t>{E, 2}) m.w13.halves = 2;
    m.w13.scale_2 = L.positive(L.need("w13_weight_scale_2", "F32", m.w13.halves == 2 ? std::vector<int64_t>{E, 2}
                                                                                       : std::vector<int64_t>{E}));
    m.w2.scale_2 = L.positive(L.need("w2_weight_scale_2", "F32", {E}));
  }
  // Biases: GPT-OSS names for mxfp4, w13_bias / w2_bias otherwise; reordered to logical rows.
  const std::vector<float> b13 = L.optional_floats(n.b13, {E, 2 * I}, "BF16|F32");
  if (!b13.empty()) {
    m.b13.resize(b13.size());
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < 2 * I; ++r)
        m.b13[size_t(e * 2 * I + r)] = b13[size_t(e * 2 * I + m.w13.physical_row(r))];
  }
  m.b2 = L.optional_floats(n.b2, {E, H}, "BF16|F32");
  m.score_bias = L.optional_floats("e_score_correction_bias", {E}, "F32");
  m.cfg.biases = !m.b13.empty() || !m.b2.empty();
  m.cfg.score_bias = !m.score_bias.empty();
  if (m.cfg.hash_vocab > 0) {
    MOEKIT_REQUIRE(m.score_bias.empty(), what, ": tensor e_score_correction_bias: a hash-routed layer takes its "
                   "experts from tid2eid and has no expert bias");
    const int64_t V = m.cfg.hash_vocab;
    const CheckpointTensor& h = L.need("tid2eid", "I32|I64", {V, int64_t(m.cfg.top_k)});
    m.hash_table = hash_table_from(h.data, h.dtype == "I64", V, m.cfg.top_k, int(E), what);
  } else {
    MOEKIT_REQUIRE(!L.find("tid2eid"), what, ": tensor tid2eid: the layer routes by score (hash_vocab = 0); "
                   "a hash-routed layer's description sets hash_vocab to the table's rows");
  }
  return m;
}

}  // namespace moekit
