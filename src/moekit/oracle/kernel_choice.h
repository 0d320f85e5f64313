// moekit/oracle/kernel_choice.h — the decode/prefill choice from a plan's per-expert row counts,
// the same arithmetic on the host (tests, tune, the regret study's numbers) and on the device
// (pipeline/kernel_choice_sm90.cu, after route_plan).
//
// The decode kernel streams an expert's weights once per chunk of R rows (R = decode_chunk_rows:
// 8, 16 or 24 by the rows per expert); the prefill kernel once per
// token tile, with work that grows with the rows. Over one plan with counts c_e:
//   streams = w(R) x sum_e ceil(c_e / R)      the decode kernel's weight streams, weighted
//                                             (kStreamUnit per 8-row stream: w = 1, 1.1, 1.2)
//   slabs   = sum_e ceil(c_e / kSlabRows)     the prefill kernel's work in kSlabRows-row slabs
// and the prefill kernel is the faster one iff streams >= ratio x slabs, ratio the threshold that
// `moekit tune` fits to its points under uniform and Zipf routing (tuning.h stream_ratio_from_points).
// On the H100 data (docs/PERFORMANCE.md, bench/regret_study.py) slabs of 32 rows beat active
// experts (a slab per expert) and 16-, 48-, 64- and 96-row slabs.
#pragma once

#include <cmath>
#include <cstdint>

#include "moekit/common/hd.h"

namespace moekit {

inline constexpr int kDecodeRows = 8;     // experts/sm90_moe_gemm.cuh kTokens
inline constexpr int kDecodeRows16 = 16;  // its 16-row variant, kTokens16
inline constexpr int kDecodeRows24 = 24;  // its 24-row variant, kTokens24
inline constexpr int kSlabRows = 32;
// The decode kernel's chunk rows for a launch of routed_rows (tokens x k) over E experts, by the
// average rows per expert: 8 below kChunk16MinRowsPerExpert (kChunk16MinRowsFewExperts with
// fewer than kManyExperts experts), 16 from there, 24 from kChunk24MinRowsPerExpert. Longer
// chunks stream an expert's weights fewer times but carry more x rows per stage, so their rings
// hold fewer weight bytes (MXFP4: 5, 4, 3 stages). Measured on an H100 (docs/PERFORMANCE.md):
// 16 beats 8 from 6 rows (qwen3-30b-a3b, gpt-oss-20b) except with 8 experts (mixtral-8x7b:
// 8 wins at 6 rows, 16 at 8); 24 beats 16 at 16 rows and loses at 12. The longer variants need
// single-multiply scales and E <= kChunk16MaxExperts (the work list in shared memory).
inline constexpr int64_t kChunk16MinRowsPerExpert = 6;
inline constexpr int64_t kChunk16MinRowsFewExperts = 8;
inline constexpr int64_t kManyExperts = 32;
inline constexpr int64_t kChunk24MinRowsPerExpert = 16;
inline constexpr int64_t kChunk16MaxExperts = 256;  // experts/sm90_moe_gemm.cuh kCachedExperts
MOEKIT_HD int decode_chunk_rows(int64_t experts, int64_t routed_rows, bool single_multiply) {
  const bool ok = single_multiply && experts > 0 && experts <= kChunk16MaxExperts;
  if (!ok) return kDecodeRows;
  if (routed_rows >= kChunk24MinRowsPerExpert * experts) return kDecodeRows24;
  const int64_t min16 = experts >= kManyExperts ? kChunk16MinRowsPerExpert : kChunk16MinRowsFewExperts;
  return routed_rows >= min16 * experts ? kDecodeRows16 : kDecodeRows;
}
// The prefill kernel's small-tile variant (experts/sm90_prefill_gemm.cuh: token tiles of up to 32
// rows, weight tiles of up to kSmallTileGroups 64-row groups over three consumer warpgroups;
// MXFP4 and NVFP4) runs where the average rows per expert are at most
// kSmallTilesMaxRowsPerExpert and each GEMM still has kSmallTilesMinWaves tiles per SM: its
// weight tiles are larger, so with few experts (gpt-oss-20b, mixtral-8x7b) too few of them leave
// SMs idle (H100, docs/PERFORMANCE.md). Past 24 rows an expert's rows split into more 32-row tiles
// than the other kernel's, each dequantizing the weights again.
inline constexpr int64_t kSmallTilesMaxRowsPerExpert = 24;
inline constexpr int64_t kSmallTileGroups = 9;
inline constexpr int64_t kSmallTilesMinWaves = 2;
// min_groups: the 64-row groups of the GEMM with fewer (w13 or w2); sms: the GPU's SMs.
MOEKIT_HD bool prefill_small_tiles(int64_t experts, int64_t routed_rows, int64_t min_groups, int64_t sms) {
  if (experts <= 0 || routed_rows > kSmallTilesMaxRowsPerExpert * experts) return false;
  const int64_t active = routed_rows < experts ? routed_rows : experts;  // at most
  return active * ((min_groups + kSmallTileGroups - 1) / kSmallTileGroups) >= kSmallTilesMinWaves * sms;
}
// The ratio in fixed point on the device: ratio x 1024, rounded.
inline constexpr int kRatioOne = 1024;

// A stream of 16 or 24 rows costs more than one of 8 (more MMAs, a shorter ring): weights in
// tenths, fitted on the H100's report of 2026-11-24 (bench/regret_study.py, docs/PERFORMANCE.md).
inline constexpr int kStreamUnit = 10;
MOEKIT_HD int stream_weight(int decode_rows) {
  return decode_rows >= kDecodeRows24 ? 12 : decode_rows >= kDecodeRows16 ? 11 : kStreamUnit;
}

struct ChoiceCounts {
  int64_t streams = 0;  // in 1/kStreamUnit streams
  int64_t slabs = 0;
};

// decode_rows: the decode kernel's chunk rows for the plan (decode_chunk_rows).
MOEKIT_HD void add_expert_rows(ChoiceCounts& c, int64_t rows, int decode_rows = kDecodeRows) {
  if (rows <= 0) return;
  c.streams += (rows + decode_rows - 1) / decode_rows * stream_weight(decode_rows);
  c.slabs += (rows + kSlabRows - 1) / kSlabRows;
}

inline int ratio_fixed(double ratio) { return ratio <= 0 ? 0 : int(ratio * kRatioOne + 0.5); }

// The threshold at T tokens when it moves with the token count (oracle/tuning.h): ratio + slope x
// log2(T / prefill_from), at least 0.001 (0 would mean "no device choice"); ratio 0 stays 0.
inline double stream_ratio_at(double ratio, double slope, int64_t prefill_from, int64_t T) {
  if (ratio <= 0) return 0;
  if (slope == 0 || prefill_from <= 0 || T <= 0) return ratio;
  const double r = ratio + slope * std::log2(double(T) / double(prefill_from));
  return r > 0.001 ? r : 0.001;
}

// True: the prefill kernel. ratio_q = ratio_fixed(ratio); no rows: the decode kernel.
MOEKIT_HD bool prefill_wins(const ChoiceCounts& c, int ratio_q) {
  return c.slabs > 0 && c.streams * kRatioOne >= int64_t(ratio_q) * c.slabs * kStreamUnit;
}

}  // namespace moekit
