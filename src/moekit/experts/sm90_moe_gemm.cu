// Instantiations of the SM90 grouped MoE GEMM: one kernel per weight format and CTA shape.
#include "moekit/experts/sm90_moe_gemm.h"

#include <algorithm>

#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::sm90 {

namespace {
// MX formats get a second instantiation for scale bytes beyond the single-multiply range.
template <WeightFormat F>
constexpr bool kHasTwoStep = F == WeightFormat::kMxfp4 || F == WeightFormat::kMxfp8;
// The wide shape exists for MXFP4 with single-multiply scales (sm90_shape.h).
template <WeightFormat F>
constexpr bool kHasWide = F == WeightFormat::kMxfp4;

// Row-split tasks (one and two tokens) have a kernel of their own for MXFP4 (single multiply,
// narrow shape).
template <WeightFormat F>
constexpr bool kHasRowSplit = F == WeightFormat::kMxfp4;

template <WeightFormat F, bool kSingle, GemmShape S, bool kRowSplit = false>
struct Kernel {
  static constexpr auto fn = moe_gemm_kernel<F, kSingle, S, kRowSplit>;
  static cudaError_t configure() {
    static const cudaError_t err =
        cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<F, S>);
    return err;
  }
  static int ctas_per_sm() {
    if (configure() != cudaSuccess) return 1;
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, kThreads, kSmemBytes<F, S>);
    return n > 0 ? n : 1;
  }
  static cudaError_t run(const FusedArgs& p, int grid, cudaStream_t s, bool pdl) {
    if (cudaError_t e = configure(); e != cudaSuccess) return e;
    return launch(fn, dim3(unsigned(grid)), dim3(kThreads), size_t(kSmemBytes<F, S>), s, pdl, p);
  }
};

template <WeightFormat F>
struct Format {
  static int sub_stage_k() { return Traits<F>::kSubStageK; }
  static bool single(const FusedArgs& p) { return p.g[0].single_multiply && (p.nphases < 2 || p.g[1].single_multiply); }
  static int ctas_row_split() {
    if constexpr (kHasRowSplit<F>) return Kernel<F, true, GemmShape::kNarrow, true>::ctas_per_sm();
    return 0;
  }
  static int ctas(GemmShape sh) {
    if constexpr (kHasWide<F>)
      if (sh == GemmShape::kWide) return Kernel<F, true, GemmShape::kWide>::ctas_per_sm();
    return Kernel<F, true, GemmShape::kNarrow>::ctas_per_sm();
  }
  static cudaError_t run(const FusedArgs& p, int grid, cudaStream_t s, bool pdl, GemmShape sh) {
    if (p.sub) {
      if constexpr (kHasRowSplit<F>)
        if (single(p) && sh == GemmShape::kNarrow) return Kernel<F, true, GemmShape::kNarrow, true>::run(p, grid, s, pdl);
      return cudaErrorInvalidValue;
    }
    if constexpr (kHasTwoStep<F>)
      if (!single(p)) {
        if (sh != GemmShape::kNarrow) return cudaErrorInvalidValue;
        return Kernel<F, false, GemmShape::kNarrow>::run(p, grid, s, pdl);
      }
    if constexpr (kHasWide<F>)
      if (sh == GemmShape::kWide) return Kernel<F, true, GemmShape::kWide>::run(p, grid, s, pdl);
    return Kernel<F, true, GemmShape::kNarrow>::run(p, grid, s, pdl);
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
int row_split_ctas_per_sm(WeightFormat f) {
  return by_format(f, [&](auto fm) { return decltype(fm)::ctas_row_split(); });
}

namespace {
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return EncodeTiled(nullptr);
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}
// [atom bytes as 8-byte words][subtile][k-block row of the matrix], box: `box_kb` k-blocks of one
// subtile.
bool encode_atoms(CUtensorMap* m, const uint8_t* base, int64_t atom_bytes, int64_t rows, int box_kb) {
  const EncodeTiled enc = encode_tiled();
  if (!enc || atom_bytes % 16 != 0 || atom_bytes / 8 > 256 || box_kb < 1 || box_kb > 256) return false;
  const cuuint64_t dims[3] = {cuuint64_t(atom_bytes / 8), cuuint64_t(kSubtiles), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {cuuint64_t(atom_bytes), cuuint64_t(kSubtiles * atom_bytes)};
  const cuuint32_t box[3] = {cuuint32_t(atom_bytes / 8), 1, cuuint32_t(box_kb)}, one[3] = {1, 1, 1};
  return enc(m, CU_TENSOR_MAP_DATA_TYPE_UINT64, 3, const_cast<uint8_t*>(base), dims, strides, box, one,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
}  // namespace

cudaError_t make_row_split_maps(FusedArgs& a) {
  for (int ph = 0; ph < 2; ++ph) {
    const GemmArgs& g = a.g[ph];
    const int64_t rows = g.dims.E * g.dims.groups() * g.dims.kblocks();
    const int cap = by_format(g.dims.format, [](auto fm) { return decltype(fm)::sub_stage_k(); });
    const int64_t n = g.dims.kblocks();
    if (n < 1 || rows >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
    const int64_t stages = (n + cap - 1) / cap, base = n / stages;  // split_stages in the kernel
    for (int which = 0; which < 2; ++which) {
      const int box = int(std::min<int64_t>(base + which, cap));
      if (!encode_atoms(&a.rs_code[ph][which], g.codes, atom_code_bytes(g.dims.format), rows, box))
        return cudaErrorInvalidValue;
      if (atom_scale_bytes(g.dims.format) > 0 &&
          !encode_atoms(&a.rs_scale[ph][which], g.scales, atom_scale_bytes(g.dims.format), rows, box))
        return cudaErrorInvalidValue;
    }
  }
  return cudaSuccess;
}
cudaError_t launch_moe_gemm(const FusedArgs& args, int grid, cudaStream_t s, bool pdl, GemmShape sh) {
  if (grid < 1) return cudaErrorInvalidValue;
  FusedArgs a = args;
  a.grid_div = FastDiv::make(uint32_t(grid));
  for (GemmArgs& g : a.g) {
    g.groups_div = FastDiv::make(uint32_t(std::max<int64_t>(1, g.dims.groups())));
    g.gather_div = FastDiv::make(uint32_t(std::max(1, g.gather_k)));
  }
  if (a.sub) {  // row-split tasks: narrow shape, both GEMMs, a handoff buffer
    if (sh != GemmShape::kNarrow || a.nphases != 2 || !a.sub_act || !a.epoch || a.sub_lag < 0)
      return cudaErrorInvalidValue;
    a.sub_c1 = int(kSubtiles * std::max<int64_t>(1, a.g[0].dims.groups()));
    a.sub_c2 = int(kSubtiles * std::max<int64_t>(1, a.g[1].dims.groups()));
    a.sub_d1 = FastDiv::make(uint32_t(a.sub_c1));
    a.sub_d2 = FastDiv::make(uint32_t(a.sub_c2));
    a.sub_d12 = FastDiv::make(uint32_t(a.sub_c1 + a.sub_c2));
  }
  return by_format(a.g[0].dims.format, [&](auto fm) { return decltype(fm)::run(a, grid, s, pdl, sh); });
}

}  // namespace moekit::sm90
