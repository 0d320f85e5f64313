// Helpers for GPU tests: checked CUDA calls and device buffers.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#define CUDA_OK(expr)                                                              \
  do {                                                                             \
    cudaError_t err_ = (expr);                                                     \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_);     \
  } while (0)

namespace moekit::test {

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    if (cudaMalloc(&ptr, sizeof(T) * (count ? count : 1)) != cudaSuccess) ptr = nullptr;
  }
  explicit DeviceBuffer(const std::vector<T>& v) : DeviceBuffer(v.size()) {
    if (ptr && n) cudaMemcpy(ptr, v.data(), sizeof(T) * n, cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::vector<T> to_host() const {
    std::vector<T> v(n);
    if (n) cudaMemcpy(v.data(), ptr, sizeof(T) * n, cudaMemcpyDeviceToHost);
    return v;
  }
  // Fills with a byte pattern (poison) before a kernel writes.
  void poison(uint8_t byte = 0xff) { cudaMemset(ptr, byte, sizeof(T) * n); }
};

}  // namespace moekit::test
