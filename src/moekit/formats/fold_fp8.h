// moekit/formats/fold_fp8.h — MX weights as E4M3 codes with one fp32 scale per (row, 128-K group),
// for the SM90 FP8 grouped GEMM (experts/sm90_fp8_gemm.cuh). Host and device.
//
// A (row, 128-K) group holds four 32-element MX blocks with E8M0 exponents s_0..s_3. Let
// s_max = max s_b. The group's fp32 scale is 2^(s_max - 127 - h) and block b's codes are rewritten
// as E4M3 codes of  value_b * 2^(d_b + h),  d_b = s_b - s_max <= 0, rounded to nearest even once:
//   MXFP4: h = 6 (kE2M1FoldHeadroom). E2M1 magnitudes {0.5 .. 6} * 2^6 <= 384 < 448 fit E4M3, so the
//          six binades of E4M3 above E2M1's range go to the shift: every block with d_b >= -14 is
//          exact (0.5 * 2^(d_b + 6) >= 2^-9, E4M3's smallest subnormal, and E2M1's 2 significant
//          bits stay on E4M3's grid). Blocks further down round once, to nearest even, to
//          E4M3's grid of 2^-9 times the group scale: absolute error at most
//          2^-10 * 2^(s_max - 133) = 2^-16 * 2^(s_max - 127) per weight (the group's largest
//          weights reach 6 * 2^(s_max - 127)), the sign kept (-0 for a negative value that
//          rounds to zero). ../shared/notes/fp8_path.md states 8 binades with h = 0; the
//          headroom costs nothing and widens the exact range to 14.
//   MXFP8: h = 0 (E4M3 uses its whole range). Exact while value * 2^d_b stays on E4M3's grid
//          (a normal code with exponent field e and 3 mantissa bits: d_b >= -(e - 1); always for
//          d_b = 0); otherwise rounded once to nearest even to 2^-9 times the group scale
//          2^(s_max - 127): absolute error at most 2^-10 * 2^(s_max - 127).
// NaN scale bytes (0xFF) make the group scale NaN. The weight's value is recovered as
// e4m3(folded code) * group scale, exactly when the fold was exact.
#pragma once

#include <cstdint>

#include "moekit/common/hd.h"
#include "moekit/formats/codes.h"
#include "moekit/formats/kernel_pack.h"

