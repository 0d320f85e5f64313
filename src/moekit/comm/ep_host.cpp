#include "moekit/comm/ep_host.h"

#include <cmath>
#include <sstream>

#include "moekit/common/bf16.h"
#include "moekit/common/error.h"

namespace moekit::ep {

const char* payload_name(Payload p) {
  switch (p) {
    case Payload::kBf16: return "bf16";
    case Payload::kMxfp8: return "mxfp8";
    case Payload::kNvfp4: return "nvfp4";
  }
  return "?";
}

Payload parse_payload(const std::string& s) {
  if (s == "bf16") return Payload::kBf16;
  if (s == "mxfp8") return Payload::kMxfp8;
  if (s == "nvfp4") return Payload::kNvfp4;
  fail("unknown EP payload '", s, "' (bf16 | mxfp8 | nvfp4)");
}

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kNone: return "none";
    case Phase::kCounts: return "dispatch counts";
    case Phase::kData: return "dispatch data";
    case Phase::kCombine: return "combine";
    case Phase::kCapacity: return "capacity";
    case Phase::kAborted: return "aborted";
  }
  return "?";
}

void validate(const Shape& s) {
  MOEKIT_REQUIRE(s.world >= 1 && s.world <= 64, "EP: ", s.world, " ranks (1..64)");
  MOEKIT_REQUIRE(s.num_experts > 0 && s.num_experts % s.world == 0, "EP: ", s.num_experts,
                 " experts do not divide over ", s.world, " ranks");
  MOEKIT_REQUIRE(int64_t(s.world + 2) * s.num_experts * 4 <= 160 * 1024, "EP: ", s.world, " ranks x ",
                 s.num_experts, " experts of counts do not fit in a CTA's shared memory");
  MOEKIT_REQUIRE(s.top_k > 0 && s.top_k <= s.num_experts && s.top_k <= 32, "EP: top_k ", s.top_k, " of ",
                 s.num_experts, " experts (at most 32: combine keeps a token's slots in one warp)");
  const int align = s.payload == Payload::kBf16 ? 8 : 32;
  MOEKIT_REQUIRE(s.hidden > 0 && s.hidden % align == 0, "EP: hidden size ", s.hidden, " is not a multiple of ",
                 align, " (", payload_name(s.payload), " payload)");
  MOEKIT_REQUIRE(s.hidden_pad >= s.hidden && s.hidden_pad % 8 == 0, "EP: row stride ", s.hidden_pad,
                 " for hidden size ", s.hidden);
  MOEKIT_REQUIRE(s.max_tokens >= 0 && s.max_tokens < (1 << kSrcTokenBits), "EP: ", s.max_tokens,
                 " tokens per rank (at most ", (1 << kSrcTokenBits) - 1, ")");
  MOEKIT_REQUIRE(s.capacity > 0 && s.rows() < (int64_t(1) << 31), "EP: capacity ", s.capacity, " rows per expert");
}

Workspace workspace_bytes(const Shape& s) {
  Workspace w;
  w.window = Window::of(s).bytes;
  const int64_t slots = int64_t(s.max_tokens) * s.top_k;
  int64_t local = align_up(slots * 4, 256);  // slot map
  if (bf16_rows(s.combine)) local += align_up(s.rows() * int64_t(s.hidden) * 4, 256);  // GEMM2's rows
  if (s.payload != Payload::kBf16) {
    local += align_up(s.rows() * int64_t(s.hidden_pad) * 2, 256);              // dequantized rows
    local += align_up(int64_t(s.max_tokens) * s.payload_stride(), 256);        // quantized source rows
  }
  w.local = local;
  return w;
}

std::string describe(const ErrorRecord& e, uint64_t timeout_ns) {
  std::ostringstream os;
  const Phase p = Phase(e.phase);
  if (p == Phase::kCapacity) {
    os << "EP dispatch: expert " << e.peer << " receives " << e.seen << " rows in round " << e.round
       << ", more than its capacity of " << e.expected << " (no row was sent; rank " << e.rank << ")";
  } else if (p == Phase::kAborted) {
    os << "EP " << "round " << e.round << " on rank " << e.rank << " was aborted";
  } else {
    const char* what = p == Phase::kCounts ? "counts" : p == Phase::kData ? "rows (done flag)" : "expert outputs (ready flag)";
    os << "EP " << phase_name(p) << " timed out: rank " << e.rank << " waited for rank " << e.peer << "'s "
       << what << " of round " << e.round << " (expected epoch " << e.expected << ", saw " << e.seen << ") for "
       << double(timeout_ns) / 1e6 << " ms";
  }
  return os.str();
}

