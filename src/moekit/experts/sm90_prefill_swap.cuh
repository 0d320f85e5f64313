// moekit/experts/sm90_prefill_swap.cuh — the SM90 prefill GEMM with swapped operands: tokens as
// A (wgmma M = 64 rows per consumer warpgroup), the weights as B (N = 256 rows), both from
// shared memory; the weights dequantized into shared memory by a warpgroup of their own.
//
// Contract: exactly the prefill kernel's (sm90_prefill_gemm.cuh: PrefillArgs, the same weights
// in the decode layout, the same epilogues, rows at or past an expert's count never read as data
// nor written, no atomics on outputs) and the same bits: the same bf16 fragments (the step
// helpers of sm90_fragment.cuh), one fp32 accumulator chain per output over the k16 steps in the
// same order, the same epilogue expressions. That the tensor core gives the same sums with the
// operands' roles swapped was measured (bench/swap_ab_probe.cu `check`, docs/PERFORMANCE.md).
//
// Why: in the prefill kernel the warps that issue the wgmmas also dequantize (unpack + scale
// multiply) the weights in registers, and that bounds it from 512 to 2048 tokens
// (docs/PERFORMANCE.md, twenty-ninth section: ~50% tensor time in the k loop). Here a writer
// warpgroup does nothing else: per k-block it turns the tile's codes into a 256-row bf16 B tile
// (stmatrix of the same fragments the prefill kernel feeds its wgmmas, into the 128-byte
// swizzle), and the consumers issue m64n256k16 wgmmas only. Cost: the B tile passes through
// shared memory (written once, read once per consumer warpgroup), and a token tile is 64 rows
// (wgmma M), so an expert's last tile multiplies up to 63 rows of nothing.
//
// Tiles: (active expert, weight tile of kTileGroups groups = 256 rows, token tile of up to
// kTileTokens = 64 kCWG rows), token tile fastest. Consumer warpgroup w multiplies the token rows
// [64 w, 64 w + 64) of the tile against the whole B tile; a warpgroup without rows only releases
// the stages. Persistent CTAs claim tiles from a global counter, as the prefill kernel's do.
//
// Roles (384 threads: at 512, ptxas gets 128 registers a thread, too few for a wgmma with 128
// accumulators, C7602; setmaxnreg within the launch's 3 x 168):
//   consumers (warpgroups 0..kCWG-1): 128 fp32 accumulators, four wgmmas per k-block as one
//     commit group, one k-block in flight; a stage is released once its wgmmas retired.
//   producer (warp 0 of warpgroup kCWG; lane 0 issues): the tile groups' codes and scales, two
//     k-blocks per 1-D bulk copy, into a ring of code stages.
//   writers (the other warps of warpgroups kCWG..2: 3 with kCWG = 2, 7 with kCWG = 1): warp w
//     dequantizes atoms w, w + kWriterWarps, ... of the weight tile (16 rows each), each k16
//     step's fragment stored with stmatrix.x4 into the stage's B tile, then fence.proxy.async and
//     an arrival on the stage's full barrier; one writer also issues the stage's token rows
//     (tensor copies, 64- and 16-row boxes, 128-byte swizzle) as the stage becomes free.
// Barriers (prefill::Ring's layout, kstages = A + B stages + code stages, cwg = the roles that
// release tile slots): full / empty of the A + B stages (full: the token rows' bytes and every
// writer thread; empty: every consumer thread), full / empty of the code stages (empty: every
// writer thread), tile_empty per consumer warpgroup and one for the writers, scratch, tile_full
// (32 producer lanes).
//
// Measured (docs/PERFORMANCE.md, thirtieth section): correct and bit-identical to the prefill
// kernel on every format, but 1.3-1.7x slower at 512-8192 tokens: the writers, not the tensor
// core or the copies, bound it (with the wgmmas removed it still takes longer at 512 tokens than
// the prefill kernel does whole). Experiment switches (timing only): MOEKIT_SWAP_CWG (1 or 2),
// MOEKIT_SWAP_STAGES (A + B stages of the 4-bit formats), MOEKIT_SWAP_WAIT_NS (the waits' suspend
// hint), MOEKIT_SWAP_X (1: no unpack, 2: no writer work, 3: no wgmma; results wrong).
#pragma once

#include "moekit/common/wgmma_sm90_ss_ops.cuh"
#include "moekit/experts/sm90_prefill_gemm.cuh"

#ifndef MOEKIT_SWAP_X
#define MOEKIT_SWAP_X \
  0  // timing experiments (results wrong): 1 no unpack, 2 no writer work, 3 no wgmma
#endif

