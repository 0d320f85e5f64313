// moekit/comm/ep_group.h — an EP group: R ranks, their windows and peer tables, and the rounds
// (dispatch, then the experts on each rank, then combine), enqueued on a stream.
//
// Two ways to make one, the same kernels, pointer tables and flags behind both:
//   virtual   R ranks as ordinary allocations on one GPU (tests, benchmarks): each kernel is one
//             cooperative launch covering every rank (blockIdx.y = rank).
//   nccl      one rank of a NCCL communicator (comm/nccl_window.h): the window is a symmetric
//             NCCL window, the peer table comes from NCCL's LSA pointers; every rank calls the
//             same sequence (one process per GPU, or one thread per local GPU).
// A round: set_inputs (per rank: tokens, x, ids/weights, y) once for a set of buffers, then
// dispatch -> the experts read view(i) (rows, work list, per-row weights) and write view(i).y ->
// combine. check() synchronizes and turns the ranks' error records into one message.
//
// The protocol is ../shared/notes/ep_design.md section 4 (counts exchanged per round, offsets
// computed alike on every rank, rows written straight into the experts' batched layout, epoch
// flags, pull combine in slot order). Where this differs, and why:
//   - combine pulls fp32 rows (Shape::combine kF32, the default: GEMM2's weighted rows, the
//     single-GPU contract, bit-identical to the single-GPU layer) or bf16 rows (kBf16: GEMM2's
//     unweighted fp32 rows rounded once into the window; combine weights them: half the bytes).
//   - a quantized payload is dequantized on receipt into local bf16 rows, since the SM90 experts
//     read bf16 (W4A16); a bf16 payload is read in place.
//   - a source's completion flag is a count: each of its CTAs adds its share of 2^32 (release,
//     system scope), so no CTA ticket and second fence decide who publishes a flag; the round's
//     epoch is the count's high word, still never reset (ep_kernels_sm90.cuh step 5).
//   - the per-rank plan (each slot's rank among this rank's rows of its expert) is route_plan's
//     stable sort (pipeline/), run per rank before the exchange kernel.
//   - the peer table of a NCCL window comes from ncclGetPeerPointer in a one-off kernel (the
//     build's NCCL 2.28.9 has no host-side lookup), so libnccl must be the headers' version.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moekit/comm/ep_layout.h"
#include "moekit/routing/routing.h"  // RoutingParams
#include "moekit/spec.hpp"            // ScaleRule

typedef struct CUstream_st* cudaStream_t;

