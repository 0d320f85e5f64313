// moekit/pipeline/prepare_batched_sm90.cuh — what the public API's calls need around the SM90
// kernels of prepare_finalize_sm90.cuh when the caller's tensors are used in place:
//   stage_rows    copies x rows into a buffer of stride K_pad with zero padding columns, where
//                 x cannot be read in place (H not a multiple of 64, other row strides); with
//                 counts, only rows [0, min(counts[g], rows)) of each group g.
//   plan_counts   the plan of the batched entry point: experts with rows from the caller's
//                 expert_num_tokens (clamped to [0, capacity] and to max_rows in all, error flag
//                 2 otherwise), row_start = e * capacity, row_src = 0 with weight one[0] = 1.
//   store_batched out rows [0, expert_count[e]) of every expert as bf16; nothing else written.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::sm90 {

constexpr int kMaxPlanCountsExperts = 1024;  // one thread per expert in one CTA

cudaError_t launch_stage_rows(const uint16_t* x, int64_t groups, int64_t rows, int64_t x_stride,
                              int64_t x_group_stride, int64_t H, int64_t K_pad, const int32_t* counts,
                              uint16_t* dst, cudaStream_t s);
cudaError_t launch_plan_counts(const PlanBuffers& b, const int32_t* counts, int E, int capacity,
                               int64_t max_rows, float* one, cudaStream_t s);
cudaError_t launch_store_batched(const float* out, const int* expert_count, int E, int64_t M, int64_t H,
                                 uint16_t* y, int64_t y_stride, int64_t y_expert_stride, cudaStream_t s,
                                 bool pdl);

}  // namespace moekit::sm90
