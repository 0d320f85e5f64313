// Instantiations of the SM90 prefill GEMM: one kernel per weight format.
#include "moekit/experts/sm90_prefill_gemm.h"

#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::sm90::prefill {

namespace {
template <WeightFormat F>
cudaError_t run(const PrefillArgs& a, int grid, cudaStream_t s, bool pdl) {
  constexpr auto fn = prefill_gemm_kernel<F>;
  static const cudaError_t cfg =
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, PTraits<F>::kDynSmem);
  if (cfg != cudaSuccess) return cfg;
  return launch(fn, dim3(unsigned(grid)), dim3(kThreads), size_t(PTraits<F>::kDynSmem), s, pdl, a);
}
}  // namespace

bool prefill_supports(WeightFormat, bool single_multiply, int64_t num_experts) {
  return single_multiply && num_experts <= kMaxExperts;
}

cudaError_t launch_prefill_gemm(const PrefillArgs& a, int grid, cudaStream_t s, bool pdl) {
  if (grid < 1 || a.dims.E > kMaxExperts) return cudaErrorInvalidValue;
  switch (a.dims.format) {
    case WeightFormat::kMxfp4: return run<WeightFormat::kMxfp4>(a, grid, s, pdl);
    case WeightFormat::kNvfp4: return run<WeightFormat::kNvfp4>(a, grid, s, pdl);
    case WeightFormat::kMxfp8: return run<WeightFormat::kMxfp8>(a, grid, s, pdl);
    case WeightFormat::kBf16: return run<WeightFormat::kBf16>(a, grid, s, pdl);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moekit::sm90::prefill
