// The Python binding: the only file that includes apache-tvm-ffi. Each function below is a C
// symbol (TVM_FFI_DLL_EXPORT_TYPED_FUNC) over the public API (include/moekit/moekit.hpp), loaded
// by python/moekit/_ffi.py with tvm_ffi.load_module. The module links neither libpython nor
// torch: tvm-ffi turns torch, numpy and any DLPack producer's tensors into DLTensor views without
// copies or stream syncs, and installs the producer's current stream (torch's current stream) as
// the environment stream that forward calls launch on.
//
// A layer is a tvm-ffi Object ("moekit.Layer") that owns the moekit::Layer and holds references
// to the packed weight tensors, so the caller's storage stays alive with it. A Status that is not
// ok becomes a Python ValueError (bad arguments) or RuntimeError (CUDA), with its message.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/object.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moekit/ep.hpp"
#include "moekit/moekit.hpp"

namespace ffi = tvm::ffi;

namespace {

using moekit::Status;
using moekit::StatusCode;

void raise(const Status& s) {
  if (s.ok()) return;
  if (s.code == StatusCode::kRuntimeError) TVM_FFI_THROW(RuntimeError) << s.message;
  TVM_FFI_THROW(ValueError) << s.message;
}

// ---- the layer description from a Python dict -------------------------------------------------

template <typename E>
E pick(const std::string& key, const std::string& v, std::initializer_list<std::pair<const char*, E>> names) {
  std::string known;
  for (const auto& [n, e] : names) {
    if (v == n) return e;
    known += (known.empty() ? "" : ", ") + std::string(n);
  }
  TVM_FFI_THROW(ValueError) << "LayerSpec." << key << ": unknown value '" << v << "' (expected " << known << ")";
}

moekit::LayerSpec to_spec(const ffi::Map<ffi::String, ffi::Any>& d) {
  using namespace moekit;
  LayerSpec s;
  for (const auto& [k, v] : d) {
    const std::string key = k;
    auto i = [&] { return v.cast<int64_t>(); };
    auto f = [&] { return float(v.cast<double>()); };
    auto b = [&] { return v.cast<bool>(); };
    auto str = [&] { return std::string(v.cast<ffi::String>()); };
    if (key == "num_experts") s.num_experts = int(i());
    else if (key == "top_k") s.top_k = int(i());
    else if (key == "hidden") s.hidden = int(i());
    else if (key == "intermediate") s.intermediate = int(i());
    else if (key == "format")
      s.format = pick<WeightFormat>(key, str(), {{"mxfp4", WeightFormat::kMxfp4}, {"nvfp4", WeightFormat::kNvfp4},
                                                 {"mxfp8", WeightFormat::kMxfp8}, {"bf16", WeightFormat::kBf16}});
    else if (key == "scale_rule")
      s.scale_rule = pick<ScaleRule>(key, str(), {{"floor", ScaleRule::kFloor}, {"rceil", ScaleRule::kRceil}});
    else if (key == "activation")
      s.act = pick<Activation>(key, str(), {{"silu", Activation::kSilu}, {"swiglu_oai", Activation::kSwigluOai},
                                            {"silu_clamped", Activation::kSiluClamped}});
    else if (key == "swiglu_alpha") s.swiglu_alpha = f();
    else if (key == "swiglu_beta") s.swiglu_beta = f();
    else if (key == "swiglu_limit") s.swiglu_limit = f();
    else if (key == "scoring")
      s.scoring = pick<Scoring>(key, str(), {{"softmax", Scoring::kSoftmax}, {"sigmoid", Scoring::kSigmoid},
                                             {"sqrtsoftplus", Scoring::kSqrtSoftplus}});
    else if (key == "norm_topk_prob") s.norm_topk_prob = b();
    else if (key == "routed_scaling_factor") s.routed_scaling_factor = f();
    else if (key == "n_group") s.n_group = int(i());
    else if (key == "topk_group") s.topk_group = int(i());
    else if (key == "score_bias") s.score_bias = b();
    else if (key == "hash_vocab") s.hash_vocab = i();
    else if (key == "biases") s.biases = b();
    else if (key == "activation_format")
      s.activation_format = pick<ActivationFormat>(
          key, str(), {{"standard", ActivationFormat::kStandard}, {"batched", ActivationFormat::kBatched}});
    else if (key == "max_tokens") s.max_tokens = i();
    else if (key == "activation_dtype")
      s.activation_dtype = pick<ActivationDtype>(key, str(), {{"bf16", ActivationDtype::kBf16}, {"fp8", ActivationDtype::kFp8}});
    else if (key == "activation_scale")
      s.activation_scale =
          pick<ActivationScale>(key, str(), {{"fp32", ActivationScale::kFp32}, {"ue8m0", ActivationScale::kUe8m0}});
    else TVM_FFI_THROW(ValueError) << "LayerSpec: unknown field '" << key << "'";
  }
  return s;
}

// ---- tensors ----------------------------------------------------------------------------------

// The DLTensor behind a view; tvm-ffi's tensors always carry strides.
DLTensor dl(const ffi::TensorView& t) {
  DLTensor d{};
  d.data = t.data_ptr();
  d.device = t.device();
  d.ndim = t.ndim();
  d.dtype = t.dtype();
  d.shape = const_cast<int64_t*>(t.shape().data());
  d.strides = t.ndim() > 0 ? const_cast<int64_t*>(t.strides().data()) : nullptr;
  d.byte_offset = t.byte_offset();
  return d;
}

std::vector<DLTensor> dls(const ffi::Array<ffi::Tensor>& a) {
  std::vector<DLTensor> v;
  v.reserve(a.size());
  for (const ffi::Tensor& t : a) v.push_back(*t.GetDLTensorPtr());
  return v;
}

moekit::LayerPlan to_plan(const ffi::String& backend, int64_t device_type, int64_t device_id,
                          const moekit::LayerSpec& spec) {
  moekit::LayerPlan plan;
  moekit::Options o;
  o.device = {DLDeviceType(device_type), int32_t(device_id)};
  o.backend = std::string(backend);
  raise(moekit::plan_layer(spec, o, &plan));
  return plan;
}

// ---- the layer object -------------------------------------------------------------------------

class LayerObj : public ffi::Object {
 public:
  std::unique_ptr<moekit::Layer> layer;
  ffi::Array<ffi::Tensor> packed;  // the caller's packed buffers, alive as long as the layer
  DLDevice device{kDLCPU, 0};

