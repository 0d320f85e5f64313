// The benchmark's GPU paths (bench/bench_sm90.cu): the layer cut after each part (the time
// split) leaves the layer intact, and a sweep with Zipf routing, the split and both kernels fills
// every field the report reads.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "moekit/bench/bench.h"
#include "moekit/backends/sm90_layer.h"

namespace moekit {
namespace {

// The whole layer after every cut (routing; + permute; + GEMM1; + GEMM2) gives the same output,
// bit for bit, as before the cuts: a cut leaves no state (GEMM counters, plan) that a whole run
// would trip on. Both kernels, both activation formats, a format with slices.
TEST(BenchGpu, LayerCutsLeaveTheLayerIntact) {
  const MoeConfig cfg = bench_shape("16,4,512,256", WeightFormat::kMxfp4);
  const int64_t T = 37;
  for (ActivationFormat fmt : {ActivationFormat::kStandard, ActivationFormat::kBatched})
    for (int64_t prefill_from : {int64_t(-1), int64_t(0)}) {
      SCOPED_TRACE(std::string(fmt == ActivationFormat::kBatched ? "batched" : "standard") +
                   (prefill_from < 0 ? " decode" : " prefill"));
      Sm90Layer layer(cfg, fmt, 5);
      layer.set_prefill_from(prefill_from);
      layer.reserve(T, cfg.top_k);
      const std::vector<float> lg = bench_router_logits(cfg, T, BenchRouting::kZipf, 1.0, 3);
      std::vector<uint16_t> x(size_t(T * layer.x_stride()), 0);
      for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < cfg.hidden; ++h)
          x[size_t(t * layer.x_stride() + h)] = uint16_t(0x3f00 | ((t * 7 + h * 13) & 0x80ff));
      ASSERT_EQ(cudaMemcpy(layer.x(), x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(layer.logits(), lg.data(), lg.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      auto run = [&](int parts) {
        layer.set_parts(parts);
        layer.enqueue(nullptr, T, false);
        layer.set_parts(kLayerParts);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "parts " << parts;
        EXPECT_EQ(layer.plan_error(nullptr), 0);
      };
      std::vector<uint16_t> y0(size_t(T * cfg.hidden)), y1(y0.size());
      run(kLayerParts);
      ASSERT_EQ(cudaMemcpy(y0.data(), layer.y(), y0.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      for (int parts = 1; parts < kLayerParts; ++parts) {
        ASSERT_EQ(cudaMemset(layer.y(), 0xff, y1.size() * 2), cudaSuccess);  // poison: a cut writes no output
        run(parts);
        ASSERT_EQ(cudaMemcpy(y1.data(), layer.y(), y1.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(std::count(y1.begin(), y1.end(), uint16_t(0xffff)), int64_t(y1.size())) << "parts " << parts;
        run(kLayerParts);
        ASSERT_EQ(cudaMemcpy(y1.data(), layer.y(), y1.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(std::memcmp(y0.data(), y1.data(), y0.size() * 2), 0) << "after the cut after part " << parts;
      }
      // Finalize alone on what the whole layer left, and a cut after it: the same output.
      ASSERT_EQ(cudaMemset(layer.y(), 0xff, y1.size() * 2), cudaSuccess);
      layer.set_parts(kLayerParts, kLayerParts);
      layer.enqueue(nullptr, T, false);
      layer.set_parts(kLayerParts);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(y1.data(), layer.y(), y1.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(std::memcmp(y0.data(), y1.data(), y0.size() * 2), 0) << "finalize alone";
      run(2);
      run(kLayerParts);
      ASSERT_EQ(cudaMemcpy(y1.data(), layer.y(), y1.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(std::memcmp(y0.data(), y1.data(), y0.size() * 2), 0) << "after finalize alone";
    }
}

TEST(BenchGpu, SweepWithZipfRoutingAndTheSplit) {
  BenchOptions o;
  o.shape = "32,4,512,512";
  o.format = WeightFormat::kNvfp4;
  o.tokens = {1, 64, 300};
  o.split = {1, 300};
  o.reps = 3;
  o.budget_ms = 1;
  o.routing = BenchRouting::kZipf;
  o.compare_kernels = true;
  const std::vector<BenchRow> rows = bench_gpu(o, "sm90");
  ASSERT_EQ(rows.size(), 3u);
  for (const BenchRow& r : rows) {
    SCOPED_TRACE("T=" + std::to_string(r.tokens));
    EXPECT_GT(r.gemm_us, 0);
    EXPECT_GT(r.layer_us, 0);
    EXPECT_GT(r.decode_us, 0);
    EXPECT_GT(r.prefill_us, 0);
    EXPECT_GE(r.max_expert_rows, 1);
    EXPECT_LE(r.max_expert_rows, r.tokens);  // k distinct experts per token
    const bool split = r.tokens != 64;
    EXPECT_EQ(r.split_us[0] >= 0, split);
    if (split) {
      const double sum = std::accumulate(std::begin(r.split_us), std::end(r.split_us), 0.0);
      EXPECT_NEAR(sum, r.layer_us, 1e-6 * r.layer_us);  // the cuts' differences add up to the layer
      EXPECT_EQ(r.split_us[1] == 0, r.kernel == "decode");  // the decode kernel has no permute
      EXPECT_GT(r.finalize_alone_us, 0);
    } else {
      EXPECT_LT(r.finalize_alone_us, 0);
    }
  }
}

}  // namespace
}  // namespace moekit
