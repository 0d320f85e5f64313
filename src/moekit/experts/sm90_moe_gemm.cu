// Instantiations of the SM90 grouped MoE GEMM: one kernel per weight format.
#include "moekit/experts/sm90_moe_gemm.h"

#include <algorithm>

#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::sm90 {

namespace {
// MX formats get a second instantiation for scale bytes beyond the single-multiply range.
template <WeightFormat F>
constexpr bool kHasTwoStep = F == WeightFormat::kMxfp4 || F == WeightFormat::kMxfp8;

template <WeightFormat F>
struct Kernel {
  static cudaError_t configure() {
    static cudaError_t err = [] {
      cudaError_t e = cudaFuncSetAttribute(moe_gemm_kernel<F, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           Traits<F>::kSmem);
      if constexpr (kHasTwoStep<F>)
        if (e == cudaSuccess)
          e = cudaFuncSetAttribute(moe_gemm_kernel<F, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   Traits<F>::kSmem);
      return e;
    }();
    return err;
  }
  static int ctas_per_sm() {
    configure();
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, moe_gemm_kernel<F, true>, kThreads, Traits<F>::kSmem);
    return n > 0 ? n : 1;
  }
  static cudaError_t run(const FusedArgs& p, int grid, cudaStream_t s, bool pdl) {
    if (cudaError_t e = configure(); e != cudaSuccess) return e;
    const bool single = p.g[0].single_multiply && (p.nphases < 2 || p.g[1].single_multiply);
    if constexpr (kHasTwoStep<F>)
      if (!single)
        return launch(moe_gemm_kernel<F, false>, dim3(unsigned(grid)), dim3(kThreads), size_t(Traits<F>::kSmem), s,
                      pdl, p);
    return launch(moe_gemm_kernel<F, true>, dim3(unsigned(grid)), dim3(kThreads), size_t(Traits<F>::kSmem), s, pdl, p);
  }
};

template <template <WeightFormat> class Fn, typename... Args>
auto dispatch(WeightFormat f, Args... args) {
  switch (f) {
    case WeightFormat::kMxfp4: return Fn<WeightFormat::kMxfp4>::call(args...);
    case WeightFormat::kNvfp4: return Fn<WeightFormat::kNvfp4>::call(args...);
    case WeightFormat::kMxfp8: return Fn<WeightFormat::kMxfp8>::call(args...);
    case WeightFormat::kBf16: default: return Fn<WeightFormat::kBf16>::call(args...);
  }
}
template <WeightFormat F> struct CtasOf { static int call() { return Kernel<F>::ctas_per_sm(); } };
template <WeightFormat F> struct RunOf {
  static cudaError_t call(const FusedArgs& p, int grid, cudaStream_t s, bool pdl) { return Kernel<F>::run(p, grid, s, pdl); }
};
}  // namespace

int gemm_ctas_per_sm(WeightFormat f) { return dispatch<CtasOf>(f); }
cudaError_t launch_moe_gemm(const FusedArgs& args, int grid, cudaStream_t s, bool pdl) {
  if (grid < 1) return cudaErrorInvalidValue;
  FusedArgs a = args;
  a.grid_div = FastDiv::make(uint32_t(grid));
  for (GemmArgs& g : a.g) {
    g.groups_div = FastDiv::make(uint32_t(std::max<int64_t>(1, g.dims.groups())));
    g.gather_div = FastDiv::make(uint32_t(std::max(1, g.gather_k)));
  }
  return dispatch<RunOf>(a.g[0].dims.format, a, grid, s, pdl);
}

}  // namespace moekit::sm90
