#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>

#include "moekit/backends/bench.h"
#include "moekit/backends/sm90_layer.h"
#include "moekit/common/error.h"
#include "moekit/oracle/tuning.h"

namespace moekit {

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("CUDA error in ", what, ": ", cudaGetErrorString(e));
}

// Reads a buffer larger than L2 so that the next kernel finds none of its weights there.
__global__ void l2_flush_kernel(const int4* p, int64_t n, int* sink) {
  int acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int4 v = __ldcg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x7fffffff) *sink = acc;
}

// A plain streaming read of n 16-byte words (four loads in flight per thread), indices taken
// modulo the buffer (mask + 1 words, a power of two): the floor for any kernel that must read
// the same bytes once, timed the same way as the GEMMs.
__global__ void read_kernel(const int4* p, int64_t n, int64_t mask, int* sink) {
  int acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    int4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = __ldcs(p + ((i + j * stride) & mask));
#pragma unroll
    for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n; i += stride) {
    const int4 v = __ldcs(p + (i & mask));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x7fffffff) *sink = acc;
}

__global__ void empty_kernel() {}

struct Flusher {
  int4* buf = nullptr;
  int* sink = nullptr;
  int64_t n = 0;
  Flusher() {
    int dev = 0, l2 = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
    n = int64_t(std::max(l2, 1 << 20)) * 4 / 16;  // 4x L2
    ck(cudaMalloc(&buf, size_t(n) * 16), "flush alloc");
    ck(cudaMemset(buf, 1, size_t(n) * 16), "flush init");
    ck(cudaMalloc(&sink, 4), "flush alloc");
  }
  ~Flusher() {
    cudaFree(buf);
    cudaFree(sink);
  }
  void run(cudaStream_t s) { l2_flush_kernel<<<1024, 256, 0, s>>>(buf, n, sink); }
};

// Median time of a graph, L2 flushed before each replay.
double time_graph(cudaGraphExec_t g, cudaStream_t s, Flusher& fl, int reps) {
  cudaEvent_t a, b;
  ck(cudaEventCreate(&a), "event");
  ck(cudaEventCreate(&b), "event");
  for (int i = 0; i < 3; ++i) ck(cudaGraphLaunch(g, s), "warm-up");
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    fl.run(s);
    ck(cudaEventRecord(a, s), "record");
    ck(cudaGraphLaunch(g, s), "graph launch");
    ck(cudaEventRecord(b, s), "record");
    ck(cudaEventSynchronize(b), "sync");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, a, b), "elapsed");
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return double(t[t.size() / 2]) * 1e3;  // us
}

template <typename F>
cudaGraphExec_t capture(cudaStream_t s, F&& body) {
  cudaGraph_t g;
  ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
  body();
  ck(cudaStreamEndCapture(s, &g), "capture end");
  cudaGraphExec_t e;
  ck(cudaGraphInstantiate(&e, g, 0), "instantiate");
  cudaGraphDestroy(g);
  return e;
}

}  // namespace

double measure_copy_tbps() {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  ck(cudaMalloc(&a, bytes), "copy alloc");
  ck(cudaMalloc(&b, bytes), "copy alloc");
  ck(cudaMemset(a, 1, bytes), "memset");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> t;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(e0);
    ck(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), "copy");
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i >= 2) t.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  std::sort(t.begin(), t.end());
  return 2.0 * double(bytes) / (double(t[t.size() / 2]) * 1e-3) / 1e12;
}

