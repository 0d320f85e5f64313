// moekit/experts/sm90_prefill_gemm.cuh — grouped mixed-input MoE GEMM for SM90 (H100/H200),
// prefill: many tokens per expert.
//
// Contract (one launch per GEMM; the same as the decode kernel's, sm90_moe_gemm.cuh)
//   out[row, n] = epilogue( sum_k in[row, k] * W_e[n, k] )   for the rows of every active expert e
//   W: MXFP4 | NVFP4 | MXFP8 | BF16 in the decode kernel's converted layout (one copy of the
//   weights serves both kernels), dequantized exactly to bf16 in registers; wgmma.m64nNk16 with
//   A = weights from registers, B = tokens from shared memory, fp32 accumulators.
//   GEMM1 epilogue: row scale (NVFP4) + bias, gated activation, bf16 store of I columns.
//   GEMM2 epilogue: row scale + bias, times the row's top-k weight, fp32 store (finalize then
//   sums the k rows of a token in slot order). No atomics on outputs: every output element is
//   computed whole by one CTA in a fixed k order, so the bits do not depend on the schedule.
//   Rows at or past an expert's count are never read as data nor written (batched format).
//
// Tiles (two kinds, by the token tile's rows n; an expert's rows are cut into kMaxN = 192-row
// token tiles, the last one holding the rest)
//   short (n <= 96): weight tile = 4 groups of 64 kernel rows (256 rows); consumer warpgroup w
//   multiplies the tile's groups w and w + 2 (so a tile with 1-3 valid groups, the last of a
//   matrix whose group count is not a multiple of 4, still splits its work over both
//   warpgroups), each as one wgmma m64nN per k16 step, N the smallest of 16, 32, ..., 96 that
//   holds n (an expert's last partial tile wastes under 16 rows).
//   tall (96 < n <= 192): weight tile = 2 groups (128 rows), one per consumer warpgroup, each as
//   one wgmma m64nN, N = 128, 160 or 192: half the dequantizing work per multiply of a short
//   tile, and two steps in flight per warpgroup (tile_mainloop_tall). Each warp's A fragments
//   are the layout's atoms.
//   Tiles are numbered (active expert, weight tile, token tile), token tile fastest: CTAs that
//   run at the same time share the expert's token rows and each weight tile in L2.
//   The small-tile kernel (prefill_gemm_kernel<F, true>, MXFP4 and NVFP4; the layer runs it up to
//   24 rows per expert on average, oracle/kernel_choice.h prefill_small_tiles): short tiles only,
//   of at most kSmallN = 32 rows, three consumer warpgroups (512 threads), weight tiles of up to
//   9 groups (576 rows; a matrix's groups spread evenly over its tiles: 64 groups are 8 tiles of
//   8); consumer warpgroup w multiplies groups w, w + 3, w + 6, two of its wgmmas in flight
//   while it makes the third's fragment (tile_mainloop_wide with kNv = 3).
//
// Schedule (persistent, dynamic, deterministic results)
//   One CTA per SM; CTA i starts with tile i, then its producer claims the next from a global
//   counter (the last CTA out resets it), so CTAs that get short tiles take more of them.
//
// Pipeline per CTA: 2 consumer warpgroups and a producer warpgroup (384 threads; the small-tile
//   kernel: 3 consumer warpgroups of 152 registers, 512 threads). setmaxnreg
//   gives the consumers 232 registers and the producer 40 (ptxas allocates each role's code
//   within its setmaxnreg count: a test kernel needing 200 registers spills at the entry cap of
//   65536 / 384 = 168 and runs in 230 after setmaxnreg.inc 232). The consumers hold 96
//   accumulators (two m64n96 or one m64n192) and two A register sets; two groups of m64n192
//   (192 accumulators) spill even so, and a tall m64n256 makes ptxas serialize the wgmmas.
//   producer (warpgroup 2): per stage, lane 0 of warp w posts the bytes of its own copies on the
//   stage's full barrier and issues them: the k-block's codes and scales of the tile's group w
//   (1-D bulk copies: the layout keeps a group's k-blocks contiguous) and its share of the token
//   rows (bulk tensor copies of 64-row boxes, then 16-row ones, into the 128-byte-swizzled B
//   tile, the first boxes to the warps without a group; the rows are in expert order: the
//   permuted x for GEMM1, GEMM1's output for GEMM2). Issuing is what a producer warp spends its
//   time on, so the fewer copies, and the cheaper each (operands warp-uniform), the sooner a
//   stage is full. A
//   full barrier completes once all four warps have arrived and every byte has landed, so no
//   producer warp can run a ring ahead of another: a warp with no copies in a tile's stages
//   (the last weight tile of a matrix, few token rows) would otherwise drift, and an mbarrier
//   parity wait two phases behind waits for the wrong phase (the BF16 hang, docs/perf/notebook.md,
//   eighteenth section). All threads stage the epilogue constants.
//   consumers (warpgroups 0, 1): per k16 step, one wgmma per group of theirs; the next fragment
//   (formats/dequant.cuh, one bf16x2 multiply with the scale folded in) is made while wgmmas run
//   (tile_mainloop_wide, tile_mainloop_tall), and a stage is released once its last wgmma
//   retired.
//   Tile metadata (expert, rows, epilogue constants, the GEMM2 top-k weights of the tile's rows)
//   travels in a 2-slot ring beside the stages: every producer thread arrives on the slot's
//   tile_full barrier after writing it, every consumer thread on its warpgroup's tile_empty
//   barrier after its epilogue (one per warpgroup: one can run tiles ahead of the other).
//   The standard format's x is permuted into expert order first (the permute kernel the batched
//   format uses), so that token tiles are contiguous rows: one layer pass of x's bytes.
//
// Limitations
//   1. Single-multiply scales only (every E8M0 byte <= 254 - tiny exponent, the convert step's
//      `single_multiply`); other MX weights run the decode kernel (the layer decides).
//   2. At most kMaxExperts active experts (the tile prefix lives in shared memory).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "moekit/common/ptx_sm90.cuh"
#include "moekit/common/trap_record.cuh"
#include "moekit/common/wgmma_sm90_ops.cuh"
#include "moekit/experts/activation.h"
#include "moekit/experts/sm90_fragment.cuh"
#include "moekit/experts/sm90_layout.h"
#include "moekit/experts/sm90_moe_gemm.cuh"

