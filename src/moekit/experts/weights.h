// moekit/experts/weights.h — one layer's expert weights as views of checkpoint bytes, in the
// logical row order every backend converts from, and the checkpoint names and layouts of SPEC
// section 7 that produce them (from a file or from the caller's tensors alike).
//
// Logical weight rows are the same for every format, whatever the checkpoint's row order:
//   w13 [E, 2I, H]: rows 0..I-1 gate, rows I..2I-1 up (GPT-OSS interleaves them on disk:
//                   physical row 2j is gate j, 2j+1 is up j; WeightMatrix maps the index)
//   w2  [E, H, I]
// Biases are fp32 in logical row order. Backends convert from these views to their own layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/common/spec.h"
#include "moekit/formats/quantize.h"

namespace moekit {

// A stacked weight tensor [E, N, K] in one of the block formats, viewing checkpoint bytes.
struct WeightMatrix {
  WeightFormat format = WeightFormat::kBf16;
  int64_t E = 0, N = 0, K = 0;
  const uint8_t* codes = nullptr;   // physical row p of expert e at codes + (e*N + p) * code_row
  const uint8_t* scales = nullptr;  // likewise with scale_row (none for bf16)
  int64_t code_row = 0, scale_row = 0;
  bool interleaved = false;         // logical row r < N/2 -> physical 2r, else 2(r - N/2) + 1
  std::vector<float> scale_2;       // nvfp4: [E * halves]; halves = 2 when gate/up differ
  int halves = 1;
  // Rows that share one row of scales: 1, or 128 for DeepSeek's 128x128 FP8 blocks (scales
  // [E, ceil(N/128), K/128] stacked, or [ceil(n/128), K/128] per part).
  int64_t scale_row_group = 1;
  // One tensor per expert and part, as Hugging Face checkpoints store experts (gate_proj, up_proj,
  // down_proj): when part_codes is not empty, logical rows [p n, (p + 1) n) of expert e, n = N /
  // parts, are the rows of part_codes[e * parts + p] (scales likewise); `codes` and `scales` then
  // point at the first part, and `interleaved` is unused.
  int parts = 1;
  std::vector<const uint8_t*> part_codes, part_scales;

  int64_t physical_row(int64_t r) const {
    return interleaved ? (r < N / 2 ? 2 * r : 2 * (r - N / 2) + 1) : r;
  }
  const uint8_t* row_codes(int64_t e, int64_t r) const {
    if (!part_codes.empty()) {
      const int64_t n = N / parts;
      return part_codes[size_t(e * parts + r / n)] + (r % n) * code_row;
    }
    return codes + (e * N + physical_row(r)) * code_row;
  }
  const uint8_t* row_scales(int64_t e, int64_t r) const {
    if (!part_scales.empty()) {
      const int64_t n = N / parts;
      return part_scales[size_t(e * parts + r / n)] + ((r % n) / scale_row_group) * scale_row;
    }
    const int64_t g = scale_row_group;
    return scales + (e * ((N + g - 1) / g) + physical_row(r) / g) * scale_row;
  }
  // nvfp4 tensor scale (1/g) of logical row r; 1 for other formats.
  float row_scale_2(int64_t e, int64_t r) const {
    if (scale_2.empty()) return 1.0f;
    return scale_2[size_t(e * halves + (halves == 2 && r >= N / 2 ? 1 : 0))];
  }
  // Exact fp32 values of logical row r (K floats).
  void dequant_row(int64_t e, int64_t r, float* out) const;
};

// The layer: its description and its weights (views; whoever made them keeps the bytes alive).
struct LayerWeights {
  MoeConfig cfg;
  WeightMatrix w13, w2;
  std::vector<float> b13;         // [E, 2I] logical order, empty when absent
  std::vector<float> b2;          // [E, H], empty when absent
  std::vector<float> score_bias;  // e_score_correction_bias [E], empty when absent
  std::vector<int32_t> hash_table;  // tid2eid [cfg.hash_vocab, top_k] (hash routing), else empty
};

// One checkpoint tensor in host memory: dense, row-major, little-endian.
struct CheckpointTensor {
  std::string name;
  std::string dtype;  // safetensors names: U8, F8_E4M3, BF16, F32, ...
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
};

// The tensors of SPEC section 7 for cfg.format (GPT-OSS names and gate/up interleave for mxfp4,
// ModelOpt-style for nvfp4, w13/w2 otherwise; optional biases and e_score_correction_bias; the
// hash table tid2eid I32|I64 [hash_vocab, top_k] when cfg.hash_vocab > 0) as views (the table as
// int32 values, checked: entries in [0, E), none twice in a row). Checks names, dtypes, shapes,
// NaN scale codes and non-finite biases; every message starts with `what` and names the tensor.
// cfg.biases and cfg.score_bias are set from what is present (an expert bias on a hash-routed
// layer is an error).
LayerWeights weights_from_checkpoint(const MoeConfig& cfg, const std::vector<CheckpointTensor>& t,
                                     const std::string& what);

// Value checks of one weight tensor's bytes (formats/quantize.h require_finite_elements): NaN
// E4M3 codes (mxfp8, fp8), non-finite bf16 weights, NaN scales (E8M0, E4M3, or non-finite fp32).
void require_finite_weights(WeightFormat f, const uint8_t* codes, size_t code_bytes, const uint8_t* scales,
                            size_t scale_bytes, const std::string& what, const std::string& code_name,
                            const std::string& scale_name);

// The layer's weights back in the checkpoint layout (SPEC section 7: names, physical row order),
// owned: for writing model directories and for handing host weights to the public API. Biases
// are BF16 (as model directories store them) or F32 (exact).
struct CheckpointBytes {
  std::vector<CheckpointTensor> tensors;  // views of storage
  std::vector<std::vector<uint8_t>> storage;
  CheckpointBytes() = default;
  CheckpointBytes(CheckpointBytes&&) = default;
  CheckpointBytes& operator=(CheckpointBytes&&) = default;
};
CheckpointBytes checkpoint_of(const LayerWeights& m, bool bf16_biases);

// The checkpoint tensors a layer takes: name, dtype, shape; optional ones flagged.
struct CheckpointSlot {
  std::string name, dtype;
  std::vector<int64_t> shape;
  bool optional = false;
};
std::vector<CheckpointSlot> checkpoint_slots(const MoeConfig& cfg);

}  // namespace moekit
