#include "moekit/bench/bench_ep.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>

#include "moekit/backends/ep_layer.h"
#include "moekit/bench/bench.h"
#include "moekit/comm/ep_host.h"
#include "moekit/comm/ep_kernels_sm90.cuh"  // TraceEvent
#include "moekit/comm/nccl_window.h"
#include "moekit/common/error.h"
#include "moekit/experts/sm90_layout.h"

namespace moekit {

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("bench --ep: ", what, ": ", cudaGetErrorString(e));
}

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t n) { ck(cudaMalloc(&p, std::max<size_t>(n, 1)), "cudaMalloc"); }
  ~Buf() { cudaFree(p); }
};

// Before each timed rep (NCCL ranks): the ranks meet on the host, then, after the L2 flush, at a
// one-int all-reduce on the timed stream, so that the timed regions start together.
// $MOEKIT_EP_BENCH_ALIGN=0 (diagnostics) leaves the device step out: each rank's timed region
// then starts when its host gets there, as this bench timed before (docs/perf/log.md).
struct Sync {
  void* comm = nullptr;  // null: virtual ranks (one launch covers them all)
  int* scratch = nullptr;
  bool align = true;
  void host() const {
    if (comm) ep::NcclWindow::comm_barrier(comm);
  }
  void device(cudaStream_t s) const {
    if (comm && align) ep::NcclWindow::allreduce_on(comm, scratch, s);
  }
};

bool bench_align() {
  const char* v = std::getenv("MOEKIT_EP_BENCH_ALIGN");
  return !(v && std::string(v) == "0");
}

// $MOEKIT_EP_BENCH_PARTS=dispatch (diagnostics): time the dispatch exchange alone (no experts,
// combine or layer rows; the traced rounds are dispatches).
bool bench_dispatch_only() {
  const char* v = std::getenv("MOEKIT_EP_BENCH_PARTS");
  return v && std::string(v) == "dispatch";
}

// $MOEKIT_EP_TRACE_CTAS=1 (diagnostics, with --trace): every CTA's dispatch stamps of the median
// traced round, a line per CTA, us after the rank's first start.
bool trace_ctas() {
  const char* v = std::getenv("MOEKIT_EP_TRACE_CTAS");
  return v && std::string(v) == "1";
}

// Median of reps timings of fn, a 256 MiB memset (L2 flush) before each; inner > 1: fn that many
// times back to back in each timed region, the time per call (the steady state of consecutive
// rounds, where the ranks run in step, as an engine's layers do).
double median_us(cudaStream_t s, int reps, const std::function<void()>& fn, void* flush, size_t flush_bytes,
                 const Sync& sync, int inner = 1) {
  cudaEvent_t a, b;
  ck(cudaEventCreate(&a), "event");
  ck(cudaEventCreate(&b), "event");
  std::vector<double> t;
  for (int i = 0; i < reps + 2; ++i) {
    sync.host();
    ck(cudaMemsetAsync(flush, i & 0xff, flush_bytes, s), "flush");
    sync.device(s);
    ck(cudaEventRecord(a, s), "event");
    for (int j = 0; j < inner; ++j) fn();
    ck(cudaEventRecord(b, s), "event");
    ck(cudaEventSynchronize(b), "event");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, a, b), "event");
    if (i >= 2) t.push_back(double(ms) * 1e3 / inner);  // two warm-up rounds
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// One token count's problem: the group's shape and every rank's routing.
struct EpProblem {
  ep::GroupConfig gc;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> w;
};

EpProblem make_problem(const EpBenchOptions& o, const MoeConfig& cfg, int64_t T, const std::string& payload) {
  EpProblem p;
  ep::Shape& sh = p.gc.shape;
  sh.world = o.ranks;
  sh.num_experts = cfg.num_experts;
  sh.top_k = cfg.top_k;
  sh.hidden = cfg.hidden;
  sh.hidden_pad = int(sm90::pad_to(cfg.hidden, sm90::kAlign));
  sh.max_tokens = int(std::max<int64_t>(T, 1));
  sh.payload = ep::parse_payload(payload);
  sh.combine = o.combine == "bf16"       ? ep::CombineRows::kBf16
               : o.combine == "bf16_sum" ? ep::CombineRows::kBf16Sum
                                         : ep::CombineRows::kF32;
  // Uniform random routing: k distinct experts per token, weights in (0, 1].
  std::mt19937 rng(uint32_t(o.seed + T));
  p.ids.resize(size_t(o.ranks));
  p.w.resize(size_t(o.ranks));
  std::vector<int> load(size_t(cfg.num_experts), 0);
  std::vector<int32_t> perm(size_t(cfg.num_experts));
  for (int r = 0; r < o.ranks; ++r)
    for (int64_t t = 0; t < T; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      for (int j = 0; j < cfg.top_k; ++j) {
        std::swap(perm[size_t(j)], perm[size_t(j) + rng() % (perm.size() - size_t(j))]);
        p.ids[size_t(r)].push_back(perm[size_t(j)]);
        p.w[size_t(r)].push_back(float(1 + rng() % 1000) / 1000.0f);
        ++load[size_t(perm[size_t(j)])];
      }
    }
  // Capacity: the busiest expert's rows, rounded up to 64.
  sh.capacity = std::max(64, (*std::max_element(load.begin(), load.end()) + 63) / 64 * 64);
  p.gc.nvfp4_g = 448.0f * 6.0f / 8.0f;
  return p;
}

