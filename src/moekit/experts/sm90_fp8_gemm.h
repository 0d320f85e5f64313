// moekit/experts/sm90_fp8_gemm.h — host entry of the SM90 FP8 grouped GEMM (see the .cuh).
// Internal: run by the SM90 layer for fp8 layers (experts/sm90_fp8_chain.cuh); not tuned yet.
#pragma once

#include <cuda_runtime.h>

#include "moekit/experts/sm90_fp8_gemm.cuh"

namespace moekit::sm90::fp8 {

// Whether the kernel runs these weights (MXFP4 or MXFP8, E <= prefill::kMaxExperts).
bool fp8_supports(WeightFormat f, int64_t num_experts);
// Launches one GEMM on `grid` persistent CTAs (one per SM). base.tile_counter and
// base.exit_count must be zero before the first launch; every launch leaves them zero. A wait
// past a.wait_limit_ns (0: trap::kWaitLimitNs) fails the launch with its trap record.
cudaError_t launch_fp8_gemm(const Fp8Args& a, int grid, cudaStream_t s, bool pdl);
// The E4M3 activation rows [rows, cols] (cols = the weights' K_pad, a multiple of 64; row stride
// cols bytes) with boxes of 128 columns x box_rows (16 or prefill::kBigBoxRows), 128-byte swizzle:
// Fp8Args::base.in_map (16) and in_map_big (64).
cudaError_t make_fp8_rows_map(CUtensorMap* map, const uint8_t* base, int64_t rows, int64_t cols, int box_rows);
// The activation scales [groups, rows_pad] fp32 (rows_pad = fp8_scale_rows_pad(rows);
// groups = ceil(cols / 128)) with boxes of kSxBox rows x 1 group (the kernel loads a
// tile's scales from its first row rounded down to a multiple of 4): Fp8Args::sx_map.
cudaError_t make_fp8_scale_map(CUtensorMap* map, const float* base, int64_t rows_pad, int64_t groups);
// rows_pad for `rows` activation rows: a multiple of 4 (16-byte rows of the map), at least one
// box (kSxBox).
inline int64_t fp8_scale_rows_pad(int64_t rows) {
  const int64_t p = (rows + 3) / 4 * 4;
  return p < kSxBox ? kSxBox : p;
}

}  // namespace moekit::sm90::fp8
