// Instantiations of the SM90 FP8 grouped GEMM (MXFP4, MXFP8 weights) and its tensor maps.
#include "moekit/experts/sm90_fp8_gemm.h"

#include "moekit/common/kernel_attr.h"
#include "moekit/common/trap_record.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::sm90::fp8 {

namespace {
// A 2-D tensor map [rows, cols] of `type` (row stride row_bytes), boxes of box_cols x box_rows,
// zero fill past the edges. The driver's encoder through the runtime (no link against libcuda),
// as make_rows_map (sm90_prefill_gemm.cu) finds it: that file is in the kernel stamp
// (cmake/kernel_manifest.txt), so sharing the lookup waits for its next measured change.
cudaError_t encode_2d_map(CUtensorMap* map, CUtensorMapDataType type, const void* base, int64_t rows, int64_t cols,
                          int64_t row_bytes, int box_cols, int box_rows, bool swizzle128) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    const bool ok = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) ==
                        cudaSuccess && q == cudaDriverEntryPointSuccess;
    return ok ? reinterpret_cast<Encode>(fn) : nullptr;
  }();
  if (!encode || rows < 1 || cols < 1) return cudaErrorInvalidValue;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(row_bytes)};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r =
      encode(map, type, 2, const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
             swizzle128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <WeightFormat F>
cudaError_t run(const Fp8Args& a, int grid, cudaStream_t s, bool pdl) {
  constexpr auto fn = fp8_gemm_kernel<F>;
  constexpr int kDynSmem = Traits<F>::kDynSmem;
  if (const cudaError_t cfg = max_dynamic_smem_once<fn>(kDynSmem); cfg != cudaSuccess) return cfg;
  Fp8Args b = a;
  if (!b.base.trap) b.base.trap = trap::device_record_if_ready();
  if (b.wait_limit_ns == 0) b.wait_limit_ns = trap::kWaitLimitNs;
  return launch(fn, dim3(unsigned(grid)), dim3(kThreads), size_t(kDynSmem), s, pdl, b);
}
}  // namespace

bool fp8_supports(WeightFormat f, int64_t num_experts) {
  return (f == WeightFormat::kMxfp4 || f == WeightFormat::kMxfp8) && num_experts <= prefill::kMaxExperts;
}

cudaError_t launch_fp8_gemm(const Fp8Args& a, int grid, cudaStream_t s, bool pdl) {
  if (grid < 1 || !fp8_supports(a.base.dims.format, a.base.dims.E)) return cudaErrorInvalidValue;
  return a.base.dims.format == WeightFormat::kMxfp4 ? run<WeightFormat::kMxfp4>(a, grid, s, pdl)
                                                    : run<WeightFormat::kMxfp8>(a, grid, s, pdl);
}

cudaError_t make_fp8_rows_map(CUtensorMap* map, const uint8_t* base, int64_t rows, int64_t cols, int box_rows) {
  if (cols % kKBlock != 0 || (box_rows != 16 && box_rows != prefill::kBigBoxRows)) return cudaErrorInvalidValue;
  return encode_2d_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, base, rows, cols, cols, kGroupK, box_rows, true);
}

cudaError_t make_fp8_scale_map(CUtensorMap* map, const float* base, int64_t rows_pad, int64_t groups) {
  if (rows_pad % 4 != 0) return cudaErrorInvalidValue;
  // Boxes of kSxBox rows at a multiple of 4 (the kernel loads row0 & ~3 on): every box starts 16-byte aligned.
  if (rows_pad < kSxBox) return cudaErrorInvalidValue;
  return encode_2d_map(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, base, groups, rows_pad, rows_pad * 4,
                       kSxBox, 1, false);
}

}  // namespace moekit::sm90::fp8
