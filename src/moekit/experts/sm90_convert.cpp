// The `convert` step of the SM90 backends: logical weight rows -> the kernel layout of
// sm90_moe_gemm.cuh. Runs once at load, multithreaded over (expert, group).
#include <sys/mman.h>

#include <cstdint>
#include <cstring>

#include "moekit/common/bf16.h"
#include "moekit/common/thread_pool.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/formats/kernel_pack.h"

namespace moekit::sm90 {

namespace {

// Fragment element i (0..7) of lane l in k16 step q of an atom: (row in subtile, k in atom).
// The m16n8k16 A fragment: a0,a1 (g, 2c..2c+1), a2,a3 (g+8, 2c..), a4,a5 (g, 2c+8..),
// a6,a7 (g+8, 2c+8..), with g = l/4, c = l%4.
inline void frag_pos(int l, int q, int i, int* row, int* k) {
  const int g = l / 4, c = l % 4;
  *row = g + ((i >> 1) & 1) * 8;
  *k = q * 16 + 2 * c + (i & 1) + ((i >> 2) & 1) * 8;
}

// Reads code i (element k) of a logical row in the checkpoint's byte order.
inline uint8_t fp4_code(const uint8_t* row_codes, int64_t k) {
  const uint8_t b = row_codes[k / 2];
  return (k & 1) ? uint8_t(b >> 4) : uint8_t(b & 0xf);
}

// The E2M1 word of one (lane, k16 step) from its four code bytes: b0 = (c0, c1), b1 = (c2, c3),
// b2 = (c4, c5), b3 = (c6, c7), low nibble first. pack_e2m1x8 ORs one contribution per code, so
// the word is the OR of four table entries (tables made from pack_e2m1x8 itself).
struct Fp4Tables {
  uint32_t t[4][256];
  Fp4Tables() {
    for (int p = 0; p < 4; ++p)
      for (int b = 0; b < 256; ++b) {
        uint8_t c[8] = {};
        c[2 * p] = uint8_t(b & 15);
        c[2 * p + 1] = uint8_t(b >> 4);
        t[p][b] = pack_e2m1x8(c);
      }
  }
};

// Codes of one atom (16 rows x 64 K) in the kernels' order, element by element: the definition.
// rows[r]: logical row r of the subtile, or null for padding rows.
void atom_by_element(WeightFormat f, const uint8_t* const rows[16], int64_t kb, int64_t K, uint8_t* atom) {
  for (int l = 0; l < 32; ++l)
    for (int q = 0; q < 4; ++q) {
      uint8_t c[8];
      uint16_t bf[8];
      for (int i = 0; i < 8; ++i) {
        int r, kk;
        frag_pos(l, q, i, &r, &kk);
        const int64_t k = kb * kKBlock + kk;
        const bool live = rows[r] && k < K;
        switch (f) {
          case WeightFormat::kMxfp4:
          case WeightFormat::kNvfp4: c[i] = live ? fp4_code(rows[r], k) : 0; break;
          case WeightFormat::kMxfp8: c[i] = live ? rows[r][k] : 0; break;
          case WeightFormat::kBf16:
            bf[i] = live ? uint16_t(rows[r][2 * k] | (rows[r][2 * k + 1] << 8)) : 0;
            break;
          case WeightFormat::kFp8: break;  // not an SM90 format: the backends refuse it
        }
      }
      // Byte offsets inside the atom: each 16-byte shared-memory load of a warp reads
      // 32 consecutive 16-byte pieces (conflict-free).
      if (f == WeightFormat::kMxfp4 || f == WeightFormat::kNvfp4) {
        const uint32_t word = pack_e2m1x8(c);
        std::memcpy(atom + l * 16 + q * 4, &word, 4);
      } else if (f == WeightFormat::kMxfp8) {
        const uint32_t w0 = pack_e4m3x4(c), w1 = pack_e4m3x4(c + 4);
        uint8_t* p = atom + (q / 2) * 512 + l * 16 + (q % 2) * 8;
        std::memcpy(p, &w0, 4);
        std::memcpy(p + 4, &w1, 4);
      } else {
        std::memcpy(atom + q * 512 + l * 16, bf, 16);
      }
    }
}

// The same atom when all its 64 K lie inside the rows (rows[r] never null: padding rows point
// at zeros), reading the fragment's element pairs straight from the row bytes. frag_pos puts
// elements 2j and 2j+1 at adjacent k of one row: (c0 c1) row g at k, (c2 c3) row g+8 at k,
// (c4 c5) row g at k+8, (c6 c7) row g+8 at k+8, with g = l/4, k = kb*64 + q*16 + 2(l%4).
void atom_fast(WeightFormat f, const uint8_t* const rows[16], int64_t kb, const Fp4Tables& t4, uint8_t* atom) {
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4;
    const uint8_t *lo = rows[g], *hi = rows[g + 8];
    for (int q = 0; q < 4; ++q) {
      const int64_t k = kb * kKBlock + q * 16 + 2 * (l % 4);
      if (f == WeightFormat::kMxfp4 || f == WeightFormat::kNvfp4) {
        const uint32_t word = t4.t[0][lo[k / 2]] | t4.t[1][hi[k / 2]] | t4.t[2][lo[k / 2 + 4]] | t4.t[3][hi[k / 2 + 4]];
        std::memcpy(atom + l * 16 + q * 4, &word, 4);
      } else if (f == WeightFormat::kMxfp8) {
        const uint8_t c0[4] = {lo[k], lo[k + 1], hi[k], hi[k + 1]};
        const uint8_t c1[4] = {lo[k + 8], lo[k + 9], hi[k + 8], hi[k + 9]};
        const uint32_t w0 = pack_e4m3x4(c0), w1 = pack_e4m3x4(c1);
        uint8_t* p = atom + (q / 2) * 512 + l * 16 + (q % 2) * 8;
        std::memcpy(p, &w0, 4);
        std::memcpy(p + 4, &w1, 4);
      } else {  // bf16: four pairs of 4 bytes
        uint8_t* p = atom + q * 512 + l * 16;
        std::memcpy(p, lo + 2 * k, 4);
        std::memcpy(p + 4, hi + 2 * k, 4);
        std::memcpy(p + 8, lo + 2 * (k + 8), 4);
        std::memcpy(p + 12, hi + 2 * (k + 8), 4);
      }
    }
  }
}

// v = n zero bytes; a large buffer asks for 2 MiB pages first (page faults of 4 KiB pages were
// a third of converting a GPT-OSS-120B layer, docs/perf/notebook.md "Checkpoints").
void zeroed(std::vector<uint8_t>& v, size_t n) {
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  v.reserve(n);
  const uintptr_t b = (reinterpret_cast<uintptr_t>(v.data()) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(v.data()) + n) & ~(kHuge - 1);
  if (e > b) madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);  // advice only
  v.assign(n, 0);
}

