// The SM90 layer with fp8 activations (LayerSpec::activation_dtype = fp8, issue 49): the sm90 and
// sm90_batched backends run every call through the FP8 chain (quantize where rows are permuted,
// FP8 GEMM1, quantize, FP8 GEMM2, finalize; experts/sm90_fp8_chain.cuh), checked against the CPU
// backend's fp8 layer on the same data and ids: MXFP4 and MXFP8 weights, both scale kinds, biases,
// swiglu_oai / silu_clamped / silu, T = 0, 1, 3, -1 ids, a token with no expert, empty experts,
// every token on one expert (several token tiles), the routed, top-k and batched entries through
// the public API with poisoned outputs, and CUDA-graph replays. Refusals on the device: NVFP4 and
// BF16 weights, the backends that pin a bf16 kernel.
//
// Tolerances: FP8Chain's (test_fp8_chain_gpu.cpp, whose comments explain them): the GPU's FP8
// wgmma adds within a 128-K group with a ~13-bit-fraction accumulator, which moves 0.8-2% of the
// intermediate's E4M3 codes to their other neighbour; GPU vs CPU is ~3e-3 rel-L2 of y (H200), the
// bound 1e-2. Bit-exact where no rounding can differ: sm90 against sm90_batched (the same rows,
// the same tiles) and against the hand-made chain of FP8Chain (test::run_fp8_chain, the same
// kernels on a host plan), and the batched entry against forward_topk of each row alone.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fp8_chain.h"
#include "gpu_util.h"
#include "moekit/common/error.h"
#include "moekit/common/spec.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/moekit.hpp"
#include "sm90_testutil.h"

