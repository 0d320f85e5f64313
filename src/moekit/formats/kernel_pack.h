// moekit/formats/kernel_pack.h — how the GPU kernels store element codes in 32-bit words.
//
// The SM90 kernels turn codes into bf16 with shifts and masks, never a table. A bf16 whose
// bits are  s 0000000 0 | e1 e0 m 000000  (sign at 15, magnitude bits at 8:6) reads as the
// E2M1 value times 2^-126 ("tiny" form: subnormal for e = 0, normal otherwise), and one exact
// bf16 multiply by a power of two restores it with the block scale folded in. Likewise
// s 0000 eeee mmm 0000 is an E4M3 value times 2^-120.
//
// E2M1, 8 codes per word (c0..c7; the A-fragment pairs (c0,c1) (c2,c3) (c4,c5) (c6,c7)).
// With M = 0x81C081C0 (each half's sign at 15, magnitude at 8:6), pair p is recovered as bf16x2
// tiny values by (e2m1x8_tiny below; 8 instructions per word, 11 in the layout before 2026-11-24):
//   p0:  w & M                          1 LOP3
//   p1:  rotl(w, 10) & M                SHF.L.W + LOP3
//   p2:  rotl(w, 13) & M                SHF.L.W + LOP3
//   p3:  ((w & K3) * C3) & M            LOP3 + IMAD + LOP3, K3 = 0x001B001B, C3 = 2^3 + 2^8 + 2^14
// p3's bits (m, e0 at 3, 4 | 19, 20; e1 at 0 | 16; s at 1 | 17) reach M through the three
// shifted copies of w & K3 that the multiply adds: the copies share no bit (no carries) and
// each M bit receives exactly one p3 bit. No four translates (shifts or rotations, of one word
// or of a word pair) of M tile the bits, so one pair needs three instructions; a search over
// the layouts (2026-11-24) found this one.
//
// E4M3, 4 codes per word (pairs (c0,c1) and (c2,c3); e4m3x4_tiny below, 5 instructions per word,
// 7 in the layout before 2026-11-24):
//   pA:  w & 0x87F087F0                                     magnitude at 10:4 | 26:20, sign at 15 | 31
//   pB:  ((w << 4) & 0x80F080F0) | ((w >> 4) & 0x07000700)  2 shifts + 2 LOP3
//        magnitude bits 3:0 at 3:0 | 19:16, bits 6:4 at 14:12 | 30:28, sign at 11 | 27
#pragma once

#include <cstdint>

#include "moekit/common/hd.h"

namespace moekit {

// Exponent offsets of the tiny forms: E2M1 unpacks to value * 2^-126, E4M3 to value * 2^-120.
inline constexpr int kE2M1TinyExp = 126;
inline constexpr int kE4M3TinyExp = 120;
// Largest E8M0 scale byte b whose multiplier 2^(b - 127 + tiny_exp) is a normal bf16, so that
// one exact bf16 multiply restores tiny * 2^(b - 127). The convert step checks every scale
// against it; the kernels take a second multiply otherwise (formats/dequant.cuh).
constexpr uint32_t mx_single_multiply_max(int tiny_exp) { return uint32_t(254 - tiny_exp); }

inline constexpr uint32_t kE2M1TinyMask = 0x81C081C0u;
inline constexpr int kE2M1Rot1 = 10, kE2M1Rot2 = 13;
inline constexpr uint32_t kE2M1P3Keep = 0x001B001Bu;
inline constexpr uint32_t kE2M1P3Mul = (1u << 3) | (1u << 8) | (1u << 14);

MOEKIT_HD uint32_t rotl32(uint32_t w, int r) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(w, w, uint32_t(r));
#else
  return (w << r) | (w >> ((32 - r) & 31));
#endif
}

// 8 E2M1 codes -> 4 bf16x2 tiny values (value * 2^-126): the kernels' unpack, also run on the
// host by the tests.
MOEKIT_HD void e2m1x8_tiny(uint32_t w, uint32_t (&t)[4]) {
  t[0] = w & kE2M1TinyMask;
  t[1] = rotl32(w, kE2M1Rot1) & kE2M1TinyMask;
  t[2] = rotl32(w, kE2M1Rot2) & kE2M1TinyMask;
  t[3] = ((w & kE2M1P3Keep) * kE2M1P3Mul) & kE2M1TinyMask;
}

// The tiny pair of codes (lo, hi): magnitude at 8:6 | 24:22, sign at 15 | 31.
MOEKIT_HD uint32_t e2m1_tiny_pair(uint32_t lo, uint32_t hi) {
  return (lo & 7u) << 6 | ((lo >> 3) & 1u) << 15 | (hi & 7u) << 22 | ((hi >> 3) & 1u) << 31;
}

MOEKIT_HD uint32_t pack_e2m1x8(const uint8_t c[8]) {
  uint32_t w = e2m1_tiny_pair(c[0], c[1]);                        // p0 in place
  w |= rotl32(e2m1_tiny_pair(c[2], c[3]), 32 - kE2M1Rot1);      // p1, rotated back
  w |= rotl32(e2m1_tiny_pair(c[4], c[5]), 32 - kE2M1Rot2);      // p2, rotated back
  auto p3 = [](uint32_t x, int base) {                            // m -> 3, e0 -> 4, e1 -> 0, s -> 1
    return (x & 1u) << (base + 3) | ((x >> 1) & 1u) << (base + 4) | ((x >> 2) & 1u) << base |
           ((x >> 3) & 1u) << (base + 1);
  };
  return w | p3(c[6], 0) | p3(c[7], 16);
}

// 4 E4M3 codes -> 2 bf16x2 tiny values (value * 2^-120). NaN codes are not handled (the
// convert step rejects them).
MOEKIT_HD void e4m3x4_tiny(uint32_t w, uint32_t (&t)[2]) {
  t[0] = w & 0x87F087F0u;
  t[1] = ((w << 4) & 0x80F080F0u) | ((w >> 4) & 0x07000700u);
}

MOEKIT_HD uint32_t pack_e4m3x4(const uint8_t c[4]) {
  uint32_t w = 0;
  w |= uint32_t(c[0] & 0x7f) << 4 | uint32_t(c[0] >> 7) << 15;
  w |= uint32_t(c[1] & 0x7f) << 20 | uint32_t(c[1] >> 7) << 31;
  auto pb = [](uint32_t x, int base) {
    return (x & 0xfu) << base | ((x >> 4) & 7u) << (base + 12) | (x >> 7) << (base + 11);
  };
  w |= pb(c[2], 0) | pb(c[3], 16);
  return w;
}

}  // namespace moekit
