// moekit/oracle/tuning.h — the SM90 backends' decode/prefill crossover, as data.
//
// `moekit tune` times both GEMM kernels over token counts on the present GPU and writes a table
// (JSON, one file per GPU model; data/tuning/ holds the committed ones, compiled into the binary).
// An entry is keyed by GPU name, shape (E, k, H, I) and weight format, and says from how many
// tokens the prefill kernel is the faster one. Lookup for a problem on a device:
//   1. $MOEKIT_TUNING, if set, is a table file read first; then the compiled-in tables;
//   2. the fresh entry (below) of this GPU with the same shape and format decides ("table entry");
//   3. else, with fresh entries of this GPU for other shapes, the median crossover in routed rows
//      per expert (tokens x k / E) of those entries, applied to this shape ("table rule");
//   4. else the documented rule: the prefill kernel from kRuleRowsPerExpert rows per expert.
//
// The device choice (oracle/kernel_choice.h): the crossover is tuned on uniform routing; a skewed
// load (a few hot experts) moves it, because the decode kernel streams an expert's weights once per
// chunk of 8, 16 or 24 of its rows. An entry with a stream ratio (tables from `moekit tune` since the regret study;
// bench/regret_study.py, docs/PERFORMANCE.md) gives, besides its crossover, a band of token counts
// around it in which the layer picks the kernel on the device from the plan's per-expert row counts.
// Older entries (no stream ratio) keep the token-count rule alone.
//
// Stamps: an entry records the kernel stamp of the build that measured it (kernels: the hash of
// the GEMM kernels' sources and launch rules that cmake/kernel_manifest.txt lists, made at build
// time by cmake/kernel_stamp.cmake). In a build whose stamp differs, or where the entry is marked
// stale (a "stale" reason), or where it has no stamp (a table from before stamps), the entry is
// stale: the lookup above skips it (steps 2 and 3), and --explain says "stale table entry
// (measured with kernels X, built Y)". Stamps are per entry, not per table, because `moekit tune`
// measures one shape and format per run and keeps the table's other entries as they are.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/common/spec.h"
#include "moekit/oracle/backend.h"
#include "moekit/oracle/kernel_choice.h"

