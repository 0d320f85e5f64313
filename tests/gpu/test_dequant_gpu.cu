// Device dequantization (formats/dequant.cuh) against the golden vectors: the exact fp32 path
// must equal `dq` bit for bit; the bf16 register path (what the GEMMs use) must equal `dq`
// wherever bf16 can hold the value, both with the general two-multiply rule and, for scales
// in its range, the single multiply; the kernels' paired single multiply against the formula.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "../testutil.h"
#include "gpu_util.h"
#include "moekit/common/bf16.h"
#include "moekit/formats/codes.h"
#include "moekit/formats/dequant.cuh"
#include "moekit/formats/kernel_pack.h"
#include "moekit/experts/sm90_fragment.cuh"
#include "moekit/formats/quantize.h"
#include "moekit/io/safetensors.h"

namespace moekit {
namespace {

enum Kind { kFp4Mx = 0, kFp8Mx = 1, kFp4Nv = 2 };

__device__ float lo_f32(uint32_t v) { return __uint_as_float(v << 16); }
__device__ float hi_f32(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// One thread per packed word. `codes` holds the standard layout (for the fp32 reference path),
// `words` the kernel order. out_bf16: the register path; out_f32: the reference path.
__global__ void dequant_kernel(int kind, const uint32_t* words, const uint8_t* codes,
                               const uint8_t* scales, float scale_2, int64_t n_words, int K,
                               bool single_multiply, float* out_bf16, float* out_f32) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_words) return;
  const int per_word = kind == kFp8Mx ? 4 : 8;
  const int64_t e0 = i * per_word;  // first element
  const int64_t row = e0 / K, col = e0 % K;
  const int block = kind == kFp4Nv ? 16 : 32;
  const uint32_t s = scales[row * (K / block) + col / block];
  float vals[8];
  if (kind == kFp8Mx) {
    uint32_t t[2];
    e4m3x4_tiny(words[i], t);
    const auto m = dev::mx_multipliers(s, 120);
    for (int p = 0; p < 2; ++p) {
      uint32_t v = dev::bf16x2_mul(t[p], m.m1);
      if (!single_multiply) v = dev::bf16x2_mul(v, m.m2);
      vals[2 * p] = lo_f32(v);
      vals[2 * p + 1] = hi_f32(v);
    }
  } else {
    uint32_t t[4];
    e2m1x8_tiny(words[i], t);
    for (int p = 0; p < 4; ++p) {
      uint32_t v;
      if (kind == kFp4Mx) {
        const auto m = dev::mx_multipliers(s, 126);
        v = dev::bf16x2_mul(t[p], m.m1);
        if (!single_multiply) v = dev::bf16x2_mul(v, m.m2);
      } else {
        v = dev::bf16x2_mul(t[p], dev::bf16x2_splat(dev::bf16_pow2_bits(126)));
        v = dev::bf16x2_mul(v, dev::e4m3_scale_bf16x2(s));
      }
      // NVFP4: q * s is exact in bf16; the tensor scale is applied in fp32 (the epilogue).
      vals[2 * p] = kind == kFp4Nv ? lo_f32(v) * scale_2 : lo_f32(v);
      vals[2 * p + 1] = kind == kFp4Nv ? hi_f32(v) * scale_2 : hi_f32(v);
    }
  }
  for (int j = 0; j < per_word; ++j) {
    const int64_t e = e0 + j;
    out_bf16[e] = vals[j];
    float ref;
    if (kind == kFp8Mx) {
      ref = dev::e4m3_to_f32(codes[e]) * dev::e8m0_to_f32(s);
    } else {
      const uint32_t byte = codes[e / 2];
      const uint32_t q = (e & 1) ? (byte >> 4) : (byte & 0xf);
      ref = kind == kFp4Mx ? dev::e2m1_to_f32(q) * dev::e8m0_to_f32(s)
                           : (dev::e2m1_to_f32(q) * dev::e4m3_to_f32(s)) * scale_2;
    }
    out_f32[e] = ref;
  }
}

// True when bf16 holds v exactly (the bf16 path can only differ from fp32 there).
bool bf16_exact(float v) { return bf16_to_float(float_to_bf16(v)) == v; }

void run_file(const std::string& path) {
  SCOPED_TRACE(path);
  const auto f = SafetensorsFile::open(path);
  const WeightFormat fmt = parse_format(f.metadata().at("format"));
  const TensorView& x = f.get("x");
  const int64_t R = x.shape[0], K = x.shape[1];
  const TensorView& codes = fmt == WeightFormat::kMxfp4 ? f.get("q_blocks") : f.get("q");
  const TensorView& scales = fmt == WeightFormat::kMxfp4 ? f.get("q_scales") : f.get("q_scale");
  const float s2 = fmt == WeightFormat::kNvfp4 ? to_float(f.get("q_scale_2"), path)[0] : 1.0f;
  const int kind = fmt == WeightFormat::kMxfp4 ? kFp4Mx : fmt == WeightFormat::kMxfp8 ? kFp8Mx : kFp4Nv;

  std::vector<uint32_t> words;
  bool all_single = true;
  for (size_t i = 0; i < scales.nbytes; ++i)
    all_single = all_single && scales.data[i] <= mx_single_multiply_max(kind == kFp8Mx ? kE4M3TinyExp : kE2M1TinyExp);
  if (kind == kFp8Mx) {
    for (int64_t e = 0; e < R * K; e += 4) words.push_back(pack_e4m3x4(codes.data + e));
  } else {
    for (int64_t e = 0; e < R * K; e += 8) {
      uint8_t c[8];
      for (int j = 0; j < 8; ++j) {
        const uint8_t byte = codes.data[(e + j) / 2];
        c[j] = (j & 1) ? uint8_t(byte >> 4) : uint8_t(byte & 0xf);
      }
      words.push_back(pack_e2m1x8(c));
    }
  }
  test::DeviceBuffer<uint32_t> d_words(words);
  test::DeviceBuffer<uint8_t> d_codes(std::vector<uint8_t>(codes.data, codes.data + codes.nbytes));
  test::DeviceBuffer<uint8_t> d_scales(std::vector<uint8_t>(scales.data, scales.data + scales.nbytes));
  test::DeviceBuffer<float> d_bf(size_t(R * K)), d_f32(size_t(R * K));
  const auto dq = to_float(f.get("dq"), path);

  for (bool single : {false, true}) {
    if (single && (kind == kFp4Nv || !all_single)) continue;
    d_bf.poison();
    d_f32.poison();
    const int64_t n = int64_t(words.size());
    dequant_kernel<<<unsigned((n + 255) / 256), 256>>>(kind, d_words.ptr, d_codes.ptr, d_scales.ptr, s2, n,
                                                       int(K), single, d_bf.ptr, d_f32.ptr);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    const auto bf = d_bf.to_host();
    const auto f32 = d_f32.to_host();
    int64_t bad_ref = 0, bad_bf = 0, outside_bf16 = 0;
    for (size_t i = 0; i < dq.size(); ++i) {
      bad_ref += float_to_bits(f32[i]) != float_to_bits(dq[i]);
      if (bf16_exact(dq[i]) || kind == kFp4Nv) {
        bad_bf += float_to_bits(bf[i]) != float_to_bits(dq[i]);
      } else {
        ++outside_bf16;  // |dq| below bf16's smallest subnormal step
        EXPECT_LT(std::fabs(dq[i]), 0x1p-126f) << "element " << i;
      }
    }
    EXPECT_EQ(bad_ref, 0);
    EXPECT_EQ(bad_bf, 0) << (single ? "single multiply" : "two multiplies");
    if (outside_bf16) std::printf("  %s: %lld values below bf16 range (fp32 path exact)\n",
                                  std::filesystem::path(path).filename().c_str(), (long long)outside_bf16);
  }
}

TEST(GpuDequant, GoldenVectors) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(test::testdata("formats"))) {
    if (e.path().filename().string().find("decode_tables") != std::string::npos) continue;
    run_file(e.path().string());
    ++n;
  }
  EXPECT_EQ(n, 20);
}

