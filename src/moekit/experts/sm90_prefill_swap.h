// moekit/experts/sm90_prefill_swap.h — host entry of the SM90 prefill GEMM with swapped operands
// (see the .cuh). Same arguments and results as launch_prefill_gemm (sm90_prefill_gemm.h).
#pragma once

#include <cuda_runtime.h>

#include "moekit/experts/sm90_prefill_gemm.h"

namespace moekit::sm90::prefill {

// Launches one GEMM on `grid` persistent CTAs (one per SM); tile_counter and exit_count as for
// launch_prefill_gemm. Every weight format.
cudaError_t launch_prefill_swap_gemm(const PrefillArgs& a, int grid, cudaStream_t s, bool pdl);

}  // namespace moekit::sm90::prefill
