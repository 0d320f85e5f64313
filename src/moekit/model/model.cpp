#include "moekit/model/model.h"

#include <cmath>

#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/formats/codes.h"

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

struct Loader {
  const SafetensorsFile& f;
  const std::string& path;

  const TensorView& need(const std::string& name, std::initializer_list<DType> dtypes,
                         const std::vector<int64_t>& shape) const {
    const TensorView* t = f.find(name);
    MOEKIT_REQUIRE(t, path, ": missing tensor ", name, " (expected ", shape_str(shape), ")");
    bool ok = false;
    std::string names;
    for (DType d : dtypes) {
      ok = ok || t->dtype == d;
      names += (names.empty() ? "" : " or ") + std::string(dtype_name(d));
    }
    MOEKIT_REQUIRE(ok, path, ": tensor ", name, ": dtype ", dtype_name(t->dtype), ", expected ",
                   names);
    MOEKIT_REQUIRE(t->shape == shape, path, ": tensor ", name, ": shape ", shape_str(t->shape),
                   ", expected ", shape_str(shape));
    return *t;
  }

  std::vector<float> optional_float(const std::string& name, const std::vector<int64_t>& shape) const {
    if (!f.has(name)) return {};
    return to_float(need(name, {DType::kF32, DType::kBF16}, shape), path);
  }

  void reject_nonfinite(const std::vector<float>& v, const std::string& name) const {
    for (size_t i = 0; i < v.size(); ++i)
      MOEKIT_REQUIRE(std::isfinite(v[i]), path, ": tensor ", name, ": non-finite value at ", i);
  }
};

}  // namespace

MoeModel MoeModel::load(const std::string& dir) {
  MoeModel m;
  m.dir = dir;
  m.cfg = load_config(dir + "/config.json");
  const std::string path = dir + "/experts.safetensors";
  m.file = SafetensorsFile::open(path);
  const Loader L{m.file, path};
  const int64_t E = m.cfg.num_experts, H = m.cfg.hidden, I = m.cfg.intermediate;
  const WeightFormat fmt = m.cfg.format;

  auto setup = [&](WeightMatrix& w, int64_t N, int64_t K) {
    w.format = fmt;
    w.E = E;
    w.N = N;
    w.K = K;
    w.code_row = format_code_bytes(fmt, K);
    w.scale_row = format_scale_bytes(fmt, K);
  };
  setup(m.w13, 2 * I, H);
  setup(m.w2, H, I);

  std::string b13_name, b2_name;
  switch (fmt) {
    case WeightFormat::kMxfp4: {
      const auto& gb = L.need("gate_up_proj_blocks", {DType::kU8}, {E, 2 * I, H / 32, 16});
      const auto& gs = L.need("gate_up_proj_scales", {DType::kU8}, {E, 2 * I, H / 32});
      const auto& db = L.need("down_proj_blocks", {DType::kU8}, {E, H, I / 32, 16});
      const auto& ds = L.need("down_proj_scales", {DType::kU8}, {E, H, I / 32});
      require_finite(gs, ElementCode::kE8M0, path);
      require_finite(ds, ElementCode::kE8M0, path);
      m.w13.codes = gb.data, m.w13.scales = gs.data, m.w13.interleaved = true;
      m.w2.codes = db.data, m.w2.scales = ds.data;
      b13_name = "gate_up_proj_bias";
      b2_name = "down_proj_bias";
      break;
    }
    case WeightFormat::kNvfp4: {
      const auto& w1 = L.need("w13_weight", {DType::kU8}, {E, 2 * I, H / 2});
      const auto& s1 = L.need("w13_weight_scale", {DType::kF8E4M3}, {E, 2 * I, H / 16});
      const auto& w2 = L.need("w2_weight", {DType::kU8}, {E, H, I / 2});
      const auto& s2 = L.need("w2_weight_scale", {DType::kF8E4M3}, {E, H, I / 16});
      require_finite(s1, ElementCode::kE4M3, path);
      require_finite(s2, ElementCode::kE4M3, path);
      m.w13.codes = w1.data, m.w13.scales = s1.data;
      m.w2.codes = w2.data, m.w2.scales = s2.data;
      const TensorView* g1 = m.file.find("w13_weight_scale_2");
      MOEKIT_REQUIRE(g1, path, ": missing tensor w13_weight_scale_2 (expected [", E, "] or [", E, ", 2])");
      if (g1->shape == std::vector<int64_t>{E, 2}) {
        m.w13.halves = 2;
      } else {
        L.need("w13_weight_scale_2", {DType::kF32}, {E});
      }
      MOEKIT_REQUIRE(g1->dtype == DType::kF32, path, ": tensor w13_weight_scale_2: dtype ",
                     dtype_name(g1->dtype), ", expected F32");
      m.w13.scale_2 = to_float(*g1, path);
      m.w2.scale_2 = to_float(L.need("w2_weight_scale_2", {DType::kF32}, {E}), path);
      require_positive(m.w13.scale_2, "w13_weight_scale_2", path);
      require_positive(m.w2.scale_2, "w2_weight_scale_2", path);
      b13_name = "w13_bias";
      b2_name = "w2_bias";
      break;
    }
    case WeightFormat::kMxfp8: {
      const auto& w1 = L.need("w13_weight", {DType::kF8E4M3}, {E, 2 * I, H});
      const auto& s1 = L.need("w13_weight_scale", {DType::kU8}, {E, 2 * I, H / 32});
      const auto& w2 = L.need("w2_weight", {DType::kF8E4M3}, {E, H, I});
      const auto& s2 = L.need("w2_weight_scale", {DType::kU8}, {E, H, I / 32});
      require_finite(w1, ElementCode::kE4M3, path);
      require_finite(w2, ElementCode::kE4M3, path);
      require_finite(s1, ElementCode::kE8M0, path);
      require_finite(s2, ElementCode::kE8M0, path);
      m.w13.codes = w1.data, m.w13.scales = s1.data;
      m.w2.codes = w2.data, m.w2.scales = s2.data;
      b13_name = "w13_bias";
      b2_name = "w2_bias";
      break;
    }
    case WeightFormat::kBf16: {
      const auto& w1 = L.need("w13_weight", {DType::kBF16}, {E, 2 * I, H});
      const auto& w2 = L.need("w2_weight", {DType::kBF16}, {E, H, I});
      require_finite(w1, ElementCode::kBF16, path);
      require_finite(w2, ElementCode::kBF16, path);
      m.w13.codes = w1.data;
      m.w2.codes = w2.data;
      b13_name = "w13_bias";
      b2_name = "w2_bias";
      break;
    }
  }
  // Biases: GPT-OSS names for mxfp4, w13_bias / w2_bias otherwise; reordered to logical rows.
  std::vector<float> b13 = L.optional_float(b13_name, {E, 2 * I});
  if (!b13.empty()) {
    L.reject_nonfinite(b13, b13_name);
    m.b13.resize(b13.size());
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < 2 * I; ++r)
        m.b13[size_t(e * 2 * I + r)] = b13[size_t(e * 2 * I + m.w13.physical_row(r))];
  }
  m.b2 = L.optional_float(b2_name, {E, H});
  L.reject_nonfinite(m.b2, b2_name);
  if (m.file.has("e_score_correction_bias")) {
    m.score_bias = to_float(L.need("e_score_correction_bias", {DType::kF32}, {E}), path);
    L.reject_nonfinite(m.score_bias, "e_score_correction_bias");
  }
  return m;
}

}  // namespace moekit
