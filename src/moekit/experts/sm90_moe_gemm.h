// moekit/experts/sm90_moe_gemm.h — host entry of the SM90 grouped MoE GEMM (see the .cuh).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "moekit/experts/sm90_moe_gemm.cuh"

namespace moekit::sm90 {

// The shape a launch can take: `want` where the format has it (MXFP4, single multiply), else
// kNarrow.
GemmShape gemm_shape(WeightFormat f, bool single_multiply, GemmShape want);
// CTAs per SM that fit in shape sh (for the persistent grid: every CTA must be resident), in
// every chunk variant of the shape.
int gemm_ctas_per_sm(WeightFormat f, GemmShape sh);
// Whether the kernel has chunks of `rows` (8; 16 or 24: single-multiply scales, E <=
// kCachedExperts; 24 in the narrow shape only).
bool gemm_has_chunk_rows(int rows, WeightFormat f, bool single_multiply, int64_t experts);
// The CTA shape's name as `moekit bench` prints it: CTAs per SM x ring stages, "/16" or "/24"
// for the longer chunks (e.g. "3x5", "3x4/16", "3x3/24").
std::string gemm_cta_name(WeightFormat f, GemmShape sh, int chunk_rows);
// Launches the kernel for the weight format of a.g[0] on `grid` persistent CTAs of shape sh
// (a shape that gemm_shape returned, grid at most SMs x gemm_ctas_per_sm).
cudaError_t launch_moe_gemm(const FusedArgs& a, int grid, cudaStream_t s, bool pdl, GemmShape sh);

}  // namespace moekit::sm90
