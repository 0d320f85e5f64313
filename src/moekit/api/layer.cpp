// The public API (include/moekit/moekit.hpp) over the oracle and the backends: checks every
// caller tensor before anything is written, turns exceptions into Status values, and hands the
// backends raw pointers (oracle/backend.h ForwardCall).
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <new>
#include <sstream>

#include "moekit/api/checks.h"
#include "moekit/api/device.h"
#include "moekit/api/pack_layer.h"
#include "moekit/common/error.h"
#include "moekit/experts/weights.h"
#include "moekit/formats/fp8_act.h"
#include "moekit/moekit.hpp"
#include "moekit/oracle/layer_checks.h"
#include "moekit/oracle/oracle.h"

namespace moekit {

using api::Checked;
using api::Kind;
using api::Want;
using api::bytes_of;
using api::check_tensor;
using api::device_name;
using api::dtype_name;
using api::guarded;
using api::host_checkpoint;
using api::shape_str;

namespace {

std::vector<PackedBuffer> packed_views(const LayerPlan& plan, std::span<const DLTensor> packed) {
  MOEKIT_REQUIRE(packed.size() == plan.buffers.size(), "packed: ", packed.size(), " buffers, the plan has ",
                 plan.buffers.size());
  std::vector<PackedBuffer> v;
  for (size_t i = 0; i < packed.size(); ++i) {
    const BufferDesc& b = plan.buffers[i];
    const std::string name = "packed buffer " + b.name;
    const Checked c = check_tensor(packed[i], name.c_str(), Kind::kBytes, Want::any(), plan.device, false);
    MOEKIT_REQUIRE(bytes_of(packed[i]) >= b.bytes, name, ": ", bytes_of(packed[i]), " bytes, needs ", b.bytes);
    MOEKIT_REQUIRE(reinterpret_cast<uintptr_t>(c.data) % uintptr_t(b.alignment) == 0, name, ": data must be ",
                   b.alignment, "-byte aligned");
    v.push_back({c.data, b.bytes});
  }
  return v;
}

DeviceInfo device_info(DLDevice d) {
  if (d.device_type == kDLCPU) {
    DeviceInfo cpu = DeviceInfo::cpu();
    cpu.gpus = api::cuda_device_count();
    return cpu;
  }
  MOEKIT_REQUIRE(d.device_type == kDLCUDA, "device type ", int(d.device_type), " is not supported (CPU or CUDA)");
  MOEKIT_REQUIRE(api::cuda_built(), "this moekit was built without CUDA: only the CPU device is available");
  const DeviceInfo info = DeviceInfo::detect(d.device_id);
  MOEKIT_REQUIRE(info.gpu, "no CUDA device ", d.device_id, " (", api::cuda_device_count(), " found)");
  return info;
}

const Backend& backend_of(const LayerPlan& plan) {
  const Backend* b = find_backend(plan.backend);
  MOEKIT_REQUIRE(b, "plan: unknown backend '", plan.backend, "'");
  return *b;
}

// The weights must be what the description says (biases, score bias); then the backend packs them.
void pack_checked(const LayerSpec& spec, const LayerPlan& plan, const LayerWeights& w,
                  const std::vector<PackedBuffer>& dst, void* stream) {
  MOEKIT_REQUIRE(w.cfg.biases == spec.biases, "checkpoint: ", spec.biases ? "no bias tensors, but spec.biases is set"
                                                                         : "bias tensors given, but spec.biases is not set");
  MOEKIT_REQUIRE(w.cfg.score_bias == spec.score_bias, "checkpoint: ",
                 spec.score_bias ? "no e_score_correction_bias, but spec.score_bias is set"
                                 : "e_score_correction_bias given, but spec.score_bias is not set");
  MOEKIT_REQUIRE(int64_t(w.hash_table.size()) == spec.hash_vocab * spec.top_k, "checkpoint: ",
                 spec.hash_vocab > 0 ? "no tid2eid table, but spec.hash_vocab is set" : "a tid2eid table given, but spec.hash_vocab is 0");
  const api::DeviceScope on(plan.device);  // the packed buffers' device, not the caller's current one
  backend_of(plan).pack(w, dst, stream);
}

}  // namespace

// ---- description, plan, packing ---------------------------------------------------------------

Status check_spec(const LayerSpec& spec) {
  return guarded([&] { validate_spec(spec, "layer spec"); });
}

Status plan_layer(const LayerSpec& spec, const Options& options, LayerPlan* plan) {
  return guarded([&] {
    MOEKIT_REQUIRE(plan, "plan_layer: null output");
    const DeviceInfo dev = device_info(options.device);
    validate_spec(spec, "layer spec");
    MOEKIT_REQUIRE(spec.max_tokens > 0, "layer spec: max_tokens must be positive");
    const Problem p = Problem::of(spec, spec.max_tokens);
    const Decision d = choose_backend(p, dev, options.backend);
    LayerPlan out;
    out.backend = d.chosen->caps().name;
    out.device = options.device;
    out.buffers = d.chosen->packed_buffers(spec);
    out.explain = d.explain(p, dev);
    *plan = std::move(out);
  });
}

std::vector<TensorDesc> checkpoint_tensors(const LayerSpec& spec) {
  std::vector<TensorDesc> v;
  for (const CheckpointSlot& s : checkpoint_slots(spec)) v.push_back({s.name, s.dtype, s.shape, s.optional});
  return v;
}

Status pack_weights(const LayerSpec& spec, const LayerPlan& plan, std::span<const NamedTensor> checkpoint,
                    std::span<const DLTensor> packed, void* stream) {
  return guarded([&] {
    validate_spec(spec, "layer spec");
    const std::vector<PackedBuffer> dst = packed_views(plan, packed);
    std::vector<std::vector<uint8_t>> host;
    const std::vector<CheckpointTensor> t = host_checkpoint(spec, checkpoint, &host);
    const LayerWeights w = weights_from_checkpoint(spec, t, "checkpoint");
    pack_checked(spec, plan, w, dst, stream);
  });
}

Status api::pack_layer_weights(const LayerSpec& spec, const LayerPlan& plan, const LayerWeights& weights,
                               std::span<const DLTensor> packed, void* stream) {
  return guarded([&] {
    validate_spec(spec, "layer spec");
    pack_checked(spec, plan, weights, packed_views(plan, packed), stream);
  });
}

Status synthesize_weights(const LayerSpec& spec, const LayerPlan& plan, std::span<const DLTensor> packed,
                          uint64_t seed, void* stream) {
  return guarded([&] {
    validate_spec(spec, "layer spec");
    const api::DeviceScope on(plan.device);
    backend_of(plan).synthesize(spec, packed_views(plan, packed), seed, stream);
  });
}

std::vector<BackendInfo> backends() {
  std::vector<BackendInfo> v;
  const bool sm90 = [] {
    const DeviceInfo d = DeviceInfo::detect(0);
    return d.gpu && d.cc_major == 9 && d.cc_minor == 0;
  }();
  for (const Backend* b : all_backends()) {
    const BackendCaps& c = b->caps();
    v.push_back({c.name, c.summary, c.activation_format, c.weight_formats, c.activations, c.needs_sm90,
                 !c.needs_sm90 || sm90, c.activation_dtypes});
  }
  return v;
}

std::string device_description(DLDevice device) {
  if (device.device_type == kDLCPU) return "CPU";
  return DeviceInfo::detect(device.device_id).describe();
}

Status explain(const LayerSpec& spec, const Options& options, int64_t tokens, std::string* text) {
  return guarded([&] {
    const DeviceInfo dev = device_info(options.device);
    validate_spec(spec, "layer spec");
    const Problem p = Problem::of(spec, tokens);
    Decision d;
    try {
      d = choose_backend(p, dev, options.backend);
    } catch (const Error& e) {
      // No backend: the table still says why each was rejected.
      for (const Backend* b : all_backends()) d.rows.push_back({b, b->supports(p, dev)});
      d.how = e.what();
    }
    *text = d.explain(p, dev);
  });
}

Status quantize_activations_fp8(const DLTensor& x, ActivationScale scale, const DLTensor& codes,
                                const DLTensor& scales) {
  return guarded([&] {
    const DLDevice cpu{kDLCPU, 0};
    const Checked cx = check_tensor(x, "x", Kind::kF32, {-1, -1}, cpu, true);
    const int64_t R = cx.shape[0], K = cx.shape[1];
    MOEKIT_REQUIRE(codes.dtype.code == kDLUInt && codes.dtype.bits == 8 && codes.dtype.lanes == 1,
                   "codes: dtype ", dtype_name(codes.dtype), ", expected uint8 (E4M3 bits)");
    const Checked cc = check_tensor(codes, "codes", Kind::kBytes, {R, K}, cpu, true);
    const Checked cs = check_tensor(scales, "scales", Kind::kF32, {R, fp8_act_groups(K)}, cpu, true);
    for (int64_t r = 0; r < R; ++r)
      quantize_row_fp8_act(static_cast<const float*>(cx.data) + r * cx.stride[0], K, scale,
                           static_cast<uint8_t*>(cc.data) + r * cc.stride[0],
                           static_cast<float*>(cs.data) + r * cs.stride[0]);
  });
}

// ---- Layer ------------------------------------------------------------------------------------

struct Layer::Impl {
  LayerSpec spec;
  std::string backend;
  DLDevice device;
  bool gpu = false;
  std::unique_ptr<LayerImpl> impl;
};

Layer::Layer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Layer::~Layer() = default;

Status Layer::create(const LayerSpec& spec, const LayerPlan& plan, std::span<const DLTensor> packed,
                     std::unique_ptr<Layer>* layer) {
  return guarded([&] {
    MOEKIT_REQUIRE(layer, "Layer::create: null output");
    validate_spec(spec, "layer spec");
    MOEKIT_REQUIRE(spec.max_tokens > 0, "layer spec: max_tokens must be positive");
    const Backend& b = backend_of(plan);
    const std::vector<BufferDesc> want = b.packed_buffers(spec);
    MOEKIT_REQUIRE(want.size() == plan.buffers.size(), "Layer::create: the plan was made for another spec");
    for (size_t i = 0; i < want.size(); ++i)
      MOEKIT_REQUIRE(want[i].name == plan.buffers[i].name && want[i].bytes == plan.buffers[i].bytes,
                     "Layer::create: the plan was made for another spec (buffer ", plan.buffers[i].name, ")");
    auto impl = std::make_unique<Impl>();
    impl->spec = spec;
    impl->backend = plan.backend;
    impl->device = plan.device;
    impl->gpu = plan.device.device_type == kDLCUDA;
    impl->impl = b.create(spec, packed_views(plan, packed), plan.device.device_id);
    layer->reset(new Layer(std::move(impl)));
  });
}

const LayerSpec& Layer::spec() const { return impl_->spec; }
const std::string& Layer::backend() const { return impl_->backend; }
DLDevice Layer::device() const { return impl_->device; }

int64_t Layer::workspace_bytes(int64_t tokens, int k) const {
  return impl_->impl->workspace_bytes(ForwardCall::kLogits, std::max<int64_t>(tokens, 0), k > 0 ? k : impl_->spec.top_k);
}
int64_t Layer::batched_workspace_bytes(int64_t rows_per_expert) const {
  return impl_->impl->workspace_bytes(ForwardCall::kBatched, std::max<int64_t>(rows_per_expert, 0), 1);
}

namespace {

// The checks every entry shares: rows of x, out and shared; the workspace.
struct Common {
  const LayerSpec& s;
  DLDevice dev;
  bool gpu;