namespace moekit::sm90::prefill {

constexpr int kHalfN = 96;        // token rows of a short tile at most
// A tile's token rows are loaded as boxes of kBigBoxRows rows, the rest as 16-row boxes: one
// tensor copy where 16-row boxes took four (each copy costs its producer warp several
// instructions; docs/perf/notebook.md, twentieth section).
constexpr int kBigBoxRows = 64;
// The boxes of a tile's nrows token rows (a multiple of 16): nbig boxes of kBigBoxRows rows, then
// 16-row boxes. Box c lands at its first row's place in the 128-byte-swizzled B tile (the swizzle
// repeats every 8 rows, so one big box is the same bytes as its four 16-row boxes).
constexpr uint32_t kTokenRowBytes = kKBlock * 2;  // a token row of a k-block in the B tile (bf16)
struct TokenBoxes {
  int nbig, nbox;
  __device__ explicit TokenBoxes(int nrows)
      : nbig(nrows / kBigBoxRows), nbox(nrows / kBigBoxRows + (nrows % kBigBoxRows) / 16) {}
  __device__ bool big(int c) const { return c < nbig; }
  __device__ int first_row(int c) const { return c < nbig ? c * kBigBoxRows : nbig * kBigBoxRows + (c - nbig) * 16; }
  __device__ uint32_t bytes(int c) const { return uint32_t(c < nbig ? kBigBoxRows : 16) * kTokenRowBytes; }
};
constexpr int kMaxN = 192;        // token rows per tile (a tall tile: one wgmma N = 128..192)
constexpr int kWideGroups = 4;    // groups per weight tile of a short token tile (n <= kHalfN)
constexpr int kTallGroups = 2;    // groups per weight tile of a tall token tile (n > kHalfN)
// The small-tile kernel (4-bit weights, few token rows per expert: 512-1024 tokens of the presets):
// every token tile has at most kSmallN rows and every weight tile up to kSmallGroups groups over three
// consumer warpgroups, three groups each, so that twelve warps make fragments and each warpgroup
// keeps two wgmmas in flight while it makes the third's fragment (the kernel above: eight warps,
// one in flight; at N = 16-32 its warpgroups wait on the wgmma chain and the issue of their
// fragments, docs/perf/log.md). A kernel of its own: next to the kernel's other variants
// ptxas serializes every wgmma (C7512).
constexpr int kSmallN = 32;
constexpr int kSmallConsumerWGs = 3;
constexpr int kSmallGroups = 3 * kSmallConsumerWGs;
constexpr int kConsumerWGs = 2;   // the other kernel's consumer warpgroups
constexpr int kWG = 128;          // threads per warpgroup
constexpr int kProducerThreads = kWG;
constexpr int kProducerWarps = kProducerThreads / 32;  // each posts and issues its own copies
constexpr int kMaxExperts = 1024;
constexpr int kSmemLimit = 227 * 1024;
// The ring's mbarriers (full and empty per stage, cwg tile_empty per slot, scratch, two
// tile_full; cwg consumer warpgroups), and the 8-byte words of the 128-byte lines they occupy:
// nothing else lives there.
MOEKIT_HD constexpr int barrier_count(int stages, int cwg) { return 2 * stages + 2 * cwg + 3; }
MOEKIT_HD constexpr int barrier_line_words(int stages, int cwg) {
  return (barrier_count(stages, cwg) * 8 + ptx::kBarrierLine - 1) / ptx::kBarrierLine * (ptx::kBarrierLine / 8);
}

// Tile variants. A short tile (n <= 96 token rows) runs one wgmma N = 16 ceil(n / 16) per group
// (variants 0-5: N = 16..96) over a wide weight tile, two groups per consumer warpgroup; a tall
// tile runs one wgmma N = 32 ceil(n / 32) (variants 6-8: N = 128..192) over a narrow weight
// tile, one group per warpgroup. wgmma_sm90_ops.cuh has one wrapper per N. Every variant adds
// to one kernel, and past a size ptxas serializes all of its wgmmas (six tall Ns do it; so do
// three A register sets in the tall loop next to the short-tile loops): scripts/nvcc_guard.sh
// makes that a build error (docs/perf/notebook.md, twentieth section).
constexpr int kVariants = 9;
MOEKIT_HD constexpr bool variant_tall(int v) { return v >= 6; }
MOEKIT_HD constexpr int variant_n(int v) { return v < 6 ? 16 * (v + 1) : 32 * (v - 2); }
MOEKIT_HD constexpr int variant_rows(int v) { return variant_n(v); }
MOEKIT_HD constexpr int n_variant(int n) { return n <= kHalfN ? (n + 15) / 16 - 1 : (n + 31) / 32 + 2; }
static_assert(variant_n(n_variant(97)) == 128 && variant_n(n_variant(kMaxN)) == kMaxN &&
                  n_variant(kMaxN) == kVariants - 1 && variant_n(n_variant(96)) == 96,
              "variants cover 1..kMaxN");
// An expert's c > 0 rows as token tiles: ceil(c / kMaxN) tiles of kMaxN rows, the last one
// holding the rest (1..kMaxN rows; short or tall). Measured and not kept: evening the rows out
// over the same number of tiles (256 rows: 128 + 128 instead of 192 + 64) was faster for some
// shapes and slower for others (docs/perf/log.md).
struct TokenSplit {
  int tiles, rows;
};

// A tile as the producer decodes it.
struct alignas(16) TileDesc {
  int t;        // tile index; -1: no more tiles
  int expert;   // expert id
  int row0;     // first activation row
  int n;        // rows (1..kMaxN)
  int nvar;     // wgmma N variant
  int g0;       // first group of the weight tile
  int ng;       // its groups
  int pad[1];
};
template <int kRows, int kWeightRows>
struct TileSlot {
  TileDesc d;
  float w[kRows];               // GEMM2: top-k weight of each token row of the tile
  float scale[kWeightRows];     // row scale (NVFP4; else 1) of each weight row of the tile
  float bias[kWeightRows];      // bias (else 0) of each weight row of the tile
};

// A kernel's tiles and ring. A stage: the token tile's B rows (128 bytes each), then the weight
// tile's groups' codes, then their scales. Short and tall tiles use the stage differently: the B
// area is sized per kind. kSmall: the small-tile kernel (short tiles of at most kSmallN rows and
// kSmallGroups groups only).
template <WeightFormat F, bool kSmall = false>
struct PTraits {
  // Consumer warpgroups, then the producer warpgroup; setmaxnreg's counts (2 x 232 + 40 = 3 x 168;
  // the small-tile kernel: 3 x 152 + 40 <= 4 x 128).
  static constexpr int kCWG = kSmall ? kSmallConsumerWGs : kConsumerWGs;
  static constexpr int kThreads = kWG * (kCWG + 1);
  static constexpr int kConsumerRegs = kSmall ? 152 : 232, kProducerRegs = 40;
  static_assert(kCWG * kConsumerRegs + kProducerRegs <= 65536 / kWG, "setmaxnreg over the register file");
  using Scan = cub::BlockScan<int, kThreads>;
  static constexpr int kRows = kSmall ? kSmallN : kMaxN;  // token rows per tile at most
  static constexpr int kShortRows = kSmall ? kSmallN : kHalfN;
  static constexpr int kShortGroups = kSmall ? kSmallGroups : kWideGroups;
  static constexpr int kTileRows = kShortGroups * kGroupRows;  // weight rows of the largest weight tile
  using Slot = TileSlot<kRows, kTileRows>;
  // An expert's c > 0 rows as token tiles of kRows (the last one holding the rest).
  MOEKIT_HD static constexpr TokenSplit token_split(int c) { return {(c + kRows - 1) / kRows, kRows}; }
  MOEKIT_HD static constexpr int b_area(bool tall) { return (tall ? kMaxN : kShortRows) * int(kTokenRowBytes); }
  MOEKIT_HD static constexpr int tile_groups(bool tall) { return tall ? kTallGroups : kShortGroups; }
  static constexpr int kCodeSlot = kSubtiles * atom_code_bytes(F);    // one group's k-block
  static constexpr int kScaleSlot = kSubtiles * atom_scale_bytes(F);
  static constexpr int kWideBytes = b_area(false) + kShortGroups * (kCodeSlot + kScaleSlot);
  static constexpr int kTallBytes = kSmall ? 0 : b_area(true) + kTallGroups * (kCodeSlot + kScaleSlot);
  static constexpr int kStageBytes = ((kWideBytes > kTallBytes ? kWideBytes : kTallBytes) + 1023) / 1024 * 1024;
  // Static shared memory: the tile prefix, two tile slots, the barrier lines (aligned to 128) and
  // the trap slot, the scan's storage, small words.
  static constexpr int kStaticSmem = 4 * (kMaxExperts + 1) + 2 * int(sizeof(Slot)) +
                                     ptx::kBarrierLine + 8 * (barrier_line_words(10, kCWG) + 1) +
                                     int(sizeof(typename Scan::TempStorage)) + 256;
  static constexpr int kStagesFit = (kSmemLimit - kStaticSmem - 1024) / kStageBytes;
  static constexpr int kStages = kStagesFit < 10 ? kStagesFit : 10;
  static constexpr int kDynSmem = kStages * kStageBytes + 1024;  // + alignment slack to 1024
  static_assert(kStages >= 3, "ring too short");
  // Shared-memory offsets in a stage of group slot j's codes and scales.
  MOEKIT_HD static constexpr int code_off(bool tall, int j) { return b_area(tall) + j * kCodeSlot; }
  MOEKIT_HD static constexpr int scale_off(bool tall, int j) {
    return b_area(tall) + tile_groups(tall) * kCodeSlot + j * kScaleSlot;
  }
};

struct alignas(64) PrefillArgs {
  // Activation rows [rows, dims.K_pad] bf16 in expert order (the permuted x for GEMM1, GEMM1's
  // output for GEMM2) as tensor maps of 64-column x 16-row and x kBigBoxRows-row boxes, 128-byte
  // swizzle (make_rows_map). First: their alignment (128 bytes with CUDA 13) leaves no gap there.
  CUtensorMap in_map;
  CUtensorMap in_map_big;
  LayoutDims dims;
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const float* row_scale = nullptr;  // [E, N_pad] or null (= 1)
  const float* bias = nullptr;       // [E, N_pad] or null
  DeviceWork work;                   // active experts (num_active, expert, count, row_start)
  uint16_t* out_act = nullptr;       // GEMM1: [rows, N_pad / 2] bf16
  float* out_f32 = nullptr;          // GEMM2: [rows, out_cols] fp32
  int64_t out_cols = 0;              // GEMM2: valid columns (H)
  const int32_t* row_src = nullptr;  // row -> token * k + j
  const float* topk_weights = nullptr;
  int* tile_counter = nullptr;       // [1] tiles claimed beyond the first P; zero between launches
  int* exit_count = nullptr;         // [1] producers out of tiles; the last resets both
  int* trap = nullptr;               // set by launch_prefill_gemm: where a timed-out wait writes its record (trap_record.h)
  ActivationParams act;
  bool gemm2 = false;
  // No implicit padding: launch arguments are compared bytewise (pipeline/launch_sm90.cuh);
  // the members end at byte 441, the size is a multiple of the tensor map's alignment.
  uint8_t pad_[71] = {};
};
static_assert(sizeof(PrefillArgs) == 512 && sizeof(PrefillArgs) % alignof(CUtensorMap) == 0,
              "PrefillArgs: no tail padding");


__device__ __forceinline__ void bulk_g2s_plain(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// A box of the activation tensor map at (column c0, row c1), completing on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, uint64_t map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// ---- consumers: one tile ---------------------------------------------------------------------
// D += A * B (the accumulators are zeroed when a tile starts).
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (N == 16) ptx::wgmma_m64n16k16_rs<1>(d, a, desc);
  else if constexpr (N == 32) ptx::wgmma_m64n32k16_rs<1>(d, a, desc);
  else if constexpr (N == 48) ptx::wgmma_m64n48k16_rs<1>(d, a, desc);
  else if constexpr (N == 64) ptx::wgmma_m64n64k16_rs<1>(d, a, desc);
  else if constexpr (N == 80) ptx::wgmma_m64n80k16_rs<1>(d, a, desc);
  else if constexpr (N == 96) ptx::wgmma_m64n96k16_rs<1>(d, a, desc);
  else if constexpr (N == 128) ptx::wgmma_m64n128k16_rs<1>(d, a, desc);
  else if constexpr (N == 160) ptx::wgmma_m64n160k16_rs<1>(d, a, desc);
  else {
    static_assert(N == 192, "one wrapper per N in wgmma_sm90_ops.cuh");
    ptx::wgmma_m64n192k16_rs<1>(d, a, desc);
  }
}

struct Ring {
  uint32_t stages0, bars;
  uint32_t tiles;  // the two TileSlots (a timed-out wait's record shows their descriptors)
  uint32_t slot_bytes;
  int kstages;
  int cwg;  // consumer warpgroups
  __device__ __forceinline__ uint32_t full(int s) const { return bars + 8u * uint32_t(s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return bars + 8u * uint32_t(kstages + s); }
  // Tile slot m & 1 released by consumer warpgroup w. One barrier per warpgroup: with short
  // tiles one warpgroup can run two tiles ahead of another, and its arrivals would complete
  // the other's phase of a shared barrier.
  __device__ __forceinline__ uint32_t tile_empty(int m, int w) const {
    return bars + 8u * uint32_t(2 * kstages + cwg * (m & 1) + w);
  }
  // Arrivals that release nothing go here (never waited on).
  __device__ __forceinline__ uint32_t scratch() const { return bars + 8u * uint32_t(2 * kstages + 2 * cwg); }
  // Tile slot m & 1 written: every producer thread arrives after its writes to the slot.
  __device__ __forceinline__ uint32_t tile_full(int m) const {
    return bars + 8u * uint32_t(2 * kstages + 2 * cwg + 1 + (m & 1));
  }
  __device__ __forceinline__ uint32_t stage(int s, int bytes) const { return stages0 + uint32_t(s) * uint32_t(bytes); }
  // The trap record's address (trap_record.h), kept in shared memory past the barriers' lines: a
  // wait that times out loads it there, so no register holds it through the k loops.
  __device__ __forceinline__ uint32_t trap_slot() const { return bars + 8u * uint32_t(barrier_line_words(kstages, cwg)); }
};

constexpr uint32_t kWaitNs = 20000;

// A barrier wait: try_wait sleeps up to kWaitNs per poll; after trap::kWaitLimitNs it records
// the barrier (its index after ring.bars), the parity, the ring's length, the current phase
// parity of every barrier (bit b: barrier b; read with mbarrier.test_wait, never as a word),
// both tile slots' descriptors (t, n, nvar, g0) and the SM, and traps. No call: it may sit
// between a warpgroup's wgmma issue and wait.
__device__ __forceinline__ void wait_bar(const Ring& ring, uint32_t bar, uint32_t parity, int site) {
  ptx::mbar_wait<kWaitNs>(bar, parity, trap::kWaitLimitNs, [&] {
    uint64_t rec;
    asm volatile("ld.shared.u64 %0, [%1];" : "=l"(rec) : "r"(ring.trap_slot()));
    trap::record_with(reinterpret_cast<int*>(rec), site, [&](auto put) {
      put(int((bar - ring.bars) / 8u));
      put(int(parity));
      put(ring.kstages);
      uint32_t parities = 0;
      for (int b = 0; b < barrier_count(ring.kstages, ring.cwg); ++b) parities |= ptx::mbar_phase_parity(ring.bars + 8u * uint32_t(b)) << b;
      put(int(parities));
      for (int j = 0; j < 2; ++j) {
        const uint32_t d = ring.tiles + uint32_t(j) * ring.slot_bytes;
        for (int f : {0, 3, 4, 5}) {  // TileDesc t, n, nvar, g0
          int v;
          asm volatile("ld.shared.s32 %0, [%1];" : "=r"(v) : "r"(d + 4u * uint32_t(f)));
          put(v);
        }
      }
      int sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      put(sm);
    });
    __trap();
  });
}

// A consumer thread's byte offsets in a group's codes and scales: warp wi's atom, then the lane's
// place in it (lane_code_offset, lane_scale_offset). Made opaque to ptxas (reg_fence) so that it
// keeps them in two registers instead of deriving them from the thread index again in every
// k-block (S2R, masks and shifts in the k loops' SASS).
template <WeightFormat F>
struct ThreadOffsets {
  uint32_t code, scale;
  __device__ __forceinline__ ThreadOffsets(int wi, int lane)
      : code(uint32_t(wi * atom_code_bytes(F)) + lane_code_offset(lane)),
        scale(uint32_t(wi * atom_scale_bytes(F)) + lane_scale_offset<F>(lane)) {
    // Not for bf16 (16-byte loads per step): there it added 5-12 instructions a k-block.
    if constexpr (F != WeightFormat::kBf16) {
      ptx::reg_fence(code);
      ptx::reg_fence(scale);
    }
  }
};

// One k16 step of a group's A fragment, in two halves so that the first can run while earlier
// wgmmas read the registers the second writes. step_unpack (packed formats): the step's tiny
// values and multipliers, the k-block's codes loaded at step 0 (one 16-byte load per lane).
template <WeightFormat F>
__device__ __forceinline__ void step_unpack(uint32_t lane_codes, int q, AtomRegs<F>& blk,
                                            const StepScales<F>& sc, StepTiny& u) {
  if constexpr (F != WeightFormat::kBf16) {
    if (q == 0) load_lane_words<F>(lane_codes, blk);
    StepCodes<F> c;
    block_step_codes<F>(blk, q, c);
    unpack_step<F>(c, sc, q, u);
  }
}
// step_fragment: the A registers (the wgmma that last read them has retired): bf16 codes as they
// are, packed formats multiplied; pinned before the wgmma fence (volatile asms keep their order).
template <WeightFormat F>
__device__ __forceinline__ void step_fragment(uint32_t lane_codes, int q, const StepTiny& u,
                                              uint32_t (&a)[4]) {
  if constexpr (F == WeightFormat::kBf16) {
    StepCodes<F> c;
    load_step_codes<F>(lane_codes, q, c);
    a[0] = c.w[0], a[1] = c.w[1], a[2] = c.w[2], a[3] = c.w[3];
  } else {
    scale_step(u, a);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) ptx::reg_fence(a[i]);
}

// The k loop of a short tile (the wide weight tile; T: the kernel's PTraits). Each k16 step issues
// one wgmma per group of this warpgroup (kNv of them, groups wg + T::kCWG j), each its own commit
// group, and a rolling wait_group kNv - 1 retires the oldest: while the wgmmas of groups
// 1..kNv-1 of step q run, group 0's fragment of step q + 1 is made and issued, and so on, so this
// warpgroup always has kNv - 1 wgmmas in flight (the small-tile kernel: 2) and each group needs
// one A register set (step q + 1's codes are loaded and unpacked ahead, only the
// multiplies wait for the retire). A stage is released by every consumer thread once its last
// wgmma retired, without a branch between a wgmma and its wait (that makes ptxas serialize them,
// C7513).
template <WeightFormat F, class T, int N, int kNv>
__device__ __forceinline__ void tile_mainloop_wide(const Ring& ring, int& stage, uint32_t& phase, int KB, int wg, int wi,
                                              int lane, float (&acc)[kNv][N / 2]) {
  constexpr int kStages = T::kStages;
#pragma unroll
  for (int j = 0; j < kNv; ++j)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[j][i] = 0.0f;
  // This thread's offsets in an atom's codes and scales, held in registers for the whole tile
  // (ThreadOffsets) and added to the stage's warp-uniform addresses: the lane's own addresses.
  const ThreadOffsets<F> to(wi, lane);
  auto code_atom = [&](int st, int j) {
    return ring.stage(st, T::kStageBytes) + T::code_off(false, T::kCWG * j + wg) + to.code;
  };
  auto scale_atom = [&](int st, int j) {
    return ring.stage(st, T::kStageBytes) + T::scale_off(false, T::kCWG * j + wg) + to.scale;
  };
  StepScales<F> sc[kNv];
  StepTiny u[kNv];
  uint32_t a[kNv][4];
  AtomRegs<F> blk[kNv];  // each group's codes of the k-block (packed formats)
  // Step q of group j from stage st: unpacked into u[j], then (its previous wgmma retired) into a[j].
  auto prepare = [&](int st, int j, int q) { step_unpack<F>(code_atom(st, j), q, blk[j], sc[j], u[j]); };
  auto finish = [&](int st, int j, int q) { step_fragment<F>(code_atom(st, j), q, u[j], a[j]); };
  auto issue = [&](int j, uint64_t desc) {
    ptx::wgmma_fence();
    wgmma_rs<N>(acc[j], a[j], desc);
    ptx::wgmma_commit();
  };
  wait_bar(ring, ring.full(stage), phase, trap::kPrefillFull);
#pragma unroll
  for (int j = 0; j < kNv; ++j) {
    load_step_scales<F>(scale_atom(stage, j), sc[j]);
    prepare(stage, j, 0);
  }
  int prev = stage;  // the stage to release once its last wgmma retired (none yet: a no-op below)
  bool have_prev = false;
  for (int kb = 0; kb < KB; ++kb) {
    const uint64_t desc0 = ptx::smem_desc_k128(ring.stage(stage, T::kStageBytes));
    const int next = stage + 1 == kStages ? 0 : stage + 1;
    const uint32_t next_phase = next == 0 ? phase ^ 1 : phase;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint64_t desc = desc0 + 2 * q;
#pragma unroll
      for (int j = 0; j < kNv; ++j) {
        finish(stage, j, q);
        issue(j, desc);
        if constexpr (kNv > 1) {
          if (j + 1 < kNv) {
            // Group j + 1's previous wgmma (at q = 0 and j + 2 = kNv: the last of the previous stage).
            ptx::wgmma_wait<kNv - 1>();
            if (q == 0 && j + 2 == kNv) {
              // Every wgmma of the previous stage has retired: release it (all threads arrive; on
              // the tile's first stage the arrival goes to a scratch barrier, so there is no branch).
              ptx::mbar_arrive(have_prev ? ring.empty(prev) : ring.scratch());
            }
          }
        }
      }
      // Step q + 1 (or the next stage's step 0) while these run.
      if (q < 3) {
#pragma unroll
        for (int j = 0; j < kNv; ++j) prepare(stage, j, q + 1);
      } else if (kb + 1 < KB) {
        wait_bar(ring, ring.full(next), next_phase, trap::kPrefillFull);
#pragma unroll
        for (int j = 0; j < kNv; ++j) {
          load_step_scales<F>(scale_atom(next, j), sc[j]);
          prepare(next, j, 0);
        }
      }
      if constexpr (kNv > 1) {
        ptx::wgmma_wait<kNv - 1>();  // group 0's wgmma of this step
      } else {
        ptx::wgmma_wait<0>();
        if (q == 3) ptx::mbar_arrive(ring.empty(stage));
      }
    }
    prev = stage;
    have_prev = true;
    stage = next;
    phase = next_phase;
  }
  ptx::wgmma_wait<0>();
  if constexpr (kNv > 1) ptx::mbar_arrive(ring.empty(prev));
#pragma unroll
  for (int j = 0; j < kNv; ++j)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) ptx::reg_fence(acc[j][i]);
}

