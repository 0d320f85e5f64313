// moekit/experts/sm90_fp8_chain.cuh — the experts of a layer with FP8 activations on SM90
// (LayerSpec::activation_dtype = fp8; docs/FORMATS.md "FP8 activations"), on a plan another stage
// made (route_plan or plan_counts, prepare_finalize_sm90.cuh / prepare_batched_sm90.cuh):
//
//   quantize_input  GEMM1's input to E4M3 codes + one scale per row per 128 K
//                   (quantize_fp8_sm90.cuh): the tokens x [T, x_stride] gathered by dest (the
//                   routed entries: each token quantized once, stored in each of its rows), or
//                   rows already in expert order (the batched entry, dest null)
//   gemm1           the FP8 grouped GEMM (experts/sm90_fp8_gemm.cuh) with the layer's biases and
//                   activation: the bf16 intermediate mid [rows, I_pad]
//   gemm2           mid quantized likewise (rows), then the FP8 GEMM: fp32 rows out [rows, H],
//                   each times its weight weights[row_src[row]] (finalize / store_batched follow,
//                   as on the bf16 path)
//
// Every launch may go into a LaunchList (launch_sm90.cuh): nothing allocated, nothing read back
// on the host, capturable in a CUDA graph. The buffers are the call's workspace (Fp8ChainRows).
// The tensor maps of the quantized rows are encoded on the host once per (buffer, rows) and
// kept (Fp8Chain's cache), as the prefill GEMMs' are (backends/sm90_layer.cu).
//
// Contract: MXFP4 or MXFP8 weights (fp8_supports), the layout sm90_convert.cpp makes; the work
// list's experts ascending (row_start ascending, as both plans make it); rows >= 1.
// Rows outside the work list: standard format, padding rows (row_src -1) get zero codes and
// scales; batched formats (work_rows), rows past an expert's count are neither read nor written
// (quantize_fp8_sm90.cuh). The GEMMs never store an output of such a row.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moekit/common/carve.h"
#include "moekit/common/small_cache.h"
#include "moekit/experts/activation.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/experts/sm90_moe_gemm.cuh"
#include "moekit/spec.hpp"

namespace moekit::sm90::fp8 {

// One call's quantized rows (in the workspace): GEMM1's input codes [rows, H_pad] and scales
// [ceil(H_pad / 128), rows_pad] fp32, GEMM2's [rows, I_pad] and [ceil(I_pad / 128), rows_pad]
// (rows_pad = fp8_scale_rows_pad(rows)).
struct Fp8ChainRows {
  uint8_t* x_codes = nullptr;
  float* x_scales = nullptr;
  uint8_t* mid_codes = nullptr;
  float* mid_scales = nullptr;
  int64_t rows = 0, rows_pad = 0;
  // Carved from cv (a null base only counts the bytes).
  void carve(Carve& cv, int64_t rows, int64_t H_pad, int64_t I_pad);
};

// One matrix as the kernel reads it (MXFP4 / MXFP8: no epilogue row scale).
struct Fp8ChainWeights {
  LayoutDims dims;
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const float* bias = nullptr;  // [E, N_pad] or null
};

struct Fp8ChainCall {
  Fp8ChainWeights w13, w2;
  ActivationParams act;
  ActivationScale rule = ActivationScale::kFp32;
  int64_t H = 0, I = 0;            // logical sizes (the weights' K_pad: H_pad, I_pad)
  // The plan: the work list over the layer's experts, rows in expert order.
  DeviceWork work{};
  const int32_t* row_src = nullptr;  // [rows] row -> entry t * k + j (standard: -1 padding)
  const float* weights = nullptr;    // GEMM2's row weights: weights[row_src[row]]
  bool work_rows = false;            // batched formats: only the work list's rows are touched
  // GEMM1's input: tokens x [T, x_stride] bf16 gathered by dest [T * k] (dest non-null), else
  // rows [rows, x_stride] in expert order. x_stride: H_pad; x 16-byte aligned.
  const uint16_t* x = nullptr;
  int64_t x_stride = 0;
  const int32_t* dest = nullptr;
  int64_t T = 0;
  int k = 0;
  Fp8ChainRows q;
  uint16_t* mid = nullptr;  // [rows, I_pad] bf16: GEMM1's output
  float* out = nullptr;     // [rows, H] fp32: GEMM2's output
  int* counters = nullptr;  // [4]: each GEMM's tile counter and exit count, zero between calls
                            //   (every launch leaves them zero)
  int grid = 0;             // persistent CTAs of each GEMM (one per SM)
};

// The chain's launches for one layer (one per layer: its cache is not thread-safe, as the layer's
// calls come from one thread).
class Fp8Chain {
 public:
  cudaError_t quantize_input(const Fp8ChainCall& c, cudaStream_t s, bool pdl);
  cudaError_t gemm1(const Fp8ChainCall& c, cudaStream_t s, bool pdl);
  cudaError_t gemm2(const Fp8ChainCall& c, cudaStream_t s, bool pdl);  // quantize mid, then GEMM2

 private:
  struct MapKey {
    const void* base = nullptr;
    int64_t rows = 0, cols = 0;
    int box = 0;  // rows of a code box (16, prefill::kBigBoxRows), or 0: the scales' map
    bool operator==(const MapKey& o) const {
      return base == o.base && rows == o.rows && cols == o.cols && box == o.box;
    }
  };
  // Three maps per GEMM (16- and 64-row boxes of codes, the scales): four call shapes.
  SmallCache<MapKey, CUtensorMap, 24> maps_;
  cudaError_t gemm(const Fp8ChainCall& c, bool second, cudaStream_t s, bool pdl);
};

}  // namespace moekit::sm90::fp8
