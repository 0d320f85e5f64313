// Expert parallelism on one GPU with virtual ranks (comm/): the received layout byte for byte
// against the host model with provenance-encoded payloads, combine against the host sum, the EP
// layer bit-identical to the single-GPU layer (bf16, MXFP8, NVFP4 payloads), -1 ids, a token
// whose experts all live on one rank, a rank with no tokens, capacity overflow, a rank that never
// arrives (dispatch and combine), the abort word, many rounds, and a one-rank NCCL communicator.
// With two or more GPUs (EpNccl.LocalGpus*): the same checks on real ranks over NVLink, one thread
// per GPU in one NCCL communicator: layouts and combine, a rank that never dispatches, the layer.
// The layout, layer and fault tests (TEST_BOTH_DISPATCH) and the multi-process scenarios run under
// both dispatch variants (MOEKIT_EP_DISPATCH=direct, fanout: the same layouts and outputs).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ep_gpu_util.h"
#include "moekit/experts/reference.h"
#include "gpu_util.h"
#include "moekit/backends/ep_layer.h"
#include "moekit/backends/sm90_layer.h"
#include "moekit/comm/ep_group.h"
#include "moekit/comm/ep_host.h"
#include "moekit/comm/ep_kernels_sm90.cuh"  // TraceEvent
#include "../ep_testutil.h"
#include "moekit/comm/nccl_window.h"
#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/formats/mxfp8.h"
#include "moekit/formats/nvfp4.h"
#include "moekit/model/synthetic.h"

extern char** environ;

