// moekit/comm/ep_host.h — the host side of expert parallelism that needs no GPU: checks of a
// group's shape, workspace bytes from the payload dtype, the error text of a failed round, and
// the host model of dispatch and combine that the GPU tests compare against byte for byte.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/comm/ep_layout.h"

namespace moekit::ep {

const char* payload_name(Payload p);
Payload parse_payload(const std::string& s);  // bf16 | mxfp8 | nvfp4; throws moekit::Error
const char* phase_name(Phase p);

// Throws moekit::Error naming the first problem (E % R, H alignment for the payload, capacity,
// ranks, tokens).
void validate(const Shape& s);

// Bytes per rank: the symmetric window, and the local scratch beside it (bf16 rows of the
// dequantized payload for the experts when the payload is quantized, staging of the quantized
// source rows, the slot map).
struct Workspace {
  int64_t window = 0;
  int64_t local = 0;
};
Workspace workspace_bytes(const Shape& s);

// "EP dispatch timed out: rank 1 waited for rank 2's counts of round 3 (expected epoch 3, saw
// 0) after 50 ms" and the like.
std::string describe(const ErrorRecord& e, uint64_t timeout_ns);

// ---- host model -----------------------------------------------------------------------------

// One rank's batch of a round: T tokens, ids/weights [T, k] (-1: empty slot).
struct RankBatch {
  int64_t T = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

struct HostDispatch {
  // Identical on every rank: the counts [R_src][E], and the first expert whose rows exceed the
  // capacity (-1: none; then no row moves).
  std::vector<std::vector<int32_t>> counts;
  int overflow_expert = -1;
  int64_t overflow_rows = 0;
  // Per receiving rank q: rows per local expert [E_l], and meta [E_l * cap] (expert -1 past
  // each count).
  std::vector<std::vector<int32_t>> local_count;
  std::vector<std::vector<RowMeta>> meta;
  // Per source rank: [T * k] the row (e_l * cap + r) each slot went to on its expert's rank, -1
  // for an empty slot.
  std::vector<std::vector<int32_t>> slot_row;
};
HostDispatch host_dispatch(const Shape& s, const std::vector<RankBatch>& batches);

// y of source rank r: per token, the fp32 sum over slots j in order of the expert output rows
// y_rows[q][row * H ...] [+ shared[t * H ...]], rounded to bf16 once. Combine rows kF32: the
// rows as given (weighted); kBf16: each row rounded to bf16 and weighted, fma(w_j, row, acc).
std::vector<uint16_t> host_combine(const Shape& s, const HostDispatch& d, const RankBatch& b, int r,
                                   const std::vector<std::vector<float>>& y_rows,
                                   const std::vector<uint16_t>* shared = nullptr);

}  // namespace moekit::ep
