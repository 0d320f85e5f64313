#include <cuda_runtime.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include "moekit/bench/bench.h"
#include "moekit/backends/sm90_layer.h"
#include "moekit/common/error.h"
#include "moekit/common/trap_record.h"
#include "moekit/formats/synthetic_bytes.h"
#include "moekit/oracle/tuning.h"

namespace moekit {

namespace {

// What the bench is doing on the GPU (a graph's replay, its row), written before each replay: a
// run stopped from outside (SIGTERM, SIGINT: `timeout`, Ctrl-C) says it on stderr.
char g_doing[320] = "starting";
extern "C" void say_what_was_running(int sig) {
  const char head[] = "\nmoekit bench: stopped by a signal during ";
  (void)!write(2, head, sizeof head - 1);
  (void)!write(2, g_doing, strnlen(g_doing, sizeof g_doing));
  (void)!write(2, "\n", 1);
  signal(sig, SIG_DFL);
  raise(sig);
}

void ck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  // A kernel's timed-out wait, when one trapped.
  fail("CUDA error in ", what, ": ", cudaGetErrorString(e), trap::report_suffix());
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

// Random bf16 hidden states [T, H] (row stride `stride`, padding columns left as they are):
// sign, exponent 2^-1 or 2^0 and mantissa from a hash of the element's index, |x| in [0.5, 2).
__global__ void fill_x_kernel(uint16_t* x, int64_t stride, int64_t T, int H, uint64_t seed) {
  const int64_t n = T * H;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = seed + uint64_t(i) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    x[(i / H) * stride + i % H] = uint16_t(0x3f00u | (uint32_t(z) & 0x80ffu));
  }
}

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

// How long to time one quantity: reps replays; with budget_ms > 0, stop once 3 replays are in
// and their sum passed budget_ms.
struct Timing {
  int reps = 50;
  double budget_ms = 0;
};

// One replay of a graph between two events (ms), after the L2 flush when asked.
struct Replayer {
  cudaStream_t s;
  Flusher& fl;
  cudaEvent_t a = nullptr, b = nullptr;
  Replayer(cudaStream_t stream, Flusher& flusher) : s(stream), fl(flusher) {
    ck(cudaEventCreate(&a), "event");
    ck(cudaEventCreate(&b), "event");
  }
  ~Replayer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  Replayer(const Replayer&) = delete;
  Replayer& operator=(const Replayer&) = delete;
  // what: the graph's name in an error message (which graph was in flight).
  float operator()(cudaGraphExec_t g, bool flush, const std::string& what = "a graph") {
    if (flush) fl.run(s);
    snprintf(g_doing, sizeof g_doing, "a replay of %s", what.c_str());
    ck(cudaEventRecord(a, s), "record");
    ck(cudaGraphLaunch(g, s), "graph launch");
    ck(cudaEventRecord(b, s), "record");
    ck(cudaEventSynchronize(b), ("sync after " + what).c_str());
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, a, b), "elapsed");
    return ms;
  }
};

// Median time of a graph, L2 flushed before each replay. Warm-up: one replay, two more when it
// took under 2 ms.
double time_graph(cudaGraphExec_t g, cudaStream_t s, Flusher& fl, const Timing& how) {
  Replayer replay(s, fl);
  const float first_ms = replay(g, false);
  if (first_ms < 2.0f)
    for (int i = 0; i < 2; ++i) ck(cudaGraphLaunch(g, s), "warm-up");
  std::vector<float> t;
  double sum_ms = 0;
  for (int i = 0; i < how.reps; ++i) {
    t.push_back(replay(g, true));
    sum_ms += t.back();
    if (how.budget_ms > 0 && t.size() >= 3 && sum_ms >= how.budget_ms) break;
  }
  std::sort(t.begin(), t.end());
  return double(t[t.size() / 2]) * 1e3;  // us
}

