// Helpers for GPU tests: checked CUDA calls and device buffers.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "moekit/common/bf16.h"

#define CUDA_OK(expr)                                                              \
  do {                                                                             \
    cudaError_t err_ = (expr);                                                     \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_);     \
  } while (0)

// Skips the test without an SM90 GPU.
#define NEED_SM90()                                                                   \
  do {                                                                                \
    if (!::moekit::test::have_sm90()) GTEST_SKIP() << "no SM90 GPU";                  \
  } while (0)

// A moekit::Status that must be ok.
#define OK(expr)                                           \
  do {                                                     \
    const ::moekit::Status st_ = (expr);                   \
    ASSERT_TRUE(st_.ok()) << #expr << ": " << st_.message; \
  } while (0)

namespace moekit::test {

// Whether device 0 is an SM90 GPU (the SM90 kernels' tests skip otherwise: NEED_SM90).
inline bool have_sm90() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return false;
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  return p.major == 9;
}

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

// Captures call() (which enqueues on s) into a CUDA graph (global capture mode: a call that
// allocates or synchronizes fails the capture), runs before() (e.g. poisoning the outputs), then
// replays the graph reps times and waits. call's own checks report its failures.
template <class Call, class Before>
void graph_replay(cudaStream_t s, Call&& call, Before&& before, int reps = 3) {
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  call();
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  before();
  for (int rep = 0; rep < reps; ++rep) CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Hidden states N(0, 1) as bf16 and router logits N(0, 2), n values from seed.
inline std::vector<uint16_t> random_x(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& b : v) b = float_to_bf16(nd(rng));
  return v;
}
inline std::vector<float> random_logits(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& b : v) b = nd(rng);
  return v;
}

}  // namespace moekit::test
