#include "moekit/comm/ep_group.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "moekit/comm/ep_host.h"
#include "moekit/comm/ep_kernels_sm90.cuh"
#include "moekit/comm/ep_net_sm90.cuh"
#include "moekit/comm/nccl_window.h"
#include "moekit/common/carve.h"
#include "moekit/common/error.h"
#include "moekit/experts/sm90_moe_gemm.cuh"  // kTokens: rows per GEMM chunk
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

#define EP_CUDA(expr)                                                                               \
  do {                                                                                              \
    const cudaError_t err_ = (expr);                                                                \
    if (err_ != cudaSuccess) ::moekit::fail("EP: CUDA error: ", #expr, ": ", cudaGetErrorString(err_)); \
  } while (0)

namespace moekit::ep {

namespace {

// A rank's per-round buffers, carved from its arena scratch (the layers of a group take turns).
struct Scratch {
  sm90::PlanBuffers plan;         // route_plan over this rank's tokens (batched, capacity T)
  int32_t* ids = nullptr;         // [Tmax * k] routing results when the caller wants none back
  float* weights = nullptr;       // [Tmax * k]
  int32_t* slot_row = nullptr;    // [Tmax * k]
  int* work = nullptr;            // num_active, expert[El], count[El], row_start[El], chunk_prefix[El + 1]
  int32_t* expert_rows = nullptr; // [El]
  uint16_t* rows_bf16 = nullptr;  // quantized payloads: [El * cap, hidden_pad]
  uint8_t* staging = nullptr;     // quantized payloads: [Tmax, payload_stride]
  float* y_f32 = nullptr;         // bf16 combine rows: [El * cap, H] GEMM2's fp32 rows
  NetBuffers net;                 // the network path's blocks (ep_net_sm90.cuh)

  int64_t carve(uint8_t* base, const Shape& s, bool net_path) {
    Carve a{base};
    const int E = s.num_experts, El = s.local_experts();
    const int64_t N = int64_t(std::max(s.max_tokens, 1)) * s.top_k;
    plan.dest = a.take<int32_t>(N);
    plan.rank = a.take<int32_t>(N);
    plan.row_src = a.take<int32_t>(int64_t(E) * std::max(s.max_tokens, 1));
    plan.slice_rows = a.take<int32_t>(sm90::plan_slice_ints(N, E));  // the plan in grids at prefill sizes
    plan.set_work(a.take<int>(sm90::PlanBuffers::work_ints(E) + 2), E);
    ids = a.take<int32_t>(N);
    weights = a.take<float>(N);
    slot_row = a.take<int32_t>(N);
    work = a.take<int>(4 * int64_t(El) + 2);
    expert_rows = a.take<int32_t>(El);
    if (bf16_rows(s.combine)) y_f32 = a.take<float>(s.rows() * s.hidden);
    if (s.payload != Payload::kBf16) {
      rows_bf16 = a.take<uint16_t>(s.rows() * s.hidden_pad);
      staging = a.take<uint8_t>(int64_t(std::max(s.max_tokens, 1)) * s.payload_stride());
    }
    if (net_path) {
      const int64_t blocks = int64_t(s.world) * net_block_rows(s);
      net.cnt_send = a.take<int32_t>(s.num_experts);
      net.cnt_all = a.take<int32_t>(int64_t(s.world) * s.num_experts);
      net.pre = a.take<int32_t>(s.num_experts);
      net.send = a.take<uint8_t>(blocks * net_row_bytes(s));
      net.recv = a.take<uint8_t>(blocks * net_row_bytes(s));
      net.back_send = a.take<uint8_t>(blocks * s.y_row_bytes());
      net.back_recv = a.take<uint8_t>(blocks * s.y_row_bytes());
    }
    return a.off;
  }
};

// A rank's buffers of its own (a layer's, kept between rounds).
struct Own {
  int32_t* gemm_row_src = nullptr;  // [El * cap]: 4 * row + 3 (meta's weight as a float index),
                                    //   or 0 (bf16 combine rows: every row's weight is `one`)
  float* one = nullptr;             // 1.0f
  int* plan_done = nullptr;         // route_plan's CTA ticket (zero between launches)
  int* plan_error = nullptr;        // route_plan's bad-id flag

  int64_t carve(uint8_t* base, const Shape& s) {
    Carve a{base};
    gemm_row_src = a.take<int32_t>(s.rows());
    one = a.take<float>(1);
    int* misc = a.take<int>(2);
    plan_done = misc;
    plan_error = misc + 1;
    return a.off;
  }
};

// row_src of the GEMM2 weights: meta's weight field (4 * row + 3 as a float index), or 0 (`one`).
__global__ void fill_row_src(int32_t* p, int64_t n, bool weighted, float* one) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = weighted ? int32_t(4 * i + 3) : 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) *one = 1.0f;
}

// An environment knob of the diagnostics (bench --ep, docs/perf/log.md); 0 when unset.
int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : 0;
}

