// moekit/io/json_file.h — a JSON file (config.json, an index, hf_quant_config.json) read whole,
// no larger than max_bytes, as one object; errors name the file ("PATH: not valid JSON (parse
// error at line 1, column 9: ...)", "PATH: not a JSON object").
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "moekit/common/error.h"
#include "moekit/io/files.h"

namespace moekit {

inline nlohmann::json read_json_object(const std::string& path, uint64_t max_bytes) {
  using nlohmann::json;
  json j;
  try {
    j = json::parse(read_file(path, max_bytes));
  } catch (const json::exception& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 9: ..." without its tag
    std::string what = e.what();
    if (const size_t tag = what.find("] "); tag != std::string::npos) what = what.substr(tag + 2);
    fail(path, ": not valid JSON (", what, ")");
  }
  MOEKIT_REQUIRE(j.is_object(), path, ": not a JSON object");
  return j;
}

}  // namespace moekit
