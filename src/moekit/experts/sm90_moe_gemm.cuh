// moekit/experts/sm90_moe_gemm.cuh — grouped mixed-input MoE GEMM for SM90 (H100/H200), decode.
//
// Contract
//   out[row, n] = epilogue( sum_k in[row, k] * W_e[n, k] )   for the rows of every active expert e
//   W: MXFP4 | NVFP4 | MXFP8 | BF16, dequantized exactly to bf16 in registers; bf16 mma.sync
//   m16n8k16 with fp32 accumulation. Weights are the MMA's M side and tokens its N side ("swap
//   AB"): 1..8 tokens of an expert fill one n8 tile and waste nothing of the weight stream.
//   GEMM1 epilogue: row scale (NVFP4) + bias, gated activation, bf16 store of I columns.
//   GEMM2 epilogue: row scale + bias, times the row's top-k weight, fp32 store.
//
// Weight layout (made once by sm90_convert.cpp; sm90_layout.h has the index arithmetic)
//   A matrix [E, N_pad, K_pad], N_pad and K_pad multiples of 64.
//   group    = 64 consecutive kernel rows = 4 subtiles of 16 rows (one per consumer warp)
//   atom     = one subtile x 64 K: the A fragments of 4 k16 steps for the 32 lanes of a warp
//   order    codes[e][group][kblock][subtile][atom bytes], scales likewise: one group's k-blocks
//            are contiguous, so a pipeline stage is one 1-D bulk copy.
//   atom bytes (lane l, k16 step q; fragment element i as in mma.m16n8k16: rows g = l/4 and
//   g+8, k = 16q + 2(l%4) + {0,1} and +8):
//     fp4 (512 B):  word at l*16 + q*4 holds the 8 codes in the order of formats/kernel_pack.h
//     fp8 (1 KB):   two words at (q/2)*512 + l*16 + (q%2)*8
//     bf16 (2 KB):  four bf16x2 at q*512 + l*16
//   scales per atom, 8 rows of bytes indexed by g (lanes 4g..4g+3 share them):
//     MX (32 B):    [g][row g kb0, row g kb1, row g+8 kb0, row g+8 kb1]   (blocks of 32)
//     NV (64 B):    [g] 2 E4M3 words (kernel_pack.h): rows g, g+8 of b, b+1; b = 0, 2 (blocks of 16)
//   GEMM1 rows: in subtile s, rows 0..7 are gate of columns 8s..8s+7 and rows 8..15 the up rows
//   of the same columns, so one thread's accumulators (rows g, g+8) hold gate and up of one
//   output column and the activation happens in registers.
//   Per warp, this A fragment is also the register-A fragment of wgmma.m64nNk16 (each warp of
//   the warpgroup owns 16 rows), so a prefill kernel can read the same bytes.
//
// Work decomposition (persistent, dynamic, deterministic split-K)
//   segment = (active expert, token chunk of <= kTok rows, group of 64 rows); a task is one
//   of S equal k-ranges of a segment, S > 1 only when that shortens the phase's makespan
//   (phase_tasks: few segments of long k, as at one token).
//   Tasks are numbered by the problem alone (phase 0's, then phase 1's); CTA i starts with task
//   i and then claims the next one from a global counter, so SMs that get less bandwidth simply
//   do fewer tasks. A sliced segment is summed in slice order by the CTA that runs its last
//   slice, from the fp32 partials (one slot per task) of the earlier slices once their counter
//   is complete, so the result has the same bits on every run whichever CTA ran what. The
//   producer warp decodes each task once, a task ahead (with the global reads its first stage
//   needs: gather rows, GEMM1 done counts), and hands it to the consumers with its first stage.
//   GEMM2 waits only for the GEMM1 columns it reads (done1); when GEMM2 is one wave, a task that
//   starts before they are stored requests its first stages' weights at once and their x rows
//   after the check. The counters are reset by the last producer to run out of tasks, so no
//   CTA's end waits on an exit barrier.
//
// Pipeline per CTA: warp 4 (producer) issues cp.async.bulk copies of weights, scales (L2
//   evict-first: read once) and the chunk's activation rows into a ring of shared-memory stages,
//   completing on mbarriers; warps 0..3 (consumers) dequantize and multiply. Two CTA shapes:
//   3 CTAs per SM with 5 stages each, or 4 with 4 (MXFP4 on fast-HBM GPUs; sm90_shape.h).
//   Token chunks of kTok = 8, 16 or 24 rows (FusedArgs::chunk_rows; oracle/kernel_choice.h
//   decode_chunk_rows picks them by the rows per expert): a dequantized fragment feeds kTok / 8
//   n8 MMAs, and the longer chunks' x tiles shorten the ring (kRingStages).
//
// Limitations
//   1. Decode-oriented: each chunk of kTok (at most 24) rows re-streams the expert's weights.
//   2. E8M0 scale bytes above 254 - 126 (fp4) / 254 - 120 (fp8) take a second bf16 multiply
//      (kernel flag single_multiply = false); MXFP8 values below 2^-133 flush in bf16.
#pragma once

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>

#include "moekit/common/fastdiv.h"
#include "moekit/common/ptx_sm90.cuh"
#include "moekit/common/trap_record.cuh"
#include "moekit/experts/activation.h"
#include "moekit/experts/sm90_fragment.cuh"
#include "moekit/experts/sm90_layout.h"
#include "moekit/experts/sm90_shape.h"
#include "moekit/formats/dequant.cuh"

