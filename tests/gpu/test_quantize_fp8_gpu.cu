// FP8 activations on the GPU (issue 49): the quantizer (pipeline/quantize_fp8_sm90.cuh) bit for bit
// against formats/fp8_act.h on the host (codes in logical order after undoing fp8_kernel_k, scales
// bitwise, padding rows and columns zero), both scale rules, poisoned outputs, awkward sizes, NaN /
// Inf / all-zero / tiny groups, every E4M3 rounding boundary, the batched formats' work_rows; and
// the chain quantize -> FP8 GEMM1 -> quantize -> FP8 GEMM2 -> finalize against the CPU backend's
// fp8 layer (public API) on the same data. MOEKIT_FP8_BENCH=1 adds the quantizer's timings (FP8Bench.Quantize).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fp8_chain.h"
#include "gpu_util.h"
#include "moekit/common/bf16.h"
#include "moekit/experts/sm90_fp8_gemm.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/formats/fold_fp8.h"
#include "moekit/formats/fp8_act.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"
#include "moekit/pipeline/quantize_fp8_sm90.cuh"

namespace moekit {
namespace {

using test::DeviceBuffer;
namespace fp8 = sm90::fp8;

const char* rule_name(ActivationScale r) { return activation_scale_name(r); }

// ---- data ------------------------------------------------------------------------------------------
// Rows [R, stride] bf16 (columns past K random too: the quantizer must not read them as data):
// each 128-K group N(0, 1) times 2^U(-30, 30), with special groups sprinkled in (special = true):
// all zero, one NaN, one +Inf, one -Inf, amax below the 1e-4 floor, signed zeros and tiny values
// that round to zero, values near bf16's largest.
std::vector<uint16_t> random_rows(int64_t R, int64_t K, int64_t stride, uint64_t seed, bool special) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ue(-30, 30), kind(0, 15);
  std::vector<uint16_t> v(size_t(R * stride));
  for (int64_t r = 0; r < R; ++r) {
    uint16_t* row = v.data() + r * stride;
    for (int64_t c = K; c < stride; ++c) row[c] = float_to_bf16(nd(rng));  // past K: never data
    for (int64_t g0 = 0; g0 < K; g0 += kFp8ActGroup) {
      const int64_t g1 = std::min(K, g0 + kFp8ActGroup);
      const float mag = std::ldexp(1.0f, ue(rng));
      for (int64_t c = g0; c < g1; ++c) row[c] = float_to_bf16(nd(rng) * mag);
      if (!special) continue;
      const int64_t at = g0 + int64_t(rng() % uint64_t(g1 - g0));
      switch (kind(rng)) {
        case 0: for (int64_t c = g0; c < g1; ++c) row[c] = 0; break;
        case 1: row[at] = 0x7fc0; break;  // NaN
        case 2: row[at] = 0x7f80; break;  // +Inf
        case 3: row[at] = 0xff80; break;  // -Inf
        case 4: for (int64_t c = g0; c < g1; ++c) row[c] = float_to_bf16(nd(rng) * 1e-6f); break;
        case 5:
          for (int64_t c = g0; c < g1; ++c) row[c] = (c & 1) ? 0x8000 : float_to_bf16(-1e-30f);
          row[at] = float_to_bf16(3.0f);  // -0 stays 0x80; tiny negatives round to -0
          break;
        case 6: for (int64_t c = g0; c < g1; ++c) row[c] = float_to_bf16(nd(rng) * 1e37f); row[at] = 0x7f7f; break;
        default: break;
      }
    }
  }
  return v;
}

// What the GEMM's input must hold for one row: codes in the kernel K order [K_pad], scales [groups].
void expected_row(const uint16_t* src, int64_t K, int64_t K_pad, ActivationScale rule, uint8_t* stored, float* scales) {
  const int64_t groups = (K_pad + kFp8ActGroup - 1) / kFp8ActGroup;
  std::fill(stored, stored + K_pad, uint8_t(0));
  std::fill(scales, scales + groups, 0.0f);
  if (!src) return;
  std::vector<float> x(static_cast<size_t>(K));
  for (int64_t c = 0; c < K; ++c) x[size_t(c)] = bf16_to_float(src[c]);
  std::vector<uint8_t> logical(size_t(K_pad), 0);
  quantize_row_fp8_act(x.data(), K, rule, logical.data(), scales);
  for (int64_t j = 0; j < K_pad; ++j) stored[j] = logical[size_t(fp8_kernel_k(int(j)))];
}

// A host plan as route_plan makes it for the standard format: expert segments in expert order,
// each padded to kRowAlign rows (row_src -1), rows past the segments stale (row_src 0 here: a
// quantizer that read them would store token 0 there).
struct HostPlan {
  int64_t rows = 0, end = 0;
  std::vector<int32_t> dest, row_src;
  std::vector<int> num_active{0}, expert, count, row_start;
};
HostPlan make_plan(const std::vector<int32_t>& ids, int64_t T, int k, int E) {
  HostPlan p;
  p.rows = T * k + int64_t(E) * (sm90::kRowAlign - 1);
  p.dest.assign(size_t(T * k), -1);
  p.row_src.assign(size_t(std::max<int64_t>(p.rows, 1)), 0);
  std::vector<int> cnt(size_t(E), 0);
  for (int32_t id : ids)
    if (id >= 0) ++cnt[size_t(id)];
  std::vector<int64_t> start(size_t(E) + 1, 0);
  for (int e = 0; e < E; ++e) start[size_t(e) + 1] = start[size_t(e)] + sm90::pad_to(cnt[size_t(e)], sm90::kRowAlign);
  for (int64_t r = 0; r < start[size_t(E)]; ++r) p.row_src[size_t(r)] = -1;
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < T * k; ++i) {
    const int32_t id = ids[size_t(i)];
    if (id < 0) continue;
    const int64_t r = next[size_t(id)]++;
    p.dest[size_t(i)] = int32_t(r);
    p.row_src[size_t(r)] = int32_t(i);
  }
  for (int e = 0; e < E; ++e)
    if (cnt[size_t(e)] > 0) {
      p.expert.push_back(e);
      p.count.push_back(cnt[size_t(e)]);
      p.row_start.push_back(int(start[size_t(e)]));
      p.end = start[size_t(e)] + cnt[size_t(e)];
    }
  p.num_active[0] = int(p.expert.size());
  if (p.expert.empty()) p.expert = p.count = p.row_start = {0};
  return p;
}