namespace moekit::ep {

struct GroupConfig {
  Shape shape;
  uint64_t timeout_ns = 5'000'000'000ull;  // every wait of a round
  float nvfp4_g = 1.0f;                    // NVFP4 payload: the tensor scale g every rank uses
  ScaleRule mx_rule = ScaleRule::kFloor;   // MXFP8 payload
  // Routing from logits (RankInput::logits): the layer's router over all E experts
  // (routing/routing.h; score_bias a device pointer or null).
  RoutingParams route;
  // create_nccl: NCCL's host collectives instead of load/store (Arena::create_nccl).
  bool host_collectives = false;
  // How dispatch moves the rows (ep_layout.h Dispatch): kDirect (0), kFanout (1), kAuto (2), or
  // -1: from $MOEKIT_EP_DISPATCH when the group is made ("auto" | "direct" | "fanout"; unset or
  // empty: auto). Ranks may differ: each round's choice travels with the rank's counts.
  int dispatch = -1;
};

// One rank's tensors of a round (device memory).
struct RankInput {
  int64_t T = 0;
  const uint16_t* x = nullptr;  // [T, x_stride] bf16, 16-byte aligned rows
  int64_t x_stride = 0;         // elements
  // [T, k] top-k ids (-1: empty slot) and weights: read, or, with logits, written by the
  // routing of this round.
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
  const float* logits = nullptr;    // optional [T, E]: route them (GroupConfig::route) first
  uint16_t* y = nullptr;            // [T, y_stride] bf16, written by combine
  int64_t y_stride = 0;
  const uint16_t* shared = nullptr;  // optional [T, shared_stride] bf16: added before rounding
  int64_t shared_stride = 0;
};

// What the experts of a rank read and write between dispatch and combine.
struct RankView {
  const uint16_t* rows = nullptr;   // [E_l, cap, hidden_pad] bf16, rows of expert e_l from e_l * cap
  const RowMeta* meta = nullptr;    // [E_l, cap]
  float* y = nullptr;               // [E_l, cap, H] fp32: the experts' outputs (weighted when the
                                    //   combine pulls fp32 rows: then y is the window's)
  uint16_t* y_bf16 = nullptr;       // bf16 combine rows: [E_l, cap, H] in the window (y rounded)
  const int32_t* expert_rows = nullptr;  // [E_l] rows received per local expert
  // The work list (sm90::DeviceWork) over the local experts.
  const int* num_active = nullptr;
  const int* expert = nullptr;
  const int* count = nullptr;
  const int* row_start = nullptr;
  const int* chunk_prefix = nullptr;
  // Per-row weights as GEMM2 reads them: weights[row_src[row]] is meta[row].weight (fp32
  // combine rows), or 1 (bf16 combine rows: combine applies the weights).
  const int32_t* row_src = nullptr;
  const float* weights = nullptr;
  const int32_t* slot_row = nullptr;  // [T, k] of this rank's tokens: their rows, -1 empty
  void* extra = nullptr;              // create_in's extra scratch (256-byte aligned)
};

// The memory the layers of a group share, since they run one at a time on one stream per rank:
// per local rank, its symmetric window (ep_layout.h) with the peer table, and its scratch (the
// per-round buffers: plan, work list, slot map, quantized and dequantized rows, the experts'
// scratch); and the failure state (the ranks' error records and abort words). reserve() grows
// it; in NCCL mode that is collective (every rank reserves the same sizes in the same order).
// Growing moves the memory and zeroes the windows (the epochs restart for every layer alike);
// the groups over the arena rebind to it before their next call (host-side only).
class Arena {
 public:
  // R virtual ranks on `device`; one rank of a NCCL communicator (ncclComm_t as void*) on the
  // current device. Both start empty.
  static std::shared_ptr<Arena> create_virtual(int world, int device);
  // host_collectives: the network path (ep_net_sm90.cuh: NCCL's host all-to-all, no window
  // registration, no load/store between ranks) for peers beyond load/store reach.
  static std::shared_ptr<Arena> create_nccl(void* nccl_comm, int world, bool host_collectives = false);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  void reserve(int64_t window_bytes, int64_t scratch_bytes);
  int world() const;
  int local_ranks() const;
  int rank(int i) const;  // of local rank i
  int device() const;
  bool host_collectives() const;
  bool poisoned() const;
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  Arena();
  std::unique_ptr<Impl> impl_;
};

class Group {
 public:
  // Virtual ranks on CUDA device `device`.
  static std::unique_ptr<Group> create_virtual(const GroupConfig& cfg, int device);
  // One rank of a NCCL communicator (ncclComm_t passed as void*); collective.
  static std::unique_ptr<Group> create_nccl(const GroupConfig& cfg, void* nccl_comm);
  // Over an arena the caller's other groups share (create_virtual / create_nccl make one of
  // their own); reserves what this group needs in it (collective in NCCL mode). layer: the id
  // error records name.
  // extra_scratch: bytes of each rank's arena scratch after the group's own (RankView::extra:
  // the experts' scratch of an EP layer).
  static std::unique_ptr<Group> create_in(const GroupConfig& cfg, std::shared_ptr<Arena> arena, int layer = 0,
                                          int64_t extra_scratch = 0);
  // Scratch bytes of a rank beside the window (what reserve() is asked for).
  static int64_t scratch_bytes(const Shape& s, bool host_collectives = false);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const GroupConfig& config() const;
  int local_ranks() const;     // R (virtual) or 1
  int64_t tokens(int i) const; // local rank i's tokens of the inputs set last
  int rank(int i) const;       // the rank of local rank i
  int ctas_per_rank() const;

  // Records the tensors of the next rounds (host only: the launches take them by value).
  void set_inputs(const std::vector<RankInput>& in);
  // Enqueues one dispatch (graph-capturable): the local plan, quantization, the exchange, and
  // the dequantization of a quantized payload for the experts.
  void dispatch(cudaStream_t s);
  RankView view(int i) const;
  void combine(cudaStream_t s);
  // Only the exchange kernel of dispatch, and combine's (benchmarks time them apart).
  void dispatch_exchange_only(cudaStream_t s);

  // Synchronizes s; "" when the last rounds went well, else one line per failed rank. A
  // capacity failure is cleared once reported (the next round may run); a timeout poisons the
  // group (and every group of its arena) until reset().
  std::string check(cudaStream_t s);
  bool poisoned() const;
  // Route-plan errors of the last rounds (a top-k id out of range): synchronizes s.
  bool plan_error(cudaStream_t s);
  // Zeroes the windows, epochs and records of the arena (collective in NCCL mode).
  void reset();
  // Returns once every rank has called it (NCCL mode: a one-int all-reduce; virtual: at once).
  void barrier();
  // Tests: the ranks that run (a rank outside the mask never arrives); the abort word.
  void set_active(uint64_t mask);
  void abort(bool on);

  // Diagnostics: per-CTA %globaltimer stamps of the next dispatch and combine launches
  // (ep_kernels_sm90.cuh TraceEvent). trace(): [local rank][CTA][kTraceEvents] of the last
  // traced launch of each kernel (ns; 0 where no stamp), with the CTAs each used; reads the
  // device after synchronizing it.
  struct Trace {
    int dispatch_ctas = 0, combine_ctas = 0, max_ctas = 0;
    std::vector<uint64_t> dispatch, combine;  // [local ranks][max_ctas][kTraceEvents]
  };
  void enable_trace(bool on);
  Trace trace();
  // The CTAs of the last dispatch and combine launches.
  int last_dispatch_ctas() const;
  int last_combine_ctas() const;

  struct Impl;

 private:
  explicit Group(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit::ep
