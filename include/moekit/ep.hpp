// moekit/ep.hpp — expert parallelism (EP): an MoE layer whose experts are spread over the GPUs of
// a group, one rank per process (as vLLM and SGLang run), each rank holding E / world experts.
//
// Life of an EP layer (every call marked "collective" is made by every rank, in the same order):
//   rank 0: ep_unique_id(&id); share id with the other ranks (torch.distributed, MPI, a file)
//   EpGroup::create(id, world, rank, device, &group)                 collective: an NCCL communicator
//     (or EpGroup::create_from_comm over a communicator the caller made)
//   EpLayer::create(*group, spec, options, checkpoint, &layer)       collective, once per MoE layer
//   layer->forward_logits(x, logits, out, stream)                    every step, on every rank
//     (or, around experts the caller runs: layer->dispatch(x, ids, weights, stream), the experts
//     on layer->batch()'s views, layer->combine(expert_out, out, stream); combine "bf16" layers)
// A forward call routes the rank's T tokens (T may differ between ranks and calls, up to
// options.max_tokens_per_rank), dispatches each token's row to the ranks of its top-k experts
// (one-sided writes into the peers' symmetric windows over NVLink), runs the local experts, and
// combines the expert outputs back on the token's rank: out = bf16(sum_k w_k y_k [+ shared]),
// the single-GPU layer's numerics (fp32 combine rows: bit for bit; bf16 rows: one more rounding
// per expert row, docs/EP.md states the error). Every rank must make the same forward calls in
// the same order (a rank with no tokens calls with T = 0).
// A forward call allocates nothing, never synchronizes, reads nothing on the host and can be
// captured in a CUDA graph (the tensors' addresses are the graph's). Bad arguments come back as
// a Status before anything runs. A peer that fails or never arrives ends the others' waits after
// options.timeout_ms with an error that check() returns (phase, rank, peer, round); the group is
// then poisoned until reset() (collective). Peers that cannot reach each other's memory
// (another node, or a group made with transport "host") go through NCCL's host all-to-all
// instead, with the same results (docs/EP.md); there a failed peer is NCCL's to report.
// The layers of a group share its windows and scratch (sized to the largest layer): they must run
// one at a time, on one stream per rank, as a model's layers do. Destroying the last layer of a
// group (and so its windows) is collective too, unless a failure poisoned the group: then nothing
// waits for the peers and the communicator is aborted.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moekit/moekit.hpp"

