#include "moekit/routing/router.h"

#include <algorithm>

#include "moekit/common/bf16.h"
#include "moekit/common/thread_pool.h"

namespace moekit {

std::vector<float> RouterWeights::logits(const uint16_t* x, int64_t T) const {
  const int64_t E = num_experts, H = hidden;
  std::vector<float> out(size_t(T * E));
  if (T == 0 || E == 0) return out;
  // Blocks of tokens: each task converts its rows of x once and runs them against every expert.
  constexpr int64_t kRows = 8;
  ThreadPool::global().parallel_for((T + kRows - 1) / kRows, [&](int64_t blk) {
    const int64_t t0 = blk * kRows, t1 = std::min(T, t0 + kRows);
    std::vector<float> xf(size_t((t1 - t0) * H));
    for (int64_t i = 0; i < (t1 - t0) * H; ++i) xf[size_t(i)] = bf16_to_float(x[t0 * H + i]);
    for (int64_t e = 0; e < E; ++e) {
      const float* w = weight.data() + e * H;
      for (int64_t t = t0; t < t1; ++t) {
        const float* xr = xf.data() + (t - t0) * H;
        float acc = 0.0f;
        for (int64_t h = 0; h < H; ++h) acc += xr[h] * w[h];
        out[size_t(t * E + e)] = bias.empty() ? acc : acc + bias[size_t(e)];
      }
    }
  });
  return out;
}

}  // namespace moekit