// acc[j][i]: rows g (i % 4 < 2) / g + 8 of this warp's 16 rows of group g0 + 2 j + wg, token
// 8 (i / 4) + 2 c + i % 2. The epilogue runs while this warpgroup's tensor work waits, so it is
// kept short: the activation chosen once per tile (not per element), no branch around an
// element (the store is predicated), each thread's outputs addressed from one base pointer.
// Measured (H100, gpt-oss-120b 8192 tokens): the per-element form took ~55 instructions an
// output and ~29% of GEMM1's time.
template <Activation A, int N, int kNv, int kCWG, class Slot>
__device__ __forceinline__ void epilogue_gemm1(const PrefillArgs& p, const Slot& ts, int wg, int wi, int lane,
                                               const float (&acc)[kNv][N / 2]) {
  const TileDesc& d = ts.d;
  const int g = lane >> 2, c = lane & 3;
  const int live = d.n - 2 * c;  // this thread's token t (tile token 2 c + t) is stored if t < live
  const uint32_t cols = uint32_t(p.dims.N_pad / 2);
#pragma unroll
  for (int j = 0; j < kNv; ++j) {
    const int group = d.g0 + kCWG * j + wg;
    const int lr = (kCWG * j + wg) * kGroupRows + wi * kSubtileRows + g;  // the tile's row of g
    const float sg = ts.scale[lr], sh = ts.scale[lr + 8], bg = ts.bias[lr], bh = ts.bias[lr + 8];
    // Tokens 2 c + 8 q + h: one pointer per h, stepped by 8 rows.
    uint16_t* o0 = p.out_act + int64_t(d.row0 + 2 * c) * cols + (group * (kGroupRows / 2) + wi * 8 + g);
    uint16_t* o1 = o0 + cols;
#pragma unroll
    for (int q = 0; q < N / 8; ++q) {
      const float v0 = activation_of<A>(p.act, acc[j][4 * q] * sg + bg, acc[j][4 * q + 2] * sh + bh);
      const float v1 = activation_of<A>(p.act, acc[j][4 * q + 1] * sg + bg, acc[j][4 * q + 3] * sh + bh);
      ptx::st_global_if(o0, __bfloat16_as_ushort(__float2bfloat16_rn(v0)), 8 * q < live);
      ptx::st_global_if(o1, __bfloat16_as_ushort(__float2bfloat16_rn(v1)), 8 * q + 1 < live);
      o0 += 8 * cols;
      o1 += 8 * cols;
    }
  }
}

