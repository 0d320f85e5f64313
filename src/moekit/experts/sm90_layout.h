// moekit/experts/sm90_layout.h — the SM90 kernels' weight layout and the `convert` step that
// produces it from a model's logical rows. The layout is stated in full at the top of
// sm90_moe_gemm.cuh, the kernel that assumes it; this header holds the index arithmetic
// (host and device) and the host-side conversion.
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/common/hd.h"
#include "moekit/formats/quantize.h"
#include "moekit/experts/weights.h"

namespace moekit::sm90 {

constexpr int kSubtileRows = 16;  // one warp's rows: the m16 of mma.sync / a quarter of wgmma m64
constexpr int kSubtiles = 4;      // subtiles per group
constexpr int kGroupRows = kSubtileRows * kSubtiles;  // 64 rows stream together
constexpr int kKBlock = 64;       // K per atom (4 k16 MMA steps)
constexpr int kAlign = 64;        // H and I are padded to this (invisible to users)

MOEKIT_HD int64_t pad_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Bytes of one atom (16 rows x 64 K of one warp) and of its scales.
MOEKIT_HD constexpr int atom_code_bytes(WeightFormat f) {
  return f == WeightFormat::kMxfp8 ? 1024 : f == WeightFormat::kBf16 ? 2048 : 512;
}
MOEKIT_HD constexpr int atom_scale_bytes(WeightFormat f) {
  return f == WeightFormat::kNvfp4 ? 64 : f == WeightFormat::kBf16 ? 0 : 32;
}

// One converted matrix [E, N_pad, K_pad].
struct LayoutDims {
  WeightFormat format = WeightFormat::kMxfp4;
  int32_t pad_ = 0;  // no implicit padding: kernel arguments are compared bytewise (launch_sm90.cuh)
  int64_t E = 0, N_pad = 0, K_pad = 0;

  MOEKIT_HD int64_t groups() const { return N_pad / kGroupRows; }
  MOEKIT_HD int64_t kblocks() const { return K_pad / kKBlock; }
  // Bytes of one k-block of one group (4 atoms), codes and scales.
  MOEKIT_HD int64_t kblock_code_bytes() const { return int64_t(kSubtiles) * atom_code_bytes(format); }
  MOEKIT_HD int64_t kblock_scale_bytes() const { return int64_t(kSubtiles) * atom_scale_bytes(format); }
  MOEKIT_HD int64_t code_offset(int64_t e, int64_t g, int64_t kb) const {
    return ((e * groups() + g) * kblocks() + kb) * kblock_code_bytes();
  }
  MOEKIT_HD int64_t scale_offset(int64_t e, int64_t g, int64_t kb) const {
    return ((e * groups() + g) * kblocks() + kb) * kblock_scale_bytes();
  }
  int64_t code_bytes() const { return E * groups() * kblocks() * kblock_code_bytes(); }
  int64_t scale_bytes() const { return E * groups() * kblocks() * kblock_scale_bytes(); }
};

// A matrix converted for the kernels (host memory; the backend uploads it).
struct ConvertedMatrix {
  LayoutDims dims;
  std::vector<uint8_t> codes, scales;
  // Per (expert, kernel row): fp32 epilogue scale (nvfp4: 128 * scale_2, see the kernel) and
  // bias; empty when all ones / absent.
  std::vector<float> row_scale, bias;
  bool single_multiply = true;  // every scale folds into one bf16 multiply
};

// Kernel row R of w13 (GEMM1) -> logical w13 row, or -1 for padding. Within each 16-row
// subtile s, rows 0..7 are gate columns 8s..8s+7 and rows 8..15 the up rows of the same
// columns, so one thread's accumulators hold gate and up of one output column.
MOEKIT_HD int64_t w13_logical_row(int64_t R, int64_t I) {
  const int64_t s = R / kSubtileRows, r = R % kSubtileRows;
  const int64_t j = s * 8 + (r & 7);
  if (j >= I) return -1;
  return r < 8 ? j : I + j;
}

// The layer's w13 / w2 in the kernels' layout (multithreaded over (expert, group)). fast: atoms
// whose 64 K lie inside the rows are read pair by pair from the row bytes; false: every element
// placed one at a time (the definition; tests check the two agree byte for byte).
ConvertedMatrix convert_w13(const LayerWeights& m, bool fast = true);
ConvertedMatrix convert_w2(const LayerWeights& m, bool fast = true);

}  // namespace moekit::sm90