// $MOEKIT_EP_DISPATCH: auto (unset, empty) | direct | fanout (ep_layout.h Dispatch, docs/EP.md).
Dispatch dispatch_from_env() {
  const char* v = std::getenv("MOEKIT_EP_DISPATCH");
  if (!v || !*v || std::string(v) == "auto") return Dispatch::kAuto;
  if (std::string(v) == "direct") return Dispatch::kDirect;
  if (std::string(v) == "fanout") return Dispatch::kFanout;
  fail("EP: MOEKIT_EP_DISPATCH='", v, "' (auto | direct | fanout)");
}

}  // namespace

// ---- the arena ------------------------------------------------------------------------------------

struct Arena::Impl {
  int device = 0;
  int world = 0;
  int R_local = 0;
  std::vector<int> ranks;            // [R_local]
  void* comm = nullptr;              // NCCL mode
  bool net = false;                  // NCCL mode over host collectives (ep_net_sm90.cuh)
  std::unique_ptr<NcclWindow> nccl;  // NCCL mode: the registered window
  std::vector<uint8_t*> windows;     // [R_local]
  std::vector<uint8_t*> scratch;     // [R_local]
  uint8_t** peers = nullptr;         // device [R_local][world]
  int64_t window_bytes = 0, scratch_bytes = 0;
  uint64_t generation = 0;
  ErrorRecord* records = nullptr;    // host-mapped [R_local]
  std::vector<ErrorRecord*> records_dev;
  int* recorded = nullptr;           // device [R_local]
  int* abort_word = nullptr;         // host-mapped
  int* abort_dev = nullptr;
  bool poisoned = false;

  void init_failure_state() {
    EP_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&records), sizeof(ErrorRecord) * R_local, cudaHostAllocMapped));
    std::memset(records, 0, sizeof(ErrorRecord) * R_local);
    records_dev.assign(size_t(R_local), nullptr);
    for (int i = 0; i < R_local; ++i)
      EP_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&records_dev[size_t(i)]), records + i, 0));
    EP_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&abort_word), sizeof(int), cudaHostAllocMapped));
    *abort_word = 0;
    EP_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&abort_dev), abort_word, 0));
    EP_CUDA(cudaMalloc(&recorded, sizeof(int) * R_local));
    EP_CUDA(cudaMemset(recorded, 0, sizeof(int) * R_local));
  }

  void free_memory() {
    for (uint8_t* p : scratch) cudaFree(p);
    scratch.clear();
    if (!nccl)
      for (uint8_t* w : windows) cudaFree(w);
    windows.clear();
    nccl.reset();
    cudaFree(peers);
    peers = nullptr;
  }

  // Grows to at least these sizes: new memory, zeroed windows, new peer tables.
  void grow(int64_t wbytes, int64_t sbytes) {
    wbytes = std::max(wbytes, window_bytes);
    sbytes = std::max(sbytes, scratch_bytes);
    EP_CUDA(cudaSetDevice(device));
    EP_CUDA(cudaDeviceSynchronize());  // nothing of this arena's may still run
    if (comm) NcclWindow::comm_barrier(comm);  // ... on any rank (they may still write here)
    free_memory();
    std::vector<std::vector<uint8_t*>> tables;
    if (comm && !net) {
      nccl = NcclWindow::create(comm, size_t(wbytes), world);  // collective; zeroed
      windows.push_back(static_cast<uint8_t*>(nccl->local()));
      tables.emplace_back();
      for (void* p : nccl->peers()) tables[0].push_back(static_cast<uint8_t*>(p));
    } else {
      for (int r = 0; r < R_local; ++r) {
        uint8_t* w = nullptr;
        if (cudaMalloc(&w, size_t(wbytes)) != cudaSuccess) {
          cudaGetLastError();
          free_memory();
          fail("EP: cannot allocate the window of virtual rank ", r, " (", wbytes, " bytes)");
        }
        windows.push_back(w);
        EP_CUDA(cudaMemset(w, 0, size_t(wbytes)));
      }
      // Every virtual rank sees every window alike; a network-path rank only its own (no
      // kernel of that path reads a peer table).
      tables.assign(size_t(R_local), comm ? std::vector<uint8_t*>(size_t(world), windows[0]) : windows);
    }
    EP_CUDA(cudaMalloc(&peers, sizeof(uint8_t*) * size_t(R_local) * world));
    for (int i = 0; i < R_local; ++i)
      EP_CUDA(cudaMemcpy(peers + size_t(i) * world, tables[size_t(i)].data(), sizeof(uint8_t*) * world,
                         cudaMemcpyHostToDevice));
    for (int i = 0; i < R_local; ++i) {
      uint8_t* p = nullptr;
      if (cudaMalloc(&p, size_t(std::max<int64_t>(sbytes, 256))) != cudaSuccess) {
        cudaGetLastError();
        free_memory();
        fail("EP: cannot allocate ", sbytes, " bytes of scratch for rank ", ranks[size_t(i)]);
      }
      scratch.push_back(p);
    }
    window_bytes = wbytes;
    scratch_bytes = sbytes;
    ++generation;
    EP_CUDA(cudaDeviceSynchronize());
  }

  void barrier() {
    if (comm) NcclWindow::comm_barrier(comm);
  }
};