namespace moekit {

inline constexpr int kFoldGroupK = 128;     // K of one folded group (four MX blocks)
inline constexpr int kE2M1FoldHeadroom = 6;  // MXFP4: codes scaled by 2^6 into E4M3
inline constexpr int kE4M3FoldHeadroom = 0;

// The largest of a group's four E8M0 bytes (0xFF, NaN, wins: it is the largest byte).
MOEKIT_HD uint32_t fold_group_max(uint32_t s0, uint32_t s1, uint32_t s2, uint32_t s3) {
  const uint32_t a = s0 > s1 ? s0 : s1, b = s2 > s3 ? s2 : s3;
  return a > b ? a : b;
}

// The group's fp32 scale 2^(s_max - 127 - headroom) (exact: fp32 subnormals reach 2^-149), NaN
// for s_max = 0xFF.
MOEKIT_HD float fold_group_scale(uint32_t s_max, int headroom) {
  if (s_max == 0xffu) return bits_to_float(0x7fc00000u);
  const int e = int(s_max) - 127 - headroom;  // >= -133
  return e >= -126 ? bits_to_float(uint32_t(e + 127) << 23) : bits_to_float(1u << (e + 149));
}

// The E4M3 magnitude code of u * 2^s units of 2^-9, rounded to nearest even, for an integer
// 0 <= u < 2^10 with at most 3 significant bits and u * 2^s <= 448 * 2^9. Integer arithmetic
// only, the definition the kernels' tables are built from (tests compare it with float_to_e4m3).
MOEKIT_HD uint32_t e4m3_units_rne(uint32_t u, int s) {
  if (u == 0) return 0;
  if (s < 0) {
    // Below 2^10 units every value that survives is < 16 units: the code is the unit count.
    if (s < -12) return 0;
    const uint32_t sh = uint32_t(-s), q = u >> sh, rem = u & ((1u << sh) - 1u), half = 1u << (sh - 1);
    const uint32_t n = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
    if (n < 16) return n;
    u = n, s = 0;  // rounded up into the normal range: exact from here
  }
  const uint32_t v = u << s;  // exact: at most 448 * 2^9
  if (v < 16) return v;       // subnormals and the first binade share the 2^-9 quantum
  int e = 0;
  while ((v >> (e + 1)) != 0) ++e;  // floor(log2 v) >= 4
  // v's significant bits fit 4 (u has at most 3 and v >= 16): no rounding here.
  return uint32_t(e - 2) << 3 | ((v >> (e - 3)) & 7u);
}

// E2M1 magnitude m (0..7) in units of 2^-10: {0, 1, 2, 3, 4, 6, 8, 12} / 2 is its value.
MOEKIT_HD uint32_t e2m1_half_units(uint32_t m) {
  m &= 7u;
  return m < 4 ? m : (2u + (m & 1u)) << ((m >> 1) - 1u);  // no table: a device array would live in local memory
}

// The 8-entry table E2M1 magnitude -> E4M3 magnitude code of value * 2^(d + 6), d = s_b - s_max
// <= 0, as two words (byte m of lo|hi is entry m): the operand pair of a byte permute.
struct FoldTable {
  uint32_t lo, hi;
};
MOEKIT_HD FoldTable e2m1_fold_table(int d) {
  if (d >= -11) {
    // Every entry normal and exact: entry m = (m << 2) + 8 k for m >= 2, 8 k for m = 1, 0 for
    // m = 0, with k = d + 12 >= 1 added to the exponent field (E2M1 bits e1 e0 m at E4M3's 4:2 read
    // as value * 2^-6). Two multiply-adds.
    const uint32_t k = uint32_t(d + 12);
    return {0x0C080000u + k * 0x08080800u, 0x1C181410u + k * 0x08080808u};
  }
#if defined(__CUDA_ARCH__)
  // Blocks more than 11 binades below the group's largest (rare): the hardware's round to nearest
  // even, value * 2^(d + 6) in fp32 (exact; below 2^-40 everything rounds to zero) to E4M3 pairs.
  // The GPU tests compare it with the integer definition below for every d.
  const int e = d + kE2M1FoldHeadroom < -40 ? -40 : d + kE2M1FoldHeadroom;
  const float sc = __int_as_float((e + 127) << 23);
  auto pair = [&](float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi * sc), "f"(lo * sc));
    return uint32_t(r);
  };
  return {pair(0.0f, 0.5f) | pair(1.0f, 1.5f) << 16, pair(2.0f, 3.0f) | pair(4.0f, 6.0f) << 16};
#else
  FoldTable t{0, 0};
  for (uint32_t m = 1; m < 8; ++m) {
    // value * 2^(d + 6) = half_units * 2^-1 * 2^(d + 6) = half_units * 2^(d + 14) units of 2^-9
    const uint32_t c = e4m3_units_rne(e2m1_half_units(m), d + 14);
    if (m < 4) t.lo |= c << (8 * m); else t.hi |= c << (8 * (m - 4));
  }
  return t;
#endif
}

// One E2M1 code (sign at bit 3) folded with shift d: the definition, one code at a time.
MOEKIT_HD uint8_t fold_e2m1(uint8_t code, int d) {
  const FoldTable t = e2m1_fold_table(d);
  const uint32_t m = code & 7u;
  const uint32_t mag = ((m < 4 ? t.lo : t.hi) >> (8 * (m & 3u))) & 0xffu;
  return uint8_t(mag | ((code & 8u) << 4));
}

// One E4M3 code folded with shift d <= 0 (MXFP8). NaN codes stay NaN.
MOEKIT_HD uint8_t fold_e4m3(uint8_t code, int d) {
  const uint32_t mag = code & 0x7fu, sign = code & 0x80u;
  if (mag == 0x7fu) return uint8_t(code);
  if (d == 0) return uint8_t(code);
  // The magnitude in units of 2^-9: subnormal m, normal (8 + m) 2^(e - 1).
  const uint32_t e = mag >> 3, m = mag & 7u;
  const uint32_t u = e == 0 ? m : 8u + m;
  const int s = e == 0 ? d : int(e) - 1 + d;
  return uint8_t(e4m3_units_rne(u, s) | sign);
}