struct DevPlan {
  DeviceBuffer<int32_t> dest, row_src;
  DeviceBuffer<int> num_active, expert, count, row_start;
  explicit DevPlan(const HostPlan& p)
      : dest(p.dest.empty() ? std::vector<int32_t>{-1} : p.dest), row_src(p.row_src), num_active(p.num_active),
        expert(p.expert), count(p.count), row_start(p.row_start) {}
};

// Random ids: -1 with probability 1/8 (none when !empties), else uniform (or all on expert `one`
// when >= 0).
std::vector<int32_t> random_ids(int64_t T, int k, int E, uint64_t seed, int one = -1, bool empties = true) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(size_t(T * k));
  for (auto& id : ids) id = empties && rng() % 8 == 0 ? -1 : one >= 0 ? one : int32_t(rng() % uint64_t(E));
  return ids;
}

// Device output vs the expected rows: codes [rows, K_pad], scales [groups, rows_pad] bitwise.
void compare(const std::vector<uint8_t>& codes, const std::vector<float>& scales, int64_t rows, int64_t rows_pad,
             int64_t K_pad, const std::function<const uint16_t*(int64_t)>& src_of, int64_t K, ActivationScale rule) {
  const int64_t groups = (K_pad + kFp8ActGroup - 1) / kFp8ActGroup;
  std::vector<uint8_t> st(static_cast<size_t>(K_pad));
  std::vector<float> sc(static_cast<size_t>(groups));
  int64_t bad_codes = 0, bad_scales = 0;
  for (int64_t r = 0; r < rows_pad; ++r) {
    expected_row(r < rows ? src_of(r) : nullptr, K, K_pad, rule, st.data(), sc.data());
    if (r < rows)
      for (int64_t j = 0; j < K_pad; ++j) {
        const uint8_t got = codes[size_t(r * K_pad + j)];
        if (got != st[size_t(j)] && bad_codes++ < 5)
          ADD_FAILURE() << "row " << r << " stored column " << j << " (logical " << fp8_kernel_k(int(j)) << "): got 0x"
                        << std::hex << int(got) << " want 0x" << int(st[size_t(j)]) << std::dec;
      }
    for (int64_t g = 0; g < groups; ++g) {
      const float got = scales[size_t(g * rows_pad + r)];
      if (float_to_bits(got) != float_to_bits(sc[size_t(g)]) && bad_scales++ < 5)
        ADD_FAILURE() << "row " << r << " group " << g << ": scale " << got << " want " << sc[size_t(g)];
    }
  }
  EXPECT_EQ(bad_codes, 0);
  EXPECT_EQ(bad_scales, 0);
}

