// moekit/experts/sm90_fp8_gemm.cuh — grouped MoE GEMM for SM90 with FP8 (E4M3) activations and
// MXFP4 / MXFP8 weights folded to E4M3 in registers: wgmma.m64nNk32.e4m3, four per 128-K group, fp32
// accumulators promoted per group (DeepGEMM's SM90 1d2d scheme, with a per-row weight scale).
//
// Contract (one launch per GEMM; the prefill kernel's, sm90_prefill_gemm.cuh, but for the inputs)
//   out[row, n] = epilogue( sum_g sx[row, g] * sw[e, n, g] * sum_{k in g} xq[row, k] * wq[e, n, k] )
//   g: 128-K groups. xq: E4M3 activation rows in expert order [rows, K_pad] (K_pad = the weights'
//   K_pad, a multiple of 64), each 16 consecutive K stored in the kernel K order fp8_kernel_k
//   (formats/fold_fp8.h): stored position j holds logical k fp8_kernel_k(j). sx: fp32 scales
//   [ceil(K_pad / 128), rows_pad] (group-major: a stage's scales of the tile's rows are one box of
//   a tensor map, kSxBox rows from row0 rounded down to a multiple of 4; rows_pad a multiple of 4,
//   fp8_scale_rows_pad). wq, sw: the MX weights in the decode kernel's
//   layout (sm90_moe_gemm.cuh; the one copy every SM90 kernel reads), folded per (row, 128-K group)
//   as formats/fold_fp8.h says: codes to E4M3 with the blocks' exponent differences, the group's
//   largest exponent as sw (MXFP4: exact within 14 binades of it, below that rounded once to
//   E4M3's grid; MXFP8: exact while the shifted codes stay on E4M3's grid, always for blocks at
//   the group's exponent, else rounded once).
//   A group with one k-block (K_pad % 128 = 64) multiplies zero A registers in its steps 2, 3 (the
//   stage's second code slot is not loaded then: stale bytes there could be E4M3 NaN codes).
//   Columns past K_pad in the last group (K_pad % 128 = 64) are the tensor map's zero fill.
//   Epilogues, biases, row scales, top-k weights, output buffers: the prefill kernel's
//   (prefill::tile_epilogue over PrefillArgs); GEMM1 writes bf16 (quantizing GEMM1's output for
//   GEMM2 is the caller's: another kernel, not here).
//   Every output element is computed whole by one CTA in a fixed k order: the bits do not depend
//   on the schedule.
//
// Tiles: token tiles of up to kRows = 128 rows (an expert's rows cut into 128-row tiles, the last
//   holding the rest), wgmma N = 16, 32, 64 or 128 (the smallest that holds the tile's rows; 128
//   runs as two halves of N = 64, one after the other, see Pipeline);
//   weight tiles of 2 groups of 64 rows, group g0 + w for consumer warpgroup w. Tiles are numbered
//   (active expert, weight tile, token tile), token tile fastest, and claimed as in the prefill
//   kernel (persistent CTAs, a global counter, the last producer out resets it).
//
// Pipeline: 2 consumer warpgroups + 1 producer warpgroup (384 threads). A stage is one 128-K
//   group: the token tile's E4M3 rows (128 bytes each, 128-byte swizzle, TMA boxes of 64 and 16
//   rows), the weight tile's codes and scales of the group's two k-blocks (1-D bulk copies: a
//   weight group's k-blocks are contiguous), and the tile rows' activation scales (one TMA box of
//   kSxBox = kRows + 4 floats from row0 & ~3: a tensor copy's first element must be 16-byte
//   aligned in global memory, and a tile's row0 is any row, the experts' rows not being padded;
//   the box at row0 itself, row0 % 4 != 0, was an illegal instruction on an H200, issue 49).
//   Thread 0 of the producer issues every copy of a stage (first version: the prefill kernel
//   spreads them over four warps).
//   Consumers, per group: the four k32 wgmmas issue back to back into the partial accumulators
//   (scale-d = 0 on the first) from the group's A fragments (16 registers, made by
//   fold_group_mxfp4 / fold_kblock_mxfp8); while they run, the next group's fragments are made;
//   then wait, acc += partial * (sx[token] * sw[row]) promotes them, and the stage is released.
//   A 128-token tile does this for tokens 0-63, then (the same A registers, no fold beside) for
//   64-127: 32 partials instead of 64 (64 partials, the 64 accumulators and two A sets need more
//   than the consumers' 224 registers: 92 / 236 bytes of spills, MXFP8, ptxas of CUDA 13.0).
//   The kernel's waits end a timeout without a trap (ring_wait: a reachable trap holds
//   ptxas to the kernel's entry count of 168 registers, setmaxnreg.inc notwithstanding); they
//   reach R215 (MXFP8) / R207 (MXFP4) of their 224, no local memory.
//   The A registers are kept live (reg_fence) until after the wait: ptxas of CUDA 13.0 otherwise
//   hands them to the next group's fold while the four wgmmas still read them (a register-input
//   wgmma reads its A operand asynchronously; the PTX ISA makes touching it before the
//   wgmma.wait_group undefined), which gave wrong results at random on an H200 (issue 49; the
//   bf16 prefill kernel keeps its A sets live across its loop and has no such write).
//   scripts/check_rs_wgmma.py checks the built SASS for it.
//
// Limitations (first version; see the report of issue 49)
//   1. MXFP4 and MXFP8 weights; DeepSeek FP8 128x128 blocks (no SM90 layout yet) and NVFP4 are not here.
//   2. One tile shape (N <= 128 tokens, 2 groups); no small-tile kernel, no tall m64n192/256.
//   3. Single-issuer producer; promotion not overlapped with the warpgroup's own next wgmmas.
//   4. At most prefill::kMaxExperts active experts.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "moekit/common/wgmma_sm90_fp8_ops.cuh"
#include "moekit/experts/sm90_prefill_gemm.cuh"
#include "moekit/formats/fold_fp8.h"

