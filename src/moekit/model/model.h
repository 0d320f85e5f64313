// moekit/model/model.h — a model directory (config.json + experts.safetensors), loaded and
// validated, with the expert weights left in the checkpoint's bytes (memory-mapped).
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

#include "moekit/formats/quantize.h"
#include "moekit/io/safetensors.h"
#include "moekit/model/config.h"

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

  int64_t physical_row(int64_t r) const {
    return interleaved ? (r < N / 2 ? 2 * r : 2 * (r - N / 2) + 1) : r;
  }
  const uint8_t* row_codes(int64_t e, int64_t r) const {
    return codes + (e * N + physical_row(r)) * code_row;
  }
  const uint8_t* row_scales(int64_t e, int64_t r) const {
    return scales + (e * N + physical_row(r)) * scale_row;
  }
  // nvfp4 tensor scale (1/g) of logical row r; 1 for other formats.
  float row_scale_2(int64_t e, int64_t r) const {
    if (scale_2.empty()) return 1.0f;
    return scale_2[size_t(e * halves + (halves == 2 && r >= N / 2 ? 1 : 0))];
  }
  // Exact fp32 values of logical row r (K floats).
  void dequant_row(int64_t e, int64_t r, float* out) const;
};

struct MoeModel {
  std::string dir;
  MoeConfig cfg;
  SafetensorsFile file;      // owns the mapping the WeightMatrix views point into (loaded)
  std::vector<std::vector<uint8_t>> storage;  // or the bytes themselves (synthetic models)
  WeightMatrix w13, w2;
  std::vector<float> b13;    // [E, 2I] logical order, empty when absent
  std::vector<float> b2;     // [E, H], empty when absent
  std::vector<float> score_bias;  // e_score_correction_bias [E], empty when absent

  // Loads DIR/config.json and DIR/experts.safetensors; throws moekit::Error naming the file,
  // tensor and problem on anything missing or inconsistent.
  static MoeModel load(const std::string& dir);

  MoeModel() = default;
  MoeModel(MoeModel&&) = default;
  MoeModel& operator=(MoeModel&&) = default;
};

}  // namespace moekit