// ---- the rows launch (GEMM2's input) -------------------------------------------------------------
// plan: rows marked by a plan over E experts (padding rows zero), else every row real.
void check_rows(int64_t rows_real, int64_t K, int64_t stride_extra, ActivationScale rule, bool plan, uint64_t seed) {
  SCOPED_TRACE("rows " + std::to_string(rows_real) + " K " + std::to_string(K) + " " + rule_name(rule) +
               (plan ? " with plan" : ""));
  const int64_t K_pad = sm90::pad_to(K, 64), stride = K_pad + stride_extra;
  HostPlan hp;
  int64_t rows = rows_real;
  if (plan) {
    const int k = 2, E = 5;
    hp = make_plan(random_ids((rows_real + 1) / 2, k, E, seed + 7), (rows_real + 1) / 2, k, E);
    rows = hp.rows;
  }
  const int64_t rows_pad = fp8::fp8_scale_rows_pad(rows), groups = (K_pad + 127) / 128;
  const std::vector<uint16_t> src = random_rows(rows, K, stride, seed, true);
  DeviceBuffer<uint16_t> d_src(src.empty() ? std::vector<uint16_t>(8, 0) : src);
  DeviceBuffer<uint8_t> d_codes(size_t(std::max<int64_t>(rows * K_pad, 1)));
  DeviceBuffer<float> d_scales(size_t(std::max<int64_t>(groups * rows_pad, 1)));
  d_codes.poison(0xab);
  d_scales.poison(0xab);
  DevPlan dp(plan ? hp : make_plan({}, 0, 1, 1));
  fp8::QuantFp8Args a{};
  a.src = d_src.ptr;
  a.src_stride = stride;
  a.row_src = plan ? dp.row_src.ptr : nullptr;
  a.num_active = dp.num_active.ptr, a.count = dp.count.ptr, a.row_start = dp.row_start.ptr;
  a.codes = d_codes.ptr, a.scales = d_scales.ptr;
  a.rows = rows, a.rows_pad = rows_pad, a.K = K, a.K_pad = K_pad, a.rule = int32_t(rule);
  CUDA_OK(fp8::launch_quantize_rows_fp8(a, nullptr, false));
  CUDA_OK(cudaDeviceSynchronize());
  compare(d_codes.to_host(), d_scales.to_host(), rows, rows_pad, K_pad, [&](int64_t r) -> const uint16_t* {
    if (plan && (r >= hp.end || hp.row_src[size_t(r)] < 0)) return nullptr;
    return src.data() + r * stride;
  }, K, rule);
}

TEST(FP8Quant, RowsBitExact) {
  NEED_SM90();
  for (ActivationScale rule : {ActivationScale::kFp32, ActivationScale::kUe8m0})
    for (int64_t K : {2880, 96, 200, 7168, 64})
      for (int64_t R : {0, 1, 3, 130}) check_rows(R, K, 0, rule, false, 100 + uint64_t(K) + uint64_t(R));
  check_rows(37, 2880, 64, ActivationScale::kFp32, false, 5);  // rows of a longer stride
}

TEST(FP8Quant, RowsWithPlanZeroPadding) {
  NEED_SM90();
  for (ActivationScale rule : {ActivationScale::kFp32, ActivationScale::kUe8m0})
    for (int64_t R : {1, 3, 61}) check_rows(R, 2880, 0, rule, true, 200 + uint64_t(R));
  check_rows(40, 200, 0, ActivationScale::kUe8m0, true, 9);
}

