// moekit/pipeline/quantize_fp8_sm90.cuh — FP8 activations on the GPU (issue 49): bf16 rows to the
// SM90 FP8 GEMM's input (experts/sm90_fp8_gemm.cuh), bit for bit the quantization of
// formats/fp8_act.h (E4M3 per row per 128 K, fp32 or ue8m0 scales, NaN/Inf groups NaN).
//
// Output (the GEMM's input contract)
//   codes   [rows, K_pad] E4M3, row stride K_pad; each 16 consecutive K stored in the kernel K
//           order (fold_fp8.h, fp8_kernel_k: stored position j holds logical k fp8_kernel_k(j));
//           columns [K, K_pad) zero.
//   scales  [ceil(K_pad / 128), rows_pad] fp32, group-major; a group with no column below K
//           (none while K_pad = pad_to(K, 64)) gets 0.
//   Padding rows get zero codes and zero scales: rows the plan marks -1 (row_src), rows past the
//   last active expert's (the standard format's segments are in expert order, so that is
//   row_start + count of the last active one), and the scale rows [rows, rows_pad). The GEMM
//   never stores what it computes from such rows; zeros keep them finite and defined.
//   With work_rows (the batched formats: expert e's rows [e * capacity, e * capacity + count),
//   the rest of its capacity the caller's garbage, never read as data) the rows outside every
//   active expert's [row_start, row_start + count) are neither read nor written: zeroing them
//   would cost more than the layer (E x capacity rows), and the GEMM stores nothing of them
//   either (what it computes for a token row depends on that row alone).
//
// Two launches, one kernel (QuantFp8Args::dest says which):
//   gather  GEMM1's input from the tokens: token t's row of x is quantized once and its codes and
//           scales stored in every row dest[t * k + j] >= 0 (the plan of prepare_finalize_sm90.cuh);
//           the quantization depends on the row only, so k copies of one result are what k
//           separate quantizations give. Extra blocks zero the padding rows. With `run` (the
//           device's kernel choice, kernel_choice_sm90.cuh) every block returns when *run == 0.
//           With work_rows no zeroing blocks.
//   rows    GEMM2's input: GEMM1's bf16 output, already in expert order (row r from src + r *
//           src_stride), rows marked padding as above zeroed (GEMM1 leaves them unwritten).
//
// Work: one warp per (row, pair of 128-K groups): a lane loads 8 consecutive bf16 (16 bytes) and
// stores 8 codes (8 bytes), 16 lanes per group; the group's amax and non-finite flag by 4
// shuffles; the kernel K order by one shuffle with the neighbouring lane and two byte permutes
// (lane 2m holds logical k 0..7 of its 16-chunk, lane 2m + 1 k 8..15; stored words 0, 1 of the
// chunk are [0 1 8 9] [2 3 10 11], words 2, 3 [4 5 12 13] [6 7 14 15]). Division: IEEE (as the
// CPU's x / s); E4M3 rounding: the hardware's cvt.rn.satfinite (round to nearest even, sign
// kept; the GPU tests compare it with float_to_e4m3 over every rounding boundary).
// Bound: memory. gather reads T * K * 2 bytes and writes rows * (K_pad + 4 K_pad / 128) bytes;
// rows reads rows * K * 2 and writes the same. Expected at copy rate (reads + writes over the
// device-to-device copy bandwidth); the timing (FP8Bench.Quantize) prints both.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moekit/spec.hpp"

namespace moekit::sm90::fp8 {

// No implicit padding: launch arguments are compared bytewise (launch_sm90.cuh).
struct QuantFp8Args {
  const uint16_t* src = nullptr;     // bf16 rows: gather: x [T, src_stride]; rows: [rows, src_stride]
  const int32_t* dest = nullptr;     // gather: [T * k] entry -> row or -1; null: the rows launch
  const int32_t* row_src = nullptr;  // [rows] row -> entry or -1 (padding); null: rows all real
  const int* num_active = nullptr;   // with row_src: the work list (DeviceWork) that bounds the
  const int* count = nullptr;        //   plan's rows (row_src past them is stale)
  const int* row_start = nullptr;
  const int* run = nullptr;          // optional: 0 -> nothing runs
  uint8_t* codes = nullptr;          // [rows, K_pad]
  float* scales = nullptr;           // [groups(K_pad), rows_pad]
  int64_t src_stride = 0;            // elements, a multiple of 8 (src 16-byte aligned)
  int64_t T = 0;                     // gather: tokens
  int64_t rows = 0;                  // rows of codes
  int64_t rows_pad = 0;              // rows of scales (>= rows, a multiple of 4: fp8_scale_rows_pad)
  int64_t K = 0;                     // logical columns (<= src_stride, <= K_pad)
  int64_t K_pad = 0;                 // a multiple of 64
  int32_t k = 0;                     // gather: slots per token
  int32_t rule = 0;                  // ActivationScale
  int32_t work_rows = 0;             // 1: only the work list's rows (num_active, count, row_start;
                                     //    row_start ascending) are read and written (above)
  int32_t pad_ = 0;
};
static_assert(sizeof(QuantFp8Args) == 136, "QuantFp8Args: no implicit padding");

// GEMM1's input: tokens x [T, x_stride] gathered by dest (entries t * k + j), padding rows per
// row_src and the work list (standard format). a.src, a.dest, a.T, a.k set; T = 0 launches nothing.
cudaError_t launch_quantize_gather_fp8(const QuantFp8Args& a, cudaStream_t s, bool pdl);
// GEMM2's input: rows already in expert order (a.dest null). rows_pad = 0 launches nothing.
cudaError_t launch_quantize_rows_fp8(const QuantFp8Args& a, cudaStream_t s, bool pdl);

}  // namespace moekit::sm90::fp8