namespace moekit::sm90::fp8 {

using prefill::PrefillArgs;
using prefill::Ring;
using prefill::TileDesc;
using prefill::TokenBoxes;

// ---- the ring's barrier wait ------------------------------------------------------------------
// prefill::wait_bar's wait and record (trap_record.cpp names the values by its site), ending in a
// faulting load instead of a trap, after limit_ns of %globaltimer (Fp8Args::wait_limit_ns). ptxas
// of CUDA 13.0 allocates the code from which a trap can be reached within the kernel's entry
// register count (65536 / kThreads, rounded down to a multiple of 8: 168), setmaxnreg.inc
// notwithstanding: wait_bar's trap, reachable from the whole k loop, held the consumers to R165
// and spilled (issue 49: 280 / 672 bytes of spill stores / loads with MXFP8 weights, 132 / 176
// with MXFP4; with this wait none). A load from address 0 is an illegal address (a sticky error
// like the trap's: the launch fails, the host reads the record) and puts no such bound.
// setmaxnreg.dec back to the entry count before the trap would not do: ptxas still reads
// registers above it there. The producer waits here too, so that one limit bounds every wait of
// the kernel. Sharing the record code with wait_bar waits for the next measured change of
// sm90_prefill_gemm.cuh (a kernel-stamp file, cmake/kernel_manifest.txt).
__device__ __forceinline__ void ring_wait(const Ring& ring, uint32_t bar, uint32_t parity, int site,
                                          uint64_t limit_ns) {
  ptx::mbar_wait<prefill::kWaitNs>(bar, parity, limit_ns, [&] {
    uint64_t rec;
    asm volatile("ld.shared.u64 %0, [%1];" : "=l"(rec) : "r"(ring.trap_slot()));
    trap::record_with(reinterpret_cast<int*>(rec), site, [&](auto put) {
      put(int((bar - ring.bars) / 8u));
      put(int(parity));
      put(ring.kstages);
      uint32_t parities = 0;
      for (int b = 0; b < prefill::barrier_count(ring.kstages, ring.cwg); ++b)
        parities |= ptx::mbar_phase_parity(ring.bars + 8u * uint32_t(b)) << b;
      put(int(parities));
      for (int j = 0; j < 2; ++j)
        for (int f : {0, 3, 4, 5}) {  // TileDesc t, n, nvar, g0 of slot j
          const uint32_t at = ring.tiles + uint32_t(j) * ring.slot_bytes + 4u * uint32_t(f);
          int v;
          asm volatile("ld.shared.s32 %0, [%1];" : "=r"(v) : "r"(at));
          put(v);
        }
      int sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      put(sm);
    });
    for (;;) {  // the first load ends the launch
      uint32_t v;
      asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(uint64_t(0)) : "memory");
    }
  });
}

