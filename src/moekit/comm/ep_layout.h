// moekit/comm/ep_layout.h — expert parallelism (EP): the shape of a group, the bytes of a
// payload row, and the symmetric window every rank holds at the same offsets (host and device).
//
//   R ranks, E experts, rank q owns experts [q * E_l, (q + 1) * E_l), E_l = E / R.
//   Window of a rank (one allocation; a NCCL symmetric window, or cudaMalloc for virtual ranks):
//     ctrl     u64 words: [0] epoch of the last round, [1], [2] unused, [3] the last
//              round whose dispatch failed (capacity: no row moved, combine skips it), [4] abort
//              (a wait of this rank failed: poisoned until reset); then
//              cnt[R_src][E]   {epoch << 32 | variant << 31 | rows from src for expert e}
//                              written by src (variant: 1 for Dispatch::kFanout)
//              dflag[R_src]    epoch << 32: src's rows of rounds up to epoch are all written
//                              here (each of src's CTAs adds its share of 2^32 per round)
//              cflag[R_src]    epoch: src's expert outputs of that round are complete
//     meta     [E_l, cap] EpRowMeta: the row's expert id (-1 past its expert's count), source
//              rank and token, top-k slot j, top-k weight
//     payload  [E_l, cap, payload_stride] bytes: bf16 rows of stride H_pad * 2 (the experts'
//              batched layout: the GEMM reads them in place, padding columns stay zero), or
//              quantized rows (codes, then block scales, each 16-byte aligned)
//     y        [E_l, cap, H] the experts' outputs: fp32 rows, weighted (GEMM2 writes them in
//              place), or bf16 rows, unweighted (GEMM2's fp32 output rounded once; combine
//              weights them): Shape::combine
//     flist, ftok, part  (CombineRows::kBf16Sum only, else empty) flist [R_src, max_tokens,
//              top_k] {row, weight} of each slot of src's token t on this rank (row -1: the
//              slot is elsewhere or empty) and ftok[R_src] = epoch << 32 | T, written by src
//              during its dispatch; part [R_exp, max_tokens, H] bf16: rank q's partial sum of
//              this rank's token t at q * max_tokens + t, written by q's combine before its
//              ready flag
//     frow     [E_l, cap] int32: the row whose bytes row g takes (fan-out dispatch), written
//              by the row's sender with its meta: g itself, or for a later slot of a token whose
//              sender fanned it out, the row of the token's first slot on this rank (lowest j),
//              where the sender wrote its one copy; this rank then copies it. Written by every
//              sender, whatever its variant, so that a receiver handles any mix of variants.
//   Rows of local expert e_l: e_l * cap + [0, count); the row of (src s, token t, slot j) for
//   expert e is base(e, s) + (its rank among src s's rows for e), base(e, s) = sum over
//   s' < s of cnt[s'][e]: every rank computes the same offsets from the same counts, so the
//   received block is the single-GPU permute of the ranks' batches concatenated in rank order.
#pragma once

#include <cstdint>

#include "moekit/common/hd.h"

namespace moekit::ep {

// What travels per row: bf16, or quantized by prepare before sending (SPEC section 5).
enum class Payload : int { kBf16 = 0, kMxfp8 = 1, kNvfp4 = 2 };

// What combine pulls (SPEC section 7, "bf16 combine rows"):
//   kF32   the experts' fp32 rows with the top-k weight applied (GEMM2's epilogue): y equals the
//          single-GPU layer's bit for bit;
//   kBf16  GEMM2's fp32 rows rounded to bf16 once, unweighted; combine computes
//          fma(w_j, row_j, acc) in fp32 in j order: half the bytes (what DeepEP, NCCL EP and
//          TRT-LLM move), one more rounding per row.
//   kBf16Sum  the same bf16 rows, summed on their experts' rank first: for each (source rank,
//          token) with slots there, p_q = bf16(fma(w_j, row_j, p) over its slots j in order),
//          one bf16 row; the token's rank adds the ranks' partials in rank order in fp32. One
//          row per (token, rank) crosses instead of one per slot (top-k 8: ~4x fewer bytes
//          over 2 ranks, ~2.2x over 4), one more rounding per partial.
enum class CombineRows : int { kF32 = 0, kBf16 = 1, kBf16Sum = 2 };
MOEKIT_HD constexpr bool bf16_rows(CombineRows c) { return c != CombineRows::kF32; }

// How dispatch moves the rows (the same received layout either way, byte for byte):
//   kDirect  one copy per (token, expert) slot, written straight into its row on the expert's
//            rank;
//   kFanout  one copy per (token, destination rank) into the row of the token's first slot
//            there, then the destination copies it into the rows of the token's other slots
//            for its experts (a local copy, frow): with top-k 8 over 2-4 ranks, 2-4x fewer
//            bytes over NVLink. The token's slots for the sender's own experts are written
//            directly (no NVLink to save);
//   kAuto    (the default) per round and rank: kFanout when the rank sends at least
//            kAutoFanoutMinTokens tokens and top_k >= kAutoFanoutMinSlots x world (where it was
//            measured to pay: DeepSeek-V3, k = 8, over 2 and 4 H200s; k = 6 and k = 4 over 2;
//            docs/PERFORMANCE.md), else kDirect.
// Chosen per group ($MOEKIT_EP_DISPATCH, GroupConfig::dispatch). Each rank's choice for a round
// travels in its count words, and a receiver handles any mix: ranks need not agree.
enum class Dispatch : int { kDirect = 0, kFanout = 1, kAuto = 2 };
constexpr int64_t kAutoFanoutMinTokens = 64;
constexpr int kAutoFanoutMinSlots = 2;
// Whether a rank sending T tokens this round fans them out.
inline bool fans_out(Dispatch d, int world, int top_k, int64_t T) {
  if (d == Dispatch::kAuto)
    return world > 1 && top_k >= kAutoFanoutMinSlots * world && T >= kAutoFanoutMinTokens;
  return d == Dispatch::kFanout;
}

MOEKIT_HD int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Wire bytes of one row of H values (SPEC section 5): codes, then scales.
MOEKIT_HD int64_t payload_code_bytes(Payload p, int64_t H) {
  return p == Payload::kBf16 ? 2 * H : p == Payload::kMxfp8 ? H : H / 2;
}
MOEKIT_HD int64_t payload_scale_bytes(Payload p, int64_t H) {
  return p == Payload::kBf16 ? 0 : p == Payload::kMxfp8 ? H / 32 : H / 16;
}
MOEKIT_HD int64_t payload_row_bytes(Payload p, int64_t H) {
  return align_up(payload_code_bytes(p, H), 16) + align_up(payload_scale_bytes(p, H), 16);
}

struct RowMeta {
  int32_t expert;  // global expert id; -1: an empty row
  int32_t src;     // source rank << 20 | source token
  int32_t slot;    // top-k slot j
  float weight;    // top-k weight
};
static_assert(sizeof(RowMeta) == 16, "one 16-byte store per row");
constexpr int kSrcTokenBits = 20;  // tokens per rank < 2^20

// Control words (u64 indices).
// kSumTicket: the CTAs of a kBf16Sum combine add their shares of 2^32 (its low word is 0
// between rounds); the one that completes it raises the rank's ready flags.
enum Ctrl : int { kEpoch = 0, kSumTicket = 1, kFailed = 3, kAbort = 4, kCtrlHead = 8 };

struct Shape {
  int world = 1;        // R
  int num_experts = 0;  // E (a multiple of R)
  int top_k = 0;
  int hidden = 0;       // H: a multiple of 8 (bf16) or of 32 (mxfp8, nvfp4)
  int hidden_pad = 0;   // bf16 row stride of the payload (the GEMM's K_pad), >= H
  int max_tokens = 0;   // tokens per rank per round, at most
  int capacity = 0;     // rows per local expert
  Payload payload = Payload::kBf16;
  CombineRows combine = CombineRows::kF32;

