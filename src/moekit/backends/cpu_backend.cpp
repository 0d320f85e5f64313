#include "moekit/backends/cpu_backend.h"

#include <algorithm>
#include <cstring>

#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/common/thread_pool.h"
#include "moekit/experts/experts_cpu.h"
#include "moekit/formats/synthetic_bytes.h"
#include "moekit/oracle/layer_checks.h"
#include "moekit/pipeline/modular.h"
#include "moekit/routing/routing.h"

namespace moekit {

namespace {

// The packed buffers, in order; which exist depends on the description.
struct CpuPacked {
  int64_t code13 = 0, scale13 = 0, code2 = 0, scale2 = 0;  // bytes
  int64_t hash_table = 0;                                   // int32 [hash_vocab, top_k]
  bool nv = false, bias = false, score_bias = false;

  explicit CpuPacked(const MoeConfig& c) {
    const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
    code13 = E * 2 * I * format_code_bytes(c.format, H);
    scale13 = E * 2 * I * format_scale_bytes(c.format, H);
    code2 = E * H * format_code_bytes(c.format, I);
    scale2 = E * H * format_scale_bytes(c.format, I);
    nv = c.format == WeightFormat::kNvfp4;
    bias = c.biases;
    score_bias = c.score_bias;
    hash_table = c.hash_vocab * c.top_k * 4;
  }
  std::vector<BufferDesc> list(const MoeConfig& c) const {
    const int64_t E = c.num_experts;
    std::vector<BufferDesc> v = {{"w13.codes", code13, 64}};
    if (scale13) v.push_back({"w13.scales", scale13, 64});
    if (nv) v.push_back({"w13.scale_2", E * 2 * 4, 64});
    v.push_back({"w2.codes", code2, 64});
    if (scale2) v.push_back({"w2.scales", scale2, 64});
    if (nv) v.push_back({"w2.scale_2", E * 4, 64});
    if (bias) {
      v.push_back({"w13.bias", E * 2 * c.intermediate * 4, 64});
      v.push_back({"w2.bias", E * int64_t(c.hidden) * 4, 64});
    }
    if (score_bias) v.push_back({"score_bias", E * 4, 64});
    if (hash_table) v.push_back({"hash_table", hash_table, 64});
    return v;
  }
};

// Named access to the packed buffers.
struct Slots {
  std::vector<BufferDesc> desc;
  const std::vector<PackedBuffer>& p;
  uint8_t* get(const char* name) const {
    for (size_t i = 0; i < desc.size(); ++i)
      if (desc[i].name == name) return static_cast<uint8_t*>(p[i].data);
    return nullptr;
  }
};

// A layer's weights as views of the packed buffers.
LayerWeights view_packed(const MoeConfig& c, const std::vector<PackedBuffer>& packed) {
  const CpuPacked cp(c);
  const Slots s{cp.list(c), packed};
  MOEKIT_REQUIRE(packed.size() == s.desc.size(), "cpu layer: ", packed.size(), " packed buffers, expected ",
                 s.desc.size());
  LayerWeights m;
  m.cfg = c;
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  auto matrix = [&](WeightMatrix& w, int64_t N, int64_t K, const char* codes, const char* scales) {
    w.format = c.format;
    w.E = E;
    w.N = N;
    w.K = K;
    w.code_row = format_code_bytes(c.format, K);
    w.scale_row = format_scale_bytes(c.format, K);
    w.codes = s.get(codes);
    w.scales = s.get(scales);
  };
  matrix(m.w13, 2 * I, H, "w13.codes", "w13.scales");
  matrix(m.w2, H, I, "w2.codes", "w2.scales");
  if (cp.nv) {
    const float* g13 = reinterpret_cast<const float*>(s.get("w13.scale_2"));
    const float* g2 = reinterpret_cast<const float*>(s.get("w2.scale_2"));
    m.w13.halves = 2;
    m.w13.scale_2.assign(g13, g13 + 2 * E);
    m.w2.scale_2.assign(g2, g2 + E);
  }
  if (cp.bias) {
    const float* b13 = reinterpret_cast<const float*>(s.get("w13.bias"));
    const float* b2 = reinterpret_cast<const float*>(s.get("w2.bias"));
    m.b13.assign(b13, b13 + E * 2 * I);
    m.b2.assign(b2, b2 + E * H);
  }
  if (cp.score_bias) {
    const float* sb = reinterpret_cast<const float*>(s.get("score_bias"));
    m.score_bias.assign(sb, sb + E);
  }
  if (cp.hash_table) {
    const int32_t* h = reinterpret_cast<const int32_t*>(s.get("hash_table"));
    m.hash_table.assign(h, h + cp.hash_table / 4);
  }
  return m;
}

void pack_cpu(const LayerWeights& m, const std::vector<PackedBuffer>& packed) {
  const MoeConfig& c = m.cfg;
  const CpuPacked cp(c);
  const Slots s{cp.list(c), packed};
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  // Row by row in logical order, experts spread over the pool (two cores copy faster than one).
  auto rows = [&](const WeightMatrix& w, const char* codes, const char* scales) {
    uint8_t* dc = s.get(codes);
    uint8_t* ds = s.get(scales);
    ThreadPool::global().parallel_for(w.E, [&](int64_t e) {
      for (int64_t r = 0; r < w.N; ++r) {
        std::memcpy(dc + (e * w.N + r) * w.code_row, w.row_codes(e, r), size_t(w.code_row));
        if (ds) std::memcpy(ds + (e * w.N + r) * w.scale_row, w.row_scales(e, r), size_t(w.scale_row));
      }
    });
  };
  rows(m.w13, "w13.codes", "w13.scales");
  rows(m.w2, "w2.codes", "w2.scales");
  if (cp.nv) {
    float* g13 = reinterpret_cast<float*>(s.get("w13.scale_2"));
    float* g2 = reinterpret_cast<float*>(s.get("w2.scale_2"));
    for (int64_t e = 0; e < E; ++e) {
      g13[2 * e] = m.w13.row_scale_2(e, 0);
      g13[2 * e + 1] = m.w13.row_scale_2(e, I);
      g2[e] = m.w2.row_scale_2(e, 0);
    }
  }
  if (cp.bias) {
    float* b13 = reinterpret_cast<float*>(s.get("w13.bias"));
    float* b2 = reinterpret_cast<float*>(s.get("w2.bias"));
    for (int64_t i = 0; i < E * 2 * I; ++i) b13[i] = m.b13.empty() ? 0.0f : m.b13[size_t(i)];
    for (int64_t i = 0; i < E * H; ++i) b2[i] = m.b2.empty() ? 0.0f : m.b2[size_t(i)];
  }
  if (cp.score_bias) std::memcpy(s.get("score_bias"), m.score_bias.data(), size_t(E) * 4);
  if (cp.hash_table) std::memcpy(s.get("hash_table"), m.hash_table.data(), size_t(cp.hash_table));
}

void synthesize_cpu(const MoeConfig& c, const std::vector<PackedBuffer>& packed, uint64_t seed) {
  const CpuPacked cp(c);
  const Slots s{cp.list(c), packed};
  for (size_t i = 0; i < s.desc.size(); ++i) {
    const std::string& n = s.desc[i].name;
    uint8_t* p = static_cast<uint8_t*>(packed[i].data);
    const int64_t bytes = s.desc[i].bytes;
    if (n.ends_with(".codes") || n.ends_with(".scales")) {
      const SyntheticKind kind = n.ends_with(".codes") ? synthetic_code_kind(c.format) : synthetic_scale_kind(c.format);
      const uint64_t sd = seed + (n.starts_with("w2") ? 7 : 0) + (n.ends_with(".scales") ? 1 : 0);
      for (int64_t b = 0; b < bytes; ++b) p[b] = synthetic_byte(b, sd, kind);
    } else if (n.ends_with(".scale_2")) {
      std::fill_n(reinterpret_cast<float*>(p), bytes / 4, kSyntheticScale2);
    } else if (n == "hash_table") {
      int32_t* h = reinterpret_cast<int32_t*>(p);
      for (int64_t i = 0; i < bytes / 4; ++i) h[i] = synthetic_hash_entry(i, c.top_k, c.num_experts, seed);
    } else {
      std::memset(p, 0, size_t(bytes));  // biases, score bias
    }
  }
}

constexpr int64_t kWsAlign = 256;
int64_t align_up(int64_t x) { return (x + kWsAlign - 1) / kWsAlign * kWsAlign; }

template <class L, class PF>
class CpuLayer final : public LayerImpl {
 public:
  CpuLayer(const MoeConfig& c, const std::vector<PackedBuffer>& packed, PF pf)
      : m_(view_packed(c, packed)), pf_(std::move(pf)), experts_(m_) {}