template <int N, int kNv, int kCWG, class Slot>
__device__ __forceinline__ void epilogue_gemm2(const PrefillArgs& p, const Slot& ts, int wg, int wi, int lane,
                                               const float (&acc)[kNv][N / 2]) {
  const TileDesc& d = ts.d;
  const int g = lane >> 2, c = lane & 3;
  const int live = d.n - 2 * c;
  const uint32_t cols = uint32_t(p.out_cols);
#pragma unroll
  for (int j = 0; j < kNv; ++j) {
    const int group = d.g0 + kCWG * j + wg;
    const int lr = (kCWG * j + wg) * kGroupRows + wi * kSubtileRows + g;
    const float sg = ts.scale[lr], sh = ts.scale[lr + 8], bg = ts.bias[lr], bh = ts.bias[lr + 8];
    const int rg = group * kGroupRows + wi * kSubtileRows + g;  // output columns rg, rg + 8
    const bool okg = rg < int(cols), okh = rg + 8 < int(cols);
    float* o0 = p.out_f32 + int64_t(d.row0 + 2 * c) * cols + rg;
    float* o1 = o0 + cols;
#pragma unroll
    for (int q = 0; q < N / 8; ++q) {
      const float w0 = ts.w[2 * c + 8 * q], w1 = ts.w[2 * c + 8 * q + 1];
      const bool s0 = 8 * q < live, s1 = 8 * q + 1 < live;
      ptx::st_global_if(o0, (acc[j][4 * q] * sg + bg) * w0, s0 && okg);
      ptx::st_global_if(o0 + 8, (acc[j][4 * q + 2] * sh + bh) * w0, s0 && okh);
      ptx::st_global_if(o1, (acc[j][4 * q + 1] * sg + bg) * w1, s1 && okg);
      ptx::st_global_if(o1 + 8, (acc[j][4 * q + 3] * sh + bh) * w1, s1 && okh);
      o0 += 8 * cols;
      o1 += 8 * cols;
    }
  }
}

