// The public API (include/moekit/moekit.hpp) on an SM90 GPU, with the caller's buffers: all three
// entry points against the CPU backend (same weights, same routing), nothing written past the
// batched counts, a non-default stream, CUDA-graph replays bit-identical to eager calls at
// T = 1, 8, 64, 512, the shared expert, strided rows (in place and staged), and the device error
// flag through check(); the prefill tensor-map cache across sizes and workspaces; with two or
// more GPUs, a layer on each while another is current.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "../moe_testutil.h"
#include "gpu_util.h"
#include "moekit/api/host_runner.h"
#include "sm90_testutil.h"
#include "moekit/experts/reference.h"
#include "moekit/model/synthetic.h"
#include "moekit/moekit.hpp"

namespace moekit {
namespace {

using test::random_logits;
using test::random_x;

constexpr uint16_t kPoison = 0x7fc1;

// A synthetic layer of cfg packed on the GPU and on the CPU (biases with swiglu_oai, a score bias
// with sigmoid routing).
std::unique_ptr<PackedBoth> pack_both(MoeConfig cfg, uint64_t seed, int64_t max_tokens, const std::string& gpu_backend) {
  SyntheticOptions so;
  so.seed = seed;
  so.biases = cfg.act == Activation::kSwigluOai;
  so.score_bias = cfg.scoring == Scoring::kSigmoid;
  return moekit::pack_both(make_synthetic_model(cfg, so), max_tokens, gpu_backend);
}

MoeConfig gptoss_like() {
  MoeConfig c;
  c.num_experts = 16;
  c.top_k = 4;
  c.hidden = 2880;
  c.intermediate = 1024;
  c.format = WeightFormat::kMxfp4;
  c.act = Activation::kSwigluOai;
  c.norm_topk_prob = true;
  return c;
}

TEST(ApiGpu, EntryPointsMatchTheCpuBackend) {
  for (const char* backend : {"sm90_decode", "sm90_decode_batched", "sm90_prefill", "sm90_prefill_batched"}) {
    SCOPED_TRACE(backend);
    const auto p = pack_both(gptoss_like(), 5, 64, backend);
    Layer& G = *p->gpu.layer;
    Layer& C = *p->cpu.layer;
    const LayerSpec& s = G.spec();
    for (int64_t T : {1, 3, 64}) {
      SCOPED_TRACE(T);
      const int64_t H = s.hidden, E = s.num_experts, k = s.top_k;
      const auto x = random_x(T * H, uint64_t(T));
      const auto lg = random_logits(T * E, uint64_t(T) + 1);
      test::DeviceBuffer<uint16_t> dx(x), dy(size_t(T * H));
      test::DeviceBuffer<float> dl(lg), dw(size_t(T * k));
      test::DeviceBuffer<int32_t> di(size_t(T * k));
      test::DeviceBuffer<uint8_t> ws(size_t(G.workspace_bytes(T)));
      dy.poison(0xff);
      const TensorRef X(dx.ptr, kBF16, {T, H}, {kDLCUDA, 0}), Y(dy.ptr, kBF16, {T, H}, {kDLCUDA, 0});
      const TensorRef L(dl.ptr, kF32, {T, E}, {kDLCUDA, 0}), I(di.ptr, kI32, {T, k}, {kDLCUDA, 0});
      const TensorRef W(dw.ptr, kF32, {T, k}, {kDLCUDA, 0}), WS(ws.ptr, kU8, {int64_t(ws.n)}, {kDLCUDA, 0});
      OK(G.forward_logits(X, L, Y, WS, nullptr, nullptr, &I.dl(), &W.dl()));
      OK(G.check(nullptr));
      const auto y = dy.to_host();
      auto ids = di.to_host();
      auto w = dw.to_host();
      // The CPU backend on the GPU's routing.
      std::vector<uint16_t> yc(size_t(T * H), kPoison);
      std::vector<uint8_t> wc(size_t(C.workspace_bytes(T)));
      OK(C.forward_topk(TensorRef(const_cast<uint16_t*>(x.data()), kBF16, {T, H}), TensorRef(ids.data(), kI32, {T, k}),
                        TensorRef(w.data(), kF32, {T, k}), TensorRef(yc.data(), kBF16, {T, H}),
                        TensorRef(wc.data(), kU8, {int64_t(wc.size())}), nullptr));
      EXPECT_LE(test::rel_l2_err(test::bf16_to_floats(y), test::bf16_to_floats(yc)), 1e-2);
      // forward_topk on the GPU with the same routing: the same bits as forward_logits.
      test::DeviceBuffer<uint16_t> dy2(size_t(T * H));
      dy2.poison(0xff);
      OK(G.forward_topk(X, I, W, TensorRef(dy2.ptr, kBF16, {T, H}, {kDLCUDA, 0}), WS, nullptr));
      EXPECT_EQ(dy2.to_host(), y);
    }
  }
}

// A layer on every GPU of the process, each made and run while another GPU is current: the API
// packs and runs on the layer's device (api/device.h DeviceScope), and kernel attributes are set
// per device (common/kernel_attr.h); each GPU's y equal bit for bit to GPU 0's at a decode and a
// prefill size, through the crossover's choice and each kernel forced.
TEST(ApiGpu, EveryGpuOfTheProcess) {
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  if (n < 2) GTEST_SKIP() << "one GPU: this test needs two or more";
  SyntheticOptions so;
  so.seed = 8;
  so.biases = true;
  const MoeModel model = make_synthetic_model(gptoss_like(), so);
  const HostCheckpoint ck(model);
  LayerSpec spec = model.cfg;
  spec.max_tokens = 700;
  for (const char* backend : {"sm90", "sm90_decode", "sm90_prefill"})
    for (int64_t T : {3, 700}) {
      SCOPED_TRACE(std::string(backend) + ", T = " + std::to_string(T));
      const int64_t H = spec.hidden, E = spec.num_experts;
      const auto x = random_x(T * H, uint64_t(T));
      const auto lg = random_logits(T * E, uint64_t(T) + 1);
      std::vector<uint16_t> y0;
      for (int d = 0; d < n; ++d) {
        SCOPED_TRACE("GPU " + std::to_string(d));
        const int other = (d + 1) % n;
        const DLDevice dev{kDLCUDA, d};
        ASSERT_EQ(cudaSetDevice(other), cudaSuccess);
        OwnedLayer L;
        OK(make_layer(spec, {dev, backend}, ck.tensors, &L));
        ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
        test::DeviceBuffer<uint16_t> dx(x), dy(size_t(T * H));
        test::DeviceBuffer<float> dl(lg);
        test::DeviceBuffer<uint8_t> ws(size_t(L.layer->workspace_bytes(T)));
        dy.poison(0xff);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_EQ(cudaSetDevice(other), cudaSuccess);
        OK(L.layer->forward_logits(TensorRef(dx.ptr, kBF16, {T, H}, dev), TensorRef(dl.ptr, kF32, {T, E}, dev),
                                   TensorRef(dy.ptr, kBF16, {T, H}, dev), TensorRef(ws.ptr, kU8, {int64_t(ws.n)}, dev),
                                   nullptr));
        OK(L.layer->check(nullptr));
        const auto y = dy.to_host();
        if (d == 0) {
          // GPU 0's y is written everywhere (the poison is a NaN no output can be) and not zero; the
          // values themselves are checked against the CPU by EntryPointsMatchTheCpuBackend.
          y0 = y;
          EXPECT_EQ(std::count(y.begin(), y.end(), uint16_t(0xffff)), 0) << "outputs left poisoned";
          EXPECT_GT(std::count_if(y.begin(), y.end(), [](uint16_t v) { return (v & 0x7fff) != 0; }), T * H / 2);
        } else {
          EXPECT_EQ(y, y0);
        }
      }
    }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

TEST(ApiGpu, BatchedWritesOnlyTheCountedRows) {
  for (const char* backend : {"sm90_decode", "sm90_prefill"}) {
    SCOPED_TRACE(backend);
    const auto p = pack_both(gptoss_like(), 6, 16, backend);
    Layer& G = *p->gpu.layer;
    Layer& C = *p->cpu.layer;
    const int64_t E = 16, M = 7, H = 2880;
    const std::vector<int32_t> counts = {0, 1, 7, 3, 0, 0, 2, 5, 1, 0, 4, 6, 0, 1, 2, 3};
    const auto x = random_x(E * M * H, 9);
    test::DeviceBuffer<uint16_t> dx(x), dy(size_t(E * M * H));
    test::DeviceBuffer<int32_t> dc(counts);
    test::DeviceBuffer<uint8_t> ws(size_t(G.batched_workspace_bytes(M)));
    dy.poison(0xff);
    OK(G.forward_batched(TensorRef(dx.ptr, kBF16, {E, M, H}, {kDLCUDA, 0}), TensorRef(dc.ptr, kI32, {E}, {kDLCUDA, 0}),
                         TensorRef(dy.ptr, kBF16, {E, M, H}, {kDLCUDA, 0}),
                         TensorRef(ws.ptr, kU8, {int64_t(ws.n)}, {kDLCUDA, 0}), nullptr));
    OK(G.check(nullptr));
    const auto y = dy.to_host();
    std::vector<uint16_t> yc(size_t(E * M * H), kPoison);
    std::vector<uint8_t> wc(size_t(C.batched_workspace_bytes(M)));
    std::vector<int32_t> cc = counts;
    OK(C.forward_batched(TensorRef(const_cast<uint16_t*>(x.data()), kBF16, {E, M, H}), TensorRef(cc.data(), kI32, {E}),
                         TensorRef(yc.data(), kBF16, {E, M, H}), TensorRef(wc.data(), kU8, {int64_t(wc.size())}),
                         nullptr));
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = counts[size_t(e)]; r < M; ++r)
        for (int64_t h = 0; h < H; ++h)
          ASSERT_EQ(y[size_t((e * M + r) * H + h)], 0xffff) << "expert " << e << " row " << r << " was written";
      if (counts[size_t(e)] == 0) continue;
      const auto part = [&](const std::vector<uint16_t>& v) {
        return test::bf16_to_floats(std::vector<uint16_t>(v.begin() + e * M * H, v.begin() + (e * M + counts[size_t(e)]) * H));
      };
      EXPECT_LE(test::rel_l2_err(part(y), part(yc)), 1e-2) << "expert " << e;
    }
  }
}

// Capture once on a non-default stream, replay: the same bits as an eager call, at every size
// (the crossover's backend: the decode kernel at few tokens, the prefill kernel at many).
TEST(ApiGpu, GraphReplayIsBitIdentical) {
  const auto p = pack_both(gptoss_like(), 7, 512, "sm90");
  Layer& G = *p->gpu.layer;
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int64_t T : {1, 8, 64, 512}) {
    SCOPED_TRACE(T);
    const int64_t H = 2880, E = 16;
    test::DeviceBuffer<uint16_t> dx(random_x(T * H, 20 + uint64_t(T))), de(size_t(T * H)), dg(size_t(T * H));
    test::DeviceBuffer<float> dl(random_logits(T * E, 30 + uint64_t(T)));
    test::DeviceBuffer<uint8_t> ws(size_t(G.workspace_bytes(T)));
    const DLDevice d{kDLCUDA, 0};
    const TensorRef X(dx.ptr, kBF16, {T, H}, d), L(dl.ptr, kF32, {T, E}, d), WS(ws.ptr, kU8, {int64_t(ws.n)}, d);
    OK(G.forward_logits(X, L, TensorRef(de.ptr, kBF16, {T, H}, d), WS, s));
    CUDA_OK(cudaStreamSynchronize(s));
    Status st;
    test::graph_replay(s, [&] { st = G.forward_logits(X, L, TensorRef(dg.ptr, kBF16, {T, H}, d), WS, s); },
                       [&] { dg.poison(0xff); });
    ASSERT_TRUE(st.ok()) << st.message;
    EXPECT_EQ(dg.to_host(), de.to_host());
  }
  cudaStreamDestroy(s);
}

