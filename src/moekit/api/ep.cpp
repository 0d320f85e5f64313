// The public EP API (include/moekit/ep.hpp) over comm/ (the arena, the group's kernels) and
// backends/ep_layer.h (dispatch -> the rank's SM90 batched experts -> combine): checks every
// argument before anything runs, turns exceptions into Status values. Without CUDA every call
// returns kUnsupported with the reason.
#include "moekit/ep.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moekit/api/checks.h"
#include "moekit/api/device.h"
#include "moekit/common/error.h"
#include "moekit/experts/weights.h"
#include "moekit/oracle/layer_checks.h"

#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "moekit/backends/ep_layer.h"
#include "moekit/backends/sm90_layer.h"
#include "moekit/comm/ep_group.h"
#include "moekit/comm/ep_host.h"
#include "moekit/comm/nccl_window.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/routing/routing.h"
#endif

namespace moekit {

using api::Checked;
using api::guarded;
using api::Kind;
using api::Want;

namespace {

// The checks of EpOptions that need no device (also the ones the Python binding relies on).
struct ParsedOptions {
  int64_t T = 0, capacity = 0;
  int payload = 0;  // ep::Payload
  int combine = 0;  // ep::CombineRows
  bool rceil = false;
  uint64_t timeout_ns = 0;
  int dispatch = -1;  // ep::Dispatch, or -1: $MOEKIT_EP_DISPATCH
};

ParsedOptions parse_options(const EpOptions& o, int world) {
  ParsedOptions p;
  MOEKIT_REQUIRE(o.max_tokens_per_rank > 0 && o.max_tokens_per_rank < (1 << 20),
                 "EP options: max_tokens_per_rank must be in [1, 2^20), got ", o.max_tokens_per_rank);
  p.T = o.max_tokens_per_rank;
  if (o.payload == "bf16") p.payload = 0;
  else if (o.payload == "mxfp8") p.payload = 1;
  else if (o.payload == "nvfp4") p.payload = 2;
  else fail("EP options: payload '", o.payload, "' (bf16 | mxfp8 | nvfp4)");
  if (o.combine == "fp32") p.combine = 0;
  else if (o.combine == "bf16") p.combine = 1;
  else if (o.combine == "bf16_sum") p.combine = 2;
  else fail("EP options: combine '", o.combine, "' (fp32 | bf16 | bf16_sum)");
  MOEKIT_REQUIRE(o.mx_scale_rule == "floor" || o.mx_scale_rule == "rceil", "EP options: mx_scale_rule '",
                 o.mx_scale_rule, "' (floor | rceil)");
  MOEKIT_REQUIRE(o.kernel == "auto" || o.kernel == "decode" || o.kernel == "prefill", "EP options: kernel '",
                 o.kernel, "' (auto | decode | prefill)");
  if (o.dispatch.empty()) p.dispatch = -1;
  else if (o.dispatch == "direct") p.dispatch = 0;
  else if (o.dispatch == "fanout") p.dispatch = 1;
  else if (o.dispatch == "auto") p.dispatch = 2;
  else fail("EP options: dispatch '", o.dispatch, "' (auto | direct | fanout)");
  p.rceil = o.mx_scale_rule == "rceil";
  MOEKIT_REQUIRE(o.expert_capacity >= 0, "EP options: expert_capacity ", o.expert_capacity, " < 0");
  p.capacity = o.expert_capacity > 0 ? o.expert_capacity : int64_t(world) * p.T;
  MOEKIT_REQUIRE(std::isfinite(o.timeout_ms) && o.timeout_ms > 0 && o.timeout_ms <= 3.6e6,
                 "EP options: timeout_ms must be in (0, 3600000], got ", o.timeout_ms);
  p.timeout_ns = uint64_t(o.timeout_ms * 1e6);
  if (p.payload == 2)
    MOEKIT_REQUIRE(std::isfinite(o.nvfp4_global_scale) && o.nvfp4_global_scale > 0,
                   "EP options: the nvfp4 payload needs nvfp4_global_scale = 448 * 6 / amax(activations) > 0");
  return p;
}

#ifdef MOEKIT_WITH_CUDA

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("EP: CUDA error: ", what, ": ", cudaGetErrorString(e));
}

// The device must be a CUDA device with an SM90 GPU (the experts are the SM90 batched kernels).
void check_device(DLDevice d) {
  MOEKIT_REQUIRE(d.device_type == kDLCUDA, "EP: the group's device must be a CUDA device (got ",
                 api::device_name(d), ")");
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  MOEKIT_REQUIRE(d.device_id >= 0 && d.device_id < n, "EP: no CUDA device ", d.device_id, " (", n, " found)");
  cudaDeviceProp p{};
  cuda_ok(cudaGetDeviceProperties(&p, d.device_id), "cudaGetDeviceProperties");
  MOEKIT_REQUIRE(p.major == 9 && p.minor == 0, "EP: device ", d.device_id, " is sm_", p.major, p.minor,
                 "; the EP layer's experts need an SM90 GPU (H100, H200)");
}

#endif

}  // namespace

