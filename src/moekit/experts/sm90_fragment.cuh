// moekit/experts/sm90_fragment.cuh — one warp's A fragments from the converted weight layout
// (sm90_moe_gemm.cuh states it): shared-memory loads of an atom's codes and scales, and the
// exact dequantization of one k16 step into the four bf16x2 registers of the A fragment. The
// fragment is that of mma.m16n8k16 and, per warp, of wgmma.m64nNk16 with A in registers, so the
// decode kernel (sm90_moe_gemm.cuh) and the prefill kernel (sm90_prefill_gemm.cuh) share it.
#pragma once

#include <cstdint>

#include "moekit/common/ptx_sm90.cuh"
#include "moekit/experts/sm90_layout.h"
#include "moekit/formats/dequant.cuh"

namespace moekit::sm90 {

// ---- scale multipliers ---------------------------------------------------------------------
// NVFP4 block scales: a lane group's 8 scale bytes are two E4M3 words in the kernels' layout
// (formats/kernel_pack.h), [row g b0, row g+8 b0, row g b1, row g+8 b1] and the same for b2, b3,
// so e4m3x4_tiny gives block b's scales of rows g and g + 8 as one bf16x2 of tiny values (their
// magnitude bits at 10:4 read as s * 2^-120, exact, subnormals too): pair b & 1 of word b >> 1.
__device__ __forceinline__ uint32_t nv_tiny_pair(const uint32_t (&words)[2], int b) {
  uint32_t t[2];
  e4m3x4_tiny(words[b >> 1], t);
  return t[b & 1];
}
// The tiny pair -> bf16x2 s * 2^119 of each row (two exact multiplies; the NVFP4 note in
// sm90_moe_gemm.cuh), both halves.
__device__ __forceinline__ uint32_t nv_scale_pair(uint32_t tiny) {
  tiny = dev::bf16x2_mul(tiny, 0x7b807b80u);  // * 2^120 -> s
  return dev::bf16x2_mul(tiny, 0x7b007b00u);  // * 2^119
}

// Scale bytes [row g kb0, row g kb1, row g+8 kb0, row g+8 kb1] -> the two multiplier pairs:
// byte i and i + 2 side by side (one permute), then (b + tiny) << 7 in both halves (one
// multiply-add; b + tiny <= 254 under the single-multiply rule, so no half carries into the other).
__device__ __forceinline__ void mx_pair_multipliers(uint32_t s, uint32_t tiny, uint32_t (&m)[2]) {
  m[0] = __byte_perm(s, 0, 0x4240) * 0x80u + tiny * 0x00800080u;
  m[1] = __byte_perm(s, 0, 0x4341) * 0x80u + tiny * 0x00800080u;
}
// t times half H of m in both halves, the splat and the multiply in one asm statement so that
// ptxas reads the half as an .H0_H0 / .H1_H1 operand of the HMUL2 (separate splats of a pair that
// several steps share are merged and then built with PRMTs: 8 per MX k-block at kNv = 2).
template <int H>
__device__ __forceinline__ uint32_t mul_half(uint32_t t, uint32_t m) {
  uint32_t d;
  if constexpr (H == 0) {
    asm("{ .reg .b16 l, h; .reg .b32 s; mov.b32 {l, h}, %2; mov.b32 s, {l, l}; mul.rn.bf16x2 %0, %1, s; }"
        : "=r"(d) : "r"(t), "r"(m));
  } else {
    asm("{ .reg .b16 l, h; .reg .b32 s; mov.b32 {l, h}, %2; mov.b32 s, {h, h}; mul.rn.bf16x2 %0, %1, s; }"
        : "=r"(d) : "r"(t), "r"(m));
  }
  return d;
}

// a = t times the pair m's row g half (registers 0, 2) and row g + 8 half (1, 3); a may be t.
__device__ __forceinline__ void mul_pair(const uint32_t (&t)[4], uint32_t m, uint32_t (&a)[4]) {
  a[0] = mul_half<0>(t[0], m);
  a[1] = mul_half<1>(t[1], m);
  a[2] = mul_half<0>(t[2], m);
  a[3] = mul_half<1>(t[3], m);
}

// The tiny values (bf16x2) of one k16 step's codes: one E2M1 word or two E4M3 words.
template <WeightFormat F>
__device__ __forceinline__ void tiny_values(const uint32_t* w, uint32_t (&t)[4]) {
  static_assert(F != WeightFormat::kBf16, "bf16 codes are the fragment");
  if constexpr (F == WeightFormat::kMxfp8) {
    uint32_t lo[2], hi[2];
    e4m3x4_tiny(w[0], lo);
    e4m3x4_tiny(w[1], hi);
    t[0] = lo[0], t[1] = lo[1], t[2] = hi[0], t[3] = hi[1];
  } else {
    e2m1x8_tiny(w[0], t);
  }
}
// a = t times the multipliers of rows g (registers 0, 2) and g + 8 (1, 3); a may be t.
__device__ __forceinline__ void mul_rows(const uint32_t (&t)[4], uint32_t mg, uint32_t mh, uint32_t (&a)[4]) {
  a[0] = dev::bf16x2_mul(t[0], mg);
  a[1] = dev::bf16x2_mul(t[1], mh);
  a[2] = dev::bf16x2_mul(t[2], mg);
  a[3] = dev::bf16x2_mul(t[3], mh);
}

// ---- dequantize one k16 step of A into bf16x2 registers ---------------------------------------
template <WeightFormat F>
struct AtomRegs {
  uint32_t w[F == WeightFormat::kBf16 ? 16 : F == WeightFormat::kMxfp8 ? 8 : 4];
  // bf16x2 multipliers: NVFP4 and single-multiply MX as pairs [row g | row g + 8], else one row each
  uint32_t mul[4];
  uint32_t mul2[F == WeightFormat::kNvfp4 ? 1 : 4];  // second multiplier (kSingle == false)
};

// A lane's bytes in an atom: its codes start lane * 16 bytes in (each 512-byte block of the atom),
// its scales at its lane group's 4 (MX) or 8 (NVFP4) bytes.
__device__ __forceinline__ uint32_t lane_code_offset(int lane) { return uint32_t(lane) * 16u; }
template <WeightFormat F>
__device__ __forceinline__ uint32_t lane_scale_offset(int lane) {
  return uint32_t(lane >> 2) * (F == WeightFormat::kNvfp4 ? 8u : 4u);
}

// The atom's codes of this lane, from its own address (the atom's + lane_code_offset).
template <WeightFormat F>
__device__ __forceinline__ void load_lane_words(uint32_t lane_codes, AtomRegs<F>& r) {
  if constexpr (F == WeightFormat::kMxfp4 || F == WeightFormat::kNvfp4) {
    const uint4 v = ptx::lds128(lane_codes);
    r.w[0] = v.x, r.w[1] = v.y, r.w[2] = v.z, r.w[3] = v.w;
  } else if constexpr (F == WeightFormat::kMxfp8) {
    const uint4 a = ptx::lds128(lane_codes);
    const uint4 b = ptx::lds128(lane_codes + 512);
    r.w[0] = a.x, r.w[1] = a.y, r.w[2] = a.z, r.w[3] = a.w;
    r.w[4] = b.x, r.w[5] = b.y, r.w[6] = b.z, r.w[7] = b.w;
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint4 v = ptx::lds128(lane_codes + q * 512);
      r.w[4 * q] = v.x, r.w[4 * q + 1] = v.y, r.w[4 * q + 2] = v.z, r.w[4 * q + 3] = v.w;
    }
  }
}
template <WeightFormat F>
__device__ __forceinline__ void load_atom_words(uint32_t code_atom, int lane, AtomRegs<F>& r) {
  load_lane_words<F>(code_atom + lane_code_offset(lane), r);
}

