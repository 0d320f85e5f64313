#include <algorithm>
#include <cmath>

#include "moekit/common/error.h"
#include "moekit/common/thread_pool.h"
#include "moekit/routing/routing.h"

namespace moekit {

RoutingParams routing_params(const LayerSpec& c, const std::vector<float>& score_bias,
                             const std::vector<int32_t>& hash_table) {
  RoutingParams p;
  p.scoring = c.scoring;
  p.num_experts = c.num_experts;
  p.top_k = c.top_k;
  p.renormalize = c.norm_topk_prob;
  p.routed_scaling_factor = c.routed_scaling_factor;
  p.n_group = c.n_group;
  p.topk_group = c.topk_group;
  p.score_bias = score_bias.empty() ? nullptr : score_bias.data();
  p.hash_table = hash_table.empty() ? nullptr : hash_table.data();
  p.hash_vocab = hash_table.empty() ? 0 : c.hash_vocab;
  return p;
}

void check_token_ids(const TokenIds& token_ids, int64_t T, int64_t hash_vocab, const char* name) {
  MOEKIT_REQUIRE(T == 0 || token_ids.data, name, ": missing (the layer is hash-routed: its experts come from its "
                 "tid2eid table by token id)");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = token_ids.at(t);
    MOEKIT_REQUIRE(id >= 0 && id < hash_vocab, name, ": token ", t, " has id ", id, ", outside the hash table's ",
                   hash_vocab, " rows [0, ", hash_vocab, ")");
  }
}

std::vector<int32_t> hash_table_from(const void* data, bool wide, int64_t V, int k, int E, const std::string& what) {
  std::vector<int32_t> t(size_t(V * k));
  std::vector<int32_t> row(static_cast<size_t>(k));
  for (int64_t r = 0; r < V; ++r) {
    for (int j = 0; j < k; ++j) {
      const int64_t i = r * k + j;
      const int64_t e = wide ? static_cast<const int64_t*>(data)[i] : int64_t(static_cast<const int32_t*>(data)[i]);
      MOEKIT_REQUIRE(e >= 0 && e < E, what, ": tid2eid row ", r, " (token id ", r, "), slot ", j, ": expert ", e,
                     " is out of range [0, ", E, ")");
      t[size_t(i)] = row[size_t(j)] = int32_t(e);
    }
    std::sort(row.begin(), row.end());
    for (int j = 1; j < k; ++j)
      MOEKIT_REQUIRE(row[size_t(j)] != row[size_t(j - 1)], what, ": tid2eid row ", r, " (token id ", r,
                     ") lists expert ", row[size_t(j)], " more than once");
  }
  return t;
}

namespace {

// Index of the largest value among the allowed entries; ties go to the lower index.
int argmax(const float* v, const std::vector<char>& allowed, int n) {
  int best = -1;
  for (int i = 0; i < n; ++i)
    if (allowed[size_t(i)] && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

// token: the row's token id (hash routing), checked by route_cpu.
void route_token(const RoutingParams& p, const float* logits, int64_t token, int32_t* ids, float* w) {
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
      prob[size_t(i)] = gate_score(p.scoring, logits[i]);
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
    // Hash routing: the table's row, in its order; else the best allowed choice.
    const int e = p.hash_table ? p.hash_table[token * k + j] : argmax(choice.data(), allowed, E);
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
               float* weights, const TokenIds& token_ids) {
  if (p.hash_table) check_token_ids(token_ids, T, p.hash_vocab);
  ThreadPool::global().parallel_for((T + 63) / 64, [&](int64_t chunk) {
    for (int64_t t = chunk * 64; t < std::min(T, chunk * 64 + 64); ++t)
      route_token(p, logits + t * p.num_experts, p.hash_table ? token_ids.at(t) : 0, ids + t * p.top_k,
                  weights + t * p.top_k);
  });
}

}  // namespace moekit
