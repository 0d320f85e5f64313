// The decode/prefill crossover as data (oracle/tuning.h): the crossover read off measured
// points, the table's JSON both ways, and the three levels of the lookup against the H100 table
// compiled into the binary (data/tuning/nvidia_h100_80gb_hbm3.json).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "moekit/bench/bench.h"
#include "moekit/common/error.h"
#include "moekit/oracle/kernel_choice.h"
#include "moekit/oracle/oracle.h"
#include "moekit/oracle/tuning.h"
#include "testutil.h"

namespace moekit {
namespace {

constexpr const char* kH100 = "NVIDIA H100 80GB HBM3";

DeviceInfo gpu_named(const char* name) {
  DeviceInfo d;
  d.gpu = true;
  d.name = name;
  d.cc_major = 9;
  return d;
}

TEST(Tuning, CrossoverIsWherePrefillStaysFaster) {
  // Unsorted points; the prefill kernel wins at 64 once, loses at 128, wins from 256 on.
  const std::vector<CrossoverPoint> p = {
      {512, 900, 500}, {8, 100, 150}, {64, 300, 290}, {128, 400, 410}, {256, 700, 600}};
  EXPECT_EQ(crossover_from_points(p), 256);
  EXPECT_EQ(crossover_from_points({{8, 100, 150}, {64, 300, 310}}), -1);
  EXPECT_EQ(crossover_from_points({{1, 10, 10}}), 1);  // a tie goes to the prefill kernel
  EXPECT_EQ(crossover_from_points({}), -1);
  // Within a tolerance: 405 is within 2.5% of 400, so the prefill kernel from 64.
  const std::vector<CrossoverPoint> q = {{512, 900, 500}, {8, 100, 150}, {64, 300, 290}, {128, 400, 405}};
  EXPECT_EQ(crossover_from_points(q), 512);
  EXPECT_EQ(crossover_from_points(q, kCrossoverTolerance), 64);
  // Two crossings within a few percent (mixtral-8x7b MXFP8 on the H100): the earlier count.
  const std::vector<CrossoverPoint> wiggle = {{2, 250, 300}, {4, 405, 390}, {8, 492, 497}, {16, 500, 497}};
  EXPECT_EQ(crossover_from_points(wiggle), 16);
  EXPECT_EQ(crossover_from_points(wiggle, kCrossoverTolerance), 4);
  // Zipf points must pass too (BF16 on the H100: a tie under uniform routing, the decode kernel
  // 3.6% faster under Zipf at 8 tokens): the crossover moves to where both are within tolerance.
  const std::vector<CrossoverPoint> tie = {
      {4, 270, 285, 0, 0, 222, 240}, {8, 509, 517, 0, 0, 422, 437}, {16, 818, 834, 0, 0, 561, 570},
      {32, 1437, 1462, 0, 0, 807, 809}};
  EXPECT_EQ(crossover_from_points(tie, kCrossoverTolerance), 16);
  std::vector<CrossoverPoint> uniform_only = tie;
  for (CrossoverPoint& p : uniform_only) p.zipf_decode_us = p.zipf_prefill_us = 0;  // not measured
  EXPECT_EQ(crossover_from_points(uniform_only, kCrossoverTolerance), 8);
  // Where the tolerance's count leaves its own points above kCrossoverMaxRegret, the minimax count
  // (mixtral-8x7b BF16 on the H100: the prefill kernel faster at 2 tokens, the decode kernel 2.7-3%
  // faster at 4): the tolerance says 8 (2 tokens then pay 6.6% under Zipf), the minimax 2 (3.0%).
  const std::vector<CrossoverPoint> mixtral = {{1, 244.0, 299.3, 0, 0, 241.0, 288.3},
                                               {2, 520.8, 506.4, 0, 0, 525.1, 492.4},
                                               {4, 703.3, 722.2, 0, 0, 583.7, 601.0},
                                               {8, 923.7, 928.5, 0, 0, 754.5, 723.2},
                                               {16, 927.5, 929.5, 0, 0, 1031.4, 929.3}};
  EXPECT_EQ(crossover_from_points(mixtral, kCrossoverTolerance), 8);
  EXPECT_NEAR(crossover_worst_regret(mixtral, 8), 525.1 / 492.4 - 1, 1e-12);
  EXPECT_EQ(crossover_from_points(mixtral, kCrossoverTolerance, kCrossoverMaxRegret), 2);
  EXPECT_NEAR(crossover_worst_regret(mixtral, 2), 601.0 / 583.7 - 1, 1e-12);
  // Within the bound the tolerance's count stands (the cases above).
  EXPECT_EQ(crossover_from_points(wiggle, kCrossoverTolerance, kCrossoverMaxRegret), 4);
  EXPECT_EQ(crossover_from_points(tie, kCrossoverTolerance, kCrossoverMaxRegret), 16);
  EXPECT_EQ(crossover_from_points(q, kCrossoverTolerance, kCrossoverMaxRegret), 64);
  // "Never" is a candidate: the decode kernel faster everywhere.
  EXPECT_EQ(crossover_from_points({{8, 100, 150}, {64, 300, 330}}, kCrossoverTolerance, kCrossoverMaxRegret), -1);
  EXPECT_DOUBLE_EQ(crossover_worst_regret({{8, 100, 150}}, -1), 0);
}

TEST(Tuning, ChoiceFromCounts) {
  // Streams: ceil(c / 8) per expert (in 1/kStreamUnit); slabs: ceil(c / 32).
  ChoiceCounts c;
  for (int rows : {0, 1, 8, 9, 32, 33, 100}) add_expert_rows(c, rows);
  EXPECT_EQ(c.streams, kStreamUnit * (0 + 1 + 1 + 2 + 4 + 5 + 13));
  EXPECT_EQ(c.slabs, 0 + 1 + 1 + 1 + 1 + 2 + 4);
  // Uniform, 8 rows on each of 128 experts: 128 streams, 128 slabs: the decode kernel unless a slab
  // costs at most one stream.
  ChoiceCounts u;
  for (int e = 0; e < 128; ++e) add_expert_rows(u, 8);
  EXPECT_FALSE(prefill_wins(u, ratio_fixed(1.45)));
  EXPECT_TRUE(prefill_wins(u, ratio_fixed(1.0)));
  // The same 1024 rows skewed: 4 hot experts of 200 rows, 224 rows over the rest (112 x 2): the
  // decode kernel re-streams the hot experts' weights 25 times each.
  ChoiceCounts z;
  for (int e = 0; e < 4; ++e) add_expert_rows(z, 200);
  for (int e = 0; e < 112; ++e) add_expert_rows(z, 2);
  EXPECT_EQ(z.streams, kStreamUnit * (4 * 25 + 112));
  EXPECT_EQ(z.slabs, 4 * 7 + 112);
  EXPECT_TRUE(prefill_wins(z, ratio_fixed(1.45)));   // 212 >= 1.45 x 140 = 203
  EXPECT_FALSE(prefill_wins(z, ratio_fixed(1.6)));   // 212 < 224
  // The boundary is inclusive and in fixed point; no rows, or no ratio: the decode kernel... unless
  // the ratio is 0 (the layer never asks then).
  ChoiceCounts one;
  add_expert_rows(one, 8);
  EXPECT_TRUE(prefill_wins(one, kRatioOne));
  EXPECT_FALSE(prefill_wins(one, kRatioOne + 1));
  EXPECT_FALSE(prefill_wins(ChoiceCounts{}, ratio_fixed(1.0)));
  EXPECT_EQ(ratio_fixed(0), 0);
  EXPECT_EQ(ratio_fixed(1.5), 1536);
}

// The prefill kernel's small-tile variant: up to 24 routed rows per expert on average (gpt-oss-120b
// and deepseek-v3 at 512 tokens: 16 rows; 1024 tokens of them, 32 rows, run the other variant),
// with at least two tiles per SM in each GEMM (132 SMs: gpt-oss-20b's 32 experts x 5 tiles of its
// 45-group w2 and mixtral-8x7b's 8 x 8 are too few).
TEST(KernelChoice, PrefillSmallTiles) {
  EXPECT_TRUE(prefill_small_tiles(128, 512 * 4, 45, 132));    // gpt-oss-120b, 512 tokens
  EXPECT_TRUE(prefill_small_tiles(256, 512 * 8, 64, 132));    // deepseek-v3, 512 tokens
  EXPECT_TRUE(prefill_small_tiles(128, 24 * 128, 45, 132));
  EXPECT_FALSE(prefill_small_tiles(128, 24 * 128 + 1, 45, 132));
  EXPECT_FALSE(prefill_small_tiles(128, 1024 * 4, 45, 132));  // gpt-oss-120b, 1024 tokens
  EXPECT_TRUE(prefill_small_tiles(128, 256 * 8, 24, 132));    // qwen3-30b-a3b, 256 tokens: 128 x 3 tiles
  EXPECT_FALSE(prefill_small_tiles(32, 128 * 4, 45, 132));    // gpt-oss-20b: 32 x 5 tiles
  EXPECT_FALSE(prefill_small_tiles(8, 64 * 2, 64, 132));      // mixtral-8x7b: 8 x 8 tiles
  EXPECT_FALSE(prefill_small_tiles(128, 40, 45, 132));        // 40 rows: at most 40 experts x 5 tiles
  EXPECT_FALSE(prefill_small_tiles(0, 1, 45, 132));
}

// The decode kernel's chunk rows: 16 from 6 routed rows per expert on average (8 with fewer than 32
// experts), 24 from 16, with single-multiply scales and at most 256 experts; 8 otherwise. Streams
// count chunks of those rows.
TEST(KernelChoice, DecodeChunkRows) {
  EXPECT_EQ(decode_chunk_rows(128, 6 * 128 - 1, true), 8);
  EXPECT_EQ(decode_chunk_rows(128, 6 * 128, true), 16);
  EXPECT_EQ(decode_chunk_rows(128, 16 * 128 - 1, true), 16);
  EXPECT_EQ(decode_chunk_rows(128, 16 * 128, true), 24);
  EXPECT_EQ(decode_chunk_rows(8, 6 * 8, true), 8);            // mixtral-8x7b, 24 tokens
  EXPECT_EQ(decode_chunk_rows(8, 8 * 8, true), 16);           // 32 tokens
  EXPECT_EQ(decode_chunk_rows(32, 6 * 32, true), 16);         // gpt-oss-20b, 48 tokens
  EXPECT_EQ(decode_chunk_rows(128, 6 * 128, false), 8);      // two-multiply MX scales: the 8-row kernel only
  EXPECT_EQ(decode_chunk_rows(256, 100000, true), 24);
  EXPECT_EQ(decode_chunk_rows(384, 100000, true), 8);        // the work list does not fit in shared memory
  EXPECT_EQ(decode_chunk_rows(0, 100, true), 8);
  EXPECT_EQ(decode_chunk_rows(256, 100000, false), 8);
  ChoiceCounts c;
  add_expert_rows(c, 17, 16);
  add_expert_rows(c, 16, 16);
  add_expert_rows(c, 0, 16);
  EXPECT_EQ(c.streams, 3 * 11);  // a 16-row stream weighs 1.1 of an 8-row one
  EXPECT_EQ(c.slabs, 2);
  ChoiceCounts d;
  add_expert_rows(d, 25, 24);
  EXPECT_EQ(d.streams, 2 * 12);
}

TEST(Tuning, BandAndStreamRatio) {
  int64_t lo = 0, hi = 0;
  crossover_band(192, &lo, &hi);
  EXPECT_EQ(lo, 192 / kBandBelow);
  EXPECT_EQ(hi, 192 * kBandAbove);
  crossover_band(16, &lo, &hi);  // never below 9 tokens: at most 8 rows per expert there
  EXPECT_EQ(lo, 9);
  EXPECT_EQ(hi, 16 * kBandAbove);
  crossover_band(4, &lo, &hi);
  EXPECT_GE(lo, hi);  // empty
  crossover_band(-1, &lo, &hi);
  EXPECT_GE(lo, hi);
  // The threshold in streams per slab whose choices have the smallest worst regret (with
  // kChoiceCostUs) over the band's points with counts, uniform and Zipf; points outside the band
  // or without counts do not count. Streams in 1/kStreamUnit.
  std::vector<CrossoverPoint> p = {
      {8, 100, 200, 100, 10},    // outside (below 192 / kBandBelow)
      {64, 100, 110, 100, 10},   // 1.0: decode
      {128, 100, 105, 150, 10},  // 1.5: decode
      {160, 100, 80, 190, 10},   // 1.9: prefill, where the token count says decode
      {192, 100, 95, 200, 10},   // 2.0: prefill
      {256, 100, 90, 250, 10},   // 2.5: prefill
      {320, 100, 50, 0, 0},      // no counts
      {1024, 100, 10, 100, 10},  // outside (from 384)
  };
  EXPECT_DOUBLE_EQ(stream_ratio_from_points(p, 192), 1.7);  // halfway between 1.5 and 1.9
  // The entry's worst regret counts that choice in its band ([48, 320): 320 is a clear prefill
  // win): 160 tokens pick the prefill kernel on the device, 80 us + kChoiceCostUs over 80; the
  // token count alone would run the decode kernel there (25% over).
  EXPECT_NEAR(crossover_worst_regret(p, 192), kChoiceCostUs / 80, 1e-12);
  // Without the case the token count gets wrong, the token-count rule is as good: no band.
  std::vector<CrossoverPoint> q = p;
  q.erase(q.begin() + 3);
  EXPECT_EQ(stream_ratio_from_points(q, 192), 0);
  // A Zipf case at 64 tokens, 1.2 streams per slab, where the prefill kernel wins clearly: the
  // threshold moves down to it (its worst, 128 uniform at 8%, beats missing it at 72%).
  p[1].zipf_decode_us = 100, p[1].zipf_prefill_us = 60, p[1].zipf_streams = 120, p[1].zipf_slabs = 10;
  EXPECT_DOUBLE_EQ(stream_ratio_from_points(p, 192), 1.1);  // halfway between 1.0 and 1.2
  // A table entry's band ends where its points show a clear winner (kClearWin).
  CrossoverEntry e;
  e.prefill_from = 192;  // crossover_band: [48, 384)
  e.points = {
      {64, 100, 140, 0, 0},   // a clear decode win in the band: it starts after it
      {96, 100, 135, 0, 0},   // and another: after this one
      {128, 100, 110, 0, 0},  // no clear winner
      {192, 100, 95, 0, 0},
      {256, 140, 100, 0, 0},  // a clear prefill win: the band ends there
      {320, 200, 100, 0, 0},
  };
  entry_band(e, &lo, &hi);
  EXPECT_EQ(lo, 97);
  EXPECT_EQ(hi, 256);
  e.points[3] = {192, 135, 100, 0, 0};  // already clear at the crossover: the band ends before it
  entry_band(e, &lo, &hi);
  EXPECT_EQ(lo, 97);
  EXPECT_EQ(hi, 192);
  e.points.clear();  // no points: crossover_band's
  entry_band(e, &lo, &hi);
  EXPECT_EQ(lo, 192 / kBandBelow);
  EXPECT_EQ(hi, 384);
  EXPECT_EQ(stream_ratio_from_points(p, -1), 0);
  // A threshold that must fall with the token count: at 256 tokens a Zipf load at 1.6 streams per
  // slab still wants the decode kernel, at 512 one at 1.4 wants the prefill kernel (and the uniform
  // load there, at 1.1, the decode kernel): no flat ratio separates them, a slope does.
  std::vector<CrossoverPoint> s2 = {
      {256, 100, 110, 120, 10, 100, 110, 160, 10},
      {512, 100, 110, 110, 10, 110, 100, 140, 10},
  };
  double slope = 1;
  const double a = stream_ratio_from_points(s2, 512, &slope);
  EXPECT_LT(slope, 0);
  EXPECT_GT(stream_ratio_at(a, slope, 512, 256), 1.6);
  EXPECT_GT(stream_ratio_at(a, slope, 512, 512), 1.1);
  EXPECT_LE(stream_ratio_at(a, slope, 512, 512), 1.4);
  stream_ratio_from_points(p, 192, &slope);
  EXPECT_EQ(slope, 0);  // the flatter of equal fits
  EXPECT_EQ(stream_ratio_from_points({{64, 100, 150}}, 64), 0);  // an old table's points
}

TEST(Tuning, TableJsonRoundTripsAndBadTablesAreRefused) {
  TuningTable t;
  t.name = "mem";
  CrossoverEntry e;
  e.gpu = kH100;
  e.label = "x";
  e.E = 8, e.k = 2, e.H = 64, e.I = 128;
  e.format = WeightFormat::kNvfp4;
  e.prefill_from = 96;
  e.points = {{1, 2.5, 3.5}, {96, 40, 30, 14, 9, 35, 20}};
  e.stream_ratio = 1.25;
  e.kernels = "0123456789ab";
  e.commit = "28ea46f";
  e.stale = "measured before the prefill kernel's faster epilogue";
  t.entries.push_back(e);
  CrossoverEntry old = e;  // a table from before the device choice: no ratio, no counts, no stamp
  old.E = 16;
  old.stream_ratio = 0;
  old.points = {{1, 2.5, 3.5}};
  old.kernels = old.commit = old.stale = "";
  t.entries.push_back(old);
  const std::string json = tuning_table_json(t);
  EXPECT_EQ(json.find("\"stale\": \"\""), std::string::npos) << "no empty stamp fields written";
  EXPECT_EQ(json.find("\"kernels\": \"\""), std::string::npos) << "no empty stamp fields written";
  EXPECT_EQ(json.find("\"slabs\": 0"), std::string::npos) << "no counts written where none were measured";
  EXPECT_EQ(json.find("\"zipf_decode_us\": 0"), std::string::npos) << "no Zipf times written where none were measured";
  const TuningTable r = parse_tuning_table(json, "again");
  ASSERT_EQ(r.entries.size(), 2u);
  EXPECT_EQ(r.entries[1].stream_ratio, 0);
  EXPECT_EQ(r.entries[1].points[0].streams, 0);
  EXPECT_EQ(r.entries[1].kernels, "");
  EXPECT_EQ(r.entries[1].stale, "");
  const CrossoverEntry& x = r.entries[0];
  EXPECT_EQ(x.kernels, "0123456789ab");
  EXPECT_EQ(x.commit, "28ea46f");
  EXPECT_EQ(x.stale, e.stale);
  EXPECT_EQ(x.gpu, kH100);
  EXPECT_EQ(x.E, 8);
  EXPECT_EQ(x.k, 2);
  EXPECT_EQ(x.H, 64);
  EXPECT_EQ(x.I, 128);
  EXPECT_EQ(x.format, WeightFormat::kNvfp4);
  EXPECT_EQ(x.prefill_from, 96);
  ASSERT_EQ(x.points.size(), 2u);
  EXPECT_EQ(x.points[1].tokens, 96);
  EXPECT_DOUBLE_EQ(x.points[1].prefill_us, 30);
  EXPECT_EQ(x.points[1].streams, 14);
  EXPECT_EQ(x.points[1].slabs, 9);
  EXPECT_DOUBLE_EQ(x.points[1].zipf_decode_us, 35);
  EXPECT_DOUBLE_EQ(x.points[1].zipf_prefill_us, 20);
  EXPECT_EQ(x.points[0].zipf_decode_us, 0);  // not measured: not written, read as 0
  EXPECT_DOUBLE_EQ(x.stream_ratio, 1.25);
  EXPECT_EQ(x.points[0].streams, 0);
  EXPECT_THROW(parse_tuning_table("[1, 2]", "t.json"), Error);
  EXPECT_THROW(parse_tuning_table("{\"entries\": [{\"gpu\": \"g\"}]}", "t.json"), Error);
  EXPECT_THROW(parse_tuning_table("{\"entries\": [{\"gpu\": \"g\", \"E\": 0, \"k\": 1, \"H\": 1, \"I\": 1, "
                                  "\"format\": \"mxfp4\", \"prefill_from\": 1}]}",
                                  "t.json"),
               Error);
  // "stale" says why; a stamp is a string.
  const std::string entry = "\"gpu\": \"g\", \"E\": 1, \"k\": 1, \"H\": 1, \"I\": 1, \"format\": \"mxfp4\", \"prefill_from\": 1";
  EXPECT_THROW(parse_tuning_table("{\"entries\": [{" + entry + ", \"stale\": \"\"}]}", "t.json"), Error);
  EXPECT_THROW(parse_tuning_table("{\"entries\": [{" + entry + ", \"stale\": true}]}", "t.json"), Error);
  EXPECT_THROW(parse_tuning_table("{\"entries\": [{" + entry + ", \"kernels\": 12}]}", "t.json"), Error);
}

TEST(Tuning, EntryThenTableRuleThenDocumentedRule) {
  // The expectations come from the compiled-in H100 table, so that re-tuning it (scripts/
  // report_gpu.sh) keeps this test true: its gpt-oss-120b/mxfp4 entry, and the median crossover
  // of its entries in routed rows per expert. Its entries are taken as this build's (a stale
  // entry is not used at all: Tuning.StaleEntriesFallBackToTheRule).
  std::vector<TuningTable> tables = compiled_in_tuning_tables();
  for (TuningTable& t : tables)
    for (CrossoverEntry& e : t.entries) e.kernels = kernel_stamp(), e.stale = "";
  const CrossoverEntry* entry = nullptr;
  std::vector<double> rows_per_expert;
  for (const TuningTable& t : tables)
    for (const CrossoverEntry& e : t.entries) {
      if (e.gpu != kH100) continue;
      if (e.label == "gpt-oss-120b" && e.format == WeightFormat::kMxfp4 && !entry) entry = &e;
      if (e.prefill_from > 0) rows_per_expert.push_back(double(e.prefill_from) * e.k / e.E);
    }
  ASSERT_NE(entry, nullptr) << "data/tuning/nvidia_h100_80gb_hbm3.json has no gpt-oss-120b/mxfp4 entry";
  ASSERT_FALSE(rows_per_expert.empty());
  std::sort(rows_per_expert.begin(), rows_per_expert.end());
  const double median = rows_per_expert[rows_per_expert.size() / 2];
  // The entry of this GPU, shape and format.
  const MoeConfig oss = bench_shape("gpt-oss-120b", WeightFormat::kMxfp4);
  const KernelCrossover a = sm90_crossover(oss, gpu_named(kH100), tables);
  EXPECT_EQ(a.prefill_from, entry->prefill_from);
  EXPECT_NE(a.source.find("entry gpt-oss-120b/mxfp4"), std::string::npos) << a.source;
  // The entry's stream ratio gives the device choice in the band around its crossover.
  EXPECT_DOUBLE_EQ(a.stream_ratio, entry->stream_ratio);
  if (entry->stream_ratio > 0 && entry->prefill_from > 0) {
    int64_t lo = 0, hi = 0;
    entry_band(*entry, &lo, &hi);
    EXPECT_EQ(a.band_from, lo);
    EXPECT_EQ(a.band_to, hi);
    if (lo <= entry->prefill_from && entry->prefill_from < hi) {
      EXPECT_TRUE(a.device_choice(entry->prefill_from));
    }
    EXPECT_FALSE(a.device_choice(8));  // the decode path at 1-8 tokens: never
    EXPECT_FALSE(a.device_choice(entry->prefill_from * kBandAbove));
    EXPECT_NE(a.explain(entry->prefill_from).find("on the device"), std::string::npos);
    EXPECT_EQ(a.explain(8).find("on the device"), std::string::npos);
  }
  // Another shape on the same GPU: the median crossover of its entries in rows per expert, here
  // E = 64, k = 2 (16 rows per expert when this test was written: 512 tokens).
  const MoeConfig other = bench_shape("64,2,512,256", WeightFormat::kMxfp4);
  const KernelCrossover b = sm90_crossover(other, gpu_named(kH100), tables);
  EXPECT_EQ(b.prefill_from, int64_t(std::ceil(median * 64 / 2)));
  EXPECT_NE(b.source.find("median"), std::string::npos) << b.source;
  EXPECT_FALSE(b.device_choice(b.prefill_from));  // no measured ratio for this shape
  // No table for the GPU (the repo has the H100's and the H200's): kRuleRowsPerExpert.
  const KernelCrossover c = sm90_crossover(other, gpu_named("NVIDIA H800"), tables);
  EXPECT_EQ(c.prefill_from, int64_t(kRuleRowsPerExpert * 64 / 2));
  EXPECT_NE(c.source.find("rule"), std::string::npos) << c.source;
}

// `moekit backends --explain` (Backend::plan): in the band it says the device chooses, and by
// what rule; outside, the token count. (Binaries built without CUDA have no sm90 backend.)
TEST(Tuning, PlanSaysWhenTheDeviceChooses) {
  const Backend* b = find_backend("sm90");
  if (!b) GTEST_SKIP() << "built without the SM90 backends";
  const KernelCrossover x = sm90_crossover(bench_shape("gpt-oss-120b", WeightFormat::kMxfp4), gpu_named(kH100));
  if (x.stream_ratio <= 0)
    GTEST_SKIP() << "the compiled-in table has no stream ratio (or no fresh entry) for gpt-oss-120b/mxfp4";
  Problem p = Problem::of(bench_shape("gpt-oss-120b", WeightFormat::kMxfp4), x.band_from);
  const std::string in_band = b->plan(p, gpu_named(kH100));
  EXPECT_NE(in_band.find("on the device"), std::string::npos) << in_band;
  EXPECT_NE(in_band.find("sum ceil(c/R)"), std::string::npos) << in_band;
  p.tokens = 1;
  const std::string decode = b->plan(p, gpu_named(kH100));
  EXPECT_EQ(decode.rfind("the decode GEMM kernel at 1 tokens", 0), 0u) << decode;
}

// The committed table's counts are those of the bench's uniform routing (what tune records): a
// point of it recomputed here from bench_expert_counts.
TEST(Tuning, TableCountsAreTheBenchRoutings) {
  for (const TuningTable& t : tuning_tables())
    for (const CrossoverEntry& e : t.entries) {
      if (e.gpu != kH100 || e.label != "qwen3-30b-a3b" || e.format != WeightFormat::kMxfp8) continue;
      const MoeConfig cfg = bench_shape(e.label, e.format);
      for (const CrossoverPoint& p : e.points) {
        if (p.tokens != 128) continue;
        ASSERT_GT(p.streams, 0) << "data/tuning: no counts (moekit tune --recount)";
        ChoiceCounts c;
        const int dr = decode_chunk_rows(cfg.num_experts, p.tokens * cfg.top_k, true);
        for (int rows : bench_expert_counts(cfg, p.tokens, BenchRouting::kUniform, 1.0, 1)) add_expert_rows(c, rows, dr);
        EXPECT_EQ(c.streams, p.streams);
        EXPECT_EQ(c.slabs, p.slabs);
        return;
      }
    }
  GTEST_SKIP() << "no qwen3-30b-a3b/mxfp8 entry at 128 tokens in the compiled-in tables";
}

// ---- kernel stamps: tables that know what they measured ------------------------------------

std::string source_path(const std::string& rel) {
  const char* env = std::getenv("MOEKIT_SOURCE_DIR");
  return std::string(env && *env ? env : MOEKIT_SOURCE_DIR) + "/" + rel;
}

// The committed tables (data/tuning/, compiled in) were measured with this build's kernels, entry
// by entry, or say that they are stale. A change to a file that cmake/kernel_manifest.txt lists
// (other than its comments and whitespace) changes the build's stamp and fails this test until
// the tables that claim the old kernels are re-measured or marked stale.
TEST(Tuning, CommittedTablesMatchTheKernels) {
  const std::string stamp = kernel_stamp();
  ASSERT_EQ(stamp.size(), 12u) << stamp;
  int entries = 0;
  for (const TuningTable& t : compiled_in_tuning_tables()) {
    std::vector<std::string> claims;  // entries that claim other kernels without saying they are stale
    for (const CrossoverEntry& e : t.entries) {
      ++entries;
      if (e.stale.empty() && e.kernels != stamp)
        claims.push_back(e.label + "/" + format_name(e.format) + " (" + (e.kernels.empty() ? "no stamp" : e.kernels) + ")");
      if (!e.stale.empty()) {
        EXPECT_FALSE(entry_fresh(e));
      }
    }
    if (claims.empty()) continue;
    std::string list;
    for (const std::string& c : claims) list += (list.empty() ? "" : ", ") + c;
    ADD_FAILURE() << "data/tuning/" << t.name << ": " << claims.size() << " of " << t.entries.size()
                  << " entries claim kernels other than this build's " << stamp
                  << " (a file that cmake/kernel_manifest.txt lists changed since they were measured): " << list
                  << ".\nRe-measure them on that GPU with this build (`scripts/gpu_check.sh report`, then copy "
                     "$OUT/report/tuning.json to data/tuning/"
                  << t.name << "; one entry: `moekit tune --shape S --format F --out data/tuning/" << t.name
                  << "`), or until then mark them stale, so the oracle falls back to its rule: `moekit tune "
                     "--mark-stale 'WHY' --table data/tuning/"
                  << t.name << "` (README.md, \"Tuning tables\").";
  }
  EXPECT_GT(entries, 0) << "no tables compiled in (data/tuning/)";
}

// Every file under src/moekit/experts/ and src/moekit/pipeline/ is in the stamp or named as not
// in it (cmake/kernel_manifest.txt), so a new kernel file cannot go unstamped; the stamp hashes
// exactly the manifest's files, and they exist.
TEST(Tuning, KernelManifestCoversExpertsAndPipeline) {
  std::ifstream in(source_path("cmake/kernel_manifest.txt"));
  ASSERT_TRUE(in.good()) << source_path("cmake/kernel_manifest.txt") << " (set $MOEKIT_SOURCE_DIR to the repository)";
  std::vector<std::string> stamped;
  std::set<std::string> named;
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::string first, path;
    if (!(ls >> first) || first[0] == '#') continue;
    if (first == "-") {
      ASSERT_TRUE(ls >> path) << "cmake/kernel_manifest.txt: '" << line << "' names no file";
      std::string why;
      EXPECT_TRUE(std::getline(ls, why) && why.find_first_not_of(' ') != std::string::npos)
          << "cmake/kernel_manifest.txt: '" << line << "' says not why the file is not in the stamp";
    } else {
      path = first;
      stamped.push_back(path);
    }
    EXPECT_TRUE(named.insert(path).second) << "cmake/kernel_manifest.txt names " << path << " twice";
    EXPECT_TRUE(std::filesystem::exists(source_path(path))) << "cmake/kernel_manifest.txt: " << path << " does not exist";
  }
  EXPECT_EQ(stamped, kernel_stamp_files()) << "the build's stamp hashes other files than the manifest lists (re-run cmake)";
  for (const char* dir : {"src/moekit/experts", "src/moekit/pipeline"})
    for (const auto& f : std::filesystem::directory_iterator(source_path(dir))) {
      const std::string rel = std::string(dir) + "/" + f.path().filename().string();
      EXPECT_TRUE(named.count(rel)) << rel << " is in neither list of cmake/kernel_manifest.txt: add it to the stamp "
                                       "if it defines or launches a GEMM kernel, else as '- "
                                    << rel << "  why'";
    }
}

// A stale entry (another stamp, no stamp, or marked) decides nothing: neither its shape's
// crossover nor the median of the table rule; the lookup falls back as if it were not there, and
// says so in the source --explain prints.
TEST(Tuning, StaleEntriesFallBackToTheRule) {
  const char* gpu = "NVIDIA Test GPU";  // no committed table has it
  const MoeConfig oss = bench_shape("gpt-oss-120b", WeightFormat::kMxfp4);  // 128 experts, top-4
  CrossoverEntry e;
  e.gpu = gpu;
  e.label = "gpt-oss-120b";
  e.E = oss.num_experts, e.k = oss.top_k, e.H = oss.hidden, e.I = oss.intermediate;
  e.format = WeightFormat::kMxfp4;
  e.prefill_from = 768;
  e.kernels = kernel_stamp();
  e.commit = "abc";
  std::vector<TuningTable> tables(1);
  tables[0].name = "t.json";
  tables[0].entries = {e};
  // Fresh: the entry decides.
  KernelCrossover x = sm90_crossover(oss, gpu_named(gpu), tables);
  EXPECT_EQ(x.prefill_from, 768);
  EXPECT_EQ(x.source.find("stale"), std::string::npos) << x.source;
  EXPECT_TRUE(entry_fresh(e));
  // Measured with other kernels: the documented rule (16 rows per expert: 512 tokens).
  const int64_t rule = int64_t(kRuleRowsPerExpert * oss.num_experts / oss.top_k);
  tables[0].entries[0].kernels = "000000000000";
  x = sm90_crossover(oss, gpu_named(gpu), tables);
  EXPECT_EQ(x.prefill_from, rule);
  EXPECT_FALSE(x.device_choice(rule));
  const std::string want = "stale table entry (measured with kernels 000000000000, built " + kernel_stamp() + ")";
  EXPECT_EQ(x.source.rfind(want, 0), 0u) << x.source;
  EXPECT_NE(x.source.find("t.json, entry gpt-oss-120b/mxfp4, measured at abc"), std::string::npos) << x.source;
  EXPECT_NE(x.source.find("rule"), std::string::npos) << x.source;
  // No stamp (a table from before stamps): stale too.
  tables[0].entries[0].kernels = "";
  x = sm90_crossover(oss, gpu_named(gpu), tables);
  EXPECT_EQ(x.prefill_from, rule);
  EXPECT_NE(x.source.find("measured with kernels unknown, built " + kernel_stamp()), std::string::npos) << x.source;
  // Marked stale, though its stamp is this build's: not used, and the reason is printed.
  tables[0].entries[0].kernels = kernel_stamp();
  tables[0].entries[0].stale = "the GPU was throttled";
  x = sm90_crossover(oss, gpu_named(gpu), tables);
  EXPECT_EQ(x.prefill_from, rule);
  EXPECT_NE(x.source.find("marked stale: the GPU was throttled"), std::string::npos) << x.source;
  // Another shape's entry on the same GPU: fresh, it gives the table rule (its crossover in rows per
  // expert); stale, it counts for nothing either.
  CrossoverEntry other = e;
  other.label = "64,2,512,256";
  other.E = 64, other.k = 2, other.H = 512, other.I = 256;
  other.prefill_from = 96;  // 3 rows per expert: 96 tokens of gpt-oss-120b
  tables[0].entries.push_back(other);
  x = sm90_crossover(oss, gpu_named(gpu), tables);
  EXPECT_EQ(x.prefill_from, 96);
  EXPECT_NE(x.source.find("median"), std::string::npos) << x.source;
  EXPECT_EQ(x.source.rfind("stale table entry (", 0), 0u) << x.source;
  tables[0].entries[1].kernels = "000000000000";
  x = sm90_crossover(oss, gpu_named(gpu), tables);
  EXPECT_EQ(x.prefill_from, rule);
  // A fresh entry of the same shape in a later table decides (a stale $MOEKIT_TUNING entry does
  // not hide the compiled-in one), with the stale one named first.
  TuningTable later;
  later.name = "later.json";
  later.entries = {e};
  later.entries[0].prefill_from = 384;
  tables.push_back(later);
  x = sm90_crossover(oss, gpu_named(gpu), tables);
  EXPECT_EQ(x.prefill_from, 384);
  EXPECT_EQ(x.source.rfind("stale table entry (", 0), 0u) << x.source;
  EXPECT_NE(x.source.find("tuning table later.json, entry gpt-oss-120b/mxfp4"), std::string::npos) << x.source;
}

// What `moekit backends --explain` prints for the SM90 backend's plan, for every compiled-in
// entry: a stale one's plan starts with the stale note and names the fallback; a fresh one's says
// nothing of staleness. (The committed H200 table was stale when this was written.)
TEST(Tuning, PlanSaysWhenAnEntryIsStale) {
  const Backend* b = find_backend("sm90");
  if (!b) GTEST_SKIP() << "built without the SM90 backends";
  int stale = 0, fresh = 0;
  for (const TuningTable& t : compiled_in_tuning_tables())
    for (const CrossoverEntry& e : t.entries) {
      MoeConfig cfg;
      try {
        cfg = bench_shape(e.label, e.format);
      } catch (const Error&) {
        continue;
      }
      const DeviceInfo d = gpu_named(e.gpu.c_str());
      const KernelCrossover x = sm90_crossover(cfg, d);
      const int64_t T = std::max<int64_t>(1, x.prefill_from);
      const std::string plan = b->plan(Problem::of(cfg, T), d);
      if (entry_fresh(e)) {
        ++fresh;
        EXPECT_EQ(plan.find("stale"), std::string::npos) << plan;
        EXPECT_EQ(x.prefill_from, e.prefill_from) << plan;
      } else {
        ++stale;
        const std::string note = "stale table entry (measured with kernels " +
                                 (e.kernels.empty() ? std::string("unknown") : e.kernels) + ", built " + kernel_stamp() + ")";
        EXPECT_NE(plan.find(note), std::string::npos) << plan;
        EXPECT_NE(plan.find(x.prefill_from >= 0 && T >= x.prefill_from ? "the prefill GEMM kernel at" : "the decode GEMM kernel at"),
                  std::string::npos)
            << plan;
      }
    }
  EXPECT_GT(stale + fresh, 0);
}

// tune --check's points: the crossover the lookup gives, the entry's measured count below it and
// its measured count above it (twice the crossover where none); never the prefill kernel: the two
// largest counts. The oracle's pick there: the token count, or in the band the counts.
TEST(Tuning, CheckPointsAndThePick) {
  CrossoverEntry e;
  e.points = {{512, 1, 1}, {64, 1, 1}, {768, 1, 1}, {1024, 1, 1}, {384, 1, 1}};
  EXPECT_EQ(check_tokens(e, 768, 3), (std::vector<int64_t>{768, 512, 1024}));
  EXPECT_EQ(check_tokens(e, 512, 3), (std::vector<int64_t>{512, 384, 768}));  // the rule's 512 on the H200's counts
  EXPECT_EQ(check_tokens(e, 600, 3), (std::vector<int64_t>{600, 512, 768}));  // not a measured count
  EXPECT_EQ(check_tokens(e, 768, 1), (std::vector<int64_t>{768}));
  EXPECT_EQ(check_tokens(e, 768, 2), (std::vector<int64_t>{768, 512}));
  EXPECT_EQ(check_tokens(e, 1024, 3), (std::vector<int64_t>{1024, 768, 2048}));  // none measured above
  EXPECT_EQ(check_tokens(e, 64, 3), (std::vector<int64_t>{64, 384}));              // none below
  EXPECT_EQ(check_tokens(e, 0, 3), (std::vector<int64_t>{1, 64}));
  EXPECT_EQ(check_tokens(e, -1, 3), (std::vector<int64_t>{1024, 768}));
  EXPECT_EQ(check_tokens(CrossoverEntry{}, -1, 3), (std::vector<int64_t>{}));
  KernelCrossover x{512, "s"};
  EXPECT_FALSE(picks_prefill(x, 384, ChoiceCounts{}));
  EXPECT_TRUE(picks_prefill(x, 512, ChoiceCounts{}));
  EXPECT_FALSE(picks_prefill(KernelCrossover{-1, "s"}, 1 << 20, ChoiceCounts{}));
  // In the band: the counts decide (streams >= ratio x slabs).
  x.band_from = 128, x.band_to = 1024, x.stream_ratio = 1.5;
  ChoiceCounts many_streams{20 * kStreamUnit, 10}, few_streams{10 * kStreamUnit, 10};
  EXPECT_TRUE(picks_prefill(x, 384, many_streams));
  EXPECT_FALSE(picks_prefill(x, 512, few_streams));
  EXPECT_TRUE(picks_prefill(x, 1024, few_streams));  // past the band: the token count
}

// The CLI: `tune --mark-stale` marks a table's entries that this build did not measure (keeping
// the stamp it is given for those without one), `backends --explain` prints every stale entry with
// the build's stamp, and `tune --check` needs a GPU.
TEST(Tuning, CliMarkStaleExplainAndCheck) {
  test::TempDir dir;
  const std::string table = dir / "t.json";
  TuningTable t;
  CrossoverEntry e;
  e.gpu = "NVIDIA Test GPU";
  e.label = "gpt-oss-120b";
  e.E = 128, e.k = 4, e.H = 2880, e.I = 2880;
  e.prefill_from = 512;
  e.points = {{512, 10, 9}};
  t.entries = {e, e, e};
  t.entries[0].kernels = kernel_stamp();                    // this build's: kept
  t.entries[1].format = WeightFormat::kBf16;                // no stamp
  t.entries[2].format = WeightFormat::kNvfp4;
  t.entries[2].kernels = "0123456789ab";                    // other kernels
  { std::ofstream(table) << tuning_table_json(t); }
  auto r = test::run_cli("tune --mark-stale 'kernels changed' --table " + table + " --kernels 82d061425771 --commit 6621433");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("2 of 3 entries"), std::string::npos) << r.out;
  std::ifstream in(table);
  std::stringstream ss;
  ss << in.rdbuf();
  const TuningTable m = parse_tuning_table(ss.str(), table);
  ASSERT_EQ(m.entries.size(), 3u);
  EXPECT_EQ(m.entries[0].stale, "");
  EXPECT_TRUE(entry_fresh(m.entries[0]));
  EXPECT_EQ(m.entries[1].stale, "kernels changed");
  EXPECT_EQ(m.entries[1].kernels, "82d061425771");  // had none: given
  EXPECT_EQ(m.entries[1].commit, "6621433");
  EXPECT_EQ(m.entries[2].kernels, "0123456789ab");  // had one: kept
  {
    test::ScopedEnv env("MOEKIT_TUNING", table.c_str());
    r = test::run_cli("backends --explain");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("this build's kernel stamp " + kernel_stamp()), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(table + ", NVIDIA Test GPU: 3 entries, 1 fresh, 2 stale"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("stale table entry (measured with kernels 82d061425771, built " + kernel_stamp() + "): " +
                         table + ", entry gpt-oss-120b/bf16, measured at 6621433, marked stale: kernels changed"),
              std::string::npos)
        << r.out;
  }
  // Bad uses: one line, exit 1 (bad input) or 2 (usage).
  EXPECT_EQ(test::run_cli("tune --mark-stale why").code, 1);  // no --table
  EXPECT_EQ(test::run_cli("tune --mark-stale why --table " + table + " --kernels xyz").code, 1);
  EXPECT_EQ(test::run_cli("tune --table " + table).code, 1);
  EXPECT_EQ(test::run_cli("tune --check --points 4").code, 2);
  if (find_backend("sm90") == nullptr || !DeviceInfo::detect().gpu) {
    r = test::run_cli("tune --check --table " + table);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_NE(r.out.find(find_backend("sm90") ? "needs an SM90 GPU" : "without CUDA"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace moekit
