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
//   - combine pulls the fp32 rows GEMM2 writes today (the single-GPU contract), not bf16 rows:
//     bit-identical to the single-GPU layer without a GEMM change, at twice the combine bytes;
//     a bf16 output knob in GEMM2 (4.0a) would halve them.
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
#include "moekit/spec.hpp"  // ScaleRule

typedef struct CUstream_st* cudaStream_t;

namespace moekit::ep {

struct GroupConfig {
  Shape shape;
  uint64_t timeout_ns = 5'000'000'000ull;  // every wait of a round
  float nvfp4_g = 1.0f;                    // NVFP4 payload: the tensor scale g every rank uses
  ScaleRule mx_rule = ScaleRule::kFloor;   // MXFP8 payload
};

// One rank's tensors of a round (device memory).
struct RankInput {
  int64_t T = 0;
  const uint16_t* x = nullptr;  // [T, x_stride] bf16, 16-byte aligned rows
  int64_t x_stride = 0;         // elements
  const int32_t* ids = nullptr;     // [T, k], -1: empty slot
  const float* weights = nullptr;   // [T, k]
  uint16_t* y = nullptr;            // [T, y_stride] bf16, written by combine
  int64_t y_stride = 0;
};

// What the experts of a rank read and write between dispatch and combine.
struct RankView {
  const uint16_t* rows = nullptr;   // [E_l, cap, hidden_pad] bf16, rows of expert e_l from e_l * cap
  const RowMeta* meta = nullptr;    // [E_l, cap]
  float* y = nullptr;               // [E_l, cap, H] fp32: the experts' weighted outputs
  // The work list (sm90::DeviceWork) over the local experts.
  const int* num_active = nullptr;
  const int* expert = nullptr;
  const int* count = nullptr;
  const int* row_start = nullptr;
  const int* chunk_prefix = nullptr;
  // Per-row weights as GEMM2 reads them: weights[row_src[row]] is meta[row].weight.
  const int32_t* row_src = nullptr;
  const float* weights = nullptr;
  const int32_t* slot_row = nullptr;  // [T, k] of this rank's tokens: their rows, -1 empty
};

class Group {
 public:
  // Virtual ranks on CUDA device `device`.
  static std::unique_ptr<Group> create_virtual(const GroupConfig& cfg, int device);
  // One rank of a NCCL communicator (ncclComm_t passed as void*); collective.
  static std::unique_ptr<Group> create_nccl(const GroupConfig& cfg, void* nccl_comm);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const GroupConfig& config() const;
  int local_ranks() const;     // R (virtual) or 1
  int rank(int i) const;       // the rank of local rank i
  int ctas_per_rank() const;

  // Records the tensors of the next rounds (copies a small table to the device; synchronous).
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
  // group until reset().
  std::string check(cudaStream_t s);
  bool poisoned() const;
  // Zeroes the windows, epochs and records (collective in NCCL mode).
  void reset();
  // Returns once every rank has called it (NCCL mode: a one-int all-reduce; virtual: at once).
  void barrier();
  // Tests: the ranks that run (a rank outside the mask never arrives); the abort word.
  void set_active(uint64_t mask);
  void abort(bool on);

  struct Impl;

 private:
  explicit Group(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit::ep
