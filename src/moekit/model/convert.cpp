#include "moekit/model/convert.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "moekit/common/bf16.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/common/thread_pool.h"
#include "moekit/formats/quantize.h"
#include "moekit/io/files.h"
#include "moekit/io/safetensors.h"
#include "moekit/model/config.h"
#include "moekit/oracle/layer_checks.h"

namespace moekit {

namespace {

// One stacked [E, N, K] matrix of the target format, logical row order.
struct Target {
  WeightMatrix w;
  std::vector<uint8_t>* codes = nullptr;
  std::vector<uint8_t>* scales = nullptr;
};

// Expert e of `src` into `dst` (format dst.w.format); adds the squared error and the squared
// norm of the exact values. `parts`: rows quantized as separate tensors (nvfp4 tensor scales:
// gate and up of w13 each get their own).
void convert_expert(const WeightMatrix& src, Target& dst, int64_t e, ScaleRule rule, int parts, double* err2,
                    double* ref2) {
  const int64_t N = src.N, K = src.K;
  WeightMatrix& w = dst.w;
  const WeightFormat to = w.format;
  uint8_t* codes = dst.codes->data() + e * N * w.code_row;
  uint8_t* scales = w.scale_row > 0 ? dst.scales->data() + e * N * w.scale_row : nullptr;
  if (src.format == to) {  // the bytes themselves
    for (int64_t r = 0; r < N; ++r) {
      std::memcpy(codes + r * w.code_row, src.row_codes(e, r), size_t(w.code_row));
      if (scales) std::memcpy(scales + r * w.scale_row, src.row_scales(e, r), size_t(w.scale_row));
    }
    for (int h = 0; h < w.halves; ++h) {
      if (!w.scale_2.empty()) w.scale_2[size_t(e * w.halves + h)] = src.row_scale_2(e, h * (N / w.halves));
    }
    return;
  }
  std::vector<float> x(size_t(N * K)), q(size_t(N * K));
  for (int64_t r = 0; r < N; ++r) src.dequant_row(e, r, x.data() + r * K);
  if (to == WeightFormat::kBf16) {
    for (int64_t i = 0; i < N * K; ++i) {
      const uint16_t b = float_to_bf16(x[size_t(i)]);
      MOEKIT_REQUIRE((b & 0x7f80) != 0x7f80, "expert ", e, ", row ", i / K, ", column ", i % K, ": ", x[size_t(i)],
                     " overflows bf16");
      std::memcpy(codes + 2 * i, &b, 2);
      q[size_t(i)] = bf16_to_float(b);
    }
  } else {
    const int64_t rows = N / parts;
    for (int p = 0; p < parts; ++p) {
      const float* xp = x.data() + p * rows * K;
      const QuantizedTensor t = quantize_tensor(xp, rows, K, to, rule, "expert " + std::to_string(e));
      std::memcpy(codes + p * rows * w.code_row, t.codes.data(), t.codes.size());
      std::memcpy(scales + p * rows * w.scale_row, t.scales.data(), t.scales.size());
      if (to == WeightFormat::kNvfp4) w.scale_2[size_t(e * w.halves + (w.halves == 2 ? p : 0))] = t.scale_2;
      dequantize_tensor(to, t.codes.data(), t.scales.data(), t.scale_2, rows, K, q.data() + p * rows * K);
    }
  }
  double a = 0, b = 0;
  for (int64_t i = 0; i < N * K; ++i) {
    const double d = double(q[size_t(i)]) - double(x[size_t(i)]);
    a += d * d;
    b += double(x[size_t(i)]) * double(x[size_t(i)]);
  }
  *err2 += a;
  *ref2 += b;
}

double rel(double err2, double ref2) { return ref2 > 0 ? std::sqrt(err2 / ref2) : (err2 > 0 ? INFINITY : 0.0); }

// w's bytes (codes, scales) copied into `storage` as one stacked matrix in logical row order (no
// parts, no interleave): a copy that outlives the checkpoint w viewed.
WeightMatrix owned_matrix(const WeightMatrix& w, std::vector<std::vector<uint8_t>>& storage) {
  WeightMatrix o = w;
  o.parts = 1;
  o.part_codes.clear();
  o.part_scales.clear();
  o.interleaved = false;
  std::vector<uint8_t>& c = storage.emplace_back(size_t(w.E * w.N * w.code_row));
  for (int64_t e = 0; e < w.E; ++e)
    for (int64_t r = 0; r < w.N; ++r)
      std::memcpy(c.data() + (e * w.N + r) * w.code_row, w.row_codes(e, r), size_t(w.code_row));
  o.codes = c.data();
  o.scales = nullptr;
  if (w.scale_row > 0) {
    const int64_t g = w.scale_row_group, groups = (w.N + g - 1) / g;
    std::vector<uint8_t>& sc = storage.emplace_back(size_t(w.E * groups * w.scale_row));
    for (int64_t e = 0; e < w.E; ++e)
      for (int64_t i = 0; i < groups; ++i)
        std::memcpy(sc.data() + (e * groups + i) * w.scale_row, w.row_scales(e, i * g), size_t(w.scale_row));
    o.scales = sc.data();
  }
  return o;
}

}  // namespace

LayerWeights owned_copy(const LayerWeights& w, std::vector<std::vector<uint8_t>>& storage) {
  LayerWeights o = w;
  o.w13 = owned_matrix(w.w13, storage);
  o.w2 = owned_matrix(w.w2, storage);
  return o;
}

std::string ConvertReport::describe() const {
  char buf[256];
  if (copied) {
    std::snprintf(buf, sizeof buf, "%s: the checkpoint's bytes, unchanged", format_name(to));
  } else {
    std::snprintf(buf, sizeof buf, "%s -> %s: rel. L2 error of the weights %.3e (w13 %.3e, w2 %.3e)%s", format_name(from),
                  format_name(to), err, err_w13, err_w2, err == 0 ? ", exact" : "");
  }
  return buf;
}

MoeModel convert_layer(const MoeModel& src, WeightFormat to, ScaleRule rule, ConvertReport* report,
                       const Progress& progress) {
  const MoeConfig& c = src.cfg;
  MoeConfig cfg = c;
  cfg.format = to;
  cfg.scale_rule = to == src.cfg.format ? c.scale_rule : rule;
  validate_spec(cfg, std::string("convert to ") + format_name(to));
  MOEKIT_REQUIRE(to != WeightFormat::kFp8 || c.format == WeightFormat::kFp8,
                 "convert: fp8 is a checkpoint format (DeepSeek-style block scales); moekit does not quantize to it");
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  require_host_memory(std::string("layer converted to ") + format_name(to),
                      sat_add(sat_mul({E, 3 * I, H, 2}), sat_mul({E, 3 * I, format_code_bytes(to, H) + format_scale_bytes(to, H)})));
  MoeModel m;
  m.dir = src.dir;
  m.cfg = cfg;
  m.layer = src.layer;
  m.source = src.source;
  m.notes = src.notes;
  m.router = src.router;
  m.b13 = src.b13;
  m.b2 = src.b2;
  m.score_bias = src.score_bias;
  m.hash_table = src.hash_table;
  m.storage.reserve(8);
  // The shared expert keeps its format; its bytes are copied (src may be a checkpoint's views).
  if (src.has_shared_expert()) m.shared_expert = owned_copy(src.shared_expert, m.storage);
  auto target = [&](const WeightMatrix& s, WeightMatrix& w, int halves) {
    Target t;
    w.format = to;
    w.E = E;
    w.N = s.N;
    w.K = s.K;
    w.code_row = format_code_bytes(to, s.K);
    w.scale_row = format_scale_bytes(to, s.K);
    t.codes = &m.storage.emplace_back(size_t(E * s.N * w.code_row));
    w.codes = t.codes->data();
    if (w.scale_row > 0) {
      t.scales = &m.storage.emplace_back(size_t(E * s.N * w.scale_row));
      w.scales = t.scales->data();
    }
    if (to == WeightFormat::kNvfp4) {
      w.halves = to == s.format ? s.halves : halves;
      w.scale_2.assign(size_t(E * w.halves), 1.0f);
    }
    t.w = w;
    return t;
  };
  Target t13 = target(src.w13, m.w13, 2), t2 = target(src.w2, m.w2, 1);
  std::vector<double> e13(size_t(E), 0.0), r13(size_t(E), 0.0), e2(size_t(E), 0.0), r2(size_t(E), 0.0);
  std::vector<std::string> errors(static_cast<size_t>(E));
  ThreadPool& pool = ThreadPool::global();
  const int64_t chunk = std::max<int64_t>(1, pool.size());
  for (int64_t e0 = 0; e0 < E; e0 += chunk) {
    const int64_t n = std::min(chunk, E - e0);
    pool.parallel_for(n, [&](int64_t i) {
      const int64_t e = e0 + i;
      try {
        convert_expert(src.w13, t13, e, rule, to == WeightFormat::kNvfp4 ? 2 : 1, &e13[size_t(e)], &r13[size_t(e)]);
        convert_expert(src.w2, t2, e, rule, 1, &e2[size_t(e)], &r2[size_t(e)]);
      } catch (const Error& x) {
        errors[size_t(e)] = x.what();
      }
    });
    for (int64_t e = e0; e < e0 + n; ++e)
      MOEKIT_REQUIRE(errors[size_t(e)].empty(), "convert to ", format_name(to), ": ", errors[size_t(e)]);
    if (progress) progress(e0 + n, E);
  }
  // Tensor scales were written into the targets' copies.
  m.w13.scale_2 = t13.w.scale_2;
  m.w2.scale_2 = t2.w.scale_2;
  // Sums in expert order: the same figures every run.
  double a13 = 0, b13 = 0, a2 = 0, b2 = 0;
  for (int64_t e = 0; e < E; ++e) a13 += e13[size_t(e)], b13 += r13[size_t(e)], a2 += e2[size_t(e)], b2 += r2[size_t(e)];
  ConvertReport rep;
  rep.from = c.format;
  rep.to = to;
  rep.copied = c.format == to;
  rep.err_w13 = rel(a13, b13);
  rep.err_w2 = rel(a2, b2);
  rep.err = rel(a13 + a2, b13 + b2);
  if (report) *report = rep;
  return m;
}

namespace {

void write_weights_dir(const LayerWeights& m, const RouterWeights* router, const std::string& dir,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
  const MoeConfig& c = m.cfg;
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MOEKIT_REQUIRE(!ec, dir, ": cannot create the directory (", ec.message(), ")");
  SafetensorsWriter sw;
  for (const auto& [k, v] : metadata) sw.set_metadata(k, v);
  const bool ilv = c.format == WeightFormat::kMxfp4;  // SPEC: GPT-OSS's interleaved gate/up rows
  auto logical = [](bool interleave, int64_t p, int64_t N) { return interleave ? (p % 2 == 0 ? p / 2 : N / 2 + p / 2) : p; };
  // Rows of a stacked [E, N, ...] tensor, physical row order of the layer directory.
  auto rows = [&](const WeightMatrix& w, bool scales, bool interleave) {
    const int64_t rb = scales ? w.scale_row : w.code_row;
    return [&w, scales, interleave, rb, logical](uint64_t off, uint8_t* dst, size_t n) {
      while (n > 0) {
        const int64_t i = int64_t(off / uint64_t(rb)), in = int64_t(off % uint64_t(rb));
        const int64_t e = i / w.N, r = logical(interleave, i % w.N, w.N);
        const uint8_t* src = scales ? w.row_scales(e, r) : w.row_codes(e, r);
        const size_t take = std::min<size_t>(n, size_t(rb - in));
        std::memcpy(dst, src + in, take);
        dst += take;
        off += take;
        n -= take;
      }
    };
  };
  auto floats = [](std::vector<float> v) {
    auto p = std::make_shared<std::vector<float>>(std::move(v));
    return [p](uint64_t off, uint8_t* dst, size_t n) { std::memcpy(dst, reinterpret_cast<const uint8_t*>(p->data()) + off, n); };
  };
  for (const CheckpointSlot& s : checkpoint_slots(c)) {
    DType d = DType::kF32;
    if (s.dtype.find('|') == std::string::npos) MOEKIT_REQUIRE(parse_dtype(s.dtype, &d), "internal: dtype ", s.dtype);
    const bool w13 = s.name.starts_with("w13") || s.name.starts_with("gate_up");
    const WeightMatrix& w = w13 ? m.w13 : m.w2;
    if (s.name.ends_with("_scale_2")) {
      std::vector<float> g(size_t(E * w.halves));
      for (int64_t e = 0; e < E; ++e)
        for (int h = 0; h < w.halves; ++h) g[size_t(e * w.halves + h)] = w.row_scale_2(e, h * (w.N / w.halves));
      sw.add_generated(s.name, DType::kF32, w.halves == 2 ? std::vector<int64_t>{E, 2} : std::vector<int64_t>{E},
                       floats(std::move(g)));
    } else if (s.name.ends_with("bias") && s.name != "e_score_correction_bias") {
      const std::vector<float>& b = w13 ? m.b13 : m.b2;
      if (b.empty()) continue;
      std::vector<float> phys(b.size());
      const int64_t N = w13 ? 2 * I : H;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t p = 0; p < N; ++p) phys[size_t(e * N + p)] = b[size_t(e * N + logical(w13 && ilv, p, N))];
      sw.add_generated(s.name, DType::kF32, s.shape, floats(std::move(phys)));
    } else if (s.name == "e_score_correction_bias") {
      if (m.score_bias.empty()) continue;
      sw.add_generated(s.name, DType::kF32, s.shape, floats(m.score_bias));
    } else if (s.name == "tid2eid") {
      auto t = std::make_shared<std::vector<int32_t>>(m.hash_table);
      sw.add_generated(s.name, DType::kI32, s.shape, [t](uint64_t off, uint8_t* dst, size_t n) {
        std::memcpy(dst, reinterpret_cast<const uint8_t*>(t->data()) + off, n);
      });
    } else {
      const bool scales = s.name.ends_with("_scale") || s.name.ends_with("_scales");
      sw.add_generated(s.name, d, s.shape, rows(w, scales, w13 && ilv));
    }
  }
  if (router && !router->empty()) {
    sw.add_generated("router_weight", DType::kF32, {E, H}, floats(router->weight));
    if (!router->bias.empty()) sw.add_generated("router_bias", DType::kF32, {E}, floats(router->bias));
  }
  sw.write(dir + "/experts.safetensors");
  write_file_atomic(dir + "/config.json", config_json(c) + "\n");
}

}  // namespace

void write_layer_dir(const MoeModel& m, const std::string& dir,
                     const std::vector<std::pair<std::string, std::string>>& metadata) {
  write_weights_dir(m, &m.router, dir, metadata);
  // The shared expert beside it, as a layer directory of one expert (MoeModel::load reads it back).
  if (m.has_shared_expert()) write_weights_dir(m.shared_expert, nullptr, dir + "/shared_expert", metadata);
}

}  // namespace moekit
