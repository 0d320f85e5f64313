#include "moekit/experts/experts_cpu.h"

#include <algorithm>
#include <cstring>

#include "moekit/common/bf16.h"
#include "moekit/common/thread_pool.h"
#include "moekit/formats/fp8_act.h"

namespace moekit {

namespace {

constexpr int kLanes = 8;  // independent fp32 partial sums: vectorizable without reassociation

float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Work items: (expert, chunk of output columns).
struct Item {
  int e;
  int64_t begin, end;
};

template <class L>
int64_t rows_of(const L& layout, int e) {
  return layout.counts[size_t(e)];
}

}  // namespace

template <class L>
void CpuExperts<L>::apply(const Activations<L>& in, ExpertOutput<L>* out) const {
  const int E = m_.cfg.num_experts;
  const int64_t H = m_.cfg.hidden, I = m_.cfg.intermediate;
  const L& layout = in.layout;
  const int64_t num_rows = int64_t(in.data.size()) / (H > 0 ? H : 1);

  // Activations as fp32, expert by expert (only real rows).
  std::vector<float> xf(size_t(num_rows * H));
  std::vector<float> act(size_t(num_rows * I));
  out->width = H;
  out->data.assign(size_t(num_rows * H), 0.0f);

  constexpr int64_t kChunk = 32;
  std::vector<Item> items1, items2;
  for (int e = 0; e < E; ++e) {
    if (rows_of(layout, e) == 0) continue;
    for (int64_t j = 0; j < I; j += kChunk) items1.push_back({e, j, std::min(I, j + kChunk)});
    for (int64_t n = 0; n < H; n += kChunk) items2.push_back({e, n, std::min(H, n + kChunk)});
  }
  // FP8 activations (spec.hpp): each GEMM's input rows rounded to what the GEMM multiplies, row
  // by row, so the bits depend on nothing but the row (any thread count, any schedule).
  const bool fp8 = m_.cfg.activation_dtype == ActivationDtype::kFp8;
  const ActivationScale rule = m_.cfg.activation_scale;
  auto& pool = ThreadPool::global();
  pool.parallel_for(E, [&](int64_t e) {
    const int64_t r0 = layout.row_begin(int(e)), n = rows_of(layout, int(e));
    for (int64_t r = r0; r < r0 + n; ++r) {
      for (int64_t h = 0; h < H; ++h) xf[size_t(r * H + h)] = bf16_to_float(in.data[size_t(r * H + h)]);
      if (fp8) round_row_fp8_act(xf.data() + r * H, H, rule);
    }
  });

  // GEMM1 + bias + activation -> bf16-rounded act[rows, I].
  pool.parallel_for(int64_t(items1.size()), [&](int64_t it) {
    const Item& w = items1[size_t(it)];
    const int64_t r0 = layout.row_begin(w.e), n = rows_of(layout, w.e);
    std::vector<float> gate(static_cast<size_t>(H)), up(static_cast<size_t>(H));
    const float* b = m_.b13.empty() ? nullptr : m_.b13.data() + int64_t(w.e) * 2 * I;
    for (int64_t j = w.begin; j < w.end; ++j) {
      m_.w13.dequant_row(w.e, j, gate.data());
      m_.w13.dequant_row(w.e, I + j, up.data());
      for (int64_t t = 0; t < n; ++t) {
        const float* x = xf.data() + (r0 + t) * H;
        float g = dot(x, gate.data(), H), u = dot(x, up.data(), H);
        if (b) {
          g += b[j];
          u += b[I + j];
        }
        act[size_t((r0 + t) * I + j)] = round_bf16(apply_activation(act_, g, u));
      }
    }
  });

  // The bf16-rounded intermediate, quantized as GEMM2's input.
  if (fp8)
    pool.parallel_for(E, [&](int64_t e) {
      const int64_t r0 = layout.row_begin(int(e)), n = rows_of(layout, int(e));
      for (int64_t r = r0; r < r0 + n; ++r) round_row_fp8_act(act.data() + r * I, I, rule);
    });

  // GEMM2 + bias -> fp32 out[rows, H].
  pool.parallel_for(int64_t(items2.size()), [&](int64_t it) {
    const Item& w = items2[size_t(it)];
    const int64_t r0 = layout.row_begin(w.e), n = rows_of(layout, w.e);
    std::vector<float> row(static_cast<size_t>(I));
    const float* b = m_.b2.empty() ? nullptr : m_.b2.data() + int64_t(w.e) * H;
    for (int64_t c = w.begin; c < w.end; ++c) {
      m_.w2.dequant_row(w.e, c, row.data());
      for (int64_t t = 0; t < n; ++t) {
        float v = dot(act.data() + (r0 + t) * I, row.data(), I);
        if (b) v += b[c];
        out->data[size_t((r0 + t) * H + c)] = v;
      }
    }
  });
}

template class CpuExperts<StandardLayout>;
template class CpuExperts<BatchedLayout>;

}  // namespace moekit
