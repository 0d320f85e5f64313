// moekit/pipeline/quantize_fp8_sm90.cu — bf16 rows to the FP8 GEMM's E4M3 input (see the .cuh).
#include <cuda_runtime.h>

#include <cstdint>

#include "moekit/common/ptx_sm90.cuh"
#include "moekit/formats/fp8_act.h"
#include "moekit/pipeline/launch_sm90.cuh"
#include "moekit/pipeline/quantize_fp8_sm90.cuh"

namespace moekit::sm90::fp8 {
namespace {

constexpr int kWarps = 4;          // warps per CTA: pairs of groups of one row (1024 columns)
constexpr int kPairCols = 2 * kFp8ActGroup;
constexpr int kZeroRows = 32;      // gather: rows a zeroing CTA checks (one flag per lane)
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Two values to two E4M3 codes (lo in byte 0), round to nearest even, |v| <= 448 (clamped).
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return uint32_t(r);
}

// x / s clamped to [-448, 448], as quantize_group_fp8_act divides (IEEE division).
__device__ __forceinline__ float scaled(float x, float s) {
  const float v = __fdiv_rn(x, s);
  return fminf(fmaxf(v, -kE4M3Max), kE4M3Max);  // both operands are numbers here
}

// One warp's pair p of groups of a bf16 row: the lane's stored 8 bytes and its group's scale
// (every lane of a half holds it).
struct PairOut {
  uint2 codes;
  float scale;
};
__device__ __forceinline__ PairOut zero_pair() { return {make_uint2(0, 0), 0.0f}; }  // a padding row's
__device__ __forceinline__ PairOut quantize_pair(const uint16_t* row, int64_t K, int p, int lane,
                                                 ActivationScale rule) {
  const int h = lane >> 4, l = lane & 15;
  const int64_t g = 2 * int64_t(p) + h;
  const int64_t c0 = g * kFp8ActGroup + 8 * l;  // the lane's first logical column
  float x[8];
  if (c0 + 8 <= K) {
    const uint4 v = *reinterpret_cast<const uint4*>(row + c0);
    x[0] = bf16_lo(v.x), x[1] = bf16_hi(v.x), x[2] = bf16_lo(v.y), x[3] = bf16_hi(v.y);
    x[4] = bf16_lo(v.z), x[5] = bf16_hi(v.z), x[6] = bf16_lo(v.w), x[7] = bf16_hi(v.w);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = c0 + i < K ? __uint_as_float(uint32_t(row[c0 + i]) << 16) : 0.0f;
  }
  // The group's amax over its columns below K (the zeros past K change nothing) and whether one
  // is NaN or Inf.
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float a = fabsf(x[i]);
    finite = finite && a <= 3.402823466e38f;
    amax = fmaxf(amax, a);
  }
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
  const uint32_t bad = __ballot_sync(kFull, !finite) >> (16 * h) & 0xffffu;
  const bool any_col = g * kFp8ActGroup < K;  // a group past K (none while K_pad = pad_to(K, 64))
  PairOut out;
  uint32_t w0, w1;
  if (!any_col) {
    out.scale = 0.0f;
    w0 = w1 = 0;
  } else if (bad) {
    out.scale = __uint_as_float(0x7fc00000u);
    // NaN codes for the group's columns below K, zero past it.
    w0 = w1 = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (c0 + i < K) (i < 4 ? w0 : w1) |= 0x7fu << (8 * (i & 3));
  } else {
    const float s = fp8_act_scale(amax, rule);
    out.scale = s;
    w0 = e4m3x2(scaled(x[0], s), scaled(x[1], s)) | e4m3x2(scaled(x[2], s), scaled(x[3], s)) << 16;
    w1 = e4m3x2(scaled(x[4], s), scaled(x[5], s)) | e4m3x2(scaled(x[6], s), scaled(x[7], s)) << 16;
  }
  // The kernel K order: even lanes hold logical k 0..7 of their 16-chunk, odd lanes 8..15.
  const bool odd = l & 1;
  const uint32_t recv = __shfl_xor_sync(kFull, odd ? w0 : w1, 1);
  const uint32_t lo = odd ? recv : w0, hi = odd ? w1 : recv;
  out.codes = make_uint2(__byte_perm(lo, hi, 0x5410u), __byte_perm(lo, hi, 0x7632u));
  return out;
}

// Stores a pair's result into row r: codes when r < rows, the scale when r < rows_pad.
__device__ __forceinline__ void store_pair(const QuantFp8Args& a, int64_t r, int p, int lane, const PairOut& v) {
  const int h = lane >> 4, l = lane & 15;
  const int64_t g = 2 * int64_t(p) + h;
  const int64_t col = g * kFp8ActGroup + 8 * l;
  if (r < a.rows && col < a.K_pad) *reinterpret_cast<uint2*>(a.codes + r * a.K_pad + col) = v.codes;
  if (l == 0 && g * kFp8ActGroup < a.K_pad) a.scales[g * a.rows_pad + r] = v.scale;
}

// The end of the plan's rows: past the last active expert's (standard format, expert order).
__device__ __forceinline__ int64_t plan_rows_end(const QuantFp8Args& a) {
  const int na = *a.num_active;
  return na > 0 ? int64_t(a.row_start[na - 1]) + a.count[na - 1] : 0;
}

