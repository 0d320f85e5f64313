// moekit/formats/mx.h — the shared-exponent rule of the OCP MX block formats (MXFP4, MXFP8).
//
// A block of 32 elements along K shares one E8M0 scale 2^e. Two rules pick e from the block's
// largest magnitude amax (both exist in the wild; checkpoints record which one made them):
//   floor (OCP MX v1.0):  e = floor(log2(amax)) - emax_elem      (E2M1: 2, E4M3: 8)
//   rceil:                e = ceil(log2(amax / max_elem))         (E2M1: 6, E4M3: 448)
// amax == 0 gives e = -127; e is clamped to [-127, 127] and stored as the byte e + 127.
// Elements are q = RNE(clamp(x / 2^e, ±max_elem)), with x / 2^e computed exactly and rounded
// to fp32 once before the rounding to the element code.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "moekit/formats/codes.h"
#include "moekit/spec.hpp"  // ScaleRule

namespace moekit {

inline constexpr int kMxBlock = 32;

const char* scale_rule_name(ScaleRule r);
ScaleRule parse_scale_rule(const std::string& s);  // throws moekit::Error on unknown names

// The shared exponent e (before the +127 bias) for a block whose largest magnitude is amax.
MOEKIT_HD int mx_shared_exponent(float amax, ScaleRule rule, int emax_elem, float max_elem) {
  if (!(amax > 0.0f)) return -127;
  int e;
  if (rule == ScaleRule::kFloor) {
    e = floor_log2(amax) - emax_elem;
  } else {
    // Smallest e with max_elem * 2^e >= amax, i.e. ceil(log2(amax / max_elem)), found with
    // exact comparisons in double rather than a rounded log2.
    e = floor_log2(amax) - floor_log2(max_elem);
    while (::ldexp(double(max_elem), e) < double(amax)) ++e;
    while (::ldexp(double(max_elem), e - 1) >= double(amax)) --e;
  }
  return e < -127 ? -127 : e > 127 ? 127 : e;
}

// x / 2^e rounded once to fp32, then clamped to ±max_elem.
MOEKIT_HD float mx_scale_down(float x, int e, float max_elem) {
  const float v = float(::ldexp(double(x), -e));  // exact in double, one rounding to fp32
  return ::fminf(::fmaxf(v, -max_elem), max_elem);
}

}  // namespace moekit