namespace moekit::sm90::prefill::swap {

#ifdef MOEKIT_SWAP_WAIT_NS  // experiment: the waits' suspend hint
__device__ __forceinline__ void swait(const Ring&, uint32_t bar, uint32_t parity, int) {
  ptx::mbar_wait<MOEKIT_SWAP_WAIT_NS>(bar, parity, trap::kWaitLimitNs, [] { __trap(); });
}
#else
__device__ __forceinline__ void swait(const Ring& ring, uint32_t bar, uint32_t parity, int site) {
  wait_bar(ring, bar, parity, site);
}
#endif

constexpr int kTokenRows = 64;  // a consumer warpgroup's token rows (wgmma M)
#ifndef MOEKIT_SWAP_CWG
#define MOEKIT_SWAP_CWG 2  // consumer warpgroups (experiment: 1 or 2)
#endif
constexpr int kCWG = MOEKIT_SWAP_CWG;                      // consumer warpgroups
constexpr int kTileTokens = kCWG * kTokenRows;             // token rows per tile at most
constexpr int kTileGroups = 4;                             // groups per weight tile
constexpr int kTileWeightRows = kTileGroups * kGroupRows;  // 256: wgmma N
// Warpgroups kCWG..2: their first warp the producer, the others the writers (a kernel of 512
// threads would leave ptxas 128 registers per thread, too few for a wgmma with 128 accumulators:
// C7602).
constexpr int kDataWG = kCWG;
constexpr int kWriterWarps = 4 * (3 - kCWG) - 1;
constexpr int kWriterThreads = 32 * kWriterWarps;
constexpr int kRoles = kCWG + 1;  // tile slot releases: consumer warpgroups, writers
constexpr int kThreads = kWG * 3;
// setmaxnreg moves registers between the warpgroups of the CTA's launch allocation (65536 / 384
// per thread, rounded down to 8: 168); asking for more than that in all makes the last
// setmaxnreg.inc wait forever (a whole consumer warpgroup never starts).
constexpr int kConsumerRegs = kCWG == 2 ? 200 : 216, kDataRegs = kCWG == 2 ? 104 : 144;
static_assert(kCWG * kConsumerRegs + (3 - kCWG) * kDataRegs <= 3 * (65536 / (kWG * 3) / 8 * 8),
              "setmaxnreg over the CTA's registers");
constexpr int kTileAtoms = kTileWeightRows / kSubtileRows;                       // 16
constexpr int kAtomsPerWriter = (kTileAtoms + kWriterWarps - 1) / kWriterWarps;  // 6
constexpr int kMaxStages = 4;      // A + B stages at most
constexpr int kMaxCodeStages = 8;  // the weights' prefetch depth (k-blocks)
constexpr uint32_t kATileBytes = kTokenRows * kTokenRowBytes;       // 8 KB
constexpr uint32_t kBTileBytes = kTileWeightRows * kTokenRowBytes;  // 32 KB of bf16
constexpr uint32_t kStageBytes = kCWG * kATileBytes + kBTileBytes;  // 48 KB

template <WeightFormat F>
struct STraits {
  static constexpr int kCodeSlot = kSubtiles * atom_code_bytes(F);  // one group's k-block
  static constexpr int kScaleSlot = kSubtiles * atom_scale_bytes(F);
  // A code stage holds kKbPerCode k-blocks of each of the tile's groups: one bulk copy per group
  // brings them all (a group's k-blocks are contiguous in the layout), so the producer issues half
  // the copies (one warp issuing eight 1-D copies a k-block bounded the kernel: ~1400 cycles a
  // k-block with the writers' and the consumers' work removed). BF16: one (its stages are 32 KB).
  static constexpr int kKbPerCode = F == WeightFormat::kBf16 ? 1 : 2;
  static constexpr int kGroupCodeBytes = kKbPerCode * kCodeSlot,
                       kGroupScaleBytes = kKbPerCode * kScaleSlot;
  static constexpr int kCodeStageBytes =
      (kTileGroups * (kGroupCodeBytes + kGroupScaleBytes) + 127) / 128 * 128;
  using Slot = TileSlot<kTileTokens, kTileWeightRows>;
  using Scan = cub::BlockScan<int, kThreads>;
  // A + B stages (four measured no faster than three on MXFP4, with two code stages).
#ifndef MOEKIT_SWAP_STAGES
#define MOEKIT_SWAP_STAGES 3
#endif
  static constexpr int kStages =
      F == WeightFormat::kMxfp4 || F == WeightFormat::kNvfp4 ? MOEKIT_SWAP_STAGES : 3;
  static constexpr int kStaticSmem =
      4 * (kMaxExperts + 1) + 2 * int(sizeof(Slot)) + ptx::kBarrierLine +
      8 * (barrier_line_words(kMaxStages + kMaxCodeStages, kRoles) + 1) +
      int(sizeof(typename Scan::TempStorage)) + 256;
  static constexpr int kCodeStagesFit =
      (kSmemLimit - kStaticSmem - 1024 - kStages * int(kStageBytes)) / kCodeStageBytes;
  static constexpr int kCodeStages =
      kCodeStagesFit < kMaxCodeStages ? kCodeStagesFit : kMaxCodeStages;
  static_assert(kCodeStages >= 2, "code ring too short");
  static constexpr int kRingStages = kStages + kCodeStages;
  static constexpr int kDynSmem = kStages * int(kStageBytes) + kCodeStages * kCodeStageBytes + 1024;
  MOEKIT_HD static constexpr int code_off(int j) {
    return j * kGroupCodeBytes;
  }
  MOEKIT_HD static constexpr int scale_off(int j) {
    return kTileGroups * kGroupCodeBytes + j * kGroupScaleBytes;
  }
  // Atom a (subtile a % 4 of group a / 4) of the stage's k-block `sub`.
  MOEKIT_HD static constexpr int atom_code(int a, int sub) {
    return code_off(a / kSubtiles) + sub * kCodeSlot + (a % kSubtiles) * atom_code_bytes(F);
  }
  MOEKIT_HD static constexpr int atom_scale(int a, int sub) {
    return scale_off(a / kSubtiles) + sub * kScaleSlot + (a % kSubtiles) * atom_scale_bytes(F);
  }
};

// A stage's A tile of consumer warpgroup w, its B tile; a code stage.
__device__ __forceinline__ uint32_t a_tile(uint32_t stages0, int s, int w) {
  return stages0 + uint32_t(s) * kStageBytes + uint32_t(w) * kATileBytes;
}
__device__ __forceinline__ uint32_t b_tile(uint32_t stages0, int s) {
  return stages0 + uint32_t(s) * kStageBytes + uint32_t(kCWG) * kATileBytes;
}
template <WeightFormat F>
__device__ __forceinline__ uint32_t code_stage(uint32_t stages0, int c) {
  return stages0 + uint32_t(STraits<F>::kStages) * kStageBytes +
         uint32_t(c) * uint32_t(STraits<F>::kCodeStageBytes);
}

// Four 8 x 8 bf16 matrices from the mma fragment layout (register i: matrix i, row lane / 4,
// columns 2 (lane % 4) and the next) to shared memory, lane l giving the address of row l % 8 of
// matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&v)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}
// Generic-proxy writes to shared memory made visible to the async proxy (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void st_global_if(uint32_t* p, uint32_t v, bool pred) {
  if (pred) *p = v;
}

