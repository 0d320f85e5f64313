// Formats: bit-exact against the golden vectors made by an independent implementation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/formats/codes.h"
#include "moekit/formats/kernel_pack.h"
#include "moekit/formats/quantize.h"
#include "moekit/io/safetensors.h"
#include "testutil.h"

namespace moekit {
namespace {

std::vector<std::string> golden_files() {
  std::vector<std::string> v;
  for (const auto& e : std::filesystem::directory_iterator(test::testdata("formats")))
    if (e.path().filename().string().rfind("pub_mx", 0) == 0 ||
        e.path().filename().string().rfind("pub_nv", 0) == 0)
      v.push_back(e.path().string());
  std::sort(v.begin(), v.end());
  return v;
}

TEST(Formats, GoldenFilesPresent) { EXPECT_EQ(golden_files().size(), 20u); }

TEST(Formats, DecodeTables) {
  const auto f = SafetensorsFile::open(test::testdata("formats/pub_decode_tables.safetensors"));
  const auto e2m1 = to_float(f.get("e2m1"), f.path());
  const auto e4m3 = to_float(f.get("e4m3"), f.path());
  ASSERT_EQ(e2m1.size(), 16u);
  ASSERT_EQ(e4m3.size(), 256u);
  for (int c = 0; c < 16; ++c)
    EXPECT_EQ(float_to_bits(e2m1_to_float(uint8_t(c))), float_to_bits(e2m1[c])) << "code " << c;
  for (int c = 0; c < 256; ++c) {
    if (std::isnan(e4m3[c])) {
      EXPECT_TRUE(std::isnan(e4m3_to_float(uint8_t(c)))) << "code " << c;
    } else {
      EXPECT_EQ(float_to_bits(e4m3_to_float(uint8_t(c))), float_to_bits(e4m3[c])) << "code " << c;
    }
  }
}

TEST(Formats, EncodeDecodeRoundTripEveryCode) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(float_to_e2m1(e2m1_to_float(uint8_t(c))), c);
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(uint8_t(c))), c) << "code " << c;
  }
  // Ties go to the even code; negative underflow keeps the sign.
  EXPECT_EQ(float_to_e2m1(2.5f), 0x4);    // 2 (even) not 3
  EXPECT_EQ(float_to_e2m1(5.0f), 0x6);    // 4 (even) not 6
  EXPECT_EQ(float_to_e2m1(0.25f), 0x0);   // 0 (even) not 0.5
  EXPECT_EQ(float_to_e2m1(-0.2f), 0x8);   // -0
  EXPECT_EQ(float_to_e4m3(-1e-9f), 0x80); // -0
  EXPECT_EQ(float_to_e4m3(432.0f), 0x7e); // tie between 416 (m=5) and 448 (m=6): even
}

// Compares every byte of codes and scales and every bit of dq with the golden file.
void check_golden(const std::string& path) {
  SCOPED_TRACE(path);
  const auto f = SafetensorsFile::open(path);
  const WeightFormat fmt = parse_format(f.metadata().at("format"));
  const ScaleRule rule = fmt == WeightFormat::kNvfp4
                             ? ScaleRule::kFloor
                             : parse_scale_rule(f.metadata().at("scale_rule"));
  const TensorView& xt = f.get("x");
  ASSERT_EQ(xt.shape.size(), 2u);
  const int64_t R = xt.shape[0], C = xt.shape[1];
  const auto x = to_float(xt, path);
  const QuantizedTensor q = quantize_tensor(x.data(), R, C, fmt, rule, path);

  const TensorView* codes = nullptr;
  const TensorView* scales = nullptr;
  if (fmt == WeightFormat::kMxfp4) {
    codes = &f.get("q_blocks");
    scales = &f.get("q_scales");
  } else {
    codes = &f.get("q");
    scales = &f.get("q_scale");
  }
  ASSERT_EQ(codes->nbytes, q.codes.size());
  ASSERT_EQ(scales->nbytes, q.scales.size());
  int64_t bad_codes = 0, bad_scales = 0, first_bad = -1;
  for (size_t i = 0; i < q.codes.size(); ++i)
    if (q.codes[i] != codes->data[i]) {
      if (first_bad < 0) first_bad = int64_t(i);
      ++bad_codes;
    }
  for (size_t i = 0; i < q.scales.size(); ++i) bad_scales += q.scales[i] != scales->data[i];
  EXPECT_EQ(bad_codes, 0) << "first mismatching code byte " << first_bad;
  EXPECT_EQ(bad_scales, 0);
  if (fmt == WeightFormat::kNvfp4) {
    const float s2 = to_float(f.get("q_scale_2"), path)[0];
    EXPECT_EQ(float_to_bits(q.scale_2), float_to_bits(s2));
  }
  // dq from the golden codes, compared bit for bit.
  std::vector<float> dq(size_t(R * C));
  dequantize_tensor(fmt, codes->data, scales->data,
                    fmt == WeightFormat::kNvfp4 ? to_float(f.get("q_scale_2"), path)[0] : 1.0f,
                    R, C, dq.data());
  const auto dq_ref = to_float(f.get("dq"), path);
  int64_t bad_dq = 0;
  for (size_t i = 0; i < dq.size(); ++i) bad_dq += float_to_bits(dq[i]) != float_to_bits(dq_ref[i]);
  EXPECT_EQ(bad_dq, 0);
}