constexpr int kGroupK = kFoldGroupK;        // K per stage and per promotion
constexpr int kKbPerGroup = kGroupK / kKBlock;  // the weight layout's 64-K blocks per group
constexpr int kRows = 128;                  // token rows per tile at most
constexpr int kSxBox = kRows + 4;           // activation scales per stage: rows row0 & ~3 on
constexpr int kRowBytes = kGroupK;          // an E4M3 token row of one group: 128 bytes
constexpr int kTileGroups = 2;              // weight groups per tile: one per consumer warpgroup
constexpr int kCWG = 2;
constexpr int kWG = prefill::kWG;
constexpr int kThreads = kWG * (kCWG + 1);
// The producer gets 56 (its single issuer holds the three maps, the tile and the stage; at 40 it spilled).
constexpr int kConsumerRegs = 224, kProducerRegs = 56;
static_assert(kCWG * kConsumerRegs + kProducerRegs <= 65536 / kWG, "setmaxnreg over the register file");
static_assert(kRowBytes == int(prefill::kTokenRowBytes), "TokenBoxes' rows are 128 bytes");
static_assert(kKbPerGroup == 2, "a group is two k-blocks of the weight layout");

constexpr int kVariants = 4;  // wgmma N = 16 << v
MOEKIT_HD constexpr int variant_n(int v) { return 16 << v; }
MOEKIT_HD constexpr int n_variant(int n) { return n <= 16 ? 0 : n <= 32 ? 1 : n <= 64 ? 2 : 3; }
static_assert(variant_n(n_variant(kRows)) == kRows && n_variant(1) == 0, "variants cover 1..kRows");

// A stage (bytes from its 1024-aligned start): B rows, then codes [group slot][k-block], scales
// likewise, then the activation scales of the tile's rows.
template <WeightFormat F>
struct Traits {
  static constexpr int kCodeSlot = kSubtiles * atom_code_bytes(F);   // one group's k-block
  static constexpr int kScaleSlot = kSubtiles * atom_scale_bytes(F);
  static constexpr int kBArea = kRows * kRowBytes;
  static constexpr int kCodeOff = kBArea;
  static constexpr int kScaleOff = kCodeOff + kTileGroups * kKbPerGroup * kCodeSlot;
  static constexpr int kSxOff = kScaleOff + kTileGroups * kKbPerGroup * kScaleSlot;
  static constexpr int kSxBytes = kSxBox * 4;
  static constexpr int kStageBytes = (kSxOff + kSxBytes + 1023) / 1024 * 1024;
  using Slot = prefill::TileSlot<kRows, kTileGroups * kGroupRows>;
  using Scan = cub::BlockScan<int, kThreads>;
  static constexpr int kStaticSmem = 4 * (prefill::kMaxExperts + 1) + 2 * int(sizeof(Slot)) + ptx::kBarrierLine +
                                     8 * (prefill::barrier_line_words(16, kCWG) + 1) +
                                     int(sizeof(typename Scan::TempStorage)) + 256;
  static constexpr int kStagesFit = (prefill::kSmemLimit - kStaticSmem - 1024) / kStageBytes;
  static constexpr int kStages = kStagesFit < 8 ? kStagesFit : 8;
  static constexpr int kDynSmem = kStages * kStageBytes + 1024;
  static_assert(kStages >= 3, "ring too short");
  static_assert(kScaleOff % 16 == 0, "bulk copies land on 16-byte boundaries");
  static_assert(kSxOff % 128 == 0, "a tensor copy (the scales box) lands on a 128-byte boundary");
  MOEKIT_HD static constexpr int code_off(int j, int kb) { return kCodeOff + (j * kKbPerGroup + kb) * kCodeSlot; }
  MOEKIT_HD static constexpr int scale_off(int j, int kb) { return kScaleOff + (j * kKbPerGroup + kb) * kScaleSlot; }
};

