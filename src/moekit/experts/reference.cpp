#include "moekit/experts/reference.h"

#include <algorithm>
#include <cmath>

#include "moekit/common/bf16.h"
#include "moekit/common/thread_pool.h"
#include "moekit/formats/fp8_act.h"

namespace moekit {

double reference_activation(const MoeConfig& c, double g, double u) {
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  const double L = c.swiglu_limit;
  switch (c.act) {
    case Activation::kSwigluOai: {
      g = std::min(g, L);
      u = std::clamp(u, -L, L);
      return g * sig(double(c.swiglu_alpha) * g) * (u + c.swiglu_beta);
    }
    case Activation::kSiluClamped:
      g = std::min(g, L);
      return g * sig(g) * std::clamp(u, -L, L);
    case Activation::kSilu:
    default:
      return g * sig(g) * u;
  }
}

std::vector<double> reference_layer(const LayerWeights& m, const uint16_t* x, int64_t T,
                                    const int32_t* ids, const float* weights, int k) {
  const int64_t E = m.cfg.num_experts, H = m.cfg.hidden, I = m.cfg.intermediate;
  std::vector<double> y(size_t(T * H), 0.0);
  // contrib[t][j] computed per expert, summed per token in slot order afterwards.
  std::vector<double> contrib(size_t(T * k * H), 0.0);
  ThreadPool::global().parallel_for(E, [&](int64_t e) {
    std::vector<int64_t> slots;
    for (int64_t i = 0; i < T * k; ++i)
      if (ids[i] == e) slots.push_back(i);
    if (slots.empty()) return;
    std::vector<float> w13(size_t(2 * I * H)), w2(size_t(H * I));
    for (int64_t r = 0; r < 2 * I; ++r) m.w13.dequant_row(e, r, w13.data() + r * H);
    for (int64_t r = 0; r < H; ++r) m.w2.dequant_row(e, r, w2.data() + r * I);
    // FP8 activations: both GEMMs' inputs rounded by the same rule (formats/fp8_act.h, tested
    // on its own against torch), everything after them in double.
    const bool fp8 = m.cfg.activation_dtype == ActivationDtype::kFp8;
    std::vector<float> xr(static_cast<size_t>(H)), af(static_cast<size_t>(I));
    std::vector<double> a(static_cast<size_t>(I));
    for (int64_t s : slots) {
      const uint16_t* xt = x + (s / k) * H;
      for (int64_t h = 0; h < H; ++h) xr[size_t(h)] = bf16_to_float(xt[h]);
      if (fp8) round_row_fp8_act(xr.data(), H, m.cfg.activation_scale);
      for (int64_t j = 0; j < I; ++j) {
        double g = 0, u = 0;
        for (int64_t h = 0; h < H; ++h) {
          const double xv = xr[size_t(h)];
          g += xv * w13[size_t(j * H + h)];
          u += xv * w13[size_t((I + j) * H + h)];
        }
        if (!m.b13.empty()) {
          g += m.b13[size_t(e * 2 * I + j)];
          u += m.b13[size_t(e * 2 * I + I + j)];
        }
        af[size_t(j)] = round_bf16(float(reference_activation(m.cfg, g, u)));
      }
      if (fp8) round_row_fp8_act(af.data(), I, m.cfg.activation_scale);
      for (int64_t j = 0; j < I; ++j) a[size_t(j)] = af[size_t(j)];
      for (int64_t n = 0; n < H; ++n) {
        double v = 0;
        for (int64_t j = 0; j < I; ++j) v += a[size_t(j)] * w2[size_t(n * I + j)];
        if (!m.b2.empty()) v += m.b2[size_t(e * H + n)];
        contrib[size_t(s * H + n)] = double(weights[s]) * v;
      }
    }
  });
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j)
      if (ids[t * k + j] >= 0)
        for (int64_t h = 0; h < H; ++h) y[size_t(t * H + h)] += contrib[size_t((t * k + j) * H + h)];
  return y;
}

double rel_l2(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = double(a[i]) - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace moekit