  void rows_2d(const DLTensor& t, const char* name, int64_t T, const uint16_t** p, int64_t* stride,
               int64_t align) const {
    const Checked c = check_tensor(t, name, Kind::kBf16, {T, s.hidden}, dev, true, gpu ? align : 0);
    *p = static_cast<const uint16_t*>(c.data);
    *stride = T > 0 ? c.stride[0] : s.hidden;
  }
  // T of x [T, H], within max_tokens.
  int64_t tokens(const DLTensor& x) const {
    const int64_t T = x.ndim > 0 ? x.shape[0] : -1;
    MOEKIT_REQUIRE(T >= 0, "x: shape ", shape_str(x), ", expected [T, ", s.hidden, "]");
    MOEKIT_REQUIRE(T <= s.max_tokens, "x: ", T, " tokens exceed the layer's max_tokens = ", s.max_tokens);
    return T;
  }
  // x, out and the optional shared rows of a [T, H] call.
  void token_rows(const DLTensor& x, const DLTensor& out, const DLTensor* shared, int64_t T, ForwardCall* c) const {
    rows_2d(x, "x", T, &c->x, &c->x_stride, 2);
    const uint16_t* y = nullptr;
    rows_2d(out, "out", T, &y, &c->y_stride, 8);
    c->y = const_cast<uint16_t*>(y);
    if (shared) rows_2d(*shared, "shared", T, &c->shared, &c->shared_stride, 8);
  }
  void workspace(const DLTensor& ws, int64_t need, ForwardCall* c) const {
    const Checked w = check_tensor(ws, "workspace", Kind::kBytes, Want::any(), dev, false);
    MOEKIT_REQUIRE(bytes_of(ws) >= need, "workspace: ", bytes_of(ws), " bytes, the call needs ", need,
                   " (workspace_bytes)");
    if (gpu)
      MOEKIT_REQUIRE(reinterpret_cast<uintptr_t>(w.data) % 256 == 0, "workspace: data must be 256-byte aligned");
    c->workspace = w.data;
  }
};

}  // namespace

Status Layer::forward_logits(const DLTensor& x, const DLTensor& logits, const DLTensor& out, const DLTensor& workspace,
                             void* stream, const DLTensor* shared, const DLTensor* topk_ids,
                             const DLTensor* topk_weights, const DLTensor* token_ids) {
  return guarded([&] {
    const LayerSpec& s = impl_->spec;
    const Common cm{s, impl_->device, impl_->gpu};
    const int64_t T = cm.tokens(x);
    ForwardCall c;
    c.entry = ForwardCall::kLogits;
    c.T = T;
    c.k = s.top_k;
    c.stream = stream;
    cm.token_rows(x, out, shared, T, &c);
    c.logits = static_cast<const float*>(check_tensor(logits, "logits", Kind::kF32, {T, s.num_experts}, cm.dev, false).data);
    MOEKIT_REQUIRE(!topk_ids == !topk_weights, "topk_ids and topk_weights come together");
    if (topk_ids) {
      c.ids = static_cast<int32_t*>(check_tensor(*topk_ids, "topk_ids", Kind::kI32, {T, s.top_k}, cm.dev, false).data);
      c.weights = static_cast<float*>(check_tensor(*topk_weights, "topk_weights", Kind::kF32, {T, s.top_k}, cm.dev, false).data);
      c.routing_out = true;
    }
    if (s.hash_vocab > 0) {
      MOEKIT_REQUIRE(token_ids, "token_ids: required: the layer is hash-routed (its experts are tid2eid[token id], ",
                     "spec.hash_vocab = ", s.hash_vocab, ")");
      c.token_ids = check_tensor(*token_ids, "token_ids", Kind::kTokenIds, {T}, cm.dev, false).data;
      c.token_ids_wide = token_ids->dtype.bits == 64;
    } else {
      MOEKIT_REQUIRE(!token_ids, "token_ids: given, but the layer routes by score (spec.hash_vocab = 0)");
    }
    cm.workspace(workspace, impl_->impl->workspace_bytes(ForwardCall::kLogits, T, c.k), &c);
    if (!c.routing_out && T > 0) {
      // The routing result lives in the workspace (CPU layers: after its first 256 bytes; the
      // SM90 layers carve their own).
      char* w = static_cast<char*>(c.workspace) + 256;
      c.ids = reinterpret_cast<int32_t*>(w);
      c.weights = reinterpret_cast<float*>(w + (T * c.k * 4 + 255) / 256 * 256);
    }
    impl_->impl->forward(c);
  });
}

Status Layer::forward_topk(const DLTensor& x, const DLTensor& topk_ids, const DLTensor& topk_weights,
                           const DLTensor& out, const DLTensor& workspace, void* stream, const DLTensor* shared) {
  return guarded([&] {
    const LayerSpec& s = impl_->spec;
    const Common cm{s, impl_->device, impl_->gpu};
    const int64_t T = cm.tokens(x);
    MOEKIT_REQUIRE(topk_ids.ndim == 2 && topk_ids.shape[1] > 0, "topk_ids: shape ", shape_str(topk_ids),
                   ", expected [", T, ", k]");
    const int64_t k = topk_ids.shape[1];
    MOEKIT_REQUIRE(T * k <= s.max_tokens * s.top_k, "topk_ids: ", T, " tokens x ", k,
                   " slots exceed the layer's max_tokens x top_k = ", s.max_tokens * s.top_k);
    ForwardCall c;
    c.entry = ForwardCall::kTopk;
    c.T = T;
    c.k = int(k);
    c.stream = stream;
    cm.token_rows(x, out, shared, T, &c);
    c.ids = static_cast<int32_t*>(check_tensor(topk_ids, "topk_ids", Kind::kI32, {T, k}, cm.dev, false).data);
    c.weights = static_cast<float*>(check_tensor(topk_weights, "topk_weights", Kind::kF32, {T, k}, cm.dev, false).data);
    cm.workspace(workspace, impl_->impl->workspace_bytes(ForwardCall::kTopk, T, c.k), &c);
    impl_->impl->forward(c);
  });
}

Status Layer::forward_batched(const DLTensor& x, const DLTensor& expert_num_tokens, const DLTensor& out,
                              const DLTensor& workspace, void* stream) {
  return guarded([&] {
    const LayerSpec& s = impl_->spec;
    const Common cm{s, impl_->device, impl_->gpu};
    const int64_t M = x.ndim == 3 ? x.shape[1] : -1;
    MOEKIT_REQUIRE(M >= 0, "x: shape ", shape_str(x), ", expected [", s.num_experts, ", M, ", s.hidden, "]");
    MOEKIT_REQUIRE(M <= s.max_tokens, "x: ", M, " rows per expert exceed the layer's max_tokens = ", s.max_tokens);
    ForwardCall c;
    c.entry = ForwardCall::kBatched;
    c.T = M;
    c.k = 1;
    c.stream = stream;
    const Checked cx = check_tensor(x, "x", Kind::kBf16, {s.num_experts, M, s.hidden}, cm.dev, true, cm.gpu ? 2 : 0);
    c.x = static_cast<const uint16_t*>(cx.data);
    c.x_expert_stride = cx.stride[0];
    c.x_stride = M > 0 ? cx.stride[1] : s.hidden;
    c.counts = static_cast<const int32_t*>(
        check_tensor(expert_num_tokens, "expert_num_tokens", Kind::kI32, {s.num_experts}, cm.dev, false).data);
    const Checked co = check_tensor(out, "out", Kind::kBf16, {s.num_experts, M, s.hidden}, cm.dev, true, 0);
    c.y = static_cast<uint16_t*>(co.data);
    c.y_expert_stride = co.stride[0];
    c.y_stride = M > 0 ? co.stride[1] : s.hidden;
    cm.workspace(workspace, impl_->impl->workspace_bytes(ForwardCall::kBatched, M, 1), &c);
    impl_->impl->forward(c);
  });
}

Status Layer::check(void* stream) {
  return guarded([&] {
    const int flag = impl_->impl->error_flag(stream);
    MOEKIT_REQUIRE(flag == 0, "layer: ",
                   flag == 1   ? "a top-k id was out of range [-1, E) (its slot was skipped)"
                   : flag == 3 ? "a token id was outside the hash table [0, hash_vocab) (its row got no expert)"
                               : "an expert's rows exceeded its capacity (the rows past it were skipped)");
  });
}

// ---- helpers ----------------------------------------------------------------------------------

TensorRef::TensorRef(void* data, DLDataType dtype, std::vector<int64_t> shape, DLDevice device,
                     std::vector<int64_t> strides)
    : shape_(std::move(shape)), strides_(std::move(strides)) {
  t_.data = data;
  t_.device = device;
  t_.dtype = dtype;
  t_.byte_offset = 0;
  point();
}
TensorRef::TensorRef(const TensorRef& o) : shape_(o.shape_), strides_(o.strides_), t_(o.t_) { point(); }
TensorRef& TensorRef::operator=(const TensorRef& o) {
  shape_ = o.shape_;
  strides_ = o.strides_;
  t_ = o.t_;
  point();
  return *this;
}
void TensorRef::point() {
  t_.ndim = int(shape_.size());
  t_.shape = shape_.data();
  t_.strides = strides_.empty() ? nullptr : strides_.data();
}

Status Buffer::allocate(DLDevice device, int64_t bytes, Buffer* out) {
  return guarded([&] {
    Buffer b;
    b.data_ = api::device_alloc(device, bytes);
    b.bytes_ = bytes;
    b.device_ = device;
    *out = std::move(b);
  });
}
Buffer::Buffer(Buffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_), device_(o.device_) { o.data_ = nullptr; }
Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    api::device_free(device_, data_);
    data_ = o.data_;
    bytes_ = o.bytes_;
    device_ = o.device_;
    o.data_ = nullptr;
  }
  return *this;
}
Buffer::~Buffer() { api::device_free(device_, data_); }
Status Buffer::copy_from_host(const void* src, int64_t bytes, int64_t offset) {
  return guarded([&] {
    MOEKIT_REQUIRE(offset >= 0 && bytes >= 0 && offset + bytes <= bytes_, "Buffer: copy of ", bytes, " bytes at ",
                   offset, " past its ", bytes_);
    api::copy_from_host(device_, static_cast<char*>(data_) + offset, src, bytes);
  });
}
Status Buffer::copy_to_host(void* dst, int64_t bytes, int64_t offset) const {
  return guarded([&] {
    MOEKIT_REQUIRE(offset >= 0 && bytes >= 0 && offset + bytes <= bytes_, "Buffer: copy of ", bytes, " bytes at ",
                   offset, " past its ", bytes_);
    api::copy_to_host(device_, dst, static_cast<const char*>(data_) + offset, bytes);
  });
}