// Whether row r is one of an active expert's rows [row_start, row_start + count) (work_rows):
// the last active expert starting at or before r (row_start ascends), by bisection.
__device__ __forceinline__ bool in_work(const QuantFp8Args& a, int64_t r) {
  int lo = 0, hi = *a.num_active - 1;
  if (hi < 0) return false;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.row_start[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return r >= a.row_start[lo] && r < int64_t(a.row_start[lo]) + a.count[lo];
}

__global__ void __launch_bounds__(kWarps * 32) quantize_fp8_kernel(QuantFp8Args a) {
  ptx::grid_dependency_wait();
  const bool skip = a.run && *a.run == 0;
  ptx::launch_dependents();
  if (skip) return;
  const int lane = int(threadIdx.x & 31);
  const int p = int(blockIdx.y) * kWarps + int(threadIdx.x >> 5);
  if (int64_t(p) * kPairCols >= a.K_pad) return;  // the whole warp
  const ActivationScale rule = ActivationScale(a.rule);
  const int64_t b = blockIdx.x;
  if (a.dest) {
    if (b < a.T) {
      // Token b: quantized once, stored in each of its rows.
      const PairOut v = quantize_pair(a.src + b * a.src_stride, a.K, p, lane, rule);
      for (int j0 = 0; j0 < a.k; j0 += 32) {
        const int32_t mine = j0 + lane < a.k ? a.dest[b * a.k + j0 + lane] : -1;
        const int n = a.k - j0 < 32 ? a.k - j0 : 32;
        for (int j = 0; j < n; ++j) {
          const int32_t r = __shfl_sync(kFull, mine, j);
          if (r >= 0) store_pair(a, r, p, lane, v);
        }
      }
      return;
    }
    if (a.work_rows) return;  // (none launched)
    // Zeroing CTAs: rows [r0, r0 + 32), one flag per lane.
    const int64_t r0 = (b - a.T) * kZeroRows, r = r0 + lane;
    const int64_t end = a.row_src ? plan_rows_end(a) : a.rows;
    const bool pad = r < a.rows_pad && (r >= a.rows || r >= end || (a.row_src && a.row_src[r] < 0));
    uint32_t m = __ballot_sync(kFull, pad);
    while (m) {
      const int i = __ffs(int(m)) - 1;
      m &= m - 1;
      store_pair(a, r0 + i, p, lane, zero_pair());
    }
    return;
  }
  // Rows: row b from src (rows marked padding, and the scale rows past `rows`, zeroed; with
  // work_rows, rows outside the work list untouched: the CTA's, uniform).
  if (a.work_rows && !(b < a.rows && in_work(a, b))) return;
  bool real = b < a.rows;
  if (real && a.row_src) real = b < plan_rows_end(a) && a.row_src[b] >= 0;
  // (real is the CTA's: the warp's shuffles stay converged)
  const PairOut v = real ? quantize_pair(a.src + b * a.src_stride, a.K, p, lane, rule) : zero_pair();
  store_pair(a, b, p, lane, v);
}

cudaError_t check_args(const QuantFp8Args& a) {
  const bool ok = a.K >= 0 && a.K <= a.K_pad && a.K_pad % 64 == 0 && a.rows >= 0 && a.rows_pad >= a.rows &&
                  a.rows_pad % 4 == 0 && a.src_stride >= a.K && a.src_stride % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(a.src) % 16 == 0 && reinterpret_cast<uintptr_t>(a.codes) % 8 == 0 &&
                  (a.rule == int32_t(ActivationScale::kFp32) || a.rule == int32_t(ActivationScale::kUe8m0)) &&
                  ((!a.row_src && !a.work_rows) || (a.num_active && a.count && a.row_start)) &&
                  (a.work_rows == 0 || a.work_rows == 1);
  return ok ? cudaSuccess : cudaErrorInvalidValue;
}

dim3 block() { return dim3(kWarps * 32); }
unsigned pair_blocks(int64_t K_pad) {
  const int64_t pairs = (K_pad + kPairCols - 1) / kPairCols;
  return unsigned((pairs + kWarps - 1) / kWarps);
}

}  // namespace

cudaError_t launch_quantize_gather_fp8(const QuantFp8Args& a, cudaStream_t s, bool pdl) {
  if (a.T == 0) return cudaSuccess;
  if (check_args(a) != cudaSuccess || !a.dest || a.k <= 0 || a.T < 0 || a.K_pad == 0) return cudaErrorInvalidValue;
  const int64_t bx = a.T + (a.work_rows ? 0 : (a.rows_pad + kZeroRows - 1) / kZeroRows);
  if (bx > int64_t(INT32_MAX)) return cudaErrorInvalidValue;
  return launch(quantize_fp8_kernel, dim3(unsigned(bx), pair_blocks(a.K_pad)), block(), 0, s, pdl, a);
}

cudaError_t launch_quantize_rows_fp8(const QuantFp8Args& a, cudaStream_t s, bool pdl) {
  if (a.rows_pad == 0 || a.K_pad == 0) return cudaSuccess;
  if (check_args(a) != cudaSuccess || a.dest || a.rows_pad > int64_t(INT32_MAX)) return cudaErrorInvalidValue;
  return launch(quantize_fp8_kernel, dim3(unsigned(a.rows_pad), pair_blocks(a.K_pad)), block(), 0, s, pdl, a);
}

}  // namespace moekit::sm90::fp8
