#include "moekit/comm/ep_group.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "moekit/comm/ep_host.h"
#include "moekit/comm/ep_kernels_sm90.cuh"
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

// The local (non-window) buffers of a rank.
struct Local {
  sm90::PlanBuffers plan;         // route_plan over this rank's tokens (batched, capacity T)
  int32_t* slot_row = nullptr;    // [Tmax * k]
  int* work = nullptr;            // num_active, expert[El], count[El], row_start[El], chunk_prefix[El + 1]
  int32_t* gemm_row_src = nullptr;  // [El * cap]: 4 * row + 3 (meta's weight as a float index)
  uint16_t* rows_bf16 = nullptr;  // quantized payloads: [El * cap, hidden_pad]
  uint8_t* staging = nullptr;     // quantized payloads: [Tmax, payload_stride]

  int64_t carve(uint8_t* base, const Shape& s) {
    Carve a{base};
    const int E = s.num_experts, El = s.local_experts();
    const int64_t N = int64_t(std::max(s.max_tokens, 1)) * s.top_k;
    plan.ids = nullptr;
    plan.weights = nullptr;
    plan.dest = a.take<int32_t>(N);
    plan.rank = a.take<int32_t>(N);
    plan.row_src = a.take<int32_t>(int64_t(E) * std::max(s.max_tokens, 1));
    plan.slice_rows = a.take<int32_t>(sm90::plan_slice_ints(N, E));  // the plan in grids at prefill sizes
    plan.set_work(a.take<int>(sm90::PlanBuffers::work_ints(E) + 2), E);
    int* misc = a.take<int>(2);
    plan.done = misc;
    plan.error = misc + 1;
    slot_row = a.take<int32_t>(N);
    work = a.take<int>(4 * int64_t(El) + 2);
    gemm_row_src = a.take<int32_t>(s.rows());
    if (s.payload != Payload::kBf16) {
      rows_bf16 = a.take<uint16_t>(s.rows() * s.hidden_pad);
      staging = a.take<uint8_t>(int64_t(std::max(s.max_tokens, 1)) * s.payload_stride());
    }
    return a.off;
  }
};

__global__ void fill_row_src(int32_t* p, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = int32_t(4 * i + 3);
}

}  // namespace

struct Group::Impl {
  GroupConfig cfg;
  Window win;
  int device = 0;
  int R_local = 0;                     // local ranks: R (virtual) or 1
  std::vector<int> ranks;              // their ranks
  std::vector<uint8_t*> windows;       // [R_local] this process's windows
  std::vector<uint8_t*> local_mem;     // [R_local]
  std::vector<Local> local;
  uint8_t** peers = nullptr;           // device [R_local][R]: each local rank's peer table
  RankCtx* ctx_dev = nullptr;          // device [R_local]
  std::vector<RankCtx> ctx;            // host copy
  std::vector<RankInput> inputs;
  ErrorRecord* records = nullptr;      // host-mapped [R_local]
  int* abort_word = nullptr;           // host-mapped
  uint64_t active = ~0ull;
  int ctas = 0;
  bool poisoned = false;
  std::unique_ptr<NcclWindow> nccl;    // NCCL mode: the registered window