#ifdef MOEKIT_WITH_CUDA

// ---- group ----------------------------------------------------------------------------------

struct EpGroup::Impl {
  std::shared_ptr<void> comm;  // ncclComm_t; destroyed with the last holder when the group made it
  int world = 0, rank = 0;
  DLDevice device{kDLCUDA, 0};
  std::string transport = "nvlink";
  std::shared_ptr<ep::Arena> arena;
  int next_layer = 0;
  // The id of the layer whose call ran last on the group (its layers share the arena's scratch,
  // so a layer's combine must follow its own dispatch with nothing of another layer between).
  std::shared_ptr<int> turn = std::make_shared<int>(-1);
};

EpGroup::EpGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EpGroup::~EpGroup() = default;

namespace {

void check_transport(const std::string& t) {
  MOEKIT_REQUIRE(t == "auto" || t == "nvlink" || t == "host", "EpGroup: transport '", t, "' (auto | nvlink | host)");
}

void finish_group(std::shared_ptr<void> comm, DLDevice device, const std::string& transport,
                  std::unique_ptr<EpGroup::Impl>* out) {
  auto m = std::make_unique<EpGroup::Impl>();
  m->comm = std::move(comm);
  m->device = device;
  m->world = ep::NcclWindow::comm_size(m->comm.get());
  m->rank = ep::NcclWindow::comm_rank(m->comm.get());
  const int lsa = ep::NcclWindow::lsa_ranks(m->comm.get());
  // Every rank sees the same team sizes, so every rank picks the same path.
  MOEKIT_REQUIRE(transport != "nvlink" || lsa == m->world, "EpGroup: transport nvlink, but only ", lsa, " of ",
                 m->world, " ranks share load/store access (one NVLink domain)");
  const bool host = transport == "host" || (transport == "auto" && lsa != m->world);
  m->transport = host ? "host" : "nvlink";
  m->arena = ep::Arena::create_nccl(m->comm.get(), m->world, host);
  *out = std::move(m);
}

}  // namespace

Status EpGroup::create(std::span<const uint8_t> unique_id, int world, int rank, DLDevice device,
                       std::unique_ptr<EpGroup>* out, const std::string& transport) {
  return guarded([&] {
    check_transport(transport);
    MOEKIT_REQUIRE(out, "EpGroup::create: null output");
    MOEKIT_REQUIRE(unique_id.size() == size_t(ep::NcclWindow::kUniqueIdBytes), "EpGroup::create: the unique id has ",
                   unique_id.size(), " bytes, expected ", ep::NcclWindow::kUniqueIdBytes, " (ep_unique_id)");
    MOEKIT_REQUIRE(world >= 1 && world <= 64, "EpGroup::create: world ", world, " (1..64)");
    MOEKIT_REQUIRE(rank >= 0 && rank < world, "EpGroup::create: rank ", rank, " of ", world);
    check_device(device);
    cuda_ok(cudaSetDevice(device.device_id), "cudaSetDevice");
    void* c = ep::NcclWindow::init_rank(std::vector<uint8_t>(unique_id.begin(), unique_id.end()), world, rank);
    std::shared_ptr<void> comm(c, [](void* p) { ep::NcclWindow::destroy_comm(p); });
    std::unique_ptr<Impl> m;
    finish_group(std::move(comm), device, transport, &m);
    out->reset(new EpGroup(std::move(m)));
  });
}

