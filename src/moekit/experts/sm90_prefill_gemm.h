// moekit/experts/sm90_prefill_gemm.h — host entry of the SM90 prefill GEMM (see the .cuh).
#pragma once

#include <cuda_runtime.h>

#include "moekit/experts/sm90_prefill_gemm.cuh"

namespace moekit::sm90::prefill {

// Launches one GEMM on `grid` persistent CTAs (one per SM). tile_counter and exit_count must be
// zero before the first launch; every launch leaves them zero.
cudaError_t launch_prefill_gemm(const PrefillArgs& a, int grid, cudaStream_t s, bool pdl);
// Whether the prefill kernel can run these weights (single-multiply scales, E <= kMaxExperts).
bool prefill_supports(WeightFormat f, bool single_multiply, int64_t num_experts);

}  // namespace moekit::sm90::prefill
