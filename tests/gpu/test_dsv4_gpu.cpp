// DeepSeek-V4 on SM90 (label gpu): the routing kernels of both kinds (sqrtsoftplus with the
// expert bias; hash by token id) against the CPU router on the same logits, ids and weights
// poisoned first, T = 0, 1, 3, 5, 7, 33, 200 and a wide plan (T k >= 4096), scores in registers
// (E <= 256; 384 in the decode kernel) and in shared memory (E = 384 and 448); the router
// goldens of tests/golden/dsv4_router; token ids outside the table (their rows get no expert,
// the flag 3, check()); the whole layer through every SM90 backend against the CPU and the
// float64 reference; the presets' routing at full size; DeepSeek-V4 checkpoints in the published
// layout through the SM90 backends with their shared expert.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "../dsv4_testutil.h"
#include "moekit/bench/bench.h"
#include "moekit/formats/synthetic_bytes.h"
#include "sm90_testutil.h"

namespace moekit {
namespace {

MoeConfig dsv4_config(int E, int k, int H, int I, int64_t vocab) {
  MoeConfig c = small_config(WeightFormat::kMxfp4, Activation::kSiluClamped, E, k, H, I);
  c.swiglu_limit = 10.0f;
  c.scoring = Scoring::kSqrtSoftplus;
  c.routed_scaling_factor = 1.5f;
  c.hash_vocab = vocab;
  c.score_bias = vocab == 0;
  return c;
}

MoeModel dsv4_model(const MoeConfig& c, uint64_t seed) {
  SyntheticOptions so;
  so.seed = seed;
  so.score_bias = c.hash_vocab == 0;
  return make_synthetic_model(c, so);
}

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> w;
  int error = -1;
};

// Routes `in` on an SM90 layer of m (its own buffers: int32 token ids), ids and weights poisoned.
Routed route_gpu(const MoeModel& m, const LayerInputData& in, ActivationFormat fmt) {
  const int64_t T = in.tokens;
  const int k = m.cfg.top_k;
  Routed r;
  Sm90Layer layer(m, fmt);
  layer.reserve(std::max<int64_t>(T, 1), k);
  cudaStream_t s;
  EXPECT_EQ(cudaStreamCreate(&s), cudaSuccess);
  EXPECT_EQ(cudaMemset(layer.ids(), 0xff, size_t(std::max<int64_t>(T, 1) * k) * 4), cudaSuccess);
  EXPECT_EQ(cudaMemset(layer.weights(), 0xff, size_t(std::max<int64_t>(T, 1) * k) * 4), cudaSuccess);
  if (T > 0) {
    EXPECT_EQ(upload_inputs(layer, in), cudaSuccess);
    if (m.cfg.hash_vocab > 0) {
      const std::vector<int32_t> tok(in.token_ids.begin(), in.token_ids.end());
      EXPECT_EQ(cudaMemcpy(layer.token_ids(), tok.data(), tok.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  layer.enqueue(s, T, false);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  r.ids.resize(size_t(T * k));
  r.w.resize(size_t(T * k));
  if (T > 0) {
    EXPECT_EQ(cudaMemcpy(r.ids.data(), layer.ids(), r.ids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(r.w.data(), layer.weights(), r.w.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    r.error = layer.plan_error(s);
  }
  cudaStreamDestroy(s);
  return r;
}

// The CPU router on the same inputs.
Routed route_cpu_of(const MoeModel& m, const LayerInputData& in) {
  Routed r;
  r.ids.resize(size_t(in.tokens * m.cfg.top_k));
  r.w.resize(r.ids.size());
  route_cpu(routing_params(m.cfg, m.score_bias, m.hash_table), in.logits.data(), in.tokens, r.ids.data(), r.w.data(),
            TokenIds{in.token_ids.data(), true});
  return r;
}

// Hash: the same ids slot by slot; learned: the same sets. Weights by id within 1e-5 (the GPU's
// exp / log1p / sqrt differ from the host's by an ulp or two).
void expect_same_routing(const Routed& gpu, const Routed& cpu, int64_t T, int k, bool hash) {
  ASSERT_EQ(gpu.ids.size(), cpu.ids.size());
  if (hash) {
    EXPECT_EQ(gpu.ids, cpu.ids);
  } else {
    expect_same_id_sets(gpu.ids, cpu.ids, T, k);
  }
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j)
      for (int q = 0; q < k; ++q)
        if (gpu.ids[size_t(t * k + j)] == cpu.ids[size_t(t * k + q)]) {
          const float a = gpu.w[size_t(t * k + j)], b = cpu.w[size_t(t * k + q)];
          bad += !(std::fabs(a - b) <= 1e-5f * std::fabs(b) + 1e-7f);
        }
  EXPECT_EQ(bad, 0) << "weights that differ";
}

TEST(Dsv4Gpu, RoutingKernelsMatchTheCpu) {
  struct Case {
    int E, k;
  };
  // 16, 64, 256: registers (J <= 8); 384: registers in the decode kernel (J = 12, DeepSeek-V4-Pro),
  // shared memory in the block kernel; 448: shared memory in both.
  for (const Case c : {Case{16, 4}, Case{64, 6}, Case{256, 6}, Case{384, 6}, Case{448, 4}})
    for (const int64_t vocab : {int64_t(0), int64_t(1000)})
      for (const int64_t T : {0, 1, 3, 5, 7, 33, 200}) {
        const MoeConfig cfg = dsv4_config(c.E, c.k, 128, 64, vocab);
        const MoeModel m = dsv4_model(cfg, 7 + uint64_t(c.E));
        const LayerInputData in = make_synthetic_input(cfg, T, 19 + uint64_t(T));
        const Routed cpu = route_cpu_of(m, in);
        for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched}) {
          SCOPED_TRACE("E=" + std::to_string(c.E) + (vocab ? " hash" : " learned") + " T=" + std::to_string(T) +
                       (fmt == ActivationFormat::kStandard ? " standard" : " batched"));
          const Routed gpu = route_gpu(m, in, fmt);
          if (T > 0) {
            EXPECT_EQ(gpu.error, 0);
          }
          expect_same_routing(gpu, cpu, T, c.k, vocab > 0);
        }
      }
}

// The wide plan (T k >= 4096 entries: route_plan routes, two more grids plan) of a hash layer.
TEST(Dsv4Gpu, WidePlanHashRouting) {
  const MoeConfig cfg = dsv4_config(64, 2, 128, 64, 5000);
  const MoeModel m = dsv4_model(cfg, 3);
  const LayerInputData in = make_synthetic_input(cfg, 2100, 4);
  const Routed cpu = route_cpu_of(m, in);
  for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched}) {
    const Routed gpu = route_gpu(m, in, fmt);
    EXPECT_EQ(gpu.error, 0);
    expect_same_routing(gpu, cpu, in.tokens, cfg.top_k, true);
  }
}

TEST(Dsv4Gpu, RouterGoldens) {
  for (const std::string& n : test::router_golden_names()) {
    SCOPED_TRACE(n);
    const test::RouterGolden g = test::load_router_golden(n);
    LayerSpec spec = g.spec(g.T);
    MoeModel m = dsv4_model(spec, 5);
    if (g.hash) m.hash_table = g.table;
    else m.score_bias = g.bias;
    LayerInputData in = make_synthetic_input(spec, g.T, 6);
    in.logits = g.logits;
    in.token_ids = g.input_ids;
    const Routed gpu = route_gpu(m, in, ActivationFormat::kStandard);
    EXPECT_EQ(gpu.error, 0);
    test::expect_golden_routing(g, gpu.ids, gpu.w, 1e-5);
  }
}

// Token ids outside the table: their rows get -1 ids and 0 weights (no expert, never a wrong
// one), y = 0 there, the other rows as on the CPU, and the flag 3; the next good call clears it.
// The one-warp decode kernel with one and seven routing warps (T = 1, 7), the block kernel with
// one CTA (T = 8, k = 6) and several (T = 200), the wide plan (T = 2100, k = 2).
TEST(Dsv4Gpu, TokenIdsOutsideTheTableSkipTheirRows) {
  for (const auto& [T, k] : {std::pair<int64_t, int>{1, 4}, {7, 4}, {8, 6}, {200, 4}, {2100, 2}}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    const MoeConfig cfg = dsv4_config(16, k, 128, 64, 300);
    const MoeModel m = dsv4_model(cfg, 8);
    LayerInputData in = make_synthetic_input(cfg, T, 9);
    std::vector<bool> bad(size_t(T), false);
    for (int64_t t = 0; t < T; t += 3) {
      in.token_ids[size_t(t)] = t % 2 ? 300 : -5;
      bad[size_t(t)] = true;
    }
    for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched}) {
      Sm90Layer layer(m, fmt);
      layer.reserve(T, k);
      cudaStream_t s;
      ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
      ASSERT_EQ(upload_inputs(layer, in), cudaSuccess);
      const std::vector<int32_t> tok(in.token_ids.begin(), in.token_ids.end());
      ASSERT_EQ(cudaMemcpy(layer.token_ids(), tok.data(), tok.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      std::vector<uint16_t> y;
      run_poisoned(layer, s, T, false, &y);
      EXPECT_EQ(layer.plan_error(s), 3);
      std::vector<int32_t> ids(size_t(T * k));
      std::vector<float> w(ids.size());
      ASSERT_EQ(cudaMemcpy(ids.data(), layer.ids(), ids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(w.data(), layer.weights(), w.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      LayerInputData good = in;
      for (int64_t t = 0; t < T; ++t)
        if (bad[size_t(t)]) good.token_ids[size_t(t)] = 0;
      const Routed cpu = route_cpu_of(m, good);
      for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) {
          const size_t i = size_t(t * k + j);
          if (bad[size_t(t)]) {
            ASSERT_EQ(ids[i], -1) << "row " << t;
            ASSERT_EQ(w[i], 0.0f);
          } else {
            ASSERT_EQ(ids[i], cpu.ids[i]) << "row " << t;
          }
        }
      for (int64_t t = 0; t < T; ++t) {
        if (!bad[size_t(t)]) continue;
        for (int64_t h = 0; h < cfg.hidden; ++h) ASSERT_EQ(y[size_t(t * cfg.hidden + h)] & 0x7fff, 0) << "row " << t;
      }
      // A good call clears the flag.
      ASSERT_EQ(cudaMemcpy(layer.token_ids(), std::vector<int32_t>(size_t(T), 1).data(), size_t(T) * 4,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      run_poisoned(layer, s, T, false, &y);
      EXPECT_EQ(layer.plan_error(s), 0);
      cudaStreamDestroy(s);
    }
  }
}

// Through the public API on the GPU: the bad id is the device flag that check() reads, with its
// message; the call itself returns ok (it cannot read device data).
TEST(Dsv4Gpu, CheckReportsTokenIdsOutsideTheTable) {
  MoeConfig cfg = dsv4_config(16, 4, 128, 64, 50);
  cfg.max_tokens = 8;
  const MoeModel m = dsv4_model(cfg, 10);
  const HostCheckpoint ck(m);
  OwnedLayer L;
  ASSERT_TRUE(make_layer(cfg, {{kDLCUDA, 0}, "sm90"}, ck.tensors, &L).ok());
  const int64_t T = 4, H = cfg.hidden, E = cfg.num_experts;
  const LayerInputData in = make_synthetic_input(cfg, T, 11);
  Buffer x, lg, y, ws, tok;
  ASSERT_TRUE(Buffer::allocate({kDLCUDA, 0}, T * H * 2, &x).ok());
  ASSERT_TRUE(Buffer::allocate({kDLCUDA, 0}, T * E * 4, &lg).ok());
  ASSERT_TRUE(Buffer::allocate({kDLCUDA, 0}, T * H * 2, &y).ok());
  ASSERT_TRUE(Buffer::allocate({kDLCUDA, 0}, L.layer->workspace_bytes(T), &ws).ok());
  ASSERT_TRUE(Buffer::allocate({kDLCUDA, 0}, T * 8, &tok).ok());
  ASSERT_TRUE(x.copy_from_host(in.x.data(), T * H * 2).ok());
  ASSERT_TRUE(lg.copy_from_host(in.logits.data(), T * E * 4).ok());
  const TensorRef xr(x.data(), kBF16, {T, H}, {kDLCUDA, 0}), yr(y.data(), kBF16, {T, H}, {kDLCUDA, 0});
  const TensorRef lr(lg.data(), kF32, {T, E}, {kDLCUDA, 0}), tr(tok.data(), kI64, {T}, {kDLCUDA, 0});
  for (const bool good : {false, true}) {
    const std::vector<int64_t> ids = {1, good ? 2 : 50, 3, 49};
    ASSERT_TRUE(tok.copy_from_host(ids.data(), T * 8).ok());
    ASSERT_TRUE(L.layer->forward_logits(xr, lr, yr, ws.tensor(), nullptr, nullptr, nullptr, nullptr, &tr.dl()).ok());
    const Status st = L.layer->check(nullptr);
    EXPECT_EQ(st.ok(), good) << st.message;
    if (!good) {
      EXPECT_NE(st.message.find("a token id was outside the hash table"), std::string::npos) << st.message;
    }
  }
}

// The layer of both router kinds on every SM90 backend (int64 token ids through the public API)
// against the CPU backend on the same routing and the float64 reference.
TEST(Dsv4Gpu, LayerOnEverySm90Backend) {
  for (const int64_t vocab : {int64_t(0), int64_t(500)})
    for (const int64_t T : {1, 3, 33, 300}) {
      SCOPED_TRACE(std::string(vocab ? "hash" : "learned") + " T=" + std::to_string(T));
      const MoeConfig cfg = dsv4_config(16, 4, 256, 128, vocab);
      const MoeModel m = dsv4_model(cfg, 12 + uint64_t(T));
      const LayerInputData in = make_synthetic_input(cfg, T, 13 + uint64_t(T));
      const LayerOutput cpu = run_backend("cpu", m, in.view());
      const std::vector<double> ref = reference_layer(m, in.x.data(), T, cpu.ids.data(), cpu.weights.data(), cfg.top_k);
      EXPECT_LE(rel_l2(to_f32(cpu.y), ref), 1e-2);
      for (const char* name : kGpuBackends) {
        SCOPED_TRACE(name);
        const LayerOutput gpu = run_backend(name, m, in.view());
        if (vocab) {
          EXPECT_EQ(gpu.ids, cpu.ids);
        } else {
          expect_same_id_sets(gpu.ids, cpu.ids, T, cfg.top_k);
        }
        EXPECT_LE(rel_l2(to_f32(gpu.y), ref), 1e-2);
        EXPECT_LE(test::rel_l2_err(to_f32(gpu.y), to_f32(cpu.y)), 1e-2);
      }
    }
}

// The presets' routing at full size (E = 384 / 256, k = 6), both kinds, at 1-128 tokens: the
// device's synthetic table is synthetic_bytes.h's, so the CPU router gets the same one.
TEST(Dsv4Gpu, PresetRoutingAtFullSize) {
  for (const char* shape : {"deepseek-v4-pro", "deepseek-v4-flash", "deepseek-v4.1-flash"})
    for (const bool hash : {false, true}) {
      BenchOptions o;
      o.shape = shape;
      o.hash_layer = hash;
      MoeConfig cfg = bench_config(o);
      cfg.hidden = 256;  // the routing does not look at H or I: small weights
      cfg.intermediate = 128;
      const uint64_t seed = 21;
      Sm90Layer layer(cfg, ActivationFormat::kStandard, seed);
      layer.reserve(128, cfg.top_k);
      std::vector<int32_t> table(size_t(cfg.hash_vocab * cfg.top_k));
      for (size_t i = 0; i < table.size(); ++i) table[i] = synthetic_hash_entry(int64_t(i), cfg.top_k, cfg.num_experts, seed);
      for (const int64_t T : {1, 2, 5, 8, 32, 128}) {
        SCOPED_TRACE(std::string(shape) + (hash ? " hash" : " learned") + " T=" + std::to_string(T));
        LayerInputData in = make_synthetic_input(cfg, T, 30 + uint64_t(T));
        ASSERT_EQ(upload_inputs(layer, in), cudaSuccess);
        if (hash) {
          const std::vector<int32_t> tok(in.token_ids.begin(), in.token_ids.end());
          ASSERT_EQ(cudaMemcpy(layer.token_ids(), tok.data(), tok.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
        }
        cudaStream_t s;
        ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
        layer.enqueue(s, T, false);
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        EXPECT_EQ(layer.plan_error(s), 0);
        Routed gpu;
        gpu.ids.resize(size_t(T * cfg.top_k));
        gpu.w.resize(gpu.ids.size());
        ASSERT_EQ(cudaMemcpy(gpu.ids.data(), layer.ids(), gpu.ids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(gpu.w.data(), layer.weights(), gpu.w.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        Routed cpu;
        cpu.ids.resize(gpu.ids.size());
        cpu.w.resize(gpu.ids.size());
        const std::vector<float> zero_bias;  // the synthetic layer's score bias is 0 (none packed)
        route_cpu(routing_params(cfg, zero_bias, hash ? table : std::vector<int32_t>{}), in.logits.data(), T,
                  cpu.ids.data(), cpu.w.data(), TokenIds{in.token_ids.data(), true});
        expect_same_routing(gpu, cpu, T, cfg.top_k, hash);
        cudaStreamDestroy(s);
      }
    }
}

// DeepSeek-V4 checkpoints in the published layout through every SM90 backend, the shared expert
// on the oracle's backend: y against the CPU and the float64 reference (FP8 routed experts run
// on the CPU only: SM90 needs them converted, `moekit run --convert`).
TEST(Dsv4Gpu, CheckpointsOnEverySm90Backend) {
  for (const test::Dsv4Case& c : test::dsv4_cases()) {
    if (c.format == WeightFormat::kFp8) continue;
    SCOPED_TRACE(c.name);
    const auto ck = test::build_dsv4_checkpoint(c, 2);
    for (int l = 0; l < c.num_layers; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      const MoeModel m = MoeModel::load(ck->path(), l);
      const LayerInputData in = test::dsv4_input(m, 37, 3 + uint64_t(l));
      const LayerOutput cpu = test::run_with_shared(m, in, "cpu");
      const std::vector<double> ref = test::dsv4_reference(*ck, l, in, cpu.ids, cpu.weights);
      for (const char* name : kGpuBackends) {
        SCOPED_TRACE(name);
        const LayerOutput gpu = test::run_with_shared(m, in, name, "");  // the shared expert on the oracle's
        if (m.cfg.hash_vocab > 0) {
          EXPECT_EQ(gpu.ids, cpu.ids);
        } else {
          expect_same_id_sets(gpu.ids, cpu.ids, in.tokens, c.k);
        }
        EXPECT_LE(rel_l2(to_f32(gpu.y), ref), 1e-2);
      }
    }
  }
}

// A reduced set for compute-sanitizer: both kinds, one warp, the block kernel, the wide plan, and
// bad token ids.
TEST(Dsv4Sanitize, SmallLayers) {
  for (const int64_t vocab : {int64_t(0), int64_t(200)})
    for (const int64_t T : {1, 3, 40, 2100}) {
      const int k = T == 2100 ? 2 : 4;
      const MoeConfig cfg = dsv4_config(16, k, 128, 64, vocab);
      const MoeModel m = dsv4_model(cfg, 14);
      LayerInputData in = make_synthetic_input(cfg, T, 15);
      const LayerOutput cpu = run_backend("cpu", m, in.view());
      for (const char* name : {"sm90", "sm90_batched"}) {
        const LayerOutput gpu = run_backend(name, m, in.view());
        EXPECT_LE(test::rel_l2_err(to_f32(gpu.y), to_f32(cpu.y)), 1e-2) << name << " T=" << T;
      }
      if (vocab) {
        for (int64_t t = 0; t < T; t += 2) in.token_ids[size_t(t)] = vocab + t;
        for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched})
          EXPECT_EQ(route_gpu(m, in, fmt).error, 3);
      }
    }
}

}  // namespace
}  // namespace moekit
