// libFuzzer target for the safetensors parser: any byte string must either be rejected with a
// moekit::Error or yield tensors whose bytes all lie inside the input (ASan checks each read).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "moekit/common/error.h"
#include "moekit/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<moekit::TensorView> tensors;
  std::map<std::string, std::string> meta;
  try {
    moekit::parse_safetensors(data, size, "fuzz", &tensors, &meta);
  } catch (const moekit::Error&) {
    return 0;
  }
  unsigned sum = 0;
  for (const auto& t : tensors) {
    for (size_t i = 0; i < t.nbytes; ++i) sum += t.data[i];
    try {
      if (t.dtype == moekit::DType::kF32 || t.dtype == moekit::DType::kBF16 ||
          t.dtype == moekit::DType::kF16)
        sum += unsigned(moekit::to_float(t, "fuzz").size());
    } catch (const moekit::Error&) {
    }
  }
  return sum == 0xdeadbeef ? 0 : 0;
}
