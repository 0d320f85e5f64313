// Helpers of the EP GPU tests (test_ep_gpu.cpp: virtual ranks and threads; test_ep_rank.cpp:
// one process per rank): provenance-encoded batches, the received layout and combine against
// the host model (comm/ep_host.h), and the single-GPU layer on the ranks' tokens.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../ep_testutil.h"
#include "gpu_util.h"
#include "moekit/backends/ep_layer.h"
#include "moekit/backends/sm90_layer.h"
#include "moekit/comm/ep_group.h"
#include "moekit/comm/ep_host.h"
#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/formats/mxfp8.h"
#include "moekit/formats/nvfp4.h"
#include "moekit/model/synthetic.h"

namespace moekit::ep_test {

using test::DeviceBuffer;

using test::ep_shape;

// The dispatch variants (ep_layout.h Dispatch), as $MOEKIT_EP_DISPATCH names them: a group reads
// the variable when it is made (GroupConfig::dispatch -1), so a test body run under each value
// makes every group of it, the EP layer's too, use that variant.
inline const char* const kDispatchVariants[] = {"direct", "fanout"};

// Sets $MOEKIT_EP_DISPATCH for a scope, then restores it.
struct DispatchEnv {
  std::string old;
  bool had = false;
  explicit DispatchEnv(const char* v) {
    if (const char* o = std::getenv("MOEKIT_EP_DISPATCH")) old = o, had = true;
    setenv("MOEKIT_EP_DISPATCH", v, 1);
  }
  ~DispatchEnv() {
    if (had) setenv("MOEKIT_EP_DISPATCH", old.c_str(), 1);
    else unsetenv("MOEKIT_EP_DISPATCH");
  }
};

inline void for_each_dispatch(const std::function<void()>& body) {
  for (const char* v : kDispatchVariants) {
    SCOPED_TRACE(std::string("MOEKIT_EP_DISPATCH=") + v);
    DispatchEnv env(v);
    body();
  }
}

// TEST_BOTH_DISPATCH(Suite, Name) { body }: a test whose body runs once per dispatch variant.
#define TEST_BOTH_DISPATCH(suite, name)                                 \
  void suite##_##name##_body();                                         \
  TEST(suite, name) { ::moekit::ep_test::for_each_dispatch(suite##_##name##_body); } \
  void suite##_##name##_body()

// A provenance value: source rank, token and column are readable from the bits.
inline uint16_t provenance(int r, int64_t t, int64_t c) {
  return uint16_t((uint32_t(r) * 0x9E37u + uint32_t(t) * 0x85EBu + uint32_t(c) * 0xC2B3u) & 0x3fffu);  // finite
}

// Per rank: ids with an id pattern, weights, x; and the device copies.
struct Batches {
  std::vector<ep::RankBatch> host;
  std::vector<std::vector<uint16_t>> x;  // [T, H] bf16
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> dx, dy;
  std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> dids;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> dw;
  int64_t y_pad = 0;  // y rows y_pad columns wider than H (pad_y)

  std::vector<ep::RankInput> inputs(const ep::Shape& s) const {
    std::vector<ep::RankInput> in(host.size());
    for (size_t r = 0; r < host.size(); ++r) {
      in[r].T = host[r].T;
      in[r].x = dx[r]->ptr;
      in[r].x_stride = s.hidden;
      in[r].ids = dids[r]->ptr;
      in[r].weights = dw[r]->ptr;
      in[r].y = dy[r]->ptr;
      in[r].y_stride = s.hidden + y_pad;
    }
    return in;
  }
};

using IdFn = std::function<int32_t(int r, int64_t t, int j, std::mt19937& rng)>;

// Distinct experts per token from a random permutation, 1 in 6 slots -1.
inline int32_t random_id(const ep::Shape& s, int64_t t, int j, std::mt19937& rng, std::vector<int32_t>& perm) {
  if (j == 0) {
    perm.resize(size_t(s.num_experts));
    for (int i = 0; i < s.num_experts; ++i) perm[size_t(i)] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
  }
  (void)t;
  return rng() % 6 == 0 ? -1 : perm[size_t(j)];
}

inline Batches make_batches(const ep::Shape& s, const std::vector<int64_t>& T, uint32_t seed, const IdFn& id = nullptr,
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
inline void expect_rank_layout(const ep::RankView& v, int q, const ep::Shape& s, const Batches& b, const ep::HostDispatch& d) {
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

inline void expect_layout(ep::Group& g, const ep::Shape& s, const Batches& b, const ep::HostDispatch& d) {
  for (int q = 0; q < s.world; ++q) expect_rank_layout(g.view(q), q, s, b, d);
}

// The expert output rows of every rank (fp32, as GEMM2 writes them), from a seed.
inline std::vector<std::vector<float>> expert_rows(const ep::Shape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::vector<float>> y(size_t(s.world), std::vector<float>(size_t(s.rows() * s.hidden)));
  for (auto& rows : y)
    for (float& v : rows) v = nd(rng);
  return y;
}

// A rank's expert output rows where combine pulls them: fp32 rows into the window, or bf16 rows
// (the fp32 values rounded) into the window's bf16 rows.
inline void put_rows(const ep::RankView& v, const ep::Shape& s, const std::vector<float>& y) {
  if (s.combine == ep::CombineRows::kF32) {
    ASSERT_EQ(cudaMemcpy(v.y, y.data(), y.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    return;
  }
  std::vector<uint16_t> h(y.size());
  for (size_t i = 0; i < y.size(); ++i) h[i] = float_to_bf16(y[i]);
  ASSERT_EQ(cudaMemcpy(v.y_bf16, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
}

// The ranks' y rows pad columns wider than H (a stride that is not a multiple of 8 takes the
// combine's 4-columns-a-lane kernel); the pad columns must keep their poison.
inline void pad_y(Batches& b, const ep::Shape& s, int64_t pad) {
  b.y_pad = pad;
  for (size_t r = 0; r < b.dy.size(); ++r)
    b.dy[r] = std::make_unique<DeviceBuffer<uint16_t>>(size_t(std::max<int64_t>(b.host[r].T, 1) * (s.hidden + pad)));
}

// y rows filled by the test (as if the experts wrote them), combine, and the host's sum.
inline void expect_combine(ep::Group& g, const ep::Shape& s, const Batches& b, const ep::HostDispatch& d, uint32_t seed,
                    cudaStream_t st) {
  const std::vector<std::vector<float>> y = expert_rows(s, seed);
  for (int q = 0; q < s.world; ++q) put_rows(g.view(q), s, y[size_t(q)]);
  for (int r = 0; r < s.world; ++r) b.dy[size_t(r)]->poison();
  g.combine(st);
  ASSERT_EQ(g.check(st), "");
  const int64_t H = s.hidden, ys = H + b.y_pad;
  for (int r = 0; r < s.world; ++r) {
    const auto got = b.dy[size_t(r)]->to_host();
    const auto want = ep::host_combine(s, d, b.host[size_t(r)], r, y);
    int64_t bad = 0, pad_written = 0;
    for (int64_t t = 0; t < b.host[size_t(r)].T; ++t) {
      bad += std::memcmp(&got[size_t(t * ys)], &want[size_t(t * H)], size_t(H) * 2) != 0;
      for (int64_t c = H; c < ys; ++c) pad_written += got[size_t(t * ys + c)] != 0xffffu;
    }
    EXPECT_EQ(bad, 0) << "rank " << r << ": rows that differ from the host model";
    EXPECT_EQ(pad_written, 0) << "rank " << r << ": pad columns written";
  }
}

inline ep::GroupConfig config(const ep::Shape& s, uint64_t timeout_ns = 5'000'000'000ull) {
  ep::GroupConfig c;
  c.shape = s;
  c.timeout_ns = timeout_ns;
  return c;
}

// One round on g: random batches of T[r] tokens per rank, dispatch, the layout and the combine
// against the host model.
inline void round_matches_host(ep::Group& g, const ep::Shape& s, const std::vector<int64_t>& T, uint32_t seed,
                        uint32_t combine_seed, cudaStream_t st, int64_t y_pad = 0) {
  Batches b = make_batches(s, T, seed);
  if (y_pad) pad_y(b, s, y_pad);
  const ep::HostDispatch d = ep::host_dispatch(s, b.host);
  ASSERT_EQ(d.overflow_expert, -1);
  g.set_inputs(b.inputs(s));
  g.dispatch(st);
  ASSERT_EQ(g.check(st), "");
  expect_layout(g, s, b, d);
  expect_combine(g, s, b, d, combine_seed, st);
}

// ---- the layer --------------------------------------------------------------------------------

// The single-GPU layer (sm90, standard format) on the ranks' batches concatenated in rank order.
inline std::vector<uint16_t> single_gpu(const LayerWeights& w, const std::vector<uint16_t>& x, const std::vector<int32_t>& ids,
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
inline std::vector<uint16_t> fake_quant(const std::vector<uint16_t>& x, int64_t T, int H, ep::Payload p, float g) {
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

inline LayerCase layer_problem(WeightFormat wf, ep::Payload payload, int R, uint64_t seed) {
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

inline void layer_case(WeightFormat wf, ep::Payload payload, int R, uint64_t seed) {
  SCOPED_TRACE(std::string(format_name(wf)) + " weights, " + ep::payload_name(payload) + " payload, R=" +
               std::to_string(R));
  const LayerCase c = layer_problem(wf, payload, R, seed);
  const Batches b = c.batches();
  ParallelLayer ep(c.m, c.gc, 0);
  ep.set_kernels(ParallelLayer::Kernels::kDecode);  // single_gpu's kernel: the same sums
  ep.set_inputs(b.inputs(c.gc.shape));
  for (int r = 0; r < R; ++r) b.dy[size_t(r)]->poison();
  ep.forward(nullptr);
  ASSERT_EQ(ep.group().check(nullptr), "");
  const std::vector<uint16_t> want = c.single_gpu_y(b);
  for (int r = 0; r < R; ++r) c.expect_rank_y(b, r, want);
}


// Rank r's side of round_matches_host: its own batch, the layout it received, the combine.
inline void rank_round(ep::Group& g, int r, const ep::Shape& s, const std::vector<int64_t>& T, uint32_t seed,
                uint32_t combine_seed) {
  const Batches b = make_batches(s, T, seed);  // every rank draws all batches alike, sends its own
  const ep::HostDispatch d = ep::host_dispatch(s, b.host);
  ASSERT_EQ(d.overflow_expert, -1);
  g.set_inputs({b.inputs(s)[size_t(r)]});
  g.dispatch(nullptr);
  ASSERT_EQ(g.check(nullptr), "") << "rank " << r;
  expect_rank_layout(g.view(0), r, s, b, d);
  const std::vector<std::vector<float>> y = expert_rows(s, combine_seed);
  put_rows(g.view(0), s, y[size_t(r)]);
  b.dy[size_t(r)]->poison();
  g.combine(nullptr);
  ASSERT_EQ(g.check(nullptr), "") << "rank " << r;
  const auto got = b.dy[size_t(r)]->to_host();
  const auto want = ep::host_combine(s, d, b.host[size_t(r)], r, y);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 2), 0) << "rank " << r;
}

// Rank r's side of the layouts test: padded rows, a rank with no tokens (the last), three rounds on
// one group; then a round of DeepSeek-V3's size.
inline void layout_rounds(int R, int r, void* comm, ep::CombineRows rows, bool dsv3_size) {
  {
    ep::Shape s = ep_shape(R, 32, 4, 200, 37, 160);
    s.combine = rows;
    auto g = ep::Group::create_nccl(config(s), comm);
    EXPECT_EQ(g->rank(0), r);
    std::vector<int64_t> T;
    for (int q = 0; q < R; ++q) T.push_back(q == R - 1 ? 0 : 37 - 5 * q % 37);
    for (uint32_t round = 0; round < 3; ++round) rank_round(*g, r, s, T, 11u * R + round, round + 5u);
  }
  if (!dsv3_size) return;
  ep::Shape s = ep_shape(R, 256, 8, 7168, 128, 128);
  s.combine = rows;
  auto g = ep::Group::create_nccl(config(s), comm);
  rank_round(*g, r, s, std::vector<int64_t>(size_t(R), 128), 99, 4);
}

}  // namespace moekit::ep_test