Arena::Arena() : impl_(std::make_unique<Impl>()) {}
Arena::~Arena() {
  Impl& m = *impl_;
  cudaSetDevice(m.device);
  cudaDeviceSynchronize();
  m.free_memory();
  cudaFree(m.recorded);
  cudaFreeHost(m.records);
  cudaFreeHost(m.abort_word);
}

std::shared_ptr<Arena> Arena::create_virtual(int world, int device) {
  MOEKIT_REQUIRE(world >= 1 && world <= kMaxLocalRanks, "EP: ", world, " virtual ranks (1..", kMaxLocalRanks, ")");
  std::shared_ptr<Arena> a(new Arena);
  Impl& m = *a->impl_;
  m.device = device;
  m.world = m.R_local = world;
  for (int r = 0; r < world; ++r) m.ranks.push_back(r);
  EP_CUDA(cudaSetDevice(device));
  m.init_failure_state();
  return a;
}

std::shared_ptr<Arena> Arena::create_nccl(void* nccl_comm, int world, bool host_collectives) {
  std::shared_ptr<Arena> a(new Arena);
  Impl& m = *a->impl_;
  EP_CUDA(cudaGetDevice(&m.device));
  m.comm = nccl_comm;
  m.net = host_collectives;
  m.world = world;
  m.R_local = 1;
  const int n = NcclWindow::comm_size(nccl_comm);
  MOEKIT_REQUIRE(n == world, "EP over NCCL: the communicator has ", n, " ranks, the group ", world);
  m.ranks.push_back(NcclWindow::comm_rank(nccl_comm));
  m.init_failure_state();
  return a;
}

void Arena::reserve(int64_t window_bytes, int64_t scratch_bytes) {
  Impl& m = *impl_;
  if (window_bytes <= m.window_bytes && scratch_bytes <= m.scratch_bytes && !m.windows.empty()) return;
  m.grow(window_bytes, scratch_bytes);
}

int Arena::world() const { return impl_->world; }
int Arena::local_ranks() const { return impl_->R_local; }
int Arena::rank(int i) const { return impl_->ranks.at(size_t(i)); }
int Arena::device() const { return impl_->device; }
bool Arena::host_collectives() const { return impl_->net; }
bool Arena::poisoned() const { return impl_->poisoned; }

// ---- the group --------------------------------------------------------------------------------

