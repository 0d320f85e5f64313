// The decode/prefill crossover as data (oracle/tuning.h): the crossover read off measured
// points, the table's JSON both ways, and the three levels of the lookup against the H100 table
// compiled into the binary (data/tuning/nvidia_h100_80gb_hbm3.json).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "moekit/backends/bench.h"
#include "moekit/common/error.h"
#include "moekit/oracle/tuning.h"

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
  e.points = {{1, 2.5, 3.5}, {96, 40, 30}};
  t.entries.push_back(e);
  const TuningTable r = parse_tuning_table(tuning_table_json(t), "again");
  ASSERT_EQ(r.entries.size(), 1u);
  const CrossoverEntry& x = r.entries[0];
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
  EXPECT_THROW(parse_tuning_table("[1, 2]", "t.json"), Error);
  EXPECT_THROW(parse_tuning_table("{\"entries\": [{\"gpu\": \"g\"}]}", "t.json"), Error);
  EXPECT_THROW(parse_tuning_table("{\"entries\": [{\"gpu\": \"g\", \"E\": 0, \"k\": 1, \"H\": 1, \"I\": 1, "
                                  "\"format\": \"mxfp4\", \"prefill_from\": 1}]}",
                                  "t.json"),
               Error);
}

TEST(Tuning, EntryThenTableRuleThenDocumentedRule) {
  // The expectations come from the compiled-in H100 table, so that re-tuning it (scripts/
  // report_gpu.sh) keeps this test true: its gpt-oss-120b/mxfp4 entry, and the median crossover
  // of its entries in routed rows per expert.
  const CrossoverEntry* entry = nullptr;
  std::vector<double> rows_per_expert;
  for (const TuningTable& t : tuning_tables())
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
  const KernelCrossover a = sm90_crossover(oss, gpu_named(kH100));
  EXPECT_EQ(a.prefill_from, entry->prefill_from);
  EXPECT_NE(a.source.find("entry gpt-oss-120b/mxfp4"), std::string::npos) << a.source;
  // Another shape on the same GPU: the median crossover of its entries in rows per expert, here
  // E = 64, k = 2 (16 rows per expert when this test was written: 512 tokens).
  const MoeConfig other = bench_shape("64,2,512,256", WeightFormat::kMxfp4);
  const KernelCrossover b = sm90_crossover(other, gpu_named(kH100));
  EXPECT_EQ(b.prefill_from, int64_t(std::ceil(median * 64 / 2)));
  EXPECT_NE(b.source.find("median"), std::string::npos) << b.source;
  // No table for the GPU: kRuleRowsPerExpert.
  const KernelCrossover c = sm90_crossover(other, gpu_named("NVIDIA H200"));
  EXPECT_EQ(c.prefill_from, int64_t(kRuleRowsPerExpert * 64 / 2));
  EXPECT_NE(c.source.find("rule"), std::string::npos) << c.source;
}

}  // namespace
}  // namespace moekit