// ---- writer: one tile ---------------------------------------------------------------------------
// Writer warp wr dequantizes atoms wr, wr + 3, ..., wr + 12 of the tile (atom a: rows 16 a .. 16 a
// + 15 of the 256, i.e. subtile a % 4 of group a / 4; its codes and scales a whole atom apart in
// the code stage), warp 0 also atom 15, into every k-block's B tile: step q's fragment (rows g,
// g + 8; columns 16 q + 2 c, + 8) stored as four 8 x 8 matrices: matrix m = rows 8 (m & 1) +
// 0..7, k chunk 2 q + m / 2.
// Every atom is written, also those of groups past the tile's (the last weight tile of a matrix):
// their codes are whatever the code stage held, and their B rows reach only accumulator columns
// that are never stored. Without a branch per atom, ptxas interleaves the atoms' independent
// chains (with one, each fragment's unpack, multiplies and store ran one after another: ~1800
// cycles a k-block).
template <WeightFormat F, int kAtoms>
__device__ __forceinline__ void write_atoms(uint32_t cs, int sub, uint32_t b, uint32_t code_lane,
                                            uint32_t scale_lane, int first, int half, int i) {
  using S = STraits<F>;
  auto atom = [&](int j) { return first + kWriterWarps * j; };
  auto codes = [&](int j) { return cs + code_lane + uint32_t(S::atom_code(atom(j), sub)); };
  StepScales<F> sc[kAtoms];
  AtomRegs<F> blk[kAtoms];
  // Every atom's scales and codes first (independent loads in flight together), then each step as
  // the prefill kernel's step_unpack / step_fragment make it: the same bf16 values.
#pragma unroll
  for (int j = 0; j < kAtoms; ++j) {
    load_step_scales<F>(cs + scale_lane + uint32_t(S::atom_scale(atom(j), sub)), sc[j]);
    if constexpr (F != WeightFormat::kBf16) load_lane_words<F>(codes(j), blk[j]);
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t chunk = uint32_t(((2 * q + half) ^ i) * 16);
#pragma unroll
    for (int j = 0; j < kAtoms; ++j) {
      uint32_t v[4];
#if MOEKIT_SWAP_X == 1
      if constexpr (true) {
        v[0] = blk[j].w[0] ^ q, v[1] = blk[j].w[1], v[2] = blk[j].w[2 % (sizeof(blk[j].w) / 4)],
        v[3] = sc[j].s[0];
      } else
#endif
          if constexpr (F == WeightFormat::kBf16) {
        step_fragment<F>(codes(j), q, StepTiny{}, v);
      } else {
        StepCodes<F> c;
        StepTiny u;
        block_step_codes<F>(blk[j], q, c);
        unpack_step<F>(c, sc[j], q, u);
        scale_step(u, v);
      }
      stmatrix_x4(b + uint32_t(atom(j) * kSubtileRows) * kTokenRowBytes + chunk, v);
    }
  }
}

