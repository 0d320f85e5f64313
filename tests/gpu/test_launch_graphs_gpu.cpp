// Eager calls replayed as cached graphs (pipeline/launch_sm90.cuh): the same bits as the same
// calls launched kernel by kernel ($MOEKIT_LAUNCH_GRAPHS=0), for a sequence that changes the
// token count, the buffers, the kernel (decode, prefill) and the entry point, issued back to back
// without a sync (a node updated while the graph's previous launch may still run), the fused
// routing back and forth between one CTA and clusters of 2 and 4 (a graph each); a repeated
// call updates no node, a call that changes only y updates one (finalize); a call on a stream
// the caller is capturing goes into the caller's graph kernel by kernel.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "gpu_util.h"
#include "sm90_testutil.h"

namespace moekit {
namespace {

// A layer built with $MOEKIT_LAUNCH_GRAPHS set to `graphs` (read when the layer is made).
std::unique_ptr<Sm90Layer> make(const MoeModel& m, ActivationFormat fmt, bool graphs, int64_t max_T) {
  const char* old = std::getenv("MOEKIT_LAUNCH_GRAPHS");
  const std::string keep = old ? old : "";
  setenv("MOEKIT_LAUNCH_GRAPHS", graphs ? "1" : "0", 1);
  auto l = std::make_unique<Sm90Layer>(m, fmt);
  if (old) setenv("MOEKIT_LAUNCH_GRAPHS", keep.c_str(), 1);
  else unsetenv("MOEKIT_LAUNCH_GRAPHS");
  l->reserve(max_T, m.cfg.top_k);
  l->set_prefill_from(256);
  return l;
}

struct Call {
  ForwardCall::Entry entry;
  int64_t T;
  int x, y;  // which input / output buffer
};

TEST(LaunchGraphs, EagerReplaysMatchDirectLaunches) {
  const MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSwigluOai, 16, 4, 2880, 1024);
  const MoeModel m = synthetic_model(cfg, 31, true);
  const int64_t H = cfg.hidden, E = cfg.num_experts, k = cfg.top_k, Tmax = 512;
  auto graph_layer = make(m, ActivationFormat::kStandard, true, Tmax);
  auto direct_layer = make(m, ActivationFormat::kStandard, false, Tmax);
  ASSERT_TRUE(graph_layer->prefill_supported());

  // Inputs: 3 x / logits sets, top-k ids and weights for the bypass entry; outputs per call.
  std::vector<std::unique_ptr<test::DeviceBuffer<uint16_t>>> xs;
  std::vector<std::unique_ptr<test::DeviceBuffer<float>>> ls;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(std::make_unique<test::DeviceBuffer<uint16_t>>(test::random_x(Tmax * H, 100 + uint64_t(i))));
    ls.push_back(std::make_unique<test::DeviceBuffer<float>>(test::random_logits(Tmax * E, 200 + uint64_t(i))));
  }
  std::vector<int32_t> hid(size_t(64 * k));
  std::vector<float> hw(size_t(64 * k));
  for (int64_t t = 0; t < 64; ++t)
    for (int64_t j = 0; j < k; ++j) {
      hid[size_t(t * k + j)] = int32_t((t * 7 + j * 5) % E);
      hw[size_t(t * k + j)] = 0.25f + 0.01f * float(j);
    }
  test::DeviceBuffer<int32_t> ids(hid);
  test::DeviceBuffer<float> wts(hw);
  const std::vector<Call> calls = {
      {ForwardCall::kLogits, 1, 0, 0},   {ForwardCall::kLogits, 1, 0, 1},   {ForwardCall::kLogits, 1, 0, 2},
      {ForwardCall::kLogits, 3, 1, 3},   {ForwardCall::kLogits, 118, 2, 4}, {ForwardCall::kLogits, 512, 0, 5},
      {ForwardCall::kLogits, 118, 2, 6}, {ForwardCall::kLogits, 0, 1, 7},   {ForwardCall::kTopk, 64, 1, 8},
      {ForwardCall::kLogits, 1, 1, 9},   {ForwardCall::kLogits, 300, 2, 10}, {ForwardCall::kLogits, 1, 1, 11},
      {ForwardCall::kLogits, 200, 0, 12}, {ForwardCall::kLogits, 118, 1, 13}, {ForwardCall::kLogits, 3, 2, 14}};
  const int kOut = 15;

