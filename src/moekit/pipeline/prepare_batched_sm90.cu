#include <cuda_bf16.h>

#include <cub/block/block_scan.cuh>

#include "moekit/pipeline/prepare_batched_sm90.cuh"

namespace moekit::sm90 {

namespace {

// One CTA per (row, group); its threads copy the row's H columns and zero [H, K_pad).
__global__ void stage_rows_kernel(const uint16_t* x, int64_t rows, int64_t x_stride, int64_t x_group_stride,
                                  int64_t H, int64_t K_pad, const int32_t* counts, uint16_t* dst) {
  const int64_t r = blockIdx.x, g = blockIdx.y;
  if (counts && r >= min(int64_t(max(counts[g], 0)), rows)) return;
  const uint16_t* src = x + g * x_group_stride + r * x_stride;
  uint16_t* out = dst + (g * rows + r) * K_pad;
  for (int64_t c = threadIdx.x; c < K_pad; c += blockDim.x) out[c] = c < H ? src[c] : uint16_t(0);
}

constexpr int kPlanThreads = kMaxPlanCountsExperts;

__global__ void __launch_bounds__(kPlanThreads)
    plan_counts_kernel(const PlanBuffers b, const int32_t* counts, int E, int capacity, int64_t max_rows,
                       float* one) {
  using Scan = cub::BlockScan<int, kPlanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int e = threadIdx.x;
  const int raw = e < E ? counts[e] : 0;
  int c = min(max(raw, 0), capacity);
  bool bad = e < E && c != raw;
  // Rows in expert order past max_rows are dropped (the state holds that many rows' counters).
  int before, total;
  Scan(tmp).ExclusiveSum(c, before, total);
  __syncthreads();
  if (int64_t(before) + c > max_rows) {
    c = max_rows > before ? int(max_rows - before) : 0;
    bad = true;
  }
  const int ch = (c + kTokens - 1) / kTokens;
  int slot, active, chunks, all_chunks;
  Scan(tmp).ExclusiveSum(c > 0 ? 1 : 0, slot, active);
  __syncthreads();
  Scan(tmp).ExclusiveSum(ch, chunks, all_chunks);
  const int any_bad = __syncthreads_or(bad);
  if (e < E) {
    b.expert_count[e] = c;
    if (c > 0) {
      b.expert[slot] = e;
      b.count[slot] = c;
      b.row_start[slot] = e * capacity;
      b.chunk_prefix[slot + 1] = chunks + ch;
    }
    for (int r = 0; r < c; ++r) b.row_src[int64_t(e) * capacity + r] = 0;
  }
  if (e == 0) {
    b.chunk_prefix[0] = 0;
    *b.num_active = active;
    *b.error = any_bad ? 2 : 0;
    *one = 1.0f;
  }
}

__global__ void store_batched_kernel(const float* out, const int* expert_count, int64_t M, int64_t H,
                                     uint16_t* y, int64_t y_stride, int64_t y_expert_stride) {
  const int64_t r = blockIdx.x, e = blockIdx.y;
  ptx::grid_dependency_wait();
  if (r >= expert_count[e]) return;
  const float* src = out + (e * M + r) * H;
  uint16_t* dst = y + e * y_expert_stride + r * y_stride;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    const __nv_bfloat16 v = __float2bfloat16_rn(src[c]);
    dst[c] = *reinterpret_cast<const uint16_t*>(&v);
  }
}

}  // namespace

cudaError_t launch_stage_rows(const uint16_t* x, int64_t groups, int64_t rows, int64_t x_stride,
                              int64_t x_group_stride, int64_t H, int64_t K_pad, const int32_t* counts,
                              uint16_t* dst, cudaStream_t s) {
  if (rows * groups == 0) return cudaSuccess;
  return launch(stage_rows_kernel, dim3(unsigned(rows), unsigned(groups)), dim3(128), 0, s, false, x, rows, x_stride,
                x_group_stride, H, K_pad, counts, dst);
}

cudaError_t launch_plan_counts(const PlanBuffers& b, const int32_t* counts, int E, int capacity,
                               int64_t max_rows, float* one, cudaStream_t s) {
  if (E > kMaxPlanCountsExperts) return cudaErrorInvalidValue;
  return launch(plan_counts_kernel, dim3(1), dim3(kPlanThreads), 0, s, false, b, counts, E, capacity, max_rows, one);
}

cudaError_t launch_store_batched(const float* out, const int* expert_count, int E, int64_t M, int64_t H,
                                 uint16_t* y, int64_t y_stride, int64_t y_expert_stride, cudaStream_t s,
                                 bool pdl) {
  if (M * E == 0) return cudaSuccess;
  return launch(store_batched_kernel, dim3(unsigned(M), unsigned(E)), dim3(128), 0, s, pdl, out, expert_count,
                M, H, y, y_stride, y_expert_stride);
}

}  // namespace moekit::sm90