// Rank r's inputs on the current device (x random bf16 in [-2, 2), from a random stream of its own).
ep::RankInput rank_input(const EpProblem& p, const MoeConfig& cfg, int64_t T, int r, uint64_t seed,
                         std::vector<std::unique_ptr<Buf>>* keep) {
  std::mt19937 rng(uint32_t(seed * 7919 + uint64_t(T) * 131 + uint64_t(r)));
  std::vector<uint16_t> x(size_t(std::max<int64_t>(T, 1) * cfg.hidden));
  for (uint16_t& v : x) v = uint16_t(0x3f80 + (rng() % 256) - 128) | uint16_t(rng() % 2 ? 0x8000 : 0);
  auto bx = std::make_unique<Buf>(x.size() * 2), by = std::make_unique<Buf>(x.size() * 2);
  auto bi = std::make_unique<Buf>(p.ids[size_t(r)].size() * 4), bw = std::make_unique<Buf>(p.w[size_t(r)].size() * 4);
  ck(cudaMemcpy(bx->p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), "x");
  ck(cudaMemcpy(bi->p, p.ids[size_t(r)].data(), p.ids[size_t(r)].size() * 4, cudaMemcpyHostToDevice), "ids");
  ck(cudaMemcpy(bw->p, p.w[size_t(r)].data(), p.w[size_t(r)].size() * 4, cudaMemcpyHostToDevice), "weights");
  ep::RankInput in;
  in.T = T;
  in.x = static_cast<uint16_t*>(bx->p);
  in.x_stride = cfg.hidden;
  in.ids = static_cast<int32_t*>(bi->p);
  in.weights = static_cast<float*>(bw->p);
  in.y = static_cast<uint16_t*>(by->p);
  in.y_stride = cfg.hidden;
  for (auto* b : {&bx, &by, &bi, &bw}) keep->push_back(std::move(*b));
  return in;
}

// A rank's phases from its CTAs' stamps: per event the median and the largest over the CTAs that
// stamped it, in us after the rank's first start stamp.
std::string trace_line(const std::vector<uint64_t>& t, int local, int max_ctas, int ctas, const char* kernel,
                       std::initializer_list<std::pair<int, const char*>> events, int rank) {
  const uint64_t* base = t.data() + size_t(local) * max_ctas * ep::kTraceEvents;
  uint64_t t0 = UINT64_MAX;
  for (int c = 0; c < ctas; ++c)
    if (base[size_t(c) * ep::kTraceEvents + ep::kTrStart]) t0 = std::min(t0, base[size_t(c) * ep::kTraceEvents]);
  char buf[256];
  std::snprintf(buf, sizeof buf, "rank %d %s (%d CTAs, start %llu ns):", rank, kernel, ctas,
                (unsigned long long)(t0 == UINT64_MAX ? 0 : t0));
  std::string line = buf;
  for (const auto& [ev, name] : events) {
    std::vector<double> v;
    for (int c = 0; c < ctas; ++c) {
      const uint64_t x = base[size_t(c) * ep::kTraceEvents + size_t(ev)];
      if (x) v.push_back(double(x - t0) / 1e3);
    }
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    std::snprintf(buf, sizeof buf, " %s %.1f/%.1f", name, v[v.size() / 2], v.back());
    line += buf;
  }
  return line + " (us, median/max over CTAs)";
}

constexpr int kSteady = 10, kSteadyLayers = 5;  // rounds back to back in the steady timings

