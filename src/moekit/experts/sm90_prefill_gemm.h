// moekit/experts/sm90_prefill_gemm.h — host entry of the SM90 prefill GEMM (see the .cuh).
#pragma once

#include <cuda_runtime.h>

#include "moekit/experts/sm90_prefill_gemm.cuh"

namespace moekit::sm90::prefill {

// Launches one GEMM on `grid` persistent CTAs (one per SM). tile_counter and exit_count must be
// zero before the first launch; every launch leaves them zero. small_tiles: the small-tile kernel
// (token tiles of at most kSmallN rows, weight tiles of up to kSmallGroups groups, three consumer
// warpgroups; MXFP4 and NVFP4 only, see prefill_has_small_tiles): correct for any counts, faster
// where experts have few rows (the layer's rule: oracle/kernel_choice.h prefill_small_tiles).
cudaError_t launch_prefill_gemm(const PrefillArgs& a, int grid, cudaStream_t s, bool pdl, bool small_tiles = false);
// Whether the format has the small-tile kernel.
bool prefill_has_small_tiles(WeightFormat f);
// The tensor map of a [rows, cols] bf16 activation buffer (row stride cols, cols a multiple of
// 64) with boxes of 64 columns x box_rows (1, 16 or kBigBoxRows) rows in the 128-byte swizzle
// (PrefillArgs::in_map, in_map_big).
cudaError_t make_rows_map(CUtensorMap* map, const uint16_t* base, int64_t rows, int64_t cols, int box_rows);
// Whether the prefill kernel can run these weights (single-multiply scales, E <= kMaxExperts).
bool prefill_supports(WeightFormat f, bool single_multiply, int64_t num_experts);

}  // namespace moekit::sm90::prefill