  void* stream() const {
    return device.device_type == kDLCPU ? nullptr : TVMFFIEnvGetStream(device.device_type, device.device_id);
  }

  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("moekit.Layer", LayerObj, ffi::Object);
};

const LayerObj& layer_of(const ffi::ObjectRef& ref) {
  const LayerObj* p = ref.as<LayerObj>();
  if (p == nullptr || !p->layer) TVM_FFI_THROW(TypeError) << "expected a moekit layer";
  return *p;
}

// ---- exported functions -----------------------------------------------------------------------

ffi::String version() { return "0.1.0"; }

bool built_with_cuda() {
  for (const moekit::BackendInfo& b : moekit::backends())
    if (b.gpu) return true;
  return false;
}

// Every backend: name, summary, activation format, gpu, available here, activation dtypes.
ffi::Array<ffi::Array<ffi::Any>> backends() {
  ffi::Array<ffi::Array<ffi::Any>> out;
  for (const moekit::BackendInfo& b : moekit::backends()) {
    ffi::Array<ffi::Any> dtypes;
    for (moekit::ActivationDtype d : b.activation_dtypes) dtypes.push_back(ffi::String(d == moekit::ActivationDtype::kFp8 ? "fp8" : "bf16"));
    out.push_back(ffi::Array<ffi::Any>{ffi::String(b.name), ffi::String(b.summary),
                                       ffi::String(b.activation_format == moekit::ActivationFormat::kStandard
                                                       ? "standard"
                                                       : "batched"),
                                       b.gpu, b.available, dtypes});
  }
  return out;
}

ffi::String device_description(int64_t device_id) {
  return moekit::device_description({kDLCUDA, int32_t(device_id)});
}

ffi::String explain(ffi::Map<ffi::String, ffi::Any> spec, int64_t device_type, int64_t device_id,
                    ffi::String backend, int64_t tokens) {
  moekit::Options o;
  o.device = {DLDeviceType(device_type), int32_t(device_id)};
  o.backend = std::string(backend);
  std::string text;
  raise(moekit::explain(to_spec(spec), o, tokens, &text));
  return text;
}

// [backend, explain, [[name, bytes, alignment], ...]]
ffi::Array<ffi::Any> plan(ffi::Map<ffi::String, ffi::Any> spec, int64_t device_type, int64_t device_id,
                          ffi::String backend) {
  const moekit::LayerPlan p = to_plan(backend, device_type, device_id, to_spec(spec));
  ffi::Array<ffi::Any> buffers;
  for (const moekit::BufferDesc& b : p.buffers)
    buffers.push_back(ffi::Array<ffi::Any>{ffi::String(b.name), b.bytes, b.alignment});
  return ffi::Array<ffi::Any>{ffi::String(p.backend), ffi::String(p.explain), buffers};
}

// [[name, dtype, shape, optional], ...]
ffi::Array<ffi::Any> checkpoint_tensors(ffi::Map<ffi::String, ffi::Any> spec) {
  ffi::Array<ffi::Any> out;
  for (const moekit::TensorDesc& t : moekit::checkpoint_tensors(to_spec(spec))) {
    ffi::Array<ffi::Any> shape;
    for (int64_t d : t.shape) shape.push_back(d);
    out.push_back(ffi::Array<ffi::Any>{ffi::String(t.name), ffi::String(t.dtype), shape, t.optional});
  }
  return out;
}

void pack(ffi::Map<ffi::String, ffi::Any> spec_d, ffi::String backend, int64_t device_type, int64_t device_id,
          ffi::Array<ffi::String> names, ffi::Array<ffi::Tensor> tensors, ffi::Array<ffi::Tensor> packed) {
  const moekit::LayerSpec spec = to_spec(spec_d);
  const moekit::LayerPlan p = to_plan(backend, device_type, device_id, spec);
  if (names.size() != tensors.size()) TVM_FFI_THROW(ValueError) << "pack: names and tensors differ in length";
  std::vector<moekit::NamedTensor> ck;
  for (size_t i = 0; i < names.size(); ++i) ck.push_back({std::string(names[i]), *tensors[i].GetDLTensorPtr()});
  const std::vector<DLTensor> dst = dls(packed);
  raise(moekit::pack_weights(spec, p, ck, dst, TVMFFIEnvGetStream(p.device.device_type, p.device.device_id)));
}

void synthesize(ffi::Map<ffi::String, ffi::Any> spec_d, ffi::String backend, int64_t device_type, int64_t device_id,
                ffi::Array<ffi::Tensor> packed, int64_t seed) {
  const moekit::LayerSpec spec = to_spec(spec_d);
  const moekit::LayerPlan p = to_plan(backend, device_type, device_id, spec);
  const std::vector<DLTensor> dst = dls(packed);
  raise(moekit::synthesize_weights(spec, p, dst, uint64_t(seed),
                                   TVMFFIEnvGetStream(p.device.device_type, p.device.device_id)));
}

ffi::ObjectRef layer_create(ffi::Map<ffi::String, ffi::Any> spec_d, ffi::String backend, int64_t device_type,
                            int64_t device_id, ffi::Array<ffi::Tensor> packed) {
  const moekit::LayerSpec spec = to_spec(spec_d);
  const moekit::LayerPlan p = to_plan(backend, device_type, device_id, spec);
  auto obj = ffi::make_object<LayerObj>();
  const std::vector<DLTensor> views = dls(packed);
  raise(moekit::Layer::create(spec, p, views, &obj->layer));
  obj->packed = packed;
  obj->device = p.device;
  return ffi::ObjectRef(obj);
}

int64_t workspace_bytes(ffi::ObjectRef layer, int64_t tokens, int64_t k) {
  return layer_of(layer).layer->workspace_bytes(tokens, int(k));
}

int64_t batched_workspace_bytes(ffi::ObjectRef layer, int64_t rows_per_expert) {
  return layer_of(layer).layer->batched_workspace_bytes(rows_per_expert);
}

// token_ids: forward_logits_tokens (a hash-routed layer's rows' token ids); forward_logits keeps
// its eight arguments for the callers that use it directly.
void forward_logits_tokens(ffi::ObjectRef layer, ffi::TensorView x, ffi::TensorView logits, ffi::TensorView out,
                           ffi::TensorView workspace, ffi::Optional<ffi::TensorView> shared,
                           ffi::Optional<ffi::TensorView> topk_ids, ffi::Optional<ffi::TensorView> topk_weights,
                           ffi::Optional<ffi::TensorView> token_ids) {
  const LayerObj& L = layer_of(layer);
  const DLTensor sh = shared.has_value() ? dl(*shared) : DLTensor{};
  const DLTensor ids = topk_ids.has_value() ? dl(*topk_ids) : DLTensor{};
  const DLTensor w = topk_weights.has_value() ? dl(*topk_weights) : DLTensor{};
  const DLTensor tok = token_ids.has_value() ? dl(*token_ids) : DLTensor{};
  raise(L.layer->forward_logits(dl(x), dl(logits), dl(out), dl(workspace), L.stream(),
                                shared.has_value() ? &sh : nullptr, topk_ids.has_value() ? &ids : nullptr,
                                topk_weights.has_value() ? &w : nullptr, token_ids.has_value() ? &tok : nullptr));
}

void forward_logits(ffi::ObjectRef layer, ffi::TensorView x, ffi::TensorView logits, ffi::TensorView out,
                    ffi::TensorView workspace, ffi::Optional<ffi::TensorView> shared,
                    ffi::Optional<ffi::TensorView> topk_ids, ffi::Optional<ffi::TensorView> topk_weights) {
  forward_logits_tokens(layer, x, logits, out, workspace, shared, topk_ids, topk_weights,
                        ffi::Optional<ffi::TensorView>());
}

void forward_topk(ffi::ObjectRef layer, ffi::TensorView x, ffi::TensorView topk_ids, ffi::TensorView topk_weights,
                  ffi::TensorView out, ffi::TensorView workspace, ffi::Optional<ffi::TensorView> shared) {
  const LayerObj& L = layer_of(layer);
  const DLTensor sh = shared.has_value() ? dl(*shared) : DLTensor{};
  raise(L.layer->forward_topk(dl(x), dl(topk_ids), dl(topk_weights), dl(out), dl(workspace), L.stream(),
                              shared.has_value() ? &sh : nullptr));
}

void forward_batched(ffi::ObjectRef layer, ffi::TensorView x, ffi::TensorView expert_num_tokens, ffi::TensorView out,
                     ffi::TensorView workspace) {
  const LayerObj& L = layer_of(layer);
  raise(L.layer->forward_batched(dl(x), dl(expert_num_tokens), dl(out), dl(workspace), L.stream()));
}

void quantize_activations_fp8(ffi::TensorView x, ffi::String scale, ffi::TensorView codes, ffi::TensorView scales) {
  const moekit::ActivationScale s = pick<moekit::ActivationScale>(
      "activation_scale", std::string(scale), {{"fp32", moekit::ActivationScale::kFp32}, {"ue8m0", moekit::ActivationScale::kUe8m0}});
  raise(moekit::quantize_activations_fp8(dl(x), s, dl(codes), dl(scales)));
}

// stream: the handle to wait for (torch's current stream, from Python); -1: the environment's.
void check(ffi::ObjectRef layer, int64_t stream) {
  const LayerObj& L = layer_of(layer);
  raise(L.layer->check(stream == -1 ? L.stream() : reinterpret_cast<void*>(static_cast<intptr_t>(stream))));
}

// [backend, device_type, device_id, max_tokens]
ffi::Array<ffi::Any> layer_info(ffi::ObjectRef layer) {
  const LayerObj& L = layer_of(layer);
  return ffi::Array<ffi::Any>{ffi::String(L.layer->backend()), int64_t(L.device.device_type),
                              int64_t(L.device.device_id), L.layer->spec().max_tokens};
}

// ---- expert parallelism (include/moekit/ep.hpp) -------------------------------------------------

class EpGroupObj : public ffi::Object {
 public:
  std::unique_ptr<moekit::EpGroup> group;
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("moekit.EpGroup", EpGroupObj, ffi::Object);
};

class EpLayerObj : public ffi::Object {
 public:
  std::unique_ptr<moekit::EpLayer> layer;
  ffi::ObjectRef group;  // the group outlives its layers
  DLDevice device{kDLCUDA, 0};
  void* stream() const { return TVMFFIEnvGetStream(device.device_type, device.device_id); }
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("moekit.EpLayer", EpLayerObj, ffi::Object);
};

EpGroupObj& ep_group_of(const ffi::ObjectRef& ref) {
  EpGroupObj* p = const_cast<EpGroupObj*>(ref.as<EpGroupObj>());
  if (p == nullptr || !p->group) TVM_FFI_THROW(TypeError) << "expected a moekit EP group";
  return *p;
}
EpLayerObj& ep_layer_of(const ffi::ObjectRef& ref) {
  EpLayerObj* p = const_cast<EpLayerObj*>(ref.as<EpLayerObj>());
  if (p == nullptr || !p->layer) TVM_FFI_THROW(TypeError) << "expected a moekit EP layer";
  return *p;
}

ffi::Bytes ep_unique_id() {
  std::vector<uint8_t> id;
  raise(moekit::ep_unique_id(&id));
  return ffi::Bytes(reinterpret_cast<const char*>(id.data()), id.size());
}

ffi::ObjectRef ep_group_create(ffi::Bytes unique_id, int64_t world, int64_t rank, int64_t device_id,
                               ffi::String transport) {
  auto obj = ffi::make_object<EpGroupObj>();
  const uint8_t* b = reinterpret_cast<const uint8_t*>(unique_id.data());
  raise(moekit::EpGroup::create(std::span<const uint8_t>(b, unique_id.size()), int(world), int(rank),
                                {kDLCUDA, int32_t(device_id)}, &obj->group, std::string(transport)));
  return ffi::ObjectRef(obj);
}

// [world, rank, device_id, transport]
ffi::Array<ffi::Any> ep_group_info(ffi::ObjectRef group) {
  const moekit::EpGroup& g = *ep_group_of(group).group;
  return ffi::Array<ffi::Any>{int64_t(g.world()), int64_t(g.rank()), int64_t(g.device().device_id),
                              ffi::String(g.transport())};
}

moekit::EpOptions to_ep_options(const ffi::Map<ffi::String, ffi::Any>& d) {
  moekit::EpOptions o;
  for (const auto& [k, v] : d) {
    const std::string key = k;
    if (key == "max_tokens_per_rank") o.max_tokens_per_rank = v.cast<int64_t>();
    else if (key == "payload") o.payload = std::string(v.cast<ffi::String>());
    else if (key == "combine") o.combine = std::string(v.cast<ffi::String>());
    else if (key == "expert_capacity") o.expert_capacity = v.cast<int64_t>();
    else if (key == "timeout_ms") o.timeout_ms = v.cast<double>();
    else if (key == "nvfp4_global_scale") o.nvfp4_global_scale = float(v.cast<double>());
    else if (key == "mx_scale_rule") o.mx_scale_rule = std::string(v.cast<ffi::String>());
    else if (key == "kernel") o.kernel = std::string(v.cast<ffi::String>());
    else if (key == "dispatch") o.dispatch = std::string(v.cast<ffi::String>());
    else TVM_FFI_THROW(ValueError) << "EpOptions: unknown field '" << key << "'";
  }
  return o;
}

ffi::ObjectRef ep_layer_create(ffi::ObjectRef group, ffi::Map<ffi::String, ffi::Any> spec_d,
                               ffi::Map<ffi::String, ffi::Any> options, ffi::Array<ffi::String> names,
                               ffi::Array<ffi::Tensor> tensors) {
  EpGroupObj& g = ep_group_of(group);
  if (names.size() != tensors.size()) TVM_FFI_THROW(ValueError) << "ep_layer: names and tensors differ in length";
  std::vector<moekit::NamedTensor> ck;
  for (size_t i = 0; i < names.size(); ++i) ck.push_back({std::string(names[i]), *tensors[i].GetDLTensorPtr()});
  auto obj = ffi::make_object<EpLayerObj>();
  raise(moekit::EpLayer::create(*g.group, to_spec(spec_d), to_ep_options(options), ck, &obj->layer));
  obj->group = group;
  obj->device = g.group->device();
  return ffi::ObjectRef(obj);
}

// [first_expert, local_experts]
ffi::Array<ffi::Any> ep_layer_info(ffi::ObjectRef layer) {
  const EpLayerObj& L = ep_layer_of(layer);
  return ffi::Array<ffi::Any>{int64_t(L.layer->first_expert()), int64_t(L.layer->local_experts())};
}

void ep_forward_logits(ffi::ObjectRef layer, ffi::TensorView x, ffi::TensorView logits, ffi::TensorView out,
                       ffi::Optional<ffi::TensorView> shared, ffi::Optional<ffi::TensorView> topk_ids,
                       ffi::Optional<ffi::TensorView> topk_weights) {
  EpLayerObj& L = ep_layer_of(layer);
  const DLTensor sh = shared.has_value() ? dl(*shared) : DLTensor{};
  const DLTensor ids = topk_ids.has_value() ? dl(*topk_ids) : DLTensor{};
  const DLTensor w = topk_weights.has_value() ? dl(*topk_weights) : DLTensor{};
  raise(L.layer->forward_logits(dl(x), dl(logits), dl(out), L.stream(), shared.has_value() ? &sh : nullptr,
                                topk_ids.has_value() ? &ids : nullptr, topk_weights.has_value() ? &w : nullptr));
}

void ep_forward_topk(ffi::ObjectRef layer, ffi::TensorView x, ffi::TensorView topk_ids, ffi::TensorView topk_weights,
                     ffi::TensorView out, ffi::Optional<ffi::TensorView> shared) {
  EpLayerObj& L = ep_layer_of(layer);
  const DLTensor sh = shared.has_value() ? dl(*shared) : DLTensor{};
  raise(L.layer->forward_topk(dl(x), dl(topk_ids), dl(topk_weights), dl(out), L.stream(),
                              shared.has_value() ? &sh : nullptr));
}

void ep_forward_batched(ffi::ObjectRef layer, ffi::TensorView x, ffi::TensorView expert_num_tokens,
                        ffi::TensorView out, ffi::TensorView workspace) {
  EpLayerObj& L = ep_layer_of(layer);
  raise(L.layer->forward_batched(dl(x), dl(expert_num_tokens), dl(out), dl(workspace), L.stream()));
}

int64_t ep_batched_workspace_bytes(ffi::ObjectRef layer, int64_t rows_per_expert) {
  return ep_layer_of(layer).layer->batched_workspace_bytes(rows_per_expert);
}

// The split calls (EpLayer::batch / dispatch / combine). ep_batch: [x, x_expert_stride,
// x_row_stride, expert_num_tokens, expert_out, local_experts, capacity, hidden] (addresses as
// integers: python/moekit/torch.py makes torch views of them).
ffi::Array<ffi::Any> ep_batch(ffi::ObjectRef layer) {
  moekit::EpBatch b;
  raise(ep_layer_of(layer).layer->batch(&b));
  auto addr = [](const void* p) { return int64_t(reinterpret_cast<intptr_t>(p)); };
  return ffi::Array<ffi::Any>{addr(b.x), b.x_expert_stride, b.x_row_stride, addr(b.expert_num_tokens),
                              addr(b.expert_out), b.local_experts, b.capacity, b.hidden};
}

void ep_dispatch(ffi::ObjectRef layer, ffi::TensorView x, ffi::TensorView topk_ids, ffi::TensorView topk_weights) {
  EpLayerObj& L = ep_layer_of(layer);
  raise(L.layer->dispatch(dl(x), dl(topk_ids), dl(topk_weights), L.stream()));
}

void ep_combine(ffi::ObjectRef layer, ffi::TensorView expert_out, ffi::TensorView out,
                ffi::Optional<ffi::TensorView> topk_weights, ffi::Optional<ffi::TensorView> shared) {
  EpLayerObj& L = ep_layer_of(layer);
  const DLTensor w = topk_weights.has_value() ? dl(*topk_weights) : DLTensor{};
  const DLTensor sh = shared.has_value() ? dl(*shared) : DLTensor{};
  raise(L.layer->combine(dl(expert_out), dl(out), L.stream(), topk_weights.has_value() ? &w : nullptr,
                         shared.has_value() ? &sh : nullptr));
}

void ep_check(ffi::ObjectRef layer, int64_t stream) {
  EpLayerObj& L = ep_layer_of(layer);
  raise(L.layer->check(stream == -1 ? L.stream() : reinterpret_cast<void*>(static_cast<intptr_t>(stream))));
}

void ep_reset(ffi::ObjectRef layer) { raise(ep_layer_of(layer).layer->reset()); }

// The environment stream a call on this device would use (tests of the stream plumbing).
int64_t env_stream(int64_t device_type, int64_t device_id) {
  return int64_t(reinterpret_cast<intptr_t>(TVMFFIEnvGetStream(int32_t(device_type), int32_t(device_id))));
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(version, version);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(built_with_cuda, built_with_cuda);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backends, backends);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(device_description, device_description);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(explain, explain);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(quantize_activations_fp8, quantize_activations_fp8);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan, plan);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(checkpoint_tensors, checkpoint_tensors);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pack, pack);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(synthesize, synthesize);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(layer_create, layer_create);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(workspace_bytes, workspace_bytes);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(batched_workspace_bytes, batched_workspace_bytes);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(forward_logits, forward_logits);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(forward_logits_tokens, forward_logits_tokens);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(forward_topk, forward_topk);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(forward_batched, forward_batched);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(check, check);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(layer_info, layer_info);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(env_stream, env_stream);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_unique_id, ep_unique_id);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_group_create, ep_group_create);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_group_info, ep_group_info);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_layer_create, ep_layer_create);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_layer_info, ep_layer_info);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_forward_logits, ep_forward_logits);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_forward_topk, ep_forward_topk);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_forward_batched, ep_forward_batched);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_batched_workspace_bytes, ep_batched_workspace_bytes);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_batch, ep_batch);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_dispatch, ep_dispatch);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_combine, ep_combine);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_check, ep_check);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(ep_reset, ep_reset);