std::vector<BenchRow> bench_gpu(const BenchOptions& o, const std::string& backend) {
  const MoeConfig cfg = bench_shape(o.shape, o.format);
  const double copy = measure_copy_tbps();
  const bool batched = backend.size() > 8 && backend.compare(backend.size() - 8, 8, "_batched") == 0;
  const ActivationFormat fmt = batched ? ActivationFormat::kBatched : ActivationFormat::kStandard;
  // The GEMM kernel: sm90_decode* and sm90_prefill* force one, sm90 / sm90_batched follow the
  // crossover (oracle/tuning.h).
  const int64_t prefill_from = backend.rfind("sm90_decode", 0) == 0    ? -1
                               : backend.rfind("sm90_prefill", 0) == 0 ? 0
                                                                       : sm90_crossover(cfg, DeviceInfo::detect()).prefill_from;
  Sm90Layer layer(cfg, fmt, o.seed);
  layer.set_prefill_from(prefill_from);
  const int64_t tmax = *std::max_element(o.tokens.begin(), o.tokens.end());
  layer.reserve(tmax, cfg.top_k);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  Flusher fl;
  // Reference kernels timed like the GEMMs: an empty one (the floor of the method: graph launch
  // and events) and a plain read of each row's weight bytes from a 1 GiB buffer.
  int sms = 0, dev = 0;
  ck(cudaGetDevice(&dev), "device");
  ck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "attribute");
  const int64_t read_words = int64_t(1) << 26;  // 1 GiB of int4
  int4* read_buf = nullptr;
  ck(cudaMalloc(&read_buf, size_t(read_words) * 16), "read buffer");
  ck(cudaMemset(read_buf, 3, size_t(read_words) * 16), "read buffer");
  double floor_us = 0;
  {
    cudaGraphExec_t g = capture(s, [&] { empty_kernel<<<1, 32, 0, s>>>(); });
    floor_us = time_graph(g, s, fl, o.reps);
    cudaGraphExecDestroy(g);
  }
  // Steady state: copies of the layer with weights of their own, run back to back in one graph
  // as consecutive layers of a model run, so every layer's weights are cold (the copies' bytes
  // are far beyond L2) while the graph launch is shared and each kernel starts as it would in a
  // model's graph. At most half the free memory is used.
  std::vector<std::unique_ptr<Sm90Layer>> copies;
  if (o.steady_layers > 1) {
    size_t free_b = 0, total_b = 0;
    ck(cudaMemGetInfo(&free_b, &total_b), "memory info");
    const Sm90WeightStats ws = layer.weight_stats();
    const double per_layer = double(cfg.num_experts) * double(ws.w13_bytes_per_expert + ws.w2_bytes_per_expert);
    const int n = int(std::min<double>(o.steady_layers - 1, 0.5 * double(free_b) / per_layer));
    for (int i = 0; i < n; ++i) {
      copies.emplace_back(new Sm90Layer(cfg, fmt, o.seed + 1000 + uint64_t(i)));
      copies.back()->set_prefill_from(prefill_from);
      copies.back()->reserve(tmax, cfg.top_k);
    }
  }
  const int nsteady = 1 + int(copies.size());
  std::vector<BenchRow> rows;
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> nx(0.0f, 1.0f), nl(0.0f, 0.1f);
  for (int64_t T : o.tokens) {
    // Uniform random routing: small random logits; random hidden states.
    std::vector<uint16_t> x(size_t(T * cfg.hidden));
    for (auto& v : x) {
      const float f = nx(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      v = uint16_t(u >> 16);
    }
    std::vector<float> lg(size_t(T * cfg.num_experts));
    for (auto& v : lg) v = nl(rng);
    ck(cudaMemcpy2D(layer.x(), size_t(layer.x_stride()) * 2, x.data(), size_t(cfg.hidden) * 2, size_t(cfg.hidden) * 2,
                    size_t(T), cudaMemcpyHostToDevice),
       "copy");
    ck(cudaMemcpy(layer.logits(), lg.data(), lg.size() * 4, cudaMemcpyHostToDevice), "copy");
    layer.enqueue(s, T, false);
    ck(cudaStreamSynchronize(s), "layer");
    BenchRow r;
    r.backend = backend;
    r.shape = o.shape;
    r.format = format_name(o.format);
    r.tokens = T;
    r.active_experts = layer.active_experts(s);
    r.gemm_shape = layer.gemm_shape(T);
    MOEKIT_REQUIRE(layer.plan_error(s) == 0, "bench: plan error");
    cudaGraphExec_t g_gemm = capture(s, [&] { layer.enqueue_gemms(s, T); });
    cudaGraphExec_t g_layer = capture(s, [&] { layer.enqueue(s, T, false); });
    r.gemm_us = time_graph(g_gemm, s, fl, o.reps);
    r.layer_us = time_graph(g_layer, s, fl, o.reps);
    cudaGraphExecDestroy(g_gemm);
    cudaGraphExecDestroy(g_layer);
    if (nsteady > 1) {
      for (auto& c : copies) {  // the same inputs, so the same routing and bytes in every copy
        ck(cudaMemcpy2D(c->x(), size_t(c->x_stride()) * 2, x.data(), size_t(cfg.hidden) * 2, size_t(cfg.hidden) * 2,
                        size_t(T), cudaMemcpyHostToDevice),
           "copy");
        ck(cudaMemcpy(c->logits(), lg.data(), lg.size() * 4, cudaMemcpyHostToDevice), "copy");
        c->enqueue(s, T, false);
      }
      ck(cudaStreamSynchronize(s), "layer copies");
      cudaGraphExec_t g = capture(s, [&] {
        layer.enqueue_gemms(s, T);
        for (auto& c : copies) c->enqueue_gemms(s, T);
      });
      r.steady_gemm_us = time_graph(g, s, fl, o.reps) / nsteady;
      cudaGraphExecDestroy(g);
      g = capture(s, [&] {
        layer.enqueue(s, T, false);
        for (auto& c : copies) c->enqueue(s, T, false);
      });
      r.steady_layer_us = time_graph(g, s, fl, o.reps) / nsteady;
      cudaGraphExecDestroy(g);
      r.steady_layers = nsteady;
    }
    if (o.trace) {
      // With --steady, the last of the layers run back to back is traced: the kernel's code is
      // warm, its weights are cold.
      Sm90Layer& traced = copies.empty() ? layer : *copies.back();
      traced.enable_trace(true);
      fl.run(s);
      layer.enqueue_gemms(s, T);
      for (auto& c : copies) c->enqueue_gemms(s, T);
      ck(cudaStreamSynchronize(s), "trace run");
      traced.enable_trace(false);
      const auto tr = traced.trace();
      const int ne = traced.trace_events(), stride = traced.trace_stride();
      const size_t ctas = tr.size() / size_t(stride);
      // The events in the order of sm90_moe_gemm.cuh TraceEvent. The buffer is zeroed before
      // the traced run and every CTA of its grid stamps its entry, so the earliest entry is the
      // run's origin; stamps before it (events a CTA did not reach, CTAs of no run) are skipped.
      static const char* names[] = {"start", "first data", "phase-1 end", "wait begin", "wait end",
                                    "phase-2 data", "end", "entry", "decoded"};
      constexpr int kEntry = 7;
      MOEKIT_REQUIRE(ne == int(sizeof(names) / sizeof(names[0])), "bench: trace events changed");
      unsigned long long t0 = ~0ull;
      for (size_t c = 0; c < ctas; ++c)
        if (tr[c * stride + kEntry] != 0) t0 = std::min(t0, tr[c * stride + kEntry]);
      std::printf("trace T=%lld (us after the first CTA's entry; min / median / max over CTAs)\n", (long long)T);
      for (int e = 0; e < ne; ++e) {
        std::vector<double> v;
        for (size_t c = 0; c < ctas; ++c)
          if (tr[c * stride + e] >= t0) v.push_back(double(tr[c * stride + e] - t0) * 1e-3);
        if (v.empty()) continue;
        std::sort(v.begin(), v.end());
        std::printf("  %-13s %8.2f %8.2f %8.2f  (%zu CTAs)\n", names[e], v.front(), v[v.size() / 2], v.back(), v.size());
      }
      if (!o.trace_file.empty()) {
        const std::string path = o.trace_file + "." + std::to_string(T) + ".csv";
        FILE* f = std::fopen(path.c_str(), "w");
        MOEKIT_REQUIRE(f != nullptr, "bench: cannot write " + path);
        std::fprintf(f, "cta,phase,task,issued_us,start_us,end_us\n");
        const int nr = traced.trace_record();
        for (size_t c = 0; c < ctas; ++c)
          for (int i = 0; i < traced.trace_tasks(); ++i) {
            const unsigned long long* rec = &tr[c * stride + ne + nr * i];
            if (rec[1] < t0 || rec[2] < t0 || rec[3] < t0) continue;  // not written (zeroed buffer)
            std::fprintf(f, "%zu,%llu,%llu,%.3f,%.3f,%.3f\n", c, rec[0] >> 32, rec[0] & 0xffffffffull,
                         double(rec[1] - t0) * 1e-3, double(rec[2] - t0) * 1e-3, double(rec[3] - t0) * 1e-3);
          }
        std::fclose(f);
      }
    }
    const Sm90WeightStats ws = layer.weight_stats();
    r.gemm_bytes = double(r.active_experts) * double(ws.w13_bytes_per_expert + ws.w2_bytes_per_expert);
    r.tbps = r.gemm_bytes / (r.gemm_us * 1e-6) / 1e12;
    r.copy_tbps = copy;
    r.pct_copy = 100.0 * r.tbps / copy;
    r.layer_over_gemm = r.layer_us / r.gemm_us;
    {
      const int64_t words = int64_t(r.gemm_bytes / 16);
      cudaGraphExec_t g = capture(s, [&] { read_kernel<<<2 * sms, 1024, 0, s>>>(read_buf, words, read_words - 1, fl.sink); });
      r.read_us = time_graph(g, s, fl, o.reps);
      cudaGraphExecDestroy(g);
    }
    r.floor_us = floor_us;
    rows.push_back(r);
  }
  cudaFree(read_buf);
  cudaStreamDestroy(s);
  return rows;
}

}  // namespace moekit
