// Expert parallelism on one GPU with virtual ranks (comm/): the received layout byte for byte
// against the host model with provenance-encoded payloads, combine against the host sum, the EP
// layer bit-identical to the single-GPU layer (bf16, MXFP8, NVFP4 payloads), -1 ids, a token
// whose experts all live on one rank, a rank with no tokens, capacity overflow, a rank that never
// arrives (dispatch and combine), the abort word, many rounds, and a one-rank NCCL communicator.
// With two or more GPUs (EpNccl.LocalGpus*): the same checks on real ranks over NVLink, one thread
// per GPU in one NCCL communicator: layouts and combine, a rank that never dispatches, the layer.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "gpu_util.h"
#include "moekit/backends/ep_layer.h"
#include "moekit/backends/sm90_layer.h"
#include "moekit/comm/ep_group.h"
#include "moekit/comm/ep_host.h"
#include "../ep_testutil.h"
#include "moekit/comm/nccl_window.h"
#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/formats/mxfp8.h"
#include "moekit/formats/nvfp4.h"
#include "moekit/model/synthetic.h"

namespace moekit {
namespace {

using test::DeviceBuffer;

using test::ep_shape;

// A provenance value: source rank, token and column are readable from the bits.
uint16_t provenance(int r, int64_t t, int64_t c) {
  return uint16_t((uint32_t(r) * 0x9E37u + uint32_t(t) * 0x85EBu + uint32_t(c) * 0xC2B3u) & 0x3fffu);  // finite
}

// Per rank: ids with an id pattern, weights, x; and the device copies.
struct Batches {
  std::vector<ep::RankBatch> host;
  std::vector<std::vector<uint16_t>> x;  // [T, H] bf16
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> dx, dy;
  std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> dids;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> dw;

  std::vector<ep::RankInput> inputs(const ep::Shape& s) const {
    std::vector<ep::RankInput> in(host.size());
    for (size_t r = 0; r < host.size(); ++r) {
      in[r].T = host[r].T;
      in[r].x = dx[r]->ptr;
      in[r].x_stride = s.hidden;
      in[r].ids = dids[r]->ptr;
      in[r].weights = dw[r]->ptr;
      in[r].y = dy[r]->ptr;
      in[r].y_stride = s.hidden;
    }
    return in;
  }
};

using IdFn = std::function<int32_t(int r, int64_t t, int j, std::mt19937& rng)>;

// Distinct experts per token from a random permutation, 1 in 6 slots -1.
int32_t random_id(const ep::Shape& s, int64_t t, int j, std::mt19937& rng, std::vector<int32_t>& perm) {
  if (j == 0) {
    perm.resize(size_t(s.num_experts));
    for (int i = 0; i < s.num_experts; ++i) perm[size_t(i)] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
  }
  (void)t;
  return rng() % 6 == 0 ? -1 : perm[size_t(j)];
}

Batches make_batches(const ep::Shape& s, const std::vector<int64_t>& T, uint32_t seed, const IdFn& id = nullptr,
                     std::function<uint16_t(int, int64_t, int64_t)> xval = provenance) {
  Batches b;
  std::mt19937 rng(seed);
  std::vector<int32_t> perm;
  for (int r = 0; r < s.world; ++r) {
    ep::RankBatch rb;
    rb.T = T[size_t(r)];
    for (int64_t t = 0; t < rb.T; ++t)
      for (int j = 0; j < s.top_k; ++j) {
        rb.ids.push_back(id ? id(r, t, j, rng) : random_id(s, t, j, rng, perm));
        rb.weights.push_back(0.125f + float(rng() % 64) / 64.0f);
      }
    std::vector<uint16_t> x(size_t(rb.T * s.hidden));
    for (int64_t t = 0; t < rb.T; ++t)
      for (int64_t c = 0; c < s.hidden; ++c) x[size_t(t * s.hidden + c)] = xval(r, t, c);
    b.dx.push_back(std::make_unique<DeviceBuffer<uint16_t>>(x));
    b.dy.push_back(std::make_unique<DeviceBuffer<uint16_t>>(size_t(std::max<int64_t>(rb.T, 1) * s.hidden)));
    b.dids.push_back(std::make_unique<DeviceBuffer<int32_t>>(rb.ids));
    b.dw.push_back(std::make_unique<DeviceBuffer<float>>(rb.weights));
    b.x.push_back(std::move(x));
    b.host.push_back(std::move(rb));
  }
  return b;
}

template <typename T>
std::vector<T> d2h(const T* p, size_t n) {
  std::vector<T> v(n);
  if (n) {
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return v;
}

// The received layout of every rank against the host model: meta (all rows, byte for byte), the
// payload rows below each count (the source's bytes; bf16 padding columns zero), the work list,
// and the slot maps.
void expect_rank_layout(const ep::RankView& v, int q, const ep::Shape& s, const Batches& b, const ep::HostDispatch& d) {
  const int El = s.local_experts();
  SCOPED_TRACE("rank " + std::to_string(q));
  const auto meta = d2h(v.meta, size_t(s.rows()));
  EXPECT_EQ(std::memcmp(meta.data(), d.meta[size_t(q)].data(), meta.size() * sizeof(ep::RowMeta)), 0) << "meta";
  const auto rows = d2h(v.rows, size_t(s.rows() * s.hidden_pad));
  int64_t bad = 0;
  for (int64_t g2 = 0; g2 < s.rows(); ++g2) {
    const ep::RowMeta& m = d.meta[size_t(q)][size_t(g2)];
    if (m.expert < 0) continue;
    const int src = m.src >> ep::kSrcTokenBits, t = m.src & ((1 << ep::kSrcTokenBits) - 1);
    for (int64_t c = 0; c < s.hidden_pad; ++c) {
      const uint16_t want = c < s.hidden ? b.x[size_t(src)][size_t(t * s.hidden + c)] : uint16_t(0);
      bad += rows[size_t(g2 * s.hidden_pad + c)] != want;
    }
  }
  EXPECT_EQ(bad, 0) << "payload elements that differ";
  const int na = d2h(v.num_active, 1)[0];
  const auto ex = d2h(v.expert, size_t(El)), cnt = d2h(v.count, size_t(El)), rs = d2h(v.row_start, size_t(El));
  const auto cp = d2h(v.chunk_prefix, size_t(El + 1));
  int a = 0, ch = 0;
  EXPECT_EQ(cp[0], 0);
  for (int el = 0; el < El; ++el) {
    const int c = d.local_count[size_t(q)][size_t(el)];
    if (c == 0) continue;
    EXPECT_EQ(ex[size_t(a)], el);
    EXPECT_EQ(cnt[size_t(a)], c);
    EXPECT_EQ(rs[size_t(a)], el * s.capacity);
    ch += (c + 7) / 8;
    EXPECT_EQ(cp[size_t(a + 1)], ch);
    ++a;
  }
  EXPECT_EQ(na, a);
  const auto slot = d2h(v.slot_row, size_t(b.host[size_t(q)].T * s.top_k));
  EXPECT_EQ(slot, d.slot_row[size_t(q)]);
}

void expect_layout(ep::Group& g, const ep::Shape& s, const Batches& b, const ep::HostDispatch& d) {
  for (int q = 0; q < s.world; ++q) expect_rank_layout(g.view(q), q, s, b, d);
}

// The expert output rows of every rank (fp32, as GEMM2 writes them), from a seed.
std::vector<std::vector<float>> expert_rows(const ep::Shape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::vector<float>> y(size_t(s.world), std::vector<float>(size_t(s.rows() * s.hidden)));
  for (auto& rows : y)
    for (float& v : rows) v = nd(rng);
  return y;
}

// y rows filled by the test (as if the experts wrote them), combine, and the host's sum.
void expect_combine(ep::Group& g, const ep::Shape& s, const Batches& b, const ep::HostDispatch& d, uint32_t seed,
                    cudaStream_t st) {
  const std::vector<std::vector<float>> y = expert_rows(s, seed);
  for (int q = 0; q < s.world; ++q) {
    ASSERT_EQ(cudaMemcpy(g.view(q).y, y[size_t(q)].data(), y[size_t(q)].size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  for (int r = 0; r < s.world; ++r) b.dy[size_t(r)]->poison();
  g.combine(st);
  ASSERT_EQ(g.check(st), "");
  for (int r = 0; r < s.world; ++r) {
    const auto got = b.dy[size_t(r)]->to_host();
    const auto want = ep::host_combine(s, d, b.host[size_t(r)], r, y);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 2), 0) << "rank " << r;
  }
}

ep::GroupConfig config(const ep::Shape& s, uint64_t timeout_ns = 5'000'000'000ull) {
  ep::GroupConfig c;
  c.shape = s;
  c.timeout_ns = timeout_ns;
  return c;
}

// One round on g: random batches of T[r] tokens per rank, dispatch, the layout and the combine
// against the host model.
void round_matches_host(ep::Group& g, const ep::Shape& s, const std::vector<int64_t>& T, uint32_t seed,
                        uint32_t combine_seed, cudaStream_t st) {
  const Batches b = make_batches(s, T, seed);
  const ep::HostDispatch d = ep::host_dispatch(s, b.host);
  ASSERT_EQ(d.overflow_expert, -1);
  g.set_inputs(b.inputs(s));
  g.dispatch(st);
  ASSERT_EQ(g.check(st), "");
  expect_layout(g, s, b, d);
  expect_combine(g, s, b, d, combine_seed, st);
}

TEST(EpTransport, VirtualRanksMatchTheHostModel) {
  cudaStream_t st = nullptr;
  for (int R : {1, 2, 4, 8}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    const ep::Shape s = ep_shape(R, 32, 4, 200, 37, 160);  // H = 200: padded rows (stride 256)
    auto g = ep::Group::create_virtual(config(s), 0);
    std::vector<int64_t> T;
    for (int r = 0; r < R; ++r) T.push_back(r == R - 1 && R > 1 ? 0 : 37 - 5 * r % 37);  // the last rank: none
    // Three rounds on the same group (epochs grow; nothing is reset in between).
    for (uint32_t round = 0; round < 3; ++round) {
      SCOPED_TRACE("round " + std::to_string(round));
      round_matches_host(*g, s, T, 11u * R + round, round + 5u, st);
    }
  }
}

// The benchmark's size (DeepSeek-V3: H = 7168, E = 256, k = 8; 8 ranks of 128 tokens), once.
TEST(EpTransport, DeepSeekScale) {
  cudaStream_t st = nullptr;
  const ep::Shape s = ep_shape(8, 256, 8, 7168, 128, 128);
  auto g = ep::Group::create_virtual(config(s), 0);
  round_matches_host(*g, s, std::vector<int64_t>(8, 128), 99, 4, st);
}

// Prefill sizes: 700 tokens x 8 slots per rank take the plan in grids (kWidePlanFrom entries) on
// every rank; the layout and the combine as the host model says.
TEST(EpTransport, PrefillSizedRanks) {
  cudaStream_t st = nullptr;
  const ep::Shape s = ep_shape(2, 16, 8, 64, 700, 1400);  // an expert gets at most 700 rows per rank
  auto g = ep::Group::create_virtual(config(s), 0);
  round_matches_host(*g, s, {700, 523}, 31, 6, st);
}

TEST(EpTransport, IdPatterns) {
  cudaStream_t st = nullptr;
  const int R = 4;
  const ep::Shape s = ep_shape(R, 16, 4, 128, 24, 96);
  const int El = s.local_experts();
  struct Pattern {
    const char* name;
    IdFn id;
  };
  const Pattern patterns[] = {
      {"all -1", [](int, int64_t, int, std::mt19937&) { return -1; }},
      {"experts of a token on one rank", [&](int r, int64_t t, int j, std::mt19937&) {
         return int32_t(((r + int(t)) % R) * El + j);
       }},
      {"every token on rank 0's experts", [&](int, int64_t, int j, std::mt19937&) { return int32_t(j); }},
      {"-1 in the first and last slots", [&](int r, int64_t t, int j, std::mt19937&) {
         return j == 0 || j == 3 ? -1 : int32_t((r * 5 + int(t) * 3 + j * 7) % 16 / 4 * 4 + j);
       }},
  };
  auto g = ep::Group::create_virtual(config(s), 0);
  uint32_t seed = 1;
  for (const Pattern& p : patterns) {
    SCOPED_TRACE(p.name);
    const Batches b = make_batches(s, {24, 0, 7, 1}, ++seed, p.id);
    const ep::HostDispatch d = ep::host_dispatch(s, b.host);
    ASSERT_EQ(d.overflow_expert, -1);
    g->set_inputs(b.inputs(s));
    g->dispatch(st);
    ASSERT_EQ(g->check(st), "");
    expect_layout(*g, s, b, d);
    expect_combine(*g, s, b, d, seed, st);
  }
}

TEST(EpFaults, CapacityOverflowIsACleanErrorOnEveryRank) {
  cudaStream_t st = nullptr;
  const int R = 4;
  const ep::Shape s = ep_shape(R, 16, 2, 64, 16, 20);
  auto g = ep::Group::create_virtual(config(s), 0);
  // Expert 5 gets 4 x 6 = 24 rows > 20.
  const Batches b = make_batches(s, {6, 6, 6, 6}, 3, [](int, int64_t t, int j, std::mt19937&) {
    return int32_t(j == 0 ? 5 : 8 + t % 8);
  });
  ASSERT_EQ(ep::host_dispatch(s, b.host).overflow_expert, 5);
  // A valid round first, so the windows hold rows that an overflow must not touch.
  const Batches ok = make_batches(s, {6, 6, 6, 6}, 4);
  g->set_inputs(ok.inputs(s));
  g->dispatch(st);
  ASSERT_EQ(g->check(st), "");
  const ep::HostDispatch dok = ep::host_dispatch(s, ok.host);
  const auto rows_before = d2h(g->view(1).rows, size_t(s.rows() * s.hidden_pad));
  g->set_inputs(b.inputs(s));
  g->dispatch(st);
  const std::string msg = g->check(st);
  for (int r = 0; r < R; ++r) EXPECT_NE(msg.find("rank " + std::to_string(r) + ")"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expert 5 receives 24 rows"), std::string::npos) << msg;
  EXPECT_NE(msg.find("capacity of 20"), std::string::npos) << msg;
  EXPECT_FALSE(g->poisoned());
  EXPECT_EQ(d2h(g->view(1).rows, rows_before.size()), rows_before) << "an overflowing round moved rows";
  EXPECT_EQ(d2h(g->view(1).num_active, 1)[0], 0);
  // combine of the failed round writes nothing and waits for nobody.
  for (int r = 0; r < R; ++r) b.dy[size_t(r)]->poison(0x7f);
  g->combine(st);
  EXPECT_EQ(g->check(st), "");
  for (uint16_t v : b.dy[0]->to_host()) ASSERT_EQ(v, 0x7f7f);
  // The next round runs.
  g->set_inputs(ok.inputs(s));
  g->dispatch(st);
  ASSERT_EQ(g->check(st), "");
  expect_layout(*g, s, ok, dok);
  expect_combine(*g, s, ok, dok, 9, st);
}

// A rank that never arrives: the others time out within the bound, the error names the phase,
// the rank, the peer, the values and the round; the context stays usable; reset() recovers.
TEST(EpFaults, ARankThatNeverArrivesTimesOut) {
  cudaStream_t st = nullptr;
  const int R = 4;
  const ep::Shape s = ep_shape(R, 16, 4, 64, 8, 64);
  const uint64_t timeout = 50'000'000;  // 50 ms
  auto g = ep::Group::create_virtual(config(s, timeout), 0);
  const Batches b = make_batches(s, {8, 8, 8, 8}, 5);
  const ep::HostDispatch d = ep::host_dispatch(s, b.host);
  g->set_inputs(b.inputs(s));
  // Round 1 runs; in round 2 rank 2 never launches.
  g->dispatch(st);
  expect_combine(*g, s, b, d, 1, st);
  g->set_active(~(1ull << 2));
  const auto t0 = std::chrono::steady_clock::now();
  g->dispatch(st);
  const std::string msg = g->check(st);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  RecordProperty("timeout_ms", std::to_string(ms));
  EXPECT_LT(ms, 50 + 2000) << "the waits are bounded";
  EXPECT_NE(msg.find("dispatch counts timed out"), std::string::npos) << msg;
  EXPECT_NE(msg.find("waited for rank 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("round 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected epoch 2, saw 1"), std::string::npos) << msg;
  for (int r : {0, 1, 3}) EXPECT_NE(msg.find("rank " + std::to_string(r) + " waited"), std::string::npos) << msg;
  EXPECT_TRUE(g->poisoned());
  EXPECT_THROW(g->dispatch(st), Error);
  // The context is alive: memory traffic and a new group work.
  DeviceBuffer<int> probe(std::vector<int>{1, 2, 3});
  EXPECT_EQ(probe.to_host(), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  g->reset();
  g->set_active(~0ull);
  g->dispatch(st);
  ASSERT_EQ(g->check(st), "");
  expect_layout(*g, s, b, d);
  // Combine: rank 1 never arrives.
  g->set_active(~(1ull << 1));
  g->combine(st);
  const std::string cm = g->check(st);
  EXPECT_NE(cm.find("combine timed out"), std::string::npos) << cm;
  EXPECT_NE(cm.find("waited for rank 1"), std::string::npos) << cm;
  // The abort word ends the waits at once, whatever the timeout.
  g->reset();
  g->set_active(~(1ull << 3));
  auto g2 = ep::Group::create_virtual(config(s, 600'000'000'000ull), 0);
  g2->set_inputs(b.inputs(s));
  g2->set_active(~(1ull << 3));
  g2->abort(true);
  const auto t1 = std::chrono::steady_clock::now();
  g2->dispatch(st);
  const std::string am = g2->check(st);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 5.0);
  EXPECT_NE(am.find("aborted"), std::string::npos) << am;
}

// ---- the layer --------------------------------------------------------------------------------

// The single-GPU layer (sm90, standard format) on the ranks' batches concatenated in rank order.
std::vector<uint16_t> single_gpu(const LayerWeights& w, const std::vector<uint16_t>& x, const std::vector<int32_t>& ids,
                                 const std::vector<float>& wts, int64_t T, int k) {
  Sm90Layer L(w, ActivationFormat::kStandard);
  L.reserve(T, k);
  const size_t row = size_t(w.cfg.hidden) * 2;
  EXPECT_EQ(cudaMemcpy2D(L.x(), size_t(L.x_stride()) * 2, x.data(), row, row, size_t(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(L.ids(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(L.weights(), wts.data(), wts.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  L.enqueue(nullptr, T, true);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d2h(L.y(), size_t(T * w.cfg.hidden));
}

// x as the experts see it after a quantized payload: bf16(dequant(quant(x))).
std::vector<uint16_t> fake_quant(const std::vector<uint16_t>& x, int64_t T, int H, ep::Payload p, float g) {
  if (p == ep::Payload::kBf16) return x;
  std::vector<uint16_t> out(x.size());
  std::vector<float> f(static_cast<size_t>(H)), back(static_cast<size_t>(H));
  std::vector<uint8_t> codes(static_cast<size_t>(H)), scales(static_cast<size_t>(H / 16));
  for (int64_t t = 0; t < T; ++t) {
    for (int c = 0; c < H; ++c) f[size_t(c)] = bf16_to_float(x[size_t(t * H + c)]);
    if (p == ep::Payload::kMxfp8) {
      quantize_row_mxfp8(f.data(), H, ScaleRule::kFloor, codes.data(), scales.data());
      dequantize_row_mxfp8(codes.data(), scales.data(), H, back.data());
    } else {
      quantize_row_nvfp4(f.data(), H, g, codes.data(), scales.data());
      dequantize_row_nvfp4(codes.data(), scales.data(), 1.0f / g, H, back.data());
    }
    for (int c = 0; c < H; ++c) out[size_t(t * H + c)] = float_to_bf16(back[size_t(c)]);
  }
  return out;
}

// A small EP layer problem: synthetic weights with biases, R ranks of up to 40 tokens (rank 1
// none), x values from the rank, token and column.
struct LayerCase {
  MoeModel m;
  ep::GroupConfig gc;
  std::vector<int64_t> T;
  uint32_t seed = 0;

  Batches batches() const {
    return make_batches(gc.shape, T, seed, nullptr, [](int r, int64_t t, int64_t c) {
      const float v = float(int((r * 131 + t * 31 + c * 7) % 97) - 48) / 24.0f;
      return float_to_bf16(v);
    });
  }
  // The single-GPU layer (on the current device) on the ranks' tokens concatenated in rank order,
  // as the payload quantized them.
  std::vector<uint16_t> single_gpu_y(const Batches& b) const {
    std::vector<uint16_t> x;
    std::vector<int32_t> ids;
    std::vector<float> w;
    int64_t all = 0;
    for (int r = 0; r < gc.shape.world; ++r) {
      x.insert(x.end(), b.x[size_t(r)].begin(), b.x[size_t(r)].end());
      ids.insert(ids.end(), b.host[size_t(r)].ids.begin(), b.host[size_t(r)].ids.end());
      w.insert(w.end(), b.host[size_t(r)].weights.begin(), b.host[size_t(r)].weights.end());
      all += T[size_t(r)];
    }
    return single_gpu(m, fake_quant(x, all, 256, gc.shape.payload, gc.nvfp4_g), ids, w, all, 4);
  }
  // Rank r's y against the single-GPU layer's rows of its tokens.
  void expect_rank_y(const Batches& b, int r, const std::vector<uint16_t>& want) const {
    int64_t off = 0;
    for (int q = 0; q < r; ++q) off += T[size_t(q)] * 256;
    const auto got = b.dy[size_t(r)]->to_host();
    int64_t bad = 0;
    for (int64_t i = 0; i < T[size_t(r)] * 256; ++i) bad += got[size_t(i)] != want[size_t(off + i)];
    EXPECT_EQ(bad, 0) << "rank " << r << ": elements that differ from the single-GPU layer";
  }
};

LayerCase layer_problem(WeightFormat wf, ep::Payload payload, int R, uint64_t seed) {
  // Whole segments in both layers, so every row's sum is the same sequence of fp32 operations
  // (the split-K choice depends on the problem's size).
  setenv("MOEKIT_SLICE_COST", "1000000", 1);
  MoeConfig cfg;
  cfg.num_experts = 16;
  cfg.top_k = 4;
  cfg.hidden = 256;
  cfg.intermediate = 192;
  cfg.format = wf;
  cfg.act = Activation::kSwigluOai;
  cfg.norm_topk_prob = true;
  SyntheticOptions so;
  so.seed = seed;
  so.biases = true;
  LayerCase c{make_synthetic_model(cfg, so), config(ep_shape(R, 16, 4, 256, 40, 40 * R)), {}, uint32_t(seed)};
  c.gc.shape.payload = payload;
  c.gc.nvfp4_g = nvfp4_global_scale(4.0f);
  for (int r = 0; r < R; ++r) c.T.push_back(r == 1 ? 0 : 40 - 7 * r % 40);
  return c;
}

void layer_case(WeightFormat wf, ep::Payload payload, int R, uint64_t seed) {
  SCOPED_TRACE(std::string(format_name(wf)) + " weights, " + ep::payload_name(payload) + " payload, R=" +
               std::to_string(R));
  const LayerCase c = layer_problem(wf, payload, R, seed);
  const Batches b = c.batches();
  EpLayer ep(c.m, c.gc, 0);
  ep.set_inputs(b.inputs(c.gc.shape));
  for (int r = 0; r < R; ++r) b.dy[size_t(r)]->poison();
  ep.forward(nullptr);
  ASSERT_EQ(ep.group().check(nullptr), "");
  const std::vector<uint16_t> want = c.single_gpu_y(b);
  for (int r = 0; r < R; ++r) c.expect_rank_y(b, r, want);
}

TEST(EpLayer, Bf16PayloadIsBitIdenticalToTheSingleGpuLayer) {
  for (int R : {1, 2, 4, 8}) layer_case(WeightFormat::kMxfp4, ep::Payload::kBf16, R, 20 + R);  // R = 1: the local pair
  layer_case(WeightFormat::kNvfp4, ep::Payload::kBf16, 4, 31);
}

TEST(EpLayer, QuantizedPayloadsEqualTheSingleGpuLayerOnQuantizedTokens) {
  for (ep::Payload p : {ep::Payload::kMxfp8, ep::Payload::kNvfp4})
    for (int R : {2, 8}) layer_case(WeightFormat::kMxfp4, p, R, 40 + R);
}

TEST(EpLayer, TheOracleRefusesQuantizationLeftToTheSm90Experts) {
  MoeConfig cfg;
  cfg.num_experts = 8;
  cfg.top_k = 2;
  cfg.hidden = 128;
  cfg.intermediate = 128;
  cfg.format = WeightFormat::kMxfp4;
  const MoeModel m = make_synthetic_model(cfg, SyntheticOptions{});
  ep::GroupConfig gc = config(ep_shape(2, 8, 2, 128, 4, 8, ep::Payload::kMxfp8));
  try {
    EpLayer bad(m, gc, 0, QuantizeSide::kExperts);
    ADD_FAILURE() << "paired";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not quantize its inputs"), std::string::npos) << e.what();
  }
}

// compute-sanitizer's reduced set: one small round through transport and combine, and a layer.
TEST(EpSanitize, SmallRound) {
  cudaStream_t st = nullptr;
  const ep::Shape s = ep_shape(2, 8, 2, 64, 5, 16);
  auto g = ep::Group::create_virtual(config(s, 60'000'000'000ull), 0);
  const Batches b = make_batches(s, {5, 3}, 77);
  const ep::HostDispatch d = ep::host_dispatch(s, b.host);
  g->set_inputs(b.inputs(s));
  g->dispatch(st);
  ASSERT_EQ(g->check(st), "");
  expect_layout(*g, s, b, d);
  expect_combine(*g, s, b, d, 3, st);
  layer_case(WeightFormat::kMxfp4, ep::Payload::kNvfp4, 2, 5);
}

// A one-rank NCCL communicator: the window from ncclMemAlloc + ncclCommWindowRegister, the peer
// table from the device API; the same round as a virtual rank.
TEST(EpNccl, OneRankCommunicator) {
  const ep::NcclInfo info = ep::nccl_info();
  RecordProperty("nccl", std::to_string(info.compiled_version) + " / " + std::to_string(info.runtime_version));
  if (!info.why.empty()) GTEST_SKIP() << info.why;
  std::vector<void*> comms = ep::NcclWindow::init_all(1);
  {
    const ep::Shape s = ep_shape(1, 8, 2, 128, 9, 32);
    auto g = ep::Group::create_nccl(config(s), comms[0]);
    EXPECT_EQ(g->rank(0), 0);
    const Batches b = make_batches(s, {9}, 8);
    const ep::HostDispatch d = ep::host_dispatch(s, b.host);
    for (int round = 0; round < 2; ++round) {
      g->set_inputs(b.inputs(s));
      g->dispatch(nullptr);
      ASSERT_EQ(g->check(nullptr), "");
      expect_layout(*g, s, b, d);
      expect_combine(*g, s, b, d, 2, nullptr);
    }
  }
  ep::NcclWindow::destroy_comm(comms[0]);
}


// ---- real GPUs: one thread per local GPU, each a rank of one NCCL communicator ---------------

// Runs f(rank, comm) on ranks 0..n-1 at once, rank r on GPU r, over a communicator of the first n
// GPUs. An exception in a rank is a test failure (its peers then time out, or wait in NCCL: the
// suite's time limit ends that).
void on_local_gpus(int n, const std::function<void(int, void*)>& f) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off (nothing here uses it)
  std::vector<void*> comms = ep::NcclWindow::init_all(n);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      try {
        ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
        f(r, comms[size_t(r)]);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (void* c : comms) ep::NcclWindow::destroy_comm(c);
}

// The world sizes to run: 2 and every local GPU (skipped below 2 GPUs or without NCCL).
std::vector<int> local_worlds() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  std::vector<int> w;
  if (n >= 2) w.push_back(2);
  if (n > 2) w.push_back(n);
  return w;
}

#define EP_SKIP_UNLESS_LOCAL_GPUS()                                                              \
  do {                                                                                           \
    const ep::NcclInfo info = ep::nccl_info();                                                   \
    if (!info.why.empty()) GTEST_SKIP() << info.why;                                             \
    if (local_worlds().empty()) GTEST_SKIP() << "one GPU: the multi-GPU EP tests need two or more"; \
  } while (0)

// Rank r's side of round_matches_host: its own batch, the layout it received, the combine.
void rank_round(ep::Group& g, int r, const ep::Shape& s, const std::vector<int64_t>& T, uint32_t seed,
                uint32_t combine_seed) {
  const Batches b = make_batches(s, T, seed);  // every rank draws all batches alike, sends its own
  const ep::HostDispatch d = ep::host_dispatch(s, b.host);
  ASSERT_EQ(d.overflow_expert, -1);
  g.set_inputs({b.inputs(s)[size_t(r)]});
  g.dispatch(nullptr);
  ASSERT_EQ(g.check(nullptr), "") << "rank " << r;
  expect_rank_layout(g.view(0), r, s, b, d);
  const std::vector<std::vector<float>> y = expert_rows(s, combine_seed);
  ASSERT_EQ(cudaMemcpy(g.view(0).y, y[size_t(r)].data(), y[size_t(r)].size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  b.dy[size_t(r)]->poison();
  g.combine(nullptr);
  ASSERT_EQ(g.check(nullptr), "") << "rank " << r;
  const auto got = b.dy[size_t(r)]->to_host();
  const auto want = ep::host_combine(s, d, b.host[size_t(r)], r, y);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 2), 0) << "rank " << r;
}

// The received layouts byte for byte and combine against the host model over NVLink: padded
// rows, a rank with no tokens, many rounds on one group, DeepSeek-V3's size.
TEST(EpNccl, LocalGpusMatchTheHostModel) {
  EP_SKIP_UNLESS_LOCAL_GPUS();
  for (int R : local_worlds()) {
    SCOPED_TRACE("R=" + std::to_string(R));
    on_local_gpus(R, [&](int r, void* comm) {
      {
        const ep::Shape s = ep_shape(R, 32, 4, 200, 37, 160);
        auto g = ep::Group::create_nccl(config(s), comm);
        EXPECT_EQ(g->rank(0), r);
        std::vector<int64_t> T;
        for (int q = 0; q < R; ++q) T.push_back(q == R - 1 ? 0 : 37 - 5 * q % 37);
        for (uint32_t round = 0; round < 3; ++round) rank_round(*g, r, s, T, 11u * R + round, round + 5u);
      }
      const ep::Shape s = ep_shape(R, 256, 8, 7168, 128, 128);
      auto g = ep::Group::create_nccl(config(s), comm);
      rank_round(*g, r, s, std::vector<int64_t>(size_t(R), 128), 99, 4);
    });
  }
}

// A rank that never dispatches: the others' waits end within the bound with the phase and the
// peer named, and after reset() (collective) the next round runs on every rank.
TEST(EpNccl, LocalGpusARankThatNeverArrivesTimesOut) {
  EP_SKIP_UNLESS_LOCAL_GPUS();
  const int R = local_worlds().front();
  const ep::Shape s = ep_shape(R, 16, 4, 64, 8, 64);
  on_local_gpus(R, [&](int r, void* comm) {
    // 500 ms: the ranks' threads are not in step between rounds (host work, copies).
    auto g = ep::Group::create_nccl(config(s, 500'000'000), comm);
    const std::vector<int64_t> T(size_t(R), 8);
    rank_round(*g, r, s, T, 5, 1);
    const Batches b = make_batches(s, T, 6);
    g->set_inputs({b.inputs(s)[size_t(r)]});
    if (r != R - 1) {
      const auto t0 = std::chrono::steady_clock::now();
      g->dispatch(nullptr);
      const std::string msg = g->check(nullptr);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_LT(ms, 500 + 2000) << "the waits are bounded";
      EXPECT_NE(msg.find("dispatch counts timed out"), std::string::npos) << msg;
      EXPECT_NE(msg.find("waited for rank " + std::to_string(R - 1)), std::string::npos) << msg;
      EXPECT_TRUE(g->poisoned());
    }
    g->reset();
    EXPECT_FALSE(g->poisoned());
    rank_round(*g, r, s, T, 7, 2);
  });
}

// The EP layer on real ranks: each GPU holds its E / R experts only; y equal bit for bit to the
// single-GPU layer (bf16 payload) or to it on the payload's quantized tokens (MXFP8, NVFP4).
TEST(EpNccl, LocalGpusLayerEqualsTheSingleGpuLayer) {
  EP_SKIP_UNLESS_LOCAL_GPUS();
  for (int R : local_worlds())
    for (ep::Payload p : {ep::Payload::kBf16, ep::Payload::kMxfp8, ep::Payload::kNvfp4}) {
      SCOPED_TRACE(std::string(ep::payload_name(p)) + " payload, R=" + std::to_string(R));
      const LayerCase c = layer_problem(WeightFormat::kMxfp4, p, R, 60 + R);
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      const std::vector<uint16_t> want = c.single_gpu_y(c.batches());
      on_local_gpus(R, [&](int r, void* comm) {
        const Batches b = c.batches();
        EpLayer ep(c.m, c.gc, comm);
        EXPECT_EQ(ep.group().rank(0), r);
        ep.set_inputs({b.inputs(c.gc.shape)[size_t(r)]});
        b.dy[size_t(r)]->poison();
        ep.forward(nullptr);
        ASSERT_EQ(ep.group().check(nullptr), "") << "rank " << r;
        c.expect_rank_y(b, r, want);
      });
    }
}

}  // namespace
}  // namespace moekit
