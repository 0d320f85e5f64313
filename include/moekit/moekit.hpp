// moekit/moekit.hpp — the public C++20 API: pack a layer's checkpoint weights once, then run its
// expert part asynchronously on the caller's tensors and stream. The only header a user includes
// (with moekit/spec.hpp, which it brings); no CUDA, framework or JSON headers.
//
// Life of a layer:
//   LayerPlan plan;   plan_layer(spec, {device, backend}, &plan)     the oracle picks the backend
//   for (b : plan.buffers) allocate b.bytes on plan.device            caller-owned packed buffers
//   pack_weights(spec, plan, checkpoint, packed, stream)              load time (synchronizes)
//   Layer::create(spec, plan, packed, &layer)                         once per MoE layer
//   allocate layer->workspace_bytes(T) on the device                  per call, may be shared
//   layer->forward_logits(x, logits, out, workspace, stream)          every step
// Tensors are DLPack DLTensors from any framework, on plan.device: bf16 hidden states and outputs
// (rows may be strided: row stride >= H, unit column stride), fp32 router logits, int32 top-k ids
// and fp32 top-k weights. A forward call allocates nothing, never synchronizes, never reads
// device memory from the host and can be captured in a CUDA graph; the caller keeps every tensor
// alive until the stream has run the call. Errors come back as a Status with a one-line message,
// never as exceptions or aborts; a call that returns an error has written nothing. Errors found
// in device data (an id out of range, a batched count past its capacity) cannot be returned by an
// asynchronous call: the kernels skip those rows and raise a flag that check() reads.
// On the CPU (device kDLCPU) the same calls run the multithreaded reference backend synchronously.
// On a GPU an eager call (its stream not being captured) replays a CUDA graph the layer keeps for
// the call's launch sequence, updating only the kernels whose arguments changed: one graph launch
// on the host instead of 3-5 kernel launches. The first call of each launch sequence (decode,
// prefill, ...: a few per layer) builds that graph (driver objects, nothing from the caller's
// memory); $MOEKIT_LAUNCH_GRAPHS=0, read when a layer is created, launches kernel by kernel. A
// layer's calls must come from one host thread at a time.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moekit/spec.hpp"

// What libmoekit.so exports (everything else in it is hidden).
#define MOEKIT_API __attribute__((visibility("default")))

namespace moekit {

enum class StatusCode { kOk = 0, kInvalidArgument = 1, kUnsupported = 2, kRuntimeError = 3 };

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;  // one line; empty when ok
  bool ok() const { return code == StatusCode::kOk; }
};

// The description's own checks (positive sizes, H and I multiples of the format's block, groups).
MOEKIT_API Status check_spec(const LayerSpec& spec);

// Where a layer runs and which backend runs it.
struct Options {
  DLDevice device = {kDLCPU, 0};
  std::string backend;  // "": the oracle's choice ($MOEKIT_BACKEND, if set, is a request)
};

struct LayerPlan {
  std::string backend;
  DLDevice device = {kDLCPU, 0};
  std::vector<BufferDesc> buffers;
  std::string explain;  // the oracle's decision: every backend, chosen or why rejected
};

// Chooses the backend for spec on options.device (for spec.max_tokens tokens) and lists the
// buffers of its packed weights.
MOEKIT_API Status plan_layer(const LayerSpec& spec, const Options& options, LayerPlan* plan);

// A checkpoint tensor of SPEC section 7 by name (GPT-OSS names for mxfp4, ModelOpt-style for
// nvfp4, w13_weight/w2_weight otherwise; optional biases and e_score_correction_bias; tid2eid
// int32|int64 [hash_vocab, top_k] of a hash-routed layer). Host or device memory, dense
// row-major.
struct NamedTensor {
  std::string name;
  DLTensor tensor;
};
struct TensorDesc {
  std::string name;
  std::string dtype;  // U8, F8_E4M3 (uint8 bits), BF16, F32, I32; "BF16|F32" where either is taken
  std::vector<int64_t> shape;
  bool optional = false;
};
// The checkpoint tensors spec.format takes.
MOEKIT_API std::vector<TensorDesc> checkpoint_tensors(const LayerSpec& spec);