struct Group::Impl {
  GroupConfig cfg;
  Window win;
  std::shared_ptr<Arena> arena;
  int layer = 0;
  uint64_t generation = 0;             // of the arena this group is bound to
  std::vector<Scratch> scratch;        // [R_local]
  std::vector<Own> own;                // [R_local]
  std::vector<uint8_t*> own_mem;       // [R_local]
  Ctxs ctx;                            // the launches' contexts (by value)
  std::vector<RankInput> inputs;
  uint64_t active = ~0ull;
  int ctas = 0;                        // the most CTAs a launch may use per rank
  int force_ctas = 0;                  // $MOEKIT_EP_CTAS (diagnostics): every launch's CTAs
  int host_poll_every_spin = 0;        // $MOEKIT_EP_HOST_POLL=1 (diagnostics): the old waits
  int chunk_vecs = 0;                  // $MOEKIT_EP_CHUNK (diagnostics): dispatch copy items
  int diag = 0;                        // $MOEKIT_EP_DIAG (diagnostics, timing only): Params::diag
  Dispatch dispatch = Dispatch::kAuto;  // GroupConfig::dispatch, resolved once (init)
  int last_dispatch = 0, last_combine = 0;
  uint64_t* trace_buf = nullptr;       // device [2][R_local][ctas][kTraceEvents] when tracing

  int64_t extra_scratch = 0;

  Arena::Impl& A() const { return arena->impl(); }
  int64_t own_scratch() const { return (Group::scratch_bytes(cfg.shape, A().net) + 255) / 256 * 256; }
  int R_local() const { return A().R_local; }

  Params params() const {
    Params p;
    p.shape = cfg.shape;
    p.win = win;
    p.timeout_ns = cfg.timeout_ns;
    p.abort = A().abort_dev;
    p.active = active;
    p.chunk_rows = sm90::kTokens;
    p.nvfp4_g = cfg.nvfp4_g;
    p.mx_rceil = cfg.mx_rule == ScaleRule::kRceil ? 1 : 0;
    p.host_poll_every_spin = host_poll_every_spin;
    p.chunk_vecs = chunk_vecs;
    p.diag = diag;
    p.fanout = fans_out(dispatch, cfg.shape.world, cfg.shape.top_k, max_T()) ? 1 : 0;  // this round's inputs
    p.net = A().net ? 1 : 0;
    p.net_block = net_block_rows(cfg.shape);
    return p;
  }
  // Params of one kernel's launch: its trace section (0 dispatch, 1 combine) when tracing.
  Params params_for(int kernel) const {
    Params p = params();
    if (trace_buf) {
      p.trace = trace_buf + size_t(kernel) * R_local() * ctas * kTraceEvents;
      p.trace_ctas = ctas;
    }
    return p;
  }
  int64_t max_T() const {
    int64_t t = 0;
    for (const RankInput& r : inputs) t = std::max(t, r.T);
    return t;
  }

  // Own buffers, contexts; the arena is reserved.
  void init(const std::shared_ptr<Arena>& a, int layer_id) {
    arena = a;
    layer = layer_id;
    const Shape& s = cfg.shape;
    const int R = R_local();
    MOEKIT_REQUIRE(A().world == s.world, "EP: the arena has ", A().world, " ranks, the layer ", s.world);
    MOEKIT_REQUIRE(cfg.dispatch >= -1 && cfg.dispatch <= 2, "EP: dispatch variant ", cfg.dispatch);
    MOEKIT_REQUIRE(!(A().net && s.combine == CombineRows::kBf16Sum),
                   "EP: combine rows \"bf16_sum\" need peers in reach of loads and stores (NVLink); the host "
                   "transport takes \"fp32\" or \"bf16\"");
    dispatch = cfg.dispatch >= 0 ? Dispatch(cfg.dispatch) : dispatch_from_env();  // read once per group
    EP_CUDA(cudaSetDevice(A().device));
    own.resize(size_t(R));
    for (int i = 0; i < R; ++i) {
      uint8_t* p = nullptr;
      EP_CUDA(cudaMalloc(&p, size_t(own[size_t(i)].carve(nullptr, s))));
      own_mem.push_back(p);
      EP_CUDA(cudaMemset(p, 0, size_t(own[size_t(i)].carve(nullptr, s))));
      own[size_t(i)].carve(p, s);
      fill_row_src<<<256, 256>>>(own[size_t(i)].gemm_row_src, s.rows(), s.combine == CombineRows::kF32,
                                  own[size_t(i)].one);
      EP_CUDA(cudaGetLastError());
    }
    arena->reserve(win.bytes, own_scratch() + extra_scratch);
    inputs.assign(size_t(R), RankInput{});
    ctas = ep::ctas_per_rank(s, R, A().device);
    MOEKIT_REQUIRE(ctas > 0, "EP: the kernels cannot be resident on device ", A().device);
    force_ctas = env_int("MOEKIT_EP_CTAS");
    host_poll_every_spin = env_int("MOEKIT_EP_HOST_POLL");
    chunk_vecs = std::clamp(env_int("MOEKIT_EP_CHUNK") / 32 * 32, 0, 256);
    diag = env_int("MOEKIT_EP_DIAG");
    bind();
    EP_CUDA(cudaDeviceSynchronize());
  }