template <WeightFormat F>
__device__ __forceinline__ void writer_tile(const PrefillArgs& p, const Ring& ring,
                                            uint32_t stages0, const TileDesc& d, int& stage,
                                            uint32_t& phase, int& cstage, uint32_t& cphase, int KB,
                                            int wr, int lane) {
  using S = STraits<F>;
  constexpr int kCommon = kTileAtoms / kWriterWarps;           // 5 atoms for every warp
  constexpr int kExtra = kTileAtoms - kCommon * kWriterWarps;  // then 1 for warp 0
  const int i = lane & 7, m = lane >> 3;
  // This lane's matrix row in the B tile for atom 0 and its chunk's half (m / 2); the swizzle
  // XORs the chunk with the row % 8 = i.
  const uint32_t row_off = uint32_t(i + 8 * (m & 1)) * kTokenRowBytes;
  const int half = m >> 1;
  const uint32_t code_lane = lane_code_offset(lane), scale_lane = lane_scale_offset<F>(lane);
  // The token rows [row0, row0 + nrows) (n rounded up to 16) as 64-row boxes, then 16-row ones,
  // each at its row's place in the stage's A tiles (adjacent: row r at r * 128 bytes). A tile's
  // rows past nrows keep older rows: multiplied, never stored.
  const int nrows = (d.n + 15) / 16 * 16;
  const TokenBoxes boxes(nrows);
  const uint64_t map = reinterpret_cast<uint64_t>(&p.in_map),
                 map_big = reinterpret_cast<uint64_t>(&p.in_map_big);
  const bool issuer = wr == kWriterWarps - 1 && lane == 0;  // a warp with kCommon atoms
  for (int kb = 0; kb < KB; ++kb) {
    const int sub = kb % S::kKbPerCode;  // the k-block's place in its code stage
    swait(ring, ring.empty(stage), phase ^ 1, trap::kPrefillEmpty);
    if (issuer) {
      // The stage's token rows, issued by the first writer as the stage becomes free (the
      // producer streams the codes, up to kCodeStages k-blocks ahead).
      const uint32_t bar = ring.full(stage);
      ptx::mbar_arrive_expect_tx(bar, uint32_t(nrows) * kTokenRowBytes);
      for (int c = 0; c < boxes.nbox; ++c) {
        const int r = boxes.first_row(c);
        tma_load_2d(a_tile(stages0, stage, 0) + uint32_t(r) * kTokenRowBytes,
                    boxes.big(c) ? map_big : map, kb * kKBlock, d.row0 + r, bar);
      }
    }
    if (sub == 0) swait(ring, ring.full(S::kStages + cstage), cphase, trap::kPrefillFull);
    const uint32_t cs = code_stage<F>(stages0, cstage);
    const uint32_t b = b_tile(stages0, stage) + row_off;
#if MOEKIT_SWAP_X != 2
    write_atoms<F, kCommon>(cs, sub, b, code_lane, scale_lane, wr, half, i);
    if (wr < kExtra)
      write_atoms<F, 1>(cs, sub, b, code_lane, scale_lane, kCommon * kWriterWarps + wr, half, i);
#endif
    // The code stage's last k-block read (the loads' values are used above): the stage is free.
    // The B tile's stores are made visible to the wgmmas' reads before the arrival on the stage's
    // full barrier.
    const bool last = sub == S::kKbPerCode - 1 || kb == KB - 1;
    if (last) ptx::mbar_arrive(ring.empty(S::kStages + cstage));
    fence_proxy_async_shared();
    ptx::mbar_arrive(ring.full(stage));
    if (last && ++cstage == S::kCodeStages) cstage = 0, cphase ^= 1;
    if (++stage == S::kStages) stage = 0, phase ^= 1;
  }
}