namespace {
// plan, allocate, fill (pack or synthesize), create.
template <class Fill>
Status make_layer_with(const LayerSpec& spec, const Options& options, OwnedLayer* out, Fill&& fill) {
  OwnedLayer o;
  Status st = plan_layer(spec, options, &o.plan);
  std::vector<DLTensor> views;
  for (const BufferDesc& b : o.plan.buffers) {
    if (!st.ok()) break;
    Buffer buf;
    st = Buffer::allocate(o.plan.device, b.bytes, &buf);
    if (!st.ok()) st.message = "packed weights (" + b.name + "): " + st.message;
    o.packed.push_back(std::move(buf));
  }
  if (!st.ok()) return st;
  // TensorRef keeps its shape; the DLTensors point into these.
  std::vector<TensorRef> refs;
  for (const Buffer& b : o.packed) refs.push_back(b.tensor());
  for (const TensorRef& r : refs) views.push_back(r.dl());
  st = fill(o.plan, std::span<const DLTensor>(views));
  if (!st.ok()) return st;
  st = Layer::create(spec, o.plan, views, &o.layer);
  if (st.ok()) *out = std::move(o);
  return st;
}
}  // namespace

Status make_layer(const LayerSpec& spec, const Options& options, std::span<const NamedTensor> checkpoint,
                  OwnedLayer* out) {
  return make_layer_with(spec, options, out, [&](const LayerPlan& plan, std::span<const DLTensor> views) {
    return checkpoint.empty() ? synthesize_weights(spec, plan, views, 1) : pack_weights(spec, plan, checkpoint, views);
  });
}

Status api::make_layer_from_weights(const LayerSpec& spec, const Options& options, const LayerWeights& weights,
                                    OwnedLayer* out) {
  return make_layer_with(spec, options, out, [&](const LayerPlan& plan, std::span<const DLTensor> views) {
    return pack_layer_weights(spec, plan, weights, views);
  });
}

}  // namespace moekit
