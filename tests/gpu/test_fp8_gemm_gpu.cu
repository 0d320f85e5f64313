// The SM90 FP8 grouped GEMM (experts/sm90_fp8_gemm.cuh), kernel level: E4M3 activations with fp32
// per-(row, 128-K) scales (quantized here, stored in the kernel K order) times MXFP4 weights in
// the decode kernel's layout, against float64 references computed on the same quantized
// activations: (a) with the exact MXFP4 weights, (b) with the folded weights the kernel multiplies
// (formats/fold_fp8.h), which must agree to the accumulation's rounding. GEMM2 (fp32 out, bias,
// top-k weight) and GEMM1 (gated activation, bf16 out); poisoned outputs; 0, 1, 3 rows; empty
// experts; every row on one expert; K and N that need padding; block exponents spread past the
// fold's exact range; MXFP8 weights; the presets' dims. Also the device folds against the host's.
// MOEKIT_FP8_BENCH=1 adds timings at 4096 and 8192 rows (FP8Bench.*).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fp8_chain.h"
#include "gpu_util.h"
#include "moekit/common/bf16.h"
#include "moekit/experts/activation.h"
#include "moekit/experts/sm90_fp8_gemm.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/formats/codes.h"
#include "moekit/formats/fold_fp8.h"

namespace moekit {
namespace {

using sm90::ConvertedMatrix;
using test::DeviceBuffer;
namespace fp8 = sm90::fp8;

// ---- the fold tables on the device ------------------------------------------------------------
__global__ void fold_e4m3_kernel(const uint32_t* words, uint32_t* folded, int nwords) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < nwords) folded[i] = fold_e4m3x4(words[i], -(i % 40));
}

__global__ void fold_tables_kernel(uint32_t* out, const uint32_t* words, uint32_t* folded, int nwords) {
  const int d = -int(threadIdx.x);  // 0 .. -255
  const FoldTable t = e2m1_fold_table(d);
  out[2 * threadIdx.x] = t.lo;
  out[2 * threadIdx.x + 1] = t.hi;
  if (threadIdx.x == 0)
    for (int i = 0; i < nwords; ++i) {
      const FoldTable tg = e2m1_fold_table(-(i % 20)), th = e2m1_fold_table(-(i % 31));
      fold_e2m1x8(words[i], tg, th, folded[2 * i], folded[2 * i + 1]);
    }
}

TEST(FP8Fold, DeviceTablesMatchHost) {
  NEED_SM90();
  std::mt19937 rng(3);
  std::vector<uint32_t> words(4096);
  for (auto& w : words) w = rng();
  DeviceBuffer<uint32_t> tab(512), dw(words), folded(2 * words.size());
  fold_tables_kernel<<<1, 256>>>(tab.ptr, dw.ptr, folded.ptr, int(words.size()));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint32_t> t = tab.to_host(), f = folded.to_host();
  for (int i = 0; i < 256; ++i) {
    const FoldTable h = e2m1_fold_table(-i);
    ASSERT_EQ(t[size_t(2 * i)], h.lo) << "d " << -i;
    ASSERT_EQ(t[size_t(2 * i + 1)], h.hi) << "d " << -i;
  }
  for (size_t i = 0; i < words.size(); ++i) {
    uint32_t x, y;
    fold_e2m1x8(words[i], e2m1_fold_table(-int(i % 20)), e2m1_fold_table(-int(i % 31)), x, y);
    ASSERT_EQ(f[2 * i], x) << i;
    ASSERT_EQ(f[2 * i + 1], y) << i;
  }
}

TEST(FP8Fold, DeviceE4M3FoldMatchesHost) {
  NEED_SM90();
  // Every code in every byte at shifts 0..-39 (the device's f16 path against the integer one).
  std::vector<uint32_t> words;
  std::mt19937 rng(4);
  for (int i = 0; i < 40 * 256; ++i) {
    uint32_t c = uint32_t(i / 40) & 0xffu;
    if ((c & 0x7f) == 0x7f) c = 0x7e;
    words.push_back(c | (rng() & 0xffffff00u));
  }
  for (auto& w : words)
    for (int b = 1; b < 4; ++b)
      if (((w >> (8 * b)) & 0x7f) == 0x7f) w &= ~(1u << (8 * b));  // no NaN codes
  DeviceBuffer<uint32_t> dw(words), out(words.size());
  fold_e4m3_kernel<<<unsigned((words.size() + 255) / 256), 256>>>(dw.ptr, out.ptr, int(words.size()));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint32_t> got = out.to_host();
  for (size_t i = 0; i < words.size(); ++i) ASSERT_EQ(got[i], fold_e4m3x4(words[i], -int(i % 40))) << i;
}