// Median times of several graphs replayed in turns (A B C A B C ...), each replay after a flush:
// their medians share the GPU's clock and power drift over the run, which timing one graph's
// replays and then the next one's does not (on an H100 a prefill-size GEMM moved by up to 15%
// between such blocks: at 700 W the SM clock falls from 1980 to 1450-1700 MHz). Warm-up: one
// replay of each; a graph with may_stop whose warm-up took over 1.5x the first graph's is not
// replayed again (its time is that replay's). With budget_ms, the turns end once 3 are in and
// the replays' sum passed budget_ms per graph.
std::vector<double> time_graphs(const std::vector<cudaGraphExec_t>& gs, const std::vector<bool>& may_stop,
                                const std::vector<std::string>& names,
                                cudaStream_t s, Flusher& fl, const Timing& how) {
  Replayer replay(s, fl);
  std::vector<float> first;
  for (size_t j = 0; j < gs.size(); ++j) first.push_back(replay(gs[j], true, names[j]));
  std::vector<std::vector<float>> t(gs.size());
  std::vector<bool> on(gs.size(), true);
  for (size_t j = 1; j < gs.size(); ++j)  // over 1.5x the first graph: it cannot be the faster one
    if (may_stop[j] && first[j] > 1.5f * first[0]) on[j] = false, t[j].push_back(first[j]);
  double sum_ms = 0;
  for (int i = 0; i < how.reps; ++i) {
    int n = 0;
    for (size_t j = 0; j < gs.size(); ++j)
      if (on[j]) t[j].push_back(replay(gs[j], true, names[j])), sum_ms += t[j].back(), ++n;
    if (how.budget_ms > 0 && i >= 2 && sum_ms >= how.budget_ms * double(n)) break;
  }
  std::vector<double> med;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    med.push_back(double(v[v.size() / 2]) * 1e3);  // us
  }
  return med;
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

std::string bench_cuda_versions() {
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  auto v = [](int x) { return x <= 0 ? std::string("none") : std::to_string(x / 1000) + "." + std::to_string(x % 1000 / 10); };
  return "runtime " + v(rt) + ", driver API " + v(drv);
}

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

double measure_bf16_tflops(std::string* why) {
  // cuBLAS is loaded at run time, so that moekit needs it only here: the soname of CUDA 13,
  // then 12 (the toolkit or a framework's wheel on the library path).
  void* lib = nullptr;
  for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"})
    if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
  if (!lib) {
    if (why) *why = "libcublas.so.13/.12 not found on the library path";
    return 0;
  }
  using Create = int (*)(void**);
  using Destroy = int (*)(void*);
  using SetStream = int (*)(void*, cudaStream_t);
  // cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C,
  // Ctype, ldc, computeType, algo) with the enum values of cublas_api.h / library_types.h.
  using GemmEx = int (*)(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                         const void*, void*, int, int, int, int);
  auto create = reinterpret_cast<Create>(dlsym(lib, "cublasCreate_v2"));
  auto destroy = reinterpret_cast<Destroy>(dlsym(lib, "cublasDestroy_v2"));
  auto set_stream = reinterpret_cast<SetStream>(dlsym(lib, "cublasSetStream_v2"));
  auto gemm = reinterpret_cast<GemmEx>(dlsym(lib, "cublasGemmEx"));
  if (!create || !destroy || !set_stream || !gemm) {
    if (why) *why = "cuBLAS loaded without cublasGemmEx";
    return 0;
  }
  constexpr int kN = 8192, kOpN = 0, kR16BF = 14, kR32F = 0, kCompute32F = 68, kAlgoDefault = -1;
  void* h = nullptr;
  if (create(&h) != 0) {
    if (why) *why = "cublasCreate failed";
    return 0;
  }
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  set_stream(h, s);
  uint16_t *a = nullptr, *b = nullptr;
  float* c = nullptr;
  ck(cudaMalloc(&a, size_t(kN) * kN * 2), "gemm alloc");
  ck(cudaMalloc(&b, size_t(kN) * kN * 2), "gemm alloc");
  ck(cudaMalloc(&c, size_t(kN) * kN * 4), "gemm alloc");
  // Random bf16 of magnitude ~1 (zeros run faster than real data), made on the device.
  fill_x_kernel<<<1024, 256, 0, s>>>(a, kN, kN, kN, 7);
  fill_x_kernel<<<1024, 256, 0, s>>>(b, kN, kN, kN, 8);
  ck(cudaStreamSynchronize(s), "gemm init");
  const float one = 1.0f, zero = 0.0f;
  auto run = [&] {
    return gemm(h, kOpN, kOpN, kN, kN, kN, &one, a, kR16BF, kN, b, kR16BF, kN, &zero, c, kR32F, kN, kCompute32F,
                kAlgoDefault);
  };
  double tf = 0;
  if (run() == 0) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int i = 0; i < 3; ++i) run();
    std::vector<float> t;
    for (int i = 0; i < 10; ++i) {
      cudaEventRecord(e0, s);
      run();
      cudaEventRecord(e1, s);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    tf = 2.0 * double(kN) * kN * kN / (double(t[t.size() / 2]) * 1e-3) / 1e12;
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  } else if (why) {
    *why = "cublasGemmEx failed";
  }
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cudaStreamDestroy(s);
  destroy(h);
  return tf;
}

