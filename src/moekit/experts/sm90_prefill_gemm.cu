// Instantiations of the SM90 prefill GEMM: one kernel per weight format.
#include "moekit/experts/sm90_prefill_gemm.h"

#include "moekit/common/kernel_attr.h"
#include "moekit/common/trap_record.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::sm90::prefill {

namespace {
template <WeightFormat F, bool kSmall>
cudaError_t run(const PrefillArgs& a, int grid, cudaStream_t s, bool pdl) {
  constexpr auto fn = prefill_gemm_kernel<F, kSmall>;
  constexpr int kDynSmem = PTraits<F, kSmall>::kDynSmem;
  if (const cudaError_t cfg = max_dynamic_smem_once<fn>(kDynSmem); cfg != cudaSuccess) return cfg;
  PrefillArgs b = a;
  if (!b.trap) b.trap = trap::device_record_if_ready();
  return launch(fn, dim3(unsigned(grid)), dim3(PTraits<F, kSmall>::kThreads), size_t(kDynSmem), s, pdl, b);
}
}  // namespace

cudaError_t make_rows_map(CUtensorMap* map, const uint16_t* base, int64_t rows, int64_t cols, int box_rows) {
  // The driver's encoder, through the runtime (no link against libcuda).
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  const bool box_ok = box_rows == 1 || box_rows == 16 || box_rows == kBigBoxRows;
  if (!encode || rows < 1 || cols % kKBlock != 0 || !box_ok) return cudaErrorInvalidValue;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kKBlock), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t*>(base), dims, strides, box,
                            elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

bool prefill_supports(WeightFormat, bool single_multiply, int64_t num_experts) {
  return single_multiply && num_experts <= kMaxExperts;
}

bool prefill_has_small_tiles(WeightFormat f) { return f == WeightFormat::kMxfp4 || f == WeightFormat::kNvfp4; }

cudaError_t launch_prefill_gemm(const PrefillArgs& a, int grid, cudaStream_t s, bool pdl, bool small_tiles) {
  if (grid < 1 || a.dims.E > kMaxExperts) return cudaErrorInvalidValue;
  if (small_tiles && !prefill_has_small_tiles(a.dims.format)) return cudaErrorInvalidValue;
  switch (a.dims.format) {
    case WeightFormat::kMxfp4:
      return small_tiles ? run<WeightFormat::kMxfp4, true>(a, grid, s, pdl) : run<WeightFormat::kMxfp4, false>(a, grid, s, pdl);
    case WeightFormat::kNvfp4:
      return small_tiles ? run<WeightFormat::kNvfp4, true>(a, grid, s, pdl) : run<WeightFormat::kNvfp4, false>(a, grid, s, pdl);
    case WeightFormat::kMxfp8: return run<WeightFormat::kMxfp8, false>(a, grid, s, pdl);
    case WeightFormat::kBf16: return run<WeightFormat::kBf16, false>(a, grid, s, pdl);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moekit::sm90::prefill