// Every E4M3 rounding boundary through the kernel: groups whose amax is 448 (scale 1 under both
// rules: fp32(448 / 448) = 1), holding the midpoints between consecutive codes and the bf16
// neighbours of each, both signs, and values around half the smallest subnormal.
TEST(FP8Quant, RoundingBoundaries) {
  NEED_SM90();
  std::vector<float> vals;
  for (int c = 0; c < 126; ++c) {
    const float lo = e4m3_to_float(uint8_t(c)), hi = e4m3_to_float(uint8_t(c + 1));
    const float mid = 0.5f * (lo + hi);
    vals.push_back(mid);
    vals.push_back(bf16_to_float(uint16_t(float_to_bf16(mid) + 1)));
    vals.push_back(bf16_to_float(uint16_t(float_to_bf16(mid) - 1)));
    vals.push_back(hi);
  }
  vals.push_back(std::ldexp(1.0f, -10));
  vals.push_back(std::ldexp(1.0f, -11));
  vals.push_back(std::ldexp(1.0f, -20));
  vals.push_back(0.0f);
  const int64_t K = 128;
  std::vector<uint16_t> rows;
  for (float sign : {1.0f, -1.0f})
    for (size_t i = 0; i < vals.size(); i += 127) {
      std::vector<uint16_t> row(size_t(K), 0);
      row[0] = float_to_bf16(448.0f);
      for (size_t j = 0; j < 127 && i + j < vals.size(); ++j) row[j + 1] = float_to_bf16(sign * vals[i + j]);
      rows.insert(rows.end(), row.begin(), row.end());
    }
  const int64_t R = int64_t(rows.size()) / K, rows_pad = fp8::fp8_scale_rows_pad(R);
  for (ActivationScale rule : {ActivationScale::kFp32, ActivationScale::kUe8m0}) {
    SCOPED_TRACE(rule_name(rule));
    DeviceBuffer<uint16_t> d_src(rows);
    DeviceBuffer<uint8_t> d_codes(size_t(R * K));
    DeviceBuffer<float> d_scales{size_t(rows_pad)};
    d_codes.poison(0xab);
    d_scales.poison(0xab);
    fp8::QuantFp8Args a{};
    a.src = d_src.ptr, a.src_stride = K, a.codes = d_codes.ptr, a.scales = d_scales.ptr;
    a.rows = R, a.rows_pad = rows_pad, a.K = K, a.K_pad = K, a.rule = int32_t(rule);
    CUDA_OK(fp8::launch_quantize_rows_fp8(a, nullptr, false));
    CUDA_OK(cudaDeviceSynchronize());
    compare(d_codes.to_host(), d_scales.to_host(), R, rows_pad, K,
            [&](int64_t r) { return rows.data() + r * K; }, K, rule);
  }
}

// ---- the gather launch (GEMM1's input) -----------------------------------------------------------
void check_gather(int64_t T, int k, int E, int64_t K, ActivationScale rule, uint64_t seed, int one = -1,
                  int run = -1) {
  SCOPED_TRACE("gather T " + std::to_string(T) + " k " + std::to_string(k) + " E " + std::to_string(E) + " K " +
               std::to_string(K) + " " + rule_name(rule) + (one >= 0 ? " one expert" : "") +
               (run >= 0 ? " run " + std::to_string(run) : ""));
  const int64_t K_pad = sm90::pad_to(K, 64), stride = K_pad;
  const HostPlan hp = make_plan(random_ids(T, k, E, seed, one), T, k, E);
  const int64_t rows = hp.rows, rows_pad = fp8::fp8_scale_rows_pad(rows), groups = (K_pad + 127) / 128;
  const std::vector<uint16_t> x = random_rows(T, K, stride, seed + 1, true);
  DeviceBuffer<uint16_t> d_x(x.empty() ? std::vector<uint16_t>(8, 0) : x);
  DeviceBuffer<uint8_t> d_codes(size_t(std::max<int64_t>(rows * K_pad, 1)));
  DeviceBuffer<float> d_scales(size_t(std::max<int64_t>(groups * rows_pad, 1)));
  d_codes.poison(0xab);
  d_scales.poison(0xab);
  DevPlan dp(hp);
  DeviceBuffer<int> d_run(std::vector<int>{run});
  fp8::QuantFp8Args a{};
  a.src = d_x.ptr, a.src_stride = stride, a.dest = dp.dest.ptr, a.row_src = dp.row_src.ptr;
  a.num_active = dp.num_active.ptr, a.count = dp.count.ptr, a.row_start = dp.row_start.ptr;
  a.run = run >= 0 ? d_run.ptr : nullptr;
  a.codes = d_codes.ptr, a.scales = d_scales.ptr;
  a.T = T, a.k = k, a.rows = rows, a.rows_pad = rows_pad, a.K = K, a.K_pad = K_pad, a.rule = int32_t(rule);
  CUDA_OK(fp8::launch_quantize_gather_fp8(a, nullptr, false));
  CUDA_OK(cudaDeviceSynchronize());
  if (T == 0) return;
  const std::vector<uint8_t> codes = d_codes.to_host();
  const std::vector<float> scales = d_scales.to_host();
  if (run == 0) {  // nothing written
    for (uint8_t c : codes) ASSERT_EQ(c, 0xab);
    return;
  }
  compare(codes, scales, rows, rows_pad, K_pad, [&](int64_t r) -> const uint16_t* {
    if (r >= hp.end || hp.row_src[size_t(r)] < 0) return nullptr;
    return x.data() + (hp.row_src[size_t(r)] / k) * stride;
  }, K, rule);
}

