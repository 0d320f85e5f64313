// Instantiation of the SM90 FP8 grouped GEMM (MXFP4 weights) and its tensor maps.
#include "moekit/experts/sm90_fp8_gemm.h"

#include "moekit/common/kernel_attr.h"
#include "moekit/common/trap_record.h"
#include "moekit/experts/sm90_prefill_gemm.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::sm90::fp8 {

namespace {
template <WeightFormat F>
cudaError_t run(const Fp8Args& a, int grid, cudaStream_t s, bool pdl) {
  constexpr auto fn = fp8_gemm_kernel<F>;
  constexpr int kDynSmem = Traits<F>::kDynSmem;
  if (const cudaError_t cfg = max_dynamic_smem_once<fn>(kDynSmem); cfg != cudaSuccess) return cfg;
  Fp8Args b = a;
  if (!b.base.trap) b.base.trap = trap::device_record_if_ready();
  return launch(fn, dim3(unsigned(grid)), dim3(kThreads), size_t(kDynSmem), s, pdl, b);
}
}  // namespace

bool fp8_supports(WeightFormat f, int64_t num_experts) {
  return f == WeightFormat::kMxfp4 && num_experts <= prefill::kMaxExperts;
}

cudaError_t launch_fp8_gemm(const Fp8Args& a, int grid, cudaStream_t s, bool pdl) {
  if (grid < 1 || !fp8_supports(a.base.dims.format, a.base.dims.E)) return cudaErrorInvalidValue;
  return run<WeightFormat::kMxfp4>(a, grid, s, pdl);
}

cudaError_t make_fp8_rows_map(CUtensorMap* map, const uint8_t* base, int64_t rows, int64_t cols, int box_rows) {
  if (cols % kKBlock != 0 || (box_rows != 16 && box_rows != prefill::kBigBoxRows)) return cudaErrorInvalidValue;
  return prefill::encode_2d_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, base, rows, cols, cols, kGroupK, box_rows, true);
}

cudaError_t make_fp8_scale_map(CUtensorMap* map, const float* base, int64_t rows_pad, int64_t groups) {
  if (rows_pad % 4 != 0) return cudaErrorInvalidValue;
  return prefill::encode_2d_map(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, base, groups, rows_pad, rows_pad * 4, kRows, 1,
                                false);
}

}  // namespace moekit::sm90::fp8