template <int N, int kNv, int kCWG, class Slot>
__device__ __forceinline__ void tile_epilogue(const PrefillArgs& p, const Slot& ts, int wg, int wi, int lane,
                                              const float (&acc)[kNv][N / 2]) {
  if (p.gemm2) {
    epilogue_gemm2<N, kNv, kCWG>(p, ts, wg, wi, lane, acc);
  } else {
    switch (p.act.kind) {
      case Activation::kSwigluOai: epilogue_gemm1<Activation::kSwigluOai, N, kNv, kCWG>(p, ts, wg, wi, lane, acc); break;
      case Activation::kSiluClamped: epilogue_gemm1<Activation::kSiluClamped, N, kNv, kCWG>(p, ts, wg, wi, lane, acc); break;
      default: epilogue_gemm1<Activation::kSilu, N, kNv, kCWG>(p, ts, wg, wi, lane, acc); break;
    }
  }
}

// The k loop of a tall tile: this warpgroup's group (g0 + wg) against the token tile, one wgmma
// m64nN per k16 step, each its own commit group; the step's A fragment lives in one of two
// register sets (step parity), so a rolling wait_group 1 keeps a whole step in flight
// while the next step's fragment is made: its codes are loaded and unpacked while two steps run,
// and only the multiplies into the other set wait for the older step to retire. A stage is
// released by every consumer thread once its last step retired, without a branch between a
// wgmma and its wait (a branch there makes ptxas serialize them, C7513).
template <WeightFormat F, int N>
__device__ __forceinline__ void tile_mainloop_tall(const Ring& ring, int& stage, uint32_t& phase, int KB, int wg,
                                                   int wi, int lane, float (&acc)[N / 2]) {
  using T = PTraits<F>;
  constexpr int kStages = T::kStages;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  const ThreadOffsets<F> to(wi, lane);  // as in tile_mainloop_wide
  auto code_atom = [&](int st) { return ring.stage(st, T::kStageBytes) + T::code_off(true, wg) + to.code; };
  auto scale_atom = [&](int st) { return ring.stage(st, T::kStageBytes) + T::scale_off(true, wg) + to.scale; };
  StepScales<F> sc;
  StepTiny u;
  uint32_t a[2][4];
  AtomRegs<F> blk;  // the k-block's codes (packed formats)
  // Step q from stage st: unpacked into u, then (the step that used set r retired) into a[r].
  auto prepare = [&](int st, int q) { step_unpack<F>(code_atom(st), q, blk, sc, u); };
  auto finish = [&](int st, int r, int q) { step_fragment<F>(code_atom(st), q, u, a[r]); };
  wait_bar(ring, ring.full(stage), phase, trap::kPrefillFull);
  load_step_scales<F>(scale_atom(stage), sc);
  prepare(stage, 0);
  finish(stage, 0, 0);
  int prev = stage;  // the stage to release once its last step retired (none yet: a no-op below)
  bool have_prev = false;
  for (int kb = 0; kb < KB; ++kb) {
    const uint64_t desc0 = ptx::smem_desc_k128(ring.stage(stage, T::kStageBytes));
    const int next = stage + 1 == kStages ? 0 : stage + 1;
    const uint32_t next_phase = next == 0 ? phase ^ 1 : phase;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = q & 1;  // four steps per k-block: the set alternates within and across blocks
      const uint64_t desc = desc0 + 2 * q;
      ptx::wgmma_fence();
      wgmma_rs<N>(acc, a[r], desc);
      ptx::wgmma_commit();
      // Step q + 1 (or the next stage's step 0) while steps q - 1 and q run.
      if (q < 3) {
        prepare(stage, q + 1);
      } else if (kb + 1 < KB) {
        wait_bar(ring, ring.full(next), next_phase, trap::kPrefillFull);
        load_step_scales<F>(scale_atom(next), sc);
        prepare(next, 0);
      }
      ptx::wgmma_wait<1>();  // step q - 1 (the previous stage's last at q = 0) has retired
      if (q == 0) {
        // Every wgmma of the previous stage has retired: release it (all threads arrive; on the
        // tile's first stage the arrival goes to a scratch barrier, so there is no branch here).
        ptx::mbar_arrive(have_prev ? ring.empty(prev) : ring.scratch());
      }
      if (q < 3) {
        finish(stage, r ^ 1, q + 1);
      } else if (kb + 1 < KB) {
        finish(next, r ^ 1, 0);
      }
    }
    prev = stage;
    have_prev = true;
    stage = next;
    phase = next_phase;
  }
  ptx::wgmma_wait<0>();
  ptx::mbar_arrive(ring.empty(prev));