// One round checked, then dispatch, the experts, combine and the whole layer timed apart on s.
EpBenchRow time_layer(ParallelLayer& layer, const EpBenchOptions& o, cudaStream_t s, void* flush, size_t flush_bytes,
                      const Sync& sync) {
  // The input copies ran on the legacy stream, which s (non-blocking) does not wait for, and a
  // pageable copy may still be in flight when cudaMemcpy returns.
  ck(cudaDeviceSynchronize(), "inputs");
  layer.forward(s);
  const std::string err = layer.group().check(s);
  MOEKIT_REQUIRE(err.empty(), "bench --ep: ", err);
  ep::Group& g = layer.group();
  EpBenchRow row;
  const bool all = !bench_dispatch_only();
  row.dispatch_us = median_us(s, o.reps, [&] { g.dispatch_exchange_only(s); }, flush, flush_bytes, sync);
  if (all) {
    row.dispatch_all_us = median_us(s, o.reps, [&] { g.dispatch(s); }, flush, flush_bytes, sync);
    row.experts_us = median_us(s, std::max(3, o.reps / 5), [&] { layer.experts(s); }, flush, flush_bytes, sync);
    row.combine_us = median_us(s, o.reps, [&] { g.combine(s); }, flush, flush_bytes, sync);
    row.layer_us = median_us(s, std::max(3, o.reps / 5), [&] { layer.forward(s); }, flush, flush_bytes, sync);
  }
  row.dispatch_steady_us =
      median_us(s, std::max(3, o.reps / 2), [&] { g.dispatch_exchange_only(s); }, flush, flush_bytes, sync, kSteady);
  if (all) {
    row.combine_steady_us =
        median_us(s, std::max(3, o.reps / 2), [&] { g.combine(s); }, flush, flush_bytes, sync, kSteady);
    row.layer_steady_us =
        median_us(s, std::max(3, o.reps / 5), [&] { layer.forward(s); }, flush, flush_bytes, sync, kSteadyLayers);
  }
  row.dispatch_ctas = g.last_dispatch_ctas();
  row.combine_ctas = g.last_combine_ctas();
  MOEKIT_REQUIRE(g.check(s).empty(), "bench --ep: a timed round failed");
  if (o.trace) {
    // Ten rounds started as the timed ones were; the trace of this rank's slowest dispatch (the
    // span of its stamps) is kept, and of the one at the median, so a rare stall shows too.
    struct Kept {
      uint64_t span = 0;
      ep::Group::Trace t;
    };
    std::vector<Kept> rounds;
    for (int i = 0; i < 10; ++i) {
      g.enable_trace(true);
      sync.host();
      ck(cudaMemsetAsync(flush, i & 0xff, flush_bytes, s), "flush");
      sync.device(s);
      if (all) layer.forward(s);
      else g.dispatch_exchange_only(s);
      MOEKIT_REQUIRE(g.check(s).empty(), "bench --ep: a traced round failed");
      Kept k{0, g.trace()};
      for (int l = 0; l < g.local_ranks(); ++l) {
        uint64_t lo = UINT64_MAX, hi = 0;
        for (int c = 0; c < k.t.dispatch_ctas; ++c)
          for (int ev = 0; ev < ep::kTraceEvents; ++ev) {
            const uint64_t x = k.t.dispatch[(size_t(l) * k.t.max_ctas + size_t(c)) * ep::kTraceEvents + size_t(ev)];
            if (x) lo = std::min(lo, x), hi = std::max(hi, x);
          }
        if (hi > lo) k.span = std::max(k.span, hi - lo);
      }
      rounds.push_back(std::move(k));
    }
    std::sort(rounds.begin(), rounds.end(), [](const Kept& a, const Kept& b) { return a.span < b.span; });
    for (const Kept* k : {&rounds.back(), &rounds[rounds.size() / 2]}) {
      const ep::Group::Trace& t = k->t;
      const std::string which = k == &rounds.back() ? "slowest of 10" : "median of 10";
      for (int i = 0; i < g.local_ranks(); ++i) {
        row.trace.push_back(which + ": " +
                            trace_line(t.dispatch, i, t.max_ctas, t.dispatch_ctas, "dispatch",
                                       {{ep::kTrStart, "start"},
                                        {ep::kTrPublished, "published"},
                                        {ep::kTrCountsSeen, "counts_seen"},
                                        {ep::kTrDataDone, "data_done"},
                                        {ep::kTrSignaled, "signaled"},
                                        {ep::kTrAllDone, "all_done"},
                                        {ep::kTrFanWait, "fan_wait"},  // MOEKIT_EP_DISPATCH=fanout
                                        {ep::kTrFanned, "fanned"}},
                                       g.rank(i)));
        if (trace_ctas() && k == &rounds[rounds.size() / 2]) {
          const uint64_t* b = t.dispatch.data() + size_t(i) * t.max_ctas * ep::kTraceEvents;
          uint64_t t0 = UINT64_MAX;
          for (int c = 0; c < t.dispatch_ctas; ++c)
            if (b[size_t(c) * ep::kTraceEvents]) t0 = std::min(t0, b[size_t(c) * ep::kTraceEvents]);
          for (int c = 0; c < t.dispatch_ctas; ++c) {
            std::string line = "cta rank " + std::to_string(g.rank(i)) + " " + std::to_string(c) + ":";
            for (int ev = 0; ev < ep::kTraceEvents; ++ev) {
              const uint64_t x = b[size_t(c) * ep::kTraceEvents + size_t(ev)];
              char buf[32];
              std::snprintf(buf, sizeof buf, " %.2f", x && x >= t0 ? double(x - t0) / 1e3 : -1.0);
              line += buf;
            }
            row.trace.push_back(line);
          }
        }
        row.trace.push_back(which + ": " +
                            trace_line(t.combine, i, t.max_ctas, t.combine_ctas, "combine",
                                       {{ep::kTrSummed, "summed"},  // bf16_sum rows
                                        {ep::kTrFlagsSeen, "flags_seen"},
                                        {ep::kTrCombined, "combined"}},
                                       g.rank(i)));
      }
    }
    g.enable_trace(false);
  }
  return row;
}

