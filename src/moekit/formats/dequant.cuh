// moekit/formats/dequant.cuh — exact dequantization to bf16 in registers (SM90 kernels).
//
// Words come in the kernel order of formats/kernel_pack.h. Each unpack gives bf16x2 "tiny"
// values (E2M1 * 2^-126, E4M3 * 2^-120); a multiply by a power-of-two multiplier restores the
// value with the E8M0 block scale folded in. Everything here is exact: E2M1 (2 significant bits)
// and E4M3 (4 bits) times a power of two, or E2M1 times an E4M3 scale (6 bits), fit bf16's 8.
// The only values bf16 cannot hold are results below 2^-133 or above bf16's range; fp32 holds
// them, and the *_f32 reference path below is exact for every code and scale.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "moekit/formats/kernel_pack.h"

namespace moekit::dev {

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&a);
  __nv_bfloat162 y = *reinterpret_cast<__nv_bfloat162*>(&b);
  __nv_bfloat162 r = __hmul2(x, y);
  return *reinterpret_cast<uint32_t*>(&r);
}

// 2^x as bf16 bits, x in [-126, 127].
__device__ __forceinline__ uint32_t bf16_pow2_bits(int x) { return uint32_t(x + 127) << 7; }
__device__ __forceinline__ uint32_t bf16x2_splat(uint32_t b16) { return b16 | (b16 << 16); }

// Codes -> bf16x2 tiny values: kernel_pack.h (e2m1x8_tiny, e4m3x4_tiny), shared with the host.

// Multipliers that restore tiny values with an E8M0 scale byte b folded in:
// value = tiny * m1 * m2. Whenever 2^(b - 127 + tiny_exp) is a normal bf16 (b <= 254 -
// tiny_exp), m2 is 1 and one multiply suffices; kernels that know all scales are in that range
// (the convert step checks) skip m2.
struct MxMultipliers {
  uint32_t m1, m2;  // bf16x2, both halves equal
};
// tiny_exp: 126 for E2M1, 120 for E4M3.
__device__ __forceinline__ MxMultipliers mx_multipliers(uint32_t b, int tiny_exp) {
  MxMultipliers r;
  if (b == 0xffu) {  // NaN scale
    r.m1 = r.m2 = 0x7fc07fc0u;
  } else if (b <= mx_single_multiply_max(tiny_exp)) {
    r.m1 = bf16x2_splat(bf16_pow2_bits(int(b) - 127 + tiny_exp));
    r.m2 = 0x3f803f80u;  // 1.0
  } else {
    r.m1 = bf16x2_splat(bf16_pow2_bits(tiny_exp));
    r.m2 = bf16x2_splat(bf16_pow2_bits(int(b) - 127));
  }
  return r;
}

// An E4M3 scale byte (NVFP4 block scale) as a bf16x2 multiplier, both halves equal, exact.
__device__ __forceinline__ uint32_t e4m3_scale_bf16x2(uint32_t s) {
  // fp32 with the E4M3 magnitude at bits 26:20 is the value * 2^-120 (subnormals included).
  float f = __uint_as_float((s & 0x7fu) << 20) * 0x1p120f;
  f = (s & 0x80u) ? -f : f;
  const uint32_t b = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(f)));
  return bf16x2_splat(b);
}

// ---- exact fp32 references (also the slow path) -----------------------------------------
__device__ __forceinline__ float e2m1_to_f32(uint32_t code) {
  const uint32_t mag = code & 7u;
  // 0.5 * m for e = 0, else 2^(e-1) * (1 + m/2): build the fp32 directly.
  float v = mag == 0 ? 0.0f : (mag == 1 ? 0.5f : __uint_as_float(((mag >> 1) + 126u) << 23 | (mag & 1u) << 22));
  return (code & 8u) ? -v : v;
}
__device__ __forceinline__ float e4m3_to_f32(uint32_t code) {
  if ((code & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u);
  const float v = __uint_as_float((code & 0x7fu) << 20) * 0x1p120f;
  return (code & 0x80u) ? -v : v;
}
__device__ __forceinline__ float e8m0_to_f32(uint32_t b) {
  if (b == 0xffu) return __uint_as_float(0x7fc00000u);
  return b == 0 ? 0x1p-127f : __uint_as_float(b << 23);
}

}  // namespace moekit::dev
