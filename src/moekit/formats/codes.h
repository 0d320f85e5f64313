// moekit/formats/codes.h — the element and scale codes that the block formats are built from.
//
//   E2M1 (fp4)  s.ee.m   bias 1   values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; no inf, no NaN
//   E4M3 (fp8)  s.eeee.mmm bias 7 max ±448; NaN only as 0x7F / 0xFF; no inf
//   E8M0        eeeeeeee  2^(b-127); 0xFF is NaN; no sign, no zero
//
// Rounding to a code is round-to-nearest-even on the value's magnitude, and keeps the sign:
// a negative value that rounds to zero gives -0 (E2M1 0x8, E4M3 0x80). Callers clamp to the
// format's maximum first; these functions never saturate on their own.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>

#include "moekit/common/bf16.h"
#include "moekit/common/hd.h"

namespace moekit {

inline constexpr float kE2M1Max = 6.0f;
inline constexpr float kE4M3Max = 448.0f;
inline constexpr int kE2M1Emax = 2;  // exponent of the largest normal E2M1 value (6 = 1.5 * 2^2)
inline constexpr int kE4M3Emax = 8;  // 448 = 1.75 * 2^8

// ---- decoding ------------------------------------------------------------------------------

MOEKIT_HD float e2m1_to_float(uint8_t code) {
  // Index = magnitude bits e1 e0 m; value 0.5*m for e = 0, else 2^(e-1) * (1 + m/2).
  constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float v = kMag[code & 7];
  return (code & 8) ? -v : v;
}

MOEKIT_HD float e4m3_to_float(uint8_t code) {
  const int e = (code >> 3) & 0xf;
  const int m = code & 7;
  float v;
  if (e == 15 && m == 7) {
    v = bits_to_float(0x7fc00000u);  // NaN
  } else if (e == 0) {
    v = ldexpf(float(m), -9);  // subnormal: m/8 * 2^-6
  } else {
    v = ldexpf(float(8 + m), e - 10);  // (1 + m/8) * 2^(e-7)
  }
  return (code & 0x80) ? -v : v;
}

MOEKIT_HD float e8m0_to_float(uint8_t code) {
  if (code == 0xff) return bits_to_float(0x7fc00000u);  // NaN
  return ldexpf(1.0f, int(code) - 127);  // 2^-127 is an fp32 subnormal: exact
}

// ---- encoding (host and device: the dispatch kernels quantize with the same code) ---------

namespace detail {
// Rounds a finite magnitude a >= 0, already clamped to the format's max, to the nearest code
// of a minifloat with EBITS exponent bits, MBITS mantissa bits and the given bias (IEEE-style
// subnormals at exponent field 0). Returns the magnitude bits (no sign).
template <int EBITS, int MBITS, int BIAS>
MOEKIT_HD uint8_t round_magnitude(float a) {
  if (!(a > 0.0f)) return 0;
  constexpr int kEmin = 1 - BIAS;  // exponent of the smallest normal
  int exp2;
  (void)::frexpf(a, &exp2);        // a = f * 2^exp2, f in [0.5, 1)
  int e = exp2 - 1;                // floor(log2(a))
  if (e < kEmin) e = kEmin;        // subnormal range shares the smallest normal's quantum
  // n = a / quantum, exact: a power-of-two scaling of an fp32 value that stays in range.
  const double n = ::ldexp(double(a), MBITS - e);
  double r = ::nearbyint(n);       // default rounding mode: nearest, ties to even
  if (r >= double(2 << MBITS)) {   // rounded up into the next binade
    r = double(1 << MBITS);
    ++e;
  }
  const int ri = int(r);
  if (ri < (1 << MBITS)) return uint8_t(ri);  // subnormal (only possible at e == kEmin)
  return uint8_t(((e + BIAS) << MBITS) | (ri - (1 << MBITS)));
}
MOEKIT_HD bool sign_bit(float x) { return (float_to_bits(x) >> 31) != 0; }
}  // namespace detail

// x must be finite with |x| <= 6.
MOEKIT_HD uint8_t float_to_e2m1(float x) {
  const uint8_t mag = detail::round_magnitude<2, 1, 1>(::fabsf(x));
  return detail::sign_bit(x) ? uint8_t(mag | 0x8) : mag;
}

// x must be finite with |x| <= 448.
MOEKIT_HD uint8_t float_to_e4m3(float x) {
  const uint8_t mag = detail::round_magnitude<4, 3, 7>(::fabsf(x));
  return detail::sign_bit(x) ? uint8_t(mag | 0x80) : mag;
}

// floor(log2(a)) for a finite a > 0, exact (subnormals included).
MOEKIT_HD int floor_log2(float a) {
  int exp2;
  (void)::frexpf(a, &exp2);
  return exp2 - 1;
}

}  // namespace moekit