// ---- consumers: one tile
// ------------------------------------------------------------------------- acc[i]: token row 16
// warp + g + 8 ((i / 2) % 2) of this warpgroup's 64, weight row (B column) 8 (i / 4) + 2 c + i % 2
// of the tile's 256. One k-block: its four wgmmas as one commit group (the tile's first overwrites
// the accumulators: scale-d 0, where zeroing them with moves made ptxas serialize every wgmma,
// C7515), then the previous k-block's group retired and its stage released (the tile's first
// k-block releases nothing: its arrival goes to the scratch barrier, without a branch).
template <WeightFormat F, bool kFirst>
__device__ __forceinline__ void consumer_kblock(const Ring& ring, uint32_t stages0, int& stage,
                                                uint32_t& phase, int& prev, int wg,
                                                float (&acc)[128]) {
  swait(ring, ring.full(stage), phase, trap::kPrefillFull);
  const uint64_t da = ptx::smem_desc_k128(a_tile(stages0, stage, wg));
  const uint64_t db = ptx::smem_desc_k128(b_tile(stages0, stage));
  ptx::wgmma_fence();
#if MOEKIT_SWAP_X != 3
  ptx::wgmma_m64n256k16_ss<kFirst ? 0 : 1>(acc, da, db);
#pragma unroll
  for (int q = 1; q < 4; ++q) ptx::wgmma_m64n256k16_ss<1>(acc, da + 2 * q, db + 2 * q);
#else
  if (kFirst)
    for (int i = 0; i < 128; ++i) acc[i] = float(da & 7);
#endif
  ptx::wgmma_commit();
  ptx::wgmma_wait<1>();
  ptx::mbar_arrive(kFirst ? ring.scratch() : ring.empty(prev));
  prev = stage;
  if (++stage == STraits<F>::kStages) stage = 0, phase ^= 1;
}

template <WeightFormat F>
__device__ __forceinline__ void consumer_mainloop(const Ring& ring, uint32_t stages0, int& stage,
                                                  uint32_t& phase, int KB, int wg,
                                                  float (&acc)[128]) {
  int prev = stage;
  consumer_kblock<F, true>(ring, stages0, stage, phase, prev, wg, acc);
  for (int kb = 1; kb < KB; ++kb)
    consumer_kblock<F, false>(ring, stages0, stage, phase, prev, wg, acc);
  ptx::wgmma_wait<0>();
  ptx::mbar_arrive(ring.empty(prev));
#pragma unroll
  for (int i = 0; i < 128; ++i) ptx::reg_fence(acc[i]);
}

// GEMM1: the gate rows of subtile s are its rows 0..7, the up rows 8..15 (the layout's pairing,
// as in the prefill kernel's epilogue): B columns 16 s + 2 c (+1) and 16 s + 8 + 2 c (+1) are
// accumulators 8 s + {0, 1} and 8 s + {4, 5} (token row g; + 2 for g + 8), output columns
// g0 * 32 + 8 s + 2 c (+1): one bf16 pair per store.
template <Activation A, class Slot>
__device__ __forceinline__ void epilogue_gemm1(const PrefillArgs& p, const Slot& ts, int wg, int wi,
                                               int lane, const float (&acc)[128]) {
  const TileDesc& d = ts.d;
  const int g = lane >> 2, c = lane & 3;
  const int tr = wg * kTokenRows + wi * 16 + g;  // the tile's token row of accumulators i % 4 < 2
  const bool ok0 = tr < d.n, ok1 = tr + 8 < d.n;
  const int64_t words = p.dims.N_pad / 4;  // 32-bit words per output row (N_pad / 2 bf16)
  uint32_t* o0 =
      reinterpret_cast<uint32_t*>(p.out_act) + int64_t(d.row0 + tr) * words + d.g0 * 16 + c;
  uint32_t* o1 = o0 + 8 * words;
#pragma unroll
  for (int s = 0; s < kTileWeightRows / 16; ++s) {
    const bool live = s / kSubtiles < d.ng;
    const int lg = 16 * s + 2 * c, lh = lg + 8;
    const float sg0 = ts.scale[lg], sg1 = ts.scale[lg + 1], sh0 = ts.scale[lh],
                sh1 = ts.scale[lh + 1];
    const float bg0 = ts.bias[lg], bg1 = ts.bias[lg + 1], bh0 = ts.bias[lh], bh1 = ts.bias[lh + 1];
    const float v00 = activation_of<A>(p.act, acc[8 * s] * sg0 + bg0, acc[8 * s + 4] * sh0 + bh0);
    const float v01 =
        activation_of<A>(p.act, acc[8 * s + 1] * sg1 + bg1, acc[8 * s + 5] * sh1 + bh1);
    const float v10 =
        activation_of<A>(p.act, acc[8 * s + 2] * sg0 + bg0, acc[8 * s + 6] * sh0 + bh0);
    const float v11 =
        activation_of<A>(p.act, acc[8 * s + 3] * sg1 + bg1, acc[8 * s + 7] * sh1 + bh1);
    const uint32_t w0 = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v00))) |
                        (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v01))) << 16);
    const uint32_t w1 = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v10))) |
                        (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v11))) << 16);
    st_global_if(o0 + 4 * s, w0, live && ok0);
    st_global_if(o1 + 4 * s, w1, live && ok1);
  }
}