namespace moekit {

// The fallback rule (no fresh table entry for this GPU): the prefill kernel from this many routed
// rows per expert (tokens x k / E), for every format: the H100's measured crossover for MXFP4 and
// NVFP4 at every preset when it was set (8 for MXFP8 and BF16). Since the prefill kernel's faster
// epilogue (2026-11-24) the H100 table says 8-12 rows for MXFP4 and NVFP4 (data/tuning/,
// docs/REPORT.md); the rule is kept on the conservative side for GPUs without a table. BF16 and
// MXFP8 mostly cross far earlier (0.25-24 rows per expert in the tables of 6621433 and abee6dd):
// on those tables' own points the rule's worst regret for them is up to 32% on the H100 and 42%
// on the H200, so a GPU whose table is stale wants it re-measured soon.
// The decode kernel re-streams an expert's weights for every 8 of its rows, the prefill kernel
// once per token tile (up to 192).
inline constexpr double kRuleRowsPerExpert = 16.0;

// Crossovers are read with this tolerance: the prefill kernel counts as the faster one where it is
// within 2.5% of the decode kernel. Where the two kernels' times cross more than once within a few
// percent (mixtral-8x7b MXFP8 between 4 and 16 tokens on the H100) this takes the earlier count, so
// that skewed loads, on which the prefill kernel wins by more, do not pay for the wiggle. Points
// measured under Zipf routing too (`moekit tune` since 2026-11-24) must pass under both: with BF16
// weights at 4-16 tokens the two kernels differ by 1-3.5%, either way depending on the routing,
// and the uniform points alone put the crossover where a skewed load pays 3-3.6%.
inline constexpr double kCrossoverTolerance = 0.025;
// Where the tolerance's crossover leaves its own points with a worse regret than this (the
// kernel its entry picks over the faster one, either routing, crossover_worst_regret), the
// crossover is instead the measured count whose entry's worst regret over the points is smallest
// (the earliest of equals), if that is smaller. The tolerance rule does not look below its
// crossover: in an H100 table of 2026-11-24 mixtral-8x7b BF16 had the prefill kernel 3-7% faster
// at 2 tokens and the decode kernel 2.7-3% faster at 4, so the tolerance put the crossover at 8
// and 2 tokens paid 6.6% on the tune's points (7.9-8.5% in that run's report).
inline constexpr double kCrossoverMaxRegret = 0.03;
// The device choice's band: from max(kBandMinTokens, crossover / kBandBelow) tokens to below
// crossover x kBandAbove. Below 9 tokens no expert can have more than 8 rows, and the counts say
// nothing the token count does not (and the decode path at 1-8 tokens stays free of extra launches).
inline constexpr int64_t kBandMinTokens = 9;
// Since the decode kernel's 16- and 24-row chunks (2026-11-24) the crossover of uniform routing
// lies later while a skewed load still prefers the prefill kernel from ~1/3 of it: the band
// reaches down to a quarter.
inline constexpr int64_t kBandBelow = 4;
inline constexpr int64_t kBandAbove = 2;
// A table entry's band is that one narrowed to where its points show no clear winner: a point at
// which one kernel took kClearWin x the other's time or more (uniform routing) ends the band on its
// side. Zipf routing moved the decode / prefill time ratio by at most ~0.2 at the band's points on
// the H100 (report of 2026-11-24), so a 1.3x win under uniform routing stays a win under skew; there
// the device choice's extra launch (2-7 us) would only cost.
inline constexpr double kClearWin = 1.3;
// What the device choice adds to a call (the choice kernel, the launches of the kernel not
// chosen), in the fit of the stream ratio: ~3 us on the H100 (regret_study: median 3.3 us).
inline constexpr double kChoiceCostUs = 3.0;

struct CrossoverPoint {
  int64_t tokens = 0;
  double decode_us = 0, prefill_us = 0;  // the two GEMMs, median of CUDA-graph replays
  // The routing's per-expert row counts c_e, as the kernels saw them (kernel_choice.h): the decode
  // kernel's weighted weight streams (in 1/kStreamUnit) and the prefill slabs sum ceil(c_e / 32);
  // 0: not recorded (older tables).
  int64_t streams = 0, slabs = 0;
  // The two GEMMs under the bench's Zipf routing (s = 1) at the same count; 0: not measured.
  double zipf_decode_us = 0, zipf_prefill_us = 0;
  int64_t zipf_streams = 0, zipf_slabs = 0;  // the Zipf routing's counts, as above
};

struct CrossoverEntry {
  std::string gpu;    // as CUDA names the device, e.g. "NVIDIA H100 80GB HBM3"
  std::string label;  // the bench shape it was measured as, e.g. "gpt-oss-120b"
  int E = 0, k = 0, H = 0, I = 0;
  WeightFormat format = WeightFormat::kMxfp4;
  int64_t prefill_from = -1;  // tokens; -1: the decode kernel at every measured count
  // The device choice's constant (kernel_choice.h): the prefill kernel iff streams >= ratio x slabs
  // with ratio = stream_ratio + stream_ratio_slope x log2(T / prefill_from); 0: none (older tables:
  // the token-count rule alone).
  double stream_ratio = 0;
  double stream_ratio_slope = 0;  // per doubling of the token count
  std::vector<CrossoverPoint> points;
  std::string kernels;  // the kernel stamp of the build that measured it ("": unknown, stale)
  std::string commit;   // the commit that build was made from (information only; "": unknown)
  std::string stale;    // marked stale, and why ("": not marked)
};

struct TuningTable {
  std::string name;  // where it came from (file name)
  std::vector<CrossoverEntry> entries;
};

struct KernelCrossover {
  int64_t prefill_from = -1;  // tokens; -1: never the prefill kernel
  std::string source;         // what decided, for --explain
  // The device choice: for band_from <= T < band_to the kernel is picked on the device (prefill
  // iff streams >= stream_ratio x slabs); an empty band (band_to <= band_from): never.
  int64_t band_from = 0, band_to = 0;
  double stream_ratio = 0, stream_ratio_slope = 0;
  bool device_choice(int64_t T) const { return stream_ratio > 0 && T >= band_from && T < band_to; }
  // The ratio at T tokens (stream_ratio_at).
  double ratio_at(int64_t T) const;
  // What decides at T tokens, for --explain.
  std::string explain(int64_t T) const;
};

// The smallest measured token count from which the prefill kernel is at least as fast (within
// `tolerance`, a fraction of the decode kernel's time) at every larger measured count (-1 if none),
// under uniform routing and, at points that have them, under Zipf routing; with `max_regret` > 0,
// the minimax count instead where that one's worst regret exceeds it (kCrossoverMaxRegret).
int64_t crossover_from_points(const std::vector<CrossoverPoint>& points, double tolerance = 0,
                              double max_regret = 0);
// The worst regret over the points (both routings) of the entry that "the prefill kernel from
// `prefill_from` tokens" (-1: never) makes: the token-count rule, and in its band (entry_band) the
// device choice with the threshold stream_ratio_from_points fits (plus kChoiceCostUs), where a
// point has counts; the picked kernel's time over the faster one's, minus 1.
double crossover_worst_regret(const std::vector<CrossoverPoint>& points, int64_t prefill_from);
// The device choice's band around a crossover (kBandMinTokens, kBandBelow, kBandAbove).
void crossover_band(int64_t prefill_from, int64_t* from, int64_t* to);
// The band of a table entry: crossover_band's, narrowed by its points (kClearWin).
void entry_band(const CrossoverEntry& e, int64_t* from, int64_t* to);
// The device choice's threshold in (weighted) decode streams per prefill slab: over the points of
// the entry's band (entry_band) with counts, uniform and Zipf, the threshold whose choices have the
// smallest worst regret (the chosen kernel plus kChoiceCostUs over the faster one), placed halfway
// between neighbouring cases' ratios; the smallest such. 0 (no device choice) when the token-count
// rule's worst over the same cases is no larger, when no point there has counts, or prefill_from < 0.
// The threshold may move with the token count: ratio(T) = a + b x log2(T / prefill_from), b from
// kSlopeMin..kSlopeMax in kSlopeStep (the flatter of equal fits), returned in *slope (the
// prefill kernel's efficiency grows with its tiles: on the H200 a Zipf load at 512 tokens wanted
// the prefill kernel below the ratio at which one at 384 still wanted the decode kernel).
inline constexpr double kSlopeMin = -0.6, kSlopeMax = 0.2, kSlopeStep = 0.02;
double stream_ratio_from_points(const std::vector<CrossoverPoint>& points, int64_t prefill_from,
                                double* slope = nullptr);

TuningTable parse_tuning_table(const std::string& json_text, const std::string& name);
std::string tuning_table_json(const TuningTable& t);

// $MOEKIT_TUNING (if set), then the tables compiled into this binary.
const std::vector<TuningTable>& tuning_tables();
// The tables of data/tuning/ compiled into this binary (not $MOEKIT_TUNING).
std::vector<TuningTable> compiled_in_tuning_tables();

// This build's kernel stamp (12 hex digits) and the files it hashes (cmake/kernel_manifest.txt).
std::string kernel_stamp();
std::vector<std::string> kernel_stamp_files();
// Whether this build may use the entry: its stamp is this build's and it is not marked stale.
bool entry_fresh(const CrossoverEntry& e);
// For a stale entry, what --explain says: "stale table entry (measured with kernels X, built Y): "
// the table, the entry, the commit it was measured at and the reason it was marked, where known.
std::string stale_entry_note(const CrossoverEntry& e, const std::string& table);

// `moekit backends --explain`: this build's kernel stamp, then per table its entries per GPU, how
// many are fresh, and the note of every stale one.
std::string explain_tuning_tables(const std::vector<TuningTable>& tables);

// What a (fresh) entry decides: its crossover, and its device-choice band and stream ratio.
KernelCrossover entry_crossover(const CrossoverEntry& e, const std::string& table);
// The lookup (the header's steps 1-4) over `tables` (the first fresh entry that matches decides),
// or over tuning_tables().
KernelCrossover sm90_crossover(const MoeConfig& cfg, const DeviceInfo& d, const std::vector<TuningTable>& tables);
KernelCrossover sm90_crossover(const MoeConfig& cfg, const DeviceInfo& d);

// `moekit tune --check`: the token counts at which to time an entry again, for the crossover its
// lookup gives (sm90_crossover; -1: never the prefill kernel): the crossover, the entry's largest
// measured count below it and its smallest above it (twice the crossover where it measured none
// above); for -1 its two largest measured counts. At most max_points of them, in that order.
std::vector<int64_t> check_tokens(const CrossoverEntry& e, int64_t crossover, int max_points);
// The kernel the layer runs at T tokens under x: in x's band the device's choice from the plan's
// counts c (prefill_wins at x.ratio_at(T)), else the token count. True: the prefill kernel.
bool picks_prefill(const KernelCrossover& x, int64_t T, const ChoiceCounts& c);
// The regret that --check fails on: the picked kernel's time over the faster one's, minus 1.
inline constexpr double kCheckMaxRegret = 0.03;

namespace detail {
// The tables of data/tuning/, compiled in (CMakeLists.txt generates the definitions).
struct EmbeddedTable {
  const char* name;
  const char* json;
};
extern const EmbeddedTable kEmbeddedTuning[];
extern const int kEmbeddedTuningCount;
// cmake/kernel_stamp.cmake generates these at build time: the stamp, and the files it hashes
// (one path a line).
extern const char* const kKernelStamp;
extern const char* const kKernelFiles;
}  // namespace detail

}  // namespace moekit
