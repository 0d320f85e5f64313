#include "moekit/backends/sm90_layer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/experts/sm90_moe_gemm.h"
#include "moekit/experts/sm90_prefill_gemm.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

#define MOEKIT_CUDA_CHECK(expr)                                                         \
  do {                                                                                  \
    const cudaError_t err_ = (expr);                                                    \
    if (err_ != cudaSuccess) ::moekit::fail("CUDA error: ", #expr, ": ", cudaGetErrorString(err_)); \
  } while (0)

namespace moekit {

namespace {

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() { cudaFree(p); }
  void alloc(size_t count, bool zero = false) {
    cudaFree(p);
    p = nullptr;
    n = count;
    // Refused with its size named, before cudaMalloc when it exceeds the device's memory.
    const uint64_t bytes = sat_mul({int64_t(std::min<size_t>(count, INT64_MAX)), int64_t(sizeof(T))});
    size_t free_b = 0, total_b = 0;
    MOEKIT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (bytes > free_b || cudaMalloc(&p, std::max<uint64_t>(bytes, 1)) != cudaSuccess) {
      cudaGetLastError();
      p = nullptr;
      fail("cannot allocate ", human_bytes(bytes), " of GPU memory (", human_bytes(free_b), " of ",
           human_bytes(total_b), " free)");
    }
    if (zero) MOEKIT_CUDA_CHECK(cudaMemset(p, 0, sizeof(T) * std::max<size_t>(count, 1)));
  }
  void upload(const std::vector<T>& v) {
    alloc(v.size());
    if (!v.empty()) MOEKIT_CUDA_CHECK(cudaMemcpy(p, v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice));
  }
};

struct DeviceMatrix {
  sm90::LayoutDims dims;
  DevBuf<uint8_t> codes, scales;
  DevBuf<float> row_scale, bias;
  bool single_multiply = true;

  void upload(const sm90::ConvertedMatrix& m) {
    dims = m.dims;
    codes.upload(m.codes);
    scales.upload(m.scales);
    if (!m.row_scale.empty()) row_scale.upload(m.row_scale);
    if (!m.bias.empty()) bias.upload(m.bias);
    single_multiply = m.single_multiply;
  }
  int64_t bytes_per_expert() const {
    return dims.E ? (dims.code_bytes() + dims.scale_bytes()) / dims.E : 0;
  }
};

// Random but valid weights on the device: codes anywhere, scales in a range that keeps the
// layer's outputs finite and lets every format use its single-multiply path.
__global__ void fill_synthetic(uint8_t* p, int64_t n, uint64_t seed, int kind) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t h = (uint64_t(i) + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    uint8_t b = uint8_t(h);
    switch (kind) {
      case 0: break;                                              // fp4 codes: any byte
      case 1: b &= 0xbf; break;                                   // e4m3 codes, |v| < 2, no NaN
      case 2: b = uint8_t(118 + (h >> 8) % 6); break;             // E8M0 scales 2^-9 .. 2^-4
      case 3: b = uint8_t(0x30 + (h >> 8) % 0x18); break;         // E4M3 block scales 0.5 .. 6
      case 4: b = (i & 1) ? uint8_t(0x3c + ((h >> 8) & 1) + ((h >> 16) & 0x80)) : b; break;  // bf16 ~2^-7
    }
    p[i] = b;
  }
}

void synthesize(DeviceMatrix& m, const sm90::LayoutDims& d, uint64_t seed) {
  m.dims = d;
  m.codes.alloc(size_t(d.code_bytes()));
  const int code_kind = d.format == WeightFormat::kMxfp8 ? 1 : d.format == WeightFormat::kBf16 ? 4 : 0;
  fill_synthetic<<<1024, 256>>>(m.codes.p, d.code_bytes(), seed, code_kind);
  if (d.scale_bytes() > 0) {
    m.scales.alloc(size_t(d.scale_bytes()));
    fill_synthetic<<<1024, 256>>>(m.scales.p, d.scale_bytes(), seed + 1,
                                  d.format == WeightFormat::kNvfp4 ? 3 : 2);
  }
  if (d.format == WeightFormat::kNvfp4) {
    m.row_scale.upload(std::vector<float>(size_t(d.E * d.N_pad), 128.0f * 0.01f));
  }
  MOEKIT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

struct Sm90Layer::Impl {
  MoeConfig cfg;
  ActivationFormat fmt = ActivationFormat::kStandard;
  DeviceMatrix w13, w2;
  DevBuf<float> score_bias;
  int64_t H_pad = 0, I_pad = 0;
  int sms = 0;
  int grid[2] = {0, 0};  // persistent grid of each GEMM shape (sm90::GemmShape)
  int max_grid = 0;
  double hbm_bytes_per_sm_cycle = 0;  // peak HBM bandwidth over SMs x SM clock (the shape rule)
  // $MOEKIT_GEMM_SHAPE = narrow | wide overrides the choice (experiments, tests).
  std::string shape_override = [] {
    const char* v = std::getenv("MOEKIT_GEMM_SHAPE");
    return std::string(v ? v : "");
  }();
  // Which GEMM kernel runs T tokens: the decode kernel below prefill_from tokens, the prefill
  // kernel from there on (set_prefill_from); -1: never the prefill kernel.
  int64_t prefill_from = -1;
  bool prefill_ok = false;  // the prefill kernel can run these weights (single-multiply scales)
  DevBuf<int> prefill_counters;  // per GEMM: tile counter, exit count (zero between launches)
  // The prefill kernel's views of act_in and act_mid (16-row boxes), made by reserve().
  CUtensorMap map_in{}, map_mid{};

  // workspace
  int64_t max_tokens = -1;
  int kmax = 0;
  int64_t rows = 0;
  int capacity = 0;
  DevBuf<uint16_t> x, y, act_in, act_mid;
  DevBuf<float> logits, weights, out2, partials;
  DevBuf<int32_t> ids, dest, rank, row_src;
  // work: num_active, done, error, exit_count, expert[E], count[E], row_start[E], chunk_prefix[E+1],
  // expert_count[E], task_counter
  DevBuf<int> work, counters, done1buf;
  DevBuf<unsigned long long> trace;
  bool tracing = false;
  // Scheduling choice (sm90_moe_gemm.cuh FusedArgs, phase_tasks); $MOEKIT_SLICE_COST overrides
  // it for experiments (docs/PERFORMANCE.md).
  int slice_cost = std::max(0, env_int("MOEKIT_SLICE_COST", 4));
  sm90::PlanBuffers plan;
  int* done1 = nullptr;
  int* exit_count = nullptr;
  int* task_counter = nullptr;
  size_t partial_floats = 0;  // per phase
  int64_t segs = 0;
  int plan_k = 0;
  int used_k = 0;  // k of the last plan

  void init_common() {
    H_pad = sm90::pad_to(cfg.hidden, sm90::kAlign);
    I_pad = sm90::pad_to(cfg.intermediate, sm90::kAlign);
    int dev = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    int sm_khz = 0, mem_khz = 0, bus_bits = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
    // Double data rate: two transfers of bus_bits per memory clock.
    if (sm_khz > 0) hbm_bytes_per_sm_cycle = 2.0 * double(mem_khz) * double(bus_bits) / 8.0 / (double(sms) * sm_khz);
    for (auto sh : {sm90::GemmShape::kNarrow, sm90::GemmShape::kWide}) {
      const auto real = sm90::gemm_shape(cfg.format, single_multiply(), sh);
      grid[int(sh)] = sms * sm90::gemm_ctas_per_sm(cfg.format, real);
    }
    max_grid = std::max(grid[0], grid[1]);
    prefill_ok = sm90::prefill::prefill_supports(cfg.format, single_multiply(), cfg.num_experts);
    prefill_counters.alloc(4, true);
  }

  bool use_prefill(int64_t T) const { return prefill_ok && prefill_from >= 0 && T >= prefill_from; }

  sm90::prefill::PrefillArgs prefill_args(bool second, int k) const {
    const DeviceMatrix& w = second ? w2 : w13;
    sm90::prefill::PrefillArgs a;
    a.dims = w.dims;
    a.codes = w.codes.p;
    a.scales = w.scales.p;
    a.row_scale = w.row_scale.p;
    a.bias = w.bias.p;
    (void)k;
    a.in_map = second ? map_mid : map_in;
    a.work = plan.work();
    a.gemm2 = second;
    a.act = activation_params(cfg);
    a.out_act = act_mid.p;
    a.out_f32 = out2.p;
    a.out_cols = cfg.hidden;
    a.row_src = row_src.p;
    a.topk_weights = weights.p;
    a.tile_counter = prefill_counters.p + (second ? 2 : 0);
    a.exit_count = prefill_counters.p + (second ? 3 : 1);
    return a;
  }

  void reserve(int64_t T, int k) {
    if (T <= max_tokens && k <= kmax) return;
    max_tokens = std::max<int64_t>(T, 1);
    kmax = std::max(k, cfg.top_k);
    const int E = cfg.num_experts;
    const int64_t N = max_tokens * kmax;
    capacity = int(max_tokens);
    rows = fmt == ActivationFormat::kStandard ? N + int64_t(E) * (sm90::kRowAlign - 1)
                                              : int64_t(E) * capacity;
    x.alloc(size_t(max_tokens * H_pad), true);  // rows padded to H_pad with zeros
    y.alloc(size_t(max_tokens * cfg.hidden));
    logits.alloc(size_t(max_tokens * E));
    ids.alloc(size_t(N));
    weights.alloc(size_t(N));
    dest.alloc(size_t(N));
    rank.alloc(size_t(N));
    row_src.alloc(size_t(rows), true);
    // The standard format is read straight from x through row_src (the GEMM's producer gathers
    // rows); the batched format is materialized by the permute kernel.
    // The prefill kernel reads x permuted into expert order in both formats.
    if (fmt == ActivationFormat::kBatched || prefill_from >= 0) act_in.alloc(size_t(rows * H_pad), true);
    act_mid.alloc(size_t(rows * I_pad), true);
    out2.alloc(size_t(rows * cfg.hidden), true);
    MOEKIT_CUDA_CHECK(sm90::prefill::make_rows_map(&map_mid, act_mid.p, rows, I_pad, 16));
    if (act_in.p) MOEKIT_CUDA_CHECK(sm90::prefill::make_rows_map(&map_in, act_in.p, rows, H_pad, 16));
    // A sliced phase has at most kMaxSlicedWaves tasks per CTA (sm90_moe_gemm.cuh phase_tasks).
    partial_floats = size_t(max_grid) * sm90::kMaxSlicedWaves * sm90::kPartialFloats;
    partials.alloc(2 * partial_floats);  // per phase
    const int64_t chunks = E + (N + sm90::kTokens - 1) / sm90::kTokens;
    segs = chunks * std::max(w13.dims.groups(), w2.dims.groups());
    // The kernel numbers tasks with int: both phases' segments plus the sliced extra.
    MOEKIT_REQUIRE(chunks * (w13.dims.groups() + w2.dims.groups()) + 2 * int64_t(max_grid) * sm90::kMaxSlicedWaves <
                       int64_t(std::numeric_limits<int>::max()) - int64_t(max_grid),
                   "Sm90Layer: ", max_tokens, " tokens make too many GEMM tasks; run fewer per call");
    counters.alloc(size_t(2 * segs), true);  // per phase
    work.alloc(size_t(4 + 5 * E + 2), true);
    done1buf.alloc(size_t(E) * size_t(w13.dims.groups()), true);
    plan.num_active = work.p;
    plan.done = work.p + 1;
    plan.error = work.p + 2;
    exit_count = work.p + 3;
    plan.expert = work.p + 4;
    plan.count = plan.expert + E;
    plan.row_start = plan.count + E;
    plan.chunk_prefix = plan.row_start + E;
    plan.expert_count = plan.chunk_prefix + E + 1;
    task_counter = plan.expert_count + E;
    done1 = done1buf.p;
    plan.ids = ids.p;
    plan.weights = weights.p;
    plan.dest = dest.p;
    plan.rank = rank.p;
    plan.row_src = row_src.p;
  }

  sm90::GemmArgs gemm_args(bool second, int k) const {
    const DeviceMatrix& w = second ? w2 : w13;
    sm90::GemmArgs g;
    g.dims = w.dims;
    g.codes = w.codes.p;
    g.scales = w.scales.p;
    g.row_scale = w.row_scale.p;
    g.bias = w.bias.p;
    g.single_multiply = w.single_multiply;
    const bool gather = !second && fmt == ActivationFormat::kStandard;
    g.in = second ? act_mid.p : gather ? x.p : act_in.p;
    g.gather_k = gather ? k : 0;
    g.work = plan.work();
    g.gemm2 = second;
    g.act = activation_params(cfg);
    g.out_act = act_mid.p;
    g.out_f32 = out2.p;
    g.out_cols = cfg.hidden;
    g.row_src = row_src.p;
    g.topk_weights = weights.p;
    g.partials = partials.p + (second ? partial_floats : 0);
    g.counters = counters.p + (second ? segs : 0);
    return g;
  }

  // Every scale of both matrices in the one-multiply range (what the 4x4 shape requires).
  bool single_multiply() const { return w13.single_multiply && w2.single_multiply; }

  sm90::GemmShape shape_for(int64_t T) const {
    const bool single = single_multiply();
    sm90::GemmShape want;
    if (shape_override == "wide") {
      want = sm90::GemmShape::kWide;
    } else if (shape_override == "narrow") {
      want = sm90::GemmShape::kNarrow;
    } else {
      sm90::ShapeQuery q;
      q.format = cfg.format;
      q.single_multiply = single;
      q.rows = T * used_k;
      q.hbm_bytes_per_sm_cycle = hbm_bytes_per_sm_cycle;
      want = sm90::choose_gemm_shape(q);
    }
    return sm90::gemm_shape(cfg.format, single, want);
  }

  void enqueue_gemms(cudaStream_t s, int64_t T) {
    if (use_prefill(T)) {
      // One persistent CTA per SM for each GEMM; GEMM2 waits for GEMM1 through PDL.
      MOEKIT_CUDA_CHECK(sm90::prefill::launch_prefill_gemm(prefill_args(false, used_k), sms, s, true));
      MOEKIT_CUDA_CHECK(sm90::prefill::launch_prefill_gemm(prefill_args(true, used_k), sms, s, true));
      return;
    }
    const sm90::GemmShape sh = shape_for(T);
    sm90::FusedArgs f;
    f.g[0] = gemm_args(false, used_k);
    f.g[1] = gemm_args(true, used_k);
    f.nphases = 2;
    f.done1 = done1;
    f.exit_count = exit_count;
    f.trace = tracing ? trace.p : nullptr;
    f.task_counter = task_counter;
    f.slice_cost = slice_cost;
    MOEKIT_CUDA_CHECK(sm90::launch_moe_gemm(f, grid[int(sh)], s, true, sh));
  }

  void enqueue(cudaStream_t s, int64_t T, bool bypass) {
    MOEKIT_REQUIRE(T <= max_tokens, "Sm90Layer: ", T, " tokens exceed the reserved ", max_tokens);
    sm90::PlanArgs a;
    a.route.p = routing_params(cfg, {});
    a.route.p.score_bias = score_bias.p;
    a.route.logits = logits.p;
    a.bypass = bypass;
    a.T = T;
    a.k = bypass ? plan_k : cfg.top_k;
    a.batched = fmt == ActivationFormat::kBatched;
    a.capacity = capacity;
    a.b = plan;
    used_k = a.k;
    MOEKIT_CUDA_CHECK(sm90::launch_route_plan(a, s, false));
    if (fmt == ActivationFormat::kBatched || use_prefill(T))
      MOEKIT_CUDA_CHECK(sm90::launch_permute(x.p, T, a.k, cfg.hidden, H_pad, dest.p, act_in.p, s, true));
    enqueue_gemms(s, T);
    MOEKIT_CUDA_CHECK(sm90::launch_finalize(out2.p, dest.p, T, a.k, cfg.hidden, y.p, s, true));
  }
};

// Allocation failures name what was being allocated (DevBuf names how much).
Sm90Layer::Sm90Layer(const MoeModel& m, ActivationFormat fmt) try : impl_(new Impl) {
  impl_->cfg = m.cfg;
  impl_->fmt = fmt;
  impl_->w13.upload(sm90::convert_w13(m));
  impl_->w2.upload(sm90::convert_w2(m));
  if (!m.score_bias.empty()) impl_->score_bias.upload(m.score_bias);
  impl_->init_common();
  impl_->plan_k = impl_->used_k = m.cfg.top_k;
} catch (const Error& e) {
  fail("sm90 weights: ", e.what());
}

Sm90Layer::Sm90Layer(const MoeConfig& cfg, ActivationFormat fmt, uint64_t seed) try : impl_(new Impl) {
  cfg.validate("synthetic layer");
  impl_->cfg = cfg;
  impl_->fmt = fmt;
  const int64_t H_pad = sm90::pad_to(cfg.hidden, sm90::kAlign), I_pad = sm90::pad_to(cfg.intermediate, sm90::kAlign);
  synthesize(impl_->w13, {cfg.format, cfg.num_experts, 2 * I_pad, H_pad}, seed);
  synthesize(impl_->w2, {cfg.format, cfg.num_experts, H_pad, I_pad}, seed + 7);
  impl_->init_common();
  impl_->plan_k = impl_->used_k = cfg.top_k;
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
} catch (const Error& e) {
  fail("sm90 weights: ", e.what());
}

Sm90Layer::~Sm90Layer() = default;

const MoeConfig& Sm90Layer::config() const { return impl_->cfg; }
Sm90WeightStats Sm90Layer::weight_stats() const {
  return {impl_->w13.bytes_per_expert(), impl_->w2.bytes_per_expert()};
}
void Sm90Layer::reserve(int64_t max_tokens, int k) {
  try {
    impl_->reserve(max_tokens, k);
  } catch (const Error& e) {
    fail("sm90 workspace for ", max_tokens, " tokens x ", k, " slots: ", e.what());
  }
  impl_->plan_k = k;
}
uint16_t* Sm90Layer::x() { return impl_->x.p; }
int64_t Sm90Layer::x_stride() const { return impl_->H_pad; }
float* Sm90Layer::logits() { return impl_->logits.p; }
int32_t* Sm90Layer::ids() { return impl_->ids.p; }
float* Sm90Layer::weights() { return impl_->weights.p; }
uint16_t* Sm90Layer::y() { return impl_->y.p; }
void Sm90Layer::enqueue(cudaStream_t s, int64_t T, bool bypass) { impl_->enqueue(s, T, bypass); }
void Sm90Layer::enqueue_gemms(cudaStream_t s, int64_t T) { impl_->enqueue_gemms(s, T); }
std::string Sm90Layer::gemm_shape(int64_t T) const {
  return impl_->use_prefill(T) ? "prefill" : sm90::shape_name(impl_->shape_for(T));
}
void Sm90Layer::set_prefill_from(int64_t tokens) {
  Impl& m = *impl_;
  m.prefill_from = tokens;
  // Already reserved without the permuted copy of x that the prefill kernel reads: add it.
  if (tokens >= 0 && m.max_tokens >= 0 && !m.act_in.p) {
    m.act_in.alloc(size_t(m.rows * m.H_pad), true);
    MOEKIT_CUDA_CHECK(sm90::prefill::make_rows_map(&m.map_in, m.act_in.p, m.rows, m.H_pad, 16));
  }
}
bool Sm90Layer::prefill_supported() const { return impl_->prefill_ok; }
bool Sm90Layer::uses_prefill(int64_t T) const { return impl_->use_prefill(T); }

void Sm90Layer::enable_trace(bool on) {
  impl_->tracing = on;
  if (on && !impl_->trace.p) impl_->trace.alloc(size_t(impl_->max_grid) * sm90::kTraceStride, true);
  // Zeroed for each traced run: the grid depends on the shape, and CTAs that do not run leave
  // no stale stamps.
  if (on) {
    MOEKIT_CUDA_CHECK(cudaMemset(impl_->trace.p, 0, impl_->trace.n * sizeof(unsigned long long)));
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  }
}
std::vector<unsigned long long> Sm90Layer::trace() {
  std::vector<unsigned long long> v(impl_->trace.n);
  if (!v.empty()) MOEKIT_CUDA_CHECK(cudaMemcpy(v.data(), impl_->trace.p, v.size() * 8, cudaMemcpyDeviceToHost));
  return v;
}
int Sm90Layer::trace_events() const { return sm90::kTraceEvents; }
int Sm90Layer::trace_stride() const { return sm90::kTraceStride; }
int Sm90Layer::trace_tasks() const { return sm90::kTraceTasks; }
int Sm90Layer::trace_record() const { return sm90::kTraceRecord; }

int Sm90Layer::active_experts(cudaStream_t s) {
  int v = 0;
  MOEKIT_CUDA_CHECK(cudaMemcpyAsync(&v, impl_->plan.num_active, 4, cudaMemcpyDeviceToHost, s));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}
int Sm90Layer::plan_error(cudaStream_t s) {
  int v = 0;
  MOEKIT_CUDA_CHECK(cudaMemcpyAsync(&v, impl_->plan.error, 4, cudaMemcpyDeviceToHost, s));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}

}  // namespace moekit