// Every (code, scale) combination through the register path, against the fp32 formula.
__global__ void all_codes_kernel(float* out) {
  const uint32_t s = blockIdx.x;     // scale byte 0..254
  const uint32_t code = threadIdx.x;  // 0..15 E2M1, or 0..255 E4M3
  if (code < 16) {
    // the same code in all eight slots
    uint8_t c[8];
    for (auto& x : c) x = uint8_t(code);
    const uint32_t w = pack_e2m1x8(c);
    uint32_t t[4];
    e2m1x8_tiny(w, t);
    const auto m = dev::mx_multipliers(s, 126);
    for (int p = 0; p < 4; ++p) {
      const uint32_t v = dev::bf16x2_mul(dev::bf16x2_mul(t[p], m.m1), m.m2);
      out[(s * 16 + code) * 8 + 2 * p] = lo_f32(v);
      out[(s * 16 + code) * 8 + 2 * p + 1] = hi_f32(v);
    }
  }
}

TEST(GpuDequant, EveryE2M1CodeTimesEveryScale) {
  test::DeviceBuffer<float> out(255 * 16 * 8);
  out.poison();
  all_codes_kernel<<<255, 256>>>(out.ptr);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  const auto v = out.to_host();
  int64_t bad = 0;
  for (int s = 0; s < 255; ++s)
    for (int c = 0; c < 16; ++c) {
      const float ref = e2m1_to_float(uint8_t(c)) * e8m0_to_float(uint8_t(s));
      for (int j = 0; j < 8; ++j) {
        const float got = v[size_t((s * 16 + c) * 8 + j)];
        if (bf16_exact(ref)) bad += float_to_bits(got) != float_to_bits(ref);
      }
    }
  EXPECT_EQ(bad, 0);
}

// The kernels' single-multiply MX path (experts/sm90_fragment.cuh): a k-block's four scale bytes
// [row g kb0, row g kb1, row g+8 kb0, row g+8 kb1] as two multiplier pairs (mx_pair_multipliers),
// each half read by one bf16x2 multiply (mul_half). Every code times every scale byte the rule
// admits, in every byte position: block s puts s, smax - s, (s + 37) % (smax + 1) and
// (7 s) % (smax + 1) in bytes 0-3. out: [fmt][s][code][kb][row g, row g + 8][slot 0..3].
constexpr uint32_t kPairSlots = 2 * 2 * 4;
__device__ __host__ inline uint32_t pair_scale_byte(uint32_t s, uint32_t smax, int i) {
  return i == 0 ? s : i == 1 ? smax - s : i == 2 ? (s + 37) % (smax + 1) : (7 * s) % (smax + 1);
}
__global__ void pair_multipliers_kernel(float* out) {
  const uint32_t s = blockIdx.x, code = threadIdx.x;  // code 0..255 (E2M1: 0..15)
  const bool fp4 = blockIdx.y == 0;
  const uint32_t tiny = fp4 ? kE2M1TinyExp : kE4M3TinyExp;
  const uint32_t smax = mx_single_multiply_max(int(tiny));
  if (s > smax || (fp4 && code >= 16)) return;
  uint32_t word = 0;
  for (int i = 0; i < 4; ++i) word |= pair_scale_byte(s, smax, i) << (8 * i);
  uint32_t m[2];
  sm90::mx_pair_multipliers(word, tiny, m);
  uint32_t t[4];
  uint8_t c[8];
  for (auto& x : c) x = uint8_t(code);
  if (fp4) {
    e2m1x8_tiny(pack_e2m1x8(c), t);  // pairs (c, c): registers 0, 2 row g, 1, 3 row g + 8
  } else {
    uint32_t lo[2];
    e4m3x4_tiny(pack_e4m3x4(c), lo);
    t[0] = t[2] = lo[0], t[1] = t[3] = lo[1];
  }
  float* o = out + ((size_t(blockIdx.y) * 256 + s) * 256 + code) * kPairSlots;
  for (int kb = 0; kb < 2; ++kb) {
    uint32_t a[4];
    sm90::mul_pair(t, m[kb], a);
    for (int r = 0; r < 4; ++r) {  // register r: row g (r even) or g + 8 (r odd)
      o[kb * 8 + (r & 1) * 4 + (r >> 1) * 2] = lo_f32(a[r]);
      o[kb * 8 + (r & 1) * 4 + (r >> 1) * 2 + 1] = hi_f32(a[r]);
    }
  }
}

TEST(GpuDequant, PairedMultipliersEveryCodeAndScale) {
  test::DeviceBuffer<float> out(2 * 256 * 256 * kPairSlots);
  out.poison();
  pair_multipliers_kernel<<<dim3(256, 2), 256>>>(out.ptr);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  const auto v = out.to_host();
  int64_t checked = 0, bad = 0;
  for (int f = 0; f < 2; ++f) {
    const uint32_t smax = mx_single_multiply_max(f == 0 ? kE2M1TinyExp : kE4M3TinyExp);
    for (uint32_t s = 0; s <= smax; ++s)
      for (int code = 0; code < (f == 0 ? 16 : 256); ++code) {
        const float x = f == 0 ? e2m1_to_float(uint8_t(code)) : e4m3_to_float(uint8_t(code));
        for (int kb = 0; kb < 2; ++kb)
          for (int row = 0; row < 2; ++row) {
            const float ref = x * e8m0_to_float(uint8_t(pair_scale_byte(s, smax, kb + 2 * row)));
            if (std::isnan(x) || !bf16_exact(ref)) continue;
            for (int j = 0; j < 4; ++j) {
              const float got = v[((size_t(f) * 256 + s) * 256 + code) * kPairSlots + kb * 8 + row * 4 + j];
              bad += float_to_bits(got) != float_to_bits(ref);
              ++checked;
            }
          }
      }
  }
  EXPECT_GT(checked, 200000);
  EXPECT_EQ(bad, 0);
}

}  // namespace
}  // namespace moekit