template <WeightFormat F, bool kSingle>
__device__ __forceinline__ void load_atom_scales(uint32_t scale_atom, int lane, AtomRegs<F>& r) {
  scale_atom += lane_scale_offset<F>(lane);
  if constexpr (F == WeightFormat::kMxfp4 || F == WeightFormat::kMxfp8) {
    constexpr uint32_t tiny = F == WeightFormat::kMxfp4 ? kE2M1TinyExp : kE4M3TinyExp;
    const uint32_t s = ptx::lds32(scale_atom);
    if constexpr (kSingle) {
      // the k-block's multiplier pairs (mx_pair_multipliers): mul[kb] = [row g | row g + 8]
      uint32_t m[2];
      mx_pair_multipliers(s, tiny, m);
      r.mul[0] = m[0], r.mul[1] = m[1];
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const auto m = dev::mx_multipliers(__byte_perm(s, 0, 0x4440 + i), int(tiny));  // byte i, zero-extended
        r.mul[i] = m.m1;
        r.mul2[i] = m.m2;
      }
    }
  } else if constexpr (F == WeightFormat::kNvfp4) {
    const uint2 s = ptx::lds64(scale_atom);
    const uint32_t words[2] = {s.x, s.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) r.mul[i] = nv_scale_pair(nv_tiny_pair(words, i));  // [row g | row g + 8]
  }
}

// A fragment (4 x bf16x2) of k16 step q.
template <WeightFormat F, bool kSingle>
__device__ __forceinline__ void fragment(const AtomRegs<F>& r, int q, uint32_t (&a)[4]) {
  if constexpr (F == WeightFormat::kBf16) {
    a[0] = r.w[4 * q], a[1] = r.w[4 * q + 1], a[2] = r.w[4 * q + 2], a[3] = r.w[4 * q + 3];
  } else {
    uint32_t t[4];
    tiny_values<F>(&r.w[F == WeightFormat::kMxfp8 ? 2 * q : q], t);
    if constexpr (F == WeightFormat::kNvfp4) {
      mul_pair(t, r.mul[q], a);  // block of 16 = this k16 step
    } else {
      // k16 steps 0,1 are kb0
      const int kb = q >> 1;
      if constexpr (kSingle) {
        mul_pair(t, r.mul[kb], a);  // mul[kb]: the pair [row g | row g + 8]
      } else {
        // mul: [row g kb0, row g kb1, row g+8 kb0, row g+8 kb1]
        mul_rows(t, r.mul[kb], r.mul[2 + kb], a);
        mul_rows(a, r.mul2[kb], r.mul2[2 + kb], a);
      }
    }
  }
}