// ---- one GEMM ------------------------------------------------------------------------------------
// Random MX weights [E, N, K] (logical rows), scale bytes 127 + [-spread, 2].
struct Mx4 {
  int64_t E, N, K;
  WeightFormat f;
  std::vector<uint8_t> codes, scales;
  std::vector<float> bias;  // [E, N] logical
  int64_t code_row() const { return f == WeightFormat::kMxfp4 ? K / 2 : K; }
  WeightMatrix view() const {
    WeightMatrix w;
    w.format = f;
    w.E = E, w.N = N, w.K = K;
    w.codes = codes.data(), w.scales = scales.data();
    w.code_row = code_row(), w.scale_row = K / 32;
    return w;
  }
};
Mx4 random_mx(WeightFormat f, int64_t E, int64_t N, int64_t K, int spread, uint64_t seed) {
  Mx4 m{E, N, K, f, {}, {}, {}};
  std::mt19937_64 rng(seed);
  m.codes.resize(size_t(E * N * m.code_row()));
  m.scales.resize(size_t(E * N * K / 32));
  for (size_t i = 0; i < m.codes.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(m.codes.data() + i, &v, std::min<size_t>(8, m.codes.size() - i));
  }
  if (f == WeightFormat::kMxfp8)
    for (auto& c : m.codes)
      if ((c & 0x7f) == 0x7f) c = uint8_t(c - 1);  // no NaN codes
  std::uniform_int_distribution<int> us(-spread, 2);
  for (auto& s : m.scales) s = uint8_t(127 + us(rng));
  std::normal_distribution<float> nb(0.0f, 0.5f);
  m.bias.resize(size_t(E * N));
  for (auto& b : m.bias) b = nb(rng);
  return m;
}

// Activation rows quantized per (row, 128-K group): scale = amax / 448, codes RNE; stored in the
// kernel K order, columns past K zero.
struct QuantRows {
  int64_t R, K, K_pad, groups, rows_pad;
  std::vector<uint8_t> stored;  // [R, K_pad] kernel order
  std::vector<float> sx;        // [groups, rows_pad]
  std::vector<double> deq;      // [R, K] logical: e4m3 * scale (what both references multiply)
};
QuantRows quantize_rows(int64_t R, int64_t K, int64_t K_pad, uint64_t seed) {
  QuantRows q{R, K, K_pad, (K_pad + 127) / 128, fp8::fp8_scale_rows_pad(R), {}, {}, {}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(R * K));
  for (auto& v : x) v = nd(rng);
  q.stored.assign(size_t(std::max<int64_t>(R, 1) * K_pad), 0);
  q.sx.assign(size_t(q.groups * q.rows_pad), 0.0f);
  q.deq.assign(size_t(R * K), 0.0);
  std::vector<uint8_t> logical(static_cast<size_t>(K_pad));
  for (int64_t r = 0; r < R; ++r) {
    std::fill(logical.begin(), logical.end(), 0);
    for (int64_t g = 0; g < q.groups; ++g) {
      float amax = 0;
      for (int64_t k = g * 128; k < std::min(K, g * 128 + 128); ++k) amax = std::max(amax, std::fabs(x[size_t(r * K + k)]));
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      q.sx[size_t(g * q.rows_pad + r)] = s;
      for (int64_t k = g * 128; k < std::min(K, g * 128 + 128); ++k) {
        const float v = std::min(448.0f, std::max(-448.0f, x[size_t(r * K + k)] / s));
        const uint8_t c = float_to_e4m3(v);
        logical[size_t(k)] = c;
        q.deq[size_t(r * K + k)] = double(e4m3_to_float(c)) * double(s);
      }
    }
    for (int64_t j = 0; j < K_pad; ++j) q.stored[size_t(r * K_pad + j)] = logical[size_t(fp8_kernel_k(int(j)))];
  }
  return q;
}

// The weight row as exact values, or as the fold makes it (e4m3(folded) * group scale).
std::vector<double> weight_row(const Mx4& w, int64_t e, int64_t n, bool folded) {
  std::vector<double> out(size_t(w.K));
  const bool fp4 = w.f == WeightFormat::kMxfp4;
  const uint8_t* codes = w.codes.data() + (e * w.N + n) * w.code_row();
  const uint8_t* sc = w.scales.data() + (e * w.N + n) * (w.K / 32);
  for (int64_t g = 0; g * 128 < w.K; ++g) {
    uint32_t smax = 0;
    for (int64_t b = 4 * g; b < std::min(w.K / 32, 4 * g + 4); ++b) smax = std::max<uint32_t>(smax, sc[b]);
    for (int64_t k = g * 128; k < std::min(w.K, g * 128 + 128); ++k) {
      const int sb = sc[k / 32];
      if (fp4) {
        const uint8_t code = uint8_t((codes[k / 2] >> (4 * (k & 1))) & 15u);
        out[size_t(k)] = folded ? double(e4m3_to_float(fold_e2m1(code, sb - int(smax)))) *
                                      double(fold_group_scale(smax, kE2M1FoldHeadroom))
                                : double(e2m1_to_float(code)) * std::ldexp(1.0, sb - 127);
      } else {
        out[size_t(k)] = folded ? double(e4m3_to_float(fold_e4m3(codes[k], sb - int(smax)))) *
                                      double(fold_group_scale(smax, kE4M3FoldHeadroom))
                                : double(e4m3_to_float(codes[k])) * std::ldexp(1.0, sb - 127);
      }
    }
  }
  return out;
}

// Rows of each expert in order; the active list holds every expert of `counts` (zeros too).
struct Work {
  std::vector<int> expert, count, row_start;
  int64_t rows = 0;
};
Work make_work(const std::vector<int>& counts) {
  Work w;
  for (size_t e = 0; e < counts.size(); ++e) {
    w.expert.push_back(int(e));
    w.count.push_back(counts[e]);
    w.row_start.push_back(int(w.rows));
    w.rows += counts[e];
  }
  return w;
}

