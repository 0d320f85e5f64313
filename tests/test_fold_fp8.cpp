// The MX -> E4M3 folding of the FP8 kernel (formats/fold_fp8.h), exhaustively over codes and
// shifts, against an independent float computation: the value times 2^(d + headroom) in double,
// rounded to E4M3 by float_to_e4m3 (formats/codes.h, itself checked against golden vectors).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>

#include "moekit/experts/sm90_layout.h"
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

// The FP8 kernel's fragments read from the decode kernel's converted MXFP4 layout, on the CPU:
// every thread (warp wi of a weight group, lane) of every (expert, 64-row group, 128-K group)
// runs fold_group_mxfp4 on its lane's bytes as the kernel loads them; each register byte is placed
// where the wgmma's A fragment puts it (row 16 wi + lane / 4 + 8 (r % 2), k 32 p + 16 (r / 2) +
// 4 (lane % 4) + byte) and, through the activations' kernel K order, at logical k
// fp8_kernel_k(that k). Every logical (row, k) must come out exactly once, equal to the fold of the
// logical weight (fold_e2m1 and the group scale of its own four MX bytes); padding rows and
// columns zero.
void check_fragments_from_layout(WeightFormat f) {
  const bool fp4 = f == WeightFormat::kMxfp4;
  const int64_t E = 2, N = 80, K = 320;  // N_pad 128 (two groups, rows 80.. padding); K: 2.5 groups
  const int64_t code_row = fp4 ? K / 2 : K;
  std::mt19937_64 rng(fp4 ? 11 : 12);
  std::vector<uint8_t> codes(size_t(E * N * code_row)), scales(size_t(E * N * K / 32));
  for (auto& c : codes) {
    c = uint8_t(rng());
    if (!fp4 && (c & 0x7f) == 0x7f) c = 0x7e;  // no NaN codes (the convert step rejects them)
  }
  for (auto& s : scales) s = uint8_t(127 + int(rng() % 30) - 25);  // spread 25 binades: every table kind
  LayerWeights lw;
  lw.cfg.num_experts = int(E);
  lw.cfg.hidden = int(N);
  lw.cfg.intermediate = int(K);
  lw.cfg.format = f;
  lw.w2.format = f;
  lw.w2.E = E, lw.w2.N = N, lw.w2.K = K;
  lw.w2.codes = codes.data(), lw.w2.scales = scales.data();
  lw.w2.code_row = code_row, lw.w2.scale_row = K / 32;
  const sm90::ConvertedMatrix cm = sm90::convert_w2(lw);
  const sm90::LayoutDims& d = cm.dims;
  ASSERT_EQ(d.N_pad, 128);
  ASSERT_EQ(d.K_pad, K);
  const int64_t KB = d.kblocks(), KG = (KB + 1) / 2;
  // got[e][row][logical k], NaN until set.
  std::vector<double> got(size_t(E * d.N_pad * d.K_pad), std::nan(""));
  auto le32 = [](const uint8_t* b) { return uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24; };
  for (int64_t e = 0; e < E; ++e)
    for (int64_t g = 0; g < d.groups(); ++g)
      for (int64_t kg = 0; kg < KG; ++kg)
        for (int wi = 0; wi < 4; ++wi)
          for (int lane = 0; lane < 32; ++lane) {
            // The lane's words as the kernel loads them (16-byte loads at lane * 16, and + 512 for fp8).
            uint32_t w4[8] = {}, w8[16] = {}, s[2] = {};
            for (int h = 0; h < 2; ++h) {
              const int64_t kb = 2 * kg + h;
              if (kb >= KB) continue;  // the kernel reads stale bytes there; their columns are zero fill
              const uint8_t* cb = cm.codes.data() + d.code_offset(e, g, kb) + wi * sm90::atom_code_bytes(d.format) + lane * 16;
              for (int q = 0; q < 4; ++q) {
                if (fp4) {
                  w4[4 * h + q] = le32(cb + 4 * q);
                } else {
                  w8[8 * h + q] = le32(cb + 4 * q);
                  w8[8 * h + 4 + q] = le32(cb + 512 + 4 * q);
                }
              }
              s[h] = le32(cm.scales.data() + d.scale_offset(e, g, kb) + wi * sm90::atom_scale_bytes(d.format) + (lane >> 2) * 4);
            }
            uint32_t a[4][4];
            float sw_g, sw_h;
            if (fp4) fold_group_mxfp4(w4, s[0], s[1], a, sw_g, sw_h);
            else {
              const Mxfp8GroupScales sc = fold_mxfp8_scales(s[0], s[1], sw_g, sw_h);
              for (int h = 0; h < 2; ++h) {
                uint32_t wk[8];
                for (int i = 0; i < 8; ++i) wk[i] = w8[8 * h + i];
                fold_kblock_mxfp8(wk, sc, h, a);
              }
            }
            const int nsteps = 2 * kg + 1 < KB ? 4 : 2;
            for (int p = 0; p < nsteps; ++p)
              for (int r = 0; r < 4; ++r)
                for (int i = 0; i < 4; ++i) {
                  const int64_t row = g * 64 + 16 * wi + (lane >> 2) + 8 * (r & 1);
                  const int hk = int(kg * 128 + 32 * p + 16 * (r >> 1) + 4 * (lane & 3) + i);
                  const int64_t k = fp8_kernel_k(hk);
                  const double v = double(e4m3_to_float(uint8_t(a[p][r] >> (8 * i)))) * double((r & 1) ? sw_h : sw_g);
                  double& slot = got[size_t((e * d.N_pad + row) * d.K_pad + k)];
                  ASSERT_TRUE(std::isnan(slot)) << "placed twice: row " << row << " k " << k;
                  slot = v;
                }
          }
  for (int64_t e = 0; e < E; ++e)
    for (int64_t row = 0; row < d.N_pad; ++row)
      for (int64_t k = 0; k < K; ++k) {
        double want = 0;
        if (row < N) {
          const uint8_t* rs = scales.data() + (e * N + row) * (K / 32);
          const int64_t g0 = k / 128 * 4;
          uint32_t smax = 0;
          for (int64_t b = g0; b < std::min<int64_t>(K / 32, g0 + 4); ++b) smax = std::max<uint32_t>(smax, rs[b]);
          const int db = int(rs[k / 32]) - int(smax);
          const uint8_t* rc = codes.data() + (e * N + row) * code_row;
          const uint8_t folded = fp4 ? fold_e2m1(uint8_t((rc[k / 2] >> (4 * (k & 1))) & 15u), db) : fold_e4m3(rc[k], db);
          want = double(e4m3_to_float(folded)) *
                 double(fold_group_scale(smax, fp4 ? kE2M1FoldHeadroom : kE4M3FoldHeadroom));
        }
        const double v = got[size_t((e * d.N_pad + row) * d.K_pad + k)];
        ASSERT_FALSE(std::isnan(v)) << "never placed: e " << e << " row " << row << " k " << k;
        if (row < N) {
          ASSERT_EQ(v, want) << "e " << e << " row " << row << " k " << k;
        } else {
          ASSERT_EQ(v, 0.0) << "padding row " << row;
        }
      }
}

TEST(FoldFp8, KernelFragmentsFromTheConvertedLayoutMxfp4) { check_fragments_from_layout(WeightFormat::kMxfp4); }
TEST(FoldFp8, KernelFragmentsFromTheConvertedLayoutMxfp8) { check_fragments_from_layout(WeightFormat::kMxfp8); }

TEST(FoldFp8, E4M3PackedWordBytes) {
  std::mt19937 rng(5);
  for (int it = 0; it < 10000; ++it) {
    uint8_t c[4];
    for (auto& x : c) x = uint8_t(rng());
    const uint32_t b = e4m3x4_bytes(pack_e4m3x4(c));
    for (int i = 0; i < 4; ++i) ASSERT_EQ((b >> (8 * i)) & 0xffu, c[i]);
  }
}

}  // namespace
}  // namespace moekit
