// The MX -> E4M3 folding of the FP8 kernel (formats/fold_fp8.h), exhaustively over codes and
// shifts, against an independent float computation: the value times 2^(d + headroom) in double,
// rounded to E4M3 by float_to_e4m3 (formats/codes.h, itself checked against golden vectors).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>

#include "moekit/formats/codes.h"
#include "moekit/formats/fold_fp8.h"
#include "moekit/formats/kernel_pack.h"

namespace moekit {
namespace {

// The reference: value * 2^shift rounded once (RNE) to E4M3, sign kept; values below E4M3's
// range (all of them here) never saturate.
uint8_t ref_fold(float value, int shift) {
  const double v = std::ldexp(double(value), shift);
  // float_to_e4m3 takes a float: v is exact in float (<= 2 significant bits of E2M1 / 4 of E4M3
  // scaled by a power of two) unless it underflows fp32; those values round to zero anyway.
  const float f = std::fabs(v) < 0x1p-140 ? std::copysign(0.0f, value) : float(v);
  return float_to_e4m3(f);
}

TEST(FoldFp8, E2M1AllCodesAllShifts) {
  for (int d = 0; d >= -254; --d) {
    for (int c = 0; c < 16; ++c) {
      const uint8_t got = fold_e2m1(uint8_t(c), d);
      const uint8_t want = ref_fold(e2m1_to_float(uint8_t(c)), d + kE2M1FoldHeadroom);
      ASSERT_EQ(got, want) << "code " << c << " d " << d;
      if (d >= -14) {
        // Exact within 14 binades of the group's largest block.
        ASSERT_EQ(std::ldexp(double(e4m3_to_float(got)), -kE2M1FoldHeadroom - d), double(e2m1_to_float(uint8_t(c))))
            << "code " << c << " d " << d;
      }
    }
  }
}

TEST(FoldFp8, E2M1BoundedRoundingBelow14Binades) {
  // |folded * 2^-6 - value * 2^d| <= 2^-10 * 2^-6 (half of E4M3's smallest subnormal), in units
  // of the group scale's 2^(s_max - 127).
  for (int d = -15; d >= -40; --d)
    for (int c = 0; c < 16; ++c) {
      const double got = std::ldexp(double(e4m3_to_float(fold_e2m1(uint8_t(c), d))), -kE2M1FoldHeadroom);
      const double exact = std::ldexp(double(e2m1_to_float(uint8_t(c))), d);
      EXPECT_LE(std::fabs(got - exact), std::ldexp(1.0, -16)) << "code " << c << " d " << d;
    }
}

TEST(FoldFp8, E4M3AllCodesAllShifts) {
  for (int d = 0; d >= -254; --d)
    for (int c = 0; c < 256; ++c) {
      if ((c & 0x7f) == 0x7f) {
        EXPECT_EQ(fold_e4m3(uint8_t(c), d), uint8_t(c));  // NaN stays NaN
        continue;
      }
      ASSERT_EQ(fold_e4m3(uint8_t(c), d), ref_fold(e4m3_to_float(uint8_t(c)), d)) << "code " << c << " d " << d;
    }
}

TEST(FoldFp8, UnitsRoundingAgainstFloat) {
  for (uint32_t u = 0; u < 16; ++u)
    for (int s = -16; s <= 14; ++s) {
      if (double(u) * std::ldexp(1.0, s) > 448.0 * 512) continue;
      ASSERT_EQ(e4m3_units_rne(u, s), float_to_e4m3(float(std::ldexp(double(u), s - 9)))) << u << " " << s;
    }
}

TEST(FoldFp8, GroupScale) {
  EXPECT_EQ(fold_group_max(3, 200, 17, 199), 200u);
  EXPECT_TRUE(std::isnan(fold_group_scale(fold_group_max(0xff, 1, 2, 3), 6)));
  for (uint32_t s = 0; s < 255; ++s)
    for (int h : {0, 6}) EXPECT_EQ(double(fold_group_scale(s, h)), std::ldexp(1.0, int(s) - 127 - h)) << s;
}

TEST(FoldFp8, PackedWordMatchesOneCodeAtATime) {
  // fold_e2m1x8 (the kernel's fragment code) against fold_e2m1 per code, for every code in
  // every position (random words) and shifts spanning the closed-form and rounding tables.
  std::mt19937 rng(7);
  for (int d_g : {0, -1, -5, -11, -12, -14, -15, -17, -30})
    for (int d_h : {0, -3, -11, -13, -16}) {
      const FoldTable tg = e2m1_fold_table(d_g), th = e2m1_fold_table(d_h);
      for (int it = 0; it < 2000; ++it) {
        uint8_t c[8];
        for (auto& x : c) x = uint8_t(rng() & 15u);
        if (it < 16)
          for (auto& x : c) x = uint8_t(it);  // every code in every position
        uint32_t x, y;
        fold_e2m1x8(pack_e2m1x8(c), tg, th, x, y);
        const uint8_t want_x[4] = {fold_e2m1(c[0], d_g), fold_e2m1(c[1], d_g), fold_e2m1(c[4], d_g), fold_e2m1(c[5], d_g)};
        const uint8_t want_y[4] = {fold_e2m1(c[2], d_h), fold_e2m1(c[3], d_h), fold_e2m1(c[6], d_h), fold_e2m1(c[7], d_h)};
        for (int i = 0; i < 4; ++i) {
          ASSERT_EQ((x >> (8 * i)) & 0xffu, want_x[i]) << "d " << d_g << " byte " << i;
          ASSERT_EQ((y >> (8 * i)) & 0xffu, want_y[i]) << "d " << d_h << " byte " << i;
        }
      }
    }
}

TEST(FoldFp8, KernelKOrderIsAPermutationOfEach16) {
  for (int base = 0; base < 256; base += 16) {
    std::set<int> seen;
    for (int j = base; j < base + 16; ++j) seen.insert(fp8_kernel_k(j));
    EXPECT_EQ(seen.size(), 16u);
    EXPECT_EQ(*seen.begin(), base);
    EXPECT_EQ(*seen.rbegin(), base + 15);
  }
  // Lane c's bytes: stored 4c + i holds logical 2c + i (i < 2), 8 + 2c + i - 2.
  EXPECT_EQ(fp8_kernel_k(4), 2);
  EXPECT_EQ(fp8_kernel_k(6), 10);
  EXPECT_EQ(fp8_kernel_k(15), 15);
}

}  // namespace
}  // namespace moekit