// Converts checkpoint tensors into the plan's packed buffers (packed[i] is plan.buffers[i]: at
// least that many bytes, on plan.device). Load time: works on the host and waits for its copies.
MOEKIT_API Status pack_weights(const LayerSpec& spec, const LayerPlan& plan,
                    std::span<const NamedTensor> checkpoint, std::span<const DLTensor> packed,
                    void* stream = nullptr);
// Random but valid packed weights (benchmarks, tests): no checkpoint needed.
MOEKIT_API Status synthesize_weights(const LayerSpec& spec, const LayerPlan& plan,
                          std::span<const DLTensor> packed, uint64_t seed, void* stream = nullptr);

struct BackendInfo {
  std::string name, summary;
  ActivationFormat activation_format = ActivationFormat::kStandard;
  std::vector<WeightFormat> weight_formats;
  std::vector<Activation> activations;
  bool gpu = false;        // needs an SM90 GPU
  bool available = false;  // its device is present here
  std::vector<ActivationDtype> activation_dtypes;  // the LayerSpec::activation_dtype values it runs
};
MOEKIT_API std::vector<BackendInfo> backends();
// "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)" or "CPU (no CUDA device)".
MOEKIT_API std::string device_description(DLDevice device = {kDLCUDA, 0});
// The oracle's decision for spec on options.device at `tokens` tokens, as plan_layer makes it.
MOEKIT_API Status explain(const LayerSpec& spec, const Options& options, int64_t tokens, std::string* text);
// The quantization a layer with activation_dtype fp8 applies to both GEMMs' inputs (spec.hpp;
// docs/FORMATS.md "FP8 activations"), to check an engine's own quantizer against: x [rows, K]
// float32 -> codes [rows, K] uint8 (E4M3 bits) and scales [rows, ceil(K / 128)] float32. Host
// (CPU) tensors with dense rows; scale fp32 or ue8m0.
MOEKIT_API Status quantize_activations_fp8(const DLTensor& x, ActivationScale scale, const DLTensor& codes,
                                           const DLTensor& scales);

class MOEKIT_API Layer {
 public:
  // packed[i] must be the buffers pack_weights or synthesize_weights filled for plan; they are
  // borrowed: keep them alive (and unchanged) for the layer's life.
  static Status create(const LayerSpec& spec, const LayerPlan& plan,
                       std::span<const DLTensor> packed, std::unique_ptr<Layer>* layer);
  ~Layer();
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  const LayerSpec& spec() const;
  const std::string& backend() const;
  DLDevice device() const;

  // Workspace bytes for `tokens` tokens with k slots each (0: spec.top_k); a*tokens + b. Any
  // buffer of at least this size on the layer's device, 256-byte aligned; its contents do not
  // matter between calls, so layers may share one.
  int64_t workspace_bytes(int64_t tokens, int k = 0) const;
  // Workspace bytes of forward_batched with rows_per_expert rows per expert.
  int64_t batched_workspace_bytes(int64_t rows_per_expert) const;