namespace moekit {
namespace {

constexpr double kChainTol = 1e-2;       // rel-L2 of y, GPU vs CPU (FP8Chain's)
constexpr uint16_t kPoison = 0xffff;     // a bf16 NaN no output can be
constexpr const char* kFp8Backends[] = {"sm90", "sm90_batched"};

struct Shape {
  const char* name;
  WeightFormat f;
  Activation act;
  int E, k, H, I;
  bool biases;
};

// GPT-OSS's H and activation with biases; DeepSeek-V4's clamped SiLU (MXFP4, ue8m0 is its
// format); MXFP8 with K % 128 = 64 on both GEMMs (H 320, I 192) and padding to 64 (H 224 -> 256).
const Shape kShapes[] = {
    {"gpt-oss H, mxfp4, swiglu_oai, biases", WeightFormat::kMxfp4, Activation::kSwigluOai, 8, 4, 2880, 1024, true},
    {"mxfp4, silu_clamped", WeightFormat::kMxfp4, Activation::kSiluClamped, 16, 6, 1024, 384, false},
    {"mxfp8, swiglu_oai, biases, K % 128", WeightFormat::kMxfp8, Activation::kSwigluOai, 8, 2, 320, 192, true},
    {"mxfp8, silu_clamped, H 224", WeightFormat::kMxfp8, Activation::kSiluClamped, 6, 3, 224, 128, true},
};

MoeModel fp8_model(const Shape& s, ActivationScale rule, uint64_t seed) {
  MoeConfig c = small_config(s.f, s.act, s.E, s.k, s.H, s.I);
  c.activation_dtype = ActivationDtype::kFp8;
  c.activation_scale = rule;
  return synthetic_model(c, seed, s.biases);
}

std::string what(const Shape& s, ActivationScale rule) {
  return std::string(s.name) + ", " + activation_scale_name(rule) + " scales";
}

// Bypass inputs: the id patterns of the tests (k distinct experts per token: the layer refuses
// a token that lists one twice).
struct Pattern {
  const char* name;
  int64_t T;
  std::function<int32_t(int64_t t, int j, int E)> id;
};
// Random distinct experts, one slot in 8 empty, expert E - 1 never chosen (an empty expert),
// token 1 without any expert.
int32_t random_id(int64_t t, int j, int E) {
  std::mt19937_64 rng(uint64_t(t) * 131 + 7);
  std::vector<int32_t> e(size_t(E - 1));
  for (int i = 0; i < E - 1; ++i) e[size_t(i)] = i;
  std::shuffle(e.begin(), e.end(), rng);
  std::mt19937_64 drop(uint64_t(t) * 977 + uint64_t(j));
  if (t == 1 || drop() % 8 == 0) return -1;
  return j < E - 1 ? e[size_t(j)] : -1;
}
const Pattern kPatterns[] = {
    {"T 1", 1, [](int64_t, int j, int E) { return j == 0 ? int32_t(E / 2) : -1; }},
    {"T 3", 3, [](int64_t t, int j, int E) { return t == 1 ? -1 : random_id(t + 100, j, E); }},
    {"T 37, -1 ids, token 1 empty, expert E-1 empty", 37, random_id},
    {"T 300 on one expert (3 token tiles)", 300, [](int64_t, int j, int) { return j == 0 ? 2 : -1; }},
};

// y of `backend` on in (public API: HostRunner poisons y first and fails on an unwritten row).
LayerOutput run_on(const char* backend, const MoeModel& m, const LayerInputData& in) {
  return run_backend(backend, m, in.view());
}

// Both fp8 backends against the CPU backend on one input; returns sm90's y.
std::vector<uint16_t> check_case(const MoeModel& m, const LayerInputData& in, const std::string& label) {
  const LayerOutput cpu = run_on("cpu", m, in);
  std::vector<uint16_t> y0;
  for (const char* b : kFp8Backends) {
    SCOPED_TRACE(b);
    const LayerOutput g = run_on(b, m, in);
    EXPECT_EQ(g.y.size(), cpu.y.size());
    if (g.y.size() != cpu.y.size()) continue;
    EXPECT_EQ(std::count_if(g.y.begin(), g.y.end(), [](uint16_t v) { return std::isnan(bf16_to_float(v)); }), 0)
        << "NaN in y";
    const double err = test::rel_l2_err(to_f32(g.y), to_f32(cpu.y));
    EXPECT_LE(err, kChainTol);
    std::printf("  %-58s %-13s rel-L2 gpu vs cpu %.3e\n", label.c_str(), b, err);
    testing::Test::RecordProperty(label + " " + b + " gpu_vs_cpu", test::fmt_e(err));
    // The standard and the batched format hold the same rows in the same tiles: the same bits.
    if (y0.empty()) y0 = g.y;
    else EXPECT_TRUE(g.y == y0) << "sm90_batched differs from sm90";
  }
  return y0;
}

// Every shape x scale kind x id pattern through the top-k entry (the ids given), against the
// CPU; sm90's y also against the hand-made chain of FP8Chain (the same kernels on a host plan).
TEST(Sm90Fp8Layer, AgainstCpuLayer) {
  NEED_SM90();
  uint64_t seed = 4900;
  for (const Shape& s : kShapes)
    for (ActivationScale rule : {ActivationScale::kFp32, ActivationScale::kUe8m0}) {
      const MoeModel m = fp8_model(s, rule, ++seed);
      const sm90::ConvertedMatrix w13 = sm90::convert_w13(m), w2 = sm90::convert_w2(m);
      for (const Pattern& p : kPatterns) {
        const std::string label = what(s, rule) + ", " + p.name;
        SCOPED_TRACE(label);
        const LayerInputData in = bypass_input(m.cfg, p.T, s.k, seed + uint64_t(p.T),
                                               [&](int64_t t, int j) { return p.id(t, j, s.E); });
        const std::vector<uint16_t> y = check_case(m, in, label);
        test::Fp8ChainIn ci;
        ci.w13 = &w13, ci.w2 = &w2;
        ci.x = in.x.data(), ci.ids = in.ids.data(), ci.weights = in.weights.data();
        ci.T = p.T, ci.H = s.H, ci.I = s.I, ci.k = s.k, ci.E = s.E;
        ci.act = activation_params(m.cfg);
        ci.rule = rule;
        std::vector<uint16_t> chain;
        ASSERT_EQ(test::run_fp8_chain(ci, &chain), "");
        EXPECT_TRUE(chain == y) << "the layer's y is not the FP8 chain's";
      }
    }
}

// No tokens: nothing launched, nothing written, on both backends.
TEST(Sm90Fp8Layer, NoTokens) {
  NEED_SM90();
  const MoeModel m = fp8_model(kShapes[0], ActivationScale::kUe8m0, 1);
  const LayerInputData in = make_synthetic_input(m.cfg, 0, 2);
  for (const char* b : kFp8Backends) EXPECT_TRUE(run_on(b, m, in).y.empty()) << b;
}

// The routed entry (router logits): the GPU's routing, the CPU on the GPU's ids.
TEST(Sm90Fp8Layer, RoutedEntry) {
  NEED_SM90();
  for (const Shape& s : {kShapes[0], kShapes[2]})
    for (int64_t T : {1, 3, 64}) {
      const MoeModel m = fp8_model(s, ActivationScale::kFp32, 77);
      const LayerInputData in = make_synthetic_input(m.cfg, T, uint64_t(T) + 5);
      const std::string label = what(s, ActivationScale::kFp32) + ", routed, T " + std::to_string(T);
      SCOPED_TRACE(label);
      const LayerOutput g = run_on("sm90", m, in);
      const LayerOutput cpu = run_on("cpu", m, with_ids(in, g, s.k));
      expect_same_id_sets(g.ids, run_on("cpu", m, in).ids, T, s.k);
      EXPECT_LE(test::rel_l2_err(to_f32(g.y), to_f32(cpu.y)), kChainTol);
      EXPECT_TRUE(run_on("sm90_batched", m, in).y == g.y);
    }
}

// ---- the public API with the caller's buffers -----------------------------------------------------

std::unique_ptr<PackedBoth> pack_fp8(const Shape& s, ActivationScale rule, int64_t max_tokens, const char* backend) {
  return pack_both(fp8_model(s, rule, 31), max_tokens, backend);
}

// forward_batched: rows [0, counts[e]) of each expert (0, 1, full, an empty expert at the end),
// the rest of y never written; each counted row the bits of forward_topk of that row alone (its
// expert, weight 1), and all against the CPU's forward_batched. Rows past the counts hold NaN:
// never read as data.
TEST(Sm90Fp8Layer, BatchedEntry) {
  NEED_SM90();
  for (const Shape& s : {kShapes[0], kShapes[2]})
    for (ActivationScale rule : {ActivationScale::kFp32, ActivationScale::kUe8m0})
      for (const char* backend : kFp8Backends) {
        SCOPED_TRACE(what(s, rule) + ", " + backend);
        const auto p = pack_fp8(s, rule, 16, backend);
        Layer& G = *p->gpu.layer;
        Layer& C = *p->cpu.layer;
        const int64_t E = s.E, M = 7, H = s.H;
        std::vector<int32_t> counts(size_t(E), 0);
        for (int64_t e = 0; e < E - 1; ++e) counts[size_t(e)] = int32_t((e * 3) % (M + 1));  // 0 .. M
        auto x = test::random_x(E * M * H, 9);
        for (int64_t e = 0; e < E; ++e)
          for (int64_t r = counts[size_t(e)]; r < M; ++r)
            std::fill_n(x.begin() + (e * M + r) * H, H, uint16_t(0x7fc0));  // garbage rows: NaN
        const DLDevice d{kDLCUDA, 0};
        test::DeviceBuffer<uint16_t> dx(x), dy(size_t(E * M * H));
        test::DeviceBuffer<int32_t> dc(counts);
        test::DeviceBuffer<uint8_t> ws(size_t(G.batched_workspace_bytes(M)));
        ws.poison(0xff);
        dy.poison(0xff);
        OK(G.forward_batched(TensorRef(dx.ptr, kBF16, {E, M, H}, d), TensorRef(dc.ptr, kI32, {E}, d),
                             TensorRef(dy.ptr, kBF16, {E, M, H}, d), TensorRef(ws.ptr, kU8, {int64_t(ws.n)}, d),
                             nullptr));
        OK(G.check(nullptr));
        const auto y = dy.to_host();
        std::vector<uint16_t> yc(size_t(E * M * H), kPoison);
        std::vector<uint8_t> wc(size_t(C.batched_workspace_bytes(M)));
        std::vector<int32_t> cc = counts;
        OK(C.forward_batched(TensorRef(x.data(), kBF16, {E, M, H}), TensorRef(cc.data(), kI32, {E}),
                             TensorRef(yc.data(), kBF16, {E, M, H}), TensorRef(wc.data(), kU8, {int64_t(wc.size())}),
                             nullptr));
        std::vector<float> got, want;
        for (int64_t e = 0; e < E; ++e) {
          const int64_t n = counts[size_t(e)];
          for (int64_t i = n * H; i < M * H; ++i)
            ASSERT_EQ(y[size_t(e * M * H + i)], kPoison) << "expert " << e << ": a row past its count was written";
          if (n == 0) continue;
          for (int64_t i = 0; i < n * H; ++i) {
            got.push_back(bf16_to_float(y[size_t(e * M * H + i)]));
            want.push_back(bf16_to_float(yc[size_t(e * M * H + i)]));
            ASSERT_FALSE(std::isnan(got.back())) << "expert " << e << " row " << i / H;
          }
          // The same rows through forward_topk, each alone on expert e with weight 1.
          const int k = s.k;
          std::vector<int32_t> ids(size_t(n * k), -1);
          std::vector<float> w(size_t(n * k), 0.0f);
          for (int64_t r = 0; r < n; ++r) ids[size_t(r * k)] = int32_t(e), w[size_t(r * k)] = 1.0f;
          test::DeviceBuffer<uint16_t> tx(std::vector<uint16_t>(x.begin() + e * M * H, x.begin() + (e * M + n) * H));
          test::DeviceBuffer<int32_t> ti(ids);
          test::DeviceBuffer<float> tw(w);
          test::DeviceBuffer<uint16_t> ty(size_t(n * H));
          test::DeviceBuffer<uint8_t> tws(size_t(G.workspace_bytes(n, k)));
          ty.poison(0xff);
          OK(G.forward_topk(TensorRef(tx.ptr, kBF16, {n, H}, d), TensorRef(ti.ptr, kI32, {n, k}, d),
                            TensorRef(tw.ptr, kF32, {n, k}, d), TensorRef(ty.ptr, kBF16, {n, H}, d),
                            TensorRef(tws.ptr, kU8, {int64_t(tws.n)}, d), nullptr));
          const auto yt = ty.to_host();
          EXPECT_TRUE(std::equal(yt.begin(), yt.end(), y.begin() + e * M * H)) << "expert " << e;
        }
        EXPECT_LE(test::rel_l2_err(got, want), kChainTol);
      }
}

// Captured once per size on a non-default stream, replayed three times over a poisoned y: the
// bits of an eager call (the routed and the batched entry). A capture fails if the layer
// allocated or synchronized during the call.
TEST(Sm90Fp8Layer, GraphReplayIsBitIdentical) {
  NEED_SM90();
  const Shape& s = kShapes[0];
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (const char* backend : kFp8Backends) {
    SCOPED_TRACE(backend);
    const auto p = pack_fp8(s, ActivationScale::kUe8m0, 256, backend);
    Layer& G = *p->gpu.layer;
    const DLDevice d{kDLCUDA, 0};
    const int64_t H = s.H, E = s.E;
    // written_all: every element of y is an output (the routed entry); else rows past the counts
    // stay poisoned in both runs (the batched entry), and the buffers are compared whole.
    auto replay = [&](const std::function<Status(uint16_t*)>& call, test::DeviceBuffer<uint16_t>& eager,
                      test::DeviceBuffer<uint16_t>& graphed, bool written_all) {
      eager.poison(0xff);
      OK(call(eager.ptr));
      CUDA_OK(cudaStreamSynchronize(st));
      Status r;
      test::graph_replay(st, [&] { r = call(graphed.ptr); }, [&] { graphed.poison(0xff); });
      ASSERT_TRUE(r.ok()) << r.message;
      const auto a = eager.to_host(), b = graphed.to_host();
      EXPECT_TRUE(a == b);
      if (written_all) {
        EXPECT_EQ(std::count(a.begin(), a.end(), kPoison), 0) << "outputs left poisoned";
      }
    };
    for (int64_t T : {1, 3, 64, 256}) {
      SCOPED_TRACE("routed, T " + std::to_string(T));
      test::DeviceBuffer<uint16_t> dx(test::random_x(T * H, 20 + uint64_t(T))), de(size_t(T * H)), dg(size_t(T * H));
      test::DeviceBuffer<float> dl(test::random_logits(T * E, 30 + uint64_t(T)));
      test::DeviceBuffer<uint8_t> ws(size_t(G.workspace_bytes(T)));
      const TensorRef X(dx.ptr, kBF16, {T, H}, d), L(dl.ptr, kF32, {T, E}, d), WS(ws.ptr, kU8, {int64_t(ws.n)}, d);
      replay([&](uint16_t* y) { return G.forward_logits(X, L, TensorRef(y, kBF16, {T, H}, d), WS, st); }, de, dg,
             true);
    }
    SCOPED_TRACE("batched entry");
    const int64_t M = 5;
    std::vector<int32_t> counts(size_t(E), 0);
    for (int64_t e = 0; e < E; e += 2) counts[size_t(e)] = int32_t(1 + e % M);
    test::DeviceBuffer<uint16_t> dx(test::random_x(E * M * H, 3)), de(size_t(E * M * H)), dg(size_t(E * M * H));
    test::DeviceBuffer<int32_t> dc(counts);
    test::DeviceBuffer<uint8_t> ws(size_t(G.batched_workspace_bytes(M)));
    const TensorRef X(dx.ptr, kBF16, {E, M, H}, d), C(dc.ptr, kI32, {E}, d), WS(ws.ptr, kU8, {int64_t(ws.n)}, d);
    replay([&](uint16_t* y) { return G.forward_batched(X, C, TensorRef(y, kBF16, {E, M, H}, d), WS, st); }, de, dg,
           false);
  }
  cudaStreamDestroy(st);
}

// For compute-sanitizer (scripts/gpu_check.sh fp8): a small layer on both backends, through the
// top-k entry (-1 ids, an empty expert) and the batched entry.
TEST(FP8Sanitize, Layer) {
  NEED_SM90();
  const Shape& s = kShapes[2];
  const MoeModel m = fp8_model(s, ActivationScale::kFp32, 5);
  const Pattern& p = kPatterns[1];
  check_case(m, bypass_input(m.cfg, p.T, s.k, 6, [&](int64_t t, int j) { return p.id(t, j, s.E); }), "sanitize layer");
  const auto pk = pack_fp8(s, ActivationScale::kUe8m0, 4, "sm90_batched");
  const int64_t E = s.E, M = 3, H = s.H;
  std::vector<int32_t> counts(size_t(E), 0);
  counts[0] = 3, counts[2] = 1;
  const DLDevice d{kDLCUDA, 0};
  test::DeviceBuffer<uint16_t> dx(test::random_x(E * M * H, 7)), dy(size_t(E * M * H));
  test::DeviceBuffer<int32_t> dc(counts);
  test::DeviceBuffer<uint8_t> ws(size_t(pk->gpu.layer->batched_workspace_bytes(M)));
  OK(pk->gpu.layer->forward_batched(TensorRef(dx.ptr, kBF16, {E, M, H}, d), TensorRef(dc.ptr, kI32, {E}, d),
                                    TensorRef(dy.ptr, kBF16, {E, M, H}, d), TensorRef(ws.ptr, kU8, {int64_t(ws.n)}, d),
                                    nullptr));
  OK(pk->gpu.layer->check(nullptr));
}

// On the device: an fp8 layer with MXFP4 / MXFP8 weights goes to sm90 (the FP8 chain, so the plan
// says); with NVFP4 and BF16 weights every SM90 backend refuses it with the reason (no backend on
// the GPU), and `moekit run`'s HostRunner runs it on the CPU backend, never with bf16 activations
// on the GPU; the backends that pin a bf16 kernel refuse fp8 and name sm90.
TEST(Sm90Fp8Layer, OracleOnTheDevice) {
  NEED_SM90();
  const DeviceInfo dev = DeviceInfo::detect();
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kMxfp8, WeightFormat::kNvfp4, WeightFormat::kBf16}) {
    SCOPED_TRACE(format_name(f));
    MoeConfig c = small_config(f, Activation::kSilu, 8, 2, 256, 128);
    c.activation_dtype = ActivationDtype::kFp8;
    c.activation_scale = ActivationScale::kUe8m0;
    c.max_tokens = 64;
    const bool runs = f == WeightFormat::kMxfp4 || f == WeightFormat::kMxfp8;
    const Problem p = Problem::of(c, 64);
    if (runs) {
      const Decision dec = choose_backend(p, dev, "");
      EXPECT_EQ(dec.chosen->caps().name, "sm90");
      const std::string text = dec.explain(p, dev);
      EXPECT_NE(text.find("FP8 chain"), std::string::npos) << text;
    } else {
      EXPECT_THROW(choose_backend(p, dev, ""), Error);  // no backend on the GPU
    }
    for (const char* b : kGpuBackends) {
      const Support sp = find_backend(b)->supports(p, dev);
      const bool crossover = std::string(b) == "sm90" || std::string(b) == "sm90_batched";
      EXPECT_EQ(sp.ok, runs && crossover) << b << ": " << sp.reason;
      if (!sp.ok) {
        EXPECT_NE(sp.reason.find("no fp8 activations"), std::string::npos) << sp.reason;
      }
      if (!crossover) {
        EXPECT_NE(sp.reason.find("sm90 / sm90_batched"), std::string::npos) << sp.reason;
      }
    }
    const MoeModel m = synthetic_model(c, 3, false);
    EXPECT_EQ(HostRunner(m, "").backend(), runs ? "sm90" : "cpu");
  }
}

}  // namespace
}  // namespace moekit
