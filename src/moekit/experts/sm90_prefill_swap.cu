// Instantiations of the SM90 prefill GEMM with swapped operands: one kernel per weight format.
// A translation unit of its own: the prefill kernel's object does not see this kernel's headers.
#include "moekit/common/trap_record.h"
#include "moekit/experts/sm90_prefill_swap.cuh"
#include "moekit/experts/sm90_prefill_swap.h"
#include "moekit/pipeline/launch_sm90.cuh"

namespace moekit::sm90::prefill {

namespace {
template <WeightFormat F>
cudaError_t run_swap(const PrefillArgs& a, int grid, cudaStream_t s, bool pdl) {
  constexpr auto fn = swap::prefill_swap_kernel<F>;
  constexpr int kDynSmem = swap::STraits<F>::kDynSmem;
  static const cudaError_t cfg =
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kDynSmem);
  if (cfg != cudaSuccess) return cfg;
  PrefillArgs b = a;
  if (!b.trap) b.trap = trap::device_record_if_ready();
  return launch(fn, dim3(unsigned(grid)), dim3(swap::kThreads), size_t(kDynSmem), s, pdl, b);
}
}  // namespace

cudaError_t launch_prefill_swap_gemm(const PrefillArgs& a, int grid, cudaStream_t s, bool pdl) {
  if (grid < 1 || a.dims.E > kMaxExperts) return cudaErrorInvalidValue;
  switch (a.dims.format) {
    case WeightFormat::kMxfp4:
      return run_swap<WeightFormat::kMxfp4>(a, grid, s, pdl);
    case WeightFormat::kNvfp4:
      return run_swap<WeightFormat::kNvfp4>(a, grid, s, pdl);
    case WeightFormat::kMxfp8:
      return run_swap<WeightFormat::kMxfp8>(a, grid, s, pdl);
    case WeightFormat::kBf16:
      return run_swap<WeightFormat::kBf16>(a, grid, s, pdl);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moekit::sm90::prefill
