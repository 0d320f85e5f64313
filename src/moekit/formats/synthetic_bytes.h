// moekit/formats/synthetic_bytes.h — random but valid weight bytes (benchmarks, tests, synthetic
// packed layers), the same on the host and the device: a hash of (index, seed) shaped so that
// codes are anything legal, scales keep a layer's outputs finite and every format stays on its
// single-multiply path.
#pragma once

#include <cstdint>

#include "moekit/common/hd.h"
#include "moekit/spec.hpp"

namespace moekit {

enum class SyntheticKind {
  kFp4Code,    // any byte (two E2M1 codes)
  kE4M3Code,   // |v| < 2, no NaN
  kE8M0Scale,  // 2^-9 .. 2^-4
  kE4M3Scale,  // 0.5 .. 6
  kBf16,       // bf16 pairs of magnitude ~2^-7 (byte i of a little-endian bf16 array)
  kF32Scale,   // fp32 in [2^-9, 2^-8) (byte i of a little-endian fp32 array)
};

MOEKIT_HD uint8_t synthetic_byte(int64_t i, uint64_t seed, SyntheticKind kind) {
  uint64_t h = (uint64_t(i) + seed) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  uint8_t b = uint8_t(h);
  switch (kind) {
    case SyntheticKind::kFp4Code: break;
    case SyntheticKind::kE4M3Code: b &= 0xbf; break;
    case SyntheticKind::kE8M0Scale: b = uint8_t(118 + (h >> 8) % 6); break;
    case SyntheticKind::kE4M3Scale: b = uint8_t(0x30 + (h >> 8) % 0x18); break;
    case SyntheticKind::kBf16: b = (i & 1) ? uint8_t(0x3c + ((h >> 8) & 1) + ((h >> 16) & 0x80)) : b; break;
    case SyntheticKind::kF32Scale: b = (i & 3) == 3 ? uint8_t(0x3b) : (i & 3) == 2 ? uint8_t(b & 0x7f) : b; break;
  }
  return b;
}

MOEKIT_HD SyntheticKind synthetic_code_kind(WeightFormat f) {
  return f == WeightFormat::kMxfp8 || f == WeightFormat::kFp8 ? SyntheticKind::kE4M3Code
         : f == WeightFormat::kBf16 ? SyntheticKind::kBf16
                                    : SyntheticKind::kFp4Code;
}
MOEKIT_HD SyntheticKind synthetic_scale_kind(WeightFormat f) {
  return f == WeightFormat::kNvfp4 ? SyntheticKind::kE4M3Scale
         : f == WeightFormat::kFp8  ? SyntheticKind::kF32Scale
                                    : SyntheticKind::kE8M0Scale;
}

// Entry i of a synthetic hash-routing table tid2eid [V, k] of E experts: row r = i / k holds k
// consecutive experts (mod E) from a hashed start, so no expert appears twice in a row (k <= E).
MOEKIT_HD int32_t synthetic_hash_entry(int64_t i, int k, int E, uint64_t seed) {
  uint64_t h = (uint64_t(i / k) + seed) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return int32_t((h % uint64_t(E) + uint64_t(i % k)) % uint64_t(E));
}

// The nvfp4 tensor scale (1/g) of synthetic weights.
constexpr float kSyntheticScale2 = 0.01f;

}  // namespace moekit