struct Case {
  bool gemm2 = true;
  int64_t N = 256, K = 256;  // logical: GEMM2 N = H, K = I; GEMM1 N = 2I, K = H
  std::vector<int> counts;
  int spread = 3;
  Activation act = Activation::kSwigluOai;
  uint64_t seed = 1;
  WeightFormat f = WeightFormat::kMxfp4;
};

// What the probes (FP8Probe.*) take from a case besides the errors: the outputs and the folded
// reference ([R, cols]), and after `repeats` more launches the number of output elements whose
// bits differ from the first launch's (a race or an early register write shows there).
struct CaseDetail {
  std::vector<double> got, ref_folded;
  int64_t cols = 0;
  int repeats = 0;
  int64_t differing = 0;
};

// Runs one case; returns the rel-L2 errors against the exact and the folded references.
void run_case(const Case& c, double* err_exact, double* err_folded, float* ms = nullptr, bool reference = true,
              CaseDetail* detail = nullptr) {
  const int64_t E = int64_t(c.counts.size());
  const Work work = make_work(c.counts);
  const int64_t R = work.rows;
  LayerWeights lw;
  lw.cfg.num_experts = int(E);
  lw.cfg.format = c.f;
  lw.cfg.act = c.act;
  const Mx4 w = random_mx(c.f, E, c.N, c.K, c.spread, c.seed);
  ConvertedMatrix conv;
  if (c.gemm2) {
    lw.cfg.hidden = int(c.N), lw.cfg.intermediate = int(c.K);
    lw.w2 = w.view();
    lw.b2 = w.bias;
    conv = sm90::convert_w2(lw);
  } else {
    lw.cfg.hidden = int(c.K), lw.cfg.intermediate = int(c.N / 2);
    lw.w13 = w.view();
    lw.b13 = w.bias;
    conv = sm90::convert_w13(lw);
  }
  const int64_t K_pad = conv.dims.K_pad, N_pad = conv.dims.N_pad;
  const QuantRows q = quantize_rows(R, c.K, K_pad, c.seed + 1);
  std::mt19937_64 rng(c.seed + 2);
  std::uniform_real_distribution<float> uw(0.1f, 1.0f);
  std::vector<float> topk(size_t(std::max<int64_t>(R, 1)));
  for (auto& v : topk) v = uw(rng);
  std::vector<int32_t> row_src(size_t(std::max<int64_t>(R, 1)));
  for (int64_t r = 0; r < R; ++r) row_src[size_t(r)] = int32_t(r);

  DeviceBuffer<uint8_t> d_codes(conv.codes), d_scales(conv.scales), d_x(q.stored);
  DeviceBuffer<float> d_bias(conv.bias), d_sx(q.sx), d_topk(topk);
  DeviceBuffer<int32_t> d_row_src(row_src);
  const int num_active = int(E);
  DeviceBuffer<int> d_num(std::vector<int>{num_active}), d_expert(work.expert), d_count(work.count),
      d_start(work.row_start), d_counters(std::vector<int>{0, 0});
  const int64_t out_cols = c.gemm2 ? c.N : N_pad / 2;
  const int64_t out_elems = std::max<int64_t>(R, 1) * (c.gemm2 ? c.N : N_pad / 2);
  DeviceBuffer<float> d_out_f32(c.gemm2 ? out_elems : 1);
  DeviceBuffer<uint16_t> d_out_act(c.gemm2 ? 1 : out_elems);
  d_out_f32.poison();
  d_out_act.poison();

  fp8::Fp8Args a{};
  const int64_t map_rows = std::max<int64_t>(R, 1);
  ASSERT_EQ(fp8::make_fp8_rows_map(&a.base.in_map, d_x.ptr, map_rows, K_pad, 16), cudaSuccess);
  ASSERT_EQ(fp8::make_fp8_rows_map(&a.base.in_map_big, d_x.ptr, map_rows, K_pad, sm90::prefill::kBigBoxRows),
            cudaSuccess);
  ASSERT_EQ(fp8::make_fp8_scale_map(&a.sx_map, d_sx.ptr, q.rows_pad, q.groups), cudaSuccess);
  a.base.dims = conv.dims;
  a.base.codes = d_codes.ptr;
  a.base.scales = d_scales.ptr;
  a.base.bias = conv.bias.empty() ? nullptr : d_bias.ptr;
  a.base.work.num_active = d_num.ptr;
  a.base.work.expert = d_expert.ptr;
  a.base.work.count = d_count.ptr;
  a.base.work.row_start = d_start.ptr;
  a.base.out_act = d_out_act.ptr;
  a.base.out_f32 = d_out_f32.ptr;
  a.base.out_cols = out_cols;
  a.base.row_src = d_row_src.ptr;
  a.base.topk_weights = d_topk.ptr;
  a.base.tile_counter = d_counters.ptr;
  a.base.exit_count = d_counters.ptr + 1;
  a.base.act = ActivationParams{c.act, 1.702f, 1.0f, 7.0f};
  a.base.gemm2 = c.gemm2;
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CUDA_OK(fp8::launch_fp8_gemm(a, sms, nullptr, false));
  CUDA_OK(cudaDeviceSynchronize());
  if (detail && detail->repeats > 0) {
    const std::vector<float> f0 = d_out_f32.to_host();
    const std::vector<uint16_t> h0 = d_out_act.to_host();
    for (int i = 0; i < detail->repeats; ++i) {
      CUDA_OK(fp8::launch_fp8_gemm(a, sms, nullptr, false));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> f = d_out_f32.to_host();
      const std::vector<uint16_t> h = d_out_act.to_host();
      for (size_t j = 0; j < f.size(); ++j) detail->differing += std::memcmp(&f[j], &f0[j], 4) != 0;
      for (size_t j = 0; j < h.size(); ++j) detail->differing += h[j] != h0[j];
    }
  }
  if (ms) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    constexpr int kIters = 20;
    cudaEventRecord(e0);
    for (int i = 0; i < kIters; ++i) CUDA_OK(fp8::launch_fp8_gemm(a, sms, nullptr, false));
    cudaEventRecord(e1);
    CUDA_OK(cudaEventSynchronize(e1));
    cudaEventElapsedTime(ms, e0, e1);
    *ms /= kIters;
    cudaEventDestroy(e0), cudaEventDestroy(e1);
  }
  const std::vector<int> counters = d_counters.to_host();
  EXPECT_EQ(counters[0], 0);
  EXPECT_EQ(counters[1], 0);
  *err_exact = *err_folded = std::nan("");
  if (!reference) return;

  // References, multithreaded over rows; every stored element must have been written.
  const int64_t cols = c.gemm2 ? c.N : c.N / 2;
  std::vector<double> ref_e(size_t(R * cols)), ref_f(size_t(R * cols));
  std::vector<int> expert_of(static_cast<size_t>(R));
  for (int64_t e = 0; e < E; ++e)
    for (int i = 0; i < work.count[size_t(e)]; ++i) expert_of[size_t(work.row_start[size_t(e)] + i)] = int(e);
  std::vector<std::vector<double>> wrows_e(size_t(E * c.N)), wrows_f(size_t(E * c.N));
  for (int64_t e = 0; e < E; ++e)
    if (work.count[size_t(e)] > 0)
      for (int64_t n = 0; n < c.N; ++n) {
        wrows_e[size_t(e * c.N + n)] = weight_row(w, e, n, false);
        wrows_f[size_t(e * c.N + n)] = weight_row(w, e, n, true);
      }
  auto dot = [&](const std::vector<double>& wr, int64_t r) {
    double s = 0;
    for (int64_t k = 0; k < c.K; ++k) s += wr[size_t(k)] * q.deq[size_t(r * c.K + k)];
    return s;
  };
  const unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < nt; ++t)
    pool.emplace_back([&, t] {
      for (int64_t r = t; r < R; r += nt) {
        const int64_t e = expert_of[size_t(r)];
        for (int64_t j = 0; j < cols; ++j) {
          for (int which = 0; which < 2; ++which) {
            const auto& rows = which ? wrows_f : wrows_e;
            double v;
            if (c.gemm2) {
              v = (dot(rows[size_t(e * c.N + j)], r) + w.bias[size_t(e * c.N + j)]) * topk[size_t(r)];
            } else {
              const int64_t I = c.N / 2;
              const double gate = dot(rows[size_t(e * c.N + j)], r) + w.bias[size_t(e * c.N + j)];
              const double up = dot(rows[size_t(e * c.N + I + j)], r) + w.bias[size_t(e * c.N + I + j)];
              v = apply_activation(a.base.act, float(gate), float(up));
            }
            (which ? ref_f : ref_e)[size_t(r * cols + j)] = v;
          }
        }
      }
    });
  for (auto& th : pool) th.join();
  std::vector<double> got(size_t(R * cols));
  if (c.gemm2) {
    const std::vector<float> o = d_out_f32.to_host();
    for (int64_t i = 0; i < R * cols; ++i) got[size_t(i)] = o[size_t(i)];
  } else {
    const std::vector<uint16_t> o = d_out_act.to_host();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < cols; ++j) got[size_t(r * cols + j)] = bf16_to_float(o[size_t(r * (N_pad / 2) + j)]);
  }
  if (detail) {
    detail->got = got;
    detail->ref_folded = ref_f;
    detail->cols = cols;
  }
  for (size_t i = 0; i < got.size(); ++i) ASSERT_FALSE(std::isnan(got[i])) << "unwritten output " << i;
  auto rel = [&](const std::vector<double>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) num += (got[i] - ref[i]) * (got[i] - ref[i]), den += ref[i] * ref[i];
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  };
  *err_exact = rel(ref_e);
  *err_folded = rel(ref_f);
}

