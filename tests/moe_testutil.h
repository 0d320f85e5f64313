// Helpers shared by the MoE layer tests: tensors out of safetensors files, bf16 vectors, norms.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "moekit/common/bf16.h"
#include "moekit/io/safetensors.h"

namespace moekit::test {

// A tensor's elements, after checking its dtype and shape (gtest failure otherwise).
template <typename T>
std::vector<T> tensor_as(const SafetensorsFile& f, const std::string& name, DType dtype,
                         const std::vector<int64_t>& shape) {
  const TensorView* t = f.find(name);
  if (!t) {
    ADD_FAILURE() << f.path() << ": no tensor " << name;
    return {};
  }
  EXPECT_EQ(t->dtype, dtype) << name;
  EXPECT_EQ(t->shape, shape) << name;
  if (t->dtype != dtype || t->shape != shape || t->nbytes % sizeof(T) != 0) return {};
  std::vector<T> v(t->nbytes / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), t->data, t->nbytes);
  return v;
}

inline std::vector<float> bf16_to_floats(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_float(b[i]);
  return f;
}

// ||a - b|| / ||b|| in double; +inf when b is zero and a is not.
template <typename A, typename B>
double rel_l2_err(const std::vector<A>& a, const std::vector<B>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

template <typename T>
double l2(const std::vector<T>& a) {
  double s = 0;
  for (const T& v : a) s += double(v) * double(v);
  return std::sqrt(s);
}

// %.3e, for RecordProperty.
inline std::string fmt_e(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3e", v);
  return buf;
}

// True when dir holds no leftover temporary file of an atomic write.
inline bool no_temp_files(const std::string& dir) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.path().filename().string().find(".tmp") != std::string::npos) return false;
  return true;
}

}  // namespace moekit::test
