#include "moekit/api/host_runner.h"

#include <algorithm>

#include "moekit/api/pack_layer.h"
#include "moekit/common/error.h"
#include "moekit/moekit.hpp"
#include "moekit/oracle/layer_checks.h"
#include "moekit/oracle/oracle.h"

namespace moekit {

namespace {

void ok(const Status& s) {
  if (!s.ok()) fail(s.message);
}

}  // namespace

HostCheckpoint::HostCheckpoint(const LayerWeights& m) : bytes(checkpoint_of(m, false)) {
  for (const CheckpointTensor& t : bytes.tensors) {
    DLTensor d{};
    d.data = const_cast<uint8_t*>(t.data);
    d.device = {kDLCPU, 0};
    d.ndim = int(t.shape.size());
    d.dtype = t.dtype == "F32" ? kF32 : t.dtype == "BF16" ? kBF16 : t.dtype == "I32" ? kI32 : kU8;
    d.shape = const_cast<int64_t*>(t.shape.data());
    tensors.push_back({t.name, d});
  }
}

struct HostRunner::Impl {
  explicit Impl(const LayerWeights& weights) : m(weights) {}
  const LayerWeights& m;
  Options opt;
  std::string backend;
  int64_t max_tokens = 0;
  OwnedLayer layer;
  Buffer x, logits, ids, weights, y, shared, ws, token_ids;
};

HostRunner::HostRunner(const LayerWeights& m, const std::string& backend) : impl_(new Impl(m)) {
  // The device: the GPU when the oracle's (or the requested) backend needs one.
  const DeviceInfo gpu = DeviceInfo::detect(0);
  LayerSpec spec = m.cfg;
  spec.max_tokens = 1;
  impl_->opt.backend = backend;
  impl_->opt.device = {kDLCPU, 0};
  std::string requested = backend;
  if (requested.empty())
    if (const char* env = std::getenv("MOEKIT_BACKEND"); env && *env) requested = env;
  const Backend* b = requested.empty() ? nullptr : find_backend(requested);
  if (gpu.gpu && (requested.empty() || (b && b->caps().needs_sm90))) {
    impl_->opt.device = {kDLCUDA, 0};
    LayerPlan probe;
    // No GPU backend for this layer (or the device is not SM90): the CPU, unless one was asked for.
    if (!plan_layer(spec, impl_->opt, &probe).ok() && requested.empty()) impl_->opt.device = {kDLCPU, 0};
  }
  LayerPlan plan;
  ok(plan_layer(spec, impl_->opt, &plan));
  impl_->backend = plan.backend;
}

HostRunner::~HostRunner() = default;

const std::string& HostRunner::backend() const { return impl_->backend; }

std::string HostRunner::explain(int64_t tokens) const {
  std::string text;
  LayerSpec spec = impl_->m.cfg;
  spec.max_tokens = std::max<int64_t>(tokens, 1);
  ok(moekit::explain(spec, impl_->opt, tokens, &text));
  return text;
}

void HostRunner::prepare(int64_t tokens, int k) {
  Impl& I = *impl_;
  const LayerSpec& c = I.m.cfg;
  const int64_t H = c.hidden, E = c.num_experts;
  // Enough tokens for T x k routed rows.
  const int64_t need = std::max<int64_t>({tokens, (tokens * k + c.top_k - 1) / c.top_k, 1});
  if (I.layer.layer && need <= I.max_tokens) return;
  const DLDevice dev = I.opt.device;
  LayerSpec spec = c;
  spec.max_tokens = need;
  Options o = I.opt;
  o.backend = I.backend;
  I.layer = OwnedLayer();
  // The views straight into the backend's packed buffers (api/pack_layer.h).
  ok(api::make_layer_from_weights(spec, o, I.m, &I.layer));
  I.max_tokens = need;
  auto alloc = [&](Buffer& b, int64_t bytes) { ok(Buffer::allocate(dev, bytes, &b)); };
  alloc(I.x, need * H * 2);
  alloc(I.y, need * H * 2);
  alloc(I.shared, need * H * 2);
  alloc(I.logits, need * E * 4);
  alloc(I.ids, need * c.top_k * 4);
  alloc(I.weights, need * c.top_k * 4);
  if (c.hash_vocab > 0) alloc(I.token_ids, need * 8);
  alloc(I.ws, I.layer.layer->workspace_bytes(need, c.top_k));
}

void HostRunner::run(const LayerInput& in, LayerOutput* out) {
  Impl& I = *impl_;
  const LayerSpec& c = I.m.cfg;
  const int64_t T = in.tokens, H = c.hidden, E = c.num_experts;
  const int k = in.bypass ? in.k : c.top_k;
  const DLDevice dev = I.opt.device;
  validate_layer_input(c, in);
  out->y.assign(size_t(T * H), 0);
  if (T == 0) {  // nothing to route; empty outputs
    out->ids.clear();
    out->weights.clear();
    return;
  }
  prepare(T, k);
  Layer& L = *I.layer.layer;
  ok(I.x.copy_from_host(in.x, T * H * 2));
  {  // y poisoned (bf16 NaN) before every call: a row the layer leaves unwritten shows as NaN
    const std::vector<uint16_t> nan(size_t(T * H), 0x7fc0);
    ok(I.y.copy_from_host(nan.data(), T * H * 2));
  }
  const TensorRef x(I.x.data(), kBF16, {T, H}, dev), y(I.y.data(), kBF16, {T, H}, dev);
  const TensorRef ids(I.ids.data(), kI32, {T, k}, dev), w(I.weights.data(), kF32, {T, k}, dev);
  const TensorRef ws = I.ws.tensor(), sh(I.shared.data(), kBF16, {T, H}, dev);
  if (in.shared) ok(I.shared.copy_from_host(in.shared, T * H * 2));
  const DLTensor* shared = in.shared ? &sh.dl() : nullptr;
  if (in.bypass) {
    ok(I.ids.copy_from_host(in.ids, T * k * 4));
    ok(I.weights.copy_from_host(in.weights, T * k * 4));
    ok(L.forward_topk(x, ids, w, y, ws, nullptr, shared));
  } else {
    ok(I.logits.copy_from_host(in.logits, T * E * 4));
    const TensorRef lg(I.logits.data(), kF32, {T, E}, dev);
    const TensorRef tok(I.token_ids.data(), kI64, {T}, dev);
    if (c.hash_vocab > 0) ok(I.token_ids.copy_from_host(in.token_ids, T * 8));
    ok(L.forward_logits(x, lg, y, ws, nullptr, shared, &ids.dl(), &w.dl(), c.hash_vocab > 0 ? &tok.dl() : nullptr));
  }
  ok(L.check(nullptr));
  out->ids.resize(size_t(T * k));
  out->weights.resize(size_t(T * k));
  ok(I.y.copy_to_host(out->y.data(), T * H * 2));
  ok(I.ids.copy_to_host(out->ids.data(), T * k * 4));
  ok(I.weights.copy_to_host(out->weights.data(), T * k * 4));
  if (in.check_values) check_layer_output(*out, T, H);
}

std::vector<uint16_t> run_shared_expert(HostRunner& runner, const uint16_t* x, int64_t T) {
  LayerInput in;
  in.tokens = T;
  in.x = x;
  in.bypass = true;
  in.k = 1;
  const std::vector<int32_t> ids(size_t(T), 0);
  const std::vector<float> w(size_t(T), 1.0f);
  in.ids = ids.data();
  in.weights = w.data();
  LayerOutput out;
  runner.run(in, &out);
  return std::move(out.y);
}

}  // namespace moekit
