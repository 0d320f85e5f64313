// moekit/experts/sm90_moe_gemm.h — host entry of the SM90 grouped MoE GEMM (see the .cuh).
#pragma once

#include <cuda_runtime.h>

#include "moekit/experts/sm90_moe_gemm.cuh"

namespace moekit::sm90 {

// CTAs per SM that fit (for the persistent grid).
int gemm_ctas_per_sm(WeightFormat f);
// Launches the kernel for the weight format of a.g[0] on `grid` persistent CTAs.
cudaError_t launch_moe_gemm(const FusedArgs& a, int grid, cudaStream_t s, bool pdl);

}  // namespace moekit::sm90
