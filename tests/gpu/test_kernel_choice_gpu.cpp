// The decode/prefill choice on the device (oracle/kernel_choice.h, pipeline/kernel_choice_sm90.cuh):
// in the band the layer launches both GEMM kernels after a kernel that reads the plan's counts;
// the output has the same bits as the layer forced onto the kernel the flag names, both kernels'
// outputs match the CPU, under uniform and skewed loads, and the whole layer captures in a graph.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "moekit/oracle/kernel_choice.h"
#include "sm90_testutil.h"

namespace moekit {
namespace {

constexpr int kE = 32, kK = 4;

// Distinct experts per token: uniform (a permutation per token) or skewed (slot 0 and 1 on the
// experts 0 and 1 for most tokens: a few hot experts, as under Zipf routing).
LayerInputData ids_input(const MoeConfig& cfg, int64_t T, bool skewed, uint64_t seed) {
  return bypass_input(cfg, T, kK, seed, [=](int64_t t, int j) {
    std::mt19937_64 rng(seed + uint64_t(t));
    std::vector<int32_t> p(kE);
    for (int e = 0; e < kE; ++e) p[size_t(e)] = e;
    std::shuffle(p.begin(), p.end(), rng);
    if (skewed && t % 8 != 0) {
      // Experts 0 and 1 first, then the permutation's others.
      std::stable_partition(p.begin(), p.end(), [](int32_t e) { return e < 2; });
    }
    return p[size_t(j)];
  });
}

// The host's view of the device choice for these ids.
bool host_prefers_prefill(const LayerInputData& in, double ratio) {
  std::vector<int> counts(kE, 0);
  for (int32_t e : in.ids)
    if (e >= 0) ++counts[size_t(e)];
  ChoiceCounts c;
  // The decode kernel's chunk rows as the layer picks them: $MOEKIT_DECODE_ROWS (the GPU runs
  // force 16 and 24) or the rule.
  const char* env = std::getenv("MOEKIT_DECODE_ROWS");
  const int forced = env ? std::atoi(env) : 0;
  const int rows = forced == 8 || forced == 16 || forced == 24 ? forced : decode_chunk_rows(kE, int64_t(in.ids.size()), true);
  for (int n : counts) add_expert_rows(c, n, rows);
  return prefill_wins(c, ratio_fixed(ratio));
}

struct LayerRun {
  std::vector<uint16_t> y;
  int chosen = -1;
};

// The layer with the device choice (band 9..4095 tokens, the token-count rule saying "decode"
// below 4096) or forced onto one kernel (device = false, prefill as given).
LayerRun run_layer(const MoeModel& m, const LayerInputData& in, bool device, double ratio, bool prefill, bool graph,
                   ActivationFormat fmt = ActivationFormat::kStandard) {
  Sm90Layer layer(m, fmt);
  EXPECT_TRUE(layer.prefill_supported());
  if (device) {
    layer.set_prefill_from(4096);
    layer.set_device_choice(9, 4096, ratio);
    EXPECT_TRUE(layer.device_choice(in.tokens));
  } else {
    layer.set_prefill_from(prefill ? 0 : -1);
  }
  layer.reserve(in.tokens, in.k);
  cudaStream_t s;
  EXPECT_EQ(cudaStreamCreate(&s), cudaSuccess);
  EXPECT_EQ(upload_inputs(layer, in), cudaSuccess);
  LayerRun r;
  run_poisoned(layer, s, in.tokens, in.bypass, &r.y);
  r.chosen = layer.chosen_kernel(s);
  if (graph) {
    // The same call captured once and replayed twice: the same bits.
    cudaGraph_t g;
    cudaGraphExec_t ge;
    EXPECT_EQ(cudaMemset(layer.y(), 0xff, r.y.size() * 2), cudaSuccess);
    EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    layer.enqueue(s, in.tokens, in.bypass);
    EXPECT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
    for (int rep = 0; rep < 2; ++rep) {
      EXPECT_EQ(cudaGraphLaunch(ge, s), cudaSuccess);
      EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      std::vector<uint16_t> y2(r.y.size());
      EXPECT_EQ(cudaMemcpy(y2.data(), layer.y(), y2.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(std::memcmp(y2.data(), r.y.data(), y2.size() * 2), 0) << "graph replay " << rep;
    }
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
  }
  EXPECT_EQ(layer.plan_error(s), 0);
  cudaStreamDestroy(s);
  return r;
}

TEST(Sm90KernelChoice, SameBitsAsTheChosenKernel) {
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kMxfp8}) {
    const MoeConfig cfg = small_config(f, Activation::kSilu, kE, kK, 320, 192);
    const MoeModel m = synthetic_model(cfg, 77, true);
    for (const bool skewed : {false, true})
      for (int64_t T : {int64_t(64), int64_t(600)}) {
        const LayerInputData in = ids_input(cfg, T, skewed, 900 + uint64_t(T));
        const LayerOutput cpu = run_backend("cpu", m, in.view());
        // A ratio the counts put on either side (1.45: uniform 8 rows per expert stays on the
        // decode kernel, the skewed load goes to the prefill kernel), and both extremes.
        for (const double ratio : {0.01, 1.45, 1000.0}) {
          const std::string what = std::string(format_name(f)) + (skewed ? " skewed" : " uniform") +
                                   " T=" + std::to_string(T) + " ratio " + std::to_string(ratio);
          SCOPED_TRACE(what);
          const bool want = host_prefers_prefill(in, ratio);
          const LayerRun dev = run_layer(m, in, true, ratio, false, ratio == 1.45);
          EXPECT_EQ(dev.chosen, want ? 1 : 0);
          const LayerRun ref = run_layer(m, in, false, 0, want, false);
          EXPECT_EQ(ref.chosen, -1);
          ASSERT_EQ(dev.y.size(), ref.y.size());
          EXPECT_EQ(std::memcmp(dev.y.data(), ref.y.data(), dev.y.size() * 2), 0) << "not the chosen kernel's bits";
          EXPECT_LE(test::rel_l2_err(to_f32(dev.y), to_f32(cpu.y)), 1e-2);
        }
        // Both kernels alone agree with the CPU on this routing.
        for (const bool pre : {false, true})
          EXPECT_LE(test::rel_l2_err(to_f32(run_layer(m, in, false, 0, pre, false).y), to_f32(cpu.y)), 1e-2);
      }
  }
}

// The batched activation format (sm90_batched): permute always runs, both kernels read its rows.
TEST(Sm90KernelChoice, BatchedFormat) {
  const MoeConfig cfg = small_config(WeightFormat::kMxfp8, Activation::kSilu, kE, kK, 320, 192);
  const MoeModel m = synthetic_model(cfg, 79, true);
  for (const bool skewed : {false, true}) {
    SCOPED_TRACE(skewed ? "skewed" : "uniform");
    const LayerInputData in = ids_input(cfg, 300, skewed, 1300);
    const LayerOutput cpu = run_backend("cpu", m, in.view());
    const bool want = host_prefers_prefill(in, 1.45);
    const LayerRun dev = run_layer(m, in, true, 1.45, false, true, ActivationFormat::kBatched);
    EXPECT_EQ(dev.chosen, want ? 1 : 0);
    const LayerRun ref = run_layer(m, in, false, 0, want, false, ActivationFormat::kBatched);
    EXPECT_EQ(std::memcmp(dev.y.data(), ref.y.data(), dev.y.size() * 2), 0) << "not the chosen kernel's bits";
    EXPECT_LE(test::rel_l2_err(to_f32(dev.y), to_f32(cpu.y)), 1e-2);
  }
}

// The routed path (logits, not ids) in the band, and outside it (8 tokens: no choice kernel).
TEST(Sm90KernelChoice, RoutedPathAndOutsideTheBand) {
  const MoeConfig cfg = small_config(WeightFormat::kNvfp4, Activation::kSwigluOai, kE, kK, 256, 128);
  const MoeModel m = synthetic_model(cfg, 78, false);
  for (int64_t T : {int64_t(8), int64_t(200)}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    const LayerInputData in = make_synthetic_input(cfg, T, 31);
    const LayerOutput cpu = run_backend("cpu", m, in.view());
    Sm90Layer layer(m, ActivationFormat::kStandard);
    ASSERT_TRUE(layer.prefill_supported());
    layer.set_prefill_from(4096);
    layer.set_device_choice(9, 4096, 1.2);
    EXPECT_EQ(layer.device_choice(T), T >= 9);
    layer.reserve(T, cfg.top_k);
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
    ASSERT_EQ(upload_inputs(layer, in), cudaSuccess);
    std::vector<uint16_t> y;
    run_poisoned(layer, s, T, false, &y);
    const int chosen = layer.chosen_kernel(s);
    EXPECT_TRUE(T >= 9 ? chosen == 0 || chosen == 1 : chosen == -1);
    EXPECT_LE(test::rel_l2_err(to_f32(y), to_f32(cpu.y)), 1e-2);
    cudaStreamDestroy(s);
  }
}

}  // namespace
}  // namespace moekit