#pragma unroll
  for (int i = 0; i < N / 2; ++i) ptx::reg_fence(acc[i]);
}

template <WeightFormat F, class T, int N, int kNv>
__device__ __forceinline__ void run_wide(const PrefillArgs& p, const Ring& ring, const typename T::Slot& ts, int& stage,
                                         uint32_t& phase, int KB, int wg, int wi, int lane) {
  float acc[kNv][N / 2];
  tile_mainloop_wide<F, T, N, kNv>(ring, stage, phase, KB, wg, wi, lane, acc);
  tile_epilogue<N, kNv, T::kCWG>(p, ts, wg, wi, lane, acc);
}

template <WeightFormat F, int N>
__device__ __forceinline__ void run_tall(const PrefillArgs& p, const Ring& ring, const typename PTraits<F>::Slot& ts, int& stage,
                                         uint32_t& phase, int KB, int wg, int wi, int lane) {
  float acc[1][N / 2];
  tile_mainloop_tall<F, N>(ring, stage, phase, KB, wg, wi, lane, acc[0]);
  tile_epilogue<N, 1, kConsumerWGs>(p, ts, wg, wi, lane, acc);  // the tall tile's group g0 + wg is the short tile's j = 0
}

template <WeightFormat F, int kNv>
__device__ __forceinline__ void run_wide_variant(const PrefillArgs& p, const Ring& ring, const typename PTraits<F>::Slot& ts, int& stage,
                                            uint32_t& phase, int KB, int wg, int wi, int lane, int v) {
  static_assert(kVariants == 9, "one case per variant");
  switch (v) {
    case 0: run_wide<F, PTraits<F>, 16, kNv>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
    case 1: run_wide<F, PTraits<F>, 32, kNv>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
    case 2: run_wide<F, PTraits<F>, 48, kNv>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
    case 3: run_wide<F, PTraits<F>, 64, kNv>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
    case 4: run_wide<F, PTraits<F>, 80, kNv>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
    default: run_wide<F, PTraits<F>, 96, kNv>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
  }
}

template <WeightFormat F>
__device__ __forceinline__ void run_tall_variant(const PrefillArgs& p, const Ring& ring, const typename PTraits<F>::Slot& ts, int& stage,
                                                 uint32_t& phase, int KB, int wg, int wi, int lane, int v) {
  switch (v) {
    case 6: run_tall<F, 128>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
    case 7: run_tall<F, 160>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
    default: run_tall<F, 192>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
  }
}

// The small-tile kernel's tiles: kNv of this warpgroup's groups (1..3; fewer in a matrix's last
// weight tile), N = 16 or 32.
template <WeightFormat F, int kNv>
__device__ __forceinline__ void run_small_variant(const PrefillArgs& p, const Ring& ring,
                                                  const typename PTraits<F, true>::Slot& ts, int& stage, uint32_t& phase,
                                                  int KB, int wg, int wi, int lane, int v) {
  using T = PTraits<F, true>;
  static_assert(kSmallN == 32, "one case per N");
  switch (v) {
    case 0: run_wide<F, T, 16, kNv>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
    default: run_wide<F, T, 32, kNv>(p, ring, ts, stage, phase, KB, wg, wi, lane); break;
  }
}