// A kernel word (formats/kernel_pack.h) of kN codes, unpacked on the host with the kernels' own
// function into kN / 2 bf16x2 tiny values: every legal code in every slot reads back as its value
// times 2^-tiny_exp with nothing outside `mask`, and the other slots' bits never leak into a slot
// (each slot's code set while the others hold random legal codes).
template <int kN, class Pack, class Unpack, class Decode>
void expect_kernel_word(Pack pack, Unpack unpack, Decode decode, int n_codes, uint32_t mask, int tiny_exp,
                        int reps, uint64_t state) {
  auto legal = [&](int c) { return n_codes == 16 || (c & 0x7f) != 0x7f; };  // E4M3 NaN: rejected by convert
  auto next = [&] {
    for (;;) {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      const int c = int(state % uint64_t(n_codes));
      if (legal(c)) return uint8_t(c);
    }
  };
  for (int rep = 0; rep < reps; ++rep)
    for (int slot = 0; slot < kN; ++slot)
      for (int code = 0; code < n_codes; ++code) {
        if (!legal(code)) continue;
        uint8_t c[kN];
        for (auto& x : c) x = next();
        c[slot] = uint8_t(code);
        uint32_t t[kN / 2];
        unpack(pack(c), t);
        for (int i = 0; i < kN; ++i) {
          const uint32_t half = i & 1 ? t[i / 2] >> 16 : t[i / 2] & 0xffffu;
          ASSERT_EQ(half & ~mask, 0u) << "slot " << i;
          const float v = std::ldexp(bits_to_float(half << 16), tiny_exp);
          ASSERT_EQ(float_to_bits(v), float_to_bits(decode(c[i]))) << "slot " << i << " code " << int(c[i]);
        }
      }
}

TEST(Formats, KernelE2M1WordEveryCodeEverySlot) {
  expect_kernel_word<8>([](const uint8_t* c) { return pack_e2m1x8(c); },
                        [](uint32_t w, uint32_t (&t)[4]) { e2m1x8_tiny(w, t); }, e2m1_to_float, 16, 0x81C0u,
                        kE2M1TinyExp, 64, 0x9e3779b97f4a7c15ull);
}

TEST(Formats, KernelE4M3WordEveryCodeEverySlot) {
  expect_kernel_word<4>([](const uint8_t* c) { return pack_e4m3x4(c); },
                        [](uint32_t w, uint32_t (&t)[2]) { e4m3x4_tiny(w, t); }, e4m3_to_float, 256, 0x87F0u,
                        kE4M3TinyExp, 8, 0x2545f4914f6cdd1dull);
}

TEST(Formats, GoldenVectorsBitExact) {
  for (const auto& p : golden_files()) check_golden(p);
}

TEST(Formats, ScaleRules) {
  // amax = 6 * 2^k: rceil gives k, floor gives floor(log2(6*2^k)) - 2 = k.
  EXPECT_EQ(mx_shared_exponent(6.0f, ScaleRule::kRceil, kE2M1Emax, kE2M1Max), 0);
  EXPECT_EQ(mx_shared_exponent(6.0f, ScaleRule::kFloor, kE2M1Emax, kE2M1Max), 0);
  // amax = 7: floor keeps e = 0 (7 saturates to 6); rceil moves to e = 1.
  EXPECT_EQ(mx_shared_exponent(7.0f, ScaleRule::kFloor, kE2M1Emax, kE2M1Max), 0);
  EXPECT_EQ(mx_shared_exponent(7.0f, ScaleRule::kRceil, kE2M1Emax, kE2M1Max), 1);
  EXPECT_EQ(mx_shared_exponent(0.0f, ScaleRule::kRceil, kE2M1Emax, kE2M1Max), -127);
  EXPECT_EQ(mx_shared_exponent(1e-38f, ScaleRule::kFloor, kE2M1Emax, kE2M1Max), -127);
  EXPECT_EQ(mx_shared_exponent(449.0f, ScaleRule::kRceil, kE4M3Emax, kE4M3Max), 1);
  EXPECT_EQ(mx_shared_exponent(448.0f, ScaleRule::kRceil, kE4M3Emax, kE4M3Max), 0);
}

TEST(Formats, RejectsNonFiniteAndBadK) {
  std::vector<float> x(64, 1.0f);
  x[37] = NAN;
  try {
    quantize_tensor(x.data(), 2, 32, WeightFormat::kMxfp4, ScaleRule::kFloor, "t");
    FAIL() << "NaN accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NaN at row 1, column 5"), std::string::npos) << e.what();
  }
  x[37] = INFINITY;
  EXPECT_THROW(quantize_tensor(x.data(), 2, 32, WeightFormat::kNvfp4, ScaleRule::kFloor, "t"), Error);
  x[37] = 1.0f;
  EXPECT_THROW(quantize_tensor(x.data(), 4, 16, WeightFormat::kMxfp8, ScaleRule::kFloor, "t"), Error);
  EXPECT_NO_THROW(quantize_tensor(x.data(), 4, 16, WeightFormat::kNvfp4, ScaleRule::kFloor, "t"));
}

TEST(Formats, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3f808001u)), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(float_to_bf16(INFINITY), 0x7f80);
}

}  // namespace
}  // namespace moekit