struct Fp8Args {  // 128-byte aligned (CUtensorMap)
  // in_map / in_map_big: the E4M3 rows (make_fp8_rows_map, boxes of 128 columns x 16 / 64 rows);
  // dims, codes, scales: the weights; the rest as for the prefill kernel.
  PrefillArgs base;
  CUtensorMap sx_map;  // activation scales (make_fp8_scale_map: boxes of kRows rows x 1 group)
  // Every barrier wait of the kernel gives up after this many ns of %globaltimer (ring_wait: the
  // trap record, then a failed launch); 0: trap::kWaitLimitNs (launch_fp8_gemm sets it). Tests
  // set a few seconds so that a hang fails fast with its record (FP8Stall.*).
  uint64_t wait_limit_ns = 0;
  uint64_t pad_[15] = {};  // to the CUtensorMaps' 128-byte alignment, no implicit padding
};
static_assert(sizeof(Fp8Args) == 768, "Fp8Args: no tail padding");

// ---- consumers ---------------------------------------------------------------------------------
template <int N>
__device__ __forceinline__ void wgmma_k32(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc, bool first) {
  // scale-d is an immediate: the caller's unrolled step index picks the wrapper.
  if (first) {
    if constexpr (N == 16) ptx::wgmma_m64n16k32_e4m3_rs<0>(d, a, desc);
    else if constexpr (N == 32) ptx::wgmma_m64n32k32_e4m3_rs<0>(d, a, desc);
    else if constexpr (N == 64) ptx::wgmma_m64n64k32_e4m3_rs<0>(d, a, desc);
    else ptx::wgmma_m64n128k32_e4m3_rs<0>(d, a, desc);
  } else {
    if constexpr (N == 16) ptx::wgmma_m64n16k32_e4m3_rs<1>(d, a, desc);
    else if constexpr (N == 32) ptx::wgmma_m64n32k32_e4m3_rs<1>(d, a, desc);
    else if constexpr (N == 64) ptx::wgmma_m64n64k32_e4m3_rs<1>(d, a, desc);
    else ptx::wgmma_m64n128k32_e4m3_rs<1>(d, a, desc);
  }
}

// One group's A fragments for this thread (rows g, g + 8 of its warp's 16) and the rows' group
// scales (fold_group_mxfp4 / fold_kblock_mxfp8, formats/fold_fp8.h: the CPU tests run them on the
// converted layout).
struct GroupFrag {
  uint32_t a[4][4];  // k32 step p (the group's MX block p): registers 0..3
  float sw_g, sw_h;  // 2^(s_max - 133) of rows g and g + 8
};
// lane_codes0 / 1: this lane's bytes of the group's two k-blocks; two = false: the group has one
// k-block (s1 = 0) and the second slot holds stale bytes, so its steps get zero codes (they
// multiply the tensor map's zero columns past K_pad, and a stale E4M3 NaN code would make them NaN).
template <WeightFormat F>
__device__ __forceinline__ void make_group_frag(uint32_t lane_codes0, uint32_t lane_codes1, uint32_t s0, uint32_t s1,
                                                bool two, GroupFrag& f) {
  const uint4 z = make_uint4(0u, 0u, 0u, 0u);
  if constexpr (F == WeightFormat::kMxfp4) {
    const uint4 w0 = ptx::lds128(lane_codes0), w1 = two ? ptx::lds128(lane_codes1) : z;
    const uint32_t w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};  // k16 steps 0..7 of the group
    fold_group_mxfp4(w, s0, s1, f.a, f.sw_g, f.sw_h);
  } else {
    static_assert(F == WeightFormat::kMxfp8, "MXFP4 and MXFP8 weights");
    const Mxfp8GroupScales sc = fold_mxfp8_scales(s0, s1, f.sw_g, f.sw_h);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t at = h ? lane_codes1 : lane_codes0;
      const bool live = h == 0 || two;
      const uint4 v0 = live ? ptx::lds128(at) : z, v1 = live ? ptx::lds128(at + 512) : z;
      const uint32_t w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
      fold_kblock_mxfp8(w, sc, h, f.a);
    }
  }