// GEMM2: B column 8 j + 2 c (+1) is output column g0 * 64 + 8 j + 2 c (+1), times the token row's
// top-k weight.
template <class Slot>
__device__ __forceinline__ void epilogue_gemm2(const PrefillArgs& p, const Slot& ts, int wg, int wi,
                                               int lane, const float (&acc)[128]) {
  const TileDesc& d = ts.d;
  const int g = lane >> 2, c = lane & 3;
  const int tr = wg * kTokenRows + wi * 16 + g;
  const bool ok0 = tr < d.n, ok1 = tr + 8 < d.n;
  const int cols = int(p.out_cols);
  const int col0 = d.g0 * kGroupRows + 2 * c;
  float* o0 = p.out_f32 + int64_t(d.row0 + tr) * cols + col0;
  float* o1 = o0 + 8 * int64_t(cols);
  const float w0 = ts.w[tr], w1 = ts.w[tr + 8];
#pragma unroll
  for (int j = 0; j < kTileWeightRows / 8; ++j) {
    const int lr = 8 * j + 2 * c;
    const bool live = j / (kGroupRows / 8) < d.ng;
    const bool okc0 = live && col0 + 8 * j < cols, okc1 = live && col0 + 8 * j + 1 < cols;
    const float s0 = ts.scale[lr], s1 = ts.scale[lr + 1], b0 = ts.bias[lr], b1 = ts.bias[lr + 1];
    ptx::st_global_if(o0 + 8 * j, (acc[4 * j] * s0 + b0) * w0, ok0 && okc0);
    ptx::st_global_if(o0 + 8 * j + 1, (acc[4 * j + 1] * s1 + b1) * w0, ok0 && okc1);
    ptx::st_global_if(o1 + 8 * j, (acc[4 * j + 2] * s0 + b0) * w1, ok1 && okc0);
    ptx::st_global_if(o1 + 8 * j + 1, (acc[4 * j + 3] * s1 + b1) * w1, ok1 && okc1);
  }
}

template <class Slot>
__device__ __forceinline__ void consumer_epilogue(const PrefillArgs& p, const Slot& ts, int wg,
                                                  int wi, int lane, const float (&acc)[128]) {
  if (p.gemm2) {
    epilogue_gemm2(p, ts, wg, wi, lane, acc);
  } else {
    switch (p.act.kind) {
      case Activation::kSwigluOai:
        epilogue_gemm1<Activation::kSwigluOai>(p, ts, wg, wi, lane, acc);
        break;
      case Activation::kSiluClamped:
        epilogue_gemm1<Activation::kSiluClamped>(p, ts, wg, wi, lane, acc);
        break;
      default:
        epilogue_gemm1<Activation::kSilu>(p, ts, wg, wi, lane, acc);
        break;
    }
  }
}