  // Routing + experts + finalize. x [T, H] bf16, logits [T, E] f32 (dense rows), out [T, H]
  // bf16; T <= spec.max_tokens. shared [T, H] bf16 (optional): a shared expert's output, added
  // before the one rounding: out = bf16(sum_k w_k y_k + shared). topk_ids [T, k] int32 and
  // topk_weights [T, k] f32 (optional, dense): the routing result, written when given.
  // token_ids [T] int32 or int64: the rows' token ids, required by a hash-routed layer
  // (spec.hash_vocab > 0; its experts are tid2eid[token_id]) and refused by the others. On a
  // GPU an id outside [0, hash_vocab) gives its row no expert (y = shared, or 0) and a flag that
  // check() reads; on the CPU it is an error before anything is written.
  Status forward_logits(const DLTensor& x, const DLTensor& logits, const DLTensor& out,
                        const DLTensor& workspace, void* stream, const DLTensor* shared = nullptr,
                        const DLTensor* topk_ids = nullptr, const DLTensor* topk_weights = nullptr,
                        const DLTensor* token_ids = nullptr);
  // Experts + finalize from given top-k ids [T, k] int32 (-1 = no expert) and weights [T, k] f32
  // (used as given: routed_scaling_factor is not applied again); T * k <= max_tokens * top_k.
  Status forward_topk(const DLTensor& x, const DLTensor& topk_ids, const DLTensor& topk_weights,
                      const DLTensor& out, const DLTensor& workspace, void* stream,
                      const DLTensor* shared = nullptr);
  // The experts alone on the batched format: x [E, M, H] bf16 and expert_num_tokens [E] int32;
  // out [E, M, H] bf16 gets expert e's output in rows [0, count_e) and nothing else is written
  // (no top-k weights: the caller's finalize applies them). M <= spec.max_tokens; the counts
  // add up to at most max_tokens x top_k (the routed rows of max_tokens tokens): counts past M,
  // or rows past that sum (in expert order), are skipped and flagged for check().
  Status forward_batched(const DLTensor& x, const DLTensor& expert_num_tokens, const DLTensor& out,
                         const DLTensor& workspace, void* stream);

  // Waits for `stream` and reads the layer's device error flag of the last call: ids out of
  // range, batched counts past M, token ids outside the hash table. Not during graph capture.
  // Always ok on the CPU.
  Status check(void* stream);

  struct Impl;

 private:
  explicit Layer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- helpers for callers without a tensor library of their own ------------------------------

inline constexpr DLDataType kBF16 = {kDLBfloat, 16, 1};
inline constexpr DLDataType kF32 = {kDLFloat, 32, 1};
inline constexpr DLDataType kI32 = {kDLInt, 32, 1};
inline constexpr DLDataType kI64 = {kDLInt, 64, 1};
inline constexpr DLDataType kU8 = {kDLUInt, 8, 1};

// A DLTensor over memory someone else owns; dense rows unless strides (in elements) are given.
class MOEKIT_API TensorRef {
 public:
  TensorRef(void* data, DLDataType dtype, std::vector<int64_t> shape,
            DLDevice device = {kDLCPU, 0}, std::vector<int64_t> strides = {});
  TensorRef(const TensorRef& o);
  TensorRef& operator=(const TensorRef& o);
  const DLTensor& dl() const { return t_; }
  operator const DLTensor&() const { return t_; }  // NOLINT: a view converts freely

 private:
  void point();
  std::vector<int64_t> shape_, strides_;
  DLTensor t_{};
};

// An owned buffer of bytes on a device (cudaMalloc on CUDA devices, aligned host memory on the
// CPU), for packed weights and workspaces.
class MOEKIT_API Buffer {
 public:
  static Status allocate(DLDevice device, int64_t bytes, Buffer* out);
  Buffer() = default;
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  ~Buffer();
  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  DLDevice device() const { return device_; }
  TensorRef tensor() const { return TensorRef(data_, kU8, {bytes_}, device_); }
  // Blocking copies between this buffer (from `offset` bytes) and host memory.
  Status copy_from_host(const void* src, int64_t bytes, int64_t offset = 0);
  Status copy_to_host(void* dst, int64_t bytes, int64_t offset = 0) const;

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  DLDevice device_ = {kDLCPU, 0};
};

// Packs a layer into buffers it owns (plan, pack, create): the shortest way to a Layer when the
// caller has no allocator of its own. checkpoint as for pack_weights; empty: synthetic weights.
struct OwnedLayer {
  LayerPlan plan;
  std::vector<Buffer> packed;
  std::unique_ptr<Layer> layer;
};
MOEKIT_API Status make_layer(const LayerSpec& spec, const Options& options,
                  std::span<const NamedTensor> checkpoint, OwnedLayer* out);

}  // namespace moekit
