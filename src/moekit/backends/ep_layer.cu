#include "moekit/backends/ep_layer.h"

#include <cuda_runtime.h>

#include "moekit/backends/sm90_layer.h"
#include "moekit/comm/ep_host.h"
#include "moekit/common/error.h"
#include "moekit/backends/sm90_backend.h"
#include "moekit/oracle/tuning.h"
#include "moekit/pipeline/prepare_batched_sm90.cuh"

namespace moekit {

namespace {

InputQuant quant_of(ep::Payload p) {
  return p == ep::Payload::kMxfp8 ? InputQuant::kMxfp8 : p == ep::Payload::kNvfp4 ? InputQuant::kNvfp4 : InputQuant::kNone;
}

}  // namespace

MoeConfig ep_rank_config(MoeConfig c, const ep::Shape& s) {
  c.num_experts = s.local_experts();
  c.score_bias = false;
  c.scoring = Scoring::kSoftmax;
  c.n_group = c.topk_group = 1;
  c.max_tokens = int64_t(s.world) * s.max_tokens;
  c.activation_format = ActivationFormat::kBatched;
  return c;
}

PrepareContract ep_prepare_contract(ep::Payload payload, QuantizeSide side) {
  PrepareContract c;
  c.name = std::string("ep_") + ep::payload_name(payload);
  c.format = ActivationFormat::kBatched;
  c.quant = quant_of(payload);
  c.side = side;
  c.hands_bf16 = true;
  return c;
}

LayerWeights slice_experts(const LayerWeights& w, int e0, int n) {
  LayerWeights s = w;
  s.cfg.num_experts = n;
  for (WeightMatrix* m : {&s.w13, &s.w2}) {
    const int64_t rows = m->N * e0;
    m->E = n;
    m->codes += rows * m->code_row;
    if (m->scales) m->scales += rows * m->scale_row;
    if (!m->scale_2.empty())
      m->scale_2 = std::vector<float>(m->scale_2.begin() + int64_t(e0) * m->halves,
                                      m->scale_2.begin() + int64_t(e0 + n) * m->halves);
  }
  const int64_t I2 = 2 * int64_t(w.cfg.intermediate), H = w.cfg.hidden;
  if (!w.b13.empty()) s.b13.assign(w.b13.begin() + e0 * I2, w.b13.begin() + (e0 + n) * I2);
  if (!w.b2.empty()) s.b2.assign(w.b2.begin() + e0 * H, w.b2.begin() + (e0 + n) * H);
  s.score_bias.clear();
  s.cfg.score_bias = false;
  return s;
}

void ParallelLayer::check_pairing(const LayerWeights& w, const ep::GroupConfig& g, QuantizeSide side) {
  MOEKIT_REQUIRE(w.cfg.num_experts == g.shape.num_experts && w.cfg.hidden == g.shape.hidden,
                 "EP layer: the group's shape does not match the layer's");
  // The oracle's pairing rule, before anything is allocated.
  const Backend* b = nullptr;
  for (const Backend* c : sm90_backends())
    if (c->caps().name == "sm90_batched") b = c;
  MOEKIT_REQUIRE(b != nullptr, "EP layer: no sm90_batched backend in this build");
  const Support ok = pair_supports(ep_prepare_contract(g.shape.payload, side), b->caps());
  MOEKIT_REQUIRE(ok.ok, "EP layer: ", ok.reason);
}

void ParallelLayer::add_rank(const LayerWeights& w, const ep::Shape& sh, int r) {
  const int El = sh.local_experts();
  LayerWeights s = slice_experts(w, r * El, El);
  s.cfg = ep_rank_config(w.cfg, sh);
  s.cfg.biases = !s.b13.empty() || !s.b2.empty();
  experts_.push_back(std::make_unique<Sm90Layer>(s, ActivationFormat::kBatched));
}

ParallelLayer::ParallelLayer(const LayerWeights& w, const ep::GroupConfig& g, int device, QuantizeSide side) {
  check_pairing(w, g, side);
  cudaSetDevice(device);
  for (int r = 0; r < g.shape.world; ++r) add_rank(w, g.shape, r);
  finish(g);
  group_ = ep::Group::create_virtual(g, device);
  alloc_workspace(g);
}

ParallelLayer::ParallelLayer(const LayerWeights& w, const ep::GroupConfig& g, void* nccl_comm, QuantizeSide side) {
  check_pairing(w, g, side);
  group_ = ep::Group::create_nccl(g, nccl_comm);  // collective; the rank comes from the communicator
  add_rank(w, g.shape, group_->rank(0));
  finish(g);
  alloc_workspace(g);
}

ParallelLayer::ParallelLayer(const MoeConfig& cfg, const ep::GroupConfig& g, uint64_t seed, int device) {
  cudaSetDevice(device);
  for (int r = 0; r < g.shape.world; ++r)
    experts_.push_back(std::make_unique<Sm90Layer>(ep_rank_config(cfg, g.shape), ActivationFormat::kBatched, seed + r));
  finish(g);
  group_ = ep::Group::create_virtual(g, device);
  alloc_workspace(g);
}

ParallelLayer::ParallelLayer(const MoeConfig& cfg, const ep::GroupConfig& g, uint64_t seed, void* nccl_comm) {
  group_ = ep::Group::create_nccl(g, nccl_comm);
  const int r = group_->rank(0);
  experts_.push_back(std::make_unique<Sm90Layer>(ep_rank_config(cfg, g.shape), ActivationFormat::kBatched, seed + r));
  finish(g);
  alloc_workspace(g);
}

ParallelLayer::ParallelLayer(const MoeConfig& cfg, const LayerWeights* local, const ep::GroupConfig& g,
                 std::shared_ptr<ep::Arena> arena, int layer, uint64_t seed) {
  MOEKIT_REQUIRE(arena && arena->local_ranks() == 1, "EP layer: an arena of one local rank");
  const int r = arena->rank(0);
  if (local) {
    MOEKIT_REQUIRE(local->cfg.num_experts == g.shape.local_experts() && local->cfg.hidden == g.shape.hidden,
                   "EP layer: the rank's weights have ", local->cfg.num_experts, " experts of hidden size ",
                   local->cfg.hidden, ", the group's shape ", g.shape.local_experts(), " of ", g.shape.hidden);
    LayerWeights w = *local;
    w.cfg = ep_rank_config(cfg, g.shape);
    w.cfg.biases = !w.b13.empty() || !w.b2.empty();
    experts_.push_back(std::make_unique<Sm90Layer>(w, ActivationFormat::kBatched));
  } else {
    experts_.push_back(std::make_unique<Sm90Layer>(ep_rank_config(cfg, g.shape), ActivationFormat::kBatched, seed + r));
  }
  finish(g);
  // The experts' scratch lives in the arena after the group's (the layers take turns).
  own_ws_ = false;
  ws_.assign(1, nullptr);
  group_ = ep::Group::create_in(g, std::move(arena), layer, experts_scratch(g));
}

int64_t ParallelLayer::experts_scratch(const ep::GroupConfig& g) const {
  return (experts_.front()->experts_workspace_bytes(g.shape.rows()) + 255) / 256 * 256;
}

void ParallelLayer::set_kernels(Kernels k) {
  for (auto& e : experts_) {
    if (k == Kernels::kDecode) {
      e->set_prefill_from(-1);
    } else if (k == Kernels::kPrefill) {
      MOEKIT_REQUIRE(e->prefill_supported(), "EP layer: these weights have scales only the decode kernel runs");
      e->set_prefill_from(0);
    } else {
      // The crossover of the rank's experts (E / R experts, k, H, I) on its device, as the sm90
      // backends take it (oracle/tuning.h): the single-GPU layer's on one rank's share.
      int dev = 0;
      cudaGetDevice(&dev);
      const KernelCrossover x = sm90_crossover(e->config(), DeviceInfo::detect(dev));
      e->set_prefill_from(e->prefill_supported() ? x.prefill_from : -1);
    }
  }
}

void ParallelLayer::finish(const ep::GroupConfig& g) {
  check_stride(g);
  set_kernels(Kernels::kAuto);
}

void ParallelLayer::check_stride(const ep::GroupConfig& g) const {
  MOEKIT_REQUIRE(g.shape.hidden_pad == experts_.front()->x_stride(), "EP layer: payload row stride ",
                 g.shape.hidden_pad, ", the experts read rows of ", experts_.front()->x_stride());
}

void ParallelLayer::alloc_workspace(const ep::GroupConfig& g) {
  for (auto& e : experts_) {
    void* p = nullptr;
    const int64_t bytes = e->experts_workspace_bytes(g.shape.rows());
    if (cudaMalloc(&p, size_t(bytes)) != cudaSuccess) fail("EP layer: cannot allocate ", bytes, " bytes of workspace");
    ws_.push_back(p);
  }
}

ParallelLayer::~ParallelLayer() {
  if (own_ws_)
    for (void* p : ws_) cudaFree(p);
}

void ParallelLayer::experts(cudaStream_t s) {
  const ep::Shape& sh = group_->config().shape;
  for (int i = 0; i < group_->local_ranks(); ++i) {
    const ep::RankView v = group_->view(i);
    Sm90Layer::ExpertsCall c;
    c.in = v.rows;
    c.rows = sh.rows();
    c.routed_rows = int64_t(sh.world) * sh.max_tokens * sh.top_k;
    c.num_active = v.num_active;
    c.expert = v.expert;
    c.count = v.count;
    c.row_start = v.row_start;
    c.chunk_prefix = v.chunk_prefix;
    c.row_src = v.row_src;
    c.weights = v.weights;
    c.out = v.y;
    c.workspace = own_ws_ ? ws_[size_t(i)] : v.extra;
    // The kernel, its shape and chunks as for the rank's own tokens (each rank's experts get
    // about T x k rows): the single-GPU layer's choice on one rank's share.
    int64_t T = 0;
    for (int j = 0; j < group_->local_ranks(); ++j) T = std::max(T, group_->tokens(j));
    c.tokens = std::max<int64_t>(T, 1);
    c.k = sh.top_k;
    experts_[size_t(i)]->enqueue_experts(c, s);
    // bf16 combine rows: GEMM2's unweighted fp32 rows rounded once into the window.
    if (ep::bf16_rows(sh.combine)) {
      const cudaError_t e = sm90::launch_store_batched(v.y, v.expert_rows, sh.local_experts(), sh.capacity, sh.hidden,
                                                       v.y_bf16, sh.hidden, int64_t(sh.capacity) * sh.hidden, s, true);
      if (e != cudaSuccess) fail("EP layer: storing the bf16 combine rows: ", cudaGetErrorString(e));
    }
  }
}

void ParallelLayer::stage_expert_rows(const uint16_t* src, int64_t row_stride, int64_t expert_stride, cudaStream_t s) {
  const ep::Shape& sh = group_->config().shape;
  MOEKIT_REQUIRE(ep::bf16_rows(sh.combine), "EP layer: the experts' rows are staged for bf16 combine rows only");
  const ep::RankView v = group_->view(0);
  const cudaError_t e = sm90::launch_stage_rows(src, sh.local_experts(), sh.capacity, row_stride, expert_stride,
                                                sh.hidden, sh.hidden, v.expert_rows, v.y_bf16, s);
  if (e != cudaSuccess) fail("EP layer: copying the experts' rows: ", cudaGetErrorString(e));
}

}  // namespace moekit