TEST(FP8Quant, GatherBitExact) {
  NEED_SM90();
  for (ActivationScale rule : {ActivationScale::kFp32, ActivationScale::kUe8m0}) {
    for (int64_t T : {0, 1, 3, 129}) check_gather(T, 4, 8, 2880, rule, 300 + uint64_t(T));
    check_gather(33, 8, 16, 7168, rule, 310);
    check_gather(5, 3, 5, 200, rule, 311);
    check_gather(17, 1, 3, 96, rule, 312);
    check_gather(40, 4, 8, 2880, rule, 313, 5);  // every row on one expert
    check_gather(70, 40, 64, 256, rule, 314);    // k > 32
  }
  check_gather(9, 4, 8, 2880, ActivationScale::kFp32, 320, -1, 0);  // the device chose decode
  check_gather(9, 4, 8, 2880, ActivationScale::kFp32, 321, -1, 1);
}

// work_rows (the batched formats): expert e's rows [e * C, e * C + count_e) as a plan_counts work
// list (empty experts left out, row_start ascending); the rows launch quantizes exactly those rows
// (bit for bit) and leaves every other code and scale poisoned, NaN rows past the counts unread as
// data; the gather launch with work_rows writes the rows dest names and nothing else (no zeroing).
TEST(FP8Quant, WorkRowsTouchOnlyTheCountedRows) {
  NEED_SM90();
  const int E = 6, C = 9;
  const std::vector<int> counts = {3, 0, 9, 1, 0, 4};
  const int64_t rows = int64_t(E) * C, rows_pad = fp8::fp8_scale_rows_pad(rows);
  HostPlan hp;
  hp.rows = rows;
  hp.row_src.assign(size_t(rows), 0);
  hp.expert.clear(), hp.count.clear(), hp.row_start.clear();
  for (int e = 0; e < E; ++e)
    if (counts[size_t(e)] > 0) hp.expert.push_back(e), hp.count.push_back(counts[size_t(e)]), hp.row_start.push_back(e * C);
  hp.num_active[0] = int(hp.expert.size());
  hp.dest = {-1};
  auto counted = [&](int64_t r) { return r % C < counts[size_t(r / C)]; };
  for (ActivationScale rule : {ActivationScale::kFp32, ActivationScale::kUe8m0})
    for (int64_t K : {2880, 200}) {
      SCOPED_TRACE(std::string(rule_name(rule)) + " K " + std::to_string(K));
      const int64_t K_pad = sm90::pad_to(K, 64), groups = (K_pad + 127) / 128;
      std::vector<uint16_t> src = random_rows(rows, K, K_pad, 500 + uint64_t(K), false);
      for (int64_t r = 0; r < rows; ++r)
        if (!counted(r)) std::fill_n(src.begin() + r * K_pad, K_pad, uint16_t(0x7fc0));  // garbage: NaN
      DeviceBuffer<uint16_t> d_src(src);
      DeviceBuffer<uint8_t> d_codes(size_t(rows * K_pad));
      DeviceBuffer<float> d_scales(size_t(groups * rows_pad));
      DevPlan dp(hp);
      for (const bool gather : {false, true}) {
        SCOPED_TRACE(gather ? "gather" : "rows");
        d_codes.poison(0xab);
        d_scales.poison(0xab);
        fp8::QuantFp8Args a{};
        a.num_active = dp.num_active.ptr, a.count = dp.count.ptr, a.row_start = dp.row_start.ptr;
        a.work_rows = 1;
        a.codes = d_codes.ptr, a.scales = d_scales.ptr;
        a.rows = rows, a.rows_pad = rows_pad, a.K = K, a.K_pad = K_pad, a.rule = int32_t(rule);
        // The gather: token i of the counted rows (in row order) goes to its row.
        std::vector<int32_t> dest;
        std::vector<uint16_t> tokens;
        for (int64_t r = 0; r < rows; ++r)
          if (counted(r)) {
            dest.push_back(int32_t(r));
            tokens.insert(tokens.end(), src.begin() + r * K_pad, src.begin() + (r + 1) * K_pad);
          }
        DeviceBuffer<int32_t> d_dest(dest);
        DeviceBuffer<uint16_t> d_tok(tokens);
        a.src_stride = K_pad;
        if (gather) {
          a.src = d_tok.ptr, a.dest = d_dest.ptr, a.T = int64_t(dest.size()), a.k = 1;
          CUDA_OK(fp8::launch_quantize_gather_fp8(a, nullptr, false));
        } else {
          a.src = d_src.ptr;
          CUDA_OK(fp8::launch_quantize_rows_fp8(a, nullptr, false));
        }
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<uint8_t> codes = d_codes.to_host();
        const std::vector<float> scales = d_scales.to_host();
        std::vector<uint8_t> st(static_cast<size_t>(K_pad));
        std::vector<float> sc(static_cast<size_t>(groups));
        int64_t bad = 0;
        for (int64_t r = 0; r < rows_pad; ++r) {
          const bool real = r < rows && counted(r);
          if (real) expected_row(src.data() + r * K_pad, K, K_pad, rule, st.data(), sc.data());
          for (int64_t j = 0; r < rows && j < K_pad; ++j)
            bad += codes[size_t(r * K_pad + j)] != (real ? st[size_t(j)] : uint8_t(0xab));
          for (int64_t g = 0; g < groups; ++g) {
            const float got = scales[size_t(g * rows_pad + r)];
            bad += real ? float_to_bits(got) != float_to_bits(sc[size_t(g)]) : float_to_bits(got) != 0xabababab;
          }
          if (bad) {
            ADD_FAILURE() << "row " << r << (real ? " (counted)" : " (not counted: must stay poisoned)");
            break;
          }
        }
      }
    }
}

