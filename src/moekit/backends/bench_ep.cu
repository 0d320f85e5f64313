#include "moekit/backends/bench_ep.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <numeric>
#include <random>

#include "moekit/backends/bench.h"
#include "moekit/backends/ep_layer.h"
#include "moekit/comm/ep_host.h"
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

// Median of reps timings of fn, a 256 MiB memset (L2 flush) before each.
double median_us(cudaStream_t s, int reps, const std::function<void()>& fn, void* flush, size_t flush_bytes) {
  cudaEvent_t a, b;
  ck(cudaEventCreate(&a), "event");
  ck(cudaEventCreate(&b), "event");
  std::vector<double> t;
  for (int i = 0; i < reps + 2; ++i) {
    ck(cudaMemsetAsync(flush, i & 0xff, flush_bytes, s), "flush");
    ck(cudaEventRecord(a, s), "event");
    fn();
    ck(cudaEventRecord(b, s), "event");
    ck(cudaEventSynchronize(b), "event");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, a, b), "event");
    if (i >= 2) t.push_back(double(ms) * 1e3);  // two warm-up rounds
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

std::vector<EpBenchRow> bench_ep(const EpBenchOptions& o) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) fail("bench --ep: no CUDA device");
  const MoeConfig cfg = bench_shape(o.shape, o.format);
  const double copy = measure_copy_tbps();
  const size_t flush_bytes = size_t(256) << 20;
  Buf flush(flush_bytes);
  cudaStream_t s = nullptr;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  std::vector<EpBenchRow> rows;
  for (int64_t T : o.tokens) {
    ep::GroupConfig gc;
    ep::Shape& sh = gc.shape;
    sh.world = o.ranks;
    sh.num_experts = cfg.num_experts;
    sh.top_k = cfg.top_k;
    sh.hidden = cfg.hidden;
    sh.hidden_pad = int(sm90::pad_to(cfg.hidden, sm90::kAlign));
    sh.max_tokens = int(std::max<int64_t>(T, 1));
    sh.payload = ep::parse_payload(o.payload);
    // Uniform random routing: k distinct experts per token, weights in (0, 1].
    std::mt19937 rng(uint32_t(o.seed + T));
    std::vector<std::vector<int32_t>> ids(size_t(o.ranks));
    std::vector<std::vector<float>> w(size_t(o.ranks));
    std::vector<int> load(size_t(cfg.num_experts), 0);
    std::vector<int32_t> perm(size_t(cfg.num_experts));
    for (int r = 0; r < o.ranks; ++r)
      for (int64_t t = 0; t < T; ++t) {
        std::iota(perm.begin(), perm.end(), 0);
        for (int j = 0; j < cfg.top_k; ++j) {
          std::swap(perm[size_t(j)], perm[size_t(j) + rng() % (perm.size() - size_t(j))]);
          ids[size_t(r)].push_back(perm[size_t(j)]);
          w[size_t(r)].push_back(float(1 + rng() % 1000) / 1000.0f);
          ++load[size_t(perm[size_t(j)])];
        }
      }
    // Capacity: the busiest expert's rows, rounded up to 64.
    sh.capacity = std::max(64, (*std::max_element(load.begin(), load.end()) + 63) / 64 * 64);
    gc.nvfp4_g = 448.0f * 6.0f / 8.0f;
    EpLayer layer(cfg, gc, o.seed, 0);
    // Inputs: x random bf16 in [-2, 2), y outputs.
    std::vector<std::unique_ptr<Buf>> keep;
    std::vector<ep::RankInput> in(size_t(o.ranks));
    std::vector<uint16_t> x(size_t(std::max<int64_t>(T, 1) * cfg.hidden));
    for (int r = 0; r < o.ranks; ++r) {
      for (uint16_t& v : x) v = uint16_t(0x3f80 + (rng() % 256) - 128) | uint16_t(rng() % 2 ? 0x8000 : 0);
      auto bx = std::make_unique<Buf>(x.size() * 2), by = std::make_unique<Buf>(x.size() * 2);
      auto bi = std::make_unique<Buf>(ids[size_t(r)].size() * 4), bw = std::make_unique<Buf>(w[size_t(r)].size() * 4);
      ck(cudaMemcpy(bx->p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), "x");
      ck(cudaMemcpy(bi->p, ids[size_t(r)].data(), ids[size_t(r)].size() * 4, cudaMemcpyHostToDevice), "ids");
      ck(cudaMemcpy(bw->p, w[size_t(r)].data(), w[size_t(r)].size() * 4, cudaMemcpyHostToDevice), "weights");
      in[size_t(r)] = {T, static_cast<uint16_t*>(bx->p), cfg.hidden, static_cast<int32_t*>(bi->p),
                       static_cast<float*>(bw->p), static_cast<uint16_t*>(by->p), cfg.hidden};
      for (auto* b : {&bx, &by, &bi, &bw}) keep.push_back(std::move(*b));
    }
    // The copies above ran on the legacy stream, which s (non-blocking) does not wait for, and a
    // pageable copy may still be in flight when cudaMemcpy returns.
    ck(cudaDeviceSynchronize(), "inputs");
    layer.set_inputs(in);
    layer.forward(s);
    const std::string err = layer.group().check(s);
    MOEKIT_REQUIRE(err.empty(), "bench --ep: ", err);
    EpBenchRow row;
    row.ranks = o.ranks;
    row.tokens = T;
    row.payload = o.payload;
    row.slots = int64_t(o.ranks) * T * cfg.top_k;
    ep::Group& g = layer.group();
    row.dispatch_us = median_us(s, o.reps, [&] { g.dispatch_exchange_only(s); }, flush.p, flush_bytes);
    row.dispatch_all_us = median_us(s, o.reps, [&] { g.dispatch(s); }, flush.p, flush_bytes);
    row.experts_us = median_us(s, std::max(3, o.reps / 5), [&] { layer.experts(s); }, flush.p, flush_bytes);
    row.combine_us = median_us(s, o.reps, [&] { g.combine(s); }, flush.p, flush_bytes);
    MOEKIT_REQUIRE(g.check(s).empty(), "bench --ep: a timed round failed");
    row.dispatch_bytes = double(row.slots) * double(2 * sh.payload_bytes() + 16);
    row.combine_bytes = double(row.slots) * double(cfg.hidden) * 4 + double(o.ranks) * double(T) * cfg.hidden * 2;
    row.copy_tbps = copy;
    row.dispatch_pct = 100.0 * row.dispatch_bytes / (row.dispatch_us * 1e-6) / (copy * 1e12);
    row.combine_pct = 100.0 * row.combine_bytes / (row.combine_us * 1e-6) / (copy * 1e12);
    rows.push_back(row);
  }
  cudaStreamDestroy(s);
  return rows;
}

}  // namespace moekit