// row_of(R) -> logical row or -1
template <class RowOf>
ConvertedMatrix convert(const WeightMatrix& w, int64_t N_pad, int64_t K_pad, RowOf row_of,
                        const std::vector<float>& bias_logical /* [E, N] or empty */, bool fast) {
  ConvertedMatrix out;
  LayoutDims& d = out.dims;
  d.format = w.format;
  d.E = w.E;
  d.N_pad = N_pad;
  d.K_pad = K_pad;
  zeroed(out.codes, size_t(d.code_bytes()));
  zeroed(out.scales, size_t(d.scale_bytes()));
  const WeightFormat f = w.format;
  const int acb = atom_code_bytes(f), asb = atom_scale_bytes(f);
  const int64_t K = w.K;
  static const Fp4Tables t4;
  const std::vector<uint8_t> zeros(size_t(w.code_row), 0);  // padding rows on the fast path
  // Zero scales for padding: E8M0 byte 0 would be 2^-127, fine with zero codes; E4M3 0 is 0.
  ThreadPool::global().parallel_for(d.E * d.groups(), [&](int64_t eg) {
    const int64_t e = eg / d.groups(), g = eg % d.groups();
    // The group's 64 rows: logical rows (null for padding) and their scales.
    const uint8_t* rows[kGroupRows];
    const uint8_t* zrows[kGroupRows];
    const uint8_t* srows[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      const int64_t lr = row_of(g * kGroupRows + r);
      rows[r] = lr >= 0 ? w.row_codes(e, lr) : nullptr;
      zrows[r] = rows[r] ? rows[r] : zeros.data();
      srows[r] = lr >= 0 && w.scales ? w.row_scales(e, lr) : nullptr;
    }
    for (int64_t kb = 0; kb < d.kblocks(); ++kb) {
      uint8_t* cdst = out.codes.data() + d.code_offset(e, g, kb);
      uint8_t* sdst = out.scales.data() + d.scale_offset(e, g, kb);
      const bool inside = (kb + 1) * kKBlock <= K && f != WeightFormat::kFp8;
      for (int s = 0; s < kSubtiles; ++s) {
        uint8_t* atom = cdst + s * acb;
        if (fast && inside) {
          atom_fast(f, zrows + s * kSubtileRows, kb, t4, atom);
        } else {
          atom_by_element(f, rows + s * kSubtileRows, kb, K, atom);
        }
        // Scales: per g (8 of them) the bytes a thread needs, rows g and g+8.
        //   MX (block 32):  [g][row g kb0, row g kb1, row g+8 kb0, row g+8 kb1]
        //   NV (block 16):  [g] two E4M3 words (pack_e4m3x4) of [row g b, row g+8 b, row g b+1,
        //                   row g+8 b+1], b = 0, 2 (sm90_fragment.cuh nv_tiny_pair)
        if (asb > 0) {
          const uint8_t* const* sr = srows + s * kSubtileRows;
          uint8_t* sat = sdst + s * asb;
          const int block = format_block(f), nb = kKBlock / block;
          auto scale = [&](int r, int b) -> uint8_t {
            const int64_t k = kb * kKBlock + b * block;
            return sr[r] && k < K ? sr[r][k / block] : 0;
          };
          for (int gi = 0; gi < 8; ++gi) {
            if (f == WeightFormat::kNvfp4) {
              for (int b = 0; b < nb; b += 2) {
                const uint8_t c[4] = {scale(gi, b), scale(gi + 8, b), scale(gi, b + 1), scale(gi + 8, b + 1)};
                const uint32_t word = pack_e4m3x4(c);
                std::memcpy(sat + gi * (2 * nb) + 2 * b, &word, 4);
              }
            } else {
              for (int half = 0; half < 2; ++half)
                for (int b = 0; b < nb; ++b) sat[gi * (2 * nb) + half * nb + b] = scale(gi + half * 8, b);
            }
          }
        }
      }
    }
  });
  // Epilogue rows: scale (nvfp4) and bias.
  const bool nv = f == WeightFormat::kNvfp4;
  if (nv) out.row_scale.assign(size_t(d.E * N_pad), 0.0f);
  if (!bias_logical.empty()) out.bias.assign(size_t(d.E * N_pad), 0.0f);
  for (int64_t e = 0; e < d.E; ++e)
    for (int64_t R = 0; R < N_pad; ++R) {
      const int64_t lr = row_of(R);
      if (lr < 0) continue;
      // The kernel multiplies the 2^-126 "tiny" E2M1 form by bf16(s * 2^119), which yields
      // q * s * 2^-7 exactly; the epilogue scale carries the 2^7 back with 1/g.
      if (nv) out.row_scale[size_t(e * N_pad + R)] = 128.0f * w.row_scale_2(e, lr);
      if (!bias_logical.empty()) out.bias[size_t(e * N_pad + R)] = bias_logical[size_t(e * w.N + lr)];
    }
  const uint32_t smax = mx_single_multiply_max(f == WeightFormat::kMxfp8 ? kE4M3TinyExp : kE2M1TinyExp);
  if (f == WeightFormat::kMxfp4 || f == WeightFormat::kMxfp8)
    for (uint8_t s : out.scales) out.single_multiply = out.single_multiply && s <= smax;
  return out;
}

}  // namespace

ConvertedMatrix convert_w13(const LayerWeights& m, bool fast) {
  const int64_t I = m.cfg.intermediate;
  const int64_t I_pad = pad_to(I, kAlign), H_pad = pad_to(m.cfg.hidden, kAlign);
  return convert(m.w13, 2 * I_pad, H_pad, [I](int64_t R) { return w13_logical_row(R, I); }, m.b13, fast);
}

ConvertedMatrix convert_w2(const LayerWeights& m, bool fast) {
  const int64_t H = m.cfg.hidden;
  const int64_t I_pad = pad_to(m.cfg.intermediate, kAlign), H_pad = pad_to(H, kAlign);
  return convert(m.w2, H_pad, I_pad, [H](int64_t R) { return R < H ? R : -1; }, m.b2, fast);
}

}  // namespace moekit::sm90
