// moekit/experts/sm90_fp8_chain.cu — the FP8 activations' experts chain (see the .cuh).
#include "moekit/experts/sm90_fp8_chain.cuh"

#include "moekit/experts/sm90_fp8_gemm.h"
#include "moekit/pipeline/quantize_fp8_sm90.cuh"

namespace moekit::sm90::fp8 {

namespace {
int64_t groups_of(int64_t cols) { return (cols + kGroupK - 1) / kGroupK; }

// The quantizer's arguments for GEMM1's input (mid false) or GEMM2's (mid true): padding rows
// by row_src (standard format), or only the work list's rows (batched formats).
QuantFp8Args quantize_args(const Fp8ChainCall& c, bool mid) {
  QuantFp8Args a{};
  a.src = mid ? c.mid : c.x;
  a.src_stride = mid ? c.w2.dims.K_pad : c.x_stride;
  a.row_src = c.work_rows ? nullptr : c.row_src;
  a.num_active = c.work.num_active, a.count = c.work.count, a.row_start = c.work.row_start;
  a.work_rows = c.work_rows ? 1 : 0;
  a.codes = mid ? c.q.mid_codes : c.q.x_codes;
  a.scales = mid ? c.q.mid_scales : c.q.x_scales;
  a.rows = c.q.rows, a.rows_pad = c.q.rows_pad;
  a.K = mid ? c.I : c.H;
  a.K_pad = mid ? c.w2.dims.K_pad : c.w13.dims.K_pad;
  a.rule = int32_t(c.rule);
  return a;
}
}  // namespace

void Fp8ChainRows::carve(Carve& cv, int64_t rows_, int64_t H_pad, int64_t I_pad) {
  rows = rows_;
  rows_pad = fp8_scale_rows_pad(rows_);
  x_codes = cv.take<uint8_t>(rows * H_pad);
  x_scales = cv.take<float>(groups_of(H_pad) * rows_pad);
  mid_codes = cv.take<uint8_t>(rows * I_pad);
  mid_scales = cv.take<float>(groups_of(I_pad) * rows_pad);
}

cudaError_t Fp8Chain::quantize_input(const Fp8ChainCall& c, cudaStream_t s, bool pdl) {
  QuantFp8Args a = quantize_args(c, false);
  if (c.dest) {  // the tokens, gathered
    a.dest = c.dest, a.T = c.T, a.k = c.k;
    return launch_quantize_gather_fp8(a, s, pdl);
  }
  if (!c.work_rows) return cudaErrorInvalidValue;  // rows in expert order come from a batched plan
  return launch_quantize_rows_fp8(a, s, pdl);
}

cudaError_t Fp8Chain::gemm(const Fp8ChainCall& c, bool second, cudaStream_t s, bool pdl) {
  const Fp8ChainWeights& w = second ? c.w2 : c.w13;
  uint8_t* codes = second ? c.q.mid_codes : c.q.x_codes;
  float* scales = second ? c.q.mid_scales : c.q.x_scales;
  const int64_t cols = w.dims.K_pad, rows = c.q.rows;
  Fp8Args a{};
  auto map = [&](CUtensorMap* m, const void* base, int box) {
    return maps_.get({base, rows, cols, box}, m, [&](CUtensorMap* out) {
      return box ? make_fp8_rows_map(out, static_cast<const uint8_t*>(base), rows, cols, box)
                 : make_fp8_scale_map(out, static_cast<const float*>(base), c.q.rows_pad, groups_of(cols));
    });
  };
  cudaError_t e = map(&a.base.in_map, codes, 16);
  if (e == cudaSuccess) e = map(&a.base.in_map_big, codes, prefill::kBigBoxRows);
  if (e == cudaSuccess) e = map(&a.sx_map, scales, 0);
  if (e != cudaSuccess) return e;
  a.base.dims = w.dims;
  a.base.codes = w.codes;
  a.base.scales = w.scales;
  a.base.row_scale = nullptr;  // MXFP4 / MXFP8: the scales are folded into the codes and sw
  a.base.bias = w.bias;
  a.base.work = c.work;
  a.base.out_act = c.mid;
  a.base.out_f32 = c.out;
  a.base.out_cols = c.H;
  a.base.row_src = c.row_src;
  a.base.topk_weights = c.weights;
  a.base.tile_counter = c.counters + (second ? 2 : 0);
  a.base.exit_count = c.counters + (second ? 3 : 1);
  a.base.act = c.act;
  a.base.gemm2 = second;
  return launch_fp8_gemm(a, c.grid, s, pdl);
}

cudaError_t Fp8Chain::gemm1(const Fp8ChainCall& c, cudaStream_t s, bool pdl) { return gemm(c, false, s, pdl); }

cudaError_t Fp8Chain::gemm2(const Fp8ChainCall& c, cudaStream_t s, bool pdl) {
  // GEMM1's output rows are in expert order already: the rows launch.
  if (const cudaError_t e = launch_quantize_rows_fp8(quantize_args(c, true), s, pdl); e != cudaSuccess) return e;
  return gemm(c, true, s, pdl);
}

}  // namespace moekit::sm90::fp8