// The tolerances: against the folded weights, the accumulation only (Hopper's FP8 wgmma adds
// with fewer bits than fp32 within a 128-K group, then fp32 promotion; not measured yet, so the
// bounds are loose: a layout or scale mistake gives errors of order 1), GEMM1 also bf16 output
// rounding; against the exact weights, the same while blocks stay within the fold's exact range.
// The measured errors are printed (and recorded as test properties) to tighten these.
constexpr double kTolFolded2 = 1e-3, kTolFolded1 = 1e-2;

// GEMM1 stores bf16 and its references are not rounded: its figures include the output's bf16
// rounding, printed alone beside them (rel-L2 of the folded reference rounded to bf16; ~1.6e-3
// on random data), so what the kernel adds is the difference.
void check(const Case& c, const char* what) {
  SCOPED_TRACE(what);
  double ee = 0, ef = 0;
  CaseDetail d;
  run_case(c, &ee, &ef, nullptr, true, &d);
  testing::Test::RecordProperty(std::string(what) + " err_exact", std::to_string(ee));
  testing::Test::RecordProperty(std::string(what) + " err_folded", std::to_string(ef));
  if (c.gemm2) {
    std::printf("  %-48s rel-L2 vs exact weights %.3e, vs folded %.3e\n", what, ee, ef);
  } else {
    double num = 0, den = 0;
    for (double v : d.ref_folded) {
      const double r = double(round_bf16(float(v)));
      num += (r - v) * (r - v), den += v * v;
    }
    const double floor = den > 0 ? std::sqrt(num / den) : 0.0;
    testing::Test::RecordProperty(std::string(what) + " bf16_rounding", std::to_string(floor));
    std::printf("  %-48s rel-L2 vs exact weights %.3e, vs folded %.3e (the bf16 rounding alone %.3e)\n", what, ee,
                ef, floor);
  }
  const double tol = c.gemm2 ? kTolFolded2 : kTolFolded1;
  EXPECT_LE(ef, tol);
  if (c.f == WeightFormat::kMxfp4 ? c.spread <= 14 : c.spread == 0) EXPECT_LE(ee, tol);
}