namespace moekit::sm90 {

constexpr int kTokens = 8;           // rows per token chunk (N side): one n8 tile
// The 16-row variant (FusedArgs::chunk_rows): chunks of up to two n8 tiles, so an expert of 9-16
// rows streams and dequantizes its weights once instead of twice. Its rings are shorter where the
// larger x tiles would not fit (kRingStages); it computes its own chunk prefix from the counts,
// so it needs the work list in shared memory (E <= kCachedExperts).
constexpr int kTokens16 = 16;
// And of up to three n8 tiles (narrow shape only: 3 stages of 3 CTAs per SM).
constexpr int kTokens24 = 24;
constexpr int kConsumerWarps = kSubtiles;
constexpr int kThreads = (kConsumerWarps + 1) * 32;
// The two CTA shapes (sm90_shape.h says which one a launch takes).
template <GemmShape S>
struct ShapeTraits {
  static constexpr int kStages = S == GemmShape::kWide ? 4 : 5;
  static constexpr int kCtasPerSm = S == GemmShape::kWide ? 4 : 3;  // register cap 65536 / (ctas * kThreads): 136 | 102
};
constexpr int kMaxStages = ShapeTraits<GemmShape::kNarrow>::kStages;  // the larger ring
constexpr uint32_t kWaitSuspendNs = 20000;  // a stage wait sleeps (woken by the phase) up to this
// When phase 2 is a single wave (one token), a phase-2 task whose GEMM1 inputs are not all
// stored when it starts requests the weights of this many stages before its first readiness
// check. Measured (GPT-OSS-120B): at one token 1-2 fill some of the HBM's idle time at the phase
// boundary, 5 delay GEMM1's last tasks by more than they save; with many phase-2 waves (64
// tokens) 2 cost 0.2% (docs/perf/log.md).
constexpr int kEarlyStages = 2;
static_assert(kEarlyStages <= ShapeTraits<GemmShape::kWide>::kStages, "early stages are ring slots");
static_assert(2 * kMaxStages <= 16, "the mbarriers live in the first 128 bytes of shared memory");

// Active experts, written by the prepare kernels (device memory).
struct DeviceWork {
  const int* num_active;    // [1]
  const int* expert;        // [E] active expert ids, ascending
  const int* count;         // [E] rows of each active expert
  const int* row_start;     // [E] its first activation row
  const int* chunk_prefix;  // [E + 1] prefix sums of ceil(count / kTokens)
};

// Members in an order that leaves no implicit padding: the layer compares launch arguments
// bytewise (pipeline/launch_sm90.cuh), and a compiler may leave any bytes in implicit padding.
struct GemmArgs {
  LayoutDims dims;
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const float* row_scale = nullptr;  // [E, N_pad] or null (= 1)
  const float* bias = nullptr;       // [E, N_pad] or null
  const uint16_t* in = nullptr;      // activation rows, stride K_pad (bf16)
  DeviceWork work;
  uint16_t* out_act = nullptr;       // GEMM1: [rows, N_pad / 2] bf16
  float* out_f32 = nullptr;          // GEMM2: [rows, out_cols] fp32
  int64_t out_cols = 0;              // GEMM2: valid columns (H)
  const int32_t* row_src = nullptr;  // row -> token * k + j (GEMM2 weights; gather)
  const float* topk_weights = nullptr;
  float* partials = nullptr;         // [tasks of the phase, kPartialFloats] when segments are sliced (8-row chunks)
  int* counters = nullptr;           // one per segment, zero between launches
  ActivationParams act;
  // Set by launch_moe_gemm: divisions by gather_k and by the groups of 64 rows, on the path from
  // the kernel's start to its first copy.
  FastDiv gather_div, groups_div;
  int gather_k = 0;                  // > 0: read row r from `in` at token row_src[r] / gather_k
  bool single_multiply = true;
  bool gemm2 = false;
  uint16_t pad_ = 0;
};

// GEMM1 then GEMM2 in one persistent launch. A phase-2 stage of expert a covering GEMM2
// k-blocks [kb, kb + n) needs GEMM1 output columns [64 kb, 64 (kb + n)), i.e. GEMM1 groups
// [2 kb, 2 (kb + n)) of a; done1[a * G1 + g] counts the stored (chunk, group g) segments, so
// phase 2 starts on the columns that are ready while phase-1 stragglers finish (the producer
// checks a stage's columns before it issues the stage). nphases = 1 runs args.g[0] alone.
struct FusedArgs {  // no implicit padding (GemmArgs)
  GemmArgs g[2];
  int* done1 = nullptr;         // [E * G1] stored phase-1 segments per (active expert, group)
  int* exit_count = nullptr;    // [1] producers out of tasks; the last resets the counters and itself
  unsigned long long* trace = nullptr;  // optional [grid, kTraceEvents] %globaltimer stamps
  int* task_counter = nullptr;  // [1] tasks claimed beyond the first P; zero between launches
  int* trap = nullptr;          // set by launch_moe_gemm: where a timed-out wait writes its record (trap_record.h)
  int nphases = 2;
  int slice_cost = 4;           // per-task cost of a slice (partial, counter, combine) in k-blocks
  FastDiv grid_div;             // set by launch_moe_gemm: division by the grid size
  int chunk_rows = kTokens;     // host side: which variant launch_moe_gemm launches (8, 16 or 24)
};

// Trace events (ns, %globaltimer), written by consumer warp 0 / the producer when args.trace.
enum TraceEvent { kTrStart, kTrFirstData, kTrPhase0End, kTrWaitBegin, kTrWaitEnd, kTrPhase1FirstData, kTrEnd,
                  kTrEntry, kTrDecoded, kTraceEvents };
// After the events, per CTA: the first kTraceTasks tasks it ran, {phase << 32 | index in the phase,
// first stage issued (producer), first stage in shared memory, stored (consumer warp 0)}.
constexpr int kTraceTasks = 64;
constexpr int kTraceRecord = 4;
constexpr int kTraceStride = kTraceEvents + kTraceRecord * kTraceTasks;
__device__ __forceinline__ unsigned long long globaltimer() { return ptx::globaltimer_ns(); }

constexpr int kCachedExperts = 256;  // work list entries kept in shared memory

template <WeightFormat F, int kTok = kTokens>
struct Traits {
  static constexpr int kStageK = F == WeightFormat::kBf16 ? 1 : F == WeightFormat::kMxfp8 ? 2 : 4;
  static constexpr int kAtomCode = F == WeightFormat::kMxfp8 ? 1024 : F == WeightFormat::kBf16 ? 2048 : 512;
  static constexpr int kAtomScale = F == WeightFormat::kNvfp4 ? 64 : F == WeightFormat::kBf16 ? 0 : 32;
  static constexpr int kStageCode = kStageK * kSubtiles * kAtomCode;
  static constexpr int kStageScale = kStageK * kSubtiles * kAtomScale;
  static constexpr int kXRow = kStageK * kKBlock * 2 + 16;  // +16 B: ldmatrix rows hit distinct banks
  static constexpr int kStageX = kTok * kXRow;
  static constexpr int kStageBytes = kStageCode + kStageScale + kStageX;
};
// Stages of a ring: the shape's count, or fewer where the CTAs of the shape would not fit in an
// SM's shared memory (228 KB, 1 KB reserved per CTA, kStaticSmem of static shared memory: the
// kernels use 5376-5504 B, cuobjdump -res-usage; the 4x4 MXFP4 ring fits with exactly 5504). The
// 16-row variant: MXFP4 / NVFP4 3x4 and 4x3, MXFP8 and BF16 3x5; the 24-row one 3x3 (MXFP8 3x4).
// The runtime occupancy query (gemm_ctas_per_sm) is what sizes the grid.
constexpr int kSmemPerSm = 228 * 1024;
constexpr int kStaticSmem = 5504;
template <WeightFormat F, GemmShape S, int kTok>
constexpr int kRingStages = [] {
  constexpr int fit = (kSmemPerSm / ShapeTraits<S>::kCtasPerSm - 1024 - kStaticSmem - ptx::kBarrierLine) /
                      Traits<F, kTok>::kStageBytes;
  return fit < ShapeTraits<S>::kStages ? fit : ShapeTraits<S>::kStages;
}();
// Dynamic shared memory of a CTA: the mbarriers' 128-byte line, then the ring.
template <WeightFormat F, GemmShape S, int kTok = kTokens>
constexpr int kSmemBytes = ptx::kBarrierLine + kRingStages<F, S, kTok> * Traits<F, kTok>::kStageBytes;

// The 8-row rings as they were measured (docs/perf/log.md): a larger static footprint would
// shorten them silently.
static_assert(kRingStages<WeightFormat::kMxfp4, GemmShape::kNarrow, kTokens> == 5 &&
              kRingStages<WeightFormat::kMxfp4, GemmShape::kWide, kTokens> == 4,
              "the 8-row decode rings are 3x5 and 4x4");

template <int kTok>
constexpr int kPartialFloatsOf = kConsumerWarps * 32 * (kTok / 2);
// A partial slot: only 8-row chunks are sliced (phase_tasks), the longer ones come with many segments.
constexpr int kPartialFloats = kPartialFloatsOf<kTokens>;

// Where a (chunk, group) segment lives.
struct Segment {
  int a, expert, n, row0, group;
};

// The work list as the kernel reads it: shared memory when it fits, else global.
struct WorkView {
  const int* prefix;
  const int* expert;
  const int* count;
  const int* row_start;
};

template <int kTok>
__device__ __forceinline__ Segment decode_segment(const WorkView& w, int seg, const FastDiv& groups, int num_active,
                                                  int* cursor) {
  const int* prefix = w.prefix;
  const int chunk = groups.div(seg);
  int a = *cursor;
  if (prefix[a + 1] <= chunk) {  // binary search for the active expert owning this chunk
    int lo = a + 1, hi = num_active - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (prefix[mid] <= chunk) lo = mid; else hi = mid - 1;
    }
    a = lo;
  }
  *cursor = a;
  const int c = chunk - prefix[a];
  Segment s;
  s.a = a;
  s.expert = w.expert[a];
  s.n = min(kTok, w.count[a] - c * kTok);
  s.row0 = w.row_start[a] + c * kTok;
  s.group = seg - chunk * int(groups.d);
  return s;
}

