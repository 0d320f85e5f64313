// The SM90 backends against the CPU backend and the golden cases: every weight format x
// activation format x activation function, awkward token counts, -1 ids, experts with no tokens,
// all tokens on one expert, padded H/I, poisoned outputs (routed and bypass), determinism
// (sliced and whole segments), routing.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <set>

#include "sm90_testutil.h"

namespace moekit {
namespace {

TEST(Sm90, GoldenCases) {
  for (const char* c : {"bypass_mxfp4_minus1", "dsv3_small_nvfp4", "gptoss_h2880_mxfp4", "gptoss_small_mxfp4",
                        "qwen_small_mxfp8", "tiny_bf16_clamped"}) {
    SCOPED_TRACE(c);
    const std::string dir = test::testdata(std::string("moe/") + c);
    const MoeModel m = MoeModel::load(dir);
    const LayerInputData in = load_layer_input(dir + "/input.safetensors", m.cfg);
    const auto exp = SafetensorsFile::open(dir + "/expected.safetensors");
    const std::vector<float> y_ref = to_float(exp.get("y_ref"), dir);
    std::vector<int32_t> ids_ref(size_t(exp.get("topk_ids").numel()));
    std::memcpy(ids_ref.data(), exp.get("topk_ids").data, ids_ref.size() * 4);
    for (const char* name : kGpuBackends) {
      SCOPED_TRACE(name);
      const LayerOutput out = run_backend(name, m, in.view());
      EXPECT_LE(test::rel_l2_err(to_f32(out.y), y_ref), 1e-2);
      expect_same_id_sets(out.ids, ids_ref, in.tokens, in.k);
    }
  }
}

TEST(Sm90, EveryFormatActivationAndLayoutMatchesCpu) {
  uint64_t seed = 100;
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16})
    for (Activation act : {Activation::kSilu, Activation::kSwigluOai, Activation::kSiluClamped}) {
      SCOPED_TRACE(std::string(format_name(f)) + " " + activation_name(act));
      const MoeConfig cfg = small_config(f, act, 16, 4, 320, 192);
      SyntheticOptions so;
      so.seed = ++seed;
      so.biases = act != Activation::kSilu;
      so.split_scale_2 = f == WeightFormat::kNvfp4;
      const MoeModel m = make_synthetic_model(cfg, so);
      const LayerInputData in = make_synthetic_input(cfg, 37, seed);
      const LayerOutput routed = run_backend("cpu", m, in.view());
      check_against_cpu(m, with_ids(in, routed, cfg.top_k));
    }
}

TEST(Sm90, AwkwardTokenCounts) {
  const MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSwigluOai, 8, 2, 2880, 320);
  const MoeModel m = synthetic_model(cfg, 7, true);
  for (int64_t T : {0, 1, 3, 64, 118, 1000}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    const LayerInputData in = make_synthetic_input(cfg, T, uint64_t(T) + 11);
    const LayerOutput routed = run_backend("cpu", m, in.view());
    if (T == 0) {
      for (const char* name : kGpuBackends) EXPECT_TRUE(run_backend(name, m, in.view()).y.empty());
      continue;
    }
    check_against_cpu(m, with_ids(in, routed, cfg.top_k));
    // The GPU's own routing picks the same experts.
    for (const char* name : kGpuBackends) expect_same_id_sets(run_backend(name, m, in.view()).ids, routed.ids, T, cfg.top_k);
  }
}

TEST(Sm90, IdPatterns) {
  const MoeConfig cfg = small_config(WeightFormat::kNvfp4, Activation::kSilu, 16, 4, 96, 160);  // H, I padded
  const MoeModel m = synthetic_model(cfg, 9, false);
  const int k = 4;
  struct Pattern {
    const char* name;
    std::function<int32_t(int64_t t, int j)> id;
  };
  const std::vector<Pattern> patterns = {
      {"two experts only (others empty)", [](int64_t, int j) { return j == 0 ? 1 : (j == 1 ? 5 : -1); }},
      {"all tokens on one expert", [](int64_t, int j) { return j == 0 ? 3 : -1; }},
      {"-1 ids everywhere, token 5 empty",
       [](int64_t t, int j) { return t == 5 ? -1 : ((t + j) % 3 == 0 ? -1 : int32_t((t * 7 + j * 3) % 16)); }},
      {"distinct experts per token", [](int64_t t, int j) { return int32_t((t + j * 4) % 16); }},
  };
  for (const int64_t T : {70, 7})  // planned by the block; by one warp (28 entries)
    for (const auto& p : patterns) {
    SCOPED_TRACE(std::string(p.name) + " T=" + std::to_string(T));
    const LayerInputData in = bypass_input(cfg, T, k, 5, p.id);
    check_against_cpu(m, in);
    for (const char* name : kGpuBackends) {
      const LayerOutput out = run_backend(name, m, in.view());
      bool all_empty = true;
      for (int j = 0; j < k; ++j) all_empty = all_empty && in.ids[size_t(5 * k + j)] < 0;
      if (all_empty) {
        for (int64_t h = 0; h < cfg.hidden; ++h) ASSERT_EQ(out.y[size_t(5 * cfg.hidden + h)], 0) << name;
      }
    }
  }
}

// y poisoned before each of three runs; the first matches the CPU backend, the others have its
// bits, including runs whose segments are summed from slices computed on different CTAs.
TEST(Sm90, PoisonedOutputAndDeterminism) {
  // GPT-OSS-sized experts on an H100 (396 CTAs). T = 1, k = 4: GEMM2's 180 segments are cut into
  // two slices each; T = 1, k = 1: both GEMMs are (GEMM2 then waits for summed GEMM1 slices);
  // T = 13: nothing is cut.
  struct Case {
    int64_t T;
    int k;
  };
  for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched})
  for (const Case c : {Case{1, 4}, Case{1, 1}, Case{13, 4}}) {
    const int64_t T = c.T;
    SCOPED_TRACE("T = " + std::to_string(T) + ", k = " + std::to_string(c.k));
    const MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSwigluOai, 32, c.k, 2880, 2880);
    const MoeModel m = synthetic_model(cfg, 21, true);
    Sm90Layer layer(m, fmt);
    layer.reserve(T, cfg.top_k);
    const LayerInputData in = make_synthetic_input(cfg, T, 77);
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
    ASSERT_EQ(upload_inputs(layer, in), cudaSuccess);
    std::vector<uint16_t> first;
    for (int rep = 0; rep < 3; ++rep) {
      std::vector<uint16_t> y;
      ASSERT_NO_FATAL_FAILURE(run_poisoned(layer, s, T, false, &y));
      if (rep == 0) {
        first = y;
        const LayerOutput cpu = run_backend("cpu", m, in.view());
        EXPECT_LE(test::rel_l2_err(to_f32(y), to_f32(cpu.y)), 1e-2);
      } else {
        EXPECT_EQ(std::memcmp(first.data(), y.data(), y.size() * 2), 0) << "run " << rep << " differs";
      }
    }
    cudaStreamDestroy(s);
  }
}

// Bypass routing with -1 ids straight through Sm90Layer, y poisoned first: a token whose ids are
// all -1 must come out exactly zero, the rest must match the CPU backend.
TEST(Sm90, PoisonedBypassWithEmptyTokens) {
  const MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSwigluOai, 16, 4, 2880, 2880);
  const MoeModel m = synthetic_model(cfg, 4, true);
  const int k = 4;
  for (const int64_t T : {9, 7})  // 36 entries: planned by the block; 28: by one warp
  for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched}) {
    SCOPED_TRACE(std::string(fmt == ActivationFormat::kStandard ? "standard" : "batched") +
                 " T=" + std::to_string(T));
    const LayerInputData in = bypass_input(cfg, T, k, 8, [](int64_t t, int j) {
      if (t == 2 || (t == 4 && j % 2 == 0) || (t == 7 && j == 3)) return -1;  // token 2: no expert at all
      return int32_t((t * 5 + j * 3) % 16);
    });
    const LayerOutput cpu = run_backend("cpu", m, in.view());
    Sm90Layer layer(m, fmt);
    layer.reserve(T, k);
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
    ASSERT_EQ(upload_inputs(layer, in), cudaSuccess);
    std::vector<uint16_t> y;
    ASSERT_NO_FATAL_FAILURE(run_poisoned(layer, s, T, true, &y));
    for (int64_t h = 0; h < cfg.hidden; ++h) ASSERT_EQ(y[size_t(2 * cfg.hidden + h)], 0) << "token 2, column " << h;
    EXPECT_LE(test::rel_l2_err(to_f32(y), to_f32(cpu.y)), 1e-2);
    cudaStreamDestroy(s);
  }
}

