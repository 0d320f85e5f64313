// moekit/backends/sm90_layer.h — one MoE layer on an SM90 GPU: converted weights, state,
// workspace, and the kernel sequence (route_plan -> permute -> GEMM1 -> GEMM2 -> finalize; in the
// device choice's band route_plan -> kernel_choice -> permute -> both GEMM kernels -> finalize;
// with fp8 activations, LayerSpec::activation_dtype, at every token count route_plan -> quantize
// (gather) -> FP8 GEMM1 -> quantize -> FP8 GEMM2 -> finalize, experts/sm90_fp8_chain.cuh, MXFP4
// and MXFP8 weights; no decode kernel for those yet), enqueued on a stream and capturable in one
// CUDA graph. No CUDA types leak into this header beyond the opaque stream handle.
//
// Memory, in three kinds (api/ hands in the caller's buffers; the constructors from weights and
// reserve() allocate their own for the CLI-free paths: benchmarks, tests):
//   packed weights  sm90_packed_buffers(): codes, scales, epilogue row scales, biases, the score
//                   bias, "meta" (flags found at pack time) and "state": the GEMM's counters,
//                   zero between launches (each launch leaves them zero), sized for max_tokens.
//   workspace       scratch of one call (workspace_bytes); anything may be there between calls.
//   inputs/outputs  the caller's tensors (ForwardCall), read and written in place: x rows whose
//                   stride is H padded to 64 (with H itself a multiple of 64) are read where they
//                   are, other x is first staged into the workspace with zero padding columns.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moekit/experts/weights.h"
#include "moekit/oracle/backend.h"
#include "moekit/pipeline/activation_format.h"

typedef struct CUstream_st* cudaStream_t;

namespace moekit {

struct Sm90WeightStats {
  int64_t w13_bytes_per_expert = 0;  // codes + scales as streamed by GEMM1
  int64_t w2_bytes_per_expert = 0;
};

// The packed buffers of the SM90 backends for a layer of up to c.max_tokens tokens.
std::vector<BufferDesc> sm90_packed_buffers(const MoeConfig& c);
// Converts m into packed (sm90_packed_buffers order, device memory); waits for its copies.
void sm90_pack(const LayerWeights& m, const std::vector<PackedBuffer>& packed, cudaStream_t s);
// Random but valid weights (single-multiply scales) and a zero state.
void sm90_synthesize(const MoeConfig& c, const std::vector<PackedBuffer>& packed, uint64_t seed,
                     cudaStream_t s);

class Sm90Layer {
 public:
  // Over packed buffers the caller owns (api/): c.max_tokens sizes nothing here, the state was
  // sized by it. Reads the 16 bytes of "meta" from the device.
  Sm90Layer(const MoeConfig& c, ActivationFormat fmt, const std::vector<PackedBuffer>& packed);
  // Converts the model's weights to the kernel layout and uploads them (own buffers).
  Sm90Layer(const LayerWeights& m, ActivationFormat fmt);
  // Synthetic weights generated on the device (benchmarks): random codes, valid scales.
  Sm90Layer(const MoeConfig& cfg, ActivationFormat fmt, uint64_t seed);
  ~Sm90Layer();
  Sm90Layer(const Sm90Layer&) = delete;
  Sm90Layer& operator=(const Sm90Layer&) = delete;

  const MoeConfig& config() const;
  Sm90WeightStats weight_stats() const;

  // Workspace bytes of one call (ForwardCall::T tokens with k slots; kBatched: T rows per expert).
  int64_t workspace_bytes(ForwardCall::Entry e, int64_t T, int k) const;
  // Enqueues one call on c.stream: no allocation, no synchronization, no host read of device data.
  void enqueue(const ForwardCall& c);

  // The two GEMMs alone on rows another stage planned (expert parallelism, comm/): `in` [rows,
  // x_stride()] bf16 in this layer's expert order, the work list of sm90::DeviceWork over this
  // layer's experts (device arrays), per-row weights weights[row_src[row]], fp32 outputs
  // out[row, H] weighted (GEMM2's epilogue). routed_rows bounds the rows the work list holds
  // (at most max_tokens x top_k: the state's counters). Scratch: experts_workspace_bytes(rows).
  struct ExpertsCall {
    const uint16_t* in = nullptr;
    int64_t rows = 0;
    int64_t routed_rows = 0;
    const int* num_active = nullptr;
    const int* expert = nullptr;
    const int* count = nullptr;
    const int* row_start = nullptr;
    const int* chunk_prefix = nullptr;
    const int32_t* row_src = nullptr;
    const float* weights = nullptr;
    float* out = nullptr;
    void* workspace = nullptr;
    // What picks the kernel, its CTA shape and its token chunks, as for a routed call of
    // `tokens` tokens with k slots each (the rows this layer's experts get on average: an EP
    // rank's tokens and top-k); 0: routed_rows rows with k = 1.
    int64_t tokens = 0;
    int k = 1;
  };
  int64_t experts_workspace_bytes(int64_t rows) const;
  void enqueue_experts(const ExpertsCall& c, cudaStream_t s);

  // Own buffers (benchmarks, tests): a state for up to max_tokens tokens with k slots each (k may
  // exceed top_k for bypass inputs), a workspace and I/O buffers. Allocation happens here, never
  // inside enqueue().
  void reserve(int64_t max_tokens, int k);