  struct Run {
    std::vector<std::unique_ptr<test::DeviceBuffer<uint16_t>>> ys;
    std::unique_ptr<test::DeviceBuffer<uint8_t>> ws;
  };
  auto prepare = [&](Sm90Layer& L, Run* r) {
    for (int i = 0; i < kOut; ++i) {
      r->ys.push_back(std::make_unique<test::DeviceBuffer<uint16_t>>(size_t(Tmax * H)));
      r->ys.back()->poison(0xff);
    }
    r->ws = std::make_unique<test::DeviceBuffer<uint8_t>>(
        size_t(std::max(L.workspace_bytes(ForwardCall::kLogits, Tmax, int(k)),
                        L.workspace_bytes(ForwardCall::kTopk, Tmax, int(k)))));
  };
  auto call = [&](Sm90Layer& L, Run& r, const Call& c, cudaStream_t s) {
    ForwardCall f;
    f.entry = c.entry;
    f.T = c.T;
    f.k = int(k);
    f.x = xs[size_t(c.x)]->ptr;
    f.x_stride = H;
    if (c.entry == ForwardCall::kLogits) {
      f.logits = ls[size_t(c.x)]->ptr;
    } else {
      f.ids = ids.ptr;
      f.weights = wts.ptr;
    }
    f.y = r.ys[size_t(c.y)]->ptr;
    f.y_stride = H;
    f.workspace = r.ws->ptr;
    f.stream = s;
    L.enqueue(f);
  };
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  Run ref, got;
  prepare(*direct_layer, &ref);
  prepare(*graph_layer, &got);
  CUDA_OK(cudaDeviceSynchronize());
  for (const Call& c : calls) call(*direct_layer, ref, c, s);
  CUDA_OK(cudaStreamSynchronize(s));
  EXPECT_EQ(direct_layer->launch_stats().graph_launches, 0);
  EXPECT_EQ(direct_layer->launch_stats().direct, long(calls.size()) - 1);  // T = 0 launches nothing

  // The first three calls one at a time, to see what each one updates.
  using Stats = Sm90Layer::LaunchStats;
  call(*graph_layer, got, calls[0], s);
  const Stats a = graph_layer->launch_stats();
  EXPECT_EQ(a.builds, 1);
  EXPECT_EQ(a.graph_launches, 1);
  call(*graph_layer, got, calls[1], s);  // the same call again (its own output buffer: y 1)
  auto which = [](const Stats& st) {
    std::string w;
    for (int i = 0; i < 12; ++i)
      if (st.last_updated >> i & 1) w += " launch " + std::to_string(i) + " (byte " + std::to_string(st.first_diff[i]) + ")";
    return w;
  };
  const Stats b = graph_layer->launch_stats();
  EXPECT_EQ(b.node_updates - a.node_updates, 1) << "only finalize's y changed; updated:" << which(b);
  EXPECT_EQ(b.last_updated, 1u << 2) << "finalize is the third launch; updated:" << which(b);
  call(*graph_layer, got, calls[1], s);
  const Stats b2 = graph_layer->launch_stats();
  EXPECT_EQ(b2.node_updates - b.node_updates, 0) << "a repeated call updates nothing; updated:" << which(b2);
  EXPECT_EQ(b2.graph_launches - b.graph_launches, 1);
  // The rest back to back (no sync between calls).
  for (size_t i = 2; i < calls.size(); ++i) call(*graph_layer, got, calls[i], s);
  CUDA_OK(cudaStreamSynchronize(s));
  const Stats z = graph_layer->launch_stats();
  EXPECT_EQ(z.direct, 0);
  EXPECT_EQ(z.graph_launches, long(calls.size()));  // every call but T = 0, one repeated
  // The routing of 16 experts, k = 4 (route_plan_fused): one CTA up to 96 tokens, a cluster of
  // 2 CTAs at 118 tokens, of 4 at 200; 300 and 512 tokens (over 1024 entries) take the older
  // kernels. A graph's node never changes between kernels of other cluster dimensions (it
  // keeps the cluster shape it was captured with): one graph per cluster size of the decode
  // calls (both entries), one for the prefill calls.
  const char* rp = std::getenv("MOEKIT_ROUTE_PLAN");
  if (!(rp && std::string(rp) == "legacy"))
    EXPECT_EQ(z.builds, 4) << "decode calls with a routing of 1, 2 and 4 CTAs, and the prefill calls";
  for (int i = 0; i < kOut; ++i) {
    SCOPED_TRACE("output " + std::to_string(i));
    ASSERT_TRUE(got.ys[size_t(i)]->to_host() == ref.ys[size_t(i)]->to_host());
  }

