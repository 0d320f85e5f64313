// moekit/common/kernel_attr.h — a kernel's dynamic shared-memory limit, set once per device.
//
// cudaFuncSetAttribute acts on the kernel as loaded in the current device's context, so a process
// that launches on several GPUs has to set it on each. A once-per-process flag left every GPU but
// the first at the 48 KB default, and their launches failed with "invalid argument" (found by
// the EP layer on two GPUs in one process, tests/gpu/test_ep_gpu.cpp EpNccl.*).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace moekit {

constexpr int kMaxDevicesTracked = 64;

// Sets Kernel's cudaFuncAttributeMaxDynamicSharedMemorySize to `bytes` on the current device the
// first time it is asked there, and returns that call's result on every later call (thread-safe;
// two threads may both set it once, which is harmless). `bytes` is the same on every call for
// one Kernel.
template <auto Kernel>
cudaError_t max_dynamic_smem_once(int bytes) {
  static std::atomic<int> state[kMaxDevicesTracked];  // 0 not set, 1 set, 2 + the error
  int dev = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (dev < 0 || dev >= kMaxDevicesTracked)
    return cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  int s = state[dev].load(std::memory_order_acquire);
  if (s == 0) {
    const cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    s = e == cudaSuccess ? 1 : 2 + int(e);
    state[dev].store(s, std::memory_order_release);
  }
  return s == 1 ? cudaSuccess : static_cast<cudaError_t>(s - 2);
}

}  // namespace moekit