  int64_t workspace_bytes(ForwardCall::Entry e, int64_t T, int k) const override {
    // ids and weights of the routing result, after a header of kWsAlign bytes that no call
    // reads (every call takes a workspace, so its size is checked the same way everywhere); the
    // rest of the scratch is host memory of the pipeline.
    return kWsAlign + (e == ForwardCall::kLogits ? 2 * align_up(T * k * 4) : 0);
  }

  void forward(const ForwardCall& c) override {
    const MoeConfig& cfg = m_.cfg;
    const int64_t T = c.T, H = cfg.hidden;
    if (c.entry == ForwardCall::kBatched) return batched(c);
    if (c.entry == ForwardCall::kTopk) validate_topk(c.ids, c.weights, T, c.k, cfg.num_experts);
    if (T == 0) return;
    if (c.entry == ForwardCall::kLogits)
      route_cpu(routing_params(cfg, m_.score_bias, m_.hash_table), c.logits, T, c.ids, c.weights,
                TokenIds{c.token_ids, c.token_ids_wide});
    std::vector<uint16_t> xd;
    const uint16_t* x = c.x;
    if (c.x_stride != H) {  // dense rows for prepare
      xd.resize(size_t(T * H));
      for (int64_t t = 0; t < T; ++t) std::memcpy(xd.data() + t * H, c.x + t * c.x_stride, size_t(H) * 2);
      x = xd.data();
    }
    ModularPipeline<L>(pf_, experts_)
        .run(x, T, H, c.ids, c.weights, c.k, cfg.num_experts, FinalOut{c.y, c.y_stride, c.shared, c.shared_stride});
  }