// What a row's bytes are, from the problem and the timings.
void fill_bytes(EpBenchRow* row, const EpBenchOptions& o, const MoeConfig& cfg, const ep::Shape& sh, int64_t T,
                const std::string& payload, double copy) {
  row->ranks = o.ranks;
  row->local_gpus = o.local_gpus;
  row->tokens = T;
  row->payload = payload;
  row->combine = o.combine;
  row->slots = int64_t(o.ranks) * T * cfg.top_k;
  row->dispatch_bytes = double(row->slots) * double(2 * sh.payload_bytes() + 16);
  row->combine_bytes = double(row->slots) * double(sh.y_row_bytes()) + double(o.ranks) * double(T) * cfg.hidden * 2;
  row->copy_tbps = copy;
  // Of the copy rate of the GPUs that move the bytes: one (virtual ranks) or R.
  const double gpus = o.local_gpus ? o.ranks : 1;
  // 0 for a part not timed (MOEKIT_EP_BENCH_PARTS=dispatch): JSON has no infinity.
  const auto pct = [&](double b, double us) { return us > 0 ? 100.0 * b / (us * 1e-6) / (copy * 1e12 * gpus) : 0.0; };
  row->dispatch_pct = pct(row->dispatch_bytes, row->dispatch_us);
  row->combine_pct = pct(row->combine_bytes, row->combine_us);
  row->send_gbps_per_rank = double(T) * cfg.top_k * double(sh.payload_bytes()) / (row->dispatch_us * 1e-6) / 1e9;
}

// Rank r of R (the calling thread's or process's current device r): its layer, inputs, timings.
EpBenchRow comm_rank(const EpBenchOptions& o, const MoeConfig& cfg, const EpProblem& p, int64_t T, int r, void* comm) {
  const size_t flush_bytes = size_t(256) << 20;
  Buf flush(flush_bytes);
  Buf scratch(sizeof(int));
  cudaStream_t s = nullptr;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  std::vector<std::unique_ptr<Buf>> keep;
  EpBenchRow row;
  {
    ParallelLayer layer(cfg, p.gc, o.seed, comm);  // collective
    layer.set_inputs({rank_input(p, cfg, T, r, o.seed, &keep)});
    row = time_layer(layer, o, s, flush.p, flush_bytes, Sync{comm, static_cast<int*>(scratch.p), bench_align()});
  }
  cudaStreamDestroy(s);
  return row;
}

void take_slowest(EpBenchRow* row, const EpBenchRow& q) {
  row->dispatch_us = std::max(row->dispatch_us, q.dispatch_us);
  row->dispatch_all_us = std::max(row->dispatch_all_us, q.dispatch_all_us);
  row->experts_us = std::max(row->experts_us, q.experts_us);
  row->combine_us = std::max(row->combine_us, q.combine_us);
  row->layer_us = std::max(row->layer_us, q.layer_us);
  row->dispatch_steady_us = std::max(row->dispatch_steady_us, q.dispatch_steady_us);
  row->combine_steady_us = std::max(row->combine_steady_us, q.combine_steady_us);
  row->layer_steady_us = std::max(row->layer_steady_us, q.layer_steady_us);
  row->dispatch_ctas = std::max(row->dispatch_ctas, q.dispatch_ctas);
  row->combine_ctas = std::max(row->combine_ctas, q.combine_ctas);
  row->trace.insert(row->trace.end(), q.trace.begin(), q.trace.end());
}

}  // namespace

