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