  // Points the scratch and contexts at the arena's present memory (host only).
  void bind() {
    const Shape& s = cfg.shape;
    scratch.assign(size_t(R_local()), Scratch{});
    for (int i = 0; i < R_local(); ++i) scratch[size_t(i)].carve(A().scratch[size_t(i)], s, A().net);
    generation = A().generation;
    for (int i = 0; i < R_local(); ++i) ctx.r[i] = make_ctx(i);
  }
  void rebind_if_moved() {
    if (generation != A().generation) bind();
  }

  RankCtx make_ctx(int i) const {
    const Shape& s = cfg.shape;
    const Scratch& L = scratch[size_t(i)];
    const RankInput& in = inputs[size_t(i)];
    RankCtx c;
    c.rank = A().ranks[size_t(i)];
    c.T = in.T;
    c.x = in.x;
    c.x_stride = in.x_stride;
    if (s.payload == Payload::kBf16) {
      c.src_rows = reinterpret_cast<const uint8_t*>(in.x);
      c.src_stride = in.x_stride * 2;
    } else {
      c.src_rows = L.staging;
      c.src_stride = s.payload_stride();
    }
    c.ids = in.logits ? L.ids : in.ids;
    c.weights = in.logits ? L.weights : in.weights;
    if (in.logits && in.ids) c.ids = in.ids, c.weights = in.weights;  // the caller wants them back
    c.dest = L.plan.dest;
    c.expert_count = L.plan.expert_count;
    c.slot_row = L.slot_row;
    const int El = s.local_experts();
    c.num_active = L.work;
    c.expert = L.work + 1;
    c.count = c.expert + El;
    c.row_start = c.count + El;
    c.chunk_prefix = c.row_start + El;
    c.expert_rows = L.expert_rows;
    c.rows_bf16 = L.rows_bf16;
    c.window = A().windows[size_t(i)];
    c.peers = A().peers + size_t(i) * s.world;
    c.error = A().records_dev[size_t(i)];
    c.recorded = A().recorded + i;
    c.layer = layer;
    c.y = in.y;
    c.y_stride = in.y_stride;
    c.shared = in.shared;
    c.shared_stride = in.shared_stride;
    c.net_back = L.net.back_recv;
    c.net_pre = L.net.pre;
    return c;
  }

  // The network path's exchange (ep_net_sm90.cuh): counts, pack, all-to-all, unpack.
  void net_exchange(cudaStream_t s) {
    const Params p = params();
    const RankCtx& c = ctx.r[0];
    const NetBuffers& b = scratch[0].net;
    const Shape& sh = cfg.shape;
    EP_CUDA(launch_net_counts(p, c, b, s));
    NcclWindow::allgather_i32(A().comm, b.cnt_send, b.cnt_all, size_t(sh.num_experts), s);
    EP_CUDA(launch_net_pack(p, c, b, s));
    NcclWindow::alltoall_bytes(A().comm, b.send, b.recv, size_t(net_block_rows(sh) * net_row_bytes(sh)), s);
    EP_CUDA(launch_net_unpack(p, c, b, s));
  }
  void net_combine(cudaStream_t s, int G) {
    const Params p = params();
    const NetBuffers& b = scratch[0].net;
    const Shape& sh = cfg.shape;
    EP_CUDA(launch_net_pack_back(p, ctx.r[0], b, s));
    NcclWindow::alltoall_bytes(A().comm, b.back_send, b.back_recv, size_t(net_block_rows(sh) * sh.y_row_bytes()), s);
    EP_CUDA(launch_combine(params_for(1), ctx, 1, G, s));
  }