Status EpGroup::create_from_comm(void* nccl_comm, DLDevice device, std::unique_ptr<EpGroup>* out,
                                 const std::string& transport) {
  return guarded([&] {
    check_transport(transport);
    MOEKIT_REQUIRE(out, "EpGroup::create_from_comm: null output");
    MOEKIT_REQUIRE(nccl_comm, "EpGroup::create_from_comm: null communicator");
    check_device(device);
    cuda_ok(cudaSetDevice(device.device_id), "cudaSetDevice");
    std::shared_ptr<void> comm(nccl_comm, [](void*) {});  // the caller's
    std::unique_ptr<Impl> m;
    finish_group(std::move(comm), device, transport, &m);
    out->reset(new EpGroup(std::move(m)));
  });
}

int EpGroup::world() const { return impl_->world; }
int EpGroup::rank() const { return impl_->rank; }
DLDevice EpGroup::device() const { return impl_->device; }
const std::string& EpGroup::transport() const { return impl_->transport; }
Status EpGroup::barrier() {
  return guarded([&] {
    const api::DeviceScope on(impl_->device);
    ep::NcclWindow::comm_barrier(impl_->comm.get());
  });
}

Status ep_unique_id(std::vector<uint8_t>* id) {
  return guarded([&] {
    MOEKIT_REQUIRE(id, "ep_unique_id: null output");
    *id = ep::NcclWindow::unique_id();
  });
}

// ---- layer ------------------------------------------------------------------------------------

struct EpLayer::Impl {
  LayerSpec spec;
  EpOptions options;
  std::shared_ptr<void> comm;  // keeps the communicator alive as long as the layer
  DLDevice device{kDLCUDA, 0};
  int world = 0, rank = 0;
  ep::GroupConfig gc;
  std::unique_ptr<moekit::ParallelLayer> layer;  // backends/ep_layer.h
  float* score_bias = nullptr;             // device [E] (sigmoid routing with a bias)
  std::shared_ptr<int> turn;               // the group's (EpGroup::Impl::turn)
  int id = 0;                              // this layer's id in the group
  // The split calls: the tensors of the dispatch that combine follows, and whether one is pending.
  ep::RankInput split;
  bool dispatched = false;
  ~Impl() {
    if (score_bias) cudaFree(score_bias);
  }
};

EpLayer::EpLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EpLayer::~EpLayer() {
  if (impl_) {
    const api::DeviceScope on(impl_->device);
    impl_->layer.reset();
  }
}

namespace {

// The rank's weights from the checkpoint (its experts' tensors, or all E), and the router's
// score bias [E] when the checkpoint has one.
LayerWeights local_weights(const LayerSpec& spec, int world, int rank, std::span<const NamedTensor> ck,
                           std::vector<std::vector<uint8_t>>* host, std::vector<float>* score_bias) {
  const int El = spec.num_experts / world;
  // The score bias is the router's ([E] whatever the experts' split): apart from the experts.
  std::vector<NamedTensor> experts;
  const NamedTensor* bias = nullptr;
  for (const NamedTensor& t : ck) {
    if (t.name == "e_score_correction_bias") bias = &t;
    else experts.push_back(t);
  }
  MOEKIT_REQUIRE(!spec.score_bias || bias, "checkpoint: no e_score_correction_bias, but spec.score_bias is set");
  MOEKIT_REQUIRE(spec.score_bias || !bias, "checkpoint: e_score_correction_bias given, but spec.score_bias is not set");
  if (bias) {
    std::vector<NamedTensor> one{*bias};
    const std::vector<CheckpointTensor> t = api::host_checkpoint(spec, one, host);
    MOEKIT_REQUIRE(t[0].dtype == "F32" && t[0].shape == std::vector<int64_t>{spec.num_experts},
                   "checkpoint tensor e_score_correction_bias: expected F32 [", spec.num_experts, "], got ", t[0].dtype,
                   " ", api::shape_str(bias->tensor));
    score_bias->assign(reinterpret_cast<const float*>(t[0].data), reinterpret_cast<const float*>(t[0].data) + spec.num_experts);
  }
  MOEKIT_REQUIRE(!experts.empty(), "checkpoint: no expert tensors");
  // Local or all experts: the leading dimension of the first expert tensor says which.
  const int64_t lead = experts[0].tensor.ndim > 0 ? experts[0].tensor.shape[0] : -1;
  LayerSpec s = spec;
  s.score_bias = false;
  if (lead == El && El != spec.num_experts) {
    s.num_experts = El;
    const std::vector<CheckpointTensor> t = api::host_checkpoint(s, experts, host);
    return weights_from_checkpoint(s, t, "checkpoint (this rank's " + std::to_string(El) + " experts)");
  }
  MOEKIT_REQUIRE(lead == spec.num_experts, "checkpoint tensor ", experts[0].name, ": leading dimension ", lead,
                 ", expected this rank's ", El, " experts or all ", spec.num_experts);
  const std::vector<CheckpointTensor> t = api::host_checkpoint(s, experts, host);
  const LayerWeights all = weights_from_checkpoint(s, t, "checkpoint");
  return slice_experts(all, rank * El, El);
}

// Where the forward calls' tensors are and what they hold.
struct Call {
  int64_t T = 0;
  ep::RankInput in;
};

}  // namespace

