// moekit/oracle/tuning.h — the SM90 backends' decode/prefill crossover, as data.
//
// `moekit tune` times both GEMM kernels over token counts on the present GPU and writes a table
// (JSON, one file per GPU model; data/tuning/ holds the committed ones, compiled into the binary).
// An entry is keyed by GPU name, shape (E, k, H, I) and weight format, and says from how many
// tokens the prefill kernel is the faster one. Lookup for a problem on a device:
//   1. $MOEKIT_TUNING, if set, is a table file read first; then the compiled-in tables;
//   2. the entry of this GPU with the same shape and format decides ("table entry");
//   3. else, with entries of this GPU for other shapes, the median crossover in routed rows per
//      expert (tokens x k / E) of those entries, applied to this shape ("table rule");
//   4. else the documented rule: the prefill kernel from kRuleRowsPerExpert rows per expert.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/common/spec.h"
#include "moekit/oracle/backend.h"

namespace moekit {

// The fallback rule (no table for this GPU): the prefill kernel from this many routed rows per
// expert (tokens x k / E): the H100's measured crossover for MXFP4 and NVFP4 at every preset
// (8 for MXFP8 and BF16; data/tuning/, docs/PERFORMANCE.md). The decode kernel re-streams an
// expert's weights for every 8 of its rows, the prefill kernel once per 96-row tile.
inline constexpr double kRuleRowsPerExpert = 16.0;

struct CrossoverPoint {
  int64_t tokens = 0;
  double decode_us = 0, prefill_us = 0;  // the two GEMMs, median of CUDA-graph replays
};

struct CrossoverEntry {
  std::string gpu;    // as CUDA names the device, e.g. "NVIDIA H100 80GB HBM3"
  std::string label;  // the bench shape it was measured as, e.g. "gpt-oss-120b"
  int E = 0, k = 0, H = 0, I = 0;
  WeightFormat format = WeightFormat::kMxfp4;
  int64_t prefill_from = -1;  // tokens; -1: the decode kernel at every measured count
  std::vector<CrossoverPoint> points;
};

struct TuningTable {
  std::string name;  // where it came from (file name)
  std::vector<CrossoverEntry> entries;
};

struct KernelCrossover {
  int64_t prefill_from = -1;  // tokens; -1: never the prefill kernel
  std::string source;         // what decided, for --explain
};

// The smallest measured token count from which the prefill kernel is at least as fast at every
// larger measured count (-1 if none).
int64_t crossover_from_points(const std::vector<CrossoverPoint>& points);

TuningTable parse_tuning_table(const std::string& json_text, const std::string& name);
std::string tuning_table_json(const TuningTable& t);

// $MOEKIT_TUNING (if set), then the tables compiled into this binary.
const std::vector<TuningTable>& tuning_tables();

KernelCrossover sm90_crossover(const MoeConfig& cfg, const DeviceInfo& d);

namespace detail {
// The tables of data/tuning/, compiled in (CMakeLists.txt generates the definitions).
struct EmbeddedTable {
  const char* name;
  const char* json;
};
extern const EmbeddedTable kEmbeddedTuning[];
extern const int kEmbeddedTuningCount;
}  // namespace detail

}  // namespace moekit