// ---- the kernel --------------------------------------------------------------------------------
template <WeightFormat F, bool kSmall>
__global__ void __launch_bounds__(PTraits<F, kSmall>::kThreads, 1)
    prefill_gemm_kernel(const __grid_constant__ PrefillArgs args) {
  using T = PTraits<F, kSmall>;
  constexpr int kStages = T::kStages;
  constexpr int kCWG = T::kCWG;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_prefix[kMaxExperts + 1];  // tiles of the active experts before each
  __shared__ typename T::Slot s_tile[2];
  // The barriers in 128-byte lines of their own, then the trap record's address.
  __shared__ alignas(ptx::kBarrierLine) uint64_t s_bars[barrier_line_words(kStages, kCWG) + 1];
  __shared__ int s_num_active;

  Ring ring;
  ring.bars = ptx::smem_addr(s_bars);
  // The 128-byte swizzle wants 1024-byte atoms. The address is derived from the shared window
  // (not the opaque ptx::smem_base) so that ptxas knows it is uniform and keeps the wgmma
  // descriptors in uniform registers: a descriptor moved there between two wgmmas of a group
  // makes it serialize them (C7513).
  ring.stages0 = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  ring.kstages = kStages;
  ring.cwg = kCWG;
  ring.tiles = ptx::smem_addr(s_tile);
  ring.slot_bytes = uint32_t(sizeof(typename T::Slot));
  // Warpgroup index, broadcast so that ptxas knows it is warp-uniform: values computed under the
  // role branch (stage addresses, wgmma descriptors) then stay in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x) / kWG, 0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(ring.full(s), kProducerWarps);  // each producer warp posts its copies' bytes
      ptx::mbar_init(ring.empty(s), kCWG * kWG);  // every consumer thread releases its reads
    }
    for (int w = 0; w < kCWG; ++w) {
      ptx::mbar_init(ring.tile_empty(0, w), kWG);  // every thread of warpgroup w, after its epilogue
      ptx::mbar_init(ring.tile_empty(1, w), kWG);
    }
    // A warp's arrive counts its 32 lanes at once: every count here is a multiple of 32 (the
    // full barriers' extra arrival is one thread's), so no arrival can take one below zero.
    ptx::mbar_init(ring.scratch(), kCWG * kWG);
    ptx::mbar_init(ring.tile_full(0), kProducerThreads);
    ptx::mbar_init(ring.tile_full(1), kProducerThreads);
    s_bars[barrier_line_words(kStages, kCWG)] = reinterpret_cast<uint64_t>(args.trap);
    ptx::fence_barrier_init();
  }

  // The active experts come from the plan kernel (and GEMM1's output from the previous launch).
  ptx::grid_dependency_wait();
  const DeviceWork& work = args.work;
  if (threadIdx.x == 0) s_num_active = *work.num_active;
  __syncthreads();
  const int num_active = s_num_active;
  if (num_active == 0) {
    // Nothing to multiply (no token, or the device chose the decode kernel: kernel_choice_sm90.cuh):
    // out before the tile scan. No CTA claims or counts, so the counters stay at zero.
    ptx::launch_dependents();
    ptx::mbar_inval_at_exit(ring.bars, barrier_count(kStages, kCWG));
    return;
  }
  const int G = int(args.dims.groups());
  // Weight tiles per token tile of n rows: tall (two groups) or short (four).
  auto weight_tiles = [&](int n) {
    const int groups = T::tile_groups(n > kHalfN);
    return (G + groups - 1) / groups;
  };
  // An expert's c rows: split.tiles - 1 token tiles of split.rows, then the last one.
  auto expert_tiles = [&](int c) {
    if (c <= 0) return 0;
    const TokenSplit sp = T::token_split(c);
    return (sp.tiles - 1) * weight_tiles(sp.rows) + weight_tiles(c - (sp.tiles - 1) * sp.rows);
  };
  {
    // Tiles per active expert, exclusive prefix sum over the CTA.
    constexpr int kItems = (kMaxExperts + T::kThreads - 1) / T::kThreads;
    using Scan = typename T::Scan;
    __shared__ typename Scan::TempStorage scan_tmp;
    int v[kItems], x[kItems], total;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int a = threadIdx.x * kItems + i;
      v[i] = a < num_active ? expert_tiles(work.count[a]) : 0;
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

  if (wg == kCWG) {
    // ---------------- producer ----------------
    ptx::setmaxnreg_dec<T::kProducerRegs>();
    const int pt = threadIdx.x - kCWG * kWG;
    const bool lead = pt == 0;
    const uint64_t map = reinterpret_cast<uint64_t>(&args.in_map);
    const uint64_t map_big = reinterpret_cast<uint64_t>(&args.in_map_big);
    int stage = 0;
    uint32_t phase = 0;
    int t = blockIdx.x;
    const int P = int(gridDim.x);
    for (int m = 0;; ++m) {
      typename T::Slot& slot = s_tile[m & 1];
      // Tile m - 2's epilogue is done in both consumer warpgroups.
      for (int w = 0; w < kCWG; ++w) wait_bar(ring, ring.tile_empty(m, w), ((m >> 1) & 1) ^ 1, trap::kPrefillTileEmpty);
      int claim = 0;
      if (lead) {
        TileDesc d{};
        d.t = t < total ? t : -1;
        if (t < total) {
          claim = P + atomicAdd(args.tile_counter, 1);  // the next tile, needed a tile from now
          int lo = 0, hi = num_active - 1;  // the active expert a with prefix[a] <= t < prefix[a + 1]
          while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_prefix[mid] <= t) lo = mid; else hi = mid - 1;
          }
          // The expert's token tiles but the last, token tile fastest (CTAs running at the same
          // time share a weight tile in L2), then the last token tile's weight tiles.
          const int count = work.count[lo];
          const TokenSplit sp = T::token_split(count);
          const int f = sp.tiles - 1;
          int local = t - s_prefix[lo], tt, wt;
          if (local < f * weight_tiles(sp.rows)) {
            wt = local / f;
            tt = local - wt * f;
          } else {
            wt = local - f * weight_tiles(sp.rows);
            tt = f;
          }
          // Weight tile wt of the token tile's kind. The small-tile kernel spreads the matrix's
          // groups evenly over its weight tiles (64 groups: 8 tiles of 8, not 7 of 9 and one of 1,
          // whose k loop would take a third of a tile's time for a ninth of its work).
          const int n = min(sp.rows, count - tt * sp.rows);
          const int groups = T::tile_groups(n > kHalfN);
          int g0, ng;
          if constexpr (kSmall) {
            const int tiles = (G + groups - 1) / groups;
            g0 = wt * G / tiles;
            ng = (wt + 1) * G / tiles - g0;
          } else {
            g0 = wt * groups;
            ng = min(groups, G - g0);
          }
          d.expert = work.expert[lo];
          d.row0 = work.row_start[lo] + tt * sp.rows;
          d.n = n;
          d.nvar = n_variant(d.n);
          d.g0 = g0;
          d.ng = ng;
        }
        slot.d = d;
      }
      ptx::named_sync(1, kProducerThreads);
      // The fields a copy's operands come from, broadcast from lane 0 (the same values in every
      // lane): the compiler then knows them warp-uniform and builds the operands in uniform
      // registers, where a value it must assume divergent takes R2UR moves and an elect loop per
      // copy (1-6% of the GEMMs at 1024-8192 tokens on the H100; docs/perf/log.md).
      TileDesc d = slot.d;
      d.row0 = __shfl_sync(0xffffffffu, d.row0, 0);
      d.expert = __shfl_sync(0xffffffffu, d.expert, 0);
      d.g0 = __shfl_sync(0xffffffffu, d.g0, 0);
      d.ng = __shfl_sync(0xffffffffu, d.ng, 0);
      d.nvar = __shfl_sync(0xffffffffu, d.nvar, 0);
      if (d.t < 0) {
        ptx::mbar_arrive(ring.tile_full(m));  // the slot says "no more tiles"
        break;
      }
      // The tile's token rows [row0, row0 + nrows) as 16-row boxes (rows past n belong to the next
      // expert or to nothing: loaded, multiplied, never stored).
      const int nrows = variant_rows(d.nvar);
      if (args.gemm2)
        for (int r = pt; r < d.n; r += kProducerThreads) slot.w[r] = args.topk_weights[args.row_src[d.row0 + r]];
      {
        // Epilogue constants of the tile's weight rows (rows past the matrix are never stored).
        const int64_t base = int64_t(d.expert) * args.dims.N_pad + int64_t(d.g0) * kGroupRows;
        const int64_t live = min(int64_t(T::kTileRows), args.dims.N_pad - int64_t(d.g0) * kGroupRows);
        for (int r = pt; r < T::kTileRows; r += kProducerThreads) {
          slot.scale[r] = args.row_scale && r < live ? args.row_scale[base + r] : 1.0f;
          slot.bias[r] = args.bias && r < live ? args.bias[base + r] : 0.0f;
        }
      }
      // The slot is complete (the consumers wait for this before they read it).
      ptx::mbar_arrive(ring.tile_full(m));
      const bool tall = variant_tall(d.nvar);
      const int nv_groups = d.ng;
      // The copies of a stage are issued by lane 0 of each producer warp w: the codes and scales of
      // groups w (and w + 4, w + 8 in the small-tile kernel's tiles of up to 9 groups) and its token-row boxes
      // (a single issuing thread is too slow: each copy takes its operands through uniform
      // registers). Sources advance by one k-block per stage.
      constexpr int kWarpGroups = (T::kShortGroups + kProducerWarps - 1) / kProducerWarps;  // per warp at most
      const int pw = __shfl_sync(0xffffffffu, pt >> 5, 0);  // the warp: warp-uniform, as d above
      const bool issuer = (pt & 31) == 0;
      const bool has_group = pw < nv_groups;
      const int my_groups = has_group ? (nv_groups - pw + kProducerWarps - 1) / kProducerWarps : 0;
      const int64_t grp = (int64_t(d.expert) * G + d.g0 + pw) * KB;
      const uint8_t* code_src = args.codes + (has_group ? grp * T::kCodeSlot : 0);
      const uint8_t* scale_src = args.scales + (has_group && T::kScaleSlot > 0 ? grp * T::kScaleSlot : 0);
      // The token rows as TokenBoxes; box c (big ones first) is issued by warp (c + the tile's
      // groups) % 4, so that the warps without a group's copies take the first boxes.
      const TokenBoxes boxes(nrows);
      const int first_box = (pw - nv_groups % kProducerWarps + kProducerWarps) % kProducerWarps;  // this warp's first box
      // This warp's bytes per stage: its group's codes and scales, its boxes (none for a warp past
      // the tile's groups and rows: it still arrives, so it keeps pace with the others).
      uint32_t box_bytes = 0;
      for (int c = first_box; c < boxes.nbox; c += kProducerWarps) box_bytes += boxes.bytes(c);
      const uint32_t my_bytes = uint32_t(my_groups) * uint32_t(T::kCodeSlot + T::kScaleSlot) + box_bytes;
      for (int kb = 0; kb < KB; ++kb) {
        wait_bar(ring, ring.empty(stage), phase ^ 1, trap::kPrefillEmpty);
        const uint32_t sa = ring.stage(stage, T::kStageBytes);
        if (issuer) {
          ptx::mbar_arrive_expect_tx(ring.full(stage), my_bytes);
#pragma unroll
          for (int i = 0; i < kWarpGroups; ++i) {
            if (i < my_groups) {
              // Group pw + 4 i: its k-blocks follow group pw's by 4 KB k-blocks.
              const int64_t skip = int64_t(i) * kProducerWarps * KB;
              bulk_g2s_plain(sa + T::code_off(tall, pw + kProducerWarps * i), code_src + skip * T::kCodeSlot,
                             T::kCodeSlot, ring.full(stage));
              if constexpr (T::kScaleSlot > 0)
                bulk_g2s_plain(sa + T::scale_off(tall, pw + kProducerWarps * i), scale_src + skip * T::kScaleSlot,
                               T::kScaleSlot, ring.full(stage));
            }
          }
          for (int c = first_box; c < boxes.nbox; c += kProducerWarps) {
            const int r = boxes.first_row(c);
            tma_load_2d(sa + uint32_t(r) * kTokenRowBytes, boxes.big(c) ? map_big : map, kb * kKBlock,
                        d.row0 + r, ring.full(stage));
          }
        }
        code_src += T::kCodeSlot;
        scale_src += T::kScaleSlot;
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      if (lead) t = claim;
    }
    // No more tiles (the last slot says so). Every tile this CTA claimed is issued; the last
    // producer out resets the counters.
    if (lead) {
      ptx::fence_acq_rel_gpu();
      if (atomicAdd(args.exit_count, 1) == int(gridDim.x) - 1) {
        ptx::fence_acq_rel_gpu();
        *args.tile_counter = 0;
        *args.exit_count = 0;
      }
    }
  } else {
    // ---------------- consumers ----------------
    ptx::setmaxnreg_inc<T::kConsumerRegs>();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wi = warp & 3;
    int stage = 0;
    uint32_t phase = 0;
    for (int m = 0;; ++m) {
      wait_bar(ring, ring.tile_full(m), (m >> 1) & 1, trap::kPrefillTileFull);  // the tile's slot
      const typename T::Slot& ts = s_tile[m & 1];
      const int tile = ts.d.t;
      if (tile < 0) break;
      const int v = ts.d.nvar;
      // This warpgroup's groups of the weight tile: g0 + wg (tall), g0 + wg and g0 + wg + 2 (short).
      // (The small-tile kernel: g0 + wg + 3 j for j < 3.)
      const int nv = variant_tall(v) ? (wg < ts.d.ng ? 1 : 0)
                                     : min(T::kShortGroups / kCWG, max(0, (ts.d.ng - wg + kCWG - 1) / kCWG));
      if (nv == 0) {
        // No group of this weight tile is ours (the last of its expert's): consume the stages
        // without multiplying.
        for (int kb = 0; kb < KB; ++kb) {
          wait_bar(ring, ring.full(stage), phase, trap::kPrefillFull);
          ptx::mbar_arrive(ring.empty(stage));
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      } else if constexpr (kSmall) {
        switch (nv) {
          case 1: run_small_variant<F, 1>(args, ring, ts, stage, phase, KB, wg, wi, lane, v); break;
          case 2: run_small_variant<F, 2>(args, ring, ts, stage, phase, KB, wg, wi, lane, v); break;
          default: run_small_variant<F, 3>(args, ring, ts, stage, phase, KB, wg, wi, lane, v); break;
        }
      } else {
        if (variant_tall(v))
          run_tall_variant<F>(args, ring, ts, stage, phase, KB, wg, wi, lane, v);
        else if (nv == 2)
          run_wide_variant<F, 2>(args, ring, ts, stage, phase, KB, wg, wi, lane, v);
        else
          run_wide_variant<F, 1>(args, ring, ts, stage, phase, KB, wg, wi, lane, v);
      }
      ptx::mbar_arrive(ring.tile_empty(m, wg));
    }
  }
  // Every copy the CTA issued has completed on its full barrier: the barriers are invalidated
  // before the SM gives their memory to the next CTA.
  ptx::mbar_inval_at_exit(ring.bars, barrier_count(kStages, kCWG));
}

}  // namespace moekit::sm90::prefill
