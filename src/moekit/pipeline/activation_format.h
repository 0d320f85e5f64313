// moekit/pipeline/activation_format.h — the two activation formats between prepare and experts.
//
// standard (contiguous): the rows of expert e are [offsets[e], offsets[e] + counts[e]); each
//   expert's segment is padded to `align` rows; padding rows carry -1 in row_src and are never
//   read as data nor written as output.
// batched (masked): a [E, max_tokens, width] block; the rows of expert e are slots
//   [0, counts[e]); slots at or beyond counts[e] are garbage and are never touched.
// In both, row_src[row] = token * k + j names the (token, top-k slot) a row came from, and
// dest[token * k + j] is the row it went to (-1 for an empty slot, id -1).
//
// A prepare/finalize produces one format and an experts kernel consumes one; ModularPipeline<L>
// only accepts the two halves for the same L, so a mismatched pair does not compile.
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/spec.hpp"  // ActivationFormat

namespace moekit {

const char* activation_format_name(ActivationFormat f);

struct StandardLayout {
  static constexpr ActivationFormat kFormat = ActivationFormat::kStandard;
  int align = 1;
  int64_t num_rows = 0;           // including padding
  std::vector<int64_t> offsets;   // [E + 1]
  std::vector<int32_t> counts;    // [E]
  std::vector<int32_t> row_src;   // [num_rows]
  std::vector<int64_t> dest;      // [T * k]

  int64_t row_begin(int e) const { return offsets[size_t(e)]; }
};

struct BatchedLayout {
  static constexpr ActivationFormat kFormat = ActivationFormat::kBatched;
  int max_tokens = 0;             // rows per expert in the block
  std::vector<int32_t> counts;    // [E]
  std::vector<int32_t> row_src;   // [E * max_tokens]; -1 beyond counts[e]
  std::vector<int64_t> dest;      // [T * k]

  int64_t num_rows() const { return int64_t(counts.size()) * max_tokens; }
  int64_t row_begin(int e) const { return int64_t(e) * max_tokens; }
};

// Rows of `width` bf16 values in layout L (host memory).
template <class L>
struct Activations {
  L layout;
  int64_t width = 0;
  std::vector<uint16_t> data;  // [rows, width] bf16 bits
};

// Expert outputs: rows of `width` fp32 values, row for row with the activations.
template <class L>
struct ExpertOutput {
  int64_t width = 0;
  std::vector<float> data;  // [rows, width]
};

}  // namespace moekit
