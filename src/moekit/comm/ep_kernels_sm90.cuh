// moekit/comm/ep_kernels_sm90.cuh — the EP kernels: dispatch and combine over the ranks'
// symmetric windows (ep_layout.h), plus the local passes around them.
//
//   quantize   x rows [T, H] bf16 -> payload rows [T, payload_stride] (MXFP8 / NVFP4 codes and
//              block scales, the formats/ quantizers), before sending.
//   dispatch   one launch per round; rank r's CTAs (as many as its slots need, dispatch_ctas):
//                1. publish: CTA 0 stores cnt[r][e] = {n, rows of r for e} into every peer's
//                   window (relaxed, system scope: each word carries its epoch)
//                2. gather: every CTA reads all R x E count words of this window until each
//                   carries epoch n (bounded), sums them: base(e, r), totals; a total past the
//                   capacity is seen by every rank alike: no row moves, the round fails
//                3. the receiving side's plan (the work list the SM90 GEMMs walk, rows per local
//                   expert) and meta expert = -1 on rows past each local expert's count
//                4. data: every thread places slots (each slot's 16-byte meta into the expert's
//                   rank at base + the slot's rank among r's rows, and slot_row), then the warps
//                   copy the payload rows in 2 KB (slot, chunk) items, several warps a row
//                   (16-byte stores); the rank's source rows go into L2 before step 1, so that
//                   the exchange hides their latency
//                5. done: thread 0 of every CTA fences at system scope once, then adds the CTA's
//                   share of 2^32 to dflag[r] in every peer; CTA 0 waits until every peer's
//                   dflag >> 32 is n (bounded) and records n as the rank's epoch: when the kernel
//                   ends, this rank's batch is complete
//              The fan-out variant (Params::fanout: Dispatch::kFanout, or kAuto's choice for the
//              round) differs in 4 and 5. Each rank chooses per round and says so in its count
//              words (bit 31); a receiver fans out the rows of the peers that fanned out and
//              finds the others' rows in place, so ranks that choose differently still agree:
//                4. the metas as above; the payload goes once per (token, destination rank q != r)
//                   into q's fan row r * max_tokens + t, and straight into the slots' rows for
//                   r's own experts
//                5. on a receiver that some peer fanned out to, every CTA (not only CTA 0) waits
//                   for every rank's done count; then the CTAs copy each row received from such
//                   a peer out of the fan region into its place:
//                   the row's meta, written by the sender before its done count, names the
//                   source (s, t), so the metas are the fan-out records
//   dequant    payload rows -> bf16 rows for the experts (quantized payloads; rows < count)
//   combine    stores cflag[r] = n into every peer ("my expert outputs are complete": the
//              GEMMs ran before on this stream), waits for all, then per token sums its slots'
//              rows, j in order, pulled from their ranks' windows (fp32 rows: acc += row; bf16
//              rows: acc = fma(w_j, row, acc)), adds the shared expert's row, rounds once.
// Epochs only grow, so no flag is ever reset; a rank writes round n + 1 into a peer only after
// the n + 1 count exchange, which every rank enters after its combine n (ep_design.md 4.4).
// Virtual ranks: one launch whose blockIdx.y is the rank, cooperative so that every CTA of every
// rank is resident (no rank's spinning CTAs can keep another rank's from running). A real rank
// launches the same kernels with one rank. Each launch takes the ranks' contexts by value
// (Ctxs, a __grid_constant__ parameter): nothing is copied to the device per call, so a call
// can be captured in a CUDA graph with its own pointers.
// Waits: spin on the word (relaxed loads, system scope), read %globaltimer every few spins
// against timeout_ns and the rank's abort word (device memory); the host's abort word (mapped
// host memory: a read crosses PCIe) at most once per kHostPollNs per CTA. A timed-out CTA writes
// the rank's error record (first writer wins), raises the rank's abort word and returns: the
// kernel ends, the context stays usable, the group is poisoned until reset.
// Trace (Params::trace, diagnostics): thread 0 of each CTA stamps %globaltimer at each phase
// into trace[(local rank * trace_ctas + cta) * kTraceEvents + event] (TraceEvent).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moekit/comm/ep_layout.h"