// The prefill GEMMs' tensor maps are cached per layer by (buffer, rows, columns): calls of many
// sizes on two workspaces, more shapes than the cache holds, each the same bits as the layer's
// first call of that size; the workspace a call does not use is poisoned first, so that a map
// left pointing into it would show as NaN rows.
TEST(ApiGpu, PrefillTensorMapsFollowEveryCall) {
  const auto p = pack_both(gptoss_like(), 9, 64, "sm90_prefill");
  Layer& G = *p->gpu.layer;
  const int64_t H = 2880, E = 16;
  const DLDevice d{kDLCUDA, 0};
  test::DeviceBuffer<uint8_t> wa(size_t(G.workspace_bytes(64))), wb(size_t(G.workspace_bytes(64)));
  const std::vector<int64_t> sizes = {3, 8, 17, 30, 41, 50, 64};
  std::vector<std::vector<uint16_t>> xs, ref;
  std::vector<std::vector<float>> lgs;
  for (int64_t T : sizes) {
    xs.push_back(random_x(T * H, 40 + uint64_t(T)));
    lgs.push_back(random_logits(T * E, 50 + uint64_t(T)));
  }
  auto run = [&](size_t i, test::DeviceBuffer<uint8_t>& ws, test::DeviceBuffer<uint8_t>& other) {
    const int64_t T = sizes[i];
    test::DeviceBuffer<uint16_t> dx(xs[i]), dy(size_t(T * H));
    test::DeviceBuffer<float> dl(lgs[i]);
    other.poison(0xff);
    dy.poison(0xff);
    const Status st = G.forward_logits(TensorRef(dx.ptr, kBF16, {T, H}, d), TensorRef(dl.ptr, kF32, {T, E}, d),
                                       TensorRef(dy.ptr, kBF16, {T, H}, d),
                                       TensorRef(ws.ptr, kU8, {int64_t(ws.n)}, d), nullptr);
    EXPECT_TRUE(st.ok()) << st.message;
    return dy.to_host();
  };
  for (size_t i = 0; i < sizes.size(); ++i) ref.push_back(run(i, wa, wb));
  // 7 sizes x 2 workspaces = 14 call shapes, 28 maps through a cache of 8, in an order that
  // returns to earlier shapes after others replaced them, and repeats some back to back.
  const size_t order[] = {0, 1, 0, 2, 3, 4, 5, 6, 0, 6, 6, 1, 3, 5, 2, 4, 0};
  int n = 0;
  for (size_t i : order) {
    for (int w = 0; w < 2; ++w) {
      SCOPED_TRACE(testing::Message() << "T " << sizes[i] << " workspace " << (w ? "b" : "a") << " call " << n++);
      const auto y = w ? run(i, wb, wa) : run(i, wa, wb);
      ASSERT_TRUE(y == ref[i]);  // (not ASSERT_EQ: 184 k values would be printed)
    }
  }
}