namespace moekit {

struct EpOptions {
  int64_t max_tokens_per_rank = 0;  // T of a forward call, at most (sizes the windows)
  // What dispatch moves per token: "bf16" (as is), "mxfp8" or "nvfp4" (quantized before
  // sending, SPEC section 2; the experts see the exact dequantization).
  std::string payload = "bf16";
  // What combine pulls: "fp32" (the experts' weighted fp32 rows: equal to the single-GPU layer
  // bit for bit), "bf16" (unweighted rows rounded to bf16 once, then weighted in fp32: half
  // the bytes, what DeepEP, NCCL EP and TensorRT-LLM move) or "bf16_sum" (those bf16 rows
  // summed on their experts' rank first, weighted, in slot order: one bf16 partial per (token,
  // rank) crosses instead of one row per slot, added in rank order; one more rounding per
  // partial; NVLink transport only; forward calls only, not dispatch / combine apart).
  std::string combine = "fp32";
  // Rows a local expert receives per call, at most; 0: world * max_tokens_per_rank (every token
  // of every rank on one expert: never overflows). Past it a call moves nothing and check()
  // names the expert.
  int64_t expert_capacity = 0;
  double timeout_ms = 10000;  // every wait of a call
  // NVFP4 payload: the fp32 tensor scale g = 448 * 6 / amax(activations) every rank uses (like a
  // checkpoint's input_scale); required for payload "nvfp4".
  float nvfp4_global_scale = 0;
  std::string mx_scale_rule = "floor";  // MXFP8 payload: floor | rceil
  // The experts' GEMM kernel, as the single-GPU backends sm90 / sm90_decode / sm90_prefill choose
  // it: "auto" (the tuning table's crossover for a layer of E / world experts), "decode" or
  // "prefill".
  std::string kernel = "auto";
  // How dispatch moves the rows over NVLink (docs/EP.md): "auto" (per call: one copy per
  // (token, destination rank), fanned out on the receiver, from 64 tokens when top_k >= 4 x
  // world; else one copy per (token, expert)), "direct", "fanout"; "" (the default): the
  // environment's MOEKIT_EP_DISPATCH, else "auto". Ranks may differ.
  std::string dispatch;
};

// An NCCL unique id (ncclGetUniqueId: 128 bytes) for EpGroup::create; one rank makes it.
MOEKIT_API Status ep_unique_id(std::vector<uint8_t>* id);

class MOEKIT_API EpGroup {
 public:
  // A new communicator of `world` ranks in which this process is `rank`, on `device` (a CUDA
  // device); collective. transport: "auto" (load/store over NVLink when every rank is in this
  // rank's NCCL load/store team, else NCCL's host all-to-all), or "nvlink" / "host" to insist.
  static Status create(std::span<const uint8_t> unique_id, int world, int rank, DLDevice device,
                       std::unique_ptr<EpGroup>* out, const std::string& transport = "auto");
  // Over a communicator the caller made (an ncclComm_t on `device`, kept alive by the caller for
  // the group's life; the NCCL moekit loads must be the one that made it); collective.
  static Status create_from_comm(void* nccl_comm, DLDevice device, std::unique_ptr<EpGroup>* out,
                                 const std::string& transport = "auto");
  ~EpGroup();
  EpGroup(const EpGroup&) = delete;
  EpGroup& operator=(const EpGroup&) = delete;

  int world() const;
  int rank() const;
  DLDevice device() const;
  // "nvlink" (load/store into the peers' windows) or "host" (NCCL's host all-to-all).
  const std::string& transport() const;
  // Returns when every rank has called it (a one-int all-reduce); collective.
  Status barrier();

  struct Impl;

 private:
  friend class EpLayer;
  explicit EpGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The batched layout an EP layer's dispatch hands to experts the caller runs (EpLayer::batch):
// views into the group's memory, at fixed addresses as long as the group's memory does not grow
// (create every layer of a group before taking them, as before capturing graphs).
struct EpBatch {
  int64_t local_experts = 0;  // E / world
  int64_t capacity = 0;       // rows per local expert (EpOptions::expert_capacity)
  int64_t hidden = 0;         // H
  // The rows dispatch received, bf16: local expert e's row r at x + e * x_expert_stride +
  // r * x_row_stride (elements; columns contiguous); rows [0, expert_num_tokens[e]) are valid,
  // in the order of the single-GPU permute of the ranks' batches concatenated in rank order.
  const uint16_t* x = nullptr;
  int64_t x_expert_stride = 0, x_row_stride = 0;
  const int32_t* expert_num_tokens = nullptr;  // [local_experts] int32, device
  // Where combine reads the experts' outputs: [local_experts, capacity, hidden] bf16, dense
  // (unweighted rows; rows [0, expert_num_tokens[e]) of each expert are read). Experts that write
  // here directly spare combine a copy.
  uint16_t* expert_out = nullptr;
};

class MOEKIT_API EpLayer {
 public:
  // spec describes the whole layer (num_experts: all of them, a multiple of the group's world;
  // max_tokens is ignored: options.max_tokens_per_rank sizes everything). checkpoint: the tensors
  // of SPEC section 7 (checkpoint_tensors(spec)) with a leading expert dimension of either this
  // rank's experts [rank * E/world, (rank + 1) * E/world), or all E (this rank's are taken);
  // empty: synthetic weights (tests, benchmarks). Packs them for the group's device; collective.
  static Status create(EpGroup& group, const LayerSpec& spec, const EpOptions& options,
                       std::span<const NamedTensor> checkpoint, std::unique_ptr<EpLayer>* out);
  ~EpLayer();
  EpLayer(const EpLayer&) = delete;
  EpLayer& operator=(const EpLayer&) = delete;

