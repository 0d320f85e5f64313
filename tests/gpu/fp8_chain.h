// The FP8 activations' GPU chain for the tests (tests/gpu/test_quantize_fp8_gpu.cu runs it, C++17
// for nvcc; tests/gpu/test_fp8_chain_gpu.cpp compares it with the CPU layer): quantize (gather) ->
// FP8 GEMM1 -> quantize (rows) -> FP8 GEMM2 -> finalize on a host-made plan of the given ids, with
// every buffer poisoned first. And the presets of the FP8 timings.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/experts/activation.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/spec.hpp"

namespace moekit::test {

struct Fp8ChainIn {
  const sm90::ConvertedMatrix* w13 = nullptr;  // sm90::convert_w13 / convert_w2 of the layer
  const sm90::ConvertedMatrix* w2 = nullptr;
  const uint16_t* x = nullptr;                 // [T, H] bf16
  const int32_t* ids = nullptr;                // [T, k] (-1: empty slot)
  const float* weights = nullptr;              // [T, k]
  int64_t T = 0, H = 0, I = 0;
  int k = 0, E = 0;
  ActivationParams act;
  ActivationScale rule = ActivationScale::kFp32;
};

// The presets the FP8 timings run (FP8Bench.*): dims, experts, top-k.
struct Fp8BenchPreset {
  const char* name;
  int64_t H, I;
  int E, k;
};
inline constexpr Fp8BenchPreset kFp8BenchPresets[] = {
    {"gpt-oss-120b", 2880, 2880, 128, 4}, {"deepseek-v3", 7168, 2048, 256, 8}, {"qwen3-30b-a3b", 2048, 768, 128, 8}};

// y [T, H] bf16; "" on success, else what failed (a launch's error, an unwritten output).
std::string run_fp8_chain(const Fp8ChainIn& in, std::vector<uint16_t>* y);

}  // namespace moekit::test
