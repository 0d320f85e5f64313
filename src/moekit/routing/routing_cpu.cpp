#include <algorithm>
#include <cmath>

#include "moekit/common/thread_pool.h"
#include "moekit/routing/routing.h"

namespace moekit {

RoutingParams routing_params(const LayerSpec& c, const std::vector<float>& score_bias) {
  RoutingParams p;
  p.scoring = c.scoring;
  p.num_experts = c.num_experts;
  p.top_k = c.top_k;
  p.renormalize = c.norm_topk_prob;
  p.routed_scaling_factor = c.routed_scaling_factor;
  p.n_group = c.n_group;
  p.topk_group = c.topk_group;
  p.score_bias = score_bias.empty() ? nullptr : score_bias.data();
  return p;
}

namespace {

// Index of the largest value among the allowed entries; ties go to the lower index.
int argmax(const float* v, const std::vector<char>& allowed, int n) {
  int best = -1;
  for (int i = 0; i < n; ++i)
    if (allowed[size_t(i)] && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

void route_token(const RoutingParams& p, const float* logits, int32_t* ids, float* w) {
  const int E = p.num_experts, k = p.top_k;
  std::vector<float> prob(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  std::vector<char> allowed(size_t(E), 1);
  if (p.scoring == Scoring::kSoftmax) {
    float mx = logits[0];
    for (int i = 1; i < E; ++i) mx = std::fmax(mx, logits[i]);
    float sum = 0.0f;
    for (int i = 0; i < E; ++i) sum += (prob[size_t(i)] = std::exp(logits[i] - mx));
    for (int i = 0; i < E; ++i) prob[size_t(i)] = prob[size_t(i)] / sum;
    choice = prob;
  } else {
    for (int i = 0; i < E; ++i) {
      prob[size_t(i)] = 1.0f / (1.0f + std::exp(-logits[i]));
      choice[size_t(i)] = prob[size_t(i)] + (p.score_bias ? p.score_bias[i] : 0.0f);
    }
    if (p.n_group > 1) {
      const int gsize = E / p.n_group;
      std::vector<float> gscore(size_t(p.n_group));
      for (int g = 0; g < p.n_group; ++g) {
        const float* c = choice.data() + g * gsize;
        float a = -INFINITY, b = -INFINITY;  // two largest
        for (int i = 0; i < gsize; ++i) {
          if (c[i] > a) {
            b = a;
            a = c[i];
          } else if (c[i] > b) {
            b = c[i];
          }
        }
        gscore[size_t(g)] = gsize == 1 ? a : a + b;
      }
      std::vector<char> gallowed(size_t(p.n_group), 1), keep(size_t(p.n_group), 0);
      for (int t = 0; t < p.topk_group; ++t) {
        const int g = argmax(gscore.data(), gallowed, p.n_group);
        keep[size_t(g)] = 1;
        gallowed[size_t(g)] = 0;
      }
      for (int i = 0; i < E; ++i) allowed[size_t(i)] = keep[size_t(i / gsize)];
    }
  }
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int e = argmax(choice.data(), allowed, E);
    allowed[size_t(e)] = 0;
    ids[j] = e;
    w[j] = prob[size_t(e)];
    sum += w[j];
  }
  for (int j = 0; j < k; ++j) {
    if (p.renormalize) w[j] = w[j] / (sum + kRenormEpsilon);
    w[j] = w[j] * p.routed_scaling_factor;
  }
}

}  // namespace

void route_cpu(const RoutingParams& p, const float* logits, int64_t T, int32_t* ids,
               float* weights) {
  ThreadPool::global().parallel_for((T + 63) / 64, [&](int64_t chunk) {
    for (int64_t t = chunk * 64; t < std::min(T, chunk * 64 + 64); ++t)
      route_token(p, logits + t * p.num_experts, ids + t * p.top_k, weights + t * p.top_k);
  });
}

}  // namespace moekit