// ---- one pipeline stage of one consumer warp ---------------------------------------------------
// kNkb > 0: the stage holds exactly kNkb atoms (no guards); kNkb == 0: nkb atoms, guarded.
// acc2: even / odd k16-step accumulator chains. The first ntl n8 tiles are multiplied (the
// chunk's rows rounded up to 8): the columns of tokens past the chunk's count hold stale shared
// memory and are never stored.
template <WeightFormat F, bool kSingle, int kNkb, int kTok>
__device__ __forceinline__ void consume_stage(uint32_t cs, uint32_t ss, uint32_t xs, int lane, int nkb, int ntl,
                                              float (&acc2)[2][kTok / 8][4]) {
  using T = Traits<F, kTok>;
  constexpr int kMax = kNkb > 0 ? kNkb : T::kStageK;
  AtomRegs<F> r[2];
  load_atom_words<F>(cs, lane, r[0]);
  load_atom_scales<F, kSingle>(ss, lane, r[0]);
#pragma unroll
  for (int b = 0; b < kMax; ++b) {
    if (kNkb > 0 || b < nkb) {
      if (b + 1 < kMax && (kNkb > 0 || b + 1 < nkb)) {  // the next atom's loads overlap this one's math
        load_atom_words<F>(cs + (b + 1) * kSubtiles * T::kAtomCode, lane, r[(b + 1) & 1]);
        load_atom_scales<F, kSingle>(ss + (b + 1) * kSubtiles * T::kAtomScale, lane, r[(b + 1) & 1]);
      }
      const AtomRegs<F>& cur = r[b & 1];
#pragma unroll
      for (int qp = 0; qp < 2; ++qp) {
        uint32_t a0[4], a1[4];
        fragment<F, kSingle>(cur, 2 * qp, a0);
        fragment<F, kSingle>(cur, 2 * qp + 1, a1);
        // ldmatrix x4: 8 tokens x k16 steps 2qp and 2qp+1 (four 8x8 matrices, 32 k).
        const uint32_t kofs = uint32_t(b * kKBlock + qp * 32) * 2;
#pragma unroll
        for (int nt = 0; nt < kTok / 8; ++nt) {
          if (nt > 0 && nt >= ntl) break;  // uniform over the warp
          uint32_t bf[4];
          ptx::ldmatrix_x4(bf, xs + uint32_t(nt * 8 * T::kXRow) + kofs);
          ptx::mma_bf16_16816(acc2[0][nt], a0, bf[0], bf[1]);
          ptx::mma_bf16_16816(acc2[1][nt], a1, bf[2], bf[3]);
        }
      }
    }
  }
}

// ---- epilogues -----------------------------------------------------------------------------
// acc[nt][0..3]: rows (g, g, g+8, g+8) x tokens (8nt + 2c, +1, 8nt + 2c, +1) of subtile `warp`.
// Per-row epilogue constants of this thread's rows g and g+8, loaded when a segment starts so
// that their latency hides under the k loop.
template <int kTok>
struct RowConsts {
  float sg, sh, bg, bh;
  float w[kTok / 8][2];  // GEMM2: top-k weight of this thread's tokens 8 nt + 2c + h
};
template <int kTok>
__device__ __forceinline__ RowConsts<kTok> row_consts(const GemmArgs& p, const Segment& s, int warp, int lane) {
  const int64_t Rg = s.group * kGroupRows + warp * kSubtileRows + (lane >> 2);
  const int64_t base = int64_t(s.expert) * p.dims.N_pad;
  RowConsts<kTok> r;
  r.sg = p.row_scale ? p.row_scale[base + Rg] : 1.0f;
  r.sh = p.row_scale ? p.row_scale[base + Rg + 8] : 1.0f;
  r.bg = p.bias ? p.bias[base + Rg] : 0.0f;
  r.bh = p.bias ? p.bias[base + Rg + 8] : 0.0f;
  if (p.gemm2) {
    const int c = lane & 3;
#pragma unroll
    for (int nt = 0; nt < kTok / 8; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tok = nt * 8 + 2 * c + h;
        r.w[nt][h] = tok < s.n ? p.topk_weights[p.row_src[s.row0 + tok]] : 0.0f;
      }
  }
  return r;
}

template <int kTok>
__device__ __forceinline__ void epilogue(const GemmArgs& p, const Segment& s, int warp, int lane,
                                         const float (&acc)[kTok / 8][4], const RowConsts<kTok>& rc) {
  const int g = lane >> 2, c = lane & 3;
  const int64_t N_pad = p.dims.N_pad;
  const int64_t Rg = s.group * kGroupRows + warp * kSubtileRows + g;  // kernel row of g
  const int64_t Rh = Rg + 8;
  const float sg = rc.sg, sh = rc.sh, bg = rc.bg, bh = rc.bh;
  if (!p.gemm2) {
    const int64_t cols = N_pad / 2;
    const int64_t j = (s.group * kGroupRows + warp * kSubtileRows) / 2 + g;
#pragma unroll
    for (int nt = 0; nt < kTok / 8; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tok = nt * 8 + 2 * c + h;
        if (tok < s.n) {
          const float gate = acc[nt][h] * sg + bg;
          const float up = acc[nt][2 + h] * sh + bh;
          const float v = apply_activation(p.act, gate, up);
          p.out_act[int64_t(s.row0 + tok) * cols + j] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
        }
      }
  } else {
#pragma unroll
    for (int nt = 0; nt < kTok / 8; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tok = nt * 8 + 2 * c + h;
        if (tok < s.n) {
          const int64_t row = s.row0 + tok;
          const float w = rc.w[nt][h];
          if (Rg < p.out_cols) p.out_f32[row * p.out_cols + Rg] = (acc[nt][h] * sg + bg) * w;
          if (Rh < p.out_cols) p.out_f32[row * p.out_cols + Rh] = (acc[nt][2 + h] * sh + bh) * w;
        }
      }
  }
}

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32)); }

// ---- tasks -------------------------------------------------------------------------------------
// The work of both phases is a list of tasks, fixed by the problem alone: phase 0's tasks, then
// phase 1's. A task is one slice of one (chunk, group) segment: segments are cut into S equal
// k-ranges when there are too few of them to keep every CTA busy (S = 1 otherwise). CTA i takes
// task i first, then the next unclaimed one from a global counter, so fast SMs take more tasks
// and all finish together. Task counts fit in int (the host checks).
struct PhaseTasks {
  int segs;    // (chunk, group) segments
  int slices;  // S
  int count;   // segs * S
  int groups, kblocks;
};
// S minimizes the phase's makespan in k-blocks, waves x task length: ceil(segs S / P) x
// (KB / S + 1 + slice_cost [S > 1]), with S <= kMaxSlices. One token, 132 SMs x 3: GPT-OSS-120B
// GEMM1 (360 segments of 45 k-blocks) stays whole, its GEMM2 (180) is cut in two, DeepSeek-V3
// GEMM1 (512 of 112) too; from 8 tokens on nothing is cut. Measured at one token, three slices
// lost to two wherever the model preferred them (DeepSeek-V3: 83.3 against 79.4 us), hence
// the cap (docs/perf/log.md). Integer arithmetic in half k-blocks, the division by P a
// multiply: this runs on the path to the kernel's first copy.
constexpr int kMaxSlices = 2;
constexpr int kMaxSlicedWaves = 4;  // a sliced phase has at most this many tasks per CTA
static_assert(kMaxSlices == 2, "phase_tasks and TaskList::decode handle S = 1 or 2");
__device__ __forceinline__ PhaseTasks phase_tasks(const GemmArgs& p, int chunks, const FastDiv& P, int slice_cost,
                                                  bool may_slice) {
  PhaseTasks t;
  t.groups = int(p.dims.groups());
  t.kblocks = int(p.dims.kblocks());
  t.segs = chunks * t.groups;
  t.slices = 1;
  const int Pn = int(P.d);
  if (may_slice && t.segs > 0 && t.kblocks >= 2 && 2 * t.segs <= kMaxSlicedWaves * Pn) {
    const int one = P.div(t.segs + Pn - 1) * (2 * t.kblocks + 2);
    const int two = P.div(2 * t.segs + Pn - 1) * (t.kblocks + 2 + 2 * slice_cost);
    if (two < one) t.slices = 2;
  }
  t.count = t.segs * t.slices;
  return t;
}

// A task as the producer decodes it; it hands the decoded task to the consumers in shared memory
// with the task's first stage. Its k-range is cut into `stages` pipeline stages of near-equal
// size: stage i carries base + (i < rem) k-blocks (45 blocks: nine of 4, three of 3), so no stage
// carries a lone block.
struct alignas(16) TaskDesc {
  int ph;      // 0 | 1; -1: no more work
  int local;   // index within its phase (its partials slot)
  int seg;     // segment within its phase
  int slice;   // k-range of the segment, 0..S-1
  int kb0;     // first k-block
  int stages, base, rem;
  Segment s;
  unsigned long long issued;  // trace only: %globaltimer when the first stage was issued
  // Phase 2: the GEMM1 groups (two per k-block) that the task reads are [2 kb0, group_end()).
  __device__ __forceinline__ int group_end() const { return 2 * (kb0 + base * stages + rem); }
};

template <int kStageK, int kTok>
struct TaskList {
  PhaseTasks p0, p1;
  int total;
  int hint0 = 0, hint1 = 0;  // decode_segment cursors (tasks are claimed in increasing order)
  FastDiv groups_div0, groups_div1;
  __device__ __forceinline__ int slices(int ph) const { return ph == 0 ? p0.slices : p1.slices; }
  __device__ __forceinline__ TaskDesc decode(int t, const WorkView& wv, int num_active) {
    TaskDesc d;
    d.ph = t < p0.count ? 0 : 1;
    const PhaseTasks& pt = d.ph == 0 ? p0 : p1;
    d.local = d.ph == 0 ? t : t - p0.count;
    const int sh = pt.slices - 1;  // S = 1 or 2
    d.seg = d.local >> sh;
    d.slice = d.local - (d.seg << sh);
    d.kb0 = (d.slice * pt.kblocks) >> sh;
    const int n = (((d.slice + 1) * pt.kblocks) >> sh) - d.kb0;
    d.stages = (n + kStageK - 1) / kStageK;
    int base = kStageK;  // n / stages, which is at most kStageK
    while (base * d.stages > n) --base;
    d.base = base;
    d.rem = n - base * d.stages;
    int hint = d.ph == 0 ? hint0 : hint1;
    const FastDiv gd = d.ph == 0 ? groups_div0 : groups_div1;
    d.s = decode_segment<kTok>(wv, d.seg, gd, num_active, &hint);
    if (d.ph == 0) hint0 = hint; else hint1 = hint;
    return d;
  }
};