// An id out of range reaching the device (the host checks first; this is the plan's own guard)
// sets the plan's error flag, whichever planner runs; a clean plan clears it again.
TEST(Sm90, PlanFlagsBadIds) {
  const MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSilu, 16, 4, 128, 64);
  const MoeModel m = synthetic_model(cfg, 3, false);
  const int k = 4;
  for (const int64_t T : {70, 7}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    Sm90Layer layer(m, ActivationFormat::kStandard);
    layer.reserve(T, k);
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
    for (const int32_t bad : {16, -2, 7}) {  // 7: the valid id of that slot, the flag goes back to 0
      const LayerInputData in = bypass_input(cfg, T, k, 8, [&](int64_t t, int j) {
        return t == 3 && j == 1 ? bad : int32_t((t + j * 4) % 16);
      });
      ASSERT_EQ(upload_inputs(layer, in), cudaSuccess);
      layer.enqueue(s, T, true);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      EXPECT_EQ(layer.plan_error(s), bad == 7 ? 0 : 1) << "id " << bad;
    }
    cudaStreamDestroy(s);
  }
}

// Routes `in` on a GPU layer whose ids and weights buffers are poisoned first (-1 ids, NaN
// weights), so a slot the routing kernels forget to write cannot pass for a right one.
LayerOutput route_poisoned(const MoeModel& m, const LayerInputData& in, ActivationFormat fmt) {
  const int64_t T = in.tokens;
  const int k = m.cfg.top_k;
  Sm90Layer layer(m, fmt);
  layer.reserve(T, k);
  LayerOutput out;
  cudaStream_t s;
  EXPECT_EQ(cudaStreamCreate(&s), cudaSuccess);
  EXPECT_EQ(cudaMemset(layer.ids(), 0xff, size_t(T * k) * 4), cudaSuccess);
  EXPECT_EQ(cudaMemset(layer.weights(), 0xff, size_t(T * k) * 4), cudaSuccess);
  EXPECT_EQ(upload_inputs(layer, in), cudaSuccess);
  layer.enqueue(s, T, false);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  out.ids.resize(size_t(T * k));
  out.weights.resize(size_t(T * k));
  EXPECT_EQ(cudaMemcpy(out.ids.data(), layer.ids(), out.ids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.weights.data(), layer.weights(), out.weights.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(layer.plan_error(s), 0);
  cudaStreamDestroy(s);
  return out;
}

// Routing in registers (E <= 256, 384 in the decode kernel; groups of whole lanes) or in shared
// memory (the rest), planned by one warp (<= 32 entries) or by the block: every combination
// against the CPU.
TEST(Sm90, RoutingMatchesCpu) {
  struct Case {
    Scoring sc;
    int E, k, n_group, topk_group;
  };
  const Case cases[] = {
      {Scoring::kSoftmax, 64, 6, 1, 1},   // registers, two experts per lane
      {Scoring::kSigmoid, 64, 6, 8, 3},   // registers, groups of 4 lanes
      {Scoring::kSoftmax, 8, 2, 1, 1},    // lanes 8..31 empty
      {Scoring::kSigmoid, 256, 8, 8, 4},  // DeepSeek-V3's routing
      {Scoring::kSigmoid, 96, 6, 4, 2},   // registers, groups of 8 lanes
      {Scoring::kSigmoid, 80, 6, 4, 2},   // shared memory: E is not 32 J
      {Scoring::kSoftmax, 320, 4, 1, 1},  // shared memory: E > 256 (registers, J = 10, in the decode kernel)
      {Scoring::kSoftmax, 448, 4, 1, 1},  // shared memory in both kernels: E > 384
  };
  for (const Case& c : cases)
    for (const int64_t T : {1, 3, 200}) {
    const Scoring sc = c.sc;
    MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSilu, c.E, c.k, 128, 64);
    cfg.scoring = sc;
    if (sc == Scoring::kSigmoid) {
      cfg.n_group = c.n_group;
      cfg.topk_group = c.topk_group;
      cfg.routed_scaling_factor = 2.5f;
    }
    SyntheticOptions so;
    so.seed = 31;
    so.score_bias = sc == Scoring::kSigmoid;
    const MoeModel m = make_synthetic_model(cfg, so);
    const LayerInputData in = make_synthetic_input(cfg, T, 8);
    const LayerOutput cpu = run_backend("cpu", m, in.view());
    for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched}) {
      SCOPED_TRACE(std::string(fmt == ActivationFormat::kStandard ? "standard " : "batched ") + scoring_name(sc) +
                   " E=" + std::to_string(c.E) + " T=" + std::to_string(T));
      const LayerOutput gpu = route_poisoned(m, in, fmt);
      expect_same_id_sets(gpu.ids, cpu.ids, in.tokens, cfg.top_k);
      for (size_t i = 0; i < cpu.ids.size(); ++i) {
        // match weights by id within the token
        const int64_t t = int64_t(i) / cfg.top_k;
        for (int j = 0; j < cfg.top_k; ++j)
          if (gpu.ids[size_t(t * cfg.top_k + j)] == cpu.ids[i]) {
            EXPECT_NEAR(gpu.weights[size_t(t * cfg.top_k + j)], cpu.weights[i], 1e-5f * std::fabs(cpu.weights[i]) + 1e-7f);
          }
      }
    }
  }
}