  const LayerSpec& spec() const;
  int first_expert() const;   // rank * E / world
  int local_experts() const;  // E / world

  // The rank's T tokens (T <= max_tokens_per_rank, 0 allowed): x [T, H] bf16 (rows 16-byte
  // aligned), router logits [T, E] f32, out [T, H] bf16; shared [T, H] bf16 (optional): a shared
  // expert's output added before the one rounding; topk_ids [T, k] i32 / topk_weights [T, k] f32
  // (optional, together): the routing result, written when given. Not for hash-routed layers
  // (spec.hash_vocab > 0): route those by their table and call forward_topk.
  Status forward_logits(const DLTensor& x, const DLTensor& logits, const DLTensor& out, void* stream,
                        const DLTensor* shared = nullptr, const DLTensor* topk_ids = nullptr,
                        const DLTensor* topk_weights = nullptr);
  // From given top-k ids [T, k] i32 (global expert ids, -1: no expert) and weights [T, k] f32.
  Status forward_topk(const DLTensor& x, const DLTensor& topk_ids, const DLTensor& topk_weights,
                      const DLTensor& out, void* stream, const DLTensor* shared = nullptr);
  // The local experts alone on the batched format (no exchange: a caller's own all-to-all, as
  // vLLM's modular kernel pairs them): x [E/world, M, H] bf16, expert_num_tokens [E/world] i32,
  // out [E/world, M, H] bf16 (unweighted); workspace: batched_workspace_bytes(M) on the device.
  Status forward_batched(const DLTensor& x, const DLTensor& expert_num_tokens, const DLTensor& out,
                         const DLTensor& workspace, void* stream);
  int64_t batched_workspace_bytes(int64_t rows_per_expert) const;

  // forward_topk split in two around experts the caller runs (an engine's prepare/finalize slot,
  // as vLLM's FusedMoEPrepareAndFinalize or DeepEP's Buffer.dispatch / combine): needs
  // options.combine == "bf16" (the experts' outputs are unweighted bf16 rows; combine weights
  // them). Every rank calls dispatch, then combine, of one layer at a time (no other call of the
  // group's layers in between), on one stream, with the contract of a forward call (nothing
  // allocated, no synchronization, graph-capturable).
  //   dispatch: x [T, H] bf16, topk_ids [T, k] i32 (global ids, -1: none), topk_weights [T, k]
  //     f32: the rows land in batch().x, the counts in batch().expert_num_tokens.
  //   the caller's experts: rows [0, expert_num_tokens[e]) of batch().x -> the same rows of
  //     expert_out (e.g. forward_batched(x view, counts view, expert_out view, workspace)).
  //   combine: expert_out [local_experts, capacity, H] bf16 (batch().expert_out itself, or a
  //     tensor of the caller's, whose valid rows are copied there first) -> out [T, H] bf16 =
  //     bf16(sum_j fma(w_j, row_j) [+ shared]) in slot order; topk_weights [T, k] f32: the
  //     weights to apply (default: dispatch's).
  // With moekit's experts (forward_batched) in between, the output equals forward_topk's with
  // combine "bf16" bit for bit (when both split the experts' work alike: docs/EP.md).
  Status batch(EpBatch* out) const;
  Status dispatch(const DLTensor& x, const DLTensor& topk_ids, const DLTensor& topk_weights, void* stream);
  Status combine(const DLTensor& expert_out, const DLTensor& out, void* stream,
                 const DLTensor* topk_weights = nullptr, const DLTensor* shared = nullptr);

  // Waits for `stream` and reports the rank's failures of earlier calls: a peer that timed out
  // (the group is then poisoned: reset()), an expert past its capacity (that call moved nothing;
  // the next may run), a top-k id out of range. Not during graph capture.
  Status check(void* stream);
  // After a failure: waits until every rank's kernels have ended, clears the windows; collective.
  Status reset();

  struct Impl;

 private:
  explicit EpLayer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit
