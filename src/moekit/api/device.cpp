#include "moekit/api/device.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "moekit/common/checked.h"
#include "moekit/common/error.h"

#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moekit::api {

namespace {
#ifdef MOEKIT_WITH_CUDA
void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(what, ": CUDA error: ", cudaGetErrorString(e));
}
#endif
void require_cuda(DLDevice d) {
  MOEKIT_REQUIRE(d.device_type == kDLCUDA, "device type ", int(d.device_type), " is not supported (CPU or CUDA)");
  MOEKIT_REQUIRE(cuda_built(), "this moekit was built without CUDA");
  MOEKIT_REQUIRE(d.device_id >= 0 && d.device_id < cuda_device_count(), "no CUDA device ", d.device_id);
}
}  // namespace

bool cuda_built() {
#ifdef MOEKIT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef MOEKIT_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

void* device_alloc(DLDevice d, int64_t bytes) {
  MOEKIT_REQUIRE(bytes >= 0, "negative allocation size ", bytes);
  const size_t n = size_t(bytes > 0 ? bytes : 1);
  if (d.device_type == kDLCPU) {
    require_host_memory("a buffer", n);
    // Large buffers (packed weights) on 2 MiB pages where the kernel offers them: filling a layer
    // of packed weights then costs a page fault per 2 MiB instead of per 4 KiB (a third of the
    // time of packing a GPT-OSS layer on the CPU, docs/perf/notebook.md "Checkpoints").
    constexpr size_t kHuge = size_t(2) << 20;
    const bool huge = n >= 4 * kHuge;
    const size_t align = huge ? kHuge : 256;
    void* p = std::aligned_alloc(align, (n + align - 1) / align * align);
    MOEKIT_REQUIRE(p, "cannot allocate ", human_bytes(n), " of host memory");
    if (huge) madvise(p, (n + align - 1) / align * align, MADV_HUGEPAGE);  // advice only: failure is fine
    return p;
  }
  require_cuda(d);
#ifdef MOEKIT_WITH_CUDA
  const DeviceScope on(d);
  // Refused with its size named, before cudaMalloc when it exceeds the device's memory.
  size_t free_b = 0, total_b = 0;
  ck(cudaMemGetInfo(&free_b, &total_b), "memory info");
  void* p = nullptr;
  if (n > free_b || cudaMalloc(&p, n) != cudaSuccess) {
    cudaGetLastError();
    fail("cannot allocate ", human_bytes(n), " of GPU memory (", human_bytes(free_b), " of ", human_bytes(total_b),
         " free)");
  }
  return p;
#else
  return nullptr;
#endif
}

void device_free(DLDevice d, void* p) {
  if (!p) return;
  if (d.device_type == kDLCPU) return std::free(p);
#ifdef MOEKIT_WITH_CUDA
  cudaFree(p);
#endif
}

namespace {
void copy(DLDevice d, void* dst, const void* src, int64_t bytes, bool to_host) {
  if (bytes <= 0) return;
  if (d.device_type == kDLCPU) return (void)std::memcpy(dst, src, size_t(bytes));
  require_cuda(d);
#ifdef MOEKIT_WITH_CUDA
  const DeviceScope on(d);
  ck(cudaMemcpy(dst, src, size_t(bytes), to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice),
     to_host ? "copy to host" : "copy from host");
  // From pageable memory cudaMemcpy returns once the bytes are staged, not landed; a kernel on a
  // non-blocking stream could then read the old bytes. Blocking means landed.
  if (!to_host) ck(cudaStreamSynchronize(nullptr), "copy from host");
#else
  (void)to_host;
#endif
}
}  // namespace

DeviceScope::DeviceScope(DLDevice d) {
#ifdef MOEKIT_WITH_CUDA
  if (d.device_type == kDLCUDA && cudaGetDevice(&old_) == cudaSuccess && old_ != d.device_id)
    set_ = cudaSetDevice(d.device_id) == cudaSuccess;
#else
  (void)d;
#endif
}

DeviceScope::~DeviceScope() {
#ifdef MOEKIT_WITH_CUDA
  if (set_) cudaSetDevice(old_);
#endif
}

void copy_to_host(DLDevice d, void* dst, const void* src, int64_t bytes) { copy(d, dst, src, bytes, true); }
void copy_from_host(DLDevice d, void* dst, const void* src, int64_t bytes) { copy(d, dst, src, bytes, false); }

}  // namespace moekit::api