// ---- the same, one k16 step at a time (few live registers: the prefill kernel) ------------------
// The step functions take the lane's own addresses (the atom's + lane_code_offset /
// lane_scale_offset), which the prefill kernel keeps in registers.
// Scales of one atom for this lane, loaded once per k-block (MX: 4 bytes, NVFP4: 8 bytes).
// MX formats: the k-block's four E8M0 multipliers as two pairs, made once when the scales are
// loaded (mx_pair_multipliers): s[0] = [row g kb0 | row g+8 kb0], s[1] = the same for kb1, each
// half read by the multiplies as an .H0_H0 / .H1_H1 operand (mul_half, no instruction).
template <WeightFormat F>
struct StepScales {
  uint32_t s[F == WeightFormat::kBf16 ? 1 : 2];
};
// Codes of one k16 step for this lane: one fp4 word, two fp8 words (block_step_codes) or the
// four bf16x2 words (load_step_codes).
template <WeightFormat F>
struct StepCodes {
  uint32_t w[F == WeightFormat::kBf16 ? 4 : F == WeightFormat::kMxfp8 ? 2 : 1];
};

template <WeightFormat F>
__device__ __forceinline__ void load_step_scales(uint32_t lane_scales, StepScales<F>& r) {
  if constexpr (F == WeightFormat::kMxfp4 || F == WeightFormat::kMxfp8) {
    constexpr uint32_t tiny = F == WeightFormat::kMxfp4 ? kE2M1TinyExp : kE4M3TinyExp;
    mx_pair_multipliers(ptx::lds32(lane_scales), tiny, r.s);
  } else if constexpr (F == WeightFormat::kNvfp4) {
    const uint2 v = ptx::lds64(lane_scales);
    r.s[0] = v.x, r.s[1] = v.y;
  }
}

// BF16: step q's four bf16x2 words (16 bytes at the lane's place in the step's 512-byte block).
template <WeightFormat F>
__device__ __forceinline__ void load_step_codes(uint32_t lane_codes, int q, StepCodes<F>& c) {
  static_assert(F == WeightFormat::kBf16, "packed steps come out of the atom's words (block_step_codes)");
  const uint4 v = ptx::lds128(lane_codes + q * 512);
  c.w[0] = v.x, c.w[1] = v.y, c.w[2] = v.z, c.w[3] = v.w;
}

// Step q's codes out of the whole atom's (load_atom_words: one or two 16-byte loads per lane,
// free of bank conflicts, where four 4-byte loads per k-block at a 16-byte lane stride take four
// wavefronts each). Packed formats; bf16 steps are loaded one by one (16 bytes each already).
template <WeightFormat F>
__device__ __forceinline__ void block_step_codes(const AtomRegs<F>& r, int q, StepCodes<F>& c) {
  static_assert(F != WeightFormat::kBf16, "bf16 codes are loaded per step");
  if constexpr (F == WeightFormat::kMxfp8) {
    c.w[0] = r.w[2 * q], c.w[1] = r.w[2 * q + 1];
  } else {
    c.w[0] = r.w[q];
  }
}

// A k16 step's fragment before its multiplies (packed formats; bf16 codes are the fragment):
// tiny values and the multipliers of rows g, g + 8.
struct StepTiny {
  uint32_t t[4], m;  // m: [row g | row g + 8] multipliers
};
template <WeightFormat F>
__device__ __forceinline__ void unpack_step(const StepCodes<F>& c, const StepScales<F>& sc, int q, StepTiny& u) {
  tiny_values<F>(c.w, u.t);
  if constexpr (F == WeightFormat::kNvfp4) {
    // Block q's scales of rows g and g + 8 in one bf16x2 (nv_tiny_pair), each splatted by the
    // multiplies that read it (mul_half, no instruction): 2-2.5% off the NVFP4
    // prefill GEMMs at 512 and 2048 tokens on the H100 against byte permutes. MX scales are
    // paired the same way, once per k-block (load_step_scales; made per step it was 1-2.5% slower).
    const uint32_t words[2] = {sc.s[0], sc.s[1]};
    u.m = nv_scale_pair(nv_tiny_pair(words, q));
  } else {
    u.m = sc.s[q >> 1];  // the k-block's multiplier pairs (load_step_scales); steps 0, 1 are kb0
  }
}
// The A fragment (the same values as fragment<F, true>): one exact bf16x2 multiply per register,
// rows g (registers 0, 2) and g + 8 (1, 3).
__device__ __forceinline__ void scale_step(const StepTiny& u, uint32_t (&a)[4]) { mul_pair(u.t, u.m, a); }

}  // namespace moekit::sm90
