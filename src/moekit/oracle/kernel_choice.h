// moekit/oracle/kernel_choice.h — the decode/prefill choice from a plan's per-expert row counts,
// the same arithmetic on the host (tests, tune, the regret study's numbers) and on the device
// (pipeline/kernel_choice_sm90.cu, after route_plan).
//
// The decode kernel streams an expert's weights once per kDecodeRows of its rows; the prefill
// kernel once per token tile, with work that grows with the rows. Over one plan with counts c_e:
//   streams = sum_e ceil(c_e / kDecodeRows)   the decode kernel's weight streams
//   slabs   = sum_e ceil(c_e / kSlabRows)     the prefill kernel's work in kSlabRows-row slabs
// and the prefill kernel is the faster one iff streams >= ratio x slabs, ratio the price of a slab
// in streams that `moekit tune` measures on uniform routing (tuning.h stream_ratio_from_points).
// On the H100 data (docs/PERFORMANCE.md, bench/regret_study.py) slabs of 32 rows beat active
// experts (a slab per expert) and 16-, 48-, 64- and 96-row slabs.
#pragma once

#include <cstdint>

#include "moekit/common/hd.h"

namespace moekit {

inline constexpr int kDecodeRows = 8;  // experts/sm90_layout.h kTokens
inline constexpr int kSlabRows = 32;
// The ratio in fixed point on the device: ratio x 1024, rounded.
inline constexpr int kRatioOne = 1024;

struct ChoiceCounts {
  int64_t streams = 0, slabs = 0;
};

MOEKIT_HD void add_expert_rows(ChoiceCounts& c, int64_t rows) {
  if (rows <= 0) return;
  c.streams += (rows + kDecodeRows - 1) / kDecodeRows;
  c.slabs += (rows + kSlabRows - 1) / kSlabRows;
}

inline int ratio_fixed(double ratio) { return ratio <= 0 ? 0 : int(ratio * kRatioOne + 0.5); }

// True: the prefill kernel. ratio_q = ratio_fixed(ratio); no rows: the decode kernel.
MOEKIT_HD bool prefill_wins(const ChoiceCounts& c, int ratio_q) {
  return c.slabs > 0 && c.streams * kRatioOne >= int64_t(ratio_q) * c.slabs;
}

}  // namespace moekit