// ---- the kernel
// ----------------------------------------------------------------------------------
template <WeightFormat F>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_swap_kernel(const __grid_constant__ PrefillArgs args) {
  using S = STraits<F>;
  constexpr int kRing = S::kRingStages;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_prefix[kMaxExperts + 1];
  __shared__ typename S::Slot s_tile[2];
  __shared__ alignas(ptx::kBarrierLine) uint64_t s_bars[barrier_line_words(kRing, kRoles) + 1];
  __shared__ int s_num_active;

  Ring ring;
  ring.bars = ptx::smem_addr(s_bars);
  const uint32_t stages0 = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  ring.stages0 = stages0;
  ring.kstages = kRing;
  ring.cwg = kRoles;
  ring.tiles = ptx::smem_addr(s_tile);
  ring.slot_bytes = uint32_t(sizeof(typename S::Slot));
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x) / kWG, 0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      ptx::mbar_init(ring.full(s),
                     1 + kWriterThreads);         // the token rows' bytes, every writer thread
      ptx::mbar_init(ring.empty(s), kCWG * kWG);  // every consumer thread
    }
    for (int c = 0; c < S::kCodeStages; ++c) {
      ptx::mbar_init(ring.full(S::kStages + c), 1);                // the producer's bytes
      ptx::mbar_init(ring.empty(S::kStages + c), kWriterThreads);  // every writer thread
    }
    for (int w = 0; w < kRoles;
         ++w) {  // every thread of consumer warpgroup w, or every writer thread
      ptx::mbar_init(ring.tile_empty(0, w), w < kCWG ? kWG : kWriterThreads);
      ptx::mbar_init(ring.tile_empty(1, w), w < kCWG ? kWG : kWriterThreads);
    }
    ptx::mbar_init(ring.scratch(), kCWG * kWG);
    ptx::mbar_init(ring.tile_full(0), 32);  // the producer warp's lanes
    ptx::mbar_init(ring.tile_full(1), 32);
    s_bars[barrier_line_words(kRing, kRoles)] = reinterpret_cast<uint64_t>(args.trap);
    ptx::fence_barrier_init();
  }

  ptx::grid_dependency_wait();
  const DeviceWork& work = args.work;
  if (threadIdx.x == 0) s_num_active = *work.num_active;
  __syncthreads();
  const int num_active = s_num_active;
  if (num_active == 0) {
    ptx::launch_dependents();
    ptx::mbar_inval_at_exit(ring.bars, barrier_count(kRing, kRoles));
    return;
  }
  const int G = int(args.dims.groups());
  const int weight_tiles = (G + kTileGroups - 1) / kTileGroups;
  {
    constexpr int kItems = (kMaxExperts + kThreads - 1) / kThreads;
    using Scan = typename S::Scan;
    __shared__ typename Scan::TempStorage scan_tmp;
    int v[kItems], x[kItems], total;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int a = threadIdx.x * kItems + i;
      const int c = a < num_active ? work.count[a] : 0;
      v[i] = c > 0 ? (c + kTileTokens - 1) / kTileTokens * weight_tiles : 0;
    }
    Scan(scan_tmp).ExclusiveSum(v, x, total);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int a = threadIdx.x * kItems + i;
      if (a < kMaxExperts) s_prefix[a] = x[i];
    }
    if (threadIdx.x == 0) s_prefix[kMaxExperts] = total;
    __syncthreads();
  }
  ptx::launch_dependents();
  const int total = s_prefix[kMaxExperts];
  const int KB = int(args.dims.kblocks());
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (wg >= kDataWG) {
    ptx::setmaxnreg_dec<kDataRegs>();  // one instruction for each whole warpgroup (.aligned)
    if (warp == 4 * kDataWG) {
      // ---------------- producer ----------------
      const bool lead = lane == 0;
      int cstage = 0;
      uint32_t cphase = 0;
      int t = blockIdx.x;
      const int P = int(gridDim.x);
      for (int m = 0;; ++m) {
        typename S::Slot& slot = s_tile[m & 1];
        for (int w = 0; w < kRoles; ++w)
          swait(ring, ring.tile_empty(m, w), ((m >> 1) & 1) ^ 1, trap::kPrefillTileEmpty);
        int claim = 0;
        if (lead) {
          TileDesc d{};
          d.t = t < total ? t : -1;
          if (t < total) {
            claim = P + atomicAdd(args.tile_counter, 1);
            int lo = 0, hi = num_active - 1;
            while (lo < hi) {
              const int mid = (lo + hi + 1) >> 1;
              if (s_prefix[mid] <= t)
                lo = mid;
              else
                hi = mid - 1;
            }
            const int count = work.count[lo];
            const int ntt = (count + kTileTokens - 1) / kTileTokens;
            const int local = t - s_prefix[lo];
            const int wt = local / ntt, tt = local - wt * ntt;  // token tile fastest
            d.expert = work.expert[lo];
            d.row0 = work.row_start[lo] + tt * kTileTokens;
            d.n = min(kTileTokens, count - tt * kTileTokens);
            d.nvar = 0;
            d.g0 = wt * kTileGroups;
            d.ng = min(kTileGroups, G - d.g0);
          }
          slot.d = d;
        }
        __syncwarp();
        TileDesc d = slot.d;
        d.t = __shfl_sync(0xffffffffu, d.t, 0);
        d.row0 = __shfl_sync(0xffffffffu, d.row0, 0);
        d.expert = __shfl_sync(0xffffffffu, d.expert, 0);
        d.g0 = __shfl_sync(0xffffffffu, d.g0, 0);
        d.ng = __shfl_sync(0xffffffffu, d.ng, 0);
        d.n = __shfl_sync(0xffffffffu, d.n, 0);
        if (d.t < 0) {
          ptx::mbar_arrive(ring.tile_full(m));
          break;
        }
        if (args.gemm2)
          for (int r = lane; r < d.n; r += 32)
            slot.w[r] = args.topk_weights[args.row_src[d.row0 + r]];
        {
          const int64_t base = int64_t(d.expert) * args.dims.N_pad + int64_t(d.g0) * kGroupRows;
          const int64_t live =
              min(int64_t(kTileWeightRows), args.dims.N_pad - int64_t(d.g0) * kGroupRows);
          for (int r = lane; r < kTileWeightRows; r += 32) {
            slot.scale[r] = args.row_scale && r < live ? args.row_scale[base + r] : 1.0f;
            slot.bias[r] = args.bias && r < live ? args.bias[base + r] : 0.0f;
          }
        }
        ptx::mbar_arrive(ring.tile_full(m));
        const int64_t grp = (int64_t(d.expert) * G + d.g0) * KB;
        const uint8_t* code_src = args.codes + grp * S::kCodeSlot;
        const uint8_t* scale_src = args.scales + (S::kScaleSlot > 0 ? grp * S::kScaleSlot : 0);
        for (int kb = 0; kb < KB; kb += S::kKbPerCode) {
          // kKbPerCode k-blocks of every group of the tile (fewer at the end of an odd KB).
          const int nkb = min(S::kKbPerCode, KB - kb);
          const uint32_t cbytes = uint32_t(nkb * S::kCodeSlot),
                         sbytes = uint32_t(nkb * S::kScaleSlot);
          swait(ring, ring.empty(S::kStages + cstage), cphase ^ 1, trap::kPrefillEmpty);
          if (lead) {
            const uint32_t cs = code_stage<F>(stages0, cstage);
            const uint32_t bar = ring.full(S::kStages + cstage);
            ptx::mbar_arrive_expect_tx(bar, uint32_t(d.ng) * (cbytes + sbytes));
            for (int j = 0; j < d.ng; ++j) {
              const int64_t skip = int64_t(j) * KB;  // group g0 + j's k-blocks follow group g0's
              bulk_g2s_plain(cs + S::code_off(j), code_src + skip * S::kCodeSlot, cbytes, bar);
              if constexpr (S::kScaleSlot > 0)
                bulk_g2s_plain(cs + S::scale_off(j), scale_src + skip * S::kScaleSlot, sbytes, bar);
            }
          }
          code_src += S::kKbPerCode * S::kCodeSlot;
          scale_src += S::kKbPerCode * S::kScaleSlot;
          if (++cstage == S::kCodeStages) cstage = 0, cphase ^= 1;
        }
        if (lead) t = claim;
      }
      if (lead) {
        ptx::fence_acq_rel_gpu();
        if (atomicAdd(args.exit_count, 1) == int(gridDim.x) - 1) {
          ptx::fence_acq_rel_gpu();
          *args.tile_counter = 0;
          *args.exit_count = 0;
        }
      }
    } else {
      // ---------------- writers ----------------
      const int wr = warp - 4 * kDataWG - 1;
      int stage = 0, cstage = 0;
      uint32_t phase = 0, cphase = 0;
      for (int m = 0;; ++m) {
        swait(ring, ring.tile_full(m), (m >> 1) & 1, trap::kPrefillTileFull);
        const typename S::Slot& ts = s_tile[m & 1];
        if (ts.d.t < 0) break;
        writer_tile<F>(args, ring, stages0, ts.d, stage, phase, cstage, cphase, KB, wr, lane);
        ptx::mbar_arrive(ring.tile_empty(m, kCWG));
      }
    }
  } else {
    // ---------------- consumers ----------------
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wi = warp & 3;
    int stage = 0;
    uint32_t phase = 0;
    for (int m = 0;; ++m) {
      swait(ring, ring.tile_full(m), (m >> 1) & 1, trap::kPrefillTileFull);
      const typename S::Slot& ts = s_tile[m & 1];
      if (ts.d.t < 0) break;
      if (ts.d.n <= wg * kTokenRows) {
        // No token rows of this tile are this warpgroup's: release the stages.
        for (int kb = 0; kb < KB; ++kb) {
          swait(ring, ring.full(stage), phase, trap::kPrefillFull);
          ptx::mbar_arrive(ring.empty(stage));
          if (++stage == S::kStages) stage = 0, phase ^= 1;
        }
      } else {
        float acc[128];
        consumer_mainloop<F>(ring, stages0, stage, phase, KB, wg, acc);
        consumer_epilogue(args, ts, wg, wi, lane, acc);
      }
      ptx::mbar_arrive(ring.tile_empty(m, wg));
    }
  }
  ptx::mbar_inval_at_exit(ring.bars, barrier_count(kRing, kRoles));
}

}  // namespace moekit::sm90::prefill::swap