// The shared expert's rows added before the rounding; x and out as windows of wider rows; H not
// a multiple of 64 (x staged); an out-of-range id reported by check().
TEST(ApiGpu, SharedStridedStagedAndTheErrorFlag) {
  MoeConfig c = gptoss_like();
  c.hidden = 1056;  // 16.5 x 64: staged
  c.format = WeightFormat::kBf16;
  const auto p = pack_both(c, 8, 16, "sm90_decode");
  Layer& G = *p->gpu.layer;
  Layer& C = *p->cpu.layer;
  const int64_t T = 5, H = c.hidden, E = c.num_experts, k = c.top_k, P = H + 64;
  const auto xw = random_x(T * P, 41);
  const auto sh = random_x(T * H, 42);
  const auto lg = random_logits(T * E, 43);
  test::DeviceBuffer<uint16_t> dx(xw), dsh(sh), dy(size_t(T * 2 * H));
  test::DeviceBuffer<float> dl(lg), dw(size_t(T * k));
  test::DeviceBuffer<int32_t> di(size_t(T * k));
  test::DeviceBuffer<uint8_t> ws(size_t(G.workspace_bytes(T)));
  dy.poison(0xff);
  const DLDevice d{kDLCUDA, 0};
  const TensorRef X(dx.ptr + 32, kBF16, {T, H}, d, {P, 1}), Y(dy.ptr + H, kBF16, {T, H}, d, {2 * H, 1});
  const TensorRef SH(dsh.ptr, kBF16, {T, H}, d), I(di.ptr, kI32, {T, k}, d), W(dw.ptr, kF32, {T, k}, d);
  const TensorRef WS(ws.ptr, kU8, {int64_t(ws.n)}, d);
  OK(G.forward_logits(X, TensorRef(dl.ptr, kF32, {T, E}, d), Y, WS, nullptr, &SH.dl(), &I.dl(), &W.dl()));
  OK(G.check(nullptr));
  const auto y = dy.to_host();
  auto ids = di.to_host();
  auto w = dw.to_host();
  std::vector<uint16_t> x(size_t(T * H)), yg(size_t(T * H)), yc(size_t(T * H));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      x[size_t(t * H + h)] = xw[size_t(t * P + 32 + h)];
      yg[size_t(t * H + h)] = y[size_t(t * 2 * H + H + h)];
      ASSERT_EQ(y[size_t(t * 2 * H + h)], 0xffff) << "wrote outside out's window";
    }
  std::vector<uint8_t> wc(size_t(C.workspace_bytes(T)));
  auto shc = sh;
  OK(C.forward_topk(TensorRef(x.data(), kBF16, {T, H}), TensorRef(ids.data(), kI32, {T, k}),
                    TensorRef(w.data(), kF32, {T, k}), TensorRef(yc.data(), kBF16, {T, H}),
                    TensorRef(wc.data(), kU8, {int64_t(wc.size())}), nullptr, &TensorRef(shc.data(), kBF16, {T, H}).dl()));
  EXPECT_LE(test::rel_l2_err(test::bf16_to_floats(yg), test::bf16_to_floats(yc)), 1e-2);
  // An id out of range: skipped on the device, reported by check().
  ids[1] = int32_t(E);
  test::DeviceBuffer<int32_t> bad(ids);
  OK(G.forward_topk(X, TensorRef(bad.ptr, kI32, {T, k}, d), W, Y, WS, nullptr));
  const Status st = G.check(nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message.find("out of range"), std::string::npos) << st.message;
}

}  // namespace
}  // namespace moekit