  MOEKIT_HD int local_experts() const { return num_experts / world; }
  MOEKIT_HD int64_t payload_stride() const {
    return payload == Payload::kBf16 ? 2 * int64_t(hidden_pad) : payload_row_bytes(payload, hidden);
  }
  // The bytes a row carries (the rest of a bf16 stride is padding, zero from creation).
  MOEKIT_HD int64_t payload_bytes() const { return payload_row_bytes(payload, hidden); }
  MOEKIT_HD int64_t rows() const { return int64_t(local_experts()) * capacity; }
  MOEKIT_HD int64_t y_row_bytes() const { return int64_t(hidden) * (combine == CombineRows::kF32 ? 4 : 2); }
  // (source rank, token) pairs a rank can receive: the bf16_sum lists and partials.
  MOEKIT_HD int64_t fan_rows() const { return int64_t(world) * max_tokens; }
};

// Byte offsets in the window (each region 256-byte aligned).
struct Window {
  int64_t cnt = 0, dflag = 0, cflag = 0, meta = 0, payload = 0, y = 0, flist = 0, ftok = 0, part = 0, frow = 0,
          bytes = 0;

  MOEKIT_HD static Window of(const Shape& s) {
    Window w;
    int64_t off = int64_t(kCtrlHead) * 8;
    w.cnt = off;
    off += int64_t(s.world) * s.num_experts * 8;
    w.dflag = off;
    off += int64_t(s.world) * 8;
    w.cflag = off;
    off += int64_t(s.world) * 8;
    w.meta = off = align_up(off, 256);
    off += s.rows() * int64_t(sizeof(RowMeta));
    w.payload = off = align_up(off, 256);
    off += s.rows() * s.payload_stride();
    w.y = off = align_up(off, 256);
    off += s.rows() * s.y_row_bytes();
    const bool sum = s.combine == CombineRows::kBf16Sum;
    w.flist = off = align_up(off, 256);
    off += sum ? s.fan_rows() * s.top_k * 8 : 0;
    w.ftok = off = align_up(off, 256);
    off += sum ? int64_t(s.world) * 8 : 0;
    w.part = off = align_up(off, 256);
    off += sum ? s.fan_rows() * int64_t(s.hidden) * 2 : 0;
    w.frow = off = align_up(off, 256);
    off += s.rows() * int64_t(sizeof(int32_t));
    w.bytes = align_up(off, 4096);  // NCCL windows: 4 KiB granularity
    return w;
  }
};

// Why a round failed (EpError::phase).
enum class Phase : int { kNone = 0, kCounts = 1, kData = 2, kCombine = 3, kCapacity = 4, kAborted = 5 };

// The first failure of a rank, written by the device into host-mapped memory (then the call's
// Status names it). Timeouts name the flag waited on: phase, this rank, the peer, the value
// expected and the one seen, and the round (epoch).
struct ErrorRecord {
  int32_t phase;     // Phase
  int32_t rank;
  int32_t peer;      // the rank waited on; capacity: the expert that overflowed
  int32_t layer;     // the group (layer) of the call
  uint64_t expected;  // timeout: the epoch waited for; capacity: the capacity
  uint64_t seen;      // timeout: the value read last; capacity: the rows routed to the expert
  uint64_t round;     // epoch of the round
};

}  // namespace moekit::ep