HostDispatch host_dispatch(const Shape& s, const std::vector<RankBatch>& batches) {
  validate(s);
  MOEKIT_REQUIRE(int(batches.size()) == s.world, "EP host model: ", batches.size(), " batches for ", s.world,
                 " ranks");
  const int R = s.world, E = s.num_experts, El = s.local_experts(), k = s.top_k;
  HostDispatch d;
  d.counts.assign(size_t(R), std::vector<int32_t>(size_t(E), 0));
  for (int r = 0; r < R; ++r)
    for (int32_t id : batches[size_t(r)].ids)
      if (id >= 0) ++d.counts[size_t(r)][size_t(id)];
  for (int e = 0; e < E && d.overflow_expert < 0; ++e) {
    int64_t total = 0;
    for (int r = 0; r < R; ++r) total += d.counts[size_t(r)][size_t(e)];
    if (total > s.capacity) d.overflow_expert = e, d.overflow_rows = total;
  }
  d.local_count.assign(size_t(R), std::vector<int32_t>(size_t(El), 0));
  d.meta.assign(size_t(R), std::vector<RowMeta>(size_t(s.rows()), RowMeta{-1, 0, 0, 0.0f}));
  d.slot_row.resize(size_t(R));
  for (int r = 0; r < R; ++r) d.slot_row[size_t(r)].assign(size_t(batches[size_t(r)].T * k), -1);
  if (d.overflow_expert >= 0) return d;
  // Rows in (source rank, token, slot) order within each expert: the stable order.
  std::vector<int32_t> next(size_t(E), 0);
  for (int r = 0; r < R; ++r) {
    const RankBatch& b = batches[size_t(r)];
    for (int64_t i = 0; i < b.T * k; ++i) {
      const int32_t e = b.ids[size_t(i)];
      if (e < 0) continue;
      const int q = e / El, el = e % El;
      const int32_t row = next[size_t(e)]++;
      const int32_t g = el * s.capacity + row;
      d.slot_row[size_t(r)][size_t(i)] = g;
      d.meta[size_t(q)][size_t(g)] =
          RowMeta{e, int32_t(r << kSrcTokenBits) | int32_t(i / k), int32_t(i % k), b.weights[size_t(i)]};
      d.local_count[size_t(q)][size_t(el)] = row + 1;
    }
  }
  return d;
}

std::vector<uint16_t> host_combine(const Shape& s, const HostDispatch& d, const RankBatch& b, int r,
                                   const std::vector<std::vector<float>>& y_rows, const std::vector<uint16_t>* shared) {
  const int k = s.top_k, El = s.local_experts();
  const int64_t H = s.hidden;
  std::vector<uint16_t> y(size_t(b.T * H));
  if (s.combine == CombineRows::kBf16Sum) {
    // Each rank's partial of the token over its slots in j order, rounded to bf16; the ranks'
    // partials added in rank order.
    for (int64_t t = 0; t < b.T; ++t)
      for (int64_t c = 0; c < H; ++c) {
        float acc = 0.0f;
        for (int q = 0; q < s.world; ++q) {
          float part = 0.0f;
          bool any = false;
          for (int j = 0; j < k; ++j) {
            const int32_t g = d.slot_row[size_t(r)][size_t(t * k + j)];
            if (g < 0 || b.ids[size_t(t * k + j)] / El != q) continue;
            const float v = bf16_to_float(float_to_bf16(y_rows[size_t(q)][size_t(g * H + c)]));
            part = std::fma(b.weights[size_t(t * k + j)], v, part);
            any = true;
          }
          if (any) acc += bf16_to_float(float_to_bf16(part));
        }
        if (shared) acc += bf16_to_float((*shared)[size_t(t * H + c)]);
        y[size_t(t * H + c)] = float_to_bf16(acc);
      }
    return y;
  }
  const bool bf16_rows = s.combine == CombineRows::kBf16;
  for (int64_t t = 0; t < b.T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      float acc = 0.0f;
      for (int j = 0; j < k; ++j) {
        const int32_t g = d.slot_row[size_t(r)][size_t(t * k + j)];
        if (g < 0) continue;
        const int q = b.ids[size_t(t * k + j)] / El;
        const float v = y_rows[size_t(q)][size_t(g * H + c)];
        if (bf16_rows) acc = std::fma(b.weights[size_t(t * k + j)], bf16_to_float(float_to_bf16(v)), acc);
        else acc += v;
      }
      if (shared) acc += bf16_to_float((*shared)[size_t(t * H + c)]);
      y[size_t(t * H + c)] = float_to_bf16(acc);
    }
  return y;
}

}  // namespace moekit::ep