  Params params() const {
    Params p;
    p.shape = cfg.shape;
    p.win = win;
    p.timeout_ns = cfg.timeout_ns;
    int* dev_abort = nullptr;
    cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_abort), abort_word, 0);
    p.abort = dev_abort;
    p.active = active;
    p.chunk_rows = sm90::kTokens;
    p.nvfp4_g = cfg.nvfp4_g;
    p.mx_rceil = cfg.mx_rule == ScaleRule::kRceil ? 1 : 0;
    return p;
  }

  // Local buffers, host-mapped records, contexts; windows[] and the peer tables are set.
  void init_local(const std::vector<std::vector<uint8_t*>>& peer_tables) {
    const Shape& s = cfg.shape;
    EP_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&records), sizeof(ErrorRecord) * R_local, cudaHostAllocMapped));
    std::memset(records, 0, sizeof(ErrorRecord) * R_local);
    EP_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&abort_word), sizeof(int), cudaHostAllocMapped));
    *abort_word = 0;
    EP_CUDA(cudaMalloc(&peers, sizeof(uint8_t*) * size_t(R_local) * s.world));
    for (int i = 0; i < R_local; ++i)
      EP_CUDA(cudaMemcpy(peers + size_t(i) * s.world, peer_tables[size_t(i)].data(), sizeof(uint8_t*) * s.world,
                         cudaMemcpyHostToDevice));
    local.resize(size_t(R_local));
    local_mem.resize(size_t(R_local));
    for (int i = 0; i < R_local; ++i) {
      const int64_t bytes = local[size_t(i)].carve(nullptr, s);
      EP_CUDA(cudaMalloc(&local_mem[size_t(i)], size_t(bytes)));
      EP_CUDA(cudaMemset(local_mem[size_t(i)], 0, size_t(bytes)));
      local[size_t(i)].carve(local_mem[size_t(i)], s);
      fill_row_src<<<256, 256>>>(local[size_t(i)].gemm_row_src, s.rows());
      EP_CUDA(cudaGetLastError());
    }
    EP_CUDA(cudaMalloc(&ctx_dev, sizeof(RankCtx) * R_local));
    ctx.assign(size_t(R_local), RankCtx{});
    inputs.assign(size_t(R_local), RankInput{});
    ctas = ep::ctas_per_rank(s, R_local, device);
    MOEKIT_REQUIRE(ctas > 0, "EP: the kernels cannot be resident on device ", device);
    EP_CUDA(cudaDeviceSynchronize());
  }

  RankCtx make_ctx(int i) const {
    const Shape& s = cfg.shape;
    const Local& L = local[size_t(i)];
    const RankInput& in = inputs[size_t(i)];
    RankCtx c;
    c.rank = ranks[size_t(i)];
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
    c.ids = in.ids;
    c.weights = in.weights;
    c.dest = L.plan.dest;
    c.expert_count = L.plan.expert_count;
    c.slot_row = L.slot_row;
    const int El = s.local_experts();
    c.num_active = L.work;
    c.expert = L.work + 1;
    c.count = c.expert + El;
    c.row_start = c.count + El;
    c.chunk_prefix = c.row_start + El;
    c.rows_bf16 = L.rows_bf16;
    c.window = windows[size_t(i)];
    c.peers = peers + size_t(i) * s.world;
    cudaHostGetDevicePointer(reinterpret_cast<void**>(&c.error), records + i, 0);
    c.y = in.y;
    c.y_stride = in.y_stride;
    return c;
  }

  void upload_ctx() {
    for (int i = 0; i < R_local; ++i) ctx[size_t(i)] = make_ctx(i);
    EP_CUDA(cudaMemcpy(ctx_dev, ctx.data(), sizeof(RankCtx) * R_local, cudaMemcpyHostToDevice));
  }

  void plan(cudaStream_t s) {
    const Shape& sh = cfg.shape;
    for (int i = 0; i < R_local; ++i) {
      const RankInput& in = inputs[size_t(i)];
      if (in.T == 0) continue;
      sm90::PlanArgs a;
      a.route.p.num_experts = sh.num_experts;
      a.route.p.top_k = sh.top_k;
      a.bypass = true;
      a.T = in.T;
      a.k = sh.top_k;
      a.batched = true;
      a.capacity = int(in.T);
      a.b = local[size_t(i)].plan;
      a.b.ids = const_cast<int32_t*>(in.ids);
      a.b.weights = const_cast<float*>(in.weights);
      EP_CUDA(sm90::launch_route_plan(a, s, false));
    }
  }

  void free_all() {
    for (uint8_t* p : local_mem) cudaFree(p);
    local_mem.clear();
    if (!nccl)
      for (uint8_t* w : windows) cudaFree(w);
    windows.clear();
    nccl.reset();
    cudaFree(peers);
    cudaFree(ctx_dev);
    cudaFreeHost(records);
    cudaFreeHost(abort_word);
    peers = nullptr, ctx_dev = nullptr, records = nullptr, abort_word = nullptr;
  }
};