TEST(FP8Quant, BadArgumentsRefused) {
  NEED_SM90();
  DeviceBuffer<uint16_t> x(64);
  DeviceBuffer<uint8_t> c(64);
  DeviceBuffer<float> s(8);
  fp8::QuantFp8Args a{};
  a.src = x.ptr, a.src_stride = 64, a.codes = c.ptr, a.scales = s.ptr;
  a.rows = 1, a.rows_pad = 4, a.K = 64, a.K_pad = 64;
  EXPECT_EQ(fp8::launch_quantize_rows_fp8(a, nullptr, false), cudaSuccess);
  CUDA_OK(cudaDeviceSynchronize());
  fp8::QuantFp8Args b = a;
  b.K_pad = 96;  // not a multiple of 64
  EXPECT_EQ(fp8::launch_quantize_rows_fp8(b, nullptr, false), cudaErrorInvalidValue);
  b = a, b.rows_pad = 2;
  EXPECT_EQ(fp8::launch_quantize_rows_fp8(b, nullptr, false), cudaErrorInvalidValue);
  b = a, b.rule = 7;
  EXPECT_EQ(fp8::launch_quantize_rows_fp8(b, nullptr, false), cudaErrorInvalidValue);
  b = a, b.T = 1, b.k = 1;  // gather without dest
  EXPECT_EQ(fp8::launch_quantize_gather_fp8(b, nullptr, false), cudaErrorInvalidValue);
  b = a, b.work_rows = 1;  // without a work list
  EXPECT_EQ(fp8::launch_quantize_rows_fp8(b, nullptr, false), cudaErrorInvalidValue);
}

// For compute-sanitizer (scripts/gpu_check.sh fp8): both launches on a small plan (the chain: FP8Sanitize.Chain).
TEST(FP8Sanitize, Quantize) {
  NEED_SM90();
  check_gather(11, 4, 6, 200, ActivationScale::kUe8m0, 400);
  check_rows(9, 200, 0, ActivationScale::kFp32, true, 401);
}

