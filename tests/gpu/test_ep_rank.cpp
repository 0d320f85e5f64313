// Expert parallelism one process per GPU, as engines run: each test here is ONE rank's side of a
// scenario, run by `moekit_ep_rank_tests` in a process of its own that EpMultiProcess.* (in
// test_ep_gpu.cpp) spawns once per rank with MOEKIT_EP_RANK, MOEKIT_EP_WORLD and MOEKIT_EP_ID
// (a fresh NCCL unique id, hex) in its environment and --gtest_filter naming the scenario. Run
// without them (ctest, a person) every test skips.
//   Layouts    the received layouts byte for byte and combine against the host model (fp32 and
//              bf16 rows), provenance-encoded rows, -1 ids, a rank with no tokens, three rounds,
//              DeepSeek-V3's size (the internal group over a communicator from the id)
//   Layer      the public API: EpGroup from the id, EpLayer from the checkpoint (all experts, and
//              the rank's own slice), forward_topk / forward_logits equal bit for bit to the
//              single-GPU public Layer on the ranks' tokens concatenated (bf16 payload; MXFP8 and
//              NVFP4: on the tokens as the payload quantizes them), the shared expert, a CUDA graph
//              replay, two layers of different sizes sharing the group, bf16 combine rows against
//              float64, bad arguments refused before anything runs
//   Capacity   an expert past its capacity: a clean error on every rank, the next call runs
//   NeverArrives  the last rank skips a call: the others' check() reports the timeout within the
//              bound, naming the rank; after reset() (collective) the next call is right again
//   Exits      the last rank's process exits before a call: the others report the timeout and
//              end without hanging (the communicator is aborted, not destroyed)
//   HostTransport  the network path (NCCL's host all-to-all) forced: the same results
//   Split      dispatch -> forward_batched on batch()'s views -> combine (bf16 combine rows), in
//              place and from a buffer of the caller's, with the shared expert, equal bit for bit
//              to forward_topk; combine without a dispatch and an fp32-rows layer refused
// Every scenario but HostTransport runs once per dispatch variant (the parent sets
// MOEKIT_EP_DISPATCH=direct | fanout in every rank's environment); Layouts and Layer also with
// the ranks' variants mixed (rank 0 fanout, the others direct) and under auto.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "ep_gpu_util.h"
#include "moekit/api/host_runner.h"
#include "moekit/comm/nccl_window.h"
#include "moekit/ep.hpp"
#include "moekit/experts/reference.h"
#include "moekit/formats/nvfp4.h"
#include "moekit/moekit.hpp"

