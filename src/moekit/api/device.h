// moekit/api/device.h — the few runtime calls the API makes outside forward: memory for Buffer,
// copies at load time. CUDA when it is built, otherwise CPU only (CUDA devices then
// fail with a message).
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>

namespace moekit::api {

bool cuda_built();
int cuda_device_count();  // 0 without CUDA or without a driver
void* device_alloc(DLDevice d, int64_t bytes);  // throws moekit::Error
void device_free(DLDevice d, void* p);
// Blocking copies; the device side on d.
void copy_to_host(DLDevice d, void* dst, const void* src, int64_t bytes);
void copy_from_host(DLDevice d, void* dst, const void* src, int64_t bytes);

// Makes CUDA device d the calling thread's current device for the scope and restores the old one
// after (nothing for a CPU device or without CUDA): what the API runs for a layer on device d
// (its packing and synthesis too) runs there, whichever device the caller had current.
class DeviceScope {
 public:
  explicit DeviceScope(DLDevice d);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int old_ = 0;
  bool set_ = false;
};

}  // namespace moekit::api