Status EpLayer::create(EpGroup& group, const LayerSpec& spec_in, const EpOptions& options,
                       std::span<const NamedTensor> checkpoint, std::unique_ptr<EpLayer>* out) {
  return guarded([&] {
    MOEKIT_REQUIRE(out, "EpLayer::create: null output");
    EpGroup::Impl& g = *group.impl_;
    LayerSpec spec = spec_in;
    spec.max_tokens = std::max<int64_t>(spec.max_tokens, 1);
    validate_spec(spec, "layer spec");
    // Its experts (Sm90Layer::enqueue_experts on the dispatched rows) take bf16 rows only, and the
    // dispatch has no fp8 payload yet: never bf16 in place of the fp8 asked for.
    MOEKIT_REQUIRE(spec.activation_dtype == ActivationDtype::kBf16, "EP layer: no ", describe_activations(spec),
                   " activations (its experts take bf16 rows from the dispatch only; the single-GPU sm90 "
                   "backends run fp8)");
    const ParsedOptions po = parse_options(options, g.world);
    MOEKIT_REQUIRE(spec.num_experts % g.world == 0, "EP: ", spec.num_experts, " experts do not divide over ",
                   g.world, " ranks");
    const api::DeviceScope on(g.device);
    auto m = std::make_unique<Impl>();
    m->spec = spec;
    m->spec.max_tokens = po.T;
    m->options = options;
    m->comm = g.comm;
    m->device = g.device;
    m->world = g.world;
    m->rank = g.rank;
    m->turn = g.turn;
    m->id = g.next_layer;
    ep::GroupConfig& gc = m->gc;
    ep::Shape& sh = gc.shape;
    sh.world = g.world;
    sh.num_experts = spec.num_experts;
    sh.top_k = spec.top_k;
    sh.hidden = spec.hidden;
    sh.hidden_pad = int(sm90::pad_to(spec.hidden, sm90::kAlign));
    sh.max_tokens = int(po.T);
    MOEKIT_REQUIRE(po.capacity < (int64_t(1) << 31) / std::max(1, sh.local_experts()), "EP options: expert_capacity ",
                   po.capacity, " is too large");
    sh.capacity = int(po.capacity);
    sh.payload = ep::Payload(po.payload);
    sh.combine = ep::CombineRows(po.combine);
    ep::validate(sh);
    gc.timeout_ns = po.timeout_ns;
    gc.dispatch = po.dispatch;
    gc.nvfp4_g = po.payload == 2 ? options.nvfp4_global_scale : 1.0f;
    gc.mx_rule = po.rceil ? ScaleRule::kRceil : ScaleRule::kFloor;
    std::vector<std::vector<uint8_t>> host;
    std::vector<float> bias;
    LayerWeights w;
    const bool synthetic = checkpoint.empty();
    if (!synthetic) w = local_weights(spec, g.world, g.rank, checkpoint, &host, &bias);
    gc.route = routing_params(spec, {});
    if (!bias.empty()) {
      cuda_ok(cudaMalloc(&m->score_bias, bias.size() * 4), "cudaMalloc");
      cuda_ok(cudaMemcpy(m->score_bias, bias.data(), bias.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
      gc.route.score_bias = m->score_bias;
    } else if (spec.score_bias && synthetic) {
      // Synthetic weights with a score bias: zeros (the choice is the plain sigmoid's).
      cuda_ok(cudaMalloc(&m->score_bias, size_t(spec.num_experts) * 4), "cudaMalloc");
      cuda_ok(cudaMemset(m->score_bias, 0, size_t(spec.num_experts) * 4), "cudaMemset");
      gc.route.score_bias = m->score_bias;
    }
    MoeConfig cfg = spec;
    cfg.max_tokens = po.T;
    m->layer = std::make_unique<moekit::ParallelLayer>(cfg, synthetic ? nullptr : &w, gc, g.arena, g.next_layer++);
    if (options.kernel != "auto")
      m->layer->set_kernels(options.kernel == "decode" ? ParallelLayer::Kernels::kDecode
                                                       : ParallelLayer::Kernels::kPrefill);
    out->reset(new EpLayer(std::move(m)));
  });
}

const LayerSpec& EpLayer::spec() const { return impl_->spec; }
int EpLayer::first_expert() const { return impl_->rank * (impl_->spec.num_experts / impl_->world); }
int EpLayer::local_experts() const { return impl_->spec.num_experts / impl_->world; }

namespace {

// The checks of a forward call's token tensors: x [T, H] (16-byte aligned rows), out and shared
// [T, H] (8-byte aligned rows).
Call token_call(const EpLayer::Impl& m, const DLTensor& x, const DLTensor& out, const DLTensor* shared) {
  const LayerSpec& s = m.spec;
  Call c;
  c.T = x.ndim > 0 ? x.shape[0] : -1;
  MOEKIT_REQUIRE(c.T >= 0, "x: shape ", api::shape_str(x), ", expected [T, ", s.hidden, "]");
  MOEKIT_REQUIRE(c.T <= m.options.max_tokens_per_rank, "x: ", c.T, " tokens exceed max_tokens_per_rank = ",
                 m.options.max_tokens_per_rank);
  const Checked cx = api::check_tensor(x, "x", Kind::kBf16, {c.T, s.hidden}, m.device, true, 16);
  c.in.T = c.T;
  c.in.x = static_cast<const uint16_t*>(cx.data);
  c.in.x_stride = c.T > 0 ? cx.stride[0] : s.hidden;
  MOEKIT_REQUIRE(c.in.x_stride % 8 == 0, "x: the row stride must be a multiple of 8 elements");
  const Checked co = api::check_tensor(out, "out", Kind::kBf16, {c.T, s.hidden}, m.device, true, 8);
  c.in.y = static_cast<uint16_t*>(co.data);
  c.in.y_stride = c.T > 0 ? co.stride[0] : s.hidden;
  MOEKIT_REQUIRE(c.in.y_stride % 4 == 0, "out: the row stride must be a multiple of 4 elements");
  if (shared) {
    const Checked cs = api::check_tensor(*shared, "shared", Kind::kBf16, {c.T, s.hidden}, m.device, true, 8);
    c.in.shared = static_cast<const uint16_t*>(cs.data);
    c.in.shared_stride = c.T > 0 ? cs.stride[0] : s.hidden;
    MOEKIT_REQUIRE(c.in.shared_stride % 4 == 0, "shared: the row stride must be a multiple of 4 elements");
  }
  return c;
}

void run(EpLayer::Impl& m, const Call& c, void* stream) {
  const api::DeviceScope on(m.device);
  *m.turn = m.id;
  m.dispatched = false;
  m.layer->set_inputs({c.in});
  m.layer->forward(static_cast<cudaStream_t>(stream));
}

}  // namespace

Status EpLayer::forward_logits(const DLTensor& x, const DLTensor& logits, const DLTensor& out, void* stream,
                               const DLTensor* shared, const DLTensor* topk_ids, const DLTensor* topk_weights) {
  return guarded([&] {
    Impl& m = *impl_;
    MOEKIT_REQUIRE(m.spec.hash_vocab == 0, "EP layer: a hash-routed layer (DeepSeek-V4's first layers) picks its experts by ",
                   "token id: route it with its table and call forward_topk");
    Call c = token_call(m, x, out, shared);
    const LayerSpec& s = m.spec;
    c.in.logits = static_cast<const float*>(
        api::check_tensor(logits, "logits", Kind::kF32, {c.T, s.num_experts}, m.device, false, 4).data);
    MOEKIT_REQUIRE(!topk_ids == !topk_weights, "topk_ids and topk_weights come together");
    if (topk_ids) {
      c.in.ids = static_cast<const int32_t*>(
          api::check_tensor(*topk_ids, "topk_ids", Kind::kI32, {c.T, s.top_k}, m.device, false).data);
      c.in.weights = static_cast<const float*>(
          api::check_tensor(*topk_weights, "topk_weights", Kind::kF32, {c.T, s.top_k}, m.device, false).data);
    }
    run(m, c, stream);
  });
}

Status EpLayer::forward_topk(const DLTensor& x, const DLTensor& topk_ids, const DLTensor& topk_weights,
                             const DLTensor& out, void* stream, const DLTensor* shared) {
  return guarded([&] {
    Impl& m = *impl_;
    Call c = token_call(m, x, out, shared);
    const LayerSpec& s = m.spec;
    c.in.ids = static_cast<const int32_t*>(
        api::check_tensor(topk_ids, "topk_ids", Kind::kI32, {c.T, s.top_k}, m.device, false).data);
    c.in.weights = static_cast<const float*>(
        api::check_tensor(topk_weights, "topk_weights", Kind::kF32, {c.T, s.top_k}, m.device, false).data);
    run(m, c, stream);
  });
}

int64_t EpLayer::batched_workspace_bytes(int64_t rows_per_expert) const {
  return impl_->layer->experts_layer().workspace_bytes(ForwardCall::kBatched, std::max<int64_t>(rows_per_expert, 0), 1);
}

Status EpLayer::forward_batched(const DLTensor& x, const DLTensor& expert_num_tokens, const DLTensor& out,
                                const DLTensor& workspace, void* stream) {
  return guarded([&] {
    Impl& m = *impl_;
    const LayerSpec& s = m.spec;
    const int El = local_experts();
    const int64_t M = x.ndim == 3 ? x.shape[1] : -1;
    MOEKIT_REQUIRE(M >= 0, "x: shape ", api::shape_str(x), ", expected [", El, ", M, ", s.hidden, "]");
    MOEKIT_REQUIRE(M <= int64_t(m.world) * m.options.max_tokens_per_rank, "x: ", M,
                   " rows per expert exceed world x max_tokens_per_rank = ",
                   int64_t(m.world) * m.options.max_tokens_per_rank);
    ForwardCall c;
    c.entry = ForwardCall::kBatched;
    c.T = M;
    c.k = 1;
    c.stream = stream;
    const Checked cx = api::check_tensor(x, "x", Kind::kBf16, {El, M, s.hidden}, m.device, true, 2);
    c.x = static_cast<const uint16_t*>(cx.data);
    c.x_expert_stride = cx.stride[0];
    c.x_stride = M > 0 ? cx.stride[1] : s.hidden;
    c.counts = static_cast<const int32_t*>(
        api::check_tensor(expert_num_tokens, "expert_num_tokens", Kind::kI32, {El}, m.device, false).data);
    const Checked co = api::check_tensor(out, "out", Kind::kBf16, {El, M, s.hidden}, m.device, true, 0);
    c.y = static_cast<uint16_t*>(co.data);
    c.y_expert_stride = co.stride[0];
    c.y_stride = M > 0 ? co.stride[1] : s.hidden;
    const Checked w = api::check_tensor(workspace, "workspace", Kind::kBytes, Want::any(), m.device, false);
    const int64_t need = batched_workspace_bytes(M);
    MOEKIT_REQUIRE(api::bytes_of(workspace) >= need, "workspace: ", api::bytes_of(workspace),
                   " bytes, the call needs ", need, " (batched_workspace_bytes)");
    MOEKIT_REQUIRE(reinterpret_cast<uintptr_t>(w.data) % 256 == 0, "workspace: data must be 256-byte aligned");
    c.workspace = w.data;
    const api::DeviceScope on(m.device);
    m.layer->experts_layer().enqueue(c);
  });
}

namespace {

void require_split(const EpLayer::Impl& m) {
  MOEKIT_REQUIRE(m.options.combine == "bf16", "EP layer: dispatch / combine need EpOptions.combine = \"bf16\" ",
                 "(the experts' outputs are unweighted bf16 rows, weighted by combine with the weights it is "
                 "given; \"bf16_sum\" weights them on the experts' rank with dispatch's); this layer has \"",
                 m.options.combine, "\"");
}

}  // namespace

Status EpLayer::batch(EpBatch* out) const {
  return guarded([&] {
    MOEKIT_REQUIRE(out, "EpLayer::batch: null output");
    Impl& m = *impl_;
    require_split(m);
    const api::DeviceScope on(m.device);
    const ep::Shape& sh = m.gc.shape;
    const ep::RankView v = m.layer->group().view(0);
    EpBatch b;
    b.local_experts = sh.local_experts();
    b.capacity = sh.capacity;
    b.hidden = sh.hidden;
    b.x = v.rows;
    b.x_row_stride = sh.hidden_pad;
    b.x_expert_stride = int64_t(sh.capacity) * sh.hidden_pad;
    b.expert_num_tokens = v.expert_rows;
    b.expert_out = v.y_bf16;
    *out = b;
  });
}

Status EpLayer::dispatch(const DLTensor& x, const DLTensor& topk_ids, const DLTensor& topk_weights, void* stream) {
  return guarded([&] {
    Impl& m = *impl_;
    require_split(m);
    const LayerSpec& s = m.spec;
    const int64_t T = x.ndim > 0 ? x.shape[0] : -1;
    MOEKIT_REQUIRE(T >= 0, "x: shape ", api::shape_str(x), ", expected [T, ", s.hidden, "]");
    MOEKIT_REQUIRE(T <= m.options.max_tokens_per_rank, "x: ", T, " tokens exceed max_tokens_per_rank = ",
                   m.options.max_tokens_per_rank);
    const Checked cx = api::check_tensor(x, "x", Kind::kBf16, {T, s.hidden}, m.device, true, 16);
    ep::RankInput in;
    in.T = T;
    in.x = static_cast<const uint16_t*>(cx.data);
    in.x_stride = T > 0 ? cx.stride[0] : s.hidden;
    MOEKIT_REQUIRE(in.x_stride % 8 == 0, "x: the row stride must be a multiple of 8 elements");
    in.ids = static_cast<const int32_t*>(
        api::check_tensor(topk_ids, "topk_ids", Kind::kI32, {T, s.top_k}, m.device, false).data);
    in.weights = static_cast<const float*>(
        api::check_tensor(topk_weights, "topk_weights", Kind::kF32, {T, s.top_k}, m.device, false).data);
    const api::DeviceScope on(m.device);
    // combine's output is not known yet: the expert-output rows stand in (dispatch writes no y;
    // combine records the real one).
    in.y = m.layer->group().view(0).y_bf16;
    in.y_stride = s.hidden;
    m.layer->set_inputs({in});
    *m.turn = m.id;
    m.dispatched = false;
    m.layer->dispatch(static_cast<cudaStream_t>(stream));
    m.split = in;
    m.dispatched = true;
  });
}

Status EpLayer::combine(const DLTensor& expert_out, const DLTensor& out, void* stream, const DLTensor* topk_weights,
                        const DLTensor* shared) {
  return guarded([&] {
    Impl& m = *impl_;
    require_split(m);
    MOEKIT_REQUIRE(m.dispatched && *m.turn == m.id, "EP layer: combine without this layer's dispatch before it ",
                   "(or with another call of the group's layers in between)");
    const LayerSpec& s = m.spec;
    const ep::Shape& sh = m.gc.shape;
    ep::RankInput in = m.split;
    const int64_t T = in.T;
    const Checked co = api::check_tensor(out, "out", Kind::kBf16, {T, s.hidden}, m.device, true, 8);
    in.y = static_cast<uint16_t*>(co.data);
    in.y_stride = T > 0 ? co.stride[0] : s.hidden;
    MOEKIT_REQUIRE(in.y_stride % 4 == 0, "out: the row stride must be a multiple of 4 elements");
    if (shared) {
      const Checked cs = api::check_tensor(*shared, "shared", Kind::kBf16, {T, s.hidden}, m.device, true, 8);
      in.shared = static_cast<const uint16_t*>(cs.data);
      in.shared_stride = T > 0 ? cs.stride[0] : s.hidden;
      MOEKIT_REQUIRE(in.shared_stride % 4 == 0, "shared: the row stride must be a multiple of 4 elements");
    }
    if (topk_weights)
      in.weights = static_cast<const float*>(
          api::check_tensor(*topk_weights, "topk_weights", Kind::kF32, {T, s.top_k}, m.device, false).data);
    const int64_t El = sh.local_experts();
    const Checked ce =
        api::check_tensor(expert_out, "expert_out", Kind::kBf16, {El, sh.capacity, s.hidden}, m.device, true, 2);
    const api::DeviceScope on(m.device);
    const ep::RankView v = m.layer->group().view(0);
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (ce.data != static_cast<void*>(v.y_bf16) || ce.stride[0] != int64_t(sh.capacity) * s.hidden ||
        ce.stride[1] != s.hidden) {
      // The caller's tensor: its valid rows into the rows combine reads.
      m.layer->stage_expert_rows(static_cast<const uint16_t*>(ce.data), ce.stride[1], ce.stride[0], st);
    }
    m.layer->set_inputs({in});
    m.layer->combine(st);
    m.dispatched = false;
  });
}

Status EpLayer::check(void* stream) {
  return guarded([&] {
    Impl& m = *impl_;
    const api::DeviceScope on(m.device);
    const std::string err = m.layer->group().check(static_cast<cudaStream_t>(stream));
    MOEKIT_REQUIRE(err.empty(), err);
    MOEKIT_REQUIRE(!m.layer->group().plan_error(static_cast<cudaStream_t>(stream)),
                   "EP layer: a top-k id was out of range [-1, E) (its slot was skipped)");
    MOEKIT_REQUIRE(m.layer->experts_layer().plan_error(static_cast<cudaStream_t>(stream)) == 0,
                   "EP layer: a batched count exceeded its capacity (the rows past it were skipped)");
  });
}

Status EpLayer::reset() {
  return guarded([&] {
    const api::DeviceScope on(impl_->device);
    impl_->layer->group().reset();
  });
}

#else  // built without CUDA

struct EpGroup::Impl {
  std::string transport;
};
struct EpLayer::Impl {
  LayerSpec spec;
};
EpGroup::EpGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EpGroup::~EpGroup() = default;
EpLayer::EpLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EpLayer::~EpLayer() = default;

namespace {
Status no_cuda() { return {StatusCode::kUnsupported, "EP: this moekit was built without CUDA"}; }
}  // namespace

Status ep_unique_id(std::vector<uint8_t>*) { return no_cuda(); }
Status EpGroup::create(std::span<const uint8_t>, int, int, DLDevice, std::unique_ptr<EpGroup>*, const std::string&) {
  return no_cuda();
}
Status EpGroup::create_from_comm(void*, DLDevice, std::unique_ptr<EpGroup>*, const std::string&) { return no_cuda(); }
int EpGroup::world() const { return 0; }
int EpGroup::rank() const { return 0; }
DLDevice EpGroup::device() const { return {kDLCPU, 0}; }
const std::string& EpGroup::transport() const { return impl_->transport; }
Status EpGroup::barrier() { return no_cuda(); }
Status EpLayer::create(EpGroup&, const LayerSpec&, const EpOptions& o, std::span<const NamedTensor>,
                       std::unique_ptr<EpLayer>*) {
  const Status st = guarded([&] { parse_options(o, 1); });
  return st.ok() ? no_cuda() : st;
}
const LayerSpec& EpLayer::spec() const { return impl_->spec; }
int EpLayer::first_expert() const { return 0; }
int EpLayer::local_experts() const { return 0; }
Status EpLayer::forward_logits(const DLTensor&, const DLTensor&, const DLTensor&, void*, const DLTensor*,
                               const DLTensor*, const DLTensor*) {
  return no_cuda();
}
Status EpLayer::forward_topk(const DLTensor&, const DLTensor&, const DLTensor&, const DLTensor&, void*,
                             const DLTensor*) {
  return no_cuda();
}
Status EpLayer::forward_batched(const DLTensor&, const DLTensor&, const DLTensor&, const DLTensor&, void*) {
  return no_cuda();
}
int64_t EpLayer::batched_workspace_bytes(int64_t) const { return 0; }
Status EpLayer::batch(EpBatch*) const { return no_cuda(); }
Status EpLayer::dispatch(const DLTensor&, const DLTensor&, const DLTensor&, void*) { return no_cuda(); }
Status EpLayer::combine(const DLTensor&, const DLTensor&, void*, const DLTensor*, const DLTensor*) { return no_cuda(); }
Status EpLayer::check(void*) { return no_cuda(); }
Status EpLayer::reset() { return no_cuda(); }

#endif

}  // namespace moekit