  // On a stream the caller captures: launched kernel by kernel into the caller's graph.
  cudaStream_t cs;
  CUDA_OK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  got.ys[3]->poison(0xff);
  CUDA_OK(cudaDeviceSynchronize());
  cudaGraph_t g;
  CUDA_OK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal));
  call(*graph_layer, got, calls[3], cs);
  CUDA_OK(cudaStreamEndCapture(cs, &g));
  EXPECT_EQ(graph_layer->launch_stats().direct, 1);
  cudaGraphExec_t x;
  CUDA_OK(cudaGraphInstantiate(&x, g, 0));
  CUDA_OK(cudaGraphLaunch(x, cs));
  CUDA_OK(cudaStreamSynchronize(cs));
  EXPECT_TRUE(got.ys[3]->to_host() == ref.ys[3]->to_host());
  cudaGraphExecDestroy(x);
  cudaGraphDestroy(g);
  cudaStreamDestroy(cs);
  cudaStreamDestroy(s);
}

// The batched entry (per-expert counts): calls with other counts and rows back to back.
TEST(LaunchGraphs, BatchedEntryMatchesDirectLaunches) {
  const MoeConfig cfg = small_config(WeightFormat::kMxfp4, Activation::kSwigluOai, 16, 4, 2880, 1024);
  const MoeModel m = synthetic_model(cfg, 32, true);
  const int64_t H = cfg.hidden, E = cfg.num_experts, Mmax = 300;
  auto graph_layer = make(m, ActivationFormat::kBatched, true, Mmax);
  auto direct_layer = make(m, ActivationFormat::kBatched, false, Mmax);
  test::DeviceBuffer<uint16_t> x(test::random_x(E * Mmax * H, 300));
  struct B {
    int64_t M;
    std::vector<int32_t> counts;
  };
  std::vector<B> cases = {{8, {}}, {8, {}}, {300, {}}, {1, {}}};
  for (size_t i = 0; i < cases.size(); ++i)
    for (int64_t e = 0; e < E; ++e) cases[i].counts.push_back(int32_t((e * 3 + int64_t(i) * 5) % (cases[i].M + 1)));
  cases[3].counts.assign(size_t(E), 0);
  cases[3].counts[5] = 1;
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto run = [&](Sm90Layer& L, std::vector<std::vector<uint16_t>>* out) {
    std::vector<std::unique_ptr<test::DeviceBuffer<uint16_t>>> ys;
    std::vector<std::unique_ptr<test::DeviceBuffer<int32_t>>> cs;
    test::DeviceBuffer<uint8_t> ws(size_t(L.workspace_bytes(ForwardCall::kBatched, Mmax, 1)));
    for (const B& b : cases) {
      ys.push_back(std::make_unique<test::DeviceBuffer<uint16_t>>(size_t(E * b.M * H)));
      ys.back()->poison(0xff);
      cs.push_back(std::make_unique<test::DeviceBuffer<int32_t>>(b.counts));
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < cases.size(); ++i) {
      ForwardCall f;
      f.entry = ForwardCall::kBatched;
      f.T = cases[i].M;
      f.k = 1;
      f.x = x.ptr;
      f.x_stride = H;
      f.x_expert_stride = cases[i].M * H;
      f.counts = cs[i]->ptr;
      f.y = ys[i]->ptr;
      f.y_stride = H;
      f.y_expert_stride = cases[i].M * H;
      f.workspace = ws.ptr;
      f.stream = s;
      L.enqueue(f);
    }
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    for (auto& y : ys) out->push_back(y->to_host());
  };
  std::vector<std::vector<uint16_t>> ref, got;
  run(*direct_layer, &ref);
  run(*graph_layer, &got);
  EXPECT_EQ(graph_layer->launch_stats().graph_launches, long(cases.size()));
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_TRUE(got[i] == ref[i]) << "case " << i;
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace moekit
