// moekit/cli/args.h — exit codes and the parsing of numbers on the command line.
//
// Exit codes (README): 0 success; 1 bad input (files, their contents, values that parse but make
// no layer, outputs that would lose data; the one-line message names the file, tensor, field or
// value); 2 usage error (unknown subcommand or option, missing argument, malformed number).
//
// Numbers are whole decimal strings (common/checked.h parse_whole_int): `8abc`, `8.5`, ` 8`,
// `0x10` and `1e3` are usage errors, never read by their prefix.
#pragma once

#include <CLI/CLI.hpp>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "moekit/bench/bench.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"

namespace moekit::cli {

inline constexpr int kExitBadInput = 1;
inline constexpr int kExitUsage = 2;

// A comma-separated list of whole decimal integers in [lo, hi]; throws moekit::Error whose
// message starts with `what` (e.g. "--tokens: ") otherwise.
inline std::vector<int64_t> parse_int_list(const std::string& s, int64_t lo, int64_t hi,
                                           const std::string& what) {
  std::vector<int64_t> v;
  size_t begin = 0;
  while (true) {
    const size_t end = s.find(',', begin);
    const std::string item = s.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    int64_t x = 0;
    MOEKIT_REQUIRE(parse_whole_int(item, lo, hi, &x), what, "'", item, "' is not a whole number in [", lo,
                   ", ", hi, "]", item == s ? "" : " (in '" + s + "')");
    v.push_back(x);
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return v;
}

// CLI11 check: the option's value is a list of `count` (0: any number of) whole numbers in
// [lo, hi]. A failure is a usage error.
inline CLI::Validator int_list(int64_t lo, int64_t hi, size_t count = 0) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        try {
          const size_t n = parse_int_list(s, lo, hi, "").size();
          if (count && n != count) return "'" + s + "' must have " + std::to_string(count) + " numbers";
        } catch (const Error& e) {
          return e.what();
        }
        return "";
      },
      count == 1 ? "INT" : "INT,...");
}
inline CLI::Validator whole_int(int64_t lo, int64_t hi) { return int_list(lo, hi, 1); }

// --activations / --activation-scale (run, backends, bench): the experts' input precision,
// LayerSpec::activation_dtype and activation_scale. Not given: the model's (config.json's
// `activation_dtype`, `activation_scale`), else bf16.
struct ActivationArgs {
  std::string activations, scale;
};
// model: the command reads a model directory, whose config.json may name its activations.
inline void add_activation_options(CLI::App* sub, ActivationArgs& a, bool model) {
  sub->add_option("--activations", a.activations,
                  std::string("the experts' input precision: bf16 | fp8 (E4M3, one scale per token per 128 along K,\n"
                              "both GEMMs' inputs; docs/FORMATS.md \"FP8 activations\"); default: ") +
                      (model ? "the model's, else bf16" : "bf16"))
      ->check(CLI::IsMember({"bf16", "fp8"}));
  sub->add_option("--activation-scale", a.scale,
                  "the scales of fp8 activations: fp32 (amax / 448; the default) | ue8m0 (the power of two\n"
                  "at or above amax / 448: DeepSeek-V4's rule)")
      ->check(CLI::IsMember({"fp32", "ue8m0"}));
}
// Applies the options given to c; a scale other than fp32 without fp8 activations is bad input.
inline void apply_activation_options(const ActivationArgs& a, LayerSpec* c) {
  if (!a.activations.empty()) {
    MOEKIT_REQUIRE(parse_activation_dtype(a.activations, &c->activation_dtype), "--activations: unknown '", a.activations, "'");
    if (c->activation_dtype == ActivationDtype::kBf16) c->activation_scale = ActivationScale::kFp32;
  }
  if (!a.scale.empty())
    MOEKIT_REQUIRE(parse_activation_scale(a.scale, &c->activation_scale), "--activation-scale: unknown '", a.scale, "'");
  MOEKIT_REQUIRE(c->activation_dtype == ActivationDtype::kFp8 || c->activation_scale == ActivationScale::kFp32,
                 "--activation-scale ", a.scale, ": applies to fp8 activations only (add --activations fp8)");
}

// CLI11 check for `bench --shape`: a named shape or E,k,H,I (whole numbers) that make a layer.
// The weight format's block sizes are checked later, with the format.
inline CLI::Validator shape_spec() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        try {
          bench_shape(s, WeightFormat::kBf16);
        } catch (const Error& e) {
          return e.what();
        }
        return "";
      },
      "SHAPE");
}

}  // namespace moekit::cli