  void plan(cudaStream_t s) {
    const Shape& sh = cfg.shape;
    for (int i = 0; i < R_local(); ++i) {
      const RankInput& in = inputs[size_t(i)];
      if (in.T == 0) continue;
      sm90::PlanArgs a;
      a.route.p = cfg.route;
      a.route.p.num_experts = sh.num_experts;
      a.route.p.top_k = sh.top_k;
      a.route.logits = in.logits;
      a.bypass = in.logits == nullptr;
      a.T = in.T;
      a.k = sh.top_k;
      a.batched = true;
      a.capacity = int(in.T);
      a.b = scratch[size_t(i)].plan;
      a.b.done = own[size_t(i)].plan_done;
      a.b.error = own[size_t(i)].plan_error;
      a.b.ids = const_cast<int32_t*>(ctx.r[i].ids);
      a.b.weights = const_cast<float*>(ctx.r[i].weights);
      EP_CUDA(sm90::launch_route_plan(a, s, false));
    }
  }

  void free_own() {
    for (uint8_t* p : own_mem) cudaFree(p);
    own_mem.clear();
    cudaFree(trace_buf);
    trace_buf = nullptr;
  }
};

Group::Group(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Group::~Group() {
  if (impl_) {
    cudaSetDevice(impl_->A().device);
    cudaDeviceSynchronize();
    impl_->free_own();
  }
}

int64_t Group::scratch_bytes(const Shape& s, bool host_collectives) { return Scratch{}.carve(nullptr, s, host_collectives); }

std::unique_ptr<Group> Group::create_in(const GroupConfig& cfg, std::shared_ptr<Arena> arena, int layer,
                                        int64_t extra_scratch) {
  validate(cfg.shape);
  MOEKIT_REQUIRE(arena != nullptr, "EP: no arena");
  auto m = std::make_unique<Impl>();
  m->cfg = cfg;
  m->win = Window::of(cfg.shape);
  m->extra_scratch = extra_scratch;
  std::unique_ptr<Group> g(new Group(std::move(m)));
  g->impl_->init(arena, layer);
  return g;
}

std::unique_ptr<Group> Group::create_virtual(const GroupConfig& cfg, int device) {
  validate(cfg.shape);
  return create_in(cfg, Arena::create_virtual(cfg.shape.world, device));
}

std::unique_ptr<Group> Group::create_nccl(const GroupConfig& cfg, void* nccl_comm) {
  validate(cfg.shape);
  return create_in(cfg, Arena::create_nccl(nccl_comm, cfg.shape.world, cfg.host_collectives));
}

const GroupConfig& Group::config() const { return impl_->cfg; }
int Group::local_ranks() const { return impl_->R_local(); }
int64_t Group::tokens(int i) const { return impl_->inputs.at(size_t(i)).T; }
int Group::rank(int i) const { return impl_->A().ranks.at(size_t(i)); }
int Group::ctas_per_rank() const { return impl_->ctas; }

void Group::set_inputs(const std::vector<RankInput>& in) {
  Impl& m = *impl_;
  const Shape& s = m.cfg.shape;
  MOEKIT_REQUIRE(int(in.size()) == m.R_local(), "EP: ", in.size(), " rank inputs for ", m.R_local(), " local ranks");
  for (size_t i = 0; i < in.size(); ++i) {
    const RankInput& r = in[i];
    const int rank = m.A().ranks[i];
    MOEKIT_REQUIRE(r.T >= 0 && r.T <= s.max_tokens, "EP: rank ", rank, ": ", r.T, " tokens (at most ", s.max_tokens,
                   ")");
    MOEKIT_REQUIRE(r.T == 0 || (r.x && (r.logits || (r.ids && r.weights)) && r.y), "EP: rank ", rank,
                   ": missing tensors");
    MOEKIT_REQUIRE(!r.ids == !r.weights, "EP: rank ", rank, ": ids and weights come together");
    MOEKIT_REQUIRE(r.x_stride >= s.hidden && r.x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(r.x) % 16 == 0,
                   "EP: x rows must be 16-byte aligned with a stride of at least H (a multiple of 8)");
    MOEKIT_REQUIRE(r.y_stride >= s.hidden && r.y_stride % 4 == 0 && reinterpret_cast<uintptr_t>(r.y) % 8 == 0,
                   "EP: y rows must be 8-byte aligned with a stride of at least H (a multiple of 4); stride ",
                   r.y_stride);
    MOEKIT_REQUIRE(!r.shared || (r.shared_stride >= s.hidden && r.shared_stride % 4 == 0 &&
                                 reinterpret_cast<uintptr_t>(r.shared) % 8 == 0),
                   "EP: shared rows must be 8-byte aligned with a stride of at least H (a multiple of 4)");
  }
  m.inputs = in;
  m.rebind_if_moved();
  for (int i = 0; i < m.R_local(); ++i) m.ctx.r[i] = m.make_ctx(i);
}

void Group::dispatch(cudaStream_t s) {
  Impl& m = *impl_;
  MOEKIT_REQUIRE(!m.A().poisoned, "EP: the group is poisoned by an earlier failure; reset() it");
  m.rebind_if_moved();
  m.plan(s);
  const Params p = m.params();
  EP_CUDA(launch_quantize(p, m.ctx, m.R_local(), m.max_T(), s));
  dispatch_exchange_only(s);
  EP_CUDA(launch_dequant(p, m.ctx, m.R_local(), s));
}

void Group::dispatch_exchange_only(cudaStream_t s) {
  Impl& m = *impl_;
  m.rebind_if_moved();
  if (m.A().net) {
    m.net_exchange(s);
    return;
  }
  const int G =
      m.force_ctas > 0 ? std::min(m.force_ctas, m.ctas) : dispatch_ctas(m.cfg.shape, m.max_T(), m.ctas, m.chunk_vecs);
  m.last_dispatch = G;
  EP_CUDA(launch_dispatch(m.params_for(0), m.ctx, m.R_local(), G, s));
}

RankView Group::view(int i) const {
  Impl& m = *impl_;
  m.rebind_if_moved();
  const Shape& s = m.cfg.shape;
  const RankCtx& c = m.ctx.r[i];
  const Scratch& L = m.scratch.at(size_t(i));
  uint8_t* w = m.A().windows[size_t(i)];
  RankView v;
  v.rows = s.payload == Payload::kBf16 ? reinterpret_cast<const uint16_t*>(w + m.win.payload) : L.rows_bf16;
  v.meta = reinterpret_cast<const RowMeta*>(w + m.win.meta);
  if (s.combine == CombineRows::kF32) {
    v.y = reinterpret_cast<float*>(w + m.win.y);
  } else {
    v.y = L.y_f32;
    v.y_bf16 = reinterpret_cast<uint16_t*>(w + m.win.y);
  }
  v.expert_rows = L.expert_rows;
  v.num_active = c.num_active;
  v.expert = c.expert;
  v.count = c.count;
  v.row_start = c.row_start;
  v.chunk_prefix = c.chunk_prefix;
  v.row_src = m.own[size_t(i)].gemm_row_src;
  v.weights = s.combine == CombineRows::kF32 ? reinterpret_cast<const float*>(v.meta) : m.own[size_t(i)].one;
  v.slot_row = L.slot_row;
  v.extra = m.A().scratch[size_t(i)] + m.own_scratch();
  return v;
}

void Group::combine(cudaStream_t s) {
  Impl& m = *impl_;
  MOEKIT_REQUIRE(!m.A().poisoned, "EP: the group is poisoned by an earlier failure; reset() it");
  m.rebind_if_moved();
  const int G = m.force_ctas > 0 ? std::min(m.force_ctas, m.ctas) : combine_ctas(m.cfg.shape, m.max_T(), m.ctas);
  m.last_combine = G;
  if (m.A().net) {
    m.net_combine(s, G);
    return;
  }
  EP_CUDA(launch_combine(m.params_for(1), m.ctx, m.R_local(), G, s));
}

std::string Group::check(cudaStream_t s) {
  Impl& m = *impl_;
  Arena::Impl& a = m.A();
  EP_CUDA(cudaStreamSynchronize(s));
  std::ostringstream os;
  for (int i = 0; i < a.R_local; ++i) {
    volatile ErrorRecord* r = a.records + i;
    if (r->phase == 0) continue;
    ErrorRecord e;
    e.phase = r->phase, e.rank = r->rank, e.peer = r->peer, e.layer = r->layer, e.expected = r->expected,
    e.seen = r->seen, e.round = r->round;
    if (os.tellp() > 0) os << "; ";
    os << describe(e, m.cfg.timeout_ns);
    if (e.layer != m.layer) os << " (layer " << e.layer << ")";
    if (Phase(e.phase) == Phase::kCapacity) {  // reported; the next round may run
      r->phase = 0;
      EP_CUDA(cudaMemset(a.recorded + i, 0, sizeof(int)));
    } else {
      a.poisoned = true;
      // A peer may be gone: from here the communicator is let go without collectives (reset()
      // is for peers that are alive and call it too).
      if (a.comm) NcclWindow::mark_failed(a.comm);
    }
  }
  return os.str();
}

bool Group::poisoned() const { return impl_->A().poisoned; }

bool Group::plan_error(cudaStream_t s) {
  Impl& m = *impl_;
  EP_CUDA(cudaStreamSynchronize(s));
  bool bad = false;
  for (const Own& o : m.own) {
    int e = 0;
    EP_CUDA(cudaMemcpy(&e, o.plan_error, sizeof(int), cudaMemcpyDeviceToHost));
    if (e != 0) {
      bad = true;
      EP_CUDA(cudaMemset(o.plan_error, 0, sizeof(int)));
    }
  }
  return bad;
}

void Group::reset() {
  Impl& m = *impl_;
  Arena::Impl& a = m.A();
  EP_CUDA(cudaSetDevice(a.device));
  EP_CUDA(cudaDeviceSynchronize());
  // NCCL mode: a peer's kernel of the failed round may still be writing into this window (its
  // counts, rows or flags); every rank's kernels have ended once every rank is past here.
  a.barrier();
  if (a.comm) NcclWindow::clear_failed(a.comm);  // every rank is here: the peers are alive
  for (uint8_t* w : a.windows) EP_CUDA(cudaMemset(w, 0, size_t(a.window_bytes)));
  std::memset(a.records, 0, sizeof(ErrorRecord) * a.R_local);
  EP_CUDA(cudaMemset(a.recorded, 0, sizeof(int) * a.R_local));
  *a.abort_word = 0;
  EP_CUDA(cudaDeviceSynchronize());
  a.barrier();
  a.poisoned = false;
}

void Group::barrier() { impl_->A().barrier(); }

void Group::set_active(uint64_t mask) { impl_->active = mask; }
void Group::abort(bool on) { *reinterpret_cast<volatile int*>(impl_->A().abort_word) = on ? 1 : 0; }

void Group::enable_trace(bool on) {
  Impl& m = *impl_;
  EP_CUDA(cudaDeviceSynchronize());
  cudaFree(m.trace_buf);
  m.trace_buf = nullptr;
  if (!on) return;
  const size_t bytes = size_t(2) * m.R_local() * m.ctas * kTraceEvents * sizeof(uint64_t);
  EP_CUDA(cudaMalloc(&m.trace_buf, bytes));
  EP_CUDA(cudaMemset(m.trace_buf, 0, bytes));
}

Group::Trace Group::trace() {
  Impl& m = *impl_;
  Trace t;
  t.max_ctas = m.ctas;
  t.dispatch_ctas = m.last_dispatch;
  t.combine_ctas = m.last_combine;
  if (!m.trace_buf) return t;
  EP_CUDA(cudaDeviceSynchronize());
  const size_t n = size_t(m.R_local()) * m.ctas * kTraceEvents;
  t.dispatch.resize(n);
  t.combine.resize(n);
  EP_CUDA(cudaMemcpy(t.dispatch.data(), m.trace_buf, n * 8, cudaMemcpyDeviceToHost));
  EP_CUDA(cudaMemcpy(t.combine.data(), m.trace_buf + n, n * 8, cudaMemcpyDeviceToHost));
  return t;
}

int Group::last_dispatch_ctas() const { return impl_->last_dispatch; }
int Group::last_combine_ctas() const { return impl_->last_combine; }

}  // namespace moekit::ep
