// The gated activations on the GPU (experts/activation.h: the epilogues' sigmoid uses ex2.approx
// and rcp.approx) against the CPU's (expf and an exact reciprocal): the documented error bound,
// the limits (-inf, +inf, NaN, the flush below x = -87), and what reaches memory: the bf16 of an
// activation equals the CPU's or is one bf16 step from it, and rarely so.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "gpu_util.h"
#include "moekit/common/bf16.h"
#include "moekit/experts/activation.h"

namespace moekit {
namespace {

constexpr int kActivations = 3;
constexpr Activation kKinds[kActivations] = {Activation::kSilu, Activation::kSwigluOai, Activation::kSiluClamped};

// sig[i] = sigmoid(x[i]); act[a * n + i] = activation a of (gate[i], up[i]).
__global__ void activation_kernel(ActivationParams p, const float* x, const float* gate, const float* up, int n,
                                  float* sig, float* act) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  sig[i] = sigmoid_f32(x[i]);
  act[i] = activation_of<Activation::kSilu>(p, gate[i], up[i]);
  act[n + i] = activation_of<Activation::kSwigluOai>(p, gate[i], up[i]);
  act[2 * n + i] = activation_of<Activation::kSiluClamped>(p, gate[i], up[i]);
}

struct GpuResults {
  std::vector<float> sig, act;
};

GpuResults run(const ActivationParams& p, const std::vector<float>& x, const std::vector<float>& gate,
               const std::vector<float>& up) {
  const int n = int(x.size());
  test::DeviceBuffer<float> dx(x), dg(gate), du(up), sig(x.size()), act(x.size() * kActivations);
  sig.poison();
  act.poison();
  activation_kernel<<<(n + 255) / 256, 256>>>(p, dx.ptr, dg.ptr, du.ptr, n, sig.ptr, act.ptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {sig.to_host(), act.to_host()};
}

// The bound the header states: a few ulp plus about |x| 2^-24 from the argument's rounding.
double sigmoid_tolerance(double x) { return 5e-7 + std::fabs(x) * 1e-7; }

TEST(GpuActivation, SigmoidWithinTheBoundAndItsLimits) {
  std::vector<float> x;
  for (int i = -100 * 64; i <= 100 * 64; ++i) x.push_back(float(i) / 64.0f);
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> special = {-inf, inf, std::nanf(""), -1e30f, 1e30f, -0.0f, 0.0f, -88.0f, -87.0f};
  x.insert(x.end(), special.begin(), special.end());
  const std::vector<float> zeros(x.size(), 0.0f);
  const auto r = run(ActivationParams{}, x, zeros, zeros);
  ASSERT_EQ(r.sig.size(), x.size());
  int64_t checked = 0;
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float xi = x[i], got = r.sig[i];
    if (std::isnan(xi)) {
      EXPECT_TRUE(std::isnan(got)) << "sigmoid(NaN) = " << got;
      continue;
    }
    const double ref = 1.0 / (1.0 + std::exp(-double(xi)));
    if (xi <= -88.0f) {  // the CPU's result is subnormal or 0: the GPU flushes it to 0
      EXPECT_EQ(got, 0.0f) << "x = " << xi;
      continue;
    }
    if (ref < 0x1p-125) continue;  // -88 < x < -86.6: at the flush threshold (0 or close on the GPU)
    const double rel = std::fabs(double(got) - ref) / ref;
    worst = std::max(worst, rel / sigmoid_tolerance(xi));
    EXPECT_LE(rel, sigmoid_tolerance(xi)) << "x = " << xi << ": " << got << " against " << ref;
    ++checked;
  }
  // The specials' exact results, by their place in `special`.
  const size_t s0 = x.size() - special.size();
  EXPECT_EQ(r.sig[s0 + 0], 0.0f);  // -inf
  EXPECT_EQ(r.sig[s0 + 1], 1.0f);  // +inf
  EXPECT_EQ(r.sig[s0 + 3], 0.0f);  // -1e30
  EXPECT_EQ(r.sig[s0 + 4], 1.0f);  // 1e30
  EXPECT_EQ(r.sig[s0 + 5], 0.5f);  // -0
  EXPECT_EQ(r.sig[s0 + 6], 0.5f);  // 0
  EXPECT_GT(checked, 11900);  // the grid from x = -86.6 and the specials above it
  std::printf("sigmoid: %lld points, worst error %.2f of the bound\n", (long long)checked, worst);
}

TEST(GpuActivation, GatedActivationsMatchTheCpuAfterBf16Rounding) {
  ActivationParams p;  // GPT-OSS's alpha 1.702, beta 1, limit 7
  std::mt19937 rng(1234);
  std::normal_distribution<float> wide(0.0f, 6.0f);
  const int n = 1 << 18;
  std::vector<float> gate(n), up(n);
  for (int i = 0; i < n; ++i) {
    gate[i] = wide(rng);
    up[i] = wide(rng);
  }
  const auto r = run(p, gate, gate, up);
  for (int a = 0; a < kActivations; ++a) {
    p.kind = kKinds[a];
    int64_t differ = 0;
    for (int i = 0; i < n; ++i) {
      const float got = r.act[size_t(a) * n + i], ref = apply_activation(p, gate[i], up[i]);
      // fp32: the sigmoid's bound (its argument is gate or alpha x gate) and a few ulp of products.
      const double x = std::fabs(double(gate[i])) * (kKinds[a] == Activation::kSwigluOai ? p.alpha : 1.0);
      const double tol = sigmoid_tolerance(x) + 4.0 * std::ldexp(1.0, -24);
      ASSERT_LE(std::fabs(double(got) - double(ref)), tol * std::fabs(double(ref)) + 1e-30)
          << "activation " << a << ", gate " << gate[i] << ", up " << up[i];
      // bf16, as the epilogues store it: equal, or one bf16 step apart.
      const uint16_t bg = float_to_bf16(got), br = float_to_bf16(ref);
      if (bg != br) {
        ++differ;
        ASSERT_EQ(std::abs(int(bg) - int(br)), 1) << "activation " << a << ", gate " << gate[i];
      }
    }
    EXPECT_LT(differ, n / 500) << "activation " << a << ": " << differ << " of " << n << " bf16 differ";
    std::printf("activation %d: %lld of %d bf16 results one step from the CPU's\n", a, (long long)differ, n);
  }
}

}  // namespace
}  // namespace moekit
