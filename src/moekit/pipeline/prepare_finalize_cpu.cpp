#include <algorithm>
#include <cstring>

#include "moekit/common/bf16.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/common/thread_pool.h"
#include "moekit/pipeline/modular.h"

namespace moekit {

const char* activation_format_name(ActivationFormat f) {
  return f == ActivationFormat::kStandard ? "standard" : "batched";
}

namespace {

constexpr uint16_t kPoison = 0x7fc0;  // bf16 NaN

std::vector<int32_t> count_per_expert(const int32_t* ids, int64_t n, int E) {
  std::vector<int32_t> counts(size_t(E), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = ids[i];
    MOEKIT_REQUIRE(e >= -1 && e < E, "expert id ", e, " at token ", i, " is out of range [-1, ", E, ")");
    if (e >= 0) ++counts[size_t(e)];
  }
  return counts;
}

// Copies row src_token of x to row `row` of out (same width).
void copy_rows(const uint16_t* x, int64_t H, const std::vector<int32_t>& row_src, int k,
               uint16_t* out) {
  ThreadPool::global().parallel_for(int64_t(row_src.size()), [&](int64_t r) {
    const int32_t s = row_src[size_t(r)];
    if (s >= 0) std::memcpy(out + r * H, x + int64_t(s / k) * H, size_t(H) * 2);
  });
}

// Shared finalize: y[t] = bf16(sum_j w[t,j] * out[dest[t,j]] + shared[t]), j ascending, fp32.
void finalize_rows(const std::vector<int64_t>& dest, const std::vector<float>& out, int64_t H,
                   const float* weights, int64_t T, int k, const FinalOut& y) {
  ThreadPool::global().parallel_for(T, [&](int64_t t) {
    std::vector<float> acc(size_t(H), 0.0f);
    for (int j = 0; j < k; ++j) {
      const int64_t row = dest[size_t(t * k + j)];
      if (row < 0) continue;
      const float w = weights[t * k + j];
      const float* o = out.data() + row * H;
      for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += w * o[h];
    }
    if (y.shared)
      for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += bf16_to_float(y.shared[t * y.shared_stride + h]);
    for (int64_t h = 0; h < H; ++h) y.y[t * y.stride + h] = float_to_bf16(acc[size_t(h)]);
  });
}

}  // namespace

void StandardPrepareFinalize::prepare(const uint16_t* x, int64_t T, int64_t H, const int32_t* ids,
                                      int k, int E, Activations<StandardLayout>* out) const {
  StandardLayout& L = out->layout;
  L.align = align_;
  L.counts = count_per_expert(ids, T * k, E);
  L.offsets.assign(size_t(E) + 1, 0);
  for (int e = 0; e < E; ++e) {
    const int64_t padded = (int64_t(L.counts[size_t(e)]) + align_ - 1) / align_ * align_;
    L.offsets[size_t(e) + 1] = L.offsets[size_t(e)] + padded;
  }
  L.num_rows = L.offsets[size_t(E)];
  L.row_src.assign(size_t(L.num_rows), -1);
  L.dest.assign(size_t(T * k), -1);
  std::vector<int64_t> fill(L.offsets.begin(), L.offsets.end() - 1);
  for (int64_t i = 0; i < T * k; ++i) {  // (token, slot) order: stable
    const int32_t e = ids[i];
    if (e < 0) continue;
    const int64_t row = fill[size_t(e)]++;
    L.row_src[size_t(row)] = int32_t(i);
    L.dest[size_t(i)] = row;
  }
  out->width = H;
  out->data.assign(size_t(L.num_rows * H), kPoison);  // padding rows: NaN, never read
  copy_rows(x, H, L.row_src, k, out->data.data());
}

void StandardPrepareFinalize::finalize(const StandardLayout& layout,
                                       const ExpertOutput<StandardLayout>& out,
                                       const float* weights, int64_t T, int k, const FinalOut& y) const {
  finalize_rows(layout.dest, out.data, out.width, weights, T, k, y);
}

void BatchedPrepareFinalize::prepare(const uint16_t* x, int64_t T, int64_t H, const int32_t* ids,
                                     int k, int E, Activations<BatchedLayout>* out) const {
  BatchedLayout& L = out->layout;
  L.counts = count_per_expert(ids, T * k, E);
  L.max_tokens = std::max(1, *std::max_element(L.counts.begin(), L.counts.end()));
  // E x max_tokens rows, most of them unused when the tokens crowd on one expert; as bf16, fp32
  // copy and fp32 output (CpuExperts) they must fit in host memory.
  require_host_memory("batched activations (" + std::to_string(E) + " experts x " +
                          std::to_string(L.max_tokens) + " rows)",
                      sat_mul({E, L.max_tokens, H, 2 + 4 + 4}));
  L.row_src.assign(size_t(L.num_rows()), -1);
  L.dest.assign(size_t(T * k), -1);
  std::vector<int32_t> fill(size_t(E), 0);
  for (int64_t i = 0; i < T * k; ++i) {
    const int32_t e = ids[i];
    if (e < 0) continue;
    const int64_t row = L.row_begin(e) + fill[size_t(e)]++;
    L.row_src[size_t(row)] = int32_t(i);
    L.dest[size_t(i)] = row;
  }
  out->width = H;
  // Slots beyond counts[e] hold NaN on purpose: nothing may read them.
  out->data.assign(size_t(L.num_rows() * H), kPoison);
  copy_rows(x, H, L.row_src, k, out->data.data());
}

void BatchedPrepareFinalize::finalize(const BatchedLayout& layout,
                                      const ExpertOutput<BatchedLayout>& out, const float* weights,
                                      int64_t T, int k, const FinalOut& y) const {
  finalize_rows(layout.dest, out.data, out.width, weights, T, k, y);
}

}  // namespace moekit
