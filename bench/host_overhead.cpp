// moekit_host_overhead: what one forward call costs the host on an SM90 GPU, in parts, through
// the public C++ API (no Python). The GPU is kept busy by a spin kernel ahead of every round, so
// that no call waits for the device; a figure is the median over rounds of the host time per
// call (a round's launches stay well below the driver's queue of pending launches).
//
//   moekit_host_overhead [shape] [tokens]        (default gpt-oss-120b 0,1,8,64,512; MXFP4)
//
// Prints, in us per call, on a stream of the program's own and on the legacy default stream
// (torch's current stream unless the caller sets one):
//   launch      one kernel launch: <<<>>> of an empty kernel, and of one with an argument of the
//               decode GEMM's size; cudaLaunchKernelEx (sm90::launch, what the layer uses) with
//               that argument, without and with the programmatic-dependent-launch attribute; the
//               driver's cuLaunchKernelEx with the same; one cudaGraphLaunch of three such
//               launches (what a graph would cost in their place)
//   tensor map  one cuTensorMapEncodeTiled of an activation buffer (sm90::prefill::make_rows_map)
//   layer       Layer::forward_logits at each token count (0: the argument checks alone), with
//               the kernels it launches (3 for the decode GEMM, 5 for the prefill GEMM): as
//               eager calls replay the layer's cached graph (pipeline/launch_sm90.cuh) the same
//               call repeated (nothing to update), two sets of x, logits and out alternating (the
//               nodes that read them updated per call), and a layer made with
//               $MOEKIT_LAUNCH_GRAPHS=0 (kernel by kernel); before those, the first call of
//               each token count (a graph built for a new launch sequence, else updated)
// With bench/python_layer.py's host_us (the same call from Python) the difference is what the
// binding costs; the layer's figure minus its launches is what the library's own code costs.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "host_overhead.h"
#include "moekit/bench/bench.h"
#include "moekit/moekit.hpp"

namespace {

using namespace moekit;

void ck(int e, const char* what) {
  if (e != 0) {
    std::fprintf(stderr, "moekit_host_overhead: %s: %s\n", what, cudaGetErrorString(cudaError_t(e)));
    std::exit(1);
  }
}
void ck(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "moekit_host_overhead: %s: %s\n", what, s.message.c_str());
    std::exit(1);
  }
}