#pragma unroll
  for (int p = 0; p < 4; ++p)
#pragma unroll
    for (int i = 0; i < 4; ++i) ptx::reg_fence(f.a[p][i]);
}

// The tile's k loop for this warpgroup's group (T: Traits<F>): acc = sum over groups of
// partial * sx * sw. Stage releases: every consumer thread of both warpgroups arrives (a
// warpgroup without a group in the tile consumes the stages without multiplying).
template <WeightFormat F, int N>
__device__ __forceinline__ void tile_mainloop(const Ring& ring, int& stage, uint32_t& phase, int KB, int row0, int wg,
                                              int wi, int lane, uint64_t limit_ns, float (&acc)[N / 2]) {
  using T = Traits<F>;
  constexpr int kStages = T::kStages;
  const int KG = (KB + kKbPerGroup - 1) / kKbPerGroup;
  const int c = lane & 3;
  // The partial accumulators hold at most 64 tokens: a 128-token tile multiplies its two halves
  // in turn (N = 128 at once, 64 partials beside the 64 accumulators and the A registers of this
  // group and the next, spills within 224 registers; see the header, Pipeline).
  constexpr int NH = N > 64 ? 64 : N;
  constexpr int kHalves = N / NH;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  float part[NH / 2];
  const uint32_t lane_code = uint32_t(wi * atom_code_bytes(F)) + lane_code_offset(lane);
  const uint32_t lane_scale = uint32_t(wi * atom_scale_bytes(F)) + lane_scale_offset<F>(lane);
  auto prep = [&](int st, int kg, GroupFrag& f) {
    const uint32_t sa = ring.stage(st, T::kStageBytes);
    const bool two = 2 * kg + 1 < KB;
    const uint32_t s0 = ptx::lds32(sa + T::scale_off(wg, 0) + lane_scale);
    const uint32_t s1 = two ? ptx::lds32(sa + T::scale_off(wg, 1) + lane_scale) : 0u;
    make_group_frag<F>(sa + T::code_off(wg, 0) + lane_code, sa + T::code_off(wg, 1) + lane_code, s0, s1, two, f);
  };
  GroupFrag cur, nxt;
  ring_wait(ring, ring.full(stage), phase, trap::kPrefillFull, limit_ns);
  prep(stage, 0, cur);
  for (int kg = 0; kg < KG; ++kg) {
    const uint32_t sa = ring.stage(stage, T::kStageBytes);
    const uint64_t desc0 = ptx::smem_desc_k128(sa);
    const int next = stage + 1 == kStages ? 0 : stage + 1;
    const uint32_t next_phase = next == 0 ? phase ^ 1 : phase;
    // Promotion: partial 4q + i holds row g (i < 2) / g + 8, token th NH + 8q + 2c + (i & 1);
    // the stage's scales start at row row0 & ~3 (4-byte loads: 2c + (row0 & 3) may be odd).
    const uint32_t sx_at = sa + T::kSxOff + uint32_t(4 * (2 * c + (row0 & 3)));
#pragma unroll
    for (int th = 0; th < kHalves; ++th) {
      // Tokens th NH on: their B rows start th NH * 128 bytes on (whole 1024-byte swizzle atoms),
      // the descriptor's address field counts 16 bytes.
      const uint64_t desc = desc0 + uint64_t(th * NH * kRowBytes / 16);
      ptx::wgmma_fence();
#pragma unroll
      for (int p = 0; p < 4; ++p) wgmma_k32<NH>(part, cur.a[p], desc + 2 * p, p == 0);  // 32 bytes of K a step
      ptx::wgmma_commit();
      // The next group's fragments while the first half runs.
      if (th == 0 && kg + 1 < KG) {
        ring_wait(ring, ring.full(next), next_phase, trap::kPrefillFull, limit_ns);
        prep(next, kg + 1, nxt);
      }
      ptx::wgmma_wait<0>();
      if (th == kHalves - 1) {
        // cur's A registers are live up to here (see the header, Pipeline).
#pragma unroll
        for (int p = 0; p < 4; ++p)
#pragma unroll
          for (int i = 0; i < 4; ++i) ptx::reg_fence(cur.a[p][i]);
      }
#pragma unroll
      for (int i = 0; i < NH / 2; ++i) ptx::reg_fence(part[i]);
#pragma unroll
      for (int q = 0; q < NH / 8; ++q) {
        const uint32_t at = sx_at + uint32_t(4 * th * NH + 32 * q);
        const float x0 = __uint_as_float(ptx::lds32(at)), x1 = __uint_as_float(ptx::lds32(at + 4));
        float* o = acc + th * (NH / 2) + 4 * q;
        o[0] = fmaf(part[4 * q], x0 * cur.sw_g, o[0]);
        o[1] = fmaf(part[4 * q + 1], x1 * cur.sw_g, o[1]);
        o[2] = fmaf(part[4 * q + 2], x0 * cur.sw_h, o[2]);
        o[3] = fmaf(part[4 * q + 3], x1 * cur.sw_h, o[3]);
      }
    }
    ptx::mbar_arrive(ring.empty(stage));
    cur = nxt;
    stage = next;
    phase = next_phase;
  }
}