// Timings (MOEKIT_FP8_BENCH=1): the gather at T tokens of the presets (uniform routing) and the
// rows launch on the intermediate; GB/s = bytes read + written (x once; codes and scales of every
// row) over the time, beside a device-to-device copy's rate (2 x bytes / time) of 1 GiB.
TEST(FP8Bench, Quantize) {
  NEED_SM90();
  const char* on = std::getenv("MOEKIT_FP8_BENCH");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "set MOEKIT_FP8_BENCH=1";
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  auto time_ms = [&](const std::function<void()>& f) {
    f();
    cudaDeviceSynchronize();
    constexpr int kIters = 20;
    cudaEventRecord(e0);
    for (int i = 0; i < kIters; ++i) f();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    return double(ms) / kIters;
  };
  {
    const size_t n = size_t(1) << 30;
    DeviceBuffer<uint8_t> a(n), b(n);
    const double ms = time_ms([&] { cudaMemcpyAsync(b.ptr, a.ptr, n, cudaMemcpyDeviceToDevice); });
    std::printf("FP8BENCH quantize: device-to-device copy of 1 GiB %.3f ms, %.0f GB/s (read + write)\n", ms,
                2.0 * double(n) / (ms * 1e-3) / 1e9);
  }
  for (const test::Fp8BenchPreset& p : test::kFp8BenchPresets)
    for (int64_t T : {4096, 8192}) {
      const HostPlan hp = make_plan(random_ids(T, p.k, p.E, 9, -1, false), T, p.k, p.E);
      DevPlan dp(hp);
      const int64_t H_pad = sm90::pad_to(p.H, 64), I_pad = sm90::pad_to(p.I, 64);
      const int64_t rows = hp.rows, rows_pad = fp8::fp8_scale_rows_pad(rows);
      int64_t real = 0;
      for (int32_t r : hp.dest) real += r >= 0;
      DeviceBuffer<uint16_t> x(test::random_x(T * H_pad, 3)), mid(test::random_x(rows * I_pad, 4));
      DeviceBuffer<uint8_t> codes(size_t(rows * std::max(H_pad, I_pad)));
      DeviceBuffer<float> scales(size_t((std::max(H_pad, I_pad) + 127) / 128 * rows_pad));
      fp8::QuantFp8Args a{};
      a.src = x.ptr, a.src_stride = H_pad, a.dest = dp.dest.ptr, a.row_src = dp.row_src.ptr;
      a.num_active = dp.num_active.ptr, a.count = dp.count.ptr, a.row_start = dp.row_start.ptr;
      a.codes = codes.ptr, a.scales = scales.ptr;
      a.T = T, a.k = p.k, a.rows = rows, a.rows_pad = rows_pad, a.K = p.H, a.K_pad = H_pad;
      a.rule = int32_t(ActivationScale::kUe8m0);
      const double g = time_ms([&] { fp8::launch_quantize_gather_fp8(a, nullptr, false); });
      const double gb = double(T * p.H * 2) + double(rows) * double(H_pad + 4 * ((H_pad + 127) / 128));
      fp8::QuantFp8Args b = a;
      b.src = mid.ptr, b.src_stride = I_pad, b.dest = nullptr, b.T = 0, b.k = 0, b.K = p.I, b.K_pad = I_pad;
      const double r = time_ms([&] { fp8::launch_quantize_rows_fp8(b, nullptr, false); });
      const double rb = double(real * p.I * 2) + double(rows) * double(I_pad + 4 * ((I_pad + 127) / 128));
      std::printf("FP8BENCH quantize %s T=%lld: gather %.3f ms %.0f GB/s, rows %.3f ms %.0f GB/s\n", p.name,
                  (long long)T, g, gb / (g * 1e-3) / 1e9, r, rb / (r * 1e-3) / 1e9);
      EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    }
  cudaEventDestroy(e0), cudaEventDestroy(e1);
}

}  // namespace
}  // namespace moekit