 private:
  // The experts alone on [E, M, H] rows with per-expert counts.
  void batched(const ForwardCall& c) {
    const int E = m_.cfg.num_experts;
    const int64_t M = c.T, H = m_.cfg.hidden;
    for (int e = 0; e < E; ++e)
      MOEKIT_REQUIRE(c.counts[e] >= 0 && c.counts[e] <= M, "expert_num_tokens[", e, "] = ", c.counts[e],
                     " is outside [0, ", M, "]");
    Activations<BatchedLayout> a;
    a.layout.max_tokens = int(M);
    a.layout.counts.assign(c.counts, c.counts + E);
    a.width = H;
    a.data.assign(size_t(E * M * H), 0x7fc0);  // rows past the counts: NaN, never read
    for (int e = 0; e < E; ++e)
      for (int64_t r = 0; r < c.counts[e]; ++r)
        std::memcpy(a.data.data() + (e * M + r) * H, c.x + e * c.x_expert_stride + r * c.x_stride, size_t(H) * 2);
    ExpertOutput<BatchedLayout> o;
    CpuExperts<BatchedLayout>(m_).apply(a, &o);
    for (int e = 0; e < E; ++e)
      for (int64_t r = 0; r < c.counts[e]; ++r) {
        uint16_t* y = c.y + e * c.y_expert_stride + r * c.y_stride;
        const float* v = o.data.data() + (e * M + r) * H;
        for (int64_t h = 0; h < H; ++h) y[h] = float_to_bf16(v[h]);
      }
  }

  LayerWeights m_;
  PF pf_;
  CpuExperts<L> experts_;
};

const std::vector<WeightFormat> kAllFormats = {WeightFormat::kMxfp4, WeightFormat::kNvfp4,
                                               WeightFormat::kMxfp8, WeightFormat::kBf16, WeightFormat::kFp8};
const std::vector<Activation> kAllActivations = {Activation::kSilu, Activation::kSwigluOai,
                                                 Activation::kSiluClamped};

// The two CPU backends differ in their activation format only.
template <class L, class PF>
class CpuBackendOf final : public Backend {
 public:
  CpuBackendOf(BackendCaps caps, PF pf) : caps_(std::move(caps)), pf_(std::move(pf)) {
    // CpuExperts rounds both GEMMs' inputs by formats/fp8_act.h when the layer asks for fp8.
    caps_.activation_dtypes = {ActivationDtype::kBf16, ActivationDtype::kFp8};
  }
  const BackendCaps& caps() const override { return caps_; }
  std::vector<BufferDesc> packed_buffers(const MoeConfig& c) const override { return CpuPacked(c).list(c); }
  void pack(const LayerWeights& m, const std::vector<PackedBuffer>& packed, void*) const override {
    pack_cpu(m, packed);
  }
  void synthesize(const MoeConfig& c, const std::vector<PackedBuffer>& packed, uint64_t seed, void*) const override {
    synthesize_cpu(c, packed, seed);
  }
  std::unique_ptr<LayerImpl> create(const MoeConfig& c, const std::vector<PackedBuffer>& packed, int) const override {
    return std::make_unique<CpuLayer<L, PF>>(c, packed, pf_);
  }

 private:
  BackendCaps caps_;
  PF pf_;
};

}  // namespace

const Backend& cpu_backend() {
  static const CpuBackendOf<StandardLayout, StandardPrepareFinalize> b(
      {"cpu", "CPU reference, multithreaded, on-the-fly dequantization", ActivationFormat::kStandard,
       kAllFormats, kAllActivations, false, 10},
      StandardPrepareFinalize(1));
  return b;
}
const Backend& cpu_batched_backend() {
  static const CpuBackendOf<BatchedLayout, BatchedPrepareFinalize> b(
      {"cpu_batched", "CPU reference on the batched (masked) format", ActivationFormat::kBatched, kAllFormats,
       kAllActivations, false, 9},
      BatchedPrepareFinalize());
  return b;
}

}  // namespace moekit