TEST(FP8Gemm, Gemm2SmallShapes) {
  NEED_SM90();
  check({true, 256, 256, {3, 0, 130, 1}, 3, Activation::kSilu, 11}, "gemm2 mixed counts");
  check({true, 320, 192, {128}, 3, Activation::kSilu, 12}, "gemm2 one full tile, K % 128 = 64");
  check({true, 112, 96, {17, 5}, 3, Activation::kSilu, 13}, "gemm2 N = 112, K = 96 padded");
  check({true, 256, 256, {1}, 3, Activation::kSilu, 14}, "gemm2 one row");
  check({true, 256, 256, {3}, 3, Activation::kSilu, 15}, "gemm2 three rows");
  check({true, 256, 256, {0, 0, 0}, 3, Activation::kSilu, 16}, "gemm2 no rows");
  check({true, 256, 512, {0, 300, 0, 0}, 3, Activation::kSilu, 17}, "gemm2 all rows on one expert");
}

TEST(FP8Gemm, Gemm1Activations) {
  NEED_SM90();
  for (Activation act : {Activation::kSwigluOai, Activation::kSilu, Activation::kSiluClamped})
    check({false, 384, 320, {40, 0, 129}, 3, act, 21 + uint64_t(act)}, (std::string("gemm1 ") + activation_name(act)).c_str());
  check({false, 160, 96, {70}, 3, Activation::kSilu, 29}, "gemm1 I = 80, H = 96 padded");
}

TEST(FP8Gemm, ExponentsPastTheExactRange) {
  NEED_SM90();
  // Block exponents spread over 24 binades: blocks more than 14 below their group's largest
  // round (the folded reference follows the kernel; the exact one only bounds it).
  check({true, 256, 512, {64, 64}, 24, Activation::kSilu, 31}, "gemm2 spread 24");
}

TEST(FP8Gemm, Mxfp8Weights) {
  NEED_SM90();
  Case c{true, 256, 320, {3, 0, 130}, 0, Activation::kSilu, 71, WeightFormat::kMxfp8};
  check(c, "mxfp8 gemm2 one exponent per group (exact fold)");
  c.spread = 3, c.seed = 72;
  check(c, "mxfp8 gemm2 spread 3");
  check({false, 384, 192, {1, 97}, 3, Activation::kSwigluOai, 73, WeightFormat::kMxfp8}, "mxfp8 gemm1");
}

TEST(FP8Gemm, PresetShapes) {
  NEED_SM90();
  // GEMM1 / GEMM2 dims of the presets on two experts (rows: a full tile, then a 2-row one).
  check({false, 2 * 2880, 2880, {130, 2}, 3, Activation::kSwigluOai, 41}, "gpt-oss-120b gemm1");
  check({true, 2880, 2880, {130, 2}, 3, Activation::kSwigluOai, 42}, "gpt-oss-120b gemm2");
  check({false, 2 * 2048, 7168, {130, 2}, 3, Activation::kSilu, 43}, "deepseek-v3 gemm1");
  check({true, 7168, 2048, {130, 2}, 3, Activation::kSilu, 44}, "deepseek-v3 gemm2");
  check({false, 2 * 768, 2048, {130, 2}, 3, Activation::kSilu, 45}, "qwen3-30b-a3b gemm1");
  check({true, 2048, 768, {130, 2}, 3, Activation::kSilu, 46}, "qwen3-30b-a3b gemm2");
}

