// moekit/backends/bench.h — the `moekit bench` driver: synthetic weights, uniform random routing,
// CUDA-graph replays timed with events after an L2 flush, median of many.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/common/spec.h"

namespace moekit {

// Named shapes: gpt-oss-120b, gpt-oss-20b, deepseek-v3, qwen3-30b-a3b, or "E,k,H,I".
MoeConfig bench_shape(const std::string& name, WeightFormat f);

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
  double flops = 0;       // useful FLOPs of the two GEMMs, 2 x tokens x k x 3 x H x I
  double tflops = 0;      // flops / gemm time
  double bf16_tflops = 0; // a cuBLAS bf16 8192^3 GEMM in the same process (0: not measured)
  double peer_us = 0;     // --peer: the peer's two GEMMs on the same problem (0: not run)
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
};

// GPU rows (the SM90 backends). Throws when no GPU is present or CUDA was not built.
std::vector<BenchRow> bench_gpu(const BenchOptions& o, const std::string& device_name);
// Measured device-to-device copy bandwidth, bytes read + written per second / 1e12.
double measure_copy_tbps();
// A bf16 8192^3 GEMM through cuBLAS (loaded at run time), TFLOP/s, median of 10; 0 and a reason
// in *why when cuBLAS cannot be loaded.
double measure_bf16_tflops(std::string* why);

}  // namespace moekit
