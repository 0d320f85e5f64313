// FP8 activations on the GPU (issue 49), end to end: quantize (gather) -> FP8 GEMM1 -> quantize
// (rows) -> FP8 GEMM2 -> finalize (tests/gpu/fp8_chain.h, run by test_quantize_fp8_gpu.cu) against
// the CPU backend's fp8 layer through the public API (activation_dtype fp8, both scale rules) on the
// same data and ids, with the rel-L2 errors printed; both also against the float64 reference.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "../fp8_chain_cases.h"
#include "fp8_chain.h"
#include "gpu_util.h"
#include "moekit/common/spec.h"
#include "moekit/experts/sm90_layout.h"
#include "sm90_testutil.h"

namespace moekit {
namespace {

// quantize (gather) -> FP8 GEMM1 (bf16 activated intermediate) -> quantize (rows) -> FP8 GEMM2 ->
// finalize, on a host plan of the CPU's ids, against the CPU layer (public API, activation_dtype
// fp8) on the same data, and both against two float64 references: the layer's definition (the
// same fp8 rounding of both GEMMs' inputs) and the bf16-activation layer (the cost of fp8).
// Tolerance 1e-2 (rel-L2 of y, GPU vs CPU). Against the same-rounding reference the GPU chain is
// ~2x the CPU layer (H200: 3.25e-3 vs 1.66e-3 at gpt-oss sizes): Hopper's FP8 wgmma adds within a
// 128-K group with a 13-bit-fraction accumulator, so GEMM1's outputs move ~1e-4 relative, which
// moves 0.8-2% of the intermediate's E4M3 codes to their other neighbour (a value beside a
// rounding boundary; with fp32 scales a group whose largest element moves is rescaled). That costs
// no accuracy. tests/test_fp8_chain_numerics.cpp emulates the chain on the CPU on this test's data
// (tests/fp8_chain_cases.h): it reproduces the H200's same-rounding figures within 4% (one
// single-row case 4.6e-3 against 3.7e-3), and against the bf16-activation reference the emulated
// chain and the CPU layer agree within 0.3% (FP8ChainNumerics.*). Checked here: GPU vs CPU <= 1e-2; GPU against
// the bf16-activation reference within 2% of the CPU's; GPU against the same-rounding reference
// at most 4x the CPU's (the emulation: 1.0-2.9x).
constexpr double kChainTol = 1e-2;
constexpr double kAccuracyTol = 0.02;  // |gpu - cpu| / cpu of the errors against the bf16-activation reference
constexpr double kSameRoundingRatio = 4.0;

using ChainCase = test::Fp8ChainCase;

double run_chain(const ChainCase& c) {
  const test::Fp8ChainData d = test::fp8_chain_data(c);  // the CPU emulation's data too
  const MoeModel& m = d.m;
  const LayerInputData& in = d.in;
  const sm90::ConvertedMatrix w13 = sm90::convert_w13(m), w2 = sm90::convert_w2(m);
  test::Fp8ChainIn ci;
  ci.w13 = &w13, ci.w2 = &w2;
  ci.x = in.x.data(), ci.ids = in.ids.data(), ci.weights = in.weights.data();
  ci.T = c.T, ci.H = c.H, ci.I = c.I, ci.k = c.k, ci.E = c.E;
  ci.act = activation_params(m.cfg);
  ci.rule = c.rule;
  std::vector<uint16_t> gy;
  const std::string failed = test::run_fp8_chain(ci, &gy);
  EXPECT_EQ(failed, "");
  if (!failed.empty() || c.T == 0) return failed.empty() ? 0.0 : INFINITY;
  const LayerOutput cpu = run_backend("cpu", m, in.view());
  const std::vector<double> ref = reference_layer(m, in.x.data(), c.T, in.ids.data(), in.weights.data(), c.k);
  LayerWeights m16 = m;  // views of m's weights
  m16.cfg.activation_dtype = ActivationDtype::kBf16;
  const std::vector<double> ref16 = reference_layer(m16, in.x.data(), c.T, in.ids.data(), in.weights.data(), c.k);
  const double err = test::rel_l2_err(to_f32(gy), to_f32(cpu.y));
  const double ce = rel_l2(to_f32(cpu.y), ref), ge = rel_l2(to_f32(gy), ref);
  const double ce16 = rel_l2(to_f32(cpu.y), ref16), ge16 = rel_l2(to_f32(gy), ref16);
  std::printf("  %-32s %-5s T=%-3lld rel-L2 gpu vs cpu %.3e (vs the float64 reference: gpu %.3e, cpu %.3e; "
              "vs the bf16-activation reference: gpu %.4e, cpu %.4e)\n",
              c.name, activation_scale_name(c.rule), (long long)c.T, err, ge, ce, ge16, ce16);
  const std::string key = std::string(c.name) + " " + activation_scale_name(c.rule);
  testing::Test::RecordProperty(key + " gpu_vs_cpu", std::to_string(err));
  testing::Test::RecordProperty(key + " gpu_vs_fp8_ref", std::to_string(ge));
  testing::Test::RecordProperty(key + " gpu_vs_bf16_ref", std::to_string(ge16));
  EXPECT_NEAR(ge16, ce16, kAccuracyTol * ce16) << "accuracy against the bf16-activation reference";
  EXPECT_LE(ge, kSameRoundingRatio * ce) << "against the same-rounding reference";
  return err;
}

TEST(FP8Chain, AgainstCpuLayer) {
  NEED_SM90();
  for (ActivationScale rule : {ActivationScale::kFp32, ActivationScale::kUe8m0}) {
    const std::vector<ChainCase> cases = test::fp8_chain_cases(rule, true);
    for (const ChainCase& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " " + activation_scale_name(rule));
      EXPECT_LE(run_chain(c), kChainTol);
    }
  }
}

// For compute-sanitizer (scripts/gpu_check.sh fp8): a small chain.
TEST(FP8Sanitize, Chain) {
  NEED_SM90();
  EXPECT_LE(run_chain({"sanitize chain", WeightFormat::kMxfp4, Activation::kSwigluOai, 4, 2, 192, 128, 5, true,
                       ActivationScale::kFp32}),
            kChainTol);
}

}  // namespace
}  // namespace moekit