// For compute-sanitizer: one small GEMM of each kind.
TEST(FP8Sanitize, Small) {
  NEED_SM90();
  check({true, 192, 192, {20, 0, 70}, 3, Activation::kSilu, 51}, "sanitize gemm2");
  check({false, 256, 192, {33}, 3, Activation::kSwigluOai, 52}, "sanitize gemm1");
  check({true, 192, 192, {5, 70}, 3, Activation::kSilu, 53, WeightFormat::kMxfp8}, "sanitize mxfp8 gemm2");
}

// Timings (MOEKIT_FP8_BENCH=1): uniform routing of T tokens x top-k over E experts, one GEMM;
// TFLOP/s = 2 * rows * N * K / time (the GEMM alone: no quantization, no reference).
TEST(FP8Bench, Presets) {
  NEED_SM90();
  const char* on = std::getenv("MOEKIT_FP8_BENCH");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "set MOEKIT_FP8_BENCH=1";
  for (const test::Fp8BenchPreset& p : test::kFp8BenchPresets)
    for (int64_t T : {4096, 8192})
      for (bool gemm2 : {false, true}) {
        const std::vector<int> counts(size_t(p.E), int(T * p.k / p.E));
        const Case c{gemm2, gemm2 ? p.H : 2 * p.I, gemm2 ? p.I : p.H, counts, 3, Activation::kSilu, 61};
        double ee = 0, ef = 0;
        float ms = 0;
        run_case(c, &ee, &ef, &ms, false);
        const double flops = 2.0 * double(int64_t(counts[0]) * p.E) * double(c.N) * double(c.K);
        std::printf("FP8BENCH %s T=%lld %s: %.3f ms, %.1f TFLOP/s\n", p.name, (long long)T, gemm2 ? "gemm2" : "gemm1", ms,
                    flops / (ms * 1e-3) / 1e12);
        std::fflush(stdout);  // a line as it comes, also with stdout in a file under `timeout`
      }
}

// ---- probes (issue 49): one run says which of the first H200 run's causes still holds ----------
// Each prints FP8PROBE lines. ScaleBox: the activation-scale tensor copy as the GEMM's producer
// issues it (the map make_fp8_scale_map encodes, the box landing at the stage's kSxOff of a
// 1024-aligned stage, the same tx count), at the 4-aligned first rows the kernel now uses, with
// the values and the zero fill checked. MisalignedScaleBox: the same copy at first row 1, 2, 3, 5
// (what the kernel issued before: a tile's own row0), each in a child process (a fault ends the
// CUDA context): says whether it faults, hangs or lands. FirstTileMismatches: the GEMM on small
// cases with an expert starting at row 3 and a one-k-block last group, every mismatch against the
// folded reference listed by (row, column) up to 24, with the row0 % 4 of its tile, NaNs counted.
// RunToRunBitwise: the same launch 20 times more; any output bit that changes is a race (the
// early write to the wgmmas' A registers showed as such). Waits are bounded (no hang).
__global__ void scale_box_probe(const __grid_constant__ CUtensorMap map, int c0, int group, float* out, int* status) {
  extern __shared__ uint8_t probe_smem[];
  __shared__ alignas(8) uint64_t bar;
  const uint32_t b = ptx::smem_addr(&bar);
  const uint32_t base = (ptx::smem_addr(probe_smem) + 1023u) & ~1023u;
  const uint32_t dst = base + uint32_t(fp8::Traits<WeightFormat::kMxfp4>::kSxOff);
  constexpr uint32_t kBytes = uint32_t(fp8::Traits<WeightFormat::kMxfp4>::kSxBytes);
  __shared__ int landed;
  if (threadIdx.x == 0) {
    ptx::mbar_init(b, 1);
    ptx::fence_barrier_init();
    ptx::mbar_arrive_expect_tx(b, kBytes);
    sm90::prefill::tma_load_2d(dst, reinterpret_cast<uint64_t>(&map), c0, group, b);
    const uint64_t t0 = ptx::globaltimer_ns();
    bool ok = false;
    while (!(ok = ptx::mbar_try_wait<1000>(b, 0)) && ptx::globaltimer_ns() - t0 < 200ull * 1000 * 1000) {
    }
    landed = ok ? 1 : 2;
    *status = landed;
  }
  __syncthreads();
  if (landed != 1) return;
  for (uint32_t i = threadIdx.x; i < kBytes / 4; i += blockDim.x) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(dst + 4 * i));
    out[i] = v;
  }
}

struct ScaleProbeData {
  int64_t rows_pad = fp8::fp8_scale_rows_pad(300), groups = 3;
  std::vector<float> sx;
  ScaleProbeData() {
    sx.resize(size_t(rows_pad * groups));
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = 0; r < rows_pad; ++r) sx[size_t(g * rows_pad + r)] = float(g * 10000 + r) + 0.5f;
  }
  float expect(int c0, int g, int i) const {
    return c0 + i < rows_pad ? sx[size_t(g * rows_pad + c0 + i)] : 0.0f;
  }
};