// Sigmoid scores that all underflow to 0 (logits -200): the renormalization divides by
// sum + 1e-20 on the GPU as on the CPU (routing.h), so every weight is 0, never NaN; in registers
// (E = 64) and in shared memory (E = 80).
TEST(Sm90, RenormalizationOfAllZeroScoresGivesZeroWeights) {
  for (const int E : {64, 80}) {
    SCOPED_TRACE("E=" + std::to_string(E));
    MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSilu, E, 6, 128, 64);
    cfg.scoring = Scoring::kSigmoid;
    cfg.routed_scaling_factor = 2.5f;
    const MoeModel m = synthetic_model(cfg, 41, false);
    LayerInputData in = make_synthetic_input(cfg, 3, 42);
    std::fill(in.logits.begin(), in.logits.end(), -200.0f);
    const LayerOutput cpu = run_backend("cpu", m, in.view());
    for (float w : cpu.weights) ASSERT_EQ(w, 0.0f);
    for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched}) {
      const LayerOutput gpu = route_poisoned(m, in, fmt);
      for (float w : gpu.weights) EXPECT_EQ(w, 0.0f);
    }
    for (const char* name : kGpuBackends)
      for (uint16_t v : run_backend(name, m, in.view()).y) ASSERT_EQ(v & 0x7fff, 0) << name;
  }
}

// A reduced set for compute-sanitizer (memcheck, racecheck): every format, small sizes.
TEST(Sm90Sanitize, SmallLayers) {
  auto check = [](const MoeConfig& cfg, uint64_t model_seed, std::initializer_list<int64_t> tokens) {
    const MoeModel m = synthetic_model(cfg, model_seed, true);
    for (int64_t T : tokens) {
      const LayerInputData in = make_synthetic_input(cfg, T, uint64_t(T) + model_seed);
      const LayerOutput cpu = run_backend("cpu", m, in.view());
      for (const char* name : kGpuBackends) {
        const LayerOutput gpu = run_backend(name, m, in.view());
        EXPECT_LE(test::rel_l2_err(to_f32(gpu.y), to_f32(cpu.y)), 1e-2) << name << " T=" << T;
      }
    }
  };
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16}) {
    SCOPED_TRACE(format_name(f));
    check(small_config(f, Activation::kSwigluOai, 8, 2, 192, 96), 5, {1, 3, 40});
  }
  // Few segments of 16 k-blocks at one token: both GEMMs are cut into two slices, so partials,
  // slice counters and the last slice's sum run under the sanitizers too.
  SCOPED_TRACE("sliced");
  check(small_config(WeightFormat::kMxfp4, Activation::kSwigluOai, 8, 1, 1024, 1024), 6, {1, 2});
  // Prefill sizes: the plan in three grids (from kWidePlanFrom entries) and finalize's variants
  // for 2, 4 and 8 slots (from 1024 tokens).
  for (int k : {2, 4, 8}) {
    SCOPED_TRACE("wide plan, k=" + std::to_string(k));
    check(small_config(WeightFormat::kMxfp4, Activation::kSilu, 16, k, 128, 64), 7, {2100});
  }
}

}  // namespace
}  // namespace moekit
