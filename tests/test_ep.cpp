// Expert parallelism on the CPU: the window's bytes from the payload dtype, shape checks, the
// host model of dispatch/combine (the GPU tests' oracle) on its own terms, the pairing rule of
// the activations' quantization, the error text, and NCCL's absence handled.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "moekit/comm/ep_host.h"
#include "ep_testutil.h"
#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/formats/mxfp8.h"
#include "moekit/formats/nvfp4.h"
#include "moekit/oracle/oracle.h"
#include "moekit/oracle/pairing.h"
#ifdef MOEKIT_WITH_CUDA
#include "moekit/comm/nccl_window.h"
#endif

namespace moekit {
namespace {

using test::ep_shape;

// Random distinct ids per token, some -1.
std::vector<ep::RankBatch> random_batches(const ep::Shape& s, const std::vector<int64_t>& T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<ep::RankBatch> b(T.size());
  for (size_t r = 0; r < T.size(); ++r) {
    b[r].T = T[r];
    for (int64_t t = 0; t < T[r]; ++t) {
      std::vector<int32_t> e(size_t(s.num_experts));
      for (int i = 0; i < s.num_experts; ++i) e[size_t(i)] = i;
      std::shuffle(e.begin(), e.end(), rng);
      for (int j = 0; j < s.top_k; ++j) {
        b[r].ids.push_back(rng() % 5 == 0 ? -1 : e[size_t(j)]);
        b[r].weights.push_back(float(rng() % 1000) / 1000.0f);
      }
    }
  }
  return b;
}

TEST(Ep, PayloadBytesFollowTheDtype) {
  // SPEC section 5: bytes/token = H elem + scales.
  EXPECT_EQ(ep::payload_row_bytes(ep::Payload::kBf16, 7168), 14336);
  EXPECT_EQ(ep::payload_row_bytes(ep::Payload::kMxfp8, 7168), 7168 + 224);
  EXPECT_EQ(ep::payload_row_bytes(ep::Payload::kNvfp4, 7168), 3584 + 448);
  // Scales start 16-byte aligned: H = 2880 (GPT-OSS): mxfp8 2880 + 90 -> 2880 + 96.
  EXPECT_EQ(ep::payload_row_bytes(ep::Payload::kMxfp8, 2880), 2880 + 96);
  const ep::Shape b = ep_shape(8, 256, 8, 7168, 128, 1024);
  ep::Shape q = b;
  q.payload = ep::Payload::kNvfp4;
  const ep::Window wb = ep::Window::of(b), wq = ep::Window::of(q);
  EXPECT_EQ(wb.bytes % 4096, 0);
  EXPECT_EQ(wb.y - wb.payload, ep::align_up(32 * 1024 * 7168 * 2, 256));
  EXPECT_EQ(wq.y - wq.payload, ep::align_up(32 * 1024 * 4032, 256));
  EXPECT_LT(ep::workspace_bytes(q).window, ep::workspace_bytes(b).window);
  EXPECT_GT(ep::workspace_bytes(q).local, ep::workspace_bytes(b).local);  // dequantized rows live locally
  for (const ep::Shape& s : {b, q}) {
    const ep::Window w = ep::Window::of(s);
    EXPECT_EQ(w.meta % 256, 0);
    EXPECT_EQ(w.payload % 256, 0);
    EXPECT_EQ(w.y % 256, 0);
    EXPECT_GE(w.cnt, 8 * ep::kCtrlHead);
    // The fan-out dispatch's landing rows: one per (source rank, token), after y, in every
    // window whatever the variant.
    EXPECT_EQ(w.fan % 256, 0);
    EXPECT_GE(w.fan, w.y + s.rows() * s.y_row_bytes());
    EXPECT_GE(w.bytes, w.fan + int64_t(8) * 128 * ep::payload_row_bytes(s.payload, 7168));
  }
}

TEST(Ep, ShapeChecksNameTheProblem) {
  auto msg = [](const ep::Shape& s) {
    try {
      ep::validate(s);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(msg(ep_shape(8, 256, 8, 7168, 128, 1024)), "");
  EXPECT_NE(msg(ep_shape(3, 256, 8, 7168, 128, 1024)).find("do not divide over 3 ranks"), std::string::npos);
  EXPECT_NE(msg(ep_shape(2, 16, 4, 100, 8, 8)).find("multiple of 8"), std::string::npos);
  EXPECT_NE(msg(ep_shape(2, 16, 4, 80, 8, 8, ep::Payload::kMxfp8)).find("multiple of 32"), std::string::npos);
  EXPECT_NE(msg(ep_shape(2, 16, 4, 64, 8, 0)).find("capacity"), std::string::npos);
  EXPECT_EQ(ep::parse_payload("nvfp4"), ep::Payload::kNvfp4);
  EXPECT_THROW(ep::parse_payload("fp8"), Error);
}

// The host model's layout: every valid slot lands exactly once, rows of an expert in (source
// rank, token, slot) order, meta names its source, -1 past the counts.
TEST(Ep, HostModelLayoutIsTheStablePermute) {
  for (int R : {1, 2, 4, 8}) {
    SCOPED_TRACE(R);
    const ep::Shape s = ep_shape(R, 16, 4, 64, 13, 64);
    std::vector<int64_t> T;
    for (int r = 0; r < R; ++r) T.push_back(r == 1 ? 0 : 3 + 5 * r % 13);  // rank 1: no tokens
    const auto b = random_batches(s, T, 7u + R);
    const ep::HostDispatch d = ep::host_dispatch(s, b);
    ASSERT_EQ(d.overflow_expert, -1);
    const int El = s.local_experts();
    int64_t placed = 0;
    for (int q = 0; q < R; ++q)
      for (int el = 0; el < El; ++el) {
        const int e = q * El + el;
        int32_t prev = -1;
        for (int row = 0; row < s.capacity; ++row) {
          const ep::RowMeta& m = d.meta[size_t(q)][size_t(el * s.capacity + row)];
          if (row >= d.local_count[size_t(q)][size_t(el)]) {
            EXPECT_EQ(m.expert, -1);
            continue;
          }
          EXPECT_EQ(m.expert, e);
          const int src = m.src >> ep::kSrcTokenBits, t = m.src & ((1 << ep::kSrcTokenBits) - 1);
          EXPECT_EQ(b[size_t(src)].ids[size_t(t * s.top_k + m.slot)], e);
          EXPECT_EQ(d.slot_row[size_t(src)][size_t(t * s.top_k + m.slot)], el * s.capacity + row);
          const int32_t key = src * 1000 + t;  // stable: source rank, then token
          EXPECT_GT(key, prev);
          prev = key;
          ++placed;
        }
      }
    int64_t valid = 0;
    for (const auto& rb : b) valid += std::count_if(rb.ids.begin(), rb.ids.end(), [](int32_t i) { return i >= 0; });
    EXPECT_EQ(placed, valid);
  }
}

TEST(Ep, HostModelOverflowMovesNothing) {
  const ep::Shape s = ep_shape(2, 4, 2, 64, 8, 5);
  std::vector<ep::RankBatch> b(2);
  for (int r = 0; r < 2; ++r) {
    b[size_t(r)].T = 3;
    for (int t = 0; t < 3; ++t) {
      b[size_t(r)].ids.insert(b[size_t(r)].ids.end(), {1, t == 2 ? -1 : 3});
      b[size_t(r)].weights.insert(b[size_t(r)].weights.end(), {0.5f, 0.5f});
    }
  }
  const ep::HostDispatch d = ep::host_dispatch(s, b);
  EXPECT_EQ(d.overflow_expert, 1);  // 6 rows for expert 1, capacity 5
  EXPECT_EQ(d.overflow_rows, 6);
  for (const auto& v : d.slot_row)
    for (int32_t g : v) EXPECT_EQ(g, -1);
}

TEST(Ep, HostCombineSumsSlotsInOrder) {
  const ep::Shape s = ep_shape(2, 4, 3, 8, 2, 8);
  std::vector<ep::RankBatch> b(2);
  b[0] = {2, {0, 2, -1, 3, 1, 0}, {1, 1, 1, 1, 1, 1}};
  b[1] = {1, {2, 1, 3}, {1, 1, 1}};
  const ep::HostDispatch d = ep::host_dispatch(s, b);
  // y rows: value = 1 + the row's (rank, index), so the sum says which rows were read.
  std::vector<std::vector<float>> y(2, std::vector<float>(size_t(s.rows() * s.hidden)));
  for (int q = 0; q < 2; ++q)
    for (int64_t i = 0; i < s.rows() * s.hidden; ++i) y[size_t(q)][size_t(i)] = float(q * 100 + i / s.hidden);
  const std::vector<uint16_t> out = ep::host_combine(s, d, b[0], 0, y);
  for (int t = 0; t < 2; ++t) {
    float want = 0;
    for (int j = 0; j < 3; ++j) {
      const int32_t g = d.slot_row[0][size_t(t * 3 + j)];
      if (g >= 0) want += float((b[0].ids[size_t(t * 3 + j)] / 2) * 100 + g);
    }
    EXPECT_EQ(bf16_to_float(out[size_t(t * s.hidden)]), round_bf16(want));
  }
}

// bf16_sum rows: each rank's slots of a token summed (weighted, j order) and rounded to bf16 on
// that rank, the partials added in rank order: here 1 + 2^-8 on rank 0 rounds to 1 before rank
// 1's 2^-8 is added, where bf16 rows sum all three slots first (1 + 2^-7, a bf16 value).
TEST(Ep, HostCombineBf16SumRoundsEachRanksPartial) {
  ep::Shape s = ep_shape(2, 4, 3, 8, 1, 8);
  std::vector<ep::RankBatch> b(2);
  b[0] = {1, {0, 2, 1}, {1, 1, 1}};  // experts 0, 1 on rank 0 (slots 0, 2), expert 2 on rank 1 (slot 1)
  b[1] = {0, {}, {}};
  const ep::HostDispatch d = ep::host_dispatch(s, b);
  std::vector<std::vector<float>> y(2, std::vector<float>(size_t(s.rows() * s.hidden), 0.0f));
  const float tiny = 1.0f / 256;  // 2^-8
  auto row = [&](int t, int j) { return size_t(d.slot_row[0][size_t(t * 3 + j)]) * size_t(s.hidden); };
  for (int c = 0; c < s.hidden; ++c) {
    y[0][row(0, 0) + size_t(c)] = 1.0f;
    y[0][row(0, 2) + size_t(c)] = tiny;
    y[1][row(0, 1) + size_t(c)] = tiny;
  }
  s.combine = ep::CombineRows::kBf16;
  const std::vector<uint16_t> rows = ep::host_combine(s, d, b[0], 0, y);
  s.combine = ep::CombineRows::kBf16Sum;
  const std::vector<uint16_t> sums = ep::host_combine(s, d, b[0], 0, y);
  for (int c = 0; c < s.hidden; ++c) {
    EXPECT_EQ(bf16_to_float(rows[size_t(c)]), 1.0f + 2 * tiny);
    EXPECT_EQ(bf16_to_float(sums[size_t(c)]), 1.0f);
  }
}

TEST(Ep, ErrorTextNamesPhaseRankPeerAndRound) {
  ep::ErrorRecord e{int(ep::Phase::kCounts), 1, 2, 0, 3, 0, 3};
  const std::string m = ep::describe(e, 50'000'000);
  for (const char* want : {"dispatch counts", "rank 1", "rank 2", "round 3", "expected epoch 3", "saw 0", "50 ms"})
    EXPECT_NE(m.find(want), std::string::npos) << m;
  ep::ErrorRecord c{int(ep::Phase::kCapacity), 0, 5, 0, 64, 70, 2};
  const std::string mc = ep::describe(c, 0);
  for (const char* want : {"expert 5", "70 rows", "capacity of 64", "round 2", "no row was sent"})
    EXPECT_NE(mc.find(want), std::string::npos) << mc;
}

// SPEC section 6: which side quantizes is checked when the halves pair.
TEST(Ep, PairingChecksTheQuantizingSide) {
  BackendCaps sm90;  // what the SM90 experts declare: bf16 in, no quantization of their own
  sm90.name = "sm90_batched";
  sm90.activation_format = ActivationFormat::kBatched;
  PrepareContract pf{"ep_mxfp8", ActivationFormat::kBatched, InputQuant::kMxfp8, QuantizeSide::kPrepare, true};
  EXPECT_TRUE(pair_supports(pf, sm90).ok);
  pf.side = QuantizeSide::kExperts;  // deferred to experts that do not quantize
  Support s = pair_supports(pf, sm90);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("does not quantize its inputs"), std::string::npos) << s.reason;
  pf.side = QuantizeSide::kPrepare;
  pf.hands_bf16 = false;  // codes to experts that read bf16 only
  s = pair_supports(pf, sm90);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("reads bf16 rows only"), std::string::npos) << s.reason;
  BackendCaps w8a8 = sm90;  // experts that quantize their inputs themselves
  w8a8.name = "w8a8";
  w8a8.quantizes_inputs = {InputQuant::kMxfp8};
  w8a8.takes_quantized = {InputQuant::kMxfp8};
  pf.hands_bf16 = true;
  s = pair_supports(pf, w8a8);  // prepare quantized, the experts would again
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("again"), std::string::npos);
  pf.hands_bf16 = false;
  EXPECT_TRUE(pair_supports(pf, w8a8).ok);
  pf.side = QuantizeSide::kExperts;
  EXPECT_TRUE(pair_supports(pf, w8a8).ok);
  pf.quant = InputQuant::kNone;
  pf.format = ActivationFormat::kStandard;
  s = pair_supports(pf, sm90);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("standard"), std::string::npos);
  // The registered backends declare no activation quantization of their own.
  for (const Backend* b : all_backends()) EXPECT_TRUE(b->caps().quantizes_inputs.empty()) << b->caps().name;
}

