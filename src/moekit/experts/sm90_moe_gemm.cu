// Instantiations of the SM90 grouped MoE GEMM: one kernel per weight format and CTA shape.
#include "moekit/experts/sm90_moe_gemm.h"

#include <algorithm>

#include "moekit/common/kernel_attr.h"
#include "moekit/common/trap_record.h"
#include "moekit/oracle/kernel_choice.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::sm90 {

namespace {
// MX formats get a second instantiation for scale bytes beyond the single-multiply range.
template <WeightFormat F>
constexpr bool kHasTwoStep = F == WeightFormat::kMxfp4 || F == WeightFormat::kMxfp8;
// The wide shape exists for MXFP4 with single-multiply scales (sm90_shape.h).
template <WeightFormat F>
constexpr bool kHasWide = F == WeightFormat::kMxfp4;

template <WeightFormat F, bool kSingle, GemmShape S, int kTok = kTokens>
struct Kernel {
  static constexpr auto fn = moe_gemm_kernel<F, kSingle, S, kTok>;
  static constexpr int kSmem = kSmemBytes<F, S, kTok>;
  static cudaError_t configure() {
    return max_dynamic_smem_once<fn>(kSmem);
  }
  static int ctas_per_sm() {
    if (configure() != cudaSuccess) return 1;
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, kThreads, kSmem);
    return n > 0 ? n : 1;
  }
  static cudaError_t run(const FusedArgs& p, int grid, cudaStream_t s, bool pdl) {
    if (cudaError_t e = configure(); e != cudaSuccess) return e;
    return launch(fn, dim3(unsigned(grid)), dim3(kThreads), size_t(kSmem), s, pdl, p);
  }
};

template <WeightFormat F>
struct Format {
  static constexpr WeightFormat kFormat = F;
  static bool single(const FusedArgs& p) { return p.g[0].single_multiply && (p.nphases < 2 || p.g[1].single_multiply); }
  template <int kTok>
  static int ctas_of(GemmShape sh) {
    if constexpr (kHasWide<F>)
      if (sh == GemmShape::kWide) return Kernel<F, true, GemmShape::kWide, kTok>::ctas_per_sm();
    return Kernel<F, true, GemmShape::kNarrow, kTok>::ctas_per_sm();
  }
  // The grid must be resident in every variant of the shape: the smallest count.
  static int ctas(GemmShape sh) {
    const int n = std::min(ctas_of<kTokens>(sh), ctas_of<kTokens16>(sh));
    return sh == GemmShape::kNarrow ? std::min(n, Kernel<F, true, GemmShape::kNarrow, kTokens24>::ctas_per_sm()) : n;
  }
  template <int kTok>
  static cudaError_t run_rows(const FusedArgs& p, int grid, cudaStream_t s, bool pdl, GemmShape sh) {
    if constexpr (kHasWide<F>)
      if (sh == GemmShape::kWide) return Kernel<F, true, GemmShape::kWide, kTok>::run(p, grid, s, pdl);
    return Kernel<F, true, GemmShape::kNarrow, kTok>::run(p, grid, s, pdl);
  }
  static cudaError_t run(const FusedArgs& p, int grid, cudaStream_t s, bool pdl, GemmShape sh) {
    if constexpr (kHasTwoStep<F>)
      if (!single(p)) {
        if (sh != GemmShape::kNarrow || p.chunk_rows != kTokens) return cudaErrorInvalidValue;
        return Kernel<F, false, GemmShape::kNarrow>::run(p, grid, s, pdl);
      }
    if (p.chunk_rows == kTokens16) return run_rows<kTokens16>(p, grid, s, pdl, sh);
    if (p.chunk_rows == kTokens24) {
      if (sh != GemmShape::kNarrow) return cudaErrorInvalidValue;
      return Kernel<F, true, GemmShape::kNarrow, kTokens24>::run(p, grid, s, pdl);
    }
    return run_rows<kTokens>(p, grid, s, pdl, sh);
  }
};

// Calls fn(Format<f>{}) for the runtime format f.
template <typename Fn>
auto by_format(WeightFormat f, Fn&& fn) {
  switch (f) {
    case WeightFormat::kMxfp4: return fn(Format<WeightFormat::kMxfp4>{});
    case WeightFormat::kNvfp4: return fn(Format<WeightFormat::kNvfp4>{});
    case WeightFormat::kMxfp8: return fn(Format<WeightFormat::kMxfp8>{});
    case WeightFormat::kBf16:
    default: return fn(Format<WeightFormat::kBf16>{});
  }
}
}  // namespace

GemmShape gemm_shape(WeightFormat f, bool single_multiply, GemmShape want) {
  return f == WeightFormat::kMxfp4 && single_multiply ? want : GemmShape::kNarrow;
}
int gemm_ctas_per_sm(WeightFormat f, GemmShape sh) {
  return by_format(f, [&](auto fm) { return decltype(fm)::ctas(sh); });
}
static_assert(kChunk16MaxExperts == kCachedExperts, "oracle/kernel_choice.h mirrors the 16-row variant's limit");
bool gemm_has_chunk_rows(int rows, WeightFormat, bool single_multiply, int64_t experts) {
  return rows == kTokens || ((rows == kTokens16 || rows == kTokens24) && single_multiply && experts <= kCachedExperts);
}
std::string gemm_cta_name(WeightFormat f, GemmShape sh, int chunk_rows) {
  const int ctas = sh == GemmShape::kWide ? ShapeTraits<GemmShape::kWide>::kCtasPerSm : ShapeTraits<GemmShape::kNarrow>::kCtasPerSm;
  const int stages = by_format(f, [&](auto fm) {
    constexpr WeightFormat F = decltype(fm)::kFormat;
    if (sh == GemmShape::kWide)
      return chunk_rows == kTokens16 ? kRingStages<F, GemmShape::kWide, kTokens16> : kRingStages<F, GemmShape::kWide, kTokens>;
    return chunk_rows == kTokens24   ? kRingStages<F, GemmShape::kNarrow, kTokens24>
           : chunk_rows == kTokens16 ? kRingStages<F, GemmShape::kNarrow, kTokens16>
                                     : kRingStages<F, GemmShape::kNarrow, kTokens>;
  });
  return std::to_string(ctas) + "x" + std::to_string(stages) + (chunk_rows > kTokens ? "/" + std::to_string(chunk_rows) : "");
}
cudaError_t launch_moe_gemm(const FusedArgs& args, int grid, cudaStream_t s, bool pdl, GemmShape sh) {
  if (grid < 1) return cudaErrorInvalidValue;
  const bool single = args.g[0].single_multiply && (args.nphases < 2 || args.g[1].single_multiply);
  if (!gemm_has_chunk_rows(args.chunk_rows, args.g[0].dims.format, single, args.g[0].dims.E)) return cudaErrorInvalidValue;
  FusedArgs a = args;
  a.grid_div = FastDiv::make(uint32_t(grid));
  if (!a.trap) a.trap = trap::device_record_if_ready();
  for (GemmArgs& g : a.g) {
    g.groups_div = FastDiv::make(uint32_t(std::max<int64_t>(1, g.dims.groups())));
    g.gather_div = FastDiv::make(uint32_t(std::max(1, g.gather_k)));
  }
  return by_format(a.g[0].dims.format, [&](auto fm) { return decltype(fm)::run(a, grid, s, pdl, sh); });
}

}  // namespace moekit::sm90