namespace moekit {
namespace {

using namespace ep_test;

TEST_BOTH_DISPATCH(EpTransport, VirtualRanksMatchTheHostModel) {
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
TEST_BOTH_DISPATCH(EpTransport, DeepSeekScale) {
  cudaStream_t st = nullptr;
  const ep::Shape s = ep_shape(8, 256, 8, 7168, 128, 128);
  auto g = ep::Group::create_virtual(config(s), 0);
  round_matches_host(*g, s, std::vector<int64_t>(8, 128), 99, 4, st);
}

// Prefill sizes: 700 tokens x 8 slots per rank take the plan in grids (kWidePlanFrom entries) on
// every rank; the layout and the combine as the host model says.
TEST_BOTH_DISPATCH(EpTransport, PrefillSizedRanks) {
  cudaStream_t st = nullptr;
  const ep::Shape s = ep_shape(2, 16, 8, 64, 700, 1400);  // an expert gets at most 700 rows per rank
  auto g = ep::Group::create_virtual(config(s), 0);
  round_matches_host(*g, s, {700, 523}, 31, 6, st);
}

// bf16 combine rows (half the bytes): every row rounded to bf16 once and weighted in combine,
// fma(w_j, row, acc) in j order, and a shared expert's rows added before the one rounding: y
// equal to the host model bit for bit; and bf16 rows summed per rank first (bf16_sum: each
// rank's bf16 partial of its slots in j order, the partials added in rank order).
TEST_BOTH_DISPATCH(EpTransport, Bf16CombineRowsAndTheSharedExpertMatchTheHostModel) {
  cudaStream_t st = nullptr;
  for (int R : {1, 2, 4}) {
    for (bool with_shared : {false, true}) {
      SCOPED_TRACE("R=" + std::to_string(R) + (with_shared ? ", shared" : ""));
      for (ep::CombineRows rows : {ep::CombineRows::kF32, ep::CombineRows::kBf16, ep::CombineRows::kBf16Sum}) {
        ep::Shape s = ep_shape(R, 32, 4, 200, 37, 160);
        s.combine = rows;
        auto g = ep::Group::create_virtual(config(s), 0);
        std::vector<int64_t> T;
        for (int r = 0; r < R; ++r) T.push_back(r == R - 1 && R > 1 ? 0 : 37 - 5 * r % 37);
        const Batches b = make_batches(s, T, 17u * R + (with_shared ? 1 : 0));
        const ep::HostDispatch d = ep::host_dispatch(s, b.host);
        std::vector<std::vector<uint16_t>> sh(static_cast<size_t>(R), std::vector<uint16_t>{});
        std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> dsh;
        std::vector<ep::RankInput> in = b.inputs(s);
        for (int r = 0; r < R; ++r) {
          sh[size_t(r)].resize(size_t(std::max<int64_t>(T[size_t(r)], 1) * s.hidden));
          for (size_t i = 0; i < sh[size_t(r)].size(); ++i)
            sh[size_t(r)][i] = float_to_bf16(float(int(i * 7 + size_t(r)) % 23 - 11) / 8.0f);
          dsh.push_back(std::make_unique<DeviceBuffer<uint16_t>>(sh[size_t(r)]));
          if (with_shared) in[size_t(r)].shared = dsh.back()->ptr, in[size_t(r)].shared_stride = s.hidden;
        }
        g->set_inputs(in);
        g->dispatch(st);
        ASSERT_EQ(g->check(st), "");
        const std::vector<std::vector<float>> y = expert_rows(s, 5);
        for (int q = 0; q < R; ++q) put_rows(g->view(q), s, y[size_t(q)]);
        for (int r = 0; r < R; ++r) b.dy[size_t(r)]->poison();
        g->combine(st);
        ASSERT_EQ(g->check(st), "");
        for (int r = 0; r < R; ++r) {
          const auto got = b.dy[size_t(r)]->to_host();
          const auto want = ep::host_combine(s, d, b.host[size_t(r)], r, y, with_shared ? &sh[size_t(r)] : nullptr);
          EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 2), 0) << "rank " << r;
        }
      }
    }
  }
}

// The kernels' grids follow the round's slots (one warp a slot), and the trace stamps every phase
// of every CTA in order.
TEST_BOTH_DISPATCH(EpTransport, GridsFollowTheSlotsAndTheTraceStampsEveryPhase) {
  cudaStream_t st = nullptr;
  const ep::Shape s = ep_shape(2, 32, 4, 256, 96, 192);
  auto g = ep::Group::create_virtual(config(s), 0);
  const char* variant = std::getenv("MOEKIT_EP_DISPATCH");
  const bool fanout = variant && std::string(variant) == "fanout";
  for (int64_t T : {int64_t(1), int64_t(3), int64_t(96)}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    const Batches b = make_batches(s, {T, T}, 3u + uint32_t(T));
    const ep::HostDispatch d = ep::host_dispatch(s, b.host);
    g->set_inputs(b.inputs(s));
    g->enable_trace(true);
    g->dispatch(st);
    ASSERT_EQ(g->check(st), "");
    expect_layout(*g, s, b, d);
    expect_combine(*g, s, b, d, 2, st);
    const ep::Group::Trace t = g->trace();
    const int want = int(std::min<int64_t>(std::max<int64_t>((T * 4 + 15) / 16, 4), g->ctas_per_rank()));  // >= 4
    EXPECT_EQ(t.dispatch_ctas, want);
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < t.dispatch_ctas; ++c) {
        const uint64_t* e = t.dispatch.data() + (size_t(r) * t.max_ctas + size_t(c)) * ep::kTraceEvents;
        for (int ev : {ep::kTrPublished, ep::kTrCountsSeen, ep::kTrDataDone, ep::kTrSignaled})
          EXPECT_GE(e[ev], e[ev - 1]) << "rank " << r << " CTA " << c << " event " << ev;
        EXPECT_NE(e[ep::kTrSignaled], 0u);
        if (c == 0) {
          EXPECT_GE(e[ep::kTrAllDone], e[ep::kTrSignaled]);
        }
        if (fanout) {  // every CTA waits for the peers' rows, then copies its share of the later slots' rows
          EXPECT_GE(e[ep::kTrFanWait], e[ep::kTrSignaled]) << "rank " << r << " CTA " << c;
          EXPECT_GE(e[ep::kTrFanned], e[ep::kTrFanWait]) << "rank " << r << " CTA " << c;
        }
      }
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < t.combine_ctas; ++c) {
        const uint64_t* e = t.combine.data() + (size_t(r) * t.max_ctas + size_t(c)) * ep::kTraceEvents;
        EXPECT_NE(e[ep::kTrStart], 0u);
        EXPECT_GE(e[ep::kTrCombined], e[ep::kTrFlagsSeen]);
      }
    g->enable_trace(false);
  }
}