namespace moekit::ep {

constexpr int kThreads = 512;
constexpr int kMaxLocalRanks = 8;  // ranks one launch covers (virtual ranks)
constexpr int kTraceEvents = 8;    // stamps per CTA per kernel

// Trace stamps (ns, %globaltimer) per CTA. Dispatch: start, counts published (CTA 0) / start of
// the gather (others), counts seen, data written, done added, (CTA 0) every peer's done seen.
// Combine: start, every peer's ready flag seen, end.
enum TraceEvent : int {
  kTrStart = 0,
  kTrPublished = 1,
  kTrCountsSeen = 2,
  kTrDataDone = 3,
  kTrSignaled = 4,
  kTrAllDone = 5,
  kTrFanWait = 6,    // fan-out dispatch: every peer's done seen (every CTA)
  kTrFanned = 7,     // fan-out dispatch: the CTA's fan-out copies written
  kTrFlagsSeen = 1,  // combine
  kTrCombined = 2,   // combine
  kTrSummed = 3,     // combine, bf16_sum rows: the CTA's partial sums written and its ticket share added
};

// One rank's pointers for a round (device memory, except `error`: host-mapped).
struct RankCtx {
  int rank = 0;
  int64_t T = 0;                      // tokens this round
  const uint16_t* x = nullptr;        // [T, x_stride] bf16 (quantize input)
  int64_t x_stride = 0;               // elements
  const uint8_t* src_rows = nullptr;  // [T, src_stride] bytes sent per token (x itself for bf16)
  int64_t src_stride = 0;             // bytes
  const int32_t* ids = nullptr;       // [T, k], -1: empty slot
  const float* weights = nullptr;     // [T, k]
  const int32_t* dest = nullptr;      // [T, k] route_plan, batched with capacity T: e * T + rank of
                                      //   the slot among this rank's rows of e; -1: none
  const int32_t* expert_count = nullptr;  // [E] this rank's rows per expert (route_plan)
  int32_t* slot_row = nullptr;        // [T, k] out: the row e_l * cap + r on the expert's rank, -1
  // The receiving side's work list (sm90::DeviceWork over the local experts).
  int* num_active = nullptr;
  int* expert = nullptr;
  int* count = nullptr;
  int* row_start = nullptr;
  int* chunk_prefix = nullptr;        // [E_l + 1]
  int32_t* expert_rows = nullptr;     // [E_l] rows received per local expert (0 on a failed round)
  uint16_t* rows_bf16 = nullptr;      // quantized payloads: [E_l, cap, hidden_pad] dequantized
  uint8_t* window = nullptr;          // this rank's window
  uint8_t* const* peers = nullptr;    // [R] every rank's window, as this rank addresses it
  ErrorRecord* error = nullptr;       // host-mapped
  int* recorded = nullptr;            // device: nonzero once `error` holds a record
  int layer = 0;                      // the group's id (error records name it)
  uint16_t* y = nullptr;              // combine output [T, y_stride] bf16
  int64_t y_stride = 0;
  const uint16_t* shared = nullptr;   // optional [T, shared_stride] bf16: added before rounding
  int64_t shared_stride = 0;
  // The network path (ep_net_sm90.cuh): combine reads slot rows from the returned blocks.
  const uint8_t* net_back = nullptr;  // [R][net_block][y_row_bytes]
  const int32_t* net_pre = nullptr;   // [E]
};

// The contexts of the ranks one launch covers, passed by value.
struct Ctxs {
  RankCtx r[kMaxLocalRanks];
};

struct Params {
  Shape shape;
  Window win;
  uint64_t timeout_ns = 0;
  const volatile int* abort = nullptr;  // host-mapped: nonzero cancels every wait
  uint64_t active = ~0ull;              // ranks that run (tests: a rank that never arrives)
  int chunk_rows = 8;                   // rows per GEMM token chunk (sm90::kTokens)
  float nvfp4_g = 1.0f;                 // NVFP4 payload: the tensor scale g shared by all ranks
  int mx_rceil = 0;                     // MXFP8 payload: scale rule (0 floor, 1 rceil)
  int host_poll_every_spin = 0;         // diagnostics: every waiting thread reads the host's
                                        //   abort word every 64 spins (the old waits)
  uint64_t* trace = nullptr;            // diagnostics: [ranks][trace_ctas][kTraceEvents]
  int trace_ctas = 0;
  int chunk_vecs = 0;                   // dispatch copy items (16-byte vectors; 0: the default)
  int fanout = 0;                       // this rank's rows for peers go fanned out this round (1)
  int diag = 0;                         // diagnostics, timing only (results wrong): 1 remote
                                        //   payload stores go to this rank's own window, 2 no
                                        //   payload stores, 4 remote metas to the own window
  int net = 0;                          // the network path: combine exchanges no flags
  int64_t net_block = 0;                // its rows per peer block
};

// CTAs per rank such that `ranks` ranks fit on the device at once (cooperative launch); 0 when
// not even one CTA per rank fits. The most a launch may use.
int ctas_per_rank(const Shape& s, int ranks, int device);
// The CTAs a rank's dispatch of T tokens uses: one warp per 2 KB of a slot's row, at least 1, at
// most max_ctas.
int dispatch_ctas(const Shape& s, int64_t T, int max_ctas, int chunk_vecs = 0);
// The CTAs a rank's combine of T tokens uses: one warp per (token, column chunk).
int combine_ctas(const Shape& s, int64_t T, int max_ctas);
// The launches cover ranks cs.r[0 .. ranks).
cudaError_t launch_quantize(const Params& p, const Ctxs& cs, int ranks, int64_t max_tokens, cudaStream_t s);
cudaError_t launch_dispatch(const Params& p, const Ctxs& cs, int ranks, int ctas, cudaStream_t s);
cudaError_t launch_dequant(const Params& p, const Ctxs& cs, int ranks, cudaStream_t s);
cudaError_t launch_combine(const Params& p, const Ctxs& cs, int ranks, int ctas, cudaStream_t s);

}  // namespace moekit::ep