// ---- the kernel's fragment: 8 packed E2M1 codes -> two words of E4M3 codes -------------------
// byte_perm as the hardware's prmt (default mode; selector bits 3, 7, 11, 15 are zero here).
MOEKIT_HD uint32_t byte_perm_hd(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t x = uint64_t(b) << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((x >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
#endif
}

// One kernel_pack.h E2M1 word of k16 step q (codes c0..c7: c0 c1 row g at k 2c, 2c+1; c2 c3 row
// g + 8 there; c4 c5 row g at 8 + 2c, 9 + 2c; c6 c7 row g + 8 there) -> x = row g's E4M3 bytes
// [c0, c1, c4, c5], y = row g + 8's [c2, c3, c6, c7], folded with the rows' tables. Per row: the
// tiny unpack's magnitudes gathered into a permute selector (3 instructions), the lookup (1),
// the signs gathered by a permute and merged (2).
MOEKIT_HD void fold_e2m1x8(uint32_t w, FoldTable tg, FoldTable th, uint32_t& x, uint32_t& y) {
  uint32_t t[4];
  e2m1x8_tiny(w, t);  // halves: magnitude e1 e0 m at 8:6, sign at 15
  auto row = [](uint32_t a, uint32_t b, FoldTable tab) {
    // a's magnitudes to 2:0 | 18:16, b's to 10:8 | 26:24, then the high half down by 12:
    // nibbles [a.lo, a.hi, b.lo, b.hi].
    const uint32_t z = ((a >> 6) & 0x00070007u) | ((b << 2) & 0x07000700u);
    const uint32_t sel = (z | (z >> 12)) & 0xffffu;
    const uint32_t mag = byte_perm_hd(tab.lo, tab.hi, sel);
    return mag | (byte_perm_hd(a, b, 0x7531u) & 0x80808080u);
  };
  x = row(t[0], t[2], tg);
  y = row(t[1], t[3], th);
}

// One thread's A fragments of one (64-row weight group, 128-K group) for the FP8 kernel, from its
// lane's bytes of the decode kernel's MXFP4 layout (experts/sm90_moe_gemm.cuh): w[0..3] the words
// of k16 steps 0..3 of the group's first k-block, w[4..7] of its second; s0, s1 the lane's scale
// bytes of the two k-blocks, [row g b0, row g b1, row g+8 b0, row g+8 b1] each (s1 = 0 when the
// group has one k-block). Out: a[p] = the registers of k32 step p (MX block p): 0, 2 row g at the
// wgmma's k 4c.. and 16 + 4c.., 1, 3 row g + 8; sw_g, sw_h the rows' group scales.
MOEKIT_HD void fold_group_mxfp4(const uint32_t (&w)[8], uint32_t s0, uint32_t s1, uint32_t (&a)[4][4], float& sw_g,
                                float& sw_h) {
  const uint32_t bg[4] = {s0 & 0xffu, (s0 >> 8) & 0xffu, s1 & 0xffu, (s1 >> 8) & 0xffu};
  const uint32_t bh[4] = {(s0 >> 16) & 0xffu, s0 >> 24, (s1 >> 16) & 0xffu, s1 >> 24};
  const uint32_t mg = fold_group_max(bg[0], bg[1], bg[2], bg[3]);
  const uint32_t mh = fold_group_max(bh[0], bh[1], bh[2], bh[3]);
  sw_g = fold_group_scale(mg, kE2M1FoldHeadroom);
  sw_h = fold_group_scale(mh, kE2M1FoldHeadroom);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int p = 0; p < 4; ++p) {
    // MX block p = k16 steps 2p, 2p + 1: registers 0, 1 from the first word, 2, 3 from the second.
    const FoldTable tg = e2m1_fold_table(int(bg[p]) - int(mg));
    const FoldTable th = e2m1_fold_table(int(bh[p]) - int(mh));
    fold_e2m1x8(w[2 * p], tg, th, a[p][0], a[p][1]);
    fold_e2m1x8(w[2 * p + 1], tg, th, a[p][2], a[p][3]);
  }
}

// ---- MXFP8 weights: E4M3 codes shifted by d <= 0 ---------------------------------------------
// The four codes of a kernel_pack.h E4M3 word (pack_e4m3x4) as natural bytes [c0, c1, c2, c3].
MOEKIT_HD uint32_t e4m3x4_bytes(uint32_t w) {
  const uint32_t c0 = ((w >> 4) & 0x7fu) | ((w >> 8) & 0x80u);
  const uint32_t c1 = ((w >> 20) & 0x7fu) | ((w >> 24) & 0x80u);
  const uint32_t c2 = (w & 0xfu) | ((w >> 8) & 0x70u) | ((w >> 4) & 0x80u);
  const uint32_t c3 = ((w >> 16) & 0xfu) | ((w >> 24) & 0x70u) | ((w >> 20) & 0x80u);
  return c0 | c1 << 8 | c2 << 16 | c3 << 24;
}

// Four E4M3 codes (bytes of x) folded with one shift d <= 0, as fold_e4m3 does each. The device
// takes the hardware's conversions: E4M3 pairs to f16 (exact), times 2^d in f16 (exact down to
// f16's subnormals, below which every result rounds to zero in E4M3 anyway: d is clamped at -24,
// 448 * 2^-24 < 2^-10), back to E4M3 rounding to nearest even once. NaN codes are not expected
// (the convert step rejects them).
MOEKIT_HD uint32_t fold_e4m3x4(uint32_t x, int d) {
  if (d == 0) return x;
#if defined(__CUDA_ARCH__)
  const int e = d < -24 ? -24 : d;
  const uint32_t h = e >= -14 ? uint32_t(e + 15) << 10 : 1u << (e + 24);  // 2^e as f16 bits
  const uint32_t m = h | h << 16;
  auto pair = [&](uint32_t p16) {
    uint32_t f, r;
    asm("{ .reg .b16 lo; cvt.u16.u32 lo, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(f) : "r"(p16));
    asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(f) : "r"(m));
    asm("{ .reg .b16 o; cvt.rn.satfinite.e4m3x2.f16x2 o, %1; cvt.u32.u16 %0, o; }" : "=r"(r) : "r"(f));
    return r;
  };
  return pair(x & 0xffffu) | pair(x >> 16) << 16;
#else
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t(fold_e4m3(uint8_t(x >> (8 * i)), d)) << (8 * i);
  return r;
#endif
}

// fold_group_mxfp4 for MXFP8 weights, one k-block (h = 0, 1: MX blocks 2h, 2h + 1) at a time, so
// that a thread holds 8 words, not 16: w[2 q], w[2 q + 1] the two words of k16 step q of the k-block
// (codes [g 2c, g 2c+1, g+8 2c, g+8 2c+1] and the same at 8 + 2c); no headroom. fold_mxfp8_scales
// first (the group's largest exponents and scales).
struct Mxfp8GroupScales {
  uint32_t bg[4], bh[4], mg, mh;
};
MOEKIT_HD Mxfp8GroupScales fold_mxfp8_scales(uint32_t s0, uint32_t s1, float& sw_g, float& sw_h) {
  Mxfp8GroupScales r{{s0 & 0xffu, (s0 >> 8) & 0xffu, s1 & 0xffu, (s1 >> 8) & 0xffu},
                     {(s0 >> 16) & 0xffu, s0 >> 24, (s1 >> 16) & 0xffu, s1 >> 24}, 0, 0};
  r.mg = fold_group_max(r.bg[0], r.bg[1], r.bg[2], r.bg[3]);
  r.mh = fold_group_max(r.bh[0], r.bh[1], r.bh[2], r.bh[3]);
  sw_g = fold_group_scale(r.mg, kE4M3FoldHeadroom);
  sw_h = fold_group_scale(r.mh, kE4M3FoldHeadroom);
  return r;
}
MOEKIT_HD void fold_kblock_mxfp8(const uint32_t (&w)[8], const Mxfp8GroupScales& sc, int h, uint32_t (&a)[4][4]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int pp = 0; pp < 2; ++pp) {
    const int p = 2 * h + pp;
    const int dg = int(sc.bg[p]) - int(sc.mg), dh = int(sc.bh[p]) - int(sc.mh);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int j = 0; j < 2; ++j) {
      const int q = 2 * (2 * pp + j);  // step 2 pp + j of the k-block
      const uint32_t A = e4m3x4_bytes(w[q]), B = e4m3x4_bytes(w[q + 1]);
      a[p][2 * j] = fold_e4m3x4(byte_perm_hd(A, B, 0x5410u), dg);      // row g: A.c0 A.c1 B.c0 B.c1
      a[p][2 * j + 1] = fold_e4m3x4(byte_perm_hd(A, B, 0x7632u), dh);  // row g + 8: A.c2 A.c3 B.c2 B.c3
    }
  }
}

// The K order of the FP8 kernel's activation rows: with A from registers, the weight bytes a
// lane holds (fold_e2m1x8: logical k 2c, 2c+1, 8 + 2c, 9 + 2c of each 16) sit at the wgmma's k
// 4c .. 4c + 3. So the E4M3 activation rows are stored with each 16 consecutive K permuted the same
// way: stored position j of a 16-K chunk holds logical k fp8_kernel_k(j). Scales (per 128 K) are
// not affected.
MOEKIT_HD int fp8_kernel_k(int j) {
  const int c = (j & 15) >> 2, i = j & 3;
  return (j & ~15) + (i < 2 ? 2 * c + i : 8 + 2 * c + (i - 2));
}

}  // namespace moekit