// Median host time of one fn() in us: rounds of `calls` calls, each behind 50 ms of device work.
template <class F>
double host_us(cudaStream_t s, int calls, F&& fn, int rounds = 15) {
  std::vector<double> t;
  for (int r = 0; r <= rounds; ++r) {  // round 0: warm-up
    ck(cudaStreamSynchronize(s), "sync");
    host_overhead::spin(s, 50'000'000ull);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) fn();
    const auto t1 = std::chrono::steady_clock::now();
    if (r > 0) t.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  }
  ck(cudaStreamSynchronize(s), "sync");
  ck(cudaGetLastError(), "launch");
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<int64_t> parse_tokens(const std::string& s) {
  std::vector<int64_t> v;
  size_t i = 0;
  while (i < s.size()) {
    const size_t j = s.find(',', i);
    v.push_back(std::stoll(s.substr(i, j == std::string::npos ? std::string::npos : j - i)));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string shape = argc > 1 ? argv[1] : "gpt-oss-120b";
  const std::vector<int64_t> tokens = parse_tokens(argc > 2 ? argv[2] : "0,1,8,64,512");
  cudaStream_t own = nullptr, legacy = nullptr;  // legacy: the default stream (handle 0)
  ck(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking), "stream");
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, 0), "device");
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  std::printf("moekit_host_overhead: %s, CUDA runtime %d, driver %d\n", prop.name, rt, drv);
  std::printf("%-52s %8s %8s\n", "us per call", "own", "legacy");
  auto row = [&](const std::string& name, int calls, auto&& fn) {
    const double a = host_us(own, calls, [&] { fn(own); });
    const double b = host_us(legacy, calls, [&] { fn(legacy); });
    std::printf("%-52s %8.2f %8.2f\n", name.c_str(), a, b);
  };

  // ---- launches ----
  {
    using P = host_overhead::Probe;
    const P probe(own);
    const struct {
      P::Kind kind;
      const char* name;
      int calls;
    } kinds[] = {{P::kEmpty, "launch: empty kernel <<<>>>", 300},
                 {P::kChevron, "launch: <<<>>> with a 520-byte argument", 300},
                 {P::kRuntime, "launch: cudaLaunchKernelEx, 520-byte argument", 300},
                 {P::kRuntimePdl, "launch: the same with PDL (the layer's launches)", 300},
                 {P::kDriverPdl, "launch: cuLaunchKernelEx (driver) with PDL", 300},
                 {P::kGraph3, "launch: a graph of 3 such launches", 100}};
    for (const auto& k : kinds) {
      // A kind this driver refuses is reported, not fatal: the layer's rows still run.
      const int err = probe.available(k.kind) ? probe.launch(k.kind, own) : int(cudaErrorNotSupported);
      if (err != 0 || cudaStreamSynchronize(own) != cudaSuccess) {
        std::printf("%-52s %8s (%s)\n", k.name, "n/a", cudaGetErrorString(cudaError_t(err)));
        cudaGetLastError();
        continue;
      }
      row(k.name, k.calls, [&](cudaStream_t s) { ck(probe.launch(k.kind, s), k.name); });
    }
  }
  std::printf("%-52s %8.2f\n", "tensor map: cuTensorMapEncodeTiled", host_overhead::encode_us(20000));

  // ---- the layer through the public API ----
  LayerSpec spec = bench_shape(shape, WeightFormat::kMxfp4);
  spec.max_tokens = std::max<int64_t>(1, *std::max_element(tokens.begin(), tokens.end()));
  Options opt;
  opt.device = {kDLCUDA, 0};
  OwnedLayer L, Ld;  // Ld: kernel by kernel (the variable is read when a layer is made)
  ck(make_layer(spec, opt, {}, &L), "layer");
  setenv("MOEKIT_LAUNCH_GRAPHS", "0", 1);
  ck(make_layer(spec, opt, {}, &Ld), "layer");
  unsetenv("MOEKIT_LAUNCH_GRAPHS");
  const DLDevice dev = opt.device;
  const int64_t T_max = spec.max_tokens, H = spec.hidden, E = spec.num_experts;
  Buffer x[2], logits[2], out[2], ws;
  std::vector<float> lg(size_t(T_max * E));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  for (float& v : lg) v = nd(rng);
  for (int i = 0; i < 2; ++i) {
    ck(Buffer::allocate(dev, T_max * H * 2, &x[i]), "x");
    ck(Buffer::allocate(dev, T_max * E * 4, &logits[i]), "logits");
    ck(Buffer::allocate(dev, T_max * H * 2, &out[i]), "out");
    ck(cudaMemset(x[i].data(), 0, size_t(x[i].bytes())), "x");
    ck(logits[i].copy_from_host(lg.data(), int64_t(lg.size()) * 4), "logits");
  }
  ck(Buffer::allocate(dev, L.layer->workspace_bytes(T_max), &ws), "workspace");
  std::printf("layer: %s MXFP4, backend %s, max_tokens %lld\n", shape.c_str(), L.plan.backend.c_str(),
              static_cast<long long>(T_max));
  // The first eager call of each token count on L: its launch sequence's graph is built then
  // (a new shape) or its nodes are updated (a shape built before); host us of that one call.
  for (int64_t T : tokens) {
    if (T == 0) continue;
    const TensorRef tx(x[0].data(), kBF16, {T, H}, dev), tl(logits[0].data(), kF32, {T, E}, dev),
        to(out[0].data(), kBF16, {T, H}, dev), tw(ws.data(), kU8, {ws.bytes()}, dev);
    ck(cudaDeviceSynchronize(), "sync");
    const auto t0 = std::chrono::steady_clock::now();
    ck(L.layer->forward_logits(tx, tl, to, tw, own), "forward");
    const auto t1 = std::chrono::steady_clock::now();
    ck(cudaDeviceSynchronize(), "sync");
    std::printf("%-52s %8.2f\n", ("layer: first call T=" + std::to_string(T) + " (graph built or updated)").c_str(),
                std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  for (int64_t T : tokens) {
    const TensorRef tw(ws.data(), kU8, {ws.bytes()}, dev);
    auto refs = [&](int i) {
      return std::array<TensorRef, 3>{TensorRef(x[i].data(), kBF16, {T, H}, dev),
                                      TensorRef(logits[i].data(), kF32, {T, E}, dev),
                                      TensorRef(out[i].data(), kBF16, {T, H}, dev)};
    };
    const std::array<TensorRef, 3> a = refs(0), b = refs(1);
    const std::string t = " T=" + std::to_string(T);
    row("layer: forward_logits" + t, 100,
        [&](cudaStream_t s) { ck(L.layer->forward_logits(a[0], a[1], a[2], tw, s), "forward"); });
    int turn = 0;
    row("layer: forward_logits" + t + ", new x/logits/out", 100, [&](cudaStream_t s) {
      const auto& r = (turn ^= 1) ? b : a;
      ck(L.layer->forward_logits(r[0], r[1], r[2], tw, s), "forward");
    });
    row("layer: forward_logits" + t + ", kernel by kernel", 100,
        [&](cudaStream_t s) { ck(Ld.layer->forward_logits(a[0], a[1], a[2], tw, s), "forward"); });
  }
  ck(cudaStreamDestroy(own), "stream");
  return 0;
}
