// moekit/bench/bench.h — the `moekit bench` driver: synthetic weights, uniform or Zipf-skewed
// random routing, CUDA-graph replays timed with events after an L2 flush, median of many.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/common/spec.h"

namespace moekit {

// Named shapes (bench_shape_names(): gpt-oss-120b, gpt-oss-20b, deepseek-v3, qwen3-30b-a3b,
// qwen3-235b-a22b, mixtral-8x7b, deepseek-v4-pro, deepseek-v4-flash, deepseek-v4.1-flash), or
// "E,k,H,I".
MoeConfig bench_shape(const std::string& name, WeightFormat f);
std::vector<std::string> bench_shape_names();
std::string bench_shape_help();  // "gpt-oss-120b | ... | E,k,H,I"

// How the benchmark's tokens pick experts. uniform: every expert equally likely; zipf: the
// expert of rank r (a permutation of the experts drawn from the seed, the same at every token
// count) with probability proportional to 1 / r^s, k distinct experts per token.
enum class BenchRouting { kUniform, kZipf };
const char* bench_routing_name(BenchRouting r);
// The probability of each expert being drawn (uniform: 1/E each).
std::vector<double> bench_expert_probabilities(int E, BenchRouting r, double zipf_s, uint64_t seed);
// Router logits [T, E] whose top-k follow that distribution (bench_inputs.cpp says how).
std::vector<float> bench_router_logits(const MoeConfig& c, int64_t T, BenchRouting r, double zipf_s, uint64_t seed);
// The rows each expert receives from those logits, routed on the CPU ([E]; the bench's GPU router
// picks the same experts): what the kernels see, for offline studies (bench/regret_study.py).
std::vector<int> bench_expert_counts(const MoeConfig& c, int64_t T, BenchRouting r, double zipf_s, uint64_t seed);

// The parts of the layer in the order it runs them, for the time split (BenchOptions::split):
// routing (the route plan, and staging x when its rows need padding), permute (x into expert
// order: the prefill kernel and the batched backends), GEMM1, GEMM2, finalize.
inline constexpr int kLayerParts = 5;
inline constexpr const char* kLayerPartNames[kLayerParts] = {"routing", "permute", "gemm1", "gemm2", "finalize"};

struct BenchRow {
  std::string backend, shape, format;
  int64_t tokens = 0;
  int active_experts = 0;
  double gemm_us = 0, layer_us = 0;   // medians
  double gemm_bytes = 0;              // active experts' weight + scale bytes
  double tbps = 0;                    // gemm_bytes / gemm time
  double pct_copy = 0;                // tbps / measured copy bandwidth
  double copy_tbps = 0;
  double layer_over_gemm = 0;
  double read_us = 0;   // a plain read of gemm_bytes in one kernel, timed the same way (median)
  double floor_us = 0;  // an empty kernel, timed the same way: what the method itself costs
  // Steady state (BenchOptions::steady_layers): per layer, over steady_layers layers with weights
  // of their own run back to back in one graph (0 when not measured).
  int steady_layers = 0;
  double steady_gemm_us = 0, steady_layer_us = 0;
  std::string gemm_shape;  // the GEMM kernel's CTA shape, CTAs per SM x stages ("3x5", "4x4"), or "prefill"
  // Both GEMM kernels on the same routing (BenchOptions::compare_kernels; 0 when not measured), and
  // which one the backend ran.
  double decode_us = 0, prefill_us = 0;
  std::string kernel;     // "decode" | "prefill"
  // "tokens": the token-count rule picked the kernel; "device": the device did, from the plan's
  // counts (oracle/kernel_choice.h), and gemm_us is the layer's path with both kernels launched.
  std::string kernel_choice = "tokens";
  double flops = 0;       // useful FLOPs of the two GEMMs, 2 x tokens x k x 3 x H x I
  double tflops = 0;      // flops / gemm time
  double bf16_tflops = 0; // a cuBLAS bf16 8192^3 GEMM in the same process (0: not measured)
  double peer_us = 0;     // --peer: the peer's two GEMMs on the same problem (0: not run)
  int64_t prefill_from = -1;  // the crossover the backend ran with (-1: never the prefill kernel)
  int max_expert_rows = 0;    // routed rows of the busiest expert
  // The time split (BenchOptions::split): the layer cut after each part, timed like layer_us;
  // part i's time is the cut after it minus the cut before it (so the parts add up to the
  // layer's time, and overlap between parts goes to the later one). 0 for a part the layer
  // does not run (the permute of the decode kernel); split_us[0] < 0: not measured.
  double split_us[kLayerParts] = {-1, 0, 0, 0, 0};
  // With the split: finalize alone on the whole layer's plan and GEMM output (its cut above
  // also holds whatever of the GEMMs' run-to-run variation the two cuts do not share).
  double finalize_alone_us = -1;
};

struct BenchOptions {
  std::string shape = "gpt-oss-120b";
  WeightFormat format = WeightFormat::kMxfp4;
  std::vector<int64_t> tokens = {1, 8, 32, 64};
  int reps = 50;
  uint64_t seed = 1;
  bool trace = false;   // print per-CTA phase timings of the GEMM kernel (diagnostics)
  std::string trace_file;  // with trace: also write every traced task (CSV) here, T appended
  int steady_layers = 0;   // > 1: also time this many layers back to back in one graph
  bool compare_kernels = false;  // also time the other GEMM kernel (decode / prefill) per row
  BenchRouting routing = BenchRouting::kUniform;
  double zipf_s = 1.0;
  std::vector<int64_t> split;   // token counts at which to time the layer's parts (split_us)
  // > 0: a timed quantity stops after this many ms of replays once it has 3 (long points of a
  // sweep); the other kernel of compare_kernels stops after one replay over 1.5x the backend's.
  double budget_ms = 0;
  bool gemms_only = false;      // only the GEMM kernels (tune): no layer, read or split timings
  // Hash routing (DeepSeek-V4's first layers): a random tid2eid [kBenchHashVocab, k] table and
  // random token ids choose the experts (uniform over the table); `routing` does not apply.
  bool hash_layer = false;
  bool progress = false;        // a line per token count on stderr (count, elapsed, estimate)
  // The experts' input precision (LayerSpec::activation_dtype / activation_scale).
  ActivationDtype activation_dtype = ActivationDtype::kBf16;
  ActivationScale activation_scale = ActivationScale::kFp32;
};

// The hash table's rows of `bench --hash`: DeepSeek-V4's vocabulary.
inline constexpr int64_t kBenchHashVocab = 129280;
// The shape's description as the bench runs it (bench_shape, hash-routed with o.hash_layer, with
// o's activations).
MoeConfig bench_config(const BenchOptions& o);

// What a benchmark ran on, for its JSON/CSV: GPU name, NVIDIA driver, CUDA runtime and driver
// API versions, the commit the binary was built from, the UTC date.
struct BenchStamp {
  std::string gpu, driver, cuda, commit, date;
};
// CUDA runtime and driver API versions ("runtime 13.0, driver API 13.0"; "none" without CUDA).
std::string bench_cuda_versions();

// GPU rows (the SM90 backends). Throws when no GPU is present or CUDA was not built.
std::vector<BenchRow> bench_gpu(const BenchOptions& o, const std::string& device_name);
// Measured device-to-device copy bandwidth, bytes read + written per second / 1e12.
double measure_copy_tbps();
// A bf16 8192^3 GEMM through cuBLAS (loaded at run time), TFLOP/s, median of 10; 0 and a reason
// in *why when cuBLAS cannot be loaded.
double measure_bf16_tflops(std::string* why);

}  // namespace moekit