template <WeightFormat F, int N>
__device__ __forceinline__ void run_tile(const PrefillArgs& p, const Ring& ring, const typename Traits<F>::Slot& ts,
                                         int& stage, uint32_t& phase, int KB, int wg, int wi, int lane,
                                         uint64_t limit_ns) {
  float acc[1][N / 2];
  tile_mainloop<F, N>(ring, stage, phase, KB, ts.d.row0, wg, wi, lane, limit_ns, acc[0]);
  prefill::tile_epilogue<N, 1, kCWG>(p, ts, wg, wi, lane, acc);
}

// ---- the kernel --------------------------------------------------------------------------------
template <WeightFormat F>
__global__ void __launch_bounds__(kThreads, 1) fp8_gemm_kernel(const __grid_constant__ Fp8Args args) {
  using T = Traits<F>;
  constexpr int kStages = T::kStages;
  const PrefillArgs& base = args.base;
  const uint64_t limit_ns = args.wait_limit_ns;  // every barrier wait's (ring_wait)
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_prefix[prefill::kMaxExperts + 1];  // tiles of the active experts before each
  __shared__ typename T::Slot s_tile[2];
  __shared__ alignas(ptx::kBarrierLine) uint64_t s_bars[prefill::barrier_line_words(kStages, kCWG) + 1];
  __shared__ int s_num_active;

  Ring ring;
  ring.bars = ptx::smem_addr(s_bars);
  ring.stages0 = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;  // the 128-byte swizzle's 1024-byte atoms
  ring.kstages = kStages;
  ring.cwg = kCWG;
  ring.tiles = ptx::smem_addr(s_tile);
  ring.slot_bytes = uint32_t(sizeof(typename T::Slot));
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x) / kWG, 0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(ring.full(s), 1);            // the producer's issuing thread posts the bytes
      ptx::mbar_init(ring.empty(s), kCWG * kWG);  // every consumer thread releases its reads
    }
    for (int w = 0; w < kCWG; ++w) {
      ptx::mbar_init(ring.tile_empty(0, w), kWG);
      ptx::mbar_init(ring.tile_empty(1, w), kWG);
    }
    ptx::mbar_init(ring.scratch(), kCWG * kWG);
    ptx::mbar_init(ring.tile_full(0), kWG);
    ptx::mbar_init(ring.tile_full(1), kWG);
    s_bars[prefill::barrier_line_words(kStages, kCWG)] = reinterpret_cast<uint64_t>(base.trap);
    ptx::fence_barrier_init();
  }

  ptx::grid_dependency_wait();
  const DeviceWork& work = base.work;
  if (threadIdx.x == 0) s_num_active = *work.num_active;
  __syncthreads();
  const int num_active = s_num_active;
  if (num_active == 0) {
    ptx::launch_dependents();
    ptx::mbar_inval_at_exit(ring.bars, prefill::barrier_count(kStages, kCWG));
    return;
  }
  const int G = int(base.dims.groups());
  const int KB = int(base.dims.kblocks());
  const int KG = (KB + kKbPerGroup - 1) / kKbPerGroup;
  const int weight_tiles = (G + kTileGroups - 1) / kTileGroups;
  {
    // Tiles per active expert (ceil(count / kRows) token tiles x weight_tiles), exclusive prefix.
    constexpr int kItems = (prefill::kMaxExperts + kThreads - 1) / kThreads;
    using Scan = typename T::Scan;
    __shared__ typename Scan::TempStorage scan_tmp;
    int v[kItems], x[kItems], total;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int a = threadIdx.x * kItems + i;
      v[i] = a < num_active ? (work.count[a] + kRows - 1) / kRows * weight_tiles : 0;
    }
    Scan(scan_tmp).ExclusiveSum(v, x, total);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int a = threadIdx.x * kItems + i;
      if (a < prefill::kMaxExperts) s_prefix[a] = x[i];
    }
    if (threadIdx.x == 0) s_prefix[prefill::kMaxExperts] = total;
    __syncthreads();
  }
  ptx::launch_dependents();
  const int total = s_prefix[prefill::kMaxExperts];

  if (wg == kCWG) {
    // ---------------- producer ----------------
    ptx::setmaxnreg_dec<kProducerRegs>();
    const int pt = threadIdx.x - kCWG * kWG;
    const bool lead = pt == 0;
    const uint64_t map = reinterpret_cast<uint64_t>(&base.in_map);
    const uint64_t map_big = reinterpret_cast<uint64_t>(&base.in_map_big);
    const uint64_t sx_map = reinterpret_cast<uint64_t>(&args.sx_map);
    int stage = 0;
    uint32_t phase = 0;
    int t = blockIdx.x;
    const int P = int(gridDim.x);
    for (int m = 0;; ++m) {
      typename T::Slot& slot = s_tile[m & 1];
      for (int w = 0; w < kCWG; ++w)
        ring_wait(ring, ring.tile_empty(m, w), ((m >> 1) & 1) ^ 1, trap::kPrefillTileEmpty, limit_ns);
      int claim = 0;
      if (lead) {
        TileDesc d{};
        d.t = t < total ? t : -1;
        if (t < total) {
          claim = P + atomicAdd(base.tile_counter, 1);
          int lo = 0, hi = num_active - 1;  // the active expert with prefix[lo] <= t < prefix[lo + 1]
          while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_prefix[mid] <= t) lo = mid; else hi = mid - 1;
          }
          const int count = work.count[lo];
          const int tiles = (count + kRows - 1) / kRows;
          const int local = t - s_prefix[lo];
          const int wt = local / tiles, tt = local - wt * tiles;  // token tile fastest
          d.expert = work.expert[lo];
          d.row0 = work.row_start[lo] + tt * kRows;
          d.n = min(kRows, count - tt * kRows);
          d.nvar = n_variant(d.n);
          d.g0 = wt * kTileGroups;
          d.ng = min(kTileGroups, G - d.g0);
        }
        slot.d = d;
      }
      ptx::named_sync(1, kWG);
      const TileDesc d = slot.d;
      if (d.t < 0) {
        ptx::mbar_arrive(ring.tile_full(m));
        break;
      }
      if (base.gemm2)
        for (int r = pt; r < d.n; r += kWG) slot.w[r] = base.topk_weights[base.row_src[d.row0 + r]];
      {
        const int64_t wbase = int64_t(d.expert) * base.dims.N_pad + int64_t(d.g0) * kGroupRows;
        const int64_t live = min(int64_t(kTileGroups * kGroupRows), base.dims.N_pad - int64_t(d.g0) * kGroupRows);
        for (int r = pt; r < kTileGroups * kGroupRows; r += kWG) {
          slot.scale[r] = base.row_scale && r < live ? base.row_scale[wbase + r] : 1.0f;
          slot.bias[r] = base.bias && r < live ? base.bias[wbase + r] : 0.0f;
        }
      }
      ptx::mbar_arrive(ring.tile_full(m));
      if (lead) {
        const int nrows = variant_n(d.nvar);
        const TokenBoxes boxes(nrows);
        uint32_t box_bytes = 0;
        for (int c = 0; c < boxes.nbox; ++c) box_bytes += boxes.bytes(c);
        const int64_t grp0 = (int64_t(d.expert) * G + d.g0) * KB;  // the tile's first group, k-block 0
        for (int kg = 0; kg < KG; ++kg) {
          ring_wait(ring, ring.empty(stage), phase ^ 1, trap::kPrefillEmpty, limit_ns);
          const uint32_t sa = ring.stage(stage, T::kStageBytes);
          const int nkb = min(kKbPerGroup, KB - kKbPerGroup * kg);
          const uint32_t wbytes = uint32_t(d.ng * nkb) * uint32_t(T::kCodeSlot + T::kScaleSlot);
          ptx::mbar_arrive_expect_tx(ring.full(stage), wbytes + box_bytes + uint32_t(T::kSxBytes));
          for (int j = 0; j < d.ng; ++j) {
            const int64_t kb0 = grp0 + int64_t(j) * KB + kKbPerGroup * kg;  // group j's k-blocks are contiguous
            prefill::bulk_g2s_plain(sa + T::code_off(j, 0), base.codes + kb0 * T::kCodeSlot,
                                    uint32_t(nkb * T::kCodeSlot), ring.full(stage));
            prefill::bulk_g2s_plain(sa + T::scale_off(j, 0), base.scales + kb0 * T::kScaleSlot,
                                    uint32_t(nkb * T::kScaleSlot), ring.full(stage));
          }
          for (int c = 0; c < boxes.nbox; ++c) {
            const int r = boxes.first_row(c);
            prefill::tma_load_2d(sa + uint32_t(r * kRowBytes), boxes.big(c) ? map_big : map, kg * kGroupK, d.row0 + r,
                                 ring.full(stage));
          }
          prefill::tma_load_2d(sa + T::kSxOff, sx_map, d.row0 & ~3, kg, ring.full(stage));
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
        t = claim;
      }
    }
    if (lead) {
      ptx::fence_acq_rel_gpu();
      if (atomicAdd(base.exit_count, 1) == int(gridDim.x) - 1) {
        ptx::fence_acq_rel_gpu();
        *base.tile_counter = 0;
        *base.exit_count = 0;
      }
    }
  } else {
    // ---------------- consumers ----------------
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wi = warp & 3;
    int stage = 0;
    uint32_t phase = 0;
    for (int m = 0;; ++m) {
      ring_wait(ring, ring.tile_full(m), (m >> 1) & 1, trap::kPrefillTileFull, limit_ns);
      const typename T::Slot& ts = s_tile[m & 1];
      if (ts.d.t < 0) break;
      if (wg >= ts.d.ng) {
        for (int kg = 0; kg < KG; ++kg) {
          ring_wait(ring, ring.full(stage), phase, trap::kPrefillFull, limit_ns);
          ptx::mbar_arrive(ring.empty(stage));
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      } else {
        switch (ts.d.nvar) {
          case 0: run_tile<F, 16>(base, ring, ts, stage, phase, KB, wg, wi, lane, limit_ns); break;
          case 1: run_tile<F, 32>(base, ring, ts, stage, phase, KB, wg, wi, lane, limit_ns); break;
          case 2: run_tile<F, 64>(base, ring, ts, stage, phase, KB, wg, wi, lane, limit_ns); break;
          default: run_tile<F, 128>(base, ring, ts, stage, phase, KB, wg, wi, lane, limit_ns); break;
        }
      }
      ptx::mbar_arrive(ring.tile_empty(m, wg));
    }
  }
  ptx::mbar_inval_at_exit(ring.bars, prefill::barrier_count(kStages, kCWG));
}

}  // namespace moekit::sm90::fp8