namespace moekit {
namespace {

using namespace ep_test;

struct RankEnv {
  int rank = -1, world = 0;
  std::vector<uint8_t> id;
};

RankEnv rank_env() {
  RankEnv e;
  const char* r = std::getenv("MOEKIT_EP_RANK");
  const char* w = std::getenv("MOEKIT_EP_WORLD");
  const char* id = std::getenv("MOEKIT_EP_ID");
  if (!r || !w || !id) return e;
  e.rank = std::atoi(r);
  e.world = std::atoi(w);
  for (size_t i = 0; id[i] && id[i + 1]; i += 2) e.id.push_back(uint8_t(std::stoi(std::string(id + i, 2), nullptr, 16)));
  return e;
}

#define RANK_OR_SKIP(env)                                                                  \
  const RankEnv env = rank_env();                                                          \
  if (env.rank < 0) GTEST_SKIP() << "one rank of EpMultiProcess.* (MOEKIT_EP_RANK unset)"; \
  ASSERT_EQ(cudaSetDevice(env.rank), cudaSuccess)

TEST(EpRank, Layouts) {
  RANK_OR_SKIP(e);
  const int R = e.world, r = e.rank;
  void* comm = ep::NcclWindow::init_rank(e.id, R, r);
  {
    SCOPED_TRACE("fp32 rows");
    layout_rounds(R, r, comm, ep::CombineRows::kF32, true);
  }
  {
    SCOPED_TRACE("bf16 rows");
    layout_rounds(R, r, comm, ep::CombineRows::kBf16, false);
  }
  {
    SCOPED_TRACE("bf16 rows summed per rank");
    layout_rounds(R, r, comm, ep::CombineRows::kBf16Sum, false);
  }
  ep::NcclWindow::destroy_comm(comm);
}

// ---- the public API --------------------------------------------------------------------------

MoeConfig layer_config(int R) {
  MoeConfig c;
  c.num_experts = 4 * R;
  c.top_k = 4;
  c.hidden = 256;
  c.intermediate = 192;
  c.format = WeightFormat::kMxfp4;
  c.act = Activation::kSwigluOai;
  c.norm_topk_prob = true;
  c.biases = true;
  return c;
}

// The scenarios' layer: layer_config(R) with random weights and biases from `seed`.
SyntheticOptions layer_options(uint64_t seed) {
  SyntheticOptions so;
  so.seed = seed;
  so.biases = true;
  return so;
}

// Every rank's tokens (every rank draws them all alike): x, ids, weights, logits; rank 1 none.
struct Tokens {
  std::vector<int64_t> T;
  std::vector<std::vector<uint16_t>> x;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> w, logits;
  std::vector<std::vector<uint16_t>> shared;
};

Tokens make_tokens(const MoeConfig& c, int R, uint32_t seed, int64_t tmax = 40) {
  Tokens t;
  std::mt19937 rng(seed);
  for (int r = 0; r < R; ++r) {
    const int64_t T = r == 1 ? 0 : tmax - 7 * r % tmax;
    t.T.push_back(T);
    std::vector<uint16_t> x(size_t(T * c.hidden)), sh(size_t(T * c.hidden));
    for (size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(float(int(rng() % 97) - 48) / 24.0f);
    for (size_t i = 0; i < sh.size(); ++i) sh[i] = float_to_bf16(float(int(rng() % 31) - 15) / 16.0f);
    std::vector<int32_t> ids;
    std::vector<float> w;
    std::vector<int32_t> perm(size_t(c.num_experts));
    for (int64_t k = 0; k < T; ++k) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < c.top_k; ++j) {
        ids.push_back(rng() % 7 == 0 ? -1 : perm[size_t(j)]);
        w.push_back(0.125f + float(rng() % 64) / 64.0f);
      }
    }
    std::vector<float> lg(size_t(T * c.num_experts));
    for (float& v : lg) v = float(int(rng() % 2001) - 1000) / 250.0f;
    t.x.push_back(x);
    t.ids.push_back(ids);
    t.w.push_back(w);
    t.logits.push_back(lg);
    t.shared.push_back(sh);
  }
  return t;
}

// Every token's slots on experts (t k + j) mod E of the rank's tokens in turn: each expert gets
// total x k / E rows, give or take one (a valid round under a tight capacity); or, with `hot`,
// every token's slot j on expert j (each of the first k experts gets every token).
void set_ids(Tokens* t, int E, int k, bool hot) {
  int64_t n = 0;
  for (auto& ids : t->ids)
    for (size_t i = 0; i < ids.size(); ++i, ++n) ids[i] = hot ? int32_t(i % size_t(k)) : int32_t(n % E);
}

template <typename T>
std::vector<T> concat(const std::vector<std::vector<T>>& v) {
  std::vector<T> out;
  for (const auto& a : v) out.insert(out.end(), a.begin(), a.end());
  return out;
}

TensorRef dev_tensor(void* p, DLDataType dt, std::vector<int64_t> shape, int dev) {
  return TensorRef(p, dt, std::move(shape), {kDLCUDA, dev});
}

// The single-GPU public Layer (this rank's GPU) on every rank's tokens concatenated: y of all, and
// the routing result of forward_logits.
struct SingleGpu {
  std::vector<uint16_t> y;
  std::vector<int32_t> ids;
};
SingleGpu single_gpu_layer(const LayerSpec& spec_in, std::span<const NamedTensor> ck, const Tokens& t, int dev,
                           bool logits, bool shared, ep::Payload payload, float g,
                           const std::string& backend = "sm90_decode") {
  const int64_t all = std::accumulate(t.T.begin(), t.T.end(), int64_t(0));
  LayerSpec spec = spec_in;
  spec.max_tokens = std::max<int64_t>(all, 1);
  OwnedLayer L;
  EXPECT_TRUE(make_layer(spec, {{kDLCUDA, dev}, backend}, ck, &L).ok());
  const int64_t H = spec.hidden, E = spec.num_experts, k = spec.top_k;
  const std::vector<uint16_t> x = fake_quant(concat(t.x), all, int(H), payload, g);
  test::DeviceBuffer<uint16_t> dx(x), dy(size_t(std::max<int64_t>(all, 1) * H)), dsh(concat(t.shared));
  test::DeviceBuffer<int32_t> dids(concat(t.ids));
  test::DeviceBuffer<float> dw(concat(t.w)), dlg(concat(t.logits));
  test::DeviceBuffer<uint8_t> ws(size_t(L.layer->workspace_bytes(all)));
  test::DeviceBuffer<int32_t> rid(size_t(std::max<int64_t>(all, 1) * k));
  test::DeviceBuffer<float> rw(size_t(std::max<int64_t>(all, 1) * k));
  const TensorRef X = dev_tensor(dx.ptr, kBF16, {all, H}, dev), Y = dev_tensor(dy.ptr, kBF16, {all, H}, dev),
                  S = dev_tensor(dsh.ptr, kBF16, {all, H}, dev), W = dev_tensor(ws.ptr, kU8, {int64_t(ws.n)}, dev);
  if (logits) {
    const TensorRef LG = dev_tensor(dlg.ptr, kF32, {all, E}, dev), I = dev_tensor(rid.ptr, kI32, {all, k}, dev),
                    RW = dev_tensor(rw.ptr, kF32, {all, k}, dev);
    EXPECT_TRUE(L.layer->forward_logits(X, LG, Y, W, nullptr, shared ? &S.dl() : nullptr, &I.dl(), &RW.dl()).ok());
  } else {
    const TensorRef I = dev_tensor(dids.ptr, kI32, {all, k}, dev), WT = dev_tensor(dw.ptr, kF32, {all, k}, dev);
    EXPECT_TRUE(L.layer->forward_topk(X, I, WT, Y, W, nullptr, shared ? &S.dl() : nullptr).ok());
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {dy.to_host(), logits ? rid.to_host() : std::vector<int32_t>{}};
}

// One EP call on this rank's tokens; returns its y (and ids for forward_logits).
struct RankIO {
  test::DeviceBuffer<uint16_t> x, y, shared;
  test::DeviceBuffer<int32_t> ids, rid;
  test::DeviceBuffer<float> w, logits, rw;
  int64_t T = 0;
  RankIO(const Tokens& t, int r, int64_t H, int64_t E, int64_t k)
      : x(t.x[size_t(r)]),
        y(size_t(std::max<int64_t>(t.T[size_t(r)], 1) * H)),
        shared(t.shared[size_t(r)]),
        ids(t.ids[size_t(r)]),
        rid(size_t(std::max<int64_t>(t.T[size_t(r)], 1) * k)),
        w(t.w[size_t(r)]),
        logits(t.logits[size_t(r)]),
        rw(size_t(std::max<int64_t>(t.T[size_t(r)], 1) * k)),
        T(t.T[size_t(r)]) {
    (void)E;
  }
};

Status ep_call(EpLayer& L, RankIO& io, int dev, bool logits, bool shared, cudaStream_t s = nullptr) {
  const LayerSpec& sp = L.spec();
  const int64_t H = sp.hidden, E = sp.num_experts, k = sp.top_k, T = io.T;
  const TensorRef X = dev_tensor(io.x.ptr, kBF16, {T, H}, dev), Y = dev_tensor(io.y.ptr, kBF16, {T, H}, dev),
                  S = dev_tensor(io.shared.ptr, kBF16, {T, H}, dev);
  if (logits) {
    const TensorRef LG = dev_tensor(io.logits.ptr, kF32, {T, E}, dev), I = dev_tensor(io.rid.ptr, kI32, {T, k}, dev),
                    RW = dev_tensor(io.rw.ptr, kF32, {T, k}, dev);
    return L.forward_logits(X, LG, Y, s, shared ? &S.dl() : nullptr, &I.dl(), &RW.dl());
  }
  const TensorRef I = dev_tensor(io.ids.ptr, kI32, {T, k}, dev), W = dev_tensor(io.w.ptr, kF32, {T, k}, dev);
  return L.forward_topk(X, I, W, Y, s, shared ? &S.dl() : nullptr);
}

// y of rank r against the single-GPU rows of its tokens, bit for bit.
void expect_rows(const std::vector<uint16_t>& got, const std::vector<uint16_t>& all, const Tokens& t, int r, int64_t H) {
  int64_t off = 0;
  for (int q = 0; q < r; ++q) off += t.T[size_t(q)] * H;
  int64_t bad = 0;
  for (int64_t i = 0; i < t.T[size_t(r)] * H; ++i) bad += got[size_t(i)] != all[size_t(off + i)];
  EXPECT_EQ(bad, 0) << "elements that differ from the single-GPU layer";
}

// A rank's slice of the checkpoint: each tensor's leading (expert) dimension cut to its experts.
struct Slice {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<NamedTensor> tensors;
};
Slice local_slice(std::span<const NamedTensor> ck, int E, int r, int R) {
  Slice s;
  s.shapes.reserve(ck.size());
  for (const NamedTensor& t : ck) {
    if (t.tensor.ndim == 0 || t.tensor.shape[0] != E) continue;  // e.g. a router bias [E] stays whole
    std::vector<int64_t> sh(t.tensor.shape, t.tensor.shape + t.tensor.ndim);
    int64_t row = t.tensor.dtype.bits / 8;
    for (int i = 1; i < t.tensor.ndim; ++i) row *= sh[size_t(i)];
    sh[0] = E / R;
    s.shapes.push_back(sh);
    NamedTensor n = t;
    n.tensor.data = static_cast<char*>(t.tensor.data) + row * (E / R) * r;
    n.tensor.shape = s.shapes.back().data();
    n.tensor.strides = nullptr;
    s.tensors.push_back(n);
  }
  return s;
}

TEST(EpRank, Layer) {
  RANK_OR_SKIP(e);
  const int R = e.world, r = e.rank;
  const MoeConfig cfg = layer_config(R);
  const MoeModel m = make_synthetic_model(cfg, layer_options(7));
  const HostCheckpoint ck(m);
  LayerSpec spec = m.cfg;
  const int64_t H = spec.hidden, E = spec.num_experts, k = spec.top_k;
  std::unique_ptr<EpGroup> g;
  OK(EpGroup::create(e.id, R, r, {kDLCUDA, r}, &g));
  EXPECT_EQ(g->rank(), r);
  EXPECT_EQ(g->world(), R);
  const float nvg = nvfp4_global_scale(4.0f);
  // Bad arguments are refused on every rank before anything collective runs.
  {
    std::unique_ptr<EpLayer> bad;
    EpOptions o;
    o.max_tokens_per_rank = 40;
    o.kernel = "decode";  // single_gpu_layer's: the same sums
    o.payload = "fp4";
    EXPECT_FALSE(EpLayer::create(*g, spec, o, ck.tensors, &bad).ok());
    o.payload = "nvfp4";  // without its global scale
    const Status st = EpLayer::create(*g, spec, o, ck.tensors, &bad);
    EXPECT_NE(st.message.find("nvfp4_global_scale"), std::string::npos) << st.message;
    LayerSpec odd = spec;
    odd.num_experts = E + 1;
    o.payload = "bf16";
    EXPECT_FALSE(EpLayer::create(*g, odd, o, {}, &bad).ok());
  }
  for (const char* payload : {"bf16", "mxfp8", "nvfp4"}) {
    SCOPED_TRACE(std::string(payload) + " payload");
    EpOptions o;
    o.max_tokens_per_rank = 40;
    o.kernel = "decode";  // single_gpu_layer's: the same sums
    o.payload = payload;
    o.nvfp4_global_scale = nvg;
    const ep::Payload p = ep::parse_payload(payload);
    std::unique_ptr<EpLayer> L;
    OK(EpLayer::create(*g, spec, o, ck.tensors, &L));
    EXPECT_EQ(L->first_expert(), r * (int(E) / R));
    const Tokens t = make_tokens(cfg, R, 100 + uint32_t(p));
    for (bool logits : {false, true})
      for (bool shared : {false, true}) {
        SCOPED_TRACE(std::string(logits ? "forward_logits" : "forward_topk") + (shared ? " + shared" : ""));
        RankIO io(t, r, H, E, k);
        io.y.poison();
        OK(ep_call(*L, io, r, logits, shared));
        OK(L->check(nullptr));
        const SingleGpu want = single_gpu_layer(spec, ck.tensors, t, r, logits, shared, p, nvg);
        expect_rows(io.y.to_host(), want.y, t, r, H);
        if (logits) {  // the routing result too
          int64_t off = 0;
          for (int q = 0; q < r; ++q) off += t.T[size_t(q)] * k;
          const auto ids = io.rid.to_host();
          for (int64_t i = 0; i < io.T * k; ++i) EXPECT_EQ(ids[size_t(i)], want.ids[size_t(off + i)]) << i;
        }
      }
  }
  // The prefill kernel on every rank against the single-GPU sm90_prefill backend, bit for bit.
  {
    EpOptions o;
    o.max_tokens_per_rank = 40;
    o.kernel = "prefill";
    std::unique_ptr<EpLayer> L;
    OK(EpLayer::create(*g, spec, o, ck.tensors, &L));
    const Tokens t = make_tokens(cfg, R, 200);
    RankIO io(t, r, H, E, k);
    io.y.poison();
    OK(ep_call(*L, io, r, false, true));
    OK(L->check(nullptr));
    const SingleGpu want = single_gpu_layer(spec, ck.tensors, t, r, false, true, ep::Payload::kBf16, 1.0f, "sm90_prefill");
    expect_rows(io.y.to_host(), want.y, t, r, H);
  }
  // The rank's own slice of the checkpoint, and a second, larger layer sharing the group (its
  // windows grow): both still right, called alternately, and under a CUDA graph.
  {
    EpOptions o;
    o.max_tokens_per_rank = 40;
    o.kernel = "decode";  // single_gpu_layer's: the same sums
    const Slice sl = local_slice(ck.tensors, int(E), r, R);
    std::unique_ptr<EpLayer> A;
    OK(EpLayer::create(*g, spec, o, sl.tensors, &A));
    MoeConfig big_cfg = cfg;
    big_cfg.hidden = 512;
    const MoeModel mb = make_synthetic_model(big_cfg, layer_options(9));
    const HostCheckpoint ckb(mb);
    std::unique_ptr<EpLayer> B;
    EpOptions ob = o;
    ob.max_tokens_per_rank = 64;
    OK(EpLayer::create(*g, mb.cfg, ob, ckb.tensors, &B));
    const Tokens ta = make_tokens(cfg, R, 300), tb = make_tokens(big_cfg, R, 301, 64);
    const SingleGpu wa = single_gpu_layer(spec, ck.tensors, ta, r, false, false, ep::Payload::kBf16, 1.0f);
    const SingleGpu wb = single_gpu_layer(mb.cfg, ckb.tensors, tb, r, false, false, ep::Payload::kBf16, 1.0f);
    RankIO ia(ta, r, H, E, k), ib(tb, r, 512, E, k);
    for (int round = 0; round < 2; ++round) {
      ia.y.poison();
      ib.y.poison();
      OK(ep_call(*A, ia, r, false, false));
      OK(ep_call(*B, ib, r, false, false));
      OK(A->check(nullptr));
      expect_rows(ia.y.to_host(), wa.y, ta, r, H);
      expect_rows(ib.y.to_host(), wb.y, tb, r, 512);
    }
    // A CUDA graph of both layers' calls, replayed twice.
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    OK(ep_call(*A, ia, r, false, false, s));
    OK(ep_call(*B, ib, r, false, false, s));
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int rep = 0; rep < 2; ++rep) {
      ia.y.poison();
      ib.y.poison();
      ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
      OK(A->check(s));
      expect_rows(ia.y.to_host(), wa.y, ta, r, H);
      expect_rows(ib.y.to_host(), wb.y, tb, r, 512);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
    // Bad call arguments: refused before anything runs (on every rank alike, so nobody waits).
    const TensorRef wrong = dev_tensor(ia.x.ptr, kF32, {ia.T, H}, r);
    const TensorRef I = dev_tensor(ia.ids.ptr, kI32, {ia.T, k}, r), W = dev_tensor(ia.w.ptr, kF32, {ia.T, k}, r),
                    Y = dev_tensor(ia.y.ptr, kBF16, {ia.T, H}, r);
    const Status st = A->forward_topk(wrong, I, W, Y, nullptr);
    EXPECT_EQ(st.code, StatusCode::kInvalidArgument);
    EXPECT_NE(st.message.find("x: dtype"), std::string::npos) << st.message;
    const TensorRef many = dev_tensor(ia.x.ptr, kBF16, {41, H}, r);
    EXPECT_FALSE(A->forward_topk(many, I, W, Y, nullptr).ok());
    OK(A->check(nullptr));
  }
  // bf16 combine rows, and summed per rank: the error against float64 next to fp32 rows'.
  {
    const Tokens t = make_tokens(cfg, R, 500);
    double err[3];
    for (int bf : {0, 1, 2}) {
      EpOptions o;
      o.max_tokens_per_rank = 40;
      o.combine = bf == 2 ? "bf16_sum" : bf ? "bf16" : "fp32";
      std::unique_ptr<EpLayer> L;
      OK(EpLayer::create(*g, spec, o, ck.tensors, &L));
      RankIO io(t, r, H, E, k);
      OK(ep_call(*L, io, r, false, false));
      OK(L->check(nullptr));
      std::vector<float> got;
      const auto y = io.y.to_host();
      for (int64_t i = 0; i < io.T * H; ++i) got.push_back(bf16_to_float(y[size_t(i)]));
      const auto ref = reference_layer(m, t.x[size_t(r)].data(), io.T, t.ids[size_t(r)].data(), t.w[size_t(r)].data(), 4);
      err[bf] = io.T > 0 ? rel_l2(got, ref) : 0.0;
    }
    std::printf("rank %d: rel-L2 against float64: fp32 combine rows %.3e, bf16 rows %.3e, bf16 sums %.3e\n", r, err[0],
                err[1], err[2]);
    EXPECT_LT(err[1], 1e-2);
    EXPECT_LT(err[2], 1e-2);
  }
}

// The network path (NCCL's host all-to-all), forced on GPUs that could load and store: the same
// results as the single-GPU layer (fp32 combine rows: bit for bit; every payload), bf16 combine
// rows against float64, an expert past its capacity, many calls.
TEST(EpRank, HostTransport) {
  RANK_OR_SKIP(e);
  const int R = e.world, r = e.rank;
  const MoeConfig cfg = layer_config(R);
  const MoeModel m = make_synthetic_model(cfg, layer_options(11));
  const HostCheckpoint ck(m);
  const LayerSpec spec = m.cfg;
  const int64_t H = spec.hidden, E = spec.num_experts, k = spec.top_k;
  std::unique_ptr<EpGroup> g;
  OK(EpGroup::create(e.id, R, r, {kDLCUDA, r}, &g, "host"));
  EXPECT_EQ(g->transport(), "host");
  const float nvg = nvfp4_global_scale(4.0f);
  for (const char* payload : {"bf16", "mxfp8", "nvfp4"}) {
    SCOPED_TRACE(std::string(payload) + " payload");
    EpOptions o;
    o.max_tokens_per_rank = 40;
    o.kernel = "decode";  // single_gpu_layer's: the same sums
    o.payload = payload;
    o.nvfp4_global_scale = nvg;
    std::unique_ptr<EpLayer> L;
    OK(EpLayer::create(*g, spec, o, ck.tensors, &L));
    for (int round = 0; round < 2; ++round) {
      const Tokens t = make_tokens(cfg, R, 700 + uint32_t(round));
      for (bool logits : {false, true}) {
        RankIO io(t, r, H, E, k);
        io.y.poison();
        OK(ep_call(*L, io, r, logits, true));
        OK(L->check(nullptr));
        const SingleGpu want = single_gpu_layer(spec, ck.tensors, t, r, logits, true, ep::parse_payload(payload), nvg);
        expect_rows(io.y.to_host(), want.y, t, r, H);
      }
    }
  }
  {
    EpOptions o;
    o.max_tokens_per_rank = 40;
    o.kernel = "decode";  // single_gpu_layer's: the same sums
    o.combine = "bf16";
    std::unique_ptr<EpLayer> L;
    OK(EpLayer::create(*g, spec, o, ck.tensors, &L));
    const Tokens t = make_tokens(cfg, R, 800);
    RankIO io(t, r, H, E, k);
    OK(ep_call(*L, io, r, false, false));
    OK(L->check(nullptr));
    if (io.T > 0) {
      std::vector<float> got;
      const auto y = io.y.to_host();
      for (int64_t i = 0; i < io.T * H; ++i) got.push_back(bf16_to_float(y[size_t(i)]));
      const auto ref = reference_layer(m, t.x[size_t(r)].data(), io.T, t.ids[size_t(r)].data(), t.w[size_t(r)].data(), 4);
      EXPECT_LT(rel_l2(got, ref), 1e-2);
    }
  }
  {
    EpOptions o;
    o.max_tokens_per_rank = 40;
    o.kernel = "decode";  // single_gpu_layer's: the same sums
    o.expert_capacity = 30;
    std::unique_ptr<EpLayer> L;
    OK(EpLayer::create(*g, spec, o, ck.tensors, &L));
    Tokens t = make_tokens(cfg, R, 21);
    set_ids(&t, cfg.num_experts, cfg.top_k, true);
    RankIO io(t, r, H, E, k);
    OK(ep_call(*L, io, r, false, false));
    const Status st = L->check(nullptr);
    EXPECT_NE(st.message.find("capacity of 30"), std::string::npos) << st.message;
    Tokens ok = make_tokens(cfg, R, 22);
    set_ids(&ok, cfg.num_experts, cfg.top_k, false);
    const SingleGpu want = single_gpu_layer(spec, ck.tensors, ok, r, false, false, ep::Payload::kBf16, 1.0f);
    RankIO io2(ok, r, H, E, k);
    OK(ep_call(*L, io2, r, false, false));
    OK(L->check(nullptr));
    expect_rows(io2.y.to_host(), want.y, ok, r, H);
  }
}

// The fault scenarios' common start: synthetic weights with biases, the group from the id, one
// layer (decode kernel, as single_gpu_layer; timeout and capacity as given).
struct FaultCase {
  MoeConfig cfg;
  MoeModel m;
  std::unique_ptr<HostCheckpoint> ck;
  std::unique_ptr<EpGroup> g;
  std::unique_ptr<EpLayer> L;
  FaultCase(const RankEnv& e, double timeout_ms, int64_t capacity = 0) : cfg(layer_config(e.world)) {
    m = make_synthetic_model(cfg, layer_options(1));
    ck = std::make_unique<HostCheckpoint>(m);
    EXPECT_TRUE(EpGroup::create(e.id, e.world, e.rank, {kDLCUDA, e.rank}, &g).ok());
    EpOptions o;
    o.max_tokens_per_rank = 40;
    o.kernel = "decode";  // single_gpu_layer's: the same sums
    o.timeout_ms = timeout_ms;
    o.expert_capacity = capacity;
    const Status st = EpLayer::create(*g, m.cfg, o, ck->tensors, &L);
    EXPECT_TRUE(st.ok()) << st.message;
  }
};

// Every rank's tokens on the same k experts: past their capacity on every rank, the same error;
// then a valid call.
TEST(EpRank, Capacity) {
  RANK_OR_SKIP(e);
  const int R = e.world, r = e.rank;
  FaultCase f(e, 10000, 30);  // a valid round gives at most 22 rows an expert; the hot one 40 or more
  ASSERT_TRUE(f.L);
  const MoeConfig& cfg = f.cfg;
  const MoeModel& m = f.m;
  const HostCheckpoint& ck = *f.ck;
  EpLayer* L = f.L.get();
  Tokens t = make_tokens(cfg, R, 21);
  set_ids(&t, cfg.num_experts, cfg.top_k, true);
  RankIO io(t, r, cfg.hidden, cfg.num_experts, cfg.top_k);
  io.y.poison();
  OK(ep_call(*L, io, r, false, false));
  const Status st = L->check(nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message.find("expert 0 receives"), std::string::npos) << st.message;
  EXPECT_NE(st.message.find("capacity of 30"), std::string::npos) << st.message;
  Tokens ok = make_tokens(cfg, R, 22);
  set_ids(&ok, cfg.num_experts, cfg.top_k, false);
  const SingleGpu want = single_gpu_layer(m.cfg, ck.tensors, ok, r, false, false, ep::Payload::kBf16, 1.0f);
  RankIO io2(ok, r, cfg.hidden, cfg.num_experts, cfg.top_k);
  OK(ep_call(*L, io2, r, false, false));
  OK(L->check(nullptr));
  expect_rows(io2.y.to_host(), want.y, ok, r, cfg.hidden);
}

TEST(EpRank, NeverArrives) {
  RANK_OR_SKIP(e);
  const int R = e.world, r = e.rank;
  FaultCase f(e, 1500);
  ASSERT_TRUE(f.L);
  const MoeConfig& cfg = f.cfg;
  const MoeModel& m = f.m;
  const HostCheckpoint& ck = *f.ck;
  EpLayer* L = f.L.get();
  const Tokens t = make_tokens(cfg, R, 31);
  const SingleGpu want = single_gpu_layer(m.cfg, ck.tensors, t, r, false, false, ep::Payload::kBf16, 1.0f);
  RankIO io(t, r, cfg.hidden, cfg.num_experts, cfg.top_k);
  OK(ep_call(*L, io, r, false, false));
  OK(L->check(nullptr));
  if (r != R - 1) {  // the last rank skips this call
    const auto t0 = std::chrono::steady_clock::now();
    OK(ep_call(*L, io, r, false, false));
    const Status st = L->check(nullptr);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_FALSE(st.ok());
    EXPECT_LT(ms, 1500 + 3000) << "the waits are bounded";
    EXPECT_NE(st.message.find("timed out"), std::string::npos) << st.message;
    EXPECT_NE(st.message.find("waited for rank " + std::to_string(R - 1)), std::string::npos) << st.message;
    // Poisoned until reset: a call is refused.
    EXPECT_FALSE(ep_call(*L, io, r, false, false).ok());
  }
  OK(L->reset());  // collective
  io.y.poison();
  OK(ep_call(*L, io, r, false, false));
  OK(L->check(nullptr));
  expect_rows(io.y.to_host(), want.y, t, r, cfg.hidden);
}

TEST(EpRank, Exits) {
  RANK_OR_SKIP(e);
  const int R = e.world, r = e.rank;
  FaultCase f(e, 1500);
  ASSERT_TRUE(f.L);
  const MoeConfig& cfg = f.cfg;
  EpLayer* L = f.L.get();
  const Tokens t = make_tokens(cfg, R, 41);
  RankIO io(t, r, cfg.hidden, cfg.num_experts, cfg.top_k);
  OK(ep_call(*L, io, r, false, false));
  OK(L->check(nullptr));
  if (r == R - 1) {
    std::fflush(stdout);
    std::_Exit(3);  // gone mid-round, without a word to anyone
  }
  OK(ep_call(*L, io, r, false, false));
  const Status st = L->check(nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message.find("timed out"), std::string::npos) << st.message;
  // Ending must not wait for the dead rank: the layer and group go (communicator aborted).
  const auto t0 = std::chrono::steady_clock::now();
  f.L.reset();
  f.g.reset();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
}

// The split calls (EpLayer::batch / dispatch / combine) around moekit's own batched experts.
TEST(EpRank, Split) {
  RANK_OR_SKIP(e);
  const int R = e.world, r = e.rank;
  FaultCase f(e, 10000);  // its layer has fp32 combine rows: no split calls
  ASSERT_TRUE(f.L);
  const MoeConfig& cfg = f.cfg;
  const LayerSpec spec = f.m.cfg;
  const int64_t H = spec.hidden, k = spec.top_k;
  EpOptions o;
  o.max_tokens_per_rank = 40;
  o.kernel = "decode";
  o.combine = "bf16";
  std::unique_ptr<EpLayer> L;
  OK(EpLayer::create(*f.g, spec, o, f.ck->tensors, &L));
  EpBatch b;
  EXPECT_NE(f.L->batch(&b).message.find("combine"), std::string::npos);
  OK(L->batch(&b));
  EXPECT_EQ(b.local_experts, L->local_experts());
  EXPECT_EQ(b.capacity, int64_t(R) * 40);
  EXPECT_EQ(b.hidden, H);
  const int64_t El = b.local_experts, cap = b.capacity;
  const TensorRef BX(const_cast<uint16_t*>(b.x), kBF16, {El, cap, H}, {kDLCUDA, r}, {b.x_expert_stride, b.x_row_stride, 1});
  const TensorRef BN(const_cast<int32_t*>(b.expert_num_tokens), kI32, {El}, {kDLCUDA, r});
  const TensorRef BO(b.expert_out, kBF16, {El, cap, H}, {kDLCUDA, r});
  test::DeviceBuffer<uint16_t> mine(size_t(El * cap * H));
  const TensorRef MO(mine.ptr, kBF16, {El, cap, H}, {kDLCUDA, r});
  test::DeviceBuffer<uint8_t> ws(size_t(L->batched_workspace_bytes(cap)));
  const TensorRef WS(ws.ptr, kU8, {int64_t(ws.n)}, {kDLCUDA, r});
  const Tokens t = make_tokens(cfg, R, 600);
  RankIO io(t, r, H, spec.num_experts, k);
  const TensorRef X = dev_tensor(io.x.ptr, kBF16, {io.T, H}, r), I = dev_tensor(io.ids.ptr, kI32, {io.T, k}, r),
                  W = dev_tensor(io.w.ptr, kF32, {io.T, k}, r), Y = dev_tensor(io.y.ptr, kBF16, {io.T, H}, r),
                  S = dev_tensor(io.shared.ptr, kBF16, {io.T, H}, r);
  // combine before any dispatch: refused on every rank alike (nobody waits).
  EXPECT_NE(L->combine(BO, Y, nullptr).message.find("dispatch"), std::string::npos);
  for (bool in_place : {true, false})
    for (bool shared : {false, true}) {
      SCOPED_TRACE(std::string(in_place ? "in place" : "caller's buffer") + (shared ? " + shared" : ""));
      OK(ep_call(*L, io, r, false, shared));
      OK(L->check(nullptr));
      const std::vector<uint16_t> want = io.y.to_host();
      io.y.poison();
      mine.poison();
      OK(L->dispatch(X, I, W, nullptr));
      OK(L->forward_batched(BX, BN, in_place ? BO : MO, WS, nullptr));
      OK(L->combine(in_place ? BO : MO, Y, nullptr, &W.dl(), shared ? &S.dl() : nullptr));
      OK(L->check(nullptr));
      const std::vector<uint16_t> got = io.y.to_host();
      for (int64_t i = 0; i < io.T * H; ++i) ASSERT_EQ(got[size_t(i)], want[size_t(i)]) << "element " << i;
    }
}

}  // namespace
}  // namespace moekit