std::vector<EpBenchRow> bench_ep(const EpBenchOptions& o) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) fail("bench --ep: no CUDA device");
  MOEKIT_REQUIRE(!o.local_gpus || (o.ranks >= 1 && o.ranks <= n), "bench --ep ", o.ranks, " --ep-gpus: ", n,
                 " GPUs here");
  const MoeConfig cfg = bench_shape(o.shape, o.format);
  ck(cudaSetDevice(0), "cudaSetDevice");
  const double copy = measure_copy_tbps();
  std::vector<void*> comms;
  if (o.local_gpus) comms = ep::NcclWindow::init_all(o.ranks);
  std::vector<EpBenchRow> rows;
  for (const std::string& payload : o.payloads)
    for (int64_t T : o.tokens) {
      const EpProblem p = make_problem(o, cfg, T, payload);
      EpBenchRow row;
      if (o.local_gpus) {
        // One thread per GPU; each row figure is the slowest rank's median.
        std::vector<EpBenchRow> per(size_t(o.ranks));
        std::vector<std::string> errors(size_t(o.ranks));
        std::vector<std::thread> th;
        for (int r = 0; r < o.ranks; ++r)
          th.emplace_back([&, r] {
            try {
              ck(cudaSetDevice(r), "cudaSetDevice");
              per[size_t(r)] = comm_rank(o, cfg, p, T, r, comms[size_t(r)]);
            } catch (const std::exception& e) {
              errors[size_t(r)] = e.what();
            }
          });
        for (auto& t : th) t.join();
        for (int r = 0; r < o.ranks; ++r) MOEKIT_REQUIRE(errors[size_t(r)].empty(), "rank ", r, ": ", errors[size_t(r)]);
        for (const EpBenchRow& q : per) take_slowest(&row, q);
        ck(cudaSetDevice(0), "cudaSetDevice");
      } else {
        const size_t flush_bytes = size_t(256) << 20;
        Buf flush(flush_bytes);
        cudaStream_t s = nullptr;
        ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
        ParallelLayer layer(cfg, p.gc, o.seed, 0);
        std::vector<std::unique_ptr<Buf>> keep;
        std::vector<ep::RankInput> in;
        for (int r = 0; r < o.ranks; ++r) in.push_back(rank_input(p, cfg, T, r, o.seed, &keep));
        layer.set_inputs(in);
        row = time_layer(layer, o, s, flush.p, flush_bytes, Sync{});
        cudaStreamDestroy(s);
      }
      fill_bytes(&row, o, cfg, p.gc.shape, T, payload, copy);
      rows.push_back(row);
    }
  for (void* c : comms) ep::NcclWindow::destroy_comm(c);
  return rows;
}

std::vector<EpBenchRow> bench_ep_rank(const EpBenchOptions& o, void* nccl_comm) {
  const MoeConfig cfg = bench_shape(o.shape, o.format);
  const int r = ep::NcclWindow::comm_rank(nccl_comm);
  MOEKIT_REQUIRE(ep::NcclWindow::comm_size(nccl_comm) == o.ranks, "bench --ep: the communicator has ",
                 ep::NcclWindow::comm_size(nccl_comm), " ranks, --ep ", o.ranks);
  const double copy = measure_copy_tbps();
  std::vector<EpBenchRow> rows;
  for (const std::string& payload : o.payloads)
    for (int64_t T : o.tokens) {
      const EpProblem p = make_problem(o, cfg, T, payload);  // every rank draws every rank's routing alike
      EpBenchRow row = comm_rank(o, cfg, p, T, r, nccl_comm);
      EpBenchOptions lo = o;
      lo.local_gpus = true;
      fill_bytes(&row, lo, cfg, p.gc.shape, T, payload, copy);
      rows.push_back(row);
    }
  return rows;
}

std::vector<EpBenchRow> bench_ep_process(const EpBenchOptions& o, const std::vector<uint8_t>& unique_id, int rank) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) fail("bench --ep: no CUDA device");
  MOEKIT_REQUIRE(rank >= 0 && rank < n, "bench --ep: rank ", rank, " has no GPU of its own (", n, " here)");
  ck(cudaSetDevice(rank), "cudaSetDevice");
  void* comm = ep::NcclWindow::init_rank(unique_id, o.ranks, rank);
  std::vector<EpBenchRow> rows;
  try {
    rows = bench_ep_rank(o, comm);
  } catch (...) {
    ep::NcclWindow::destroy_comm(comm);
    throw;
  }
  ep::NcclWindow::destroy_comm(comm);
  return rows;
}

}  // namespace moekit