  // The own device buffers (valid after reserve): inputs x [T, H] bf16 with row stride x_stride()
  // (H rounded up to 64; the padding columns are zero and must stay zero), logits [T, E] f32
  // (and token_ids [T] int32 for a hash-routed layer, else null), or ids/weights [T, k] for
  // bypass; output y [T, H] bf16 (ids/weights hold the routing result).
  uint16_t* x();
  int64_t x_stride() const;
  float* logits();
  int32_t* token_ids();
  int32_t* ids();
  float* weights();
  uint16_t* y();

  // The whole layer on the own buffers. bypass: ids()/weights() are inputs, no routing.
  void enqueue(cudaStream_t s, int64_t T, bool bypass);
  // Only the two GEMMs, on the plan of the last enqueue() with the same T (benchmarks; fp8
  // layers: FP8 GEMM1, the intermediate's quantization and FP8 GEMM2 on the last call's quantized input).
  void enqueue_gemms(cudaStream_t s, int64_t T);
  // The GEMM kernel for T tokens: "prefill" ("prefill/32": its small tiles), "fp8" (fp8 layers), or the decode kernel's CTA shape "3x5" or "4x4"
  // (CTAs per SM x ring stages; the rule is in experts/sm90_shape.h, $MOEKIT_GEMM_SHAPE =
  // narrow | wide overrides it).
  std::string gemm_shape(int64_t T) const;
  // The prefill kernel (experts/sm90_prefill_gemm.cuh) runs calls of at least `tokens` tokens
  // (-1: never; the default), the decode kernel the others. Both read the same weights.
  void set_prefill_from(int64_t tokens);
  bool prefill_supported() const;  // single-multiply scales (the convert step knows), E <= 1024;
                                   // false for fp8 layers (they run neither bf16 kernel)
  // The layer runs fp8 activations (its config's activation_dtype): the FP8 chain at every token
  // count; set_prefill_from and set_device_choice change nothing, gemm_shape() is "fp8", and
  // enqueue_experts() refuses (expert parallelism takes bf16 rows).
  bool fp8_activations() const;
  // The device choice (oracle/kernel_choice.h, pipeline/kernel_choice_sm90.cuh): routed calls of
  // band_from <= T < band_to tokens pick the kernel on the device from the plan's per-expert row
  // counts (the prefill kernel iff decode weight streams >= stream_ratio x 32-row slabs); a kernel
  // after route_plan writes the choice, both GEMM kernels are launched and the one not chosen
  // returns at once. stream_ratio 0 (the default): never. Outside the band set_prefill_from decides.
  // slope: the ratio at T is stream_ratio + slope x log2(T / prefill_from) (tuning.h).
  void set_device_choice(int64_t band_from, int64_t band_to, double stream_ratio, double slope = 0);
  bool device_choice(int64_t T) const;
  // The kernel the device chose in the last enqueue (1 prefill, 0 decode; synchronizes the
  // stream), -1 when the last call had no device choice.
  int chosen_kernel(cudaStream_t s);
  bool uses_prefill(int64_t T) const;
  // Whether the prefill GEMMs of T tokens run the small-tile kernel (oracle/kernel_choice.h
  // prefill_small_tiles; $MOEKIT_PREFILL_TILES = small | normal overrides it).
  bool prefill_small_tiles(int64_t T) const;
  std::string prefill_name(int64_t T) const;  // "prefill" or "prefill/32" (gemm_shape's)
  // Benchmarks (the time split): enqueue() stops after the first `parts` of routing, permute,
  // GEMM1, GEMM2, finalize (bench/bench.h kLayerPartNames); 5, the default, runs the whole layer.
  // fp8 layers: permute is the input's quantization, GEMM2 includes the intermediate's.
  // first > 1 also skips the parts before it (a part alone, on what the last whole call left;
  // first 4 keeps both GEMMs: on the decode path they are one launch); first 5: finalize alone.
  void set_parts(int parts, int first = 1);
  // Diagnostics: per-CTA %globaltimer stamps of the GEMM kernel (sm90_moe_gemm.cuh TraceEvent),
  // [grid][trace_stride()]; enable before enqueue, read after the stream is idle.
  void enable_trace(bool on);
  std::vector<unsigned long long> trace();
  int trace_events() const;  // per CTA: trace_events() phase stamps, then trace_tasks() task records
  int trace_stride() const;  //   of trace_record() stamps: {phase << 32 | index, first stage issued,
  int trace_tasks() const;   //   first stage ready, stored}
  int trace_record() const;

  // How forward calls reached the GPU (pipeline/launch_sm90.cuh): calls replayed as a cached
  // graph, kernel nodes updated before such a replay, graphs built, calls launched kernel by
  // kernel (a capturing stream, or $MOEKIT_LAUNCH_GRAPHS=0).
  struct LaunchStats {
    long graph_launches = 0, node_updates = 0, builds = 0, direct = 0;
    unsigned last_updated = 0;  // bit i: the last replay updated launch i
    int first_diff[12] = {};    // per updated launch: the first argument byte that differed
  };
  LaunchStats launch_stats() const;

  // Active experts of the last plan (own workspace) and the error flag of the last call
  // (0 none, 1 an id out of range, 2 a batched count past its capacity, 3 a token id outside the
  // hash table); synchronize the stream.
  int active_experts(cudaStream_t s);
  int plan_error(cudaStream_t s);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit
