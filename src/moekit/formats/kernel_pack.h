// moekit/formats/kernel_pack.h — how the GPU kernels store element codes in 32-bit words.
//
// The SM90 kernels turn codes into bf16 with shifts and masks, never a table. A bf16 whose
// bits are  s 0000000 0 | e1 e0 m 000000  (sign at 15, magnitude bits at 8:6) reads as the
// E2M1 value times 2^-126 ("tiny" form: subnormal for e = 0, normal otherwise), and one exact
// bf16 multiply by a power of two restores it with the block scale folded in. Likewise
// s 0000 eeee mmm 0000 is an E4M3 value times 2^-120.
//
// E2M1, 8 codes per word (c0..c7; the A-fragment pairs (c0,c1) (c2,c3) (c4,c5) (c6,c7)).
// Pair p is recovered as bf16x2 tiny values by:
//   p0:  w & M                    bits {6,7,8,15 | 22,23,24,31}
//   p1:  (w << 6) & M             stored at {0,1,2,9 | 16,17,18,25}
//   p2:  (w << 3) & M             stored at {3,4,5,12 | 19,20,21,28}
//   p3:  ((w >> 6) & 0x01800180) | ((w >> 4) & 0x00400040) | ((w << 4) & 0x80008000)
//        m at 10|26, e0 e1 at 13,14|29,30, s at 11|27
// with M = 0x81C081C0 (no 32-bit word admits four translates of M, hence the odd p3).
//
// E4M3, 4 codes per word (pairs (c0,c1) and (c2,c3)):
//   pA:  w & 0x87F087F0           magnitude at 10:4 | 26:20, sign at 15 | 31
//   pB:  ((w << 4) & 0x00F000F0) | ((w >> 3) & 0x07000700) | ((w << 1) & 0x80008000)
//        magnitude bits 3:0 at 3:0 | 19:16, bits 6:4 at 13:11 | 29:27, sign at 14 | 30
#pragma once

#include <cstdint>

namespace moekit {

// Exponent offsets of the tiny forms: E2M1 unpacks to value * 2^-126, E4M3 to value * 2^-120.
inline constexpr int kE2M1TinyExp = 126;
inline constexpr int kE4M3TinyExp = 120;
// Largest E8M0 scale byte b whose multiplier 2^(b - 127 + tiny_exp) is a normal bf16, so that
// one exact bf16 multiply restores tiny * 2^(b - 127). The convert step checks every scale
// against it; the kernels take a second multiply otherwise (formats/dequant.cuh).
constexpr uint32_t mx_single_multiply_max(int tiny_exp) { return uint32_t(254 - tiny_exp); }

inline uint32_t pack_e2m1x8(const uint8_t c[8]) {
  uint32_t w = 0;
  auto mag = [](uint8_t x) { return uint32_t(x & 7); };
  auto sgn = [](uint8_t x) { return uint32_t((x >> 3) & 1); };
  // p0
  w |= mag(c[0]) << 6 | sgn(c[0]) << 15 | mag(c[1]) << 22 | sgn(c[1]) << 31;
  // p1 (recovered by << 6)
  w |= mag(c[2]) << 0 | sgn(c[2]) << 9 | mag(c[3]) << 16 | sgn(c[3]) << 25;
  // p2 (recovered by << 3)
  w |= mag(c[4]) << 3 | sgn(c[4]) << 12 | mag(c[5]) << 19 | sgn(c[5]) << 28;
  // p3: m -> 10|26, e0 e1 -> 13,14|29,30, s -> 11|27
  auto p3 = [&](uint8_t x, int base) {
    return (uint32_t(x & 1) << (base + 10)) | (uint32_t((x >> 1) & 3) << (base + 13)) |
           (sgn(x) << (base + 11));
  };
  w |= p3(c[6], 0) | p3(c[7], 16);
  return w;
}

inline uint32_t pack_e4m3x4(const uint8_t c[4]) {
  uint32_t w = 0;
  w |= uint32_t(c[0] & 0x7f) << 4 | uint32_t(c[0] >> 7) << 15;
  w |= uint32_t(c[1] & 0x7f) << 20 | uint32_t(c[1] >> 7) << 31;
  auto pb = [](uint8_t x, int base) {
    return (uint32_t(x & 0xf) << base) | (uint32_t((x >> 4) & 7) << (base + 11)) |
           (uint32_t(x >> 7) << (base + 14));
  };
  w |= pb(c[2], 0) | pb(c[3], 16);
  return w;
}

}  // namespace moekit