// One probe copy: 1 landed with the right values, 0 landed wrong, 2 timed out, 3 a CUDA error.
int run_scale_probe(int c0, int g, std::string* what) {
  const ScaleProbeData p;
  float* d_sx = nullptr;
  float* d_out = nullptr;
  int* d_status = nullptr;
  constexpr int kBox = fp8::kSxBox;
  cudaError_t e = cudaMalloc(&d_sx, p.sx.size() * 4);
  if (e == cudaSuccess) e = cudaMalloc(&d_out, kBox * 4);
  if (e == cudaSuccess) e = cudaMalloc(&d_status, 4);
  if (e == cudaSuccess) e = cudaMemcpy(d_sx, p.sx.data(), p.sx.size() * 4, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = cudaMemset(d_out, 0xff, kBox * 4);
  if (e == cudaSuccess) e = cudaMemset(d_status, 0, 4);
  CUtensorMap map;
  if (e == cudaSuccess) e = fp8::make_fp8_scale_map(&map, d_sx, p.rows_pad, p.groups);
  const int smem = fp8::Traits<WeightFormat::kMxfp4>::kSxOff + fp8::Traits<WeightFormat::kMxfp4>::kSxBytes + 1024;
  if (e == cudaSuccess) e = cudaFuncSetAttribute(scale_box_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess) {
    scale_box_probe<<<1, 128, smem>>>(map, c0, g, d_out, d_status);
    e = cudaDeviceSynchronize();
  }
  if (e != cudaSuccess) {
    *what = std::string("CUDA error: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    return 3;
  }
  int status = 0;
  std::vector<float> out(kBox);
  cudaMemcpy(&status, d_status, 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(out.data(), d_out, kBox * 4, cudaMemcpyDeviceToHost);
  cudaFree(d_sx), cudaFree(d_out), cudaFree(d_status);
  if (status != 1) {
    *what = "the copy never completed its bytes (200 ms)";
    return 2;
  }
  int bad = 0, first = -1;
  for (int i = 0; i < kBox; ++i)
    if (out[size_t(i)] != p.expect(c0, g, i) && bad++ == 0) first = i;
  if (bad == 0) {
    *what = "landed, every value right";
    return 1;
  }
  char buf[200];
  std::snprintf(buf, sizeof buf, "landed WRONG: %d of %d values, first at %d: %g (expected %g; %g = row %d's)", bad,
                kBox, first, out[size_t(first)], p.expect(c0, g, first), out[size_t(first)],
                int(out[size_t(first)]) % 10000);
  *what = buf;
  return 0;
}

TEST(FP8Probe, ScaleBox) {
  NEED_SM90();
  for (int c0 : {0, 4, 8, 128, 168, 296})
    for (int g : {0, 2}) {
      std::string what;
      const int r = run_scale_probe(c0, g, &what);
      std::printf("FP8PROBE scale box first row %3d group %d: %s\n", c0, g, what.c_str());
      EXPECT_EQ(r, 1) << what;
      if (r == 3) return;  // the context is gone
    }
}

[[noreturn]] void misaligned_child(int c0) {
  std::string what;
  const int r = run_scale_probe(c0, 1, &what);
  std::fprintf(stderr, "FP8PROBE-CHILD %s\n", what.c_str());
  std::exit(10 + r);
}

TEST(FP8Probe, MisalignedScaleBox) {
  NEED_SM90();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (int c0 : {1, 2, 3, 5}) {
    int status = -1;
    EXPECT_EXIT(misaligned_child(c0), ([&status](int st) { status = st; return true; }), "");
    if (status == -1) continue;  // a child process skipping the other cases' statements
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    const char* says = code == 11 ? "lands right (no alignment needed)"
                       : code == 10 ? "lands WRONG values"
                       : code == 12 ? "never completes (hang)"
                       : code == 13 ? "CUDA error (illegal instruction expected; see the child's stderr above)"
                                    : "child died otherwise";
    std::printf("FP8PROBE scale box at first row %d (not a multiple of 4): %s (child exit %d)\n", c0, says, code);
  }
}

void print_mismatches(const char* name, const Case& c, const CaseDetail& d) {
  const Work work = make_work(c.counts);
  double rms = 0;
  for (double v : d.ref_folded) rms += v * v;
  rms = std::sqrt(rms / double(std::max<size_t>(1, d.ref_folded.size())));
  int64_t bad = 0, nans = 0;
  std::vector<int64_t> by_mod4(4, 0);
  int shown = 0;
  for (size_t i = 0; i < d.got.size(); ++i) {
    const int64_t r = int64_t(i) / d.cols, col = int64_t(i) % d.cols;
    const double g = d.got[i], f = d.ref_folded[i];
    const bool nan = std::isnan(g);
    if (!nan && std::fabs(g - f) <= 1e-3 * rms + 1e-3 * std::fabs(f)) continue;
    ++bad;
    nans += nan;
    size_t e = 0;
    while (e + 1 < work.row_start.size() && work.row_start[e + 1] <= r) ++e;
    const int row0 = work.row_start[e] + int(r - work.row_start[e]) / fp8::kRows * fp8::kRows;
    ++by_mod4[size_t(row0 % 4)];
    if (shown++ < 24)
      std::printf("FP8PROBE   %s row %lld col %lld (expert %zu, tile row0 %d): got %.6g folded ref %.6g\n", name,
                  (long long)r, (long long)col, e, row0, g, f);
  }
  std::printf("FP8PROBE %s: %lld of %zu outputs off (%lld NaN); by tile row0 %% 4: %lld %lld %lld %lld\n", name,
              (long long)bad, d.got.size(), (long long)nans, (long long)by_mod4[0], (long long)by_mod4[1],
              (long long)by_mod4[2], (long long)by_mod4[3]);
}

TEST(FP8Probe, FirstTileMismatches) {
  NEED_SM90();
  const struct {
    const char* name;
    Case c;
  } cases[] = {
      {"mxfp4 gemm2 rows {3,130} K 192", {true, 128, 192, {3, 130}, 3, Activation::kSilu, 81}},
      {"mxfp8 gemm2 rows {3,130} K 192", {true, 128, 192, {3, 130}, 3, Activation::kSilu, 82, WeightFormat::kMxfp8}},
      {"mxfp4 gemm2 rows {20,0,70} (sanitize gemm2)", {true, 192, 192, {20, 0, 70}, 3, Activation::kSilu, 51}},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name);
    CaseDetail d;
    double ee = 0, ef = 0;
    run_case(k.c, &ee, &ef, nullptr, true, &d);
    print_mismatches(k.name, k.c, d);
    std::printf("FP8PROBE %s: rel-L2 vs folded %.3e\n", k.name, ef);
    if (HasFatalFailure()) return;
    EXPECT_LE(ef, kTolFolded2);
  }
}

TEST(FP8Probe, RunToRunBitwise) {
  NEED_SM90();
  for (const Case& c : {Case{true, 192, 192, {20, 0, 70}, 3, Activation::kSilu, 51},
                        Case{true, 256, 320, {3, 0, 130}, 3, Activation::kSilu, 72, WeightFormat::kMxfp8},
                        Case{false, 384, 320, {40, 0, 129}, 3, Activation::kSwigluOai, 21}}) {
    CaseDetail d;
    d.repeats = 20;
    double ee = 0, ef = 0;
    run_case(c, &ee, &ef, nullptr, true, &d);
    std::printf("FP8PROBE run-to-run (%s %s, rows %zu experts): %lld output elements changed bits over 20 launches; "
                "rel-L2 vs folded %.3e\n",
                c.f == WeightFormat::kMxfp4 ? "mxfp4" : "mxfp8", c.gemm2 ? "gemm2" : "gemm1", c.counts.size(),
                (long long)d.differing, ef);
    if (HasFatalFailure()) return;
    EXPECT_EQ(d.differing, 0);
  }
}

// FP8Trap: a consumer wait that cannot end (fp8::ring_wait, 1 ms here) records what it waited
// for, as the prefill kernel's waits do, and fails the launch without a trap (an illegal-address
// load; sm90_fp8_gemm.cuh says why). A ring of one stage and one consumer warpgroup, tile slot j's
// descriptor words f = 8 j + f; barrier 0 (stage 0's full barrier) counts one arrival and gets none.
__global__ void fp8_consumer_wait_forever(int* rec, unsigned long long limit_ns) {
  namespace pf = sm90::prefill;
  constexpr int kStages = 1, kCwg = 1;
  __shared__ alignas(ptx::kBarrierLine) uint64_t bars[pf::barrier_line_words(kStages, kCwg) + 1];
  __shared__ int slots[2][8];
  fp8::Ring ring{};
  ring.bars = ptx::smem_addr(bars);
  ring.tiles = ptx::smem_addr(&slots[0][0]);
  ring.slot_bytes = uint32_t(sizeof(slots[0]));
  ring.kstages = kStages;
  ring.cwg = kCwg;
  if (threadIdx.x == 0) {
    for (int b = 0; b < pf::barrier_count(kStages, kCwg); ++b) ptx::mbar_init(ring.bars + 8u * uint32_t(b), 1);
    for (int i = 0; i < 16; ++i) slots[i / 8][i % 8] = i;
    bars[pf::barrier_line_words(kStages, kCwg)] = reinterpret_cast<uint64_t>(rec);
    ptx::fence_barrier_init();
  }
  __syncthreads();
  fp8::ring_wait(ring, ring.full(0), 0, trap::kPrefillFull, limit_ns);
}

[[noreturn]] void fp8_wait_child() {
  int* rec = trap::device_record();
  if (!rec) std::exit(4);
  fp8_consumer_wait_forever<<<1, 128>>>(rec, 1000ull * 1000);
  const cudaError_t e = cudaDeviceSynchronize();
  std::fprintf(stderr, "%s; %s\n", cudaGetErrorName(e), trap::report().c_str());
  std::exit(e == cudaSuccess ? 5 : 3);
}

TEST(FP8Trap, ATimedOutConsumerWaitFailsAndSaysWhat) {
  NEED_SM90();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(fp8_wait_child(), testing::ExitedWithCode(3),
              "cudaError[A-Za-z]+; prefill consumer wait for a filled stage timed out \\(block 0, thread "
              "[0-9]+\\): barrier 0, parity 0, stages 1, phase parities \\(bit b: barrier b\\) 0, slot 0 tile 0, "
              "slot 0 rows 3, slot 0 variant 4, slot 0 first group 5, slot 1 tile 8, slot 1 rows 11, slot 1 variant "
              "12, slot 1 first group 13, SM [0-9]+");
}

}  // namespace
}  // namespace moekit
