// Helpers of the SM90 layer tests (tests/gpu): synthetic models and inputs, runs through a
// backend or straight through Sm90Layer with poisoned outputs, comparisons with the CPU.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../moe_testutil.h"
#include "../testutil.h"
#include "moekit/api/host_runner.h"
#include "moekit/backends/sm90_layer.h"
#include "moekit/common/bf16.h"
#include "moekit/experts/reference.h"
#include "moekit/model/layer_io.h"
#include "moekit/model/synthetic.h"
#include "moekit/oracle/oracle.h"

namespace moekit {

// Every SM90 backend: the crossover's choice per call, and each kernel forced, on both formats.
inline const char* const kGpuBackends[] = {"sm90", "sm90_batched", "sm90_decode",
                                           "sm90_decode_batched", "sm90_prefill", "sm90_prefill_batched"};

// Through the public API (api/host_runner.h), on the backend's device.
inline LayerOutput run_backend(const std::string& name, const MoeModel& m, const LayerInput& in) {
  const Backend* b = find_backend(name);
  EXPECT_NE(b, nullptr) << name;
  const DeviceInfo dev = b->caps().needs_sm90 ? DeviceInfo::detect() : DeviceInfo::cpu();
  const Support s = b->supports(Problem::of(m, in.tokens), dev);
  EXPECT_TRUE(s.ok) << name << ": " << s.reason;
  LayerOutput out;
  HostRunner(m, name).run(in, &out);
  return out;
}

// A layer's weights packed through the public API on the GPU (gpu_backend, for up to max_tokens
// tokens) and on the CPU ("cpu"), from one checkpoint.
struct PackedBoth {
  MoeModel model;
  std::unique_ptr<HostCheckpoint> ck;
  OwnedLayer gpu, cpu;
};
inline std::unique_ptr<PackedBoth> pack_both(MoeModel m, int64_t max_tokens, const std::string& gpu_backend) {
  auto p = std::make_unique<PackedBoth>();
  p->model = std::move(m);
  p->ck = std::make_unique<HostCheckpoint>(p->model);
  LayerSpec spec = p->model.cfg;
  spec.max_tokens = max_tokens;
  EXPECT_TRUE(make_layer(spec, {{kDLCUDA, 0}, gpu_backend}, p->ck->tensors, &p->gpu).ok());
  EXPECT_TRUE(make_layer(spec, {{kDLCPU, 0}, "cpu"}, p->ck->tensors, &p->cpu).ok());
  return p;
}

inline std::vector<float> to_f32(const std::vector<uint16_t>& y) { return test::bf16_to_floats(y); }

inline void expect_same_id_sets(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int64_t T, int k) {
  ASSERT_EQ(a.size(), b.size());
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::multiset<int32_t> x(a.begin() + t * k, a.begin() + (t + 1) * k), y(b.begin() + t * k, b.begin() + (t + 1) * k);
    bad += x != y;
  }
  EXPECT_EQ(bad, 0) << "tokens whose expert sets differ";
}

inline MoeConfig small_config(WeightFormat f, Activation act, int E, int k, int H, int I) {
  MoeConfig c;
  c.num_experts = E;
  c.top_k = k;
  c.hidden = H;
  c.intermediate = I;
  c.act = act;
  c.format = f;
  c.norm_topk_prob = true;
  c.swiglu_limit = act == Activation::kSiluClamped ? 5.0f : 7.0f;
  return c;
}

// A synthetic model of cfg with the given seed, with or without biases.
inline MoeModel synthetic_model(const MoeConfig& cfg, uint64_t seed, bool biases) {
  SyntheticOptions so;
  so.seed = seed;
  so.biases = biases;
  return make_synthetic_model(cfg, so);
}

// Copies an input's hidden states (rows padded to the layer's stride) and its router logits, or
// for bypass inputs its top-k ids and weights, into the layer's buffers.
inline cudaError_t upload_inputs(Sm90Layer& layer, const LayerInputData& in) {
  const size_t row = size_t(layer.config().hidden) * 2;
  cudaError_t e = cudaMemcpy2D(layer.x(), size_t(layer.x_stride()) * 2, in.x.data(), row, row, size_t(in.tokens),
                               cudaMemcpyHostToDevice);
  if (e == cudaSuccess && !in.logits.empty())
    e = cudaMemcpy(layer.logits(), in.logits.data(), in.logits.size() * 4, cudaMemcpyHostToDevice);
  if (e == cudaSuccess && in.bypass)
    e = cudaMemcpy(layer.ids(), in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice);
  if (e == cudaSuccess && in.bypass)
    e = cudaMemcpy(layer.weights(), in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice);
  return e;
}

// Runs the whole layer on T tokens with y poisoned (NaN) first; every element must be written.
inline void run_poisoned(Sm90Layer& layer, cudaStream_t s, int64_t T, bool bypass, std::vector<uint16_t>* y) {
  const size_t n = size_t(T * layer.config().hidden);
  ASSERT_EQ(cudaMemset(layer.y(), 0xff, n * 2), cudaSuccess);
  layer.enqueue(s, T, bypass);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  y->assign(n, 0);
  ASSERT_EQ(cudaMemcpy(y->data(), layer.y(), n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint16_t v : *y) ASSERT_NE(v, 0xffff) << "unwritten output";
}

// Bypass routing input: ids from id(t, j) (-1 = empty slot), top-k weights uniform in [0.1, 1).
inline LayerInputData bypass_input(const MoeConfig& cfg, int64_t T, int k, uint64_t seed,
                            const std::function<int32_t(int64_t, int)>& id) {
  LayerInputData in = make_synthetic_input(cfg, T, seed);
  in.logits.clear();
  in.bypass = true;
  in.k = k;
  std::mt19937 rng(uint32_t(seed) + 1);
  std::uniform_real_distribution<float> uw(0.1f, 1.0f);
  in.ids.resize(size_t(T * k));
  in.weights.resize(size_t(T * k));
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      in.ids[size_t(t * k + j)] = id(t, j);
      in.weights[size_t(t * k + j)] = uw(rng);
    }
  return in;
}

// Bypass input with the CPU's routing, so both backends multiply the same experts.
inline LayerInputData with_ids(const LayerInputData& in, const LayerOutput& routed, int k) {
  LayerInputData d;
  d.tokens = in.tokens;
  d.x = in.x;
  d.bypass = true;
  d.ids = routed.ids;
  d.weights = routed.weights;
  d.k = k;
  return d;
}

// GPU y vs CPU y (same ids), and both vs the double reference.
inline void check_against_cpu(const MoeModel& m, const LayerInputData& in, double tol = 1e-2) {
  const LayerOutput cpu = run_backend("cpu", m, in.view());
  const std::vector<double> ref = reference_layer(m, in.x.data(), in.tokens, cpu.ids.data(), cpu.weights.data(),
                                                  in.ids.empty() ? m.cfg.top_k : in.k);
  const double cpu_err = rel_l2(to_f32(cpu.y), ref);
  EXPECT_LE(cpu_err, tol);
  for (const char* name : kGpuBackends) {
    SCOPED_TRACE(name);
    const LayerOutput gpu = run_backend(name, m, in.view());
    ASSERT_EQ(gpu.y.size(), cpu.y.size());
    const double err = rel_l2(to_f32(gpu.y), ref);
    EXPECT_LE(err, tol) << "vs reference (cpu: " << cpu_err << ")";
    EXPECT_LE(test::rel_l2_err(to_f32(gpu.y), to_f32(cpu.y)), tol);
    for (uint16_t v : gpu.y) ASSERT_FALSE(std::isnan(bf16_to_float(v)));
  }
}

}  // namespace moekit