std::vector<BenchRow> bench_gpu(const BenchOptions& o, const std::string& backend) {
  const MoeConfig cfg = bench_config(o);
  const double copy = measure_copy_tbps();
  const bool batched = backend.size() > 8 && backend.compare(backend.size() - 8, 8, "_batched") == 0;
  const ActivationFormat fmt = batched ? ActivationFormat::kBatched : ActivationFormat::kStandard;
  // The GEMM kernel: sm90_decode* and sm90_prefill* force one, sm90 / sm90_batched follow the
  // crossover (oracle/tuning.h).
  const bool crossover = backend.rfind("sm90_decode", 0) != 0 && backend.rfind("sm90_prefill", 0) != 0;
  const KernelCrossover xo = crossover ? sm90_crossover(cfg, DeviceInfo::detect()) : KernelCrossover{};
  const int64_t prefill_from = backend.rfind("sm90_decode", 0) == 0    ? -1
                               : backend.rfind("sm90_prefill", 0) == 0 ? 0
                                                                       : xo.prefill_from;
  Sm90Layer layer(cfg, fmt, o.seed);
  signal(SIGTERM, say_what_was_running);
  signal(SIGINT, say_what_was_running);
  // The rows' graphs are all captured before any is timed (time_graphs), so every capture must
  // see one workspace layout: with the comparison the workspace keeps the prefill kernel's
  // permuted x even where the backend never runs that kernel (kNever: the decode kernel at every
  // count, as -1, with that layout), and the decode kernel alone is run as kNever.
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  const bool keep_permuted = o.compare_kernels && prefill_from < 0 && layer.prefill_supported();
  const int64_t run_from = keep_permuted ? kNever : prefill_from;
  layer.set_prefill_from(run_from);
  // The crossover backends pick the kernel on the device in a band around the crossover.
  layer.set_device_choice(xo.band_from, xo.band_to, xo.stream_ratio, xo.stream_ratio_slope);
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
  Timing how;
  how.reps = o.reps;
  how.budget_ms = o.budget_ms;
  double floor_us = 0;
  {
    cudaGraphExec_t g = capture(s, [&] { empty_kernel<<<1, 32, 0, s>>>(); });
    floor_us = time_graph(g, s, fl, how);
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
      copies.back()->set_device_choice(xo.band_from, xo.band_to, xo.stream_ratio, xo.stream_ratio_slope);
      copies.back()->reserve(tmax, cfg.top_k);
    }
  }
  const int nsteady = 1 + int(copies.size());
  std::vector<BenchRow> rows;
  const auto t_start = std::chrono::steady_clock::now();
  double tokens_done = 0, tokens_all = 0;
  for (int64_t T : o.tokens) tokens_all += double(std::max<int64_t>(T, 1));
  for (size_t ti = 0; ti < o.tokens.size(); ++ti) {
    const int64_t T = o.tokens[ti];
    // Random hidden states (made on the device: 16384 x 7168 of them on the host took seconds)
    // and router logits of the chosen distribution.
    if (T > 0) fill_x_kernel<<<1024, 256, 0, s>>>(layer.x(), layer.x_stride(), T, cfg.hidden, o.seed + uint64_t(T));
    ck(cudaGetLastError(), "fill x");
    const std::vector<float> lg = bench_router_logits(cfg, T, o.routing, o.zipf_s, o.seed);
    // On s, not a plain cudaMemcpy: from pageable memory that returns once the bytes are staged,
    // and s does not wait for the legacy stream, so the routing could read the last row's logits
    // (the report's rows then routed a mix of two distributions: bench/regret_study.py's count check
    // found 3-5 of 720 rows whose busiest expert was not the one these logits give).
    snprintf(g_doing, sizeof g_doing, "eager layer calls (%s %s %s %lld tokens)", o.shape.c_str(),
             format_name(o.format), bench_routing_name(o.routing), static_cast<long long>(T));
    ck(cudaMemcpyAsync(layer.logits(), lg.data(), lg.size() * 4, cudaMemcpyHostToDevice, s), "copy");
    // Hash routing: random token ids (uniform over the table).
    std::vector<int32_t> tok(cfg.hash_vocab > 0 ? size_t(T) : 0);
    for (size_t i = 0; i < tok.size(); ++i)
      tok[i] = int32_t(synthetic_hash_entry(int64_t(i) * cfg.top_k, cfg.top_k, int(cfg.hash_vocab), o.seed + uint64_t(T)));
    if (!tok.empty())
      ck(cudaMemcpyAsync(layer.token_ids(), tok.data(), tok.size() * 4, cudaMemcpyHostToDevice, s), "copy");
    ck(cudaStreamSynchronize(s), "fill x");
    layer.enqueue(s, T, false);
    ck(cudaStreamSynchronize(s), "layer");
    BenchRow r;
    r.backend = backend;
    r.shape = o.shape;
    r.format = format_name(o.format);
    r.tokens = T;
    r.prefill_from = prefill_from;
    r.active_experts = layer.active_experts(s);
    r.gemm_shape = layer.gemm_shape(T);
    MOEKIT_REQUIRE(layer.plan_error(s) == 0, "bench: plan error");
    {  // the load: routed rows of the busiest expert (the routing wrote its ids to layer.ids())
      std::vector<int32_t> ids(size_t(T) * size_t(cfg.top_k));
      ck(cudaMemcpy(ids.data(), layer.ids(), ids.size() * 4, cudaMemcpyDeviceToHost), "copy ids");
      std::vector<int> rows_of(size_t(cfg.num_experts), 0);
      for (int32_t id : ids)
        if (id >= 0 && id < cfg.num_experts) r.max_expert_rows = std::max(r.max_expert_rows, ++rows_of[size_t(id)]);
    }
    const bool device_choice = layer.device_choice(T);
    const bool on_prefill = device_choice ? layer.chosen_kernel(s) == 1 : layer.uses_prefill(T);
    r.kernel = layer.fp8_activations() ? "fp8" : on_prefill ? "prefill" : "decode";
    r.kernel_choice = device_choice ? "device" : "tokens";
    if (on_prefill) r.gemm_shape = layer.prefill_name(T);
    // Every graph of the row, captured first and then timed in turns (time_graphs): the GEMMs
    // on the backend's path, the layer, with the split the layer cut after each part and
    // finalize alone, with the comparison each GEMM kernel alone on the same plan.
    std::vector<cudaGraphExec_t> gs;
    std::vector<bool> may_stop;  // with a budget: a comparison kernel that cannot be the faster one
    std::vector<std::string> names;  // for an error message: the graph in flight, its row
    const std::string row = o.shape + " " + r.format + " " + bench_routing_name(o.routing) + " " + std::to_string(T) + " tokens";
    auto add = [&](cudaGraphExec_t g, bool stop, const std::string& name) {
      gs.push_back(g);
      may_stop.push_back(stop && o.budget_ms > 0);
      names.push_back(name + " (" + row + ")");
      return int(gs.size()) - 1;
    };
    add(capture(s, [&] { layer.enqueue_gemms(s, T); }), false, "the GEMMs");
    if (!o.gemms_only) add(capture(s, [&] { layer.enqueue(s, T, false); }), false, "the layer");
    const bool split = std::find(o.split.begin(), o.split.end(), T) != o.split.end() && !o.gemms_only;
    // A part the layer does not run (the decode kernel's permute) has no cut: its time is 0.
    const bool permutes = batched || layer.uses_prefill(T) || device_choice || layer.fp8_activations();
    int cut_at[kLayerParts] = {};  // index in gs of the cut after part p (the last: the layer)
    int fin_alone = -1;
    if (split) {
      for (int part = 1; part < kLayerParts; ++part) {
        cut_at[part - 1] = -1;
        if (part == 2 && !permutes) continue;
        layer.set_parts(part);
        cut_at[part - 1] = add(capture(s, [&] { layer.enqueue(s, T, false); }), false,
                               "the layer cut after part " + std::to_string(part));
      }
      cut_at[kLayerParts - 1] = 1;
      layer.set_parts(kLayerParts, kLayerParts);
      fin_alone = add(capture(s, [&] { layer.enqueue(s, T, false); }), false, "finalize alone");
      layer.set_parts(kLayerParts);
    }
    // The comparison: each kernel alone as the token-count rule runs it, on the same routing
    // (its layer run once first: the prefill kernel reads the permuted x). Under the device
    // choice both are timed (gemm_us is the path that launches both); else the other one.
    const bool compare = o.compare_kernels && layer.prefill_supported();
    int alone[2] = {-1, -1};  // decode, prefill
    if (compare) {
      if (device_choice) layer.set_device_choice(0, 0, 0);
      for (const bool pre : {false, true}) {
        if (!device_choice && pre == on_prefill) continue;
        layer.set_prefill_from(pre ? 0 : kNever);
        layer.enqueue(s, T, false);
        ck(cudaStreamSynchronize(s), "layer");
        alone[pre] = add(capture(s, [&] { layer.enqueue_gemms(s, T); }), pre != on_prefill,
                         pre ? "the prefill kernel alone" : "the decode kernel alone (" + layer.gemm_shape(T) + ")");
      }
      layer.set_prefill_from(run_from);
      if (device_choice) layer.set_device_choice(xo.band_from, xo.band_to, xo.stream_ratio, xo.stream_ratio_slope);
      layer.enqueue(s, T, false);
      ck(cudaStreamSynchronize(s), "layer");
    }
    const std::vector<double> us = time_graphs(gs, may_stop, names, s, fl, how);
    for (cudaGraphExec_t g : gs) cudaGraphExecDestroy(g);
    r.gemm_us = us[0];
    if (!o.gemms_only) r.layer_us = us[1];
    if (split) {
      double before = 0;
      for (int p = 0; p < kLayerParts; ++p) {
        if (cut_at[p] < 0) {
          r.split_us[p] = 0;
          continue;
        }
        r.split_us[p] = us[size_t(cut_at[p])] - before;
        before = us[size_t(cut_at[p])];
      }
      r.finalize_alone_us = us[size_t(fin_alone)];
    }
    r.decode_us = alone[0] >= 0 ? us[size_t(alone[0])] : on_prefill ? 0.0 : r.gemm_us;
    r.prefill_us = alone[1] >= 0 ? us[size_t(alone[1])] : on_prefill ? r.gemm_us : 0.0;
    layer.enqueue(s, T, false);  // the whole layer again: a cut leaves its counters as a whole run does
    ck(cudaStreamSynchronize(s), "layer");
    if (nsteady > 1) {
      for (auto& c : copies) {  // the same inputs, so the same routing and bytes in every copy
        ck(cudaMemcpy2DAsync(c->x(), size_t(c->x_stride()) * 2, layer.x(), size_t(layer.x_stride()) * 2,
                             size_t(cfg.hidden) * 2, size_t(T), cudaMemcpyDeviceToDevice, s),
           "copy");
        ck(cudaMemcpyAsync(c->logits(), lg.data(), lg.size() * 4, cudaMemcpyHostToDevice, s), "copy");
        if (!tok.empty())
          ck(cudaMemcpyAsync(c->token_ids(), tok.data(), tok.size() * 4, cudaMemcpyHostToDevice, s), "copy");
        c->enqueue(s, T, false);
      }
      ck(cudaStreamSynchronize(s), "layer copies");
      cudaGraphExec_t g = capture(s, [&] {
        layer.enqueue_gemms(s, T);
        for (auto& c : copies) c->enqueue_gemms(s, T);
      });
      r.steady_gemm_us = time_graph(g, s, fl, how) / nsteady;
      cudaGraphExecDestroy(g);
      g = capture(s, [&] {
        layer.enqueue(s, T, false);
        for (auto& c : copies) c->enqueue(s, T, false);
      });
      r.steady_layer_us = time_graph(g, s, fl, how) / nsteady;
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
    if (!o.gemms_only) {
      const int64_t words = int64_t(r.gemm_bytes / 16);
      cudaGraphExec_t g = capture(s, [&] { read_kernel<<<2 * sms, 1024, 0, s>>>(read_buf, words, read_words - 1, fl.sink); });
      r.read_us = time_graph(g, s, fl, how);
      cudaGraphExecDestroy(g);
    }
    r.floor_us = floor_us;
    r.flops = 2.0 * double(T) * cfg.top_k * 3.0 * double(cfg.hidden) * double(cfg.intermediate);
    r.tflops = r.flops / (r.gemm_us * 1e-6) / 1e12;
    rows.push_back(r);
    if (o.progress) {
      // Time left estimated from the tokens still to run (the long points are the large ones).
      tokens_done += double(std::max<int64_t>(T, 1));
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
      std::fprintf(stderr, "bench %s %s %s: %zu/%zu token counts (T=%lld), %.1f s, about %.0f s left\n",
                   o.shape.c_str(), r.format.c_str(), bench_routing_name(o.routing), ti + 1, o.tokens.size(),
                   (long long)T, el, el / tokens_done * (tokens_all - tokens_done));
    }
  }
  cudaFree(read_buf);
  cudaStreamDestroy(s);
  return rows;
}

}  // namespace moekit