TEST_BOTH_DISPATCH(EpTransport, IdPatterns) {
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

TEST_BOTH_DISPATCH(EpFaults, CapacityOverflowIsACleanErrorOnEveryRank) {
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
TEST_BOTH_DISPATCH(EpFaults, ARankThatNeverArrivesTimesOut) {
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
  ::testing::Test::RecordProperty("timeout_ms", std::to_string(ms));
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

TEST_BOTH_DISPATCH(ParallelLayer, Bf16PayloadIsBitIdenticalToTheSingleGpuLayer) {
  for (int R : {1, 2, 4, 8}) layer_case(WeightFormat::kMxfp4, ep::Payload::kBf16, R, 20 + R);  // R = 1: the local pair
  layer_case(WeightFormat::kNvfp4, ep::Payload::kBf16, 4, 31);
}

TEST_BOTH_DISPATCH(ParallelLayer, QuantizedPayloadsEqualTheSingleGpuLayerOnQuantizedTokens) {
  for (ep::Payload p : {ep::Payload::kMxfp8, ep::Payload::kNvfp4})
    for (int R : {2, 8}) layer_case(WeightFormat::kMxfp4, p, R, 40 + R);
}

// bf16_sum combine rows over rounds on one group (the ticket completes every round; the lists
// and token counts of a round replace the last's): token counts that change from round to
// round, a rank with none each round, every token's slots on rank 0's experts, then one token a
// rank.
TEST_BOTH_DISPATCH(EpTransport, Bf16SumRowsOverRounds) {
  cudaStream_t st = nullptr;
  // H = 96: one column chunk of the token's-rank pass; 1320: six (three items of two, the last
  // chunk 40 columns wide). y rows 4 columns wider than H: 4 columns a lane (combine_wide false).
  struct Case { int R, H, pad; };
  for (const Case c : {Case{2, 96, 0}, Case{4, 96, 0}, Case{2, 1320, 0}, Case{4, 1320, 0}, Case{4, 96, 4},
                       Case{2, 1320, 4}}) {
    const int R = c.R;
    SCOPED_TRACE("R=" + std::to_string(R) + ", H=" + std::to_string(c.H) + ", y pad " + std::to_string(c.pad));
    ep::Shape s = ep_shape(R, 8 * R, 4, c.H, 70, 4 * 70);
    s.combine = ep::CombineRows::kBf16Sum;
    auto g = ep::Group::create_virtual(config(s), 0);
    for (uint32_t round = 0; round < 4; ++round) {
      std::vector<int64_t> T;
      for (int r = 0; r < R; ++r) T.push_back(int64_t((round * 7 + 13 * r) % 71) * (r == round % R ? 0 : 1));
      round_matches_host(*g, s, T, 100u + round, 7u + round, st, c.pad);
    }
    {  // every token's slots on rank 0's experts
      Batches b = make_batches(s, std::vector<int64_t>(size_t(R), 9), 300u,
                               [](int, int64_t, int j, std::mt19937&) { return int32_t(j); });  // experts 0..3
      if (c.pad) pad_y(b, s, c.pad);
      const ep::HostDispatch d = ep::host_dispatch(s, b.host);
      g->set_inputs(b.inputs(s));
      g->dispatch(st);
      ASSERT_EQ(g->check(st), "");
      expect_layout(*g, s, b, d);
      expect_combine(*g, s, b, d, 301u, st);
    }
    round_matches_host(*g, s, std::vector<int64_t>(size_t(R), 1), 400u, 401u, st, c.pad);
  }
}

// bf16 combine rows on the whole layer: against the float64 reference, the error stated (and at
// most the bf16 tolerance), and next to the fp32 rows' (bit-identical to one GPU) error.
TEST(ParallelLayer, Bf16CombineRowsErrorAgainstFloat64) {
  for (int R : {2, 4}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    LayerCase c = layer_problem(WeightFormat::kMxfp4, ep::Payload::kBf16, R, 70 + R);
    double err[3] = {0, 0, 0};
    for (ep::CombineRows rows : {ep::CombineRows::kF32, ep::CombineRows::kBf16, ep::CombineRows::kBf16Sum}) {
      c.gc.shape.combine = rows;
      const Batches b = c.batches();
      ParallelLayer ep(c.m, c.gc, 0);
      ep.set_inputs(b.inputs(c.gc.shape));
      for (int r = 0; r < R; ++r) b.dy[size_t(r)]->poison();
      ep.forward(nullptr);
      ASSERT_EQ(ep.group().check(nullptr), "");
      std::vector<float> got;
      std::vector<double> want;
      for (int r = 0; r < R; ++r) {
        if (c.T[size_t(r)] == 0) continue;
        const auto y = b.dy[size_t(r)]->to_host();
        for (int64_t i = 0; i < c.T[size_t(r)] * 256; ++i) got.push_back(bf16_to_float(y[size_t(i)]));
        const auto ref = reference_layer(c.m, b.x[size_t(r)].data(), c.T[size_t(r)], b.host[size_t(r)].ids.data(),
                                         b.host[size_t(r)].weights.data(), 4);
        want.insert(want.end(), ref.begin(), ref.end());
      }
      err[int(rows)] = rel_l2(got, want);
    }
    RecordProperty("rel_l2_fp32_rows_R" + std::to_string(R), std::to_string(err[0]));
    RecordProperty("rel_l2_bf16_rows_R" + std::to_string(R), std::to_string(err[1]));
    RecordProperty("rel_l2_bf16_sum_rows_R" + std::to_string(R), std::to_string(err[2]));
    std::printf("EP layer R=%d against float64: fp32 combine rows rel-L2 %.3e, bf16 rows %.3e, bf16 sums %.3e\n", R,
                err[0], err[1], err[2]);
    EXPECT_LT(err[2], 1e-2);
    EXPECT_LT(err[1], 1e-2);
    EXPECT_LT(err[0], 1e-2);
  }
}

TEST(ParallelLayer, TheOracleRefusesQuantizationLeftToTheSm90Experts) {
  MoeConfig cfg;
  cfg.num_experts = 8;
  cfg.top_k = 2;
  cfg.hidden = 128;
  cfg.intermediate = 128;
  cfg.format = WeightFormat::kMxfp4;
  const MoeModel m = make_synthetic_model(cfg, SyntheticOptions{});
  ep::GroupConfig gc = config(ep_shape(2, 8, 2, 128, 4, 8, ep::Payload::kMxfp8));
  try {
    ParallelLayer bad(m, gc, 0, QuantizeSide::kExperts);
    ADD_FAILURE() << "paired";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not quantize its inputs"), std::string::npos) << e.what();
  }
}

// compute-sanitizer's reduced set: one small round through transport and combine, and a layer.
TEST_BOTH_DISPATCH(EpSanitize, SmallRound) {
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
TEST_BOTH_DISPATCH(EpNccl, OneRankCommunicator) {
  const ep::NcclInfo info = ep::nccl_info();
  ::testing::Test::RecordProperty("nccl", std::to_string(info.compiled_version) + " / " + std::to_string(info.runtime_version));
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

// The received layouts byte for byte and combine against the host model over NVLink: padded
// rows, a rank with no tokens, many rounds on one group, DeepSeek-V3's size.
TEST_BOTH_DISPATCH(EpNccl, LocalGpusMatchTheHostModel) {
  EP_SKIP_UNLESS_LOCAL_GPUS();
  for (int R : local_worlds()) {
    SCOPED_TRACE("R=" + std::to_string(R));
    on_local_gpus(R, [&](int r, void* comm) { layout_rounds(R, r, comm, ep::CombineRows::kF32, true); });
  }
}

// A rank that never dispatches: the others' waits end within the bound with the phase and the
// peer named, and after reset() (collective) the next round runs on every rank.
TEST_BOTH_DISPATCH(EpNccl, LocalGpusARankThatNeverArrivesTimesOut) {
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
TEST_BOTH_DISPATCH(EpNccl, LocalGpusLayerEqualsTheSingleGpuLayer) {
  EP_SKIP_UNLESS_LOCAL_GPUS();
  for (int R : local_worlds())
    for (ep::Payload p : {ep::Payload::kBf16, ep::Payload::kMxfp8, ep::Payload::kNvfp4}) {
      SCOPED_TRACE(std::string(ep::payload_name(p)) + " payload, R=" + std::to_string(R));
      const LayerCase c = layer_problem(WeightFormat::kMxfp4, p, R, 60 + R);
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      const std::vector<uint16_t> want = c.single_gpu_y(c.batches());
      on_local_gpus(R, [&](int r, void* comm) {
        const Batches b = c.batches();
        ParallelLayer ep(c.m, c.gc, comm);
        ep.set_kernels(ParallelLayer::Kernels::kDecode);  // single_gpu_y's kernel
        EXPECT_EQ(ep.group().rank(0), r);
        ep.set_inputs({b.inputs(c.gc.shape)[size_t(r)]});
        b.dy[size_t(r)]->poison();
        ep.forward(nullptr);
        ASSERT_EQ(ep.group().check(nullptr), "") << "rank " << r;
        c.expect_rank_y(b, r, want);
      });
    }
}

// ---- one process per GPU, as engines run: each rank's side is a test of moekit_ep_rank_tests ----

struct RankResult {
  int status = -1;
  std::string log;
};

// Starts `world` processes of the rank binary on one scenario (a fresh NCCL unique id, rank r on
// GPU r) and waits for all of them, at most `limit_s` seconds: then the rest are killed (a hang is
// a failure, never a wait). Returns each rank's exit status and output.
// The rank binary: beside this one (a copied build, the GPU machine's), else where CMake built it.
std::string rank_binary() {
  char exe[4096] = {0};
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    std::string p(exe, size_t(n));
    p = p.substr(0, p.rfind('/')) + "/moekit_ep_rank_tests";
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return MOEKIT_EP_RANK_BIN;
}

// dispatch: the ranks' $MOEKIT_EP_DISPATCH (the parent's MOEKIT_EP_* variables are not passed on);
// "mixed": fanout on rank 0, direct on the others.
std::vector<RankResult> run_ranks(int world, const std::string& scenario, double limit_s, const std::string& dispatch) {
  static const char* hex = "0123456789abcdef";
  std::string id;
  for (uint8_t b : ep::NcclWindow::unique_id()) id += hex[b >> 4], id += hex[b & 15];
  char dir_t[] = "/tmp/moekit-eprank-XXXXXX";
  EXPECT_NE(mkdtemp(dir_t), nullptr);
  const std::string dir = dir_t;
  std::vector<pid_t> pids(size_t(world), -1);
  for (int r = 0; r < world; ++r) {
    // posix_spawn, not fork: this process holds CUDA's threads.
    std::vector<std::string> env_s;
    for (char** e = environ; *e; ++e)
      if (std::strncmp(*e, "MOEKIT_EP_", 10) != 0) env_s.push_back(*e);
    env_s.push_back("MOEKIT_EP_RANK=" + std::to_string(r));
    env_s.push_back("MOEKIT_EP_WORLD=" + std::to_string(world));
    env_s.push_back("MOEKIT_EP_ID=" + id);
    env_s.push_back("MOEKIT_EP_DISPATCH=" + (dispatch == "mixed" ? std::string(r == 0 ? "fanout" : "direct") : dispatch));
    std::vector<char*> envp;
    for (std::string& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    // $MOEKIT_EP_RANK_WRAP (e.g. "compute-sanitizer --tool memcheck --error-exitcode 9") runs
    // each rank under a tool.
    std::string bin = rank_binary(), filter = "--gtest_filter=EpRank." + scenario;
    std::vector<std::string> words;
    if (const char* w = std::getenv("MOEKIT_EP_RANK_WRAP")) {
      std::stringstream ss(w);
      for (std::string x; ss >> x;) words.push_back(x);
    }
    words.push_back(bin);
    words.push_back(filter);
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    const std::string log = dir + "/rank" + std::to_string(r) + ".log";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = -1;
    EXPECT_EQ(posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), envp.data()), 0);
    posix_spawn_file_actions_destroy(&fa);
    pids[size_t(r)] = pid;
  }
  std::vector<RankResult> res(static_cast<size_t>(world));
  const auto t0 = std::chrono::steady_clock::now();
  int left = world;
  while (left > 0) {
    for (int r = 0; r < world; ++r) {
      if (res[size_t(r)].status != -1) continue;
      int st = 0;
      if (waitpid(pids[size_t(r)], &st, WNOHANG) == pids[size_t(r)]) {
        res[size_t(r)].status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        --left;
      }
    }
    if (left > 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > limit_s) {
      for (int r = 0; r < world; ++r)
        if (res[size_t(r)].status == -1) {
          kill(pids[size_t(r)], SIGKILL);
          waitpid(pids[size_t(r)], nullptr, 0);
          res[size_t(r)].status = 1000;  // hung: killed
        }
      left = 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    const std::string log = dir + "/rank" + std::to_string(r) + ".log";
    if (FILE* f = std::fopen(log.c_str(), "r")) {
      char buf[4096];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) res[size_t(r)].log.append(buf, n);
      std::fclose(f);
    }
    std::remove(log.c_str());
  }
  rmdir(dir.c_str());
  return res;
}

std::string tail_of(const std::string& s) { return s.size() > 6000 ? "..." + s.substr(s.size() - 6000) : s; }

#define EP_SKIP_UNLESS_PROCESS_RANKS()                                                           \
  do {                                                                                           \
    const ep::NcclInfo info = ep::nccl_info();                                                   \
    if (!info.why.empty()) GTEST_SKIP() << info.why;                                             \
    if (local_worlds().empty()) GTEST_SKIP() << "one GPU: the multi-process EP tests need two or more"; \
  } while (0)

// Every rank passes its side of the scenario, within the bound, on 2 GPUs and on all of them,
// under each dispatch variant (or the given one).
void expect_scenario(const std::string& scenario, double limit_s, const std::vector<std::string>& dispatch = {"direct", "fanout"}) {
  for (const std::string& v : dispatch) {
    for (int R : local_worlds()) {
      SCOPED_TRACE(scenario + ", " + std::to_string(R) + " processes, MOEKIT_EP_DISPATCH=" + v);
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<RankResult> res = run_ranks(R, scenario, limit_s, v);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("EpMultiProcess %s on %d processes (dispatch %s): %.1f s\n", scenario.c_str(), R, v.c_str(), s);
      for (int r = 0; r < R; ++r) {
        const bool gone = scenario == "Exits" && r == R - 1;
        EXPECT_EQ(res[size_t(r)].status, gone ? 3 : 0) << "rank " << r << ":\n" << tail_of(res[size_t(r)].log);
        if (!gone) {
          EXPECT_NE(res[size_t(r)].log.find("[  PASSED  ] 1 test"), std::string::npos)
              << "rank " << r << " ran no test:\n" << tail_of(res[size_t(r)].log);
        }
      }
    }
  }
}

TEST(EpMultiProcess, Layouts) {
  EP_SKIP_UNLESS_PROCESS_RANKS();
  expect_scenario("Layouts", 300);
}
TEST(EpMultiProcess, Layer) {
  EP_SKIP_UNLESS_PROCESS_RANKS();
  expect_scenario("Layer", 300);
}
TEST(EpMultiProcess, Capacity) {
  EP_SKIP_UNLESS_PROCESS_RANKS();
  expect_scenario("Capacity", 180);
}
TEST(EpMultiProcess, NeverArrives) {
  EP_SKIP_UNLESS_PROCESS_RANKS();
  expect_scenario("NeverArrives", 180);
}
TEST(EpMultiProcess, Exits) {
  EP_SKIP_UNLESS_PROCESS_RANKS();
  expect_scenario("Exits", 180);
}
TEST(EpMultiProcess, HostTransport) {
  EP_SKIP_UNLESS_PROCESS_RANKS();
  expect_scenario("HostTransport", 300, {"direct"});  // the variable does not change the network path
}
// Rank 0 fans out, the others dispatch directly (each receiver fans out only rank 0's rows), and
// auto (each rank's choice per round: direct at the small shape, fanout at the DeepSeek-V3 one
// on 2 GPUs): the same layouts and layer outputs.
TEST(EpMultiProcess, MixedDispatchVariants) {
  EP_SKIP_UNLESS_PROCESS_RANKS();
  expect_scenario("Layouts", 300, {"mixed", "auto"});
  expect_scenario("Layer", 300, {"mixed", "auto"});
}
TEST(EpMultiProcess, Split) {
  EP_SKIP_UNLESS_PROCESS_RANKS();
  expect_scenario("Split", 180);
}

}  // namespace
}  // namespace moekit
