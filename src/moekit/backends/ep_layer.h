// moekit/backends/ep_layer.h — an expert-parallel MoE layer (ParallelLayer; the public API's
// EpLayer, include/moekit/ep.hpp, runs one): EP dispatch/combine (comm/, a
// prepare/finalize of the batched format) paired with the sm90_batched experts on each rank.
//
//   dispatch (comm::Group)  -> per rank: the two GEMMs on the received rows in place (their
//   weighted fp32 outputs into the window) -> combine (comm::Group)
// The pair is checked by the oracle's rule (oracle/pairing.h): the activations' quantization
// (the payload) is applied by prepare before sending, and the rows reach the experts as bf16
// (the exact dequantization of what was sent), since the SM90 experts read bf16 and quantize
// nothing themselves. With a bf16 payload and the same tokens, the output equals the single-GPU
// layer's bit for bit (the same rows, GEMMs and fp32 sums in slot order; ep_design.md 4.0).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moekit/comm/ep_group.h"
#include "moekit/experts/weights.h"
#include "moekit/oracle/pairing.h"

typedef struct CUstream_st* cudaStream_t;

namespace moekit {

class Sm90Layer;

// The per-rank layer's description: E_l experts, a state for every row the rank can receive.
MoeConfig ep_rank_config(MoeConfig c, const ep::Shape& s);

// The contract of EP prepare/finalize for a payload: quantized before sending (kPrepare), or
// left to the experts (kExperts, which the SM90 experts refuse).
PrepareContract ep_prepare_contract(ep::Payload payload, QuantizeSide side);

// Experts [e0, e0 + n) of w (views into w's bytes; biases copied).
LayerWeights slice_experts(const LayerWeights& w, int e0, int n);

class ParallelLayer {
 public:
  // Virtual ranks on `device`: rank r runs experts [r E_l, (r + 1) E_l) of w.
  ParallelLayer(const LayerWeights& w, const ep::GroupConfig& g, int device,
          QuantizeSide side = QuantizeSide::kPrepare);
  // One rank of a NCCL communicator (an ncclComm_t) on the current device; collective: every
  // rank constructs its layer at the same time. It runs experts [rank E_l, (rank + 1) E_l) of w.
  ParallelLayer(const LayerWeights& w, const ep::GroupConfig& g, void* nccl_comm,
          QuantizeSide side = QuantizeSide::kPrepare);
  // Synthetic weights (benchmarks): each rank's experts from seed + rank.
  ParallelLayer(const MoeConfig& cfg, const ep::GroupConfig& g, uint64_t seed, int device);
  // ... on one rank of a NCCL communicator (current device, collective): its experts from seed + rank.
  ParallelLayer(const MoeConfig& cfg, const ep::GroupConfig& g, uint64_t seed, void* nccl_comm);
  // Over an arena the layers of a group share (the public API, api/ep.cpp): one local rank
  // (NCCL) of the layer cfg describes (all E experts), whose experts are `local` (E / R experts:
  // the rank's), or synthetic from seed + rank when local is null; layer: the id error records
  // name. Collective in NCCL mode.
  ParallelLayer(const MoeConfig& cfg, const LayerWeights* local, const ep::GroupConfig& g, std::shared_ptr<ep::Arena> arena,
          int layer, uint64_t seed = 1);
  ~ParallelLayer();

  // Which GEMM kernel the experts run: the crossover's choice per call (set at construction:
  // the single-GPU layer's on one rank's share), or one of the two (tests compare with the
  // sm90_decode / sm90_prefill single-GPU backends).
  enum class Kernels { kAuto, kDecode, kPrefill };
  void set_kernels(Kernels k);

  ep::Group& group() { return *group_; }
  // The experts of local rank i (an SM90 layer in the batched format over its E / R experts).
  Sm90Layer& experts_layer(int i = 0) { return *experts_.at(size_t(i)); }
  void set_inputs(const std::vector<ep::RankInput>& in) { group_->set_inputs(in); }
  void dispatch(cudaStream_t s) { group_->dispatch(s); }
  void experts(cudaStream_t s);
  void combine(cudaStream_t s) { group_->combine(s); }
  // Experts the caller ran (the public API's split dispatch / combine, bf16 combine rows): copies
  // rows [0, received) of each local expert of src (bf16, element strides) into the rows combine
  // pulls (local rank 0's).
  void stage_expert_rows(const uint16_t* src, int64_t row_stride, int64_t expert_stride, cudaStream_t s);
  void forward(cudaStream_t s) {
    dispatch(s);
    experts(s);
    combine(s);
  }

 private:
  static void check_pairing(const LayerWeights& w, const ep::GroupConfig& g, QuantizeSide side);
  void add_rank(const LayerWeights& w, const ep::Shape& sh, int r);
  void check_stride(const ep::GroupConfig& g) const;
  void finish(const ep::GroupConfig& g);  // check_stride, the crossover
  void alloc_workspace(const ep::GroupConfig& g);
  int64_t experts_scratch(const ep::GroupConfig& g) const;
  std::unique_ptr<ep::Group> group_;
  std::vector<std::unique_ptr<Sm90Layer>> experts_;
  std::vector<void*> ws_;  // the experts' scratch per local rank (own, or in the arena)
  bool own_ws_ = true;
};

}  // namespace moekit