// The block quantizers are shared by the host and the dispatch kernel: spot-check them against
// the row functions they now serve.
TEST(Ep, BlockQuantizersMatchTheRowFunctions) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> x(64);
  for (float& v : x) v = round_bf16(nd(rng));
  uint8_t c1[64], s1[2], c2[32], s2[4];
  quantize_row_mxfp8(x.data(), 64, ScaleRule::kRceil, c1, s1);
  for (int b = 0; b < 2; ++b) {
    uint8_t c[32];
    EXPECT_EQ(quantize_block_mxfp8(x.data() + 32 * b, ScaleRule::kRceil, c), s1[b]);
    EXPECT_EQ(std::vector<uint8_t>(c, c + 32), std::vector<uint8_t>(c1 + 32 * b, c1 + 32 * b + 32));
  }
  const float g = nvfp4_global_scale(8.0f);
  quantize_row_nvfp4(x.data(), 64, g, c2, s2);
  for (int b = 0; b < 4; ++b) {
    uint8_t c[8];
    EXPECT_EQ(quantize_block_nvfp4(x.data() + 16 * b, g, c), s2[b]);
    EXPECT_EQ(std::vector<uint8_t>(c, c + 8), std::vector<uint8_t>(c2 + 8 * b, c2 + 8 * b + 8));
  }
}

#ifdef MOEKIT_WITH_CUDA
// NCCL is loaded at run time: without it (or with another version than the headers of the
// build) the EP-over-NCCL entry says why, and nothing else needs it.
TEST(Ep, NcclAbsenceIsAClearError) {
  const ep::NcclInfo i = ep::nccl_info();
  RecordProperty("nccl_why", i.why);
  if (i.why.empty()) GTEST_SKIP() << "NCCL " << i.runtime_version << " is loadable here";
  try {
    ep::NcclWindow::create(nullptr, 4096, 1);
    ADD_FAILURE() << "created";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("EP over NCCL"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(i.why), std::string::npos) << e.what();
  }
}
#endif

}  // namespace
}  // namespace moekit