Group::Group(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Group::~Group() {
  if (impl_) impl_->free_all();
}

std::unique_ptr<Group> Group::create_virtual(const GroupConfig& cfg, int device) {
  validate(cfg.shape);
  auto m = std::make_unique<Impl>();
  m->cfg = cfg;
  m->win = Window::of(cfg.shape);
  m->device = device;
  EP_CUDA(cudaSetDevice(device));
  const int R = cfg.shape.world;
  m->R_local = R;
  for (int r = 0; r < R; ++r) {
    m->ranks.push_back(r);
    uint8_t* w = nullptr;
    const cudaError_t e = cudaMalloc(&w, size_t(m->win.bytes));
    if (e != cudaSuccess) {
      cudaGetLastError();
      m->free_all();
      fail("EP: cannot allocate the window of virtual rank ", r, " (", m->win.bytes, " bytes)");
    }
    m->windows.push_back(w);
    EP_CUDA(cudaMemset(w, 0, size_t(m->win.bytes)));
  }
  // Every virtual rank sees every window at its own address: one table, R copies.
  std::vector<std::vector<uint8_t*>> tables(size_t(R), m->windows);
  m->init_local(tables);
  return std::unique_ptr<Group>(new Group(std::move(m)));
}

std::unique_ptr<Group> Group::create_nccl(const GroupConfig& cfg, void* nccl_comm) {
  validate(cfg.shape);
  auto m = std::make_unique<Impl>();
  m->cfg = cfg;
  m->win = Window::of(cfg.shape);
  EP_CUDA(cudaGetDevice(&m->device));
  m->R_local = 1;
  m->nccl = NcclWindow::create(nccl_comm, size_t(m->win.bytes), cfg.shape.world);
  m->ranks.push_back(m->nccl->rank());
  m->windows.push_back(static_cast<uint8_t*>(m->nccl->local()));
  std::vector<std::vector<uint8_t*>> tables(1);
  for (void* p : m->nccl->peers()) tables[0].push_back(static_cast<uint8_t*>(p));
  m->init_local(tables);
  return std::unique_ptr<Group>(new Group(std::move(m)));
}

const GroupConfig& Group::config() const { return impl_->cfg; }
int Group::local_ranks() const { return impl_->R_local; }
int Group::rank(int i) const { return impl_->ranks.at(size_t(i)); }
int Group::ctas_per_rank() const { return impl_->ctas; }

void Group::set_inputs(const std::vector<RankInput>& in) {
  Impl& m = *impl_;
  const Shape& s = m.cfg.shape;
  MOEKIT_REQUIRE(int(in.size()) == m.R_local, "EP: ", in.size(), " rank inputs for ", m.R_local, " local ranks");
  for (size_t i = 0; i < in.size(); ++i) {
    const RankInput& r = in[i];
    MOEKIT_REQUIRE(r.T >= 0 && r.T <= s.max_tokens, "EP: rank ", m.ranks[i], ": ", r.T, " tokens (at most ",
                   s.max_tokens, ")");
    MOEKIT_REQUIRE(r.T == 0 || (r.x && r.ids && r.weights && r.y), "EP: rank ", m.ranks[i], ": missing tensors");
    MOEKIT_REQUIRE(r.x_stride >= s.hidden && r.x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(r.x) % 16 == 0,
                   "EP: x rows must be 16-byte aligned with a stride of at least H (a multiple of 8)");
    MOEKIT_REQUIRE(r.y_stride >= s.hidden && r.y_stride % 4 == 0 && reinterpret_cast<uintptr_t>(r.y) % 8 == 0,
                   "EP: y rows must be 8-byte aligned with a stride of at least H (a multiple of 4); stride ",
                   r.y_stride);
  }
  m.inputs = in;
  m.upload_ctx();
}

void Group::dispatch(cudaStream_t s) {
  Impl& m = *impl_;
  MOEKIT_REQUIRE(!m.poisoned, "EP: the group is poisoned by an earlier failure; reset() it");
  int64_t tmax = 0;
  for (const RankInput& r : m.inputs) tmax = std::max(tmax, r.T);
  m.plan(s);
  const Params p = m.params();
  EP_CUDA(launch_quantize(p, m.ctx_dev, m.R_local, tmax, s));
  EP_CUDA(launch_dispatch(p, m.ctx_dev, m.R_local, m.ctas, s));
  EP_CUDA(launch_dequant(p, m.ctx_dev, m.R_local, s));
}

void Group::dispatch_exchange_only(cudaStream_t s) {
  Impl& m = *impl_;
  EP_CUDA(launch_dispatch(m.params(), m.ctx_dev, m.R_local, m.ctas, s));
}

RankView Group::view(int i) const {
  const Impl& m = *impl_;
  const Shape& s = m.cfg.shape;
  const RankCtx& c = m.ctx.at(size_t(i));
  const Local& L = m.local.at(size_t(i));
  uint8_t* w = m.windows[size_t(i)];
  RankView v;
  v.rows = s.payload == Payload::kBf16 ? reinterpret_cast<const uint16_t*>(w + m.win.payload) : L.rows_bf16;
  v.meta = reinterpret_cast<const RowMeta*>(w + m.win.meta);
  v.y = reinterpret_cast<float*>(w + m.win.y);
  v.num_active = c.num_active;
  v.expert = c.expert;
  v.count = c.count;
  v.row_start = c.row_start;
  v.chunk_prefix = c.chunk_prefix;
  v.row_src = L.gemm_row_src;
  v.weights = reinterpret_cast<const float*>(v.meta);
  v.slot_row = L.slot_row;
  return v;
}

void Group::combine(cudaStream_t s) {
  Impl& m = *impl_;
  MOEKIT_REQUIRE(!m.poisoned, "EP: the group is poisoned by an earlier failure; reset() it");
  EP_CUDA(launch_combine(m.params(), m.ctx_dev, m.R_local, m.ctas, s));
}

std::string Group::check(cudaStream_t s) {
  Impl& m = *impl_;
  EP_CUDA(cudaStreamSynchronize(s));
  std::ostringstream os;
  for (int i = 0; i < m.R_local; ++i) {
    volatile ErrorRecord* r = m.records + i;
    if (r->phase == 0) continue;
    ErrorRecord e;
    e.phase = r->phase, e.rank = r->rank, e.peer = r->peer, e.expected = r->expected, e.seen = r->seen,
    e.round = r->round;
    if (os.tellp() > 0) os << "; ";
    os << describe(e, m.cfg.timeout_ns);
    if (Phase(e.phase) == Phase::kCapacity) r->phase = 0;  // reported; the next round may run
    else m.poisoned = true;
  }
  return os.str();
}

bool Group::poisoned() const { return impl_->poisoned; }

void Group::reset() {
  Impl& m = *impl_;
  EP_CUDA(cudaDeviceSynchronize());
  // NCCL mode: a peer's kernel of the failed round may still be writing into this window (its
  // counts, rows or flags); every rank's kernels have ended once every rank is past here.
  if (m.nccl) m.nccl->barrier();
  for (uint8_t* w : m.windows) EP_CUDA(cudaMemset(w, 0, size_t(m.win.bytes)));
  std::memset(m.records, 0, sizeof(ErrorRecord) * m.R_local);
  *m.abort_word = 0;
  EP_CUDA(cudaDeviceSynchronize());
  if (m.nccl) m.nccl->barrier();
  m.poisoned = false;
}

void Group::barrier() {
  if (impl_->nccl) impl_->nccl->barrier();
}

void Group::set_active(uint64_t mask) { impl_->active = mask; }
void Group::abort(bool on) { *reinterpret_cast<volatile int*>(impl_->abort_word) = on ? 1 : 0; }

}  // namespace moekit::ep