// ---- the kernel --------------------------------------------------------------------------------
template <WeightFormat F, bool kSingle, GemmShape kShape, int kTok = kTokens>
__global__ void __launch_bounds__(kThreads, ShapeTraits<kShape>::kCtasPerSm)
    moe_gemm_kernel(const __grid_constant__ FusedArgs args) {
  using T = Traits<F, kTok>;
  constexpr int kStages = kRingStages<F, kShape, kTok>;
  static_assert(kStages >= 3 && kStages <= kMaxStages);
  static_assert(kTok == kTokens || kTok == kTokens16 || kTok == kTokens24);
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int s_prefix[kCachedExperts + 1], s_expert[kCachedExperts], s_count[kCachedExperts],
      s_row_start[kCachedExperts];
  __shared__ int s_flag;
  __shared__ TaskDesc s_desc[kStages];  // the task whose first stage a stage holds
  // Barriers and stages by shared-memory address: full[s] = bars + 8 s, empty[s] = bars + 8 (kStages + s),
  // in a 128-byte line of their own (ptx_sm90.cuh, mbarrier).
  static_assert(2 * kStages * 8 <= ptx::kBarrierLine);
  const uint32_t bars = ptx::smem_base(smem);
  const uint32_t stages0 = bars + ptx::kBarrierLine;
  auto full = [&](int s) { return bars + 8u * uint32_t(s); };
  auto empty = [&](int s) { return bars + 8u * uint32_t(kStages + s); };
  // A ring wait: sleeps in try_wait; after trap::kWaitLimitNs, timed_out() records and traps.
  auto wait_stage = [&](uint32_t bar, uint32_t parity, auto&& timed_out) {
    ptx::mbar_wait<kWaitSuspendNs>(bar, parity, trap::kWaitLimitNs, timed_out);
  };
  // The shared counters as a trap record sees them.
  auto counter = [&](const int* c) { return *reinterpret_cast<const volatile int*>(c); };

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (args.trace && threadIdx.x == 0) args.trace[size_t(blockIdx.x) * kTraceStride + kTrEntry] = globaltimer();
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full(s), 1);
      ptx::mbar_init(empty(s), kConsumerWarps * 32);  // every consumer thread releases a stage
    }
    ptx::fence_barrier_init();
  }

  // The work list comes from the prepare kernel that precedes this one. All E entries are read
  // at once, without waiting for num_active: one round trip to memory.
  ptx::grid_dependency_wait();
  const DeviceWork& work = args.g[0].work;
  const int E = int(args.g[0].dims.E);
  const bool cached = E <= kCachedExperts;
  if (cached)
    for (int i = threadIdx.x; i <= E; i += blockDim.x) {
      s_prefix[i] = work.chunk_prefix[i];
      if (i < E) s_expert[i] = work.expert[i], s_count[i] = work.count[i], s_row_start[i] = work.row_start[i];
    }
  if (threadIdx.x == 0) s_flag = *work.num_active;
  __syncthreads();
  const int num_active = s_flag;
  // After the wait above: finalize, launched by this trigger, reads route_plan's dest early.
  ptx::launch_dependents();
  if constexpr (kTok != kTokens) {
    // The work list's prefix counts 8-row chunks: this variant's chunks of kTok rows are counted
    // here (the host launches it only with the list in shared memory). Warp 0 scans.
    if (warp == 0) {
      constexpr int kPer = kCachedExperts / 32;
      int run[kPer];
      int sum = 0;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int i = lane * kPer + j;
        sum += i < num_active ? (s_count[i] + kTok - 1) / kTok : 0;
        run[j] = sum;
      }
      int incl = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const int excl = incl - sum;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int i = lane * kPer + j;
        if (i < E) s_prefix[i + 1] = excl + run[j];
      }
      if (lane == 0) s_prefix[0] = 0;
    }
    __syncthreads();
  }
  const WorkView wv = cached ? WorkView{s_prefix, s_expert, s_count, s_row_start}
                             : WorkView{work.chunk_prefix, work.expert, work.count, work.row_start};
  const int* prefix = wv.prefix;
  const int chunks = num_active > 0 ? prefix[num_active] : 0;
  unsigned long long* trace = args.trace ? args.trace + size_t(blockIdx.x) * kTraceStride : nullptr;
  if (trace && threadIdx.x == 0) trace[kTrStart] = globaltimer();
  const int P = int(gridDim.x);  // == args.grid_div.d
  TaskList<T::kStageK, kTok> tl;
  constexpr bool kMaySlice = kTok == kTokens;
  tl.p0 = phase_tasks(args.g[0], chunks, args.grid_div, args.slice_cost, kMaySlice);
  tl.p1 = args.nphases == 2 ? phase_tasks(args.g[1], chunks, args.grid_div, args.slice_cost, kMaySlice)
                            : PhaseTasks{0, 1, 0, 1, 1};
  tl.groups_div0 = args.g[0].groups_div;
  tl.groups_div1 = args.g[args.nphases - 1].groups_div;
  tl.total = tl.p0.count + tl.p1.count;
  const int G1 = tl.p0.groups;

  if (warp == kConsumerWarps) {
    // ---------------- producer ----------------
    const uint64_t evict_first = ptx::l2_evict_first_policy();
    const uint64_t evict_last = ptx::l2_evict_last_policy();
    int stage = 0;
    uint32_t phase = 0;
    int ready_a = -1, ready_g1 = -1;  // GEMM1 groups 0..ready_g1 of active expert ready_a are stored
    bool traced_wait = false, traced_begin = false;
    // What a task needs from global memory before its first stage (the gather rows of its tokens,
    // the done1 counts of its inputs) is loaded while the previous task's stages are issued, so
    // those round trips do not delay the first stage of the next task.
    struct TaskInputs {
      int done[4];  // phase 2: done1 of GEMM1 groups 2 kb0 + 32 r + lane (INT_MAX past the task)
      int src;      // gather: row_src of this lane's token
    };
    // done1 counts of active expert a's GEMM1 groups from + 32 r + lane (r < 4; INT_MAX at and
    // past `end`): up to 128 groups in one round trip.
    auto load_done = [&](int a, int from, int end, int (&v)[4]) {
      const int* flags = args.done1 + int64_t(a) * G1;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int g = from + 32 * r + lane;
        v[r] = g < end ? ptx::ld_acquire_gpu(flags + g) : INT_MAX;
      }
    };
    // The end of the run of stored groups that starts at `from`, from counts read by load_done.
    auto stored_end = [&](const int (&v)[4], int from, int end, int target) {
      int stop = from + 128;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t ok = __ballot_sync(0xffffffffu, v[r] >= target);
        if (ok != 0xffffffffu) {
          stop = from + 32 * r + __ffs(~ok) - 1;
          break;
        }
      }
      return min(stop, end);
    };
    auto load_inputs = [&](const TaskDesc& d, TaskInputs& in) {
      const GemmArgs& p = args.g[d.ph];
      in.src = p.gather_k > 0 && lane < d.s.n ? p.row_src[d.s.row0 + lane] : 0;
      if (d.ph == 1) load_done(d.s.a, 2 * d.kb0, d.group_end(), in.done);
    };
    // Lane 0 posts a stage's bytes (weights, scales and the x rows that follow) on its full
    // barrier and copies the weights and scales; the task's first stage also publishes the task.
    // The transaction count may see a copy complete before the expected bytes are posted: the
    // phase cannot complete before lane 0's arrival.
    auto issue_weights = [&](const TaskDesc& d, int st, int stage, int nkb, const uint8_t* code, const uint8_t* scale) {
      const uint32_t cbytes = uint32_t(nkb) * kSubtiles * T::kAtomCode;
      const uint32_t sbytes = uint32_t(nkb) * kSubtiles * T::kAtomScale;
      const uint32_t xbytes = uint32_t(nkb) * kKBlock * 2;
      const uint32_t dst = stages0 + uint32_t(stage) * T::kStageBytes;
      if (lane == 0) {
        if (st == 0) {
          s_desc[stage] = d;  // published by the arrive below (release)
          if (trace) s_desc[stage].issued = globaltimer();
        }
        ptx::mbar_arrive_expect_tx(full(stage), cbytes + sbytes + xbytes * uint32_t(d.s.n));
        ptx::bulk_g2s(dst, code, cbytes, full(stage), evict_first);
        if (sbytes) ptx::bulk_g2s(dst + T::kStageCode, scale, sbytes, full(stage), evict_first);
      }
    };
    int t = blockIdx.x;
    auto wait_empty = [&](int st_, uint32_t parity) {
      wait_stage(empty(st_), parity, [&] {
        const int ctx[] = {st_, int(parity), t, tl.total, counter(args.task_counter), counter(args.exit_count), kTok,
                           int(gridDim.x)};
        trap::record_and_trap(args.trap, trap::kDecodeEmptyWait, ctx);
      });
    };
    TaskDesc d;
    TaskInputs in;
    if (t < tl.total) d = tl.decode(t, wv, num_active), load_inputs(d, in);
    if (trace && lane == 0) trace[kTrDecoded] = globaltimer();
    while (t < tl.total) {
      // Claim the next task now; the answer is needed after this task's first stages.
      int claim = 0;
      if (lane == 0) claim = P + atomicAdd(args.task_counter, 1);
      const GemmArgs& p = args.g[d.ph];
      // Phase 2: GEMM1 groups [2 kb0, pre_end) of the task's inputs were stored when their counts
      // were loaded. Up to 128 groups (a whole task unless K is very long) are checked at once,
      // so a task whose inputs are ready, as they are from a few tokens on, polls nothing per stage.
      int pre_end = 0;
      if (d.ph == 1) {
        const int first = 2 * d.kb0;
        const int target1 = prefix[d.s.a + 1] - prefix[d.s.a];
        pre_end = stored_end(in.done, first, d.group_end(), target1);
        if (d.s.a != ready_a) ready_a = d.s.a, ready_g1 = -1;
        if (first <= ready_g1 + 1) ready_g1 = max(ready_g1, pre_end - 1);
      }
      // Sources of the task's first stage; every stage advances them.
      const uint8_t* code = p.codes + p.dims.code_offset(d.s.expert, d.s.group, d.kb0);
      const uint8_t* scale = p.scales + p.dims.scale_offset(d.s.expert, d.s.group, d.kb0);
      // Source row of this lane's token in the chunk (gather: the token's row of x).
      const int64_t src_row = p.gather_k > 0 && lane < d.s.n ? p.gather_div.div(in.src) : d.s.row0 + lane;
      const uint16_t* x = p.in + src_row * p.dims.K_pad + int64_t(d.kb0) * kKBlock;
      // The next task is decoded and its inputs loaded after this task's stage st_next.
      const int st_next = min(1, d.stages - 1);
      int t_next = tl.total;
      TaskDesc dn;
      TaskInputs in_next;
      int kb = d.kb0;
      // A phase-2 task whose inputs are not all stored yet requests the weights of its first
      // stages at once, into ring slots as they free up; their x rows follow each readiness check.
      int npre = 0;
      if (d.ph == 1 && tl.p1.count <= P && pre_end < d.group_end()) {
        npre = min(d.stages, kEarlyStages);
        int pstage = stage;
        uint32_t pphase = phase;
        const uint8_t* pc = code;
        const uint8_t* ps = scale;
        for (int st = 0; st < npre; ++st) {
          const int nkb = d.base + (st < d.rem);
          wait_empty(pstage, pphase ^ 1);
          issue_weights(d, st, pstage, nkb, pc, ps);
          pc += nkb * kSubtiles * T::kAtomCode;
          ps += nkb * kSubtiles * T::kAtomScale;
          if (++pstage == kStages) pstage = 0, pphase ^= 1;
        }
      }
      for (int st = 0; st < d.stages; ++st) {
        const int nkb = d.base + (st < d.rem);
        if (d.ph == 1) {
          // GEMM1 groups [2 kb, 2 (kb + nkb)) of this expert must be stored. Each poll reads the
          // counts of every group from `first` to the task's end (up to 128, one round trip), so
          // the later stages found stored with this one are issued without a poll of their own.
          if (d.s.a != ready_a) ready_a = d.s.a, ready_g1 = -1;
          const int last = 2 * (kb + nkb);
          const int first = max(max(2 * kb, ready_g1 + 1), pre_end);
          if (first < last) {
            if (trace && lane == 0 && !traced_begin) trace[kTrWaitBegin] = globaltimer(), traced_begin = true;
            const int target1 = prefix[d.s.a + 1] - prefix[d.s.a];
            const uint64_t t0 = ptx::globaltimer_ns();
            int ready_end;
            while (true) {
              int v[4];
              load_done(d.s.a, first, d.group_end(), v);
              if ((ready_end = stored_end(v, first, d.group_end(), target1)) >= last) break;
              __nanosleep(32);
              if (ptx::globaltimer_ns() - t0 > trap::kWaitLimitNs) {
                if (lane == 0) {
                  const int ctx[] = {d.s.a, d.s.expert, first, last, target1, ready_end, v[0], t, tl.total,
                                     tl.p0.count, tl.p1.count, counter(args.task_counter), counter(args.exit_count),
                                     num_active, chunks, kTok, int(gridDim.x), G1};
                  trap::record(args.trap, trap::kDecodeGemm2Wait, ctx);
                }
                __syncwarp();
                __trap();
              }
            }
            pre_end = ready_end;
            // ready_g1 is a watermark: only a contiguous range from group 0 moves it.
            if (first == ready_g1 + 1) ready_g1 = ready_end - 1;
            if (trace && lane == 0 && !traced_wait) trace[kTrWaitEnd] = globaltimer(), traced_wait = true;
          }
          // Every lane's bulk copies below read what lanes acquired: order them per thread.
          __syncwarp();
          ptx::fence_proxy_async_global();
        }
        // A producer with a full ring sleeps in try_wait instead of spinning on issue slots.
        if (st >= npre) wait_empty(stage, phase ^ 1);
        const uint32_t cbytes = uint32_t(nkb) * kSubtiles * T::kAtomCode;
        const uint32_t sbytes = uint32_t(nkb) * kSubtiles * T::kAtomScale;
        const uint32_t xbytes = uint32_t(nkb) * kKBlock * 2;
        const uint32_t dst = stages0 + uint32_t(stage) * T::kStageBytes;
        if (st >= npre) issue_weights(d, st, stage, nkb, code, scale);
        if (lane < d.s.n)
          ptx::bulk_g2s(dst + T::kStageCode + T::kStageScale + lane * T::kXRow, x, xbytes, full(stage), evict_last);
        if (st == st_next) {
          t_next = __shfl_sync(0xffffffffu, claim, 0);
          if (t_next < tl.total) dn = tl.decode(t_next, wv, num_active), load_inputs(dn, in_next);
        }
        code += cbytes;
        scale += sbytes;
        x += nkb * kKBlock;
        kb += nkb;
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      t = t_next;
      if (t < tl.total) d = dn, in = in_next;
    }
    // No more tasks: one empty stage tells the consumers.
    wait_empty(stage, phase ^ 1);
    if (lane == 0) {
      s_desc[stage].ph = -1;
      ptx::mbar_arrive(full(stage));
    }
    // Every task this CTA claimed is issued. The last producer to get here knows that every claim
    // has been made and that every done1 counter has reached its target (each was seen complete
    // by a phase-2 check before its checker's ticket), so it resets them for the next launch
    // while the consumers finish: no CTA's end waits for the ticket.
    int last_out = 0;
    if (lane == 0) {
      ptx::fence_acq_rel_gpu();  // this CTA's claims and polls come before its ticket
      last_out = atomicAdd(args.exit_count, 1) == int(gridDim.x) - 1;
      if (last_out) {
        ptx::fence_acq_rel_gpu();
        *args.task_counter = 0;
        *args.exit_count = 0;
      }
    }
    if (__shfl_sync(0xffffffffu, last_out, 0) && args.nphases == 2) {
      const int n = num_active * G1;
      for (int i = lane; i < n; i += 32) args.done1[i] = 0;
    }
  } else {
    // ---------------- consumers ----------------
    int stage = 0;
    uint32_t phase = 0;
    const uint32_t xs_lane = stages0 + T::kStageCode + T::kStageScale + (lane & 7) * T::kXRow + (lane >> 3) * 16;
    bool phase1_seen = false;
    bool first_data = true;
    int traced_tasks = 0;
    while (true) {
      // A consumer waiting for data sleeps too.
      wait_stage(full(stage), phase, [&] {
        const int ctx[] = {stage, int(phase), -1, -1, 0, kTok, int(gridDim.x)};
        trap::record_and_trap(args.trap, trap::kDecodeFullWait, ctx);
      });
      const TaskDesc d = s_desc[stage];
      if (d.ph < 0) break;
      unsigned long long* task_rec = trace && threadIdx.x == 0 && traced_tasks < kTraceTasks
                                         ? trace + kTraceEvents + kTraceRecord * traced_tasks++
                                         : nullptr;
      if (task_rec) task_rec[0] = uint64_t(d.ph) << 32 | uint32_t(d.local), task_rec[1] = d.issued, task_rec[2] = globaltimer();
      const GemmArgs& p = args.g[d.ph];
      if (trace && threadIdx.x == 0) {
        if (first_data) trace[kTrFirstData] = globaltimer(), first_data = false;
        if (d.ph == 1 && !phase1_seen) trace[kTrPhase0End] = trace[kTrPhase1FirstData] = globaltimer();
      }
      phase1_seen |= d.ph == 1;
      const RowConsts<kTok> rc = row_consts<kTok>(p, d.s, warp, lane);
      const int ntl = (d.s.n + 7) >> 3;  // n8 tiles that hold rows
      // Two accumulator chains (even / odd k16 steps) halve the dependent-MMA latency.
      float acc2[2][kTok / 8][4];
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int nt = 0; nt < kTok / 8; ++nt) acc2[c][nt][0] = acc2[c][nt][1] = acc2[c][nt][2] = acc2[c][nt][3] = 0.0f;

      for (int st = 0; st < d.stages; ++st) {
        const int nkb = d.base + (st < d.rem);
        if (st > 0)
          wait_stage(full(stage), phase, [&] {
            const int ctx[] = {stage, int(phase), d.ph, d.local, st, kTok, int(gridDim.x)};
            trap::record_and_trap(args.trap, trap::kDecodeFullWait, ctx);
          });
        const uint32_t xs = xs_lane + uint32_t(stage) * T::kStageBytes;
        const uint32_t cs = stages0 + uint32_t(stage * T::kStageBytes + warp * T::kAtomCode);
        const uint32_t ss = stages0 + uint32_t(stage * T::kStageBytes + T::kStageCode + warp * T::kAtomScale);
        // Branch-free paths for whole and one-short stages; the general one guards every atom.
        constexpr int kShort = T::kStageK > 1 ? T::kStageK - 1 : T::kStageK;
        if (nkb == T::kStageK)
          consume_stage<F, kSingle, T::kStageK, kTok>(cs, ss, xs, lane, nkb, ntl, acc2);
        else if (nkb == kShort)
          consume_stage<F, kSingle, kShort, kTok>(cs, ss, xs, lane, nkb, ntl, acc2);
        else
          consume_stage<F, kSingle, 0, kTok>(cs, ss, xs, lane, nkb, ntl, acc2);
        ptx::mbar_arrive(empty(stage));  // each thread releases its own reads of the stage
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      float acc[kTok / 8][4];
#pragma unroll
      for (int nt = 0; nt < kTok / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = acc2[0][nt][i] + acc2[1][nt][i];

      const int S = tl.slices(d.ph);
      bool stored = false;
      if (S == 1) {
        epilogue(p, d.s, warp, lane, acc, rc);
        stored = true;
      } else if (d.slice < S - 1) {
        // A slice before the last: publish this task's partial and count it (no answer awaited).
        float* mine = p.partials + int64_t(d.local) * kPartialFloatsOf<kTok> + (warp * 32 + lane) * (kTok / 2);
#pragma unroll
        for (int nt = 0; nt < kTok / 8; ++nt)
          reinterpret_cast<float4*>(mine)[nt] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
        // One release after the barrier publishes every consumer thread's partial: the barrier
        // orders their stores before thread 0's release, which is cumulative.
        consumer_sync();
        if (threadIdx.x == 0) ptx::red_release_gpu_add(&p.counters[d.seg], 1);
      } else {
        // The last slice sums the segment: the earlier slices' partials in slice order, then its
        // own. They were claimed before it, so they are done or nearly done by now (and never
        // wait for it: every wait points to a task claimed earlier, so none is circular).
        if (threadIdx.x == 0) {
          const uint64_t t0 = ptx::globaltimer_ns();
          int got;
          while ((got = ptx::ld_acquire_gpu(&p.counters[d.seg])) < S - 1) {
            __nanosleep(64);
            if (ptx::globaltimer_ns() - t0 > trap::kWaitLimitNs) {
              const int ctx[] = {d.seg, got, S, counter(args.task_counter), counter(args.exit_count), kTok,
                                 int(gridDim.x)};
              trap::record_and_trap(args.trap, trap::kDecodeSliceWait, ctx);
            }
          }
          p.counters[d.seg] = 0;  // ready for the next launch
        }
        consumer_sync();  // thread 0 acquired the partials for all consumer threads (cumulative)
        float sum[kTok / 8][4] = {};
        const float* part = p.partials + (int64_t(d.local) - d.slice) * kPartialFloatsOf<kTok> + (warp * 32 + lane) * (kTok / 2);
        for (int sl0 = 0; sl0 < S - 1; sl0 += 4) {  // four loads in flight, summed in slice order
          float4 v[4][kTok / 8];
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int nt = 0; nt < kTok / 8; ++nt)
              if (sl0 + j < S - 1) v[j][nt] = __ldcg(reinterpret_cast<const float4*>(part + (sl0 + j) * kPartialFloatsOf<kTok>) + nt);
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int nt = 0; nt < kTok / 8; ++nt)
              if (sl0 + j < S - 1)
                sum[nt][0] += v[j][nt].x, sum[nt][1] += v[j][nt].y, sum[nt][2] += v[j][nt].z, sum[nt][3] += v[j][nt].w;
        }
#pragma unroll
        for (int nt = 0; nt < kTok / 8; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[nt][i] = sum[nt][i] + acc[nt][i];
        epilogue(p, d.s, warp, lane, acc, rc);
        stored = true;
      }
      if (task_rec) task_rec[3] = globaltimer();
      if (d.ph == 0 && args.nphases == 2 && stored) {
        // Tell phase 2 that this (chunk, group) of expert a is in memory: barrier, then one
        // thread's release; the other warps go on to the next task.
        consumer_sync();
        if (threadIdx.x == 0) {
          ptx::red_release_gpu_add(args.done1 + int64_t(d.s.a) * G1 + d.s.group, 1);
        }
      }
    }
    if (trace && threadIdx.x == 0) {
      if (!phase1_seen) trace[kTrPhase0End] = globaltimer();
      trace[kTrEnd] = globaltimer();
    }
  }
  // The barriers are invalidated before the SM gives their memory to the next CTA.
  ptx::mbar_inval_at_exit(bars, 2 * kStages);
}

}  // namespace moekit::sm90