namespace moekit::test {

std::string run_fp8_chain(const Fp8ChainIn& c, std::vector<uint16_t>* y_out) {
  const int64_t T = c.T, H = c.H;
  const sm90::ConvertedMatrix &w13 = *c.w13, &w2 = *c.w2;
  const int64_t H_pad = w13.dims.K_pad, I_pad = w2.dims.K_pad;
  if (w13.dims.N_pad != 2 * I_pad) return "w13's N_pad is not twice w2's K_pad";
  if (!fp8::fp8_supports(w13.dims.format, c.E)) return "the FP8 GEMM does not run these weights";
  y_out->clear();
  fp8::QuantFp8Args q{};
  q.T = T, q.k = c.k, q.rule = int32_t(c.rule);
  if (T == 0) {  // nothing to launch: both launches accept it
    if (fp8::launch_quantize_gather_fp8(q, nullptr, false) != cudaSuccess) return "gather at T = 0";
    q.T = 0;
    if (fp8::launch_quantize_rows_fp8(q, nullptr, false) != cudaSuccess) return "rows at T = 0";
    return "";
  }
  const HostPlan hp = make_plan(std::vector<int32_t>(c.ids, c.ids + T * c.k), T, c.k, c.E);
  const int64_t rows = hp.rows, rows_pad = fp8::fp8_scale_rows_pad(rows);
  DevPlan dp(hp);
  std::vector<uint16_t> xp(size_t(T * H_pad), 0);
  for (int64_t t = 0; t < T; ++t) std::copy_n(c.x + t * H, H, xp.data() + t * H_pad);
  DeviceBuffer<uint16_t> d_x(xp);
  DeviceBuffer<float> d_w(std::vector<float>(c.weights, c.weights + T * c.k));
  DeviceBuffer<uint8_t> c13(w13.codes), s13(w13.scales), c2(w2.codes), s2(w2.scales);
  DeviceBuffer<float> b13(w13.bias.empty() ? std::vector<float>{0} : w13.bias),
      b2(w2.bias.empty() ? std::vector<float>{0} : w2.bias);
  DeviceBuffer<uint8_t> xq(size_t(rows * H_pad)), mq(size_t(rows * I_pad));
  DeviceBuffer<float> xs(size_t((H_pad + 127) / 128 * rows_pad)), ms(size_t((I_pad + 127) / 128 * rows_pad));
  DeviceBuffer<uint16_t> mid(size_t(rows * I_pad)), y(size_t(T * H));
  DeviceBuffer<float> out2(size_t(rows * H));
  DeviceBuffer<int> counters(std::vector<int>{0, 0});
  xq.poison(0xab), mq.poison(0xab), xs.poison(0xab), ms.poison(0xab);
  mid.poison(0xff), out2.poison(0xff), y.poison(0xff);

  q.src = d_x.ptr, q.src_stride = H_pad, q.dest = dp.dest.ptr, q.row_src = dp.row_src.ptr;
  q.num_active = dp.num_active.ptr, q.count = dp.count.ptr, q.row_start = dp.row_start.ptr;
  q.codes = xq.ptr, q.scales = xs.ptr;
  q.rows = rows, q.rows_pad = rows_pad, q.K = H, q.K_pad = H_pad;
  cudaError_t e = fp8::launch_quantize_gather_fp8(q, nullptr, false);
  if (e != cudaSuccess) return std::string("gather: ") + cudaGetErrorString(e);

  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  auto gemm = [&](bool second) {
    const sm90::ConvertedMatrix& w = second ? w2 : w13;
    uint8_t* in_codes = second ? mq.ptr : xq.ptr;
    float* in_scales = second ? ms.ptr : xs.ptr;
    const int64_t cols = second ? I_pad : H_pad;
    fp8::Fp8Args a{};
    cudaError_t r = fp8::make_fp8_rows_map(&a.base.in_map, in_codes, rows, cols, 16);
    if (r == cudaSuccess)
      r = fp8::make_fp8_rows_map(&a.base.in_map_big, in_codes, rows, cols, sm90::prefill::kBigBoxRows);
    if (r == cudaSuccess) r = fp8::make_fp8_scale_map(&a.sx_map, in_scales, rows_pad, (cols + 127) / 128);
    if (r != cudaSuccess) return r;
    a.base.dims = w.dims;
    a.base.codes = second ? c2.ptr : c13.ptr;
    a.base.scales = second ? s2.ptr : s13.ptr;
    a.base.bias = w.bias.empty() ? nullptr : (second ? b2.ptr : b13.ptr);
    a.base.row_scale = nullptr;  // MXFP4 / MXFP8: no row scales
    a.base.work.num_active = dp.num_active.ptr;
    a.base.work.expert = dp.expert.ptr;
    a.base.work.count = dp.count.ptr;
    a.base.work.row_start = dp.row_start.ptr;
    a.base.out_act = mid.ptr;
    a.base.out_f32 = out2.ptr;
    a.base.out_cols = second ? H : I_pad;
    a.base.row_src = dp.row_src.ptr;
    a.base.topk_weights = d_w.ptr;
    a.base.tile_counter = counters.ptr;
    a.base.exit_count = counters.ptr + 1;
    a.base.act = c.act;
    a.base.gemm2 = second;
    return fp8::launch_fp8_gemm(a, sms, nullptr, false);
  };
  if ((e = gemm(false)) != cudaSuccess) return std::string("GEMM1: ") + cudaGetErrorString(e);
  fp8::QuantFp8Args q2 = q;
  q2.src = mid.ptr, q2.src_stride = I_pad, q2.dest = nullptr, q2.T = 0, q2.k = 0;
  q2.codes = mq.ptr, q2.scales = ms.ptr, q2.K = c.I, q2.K_pad = I_pad;
  if ((e = fp8::launch_quantize_rows_fp8(q2, nullptr, false)) != cudaSuccess)
    return std::string("rows: ") + cudaGetErrorString(e);
  if ((e = gemm(true)) != cudaSuccess) return std::string("GEMM2: ") + cudaGetErrorString(e);
  e = sm90::launch_finalize(out2.ptr, dp.dest.ptr, T, c.k, H, y.ptr, nullptr, false);
  if (e != cudaSuccess) return std::string("finalize: ") + cudaGetErrorString(e);
  if ((e = cudaDeviceSynchronize()) != cudaSuccess) return std::string("chain: ") + cudaGetErrorString(e);
  *y_out = y.to_host();
  for (size_t i = 0; i < y_out->size(); ++i)
    if ((*y_out)[i] == 0xffff) return "unwritten output " + std::to_string(i);
  return "";
}

}  // namespace moekit::test
