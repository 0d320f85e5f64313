// moekit/api/checks.h — the checks every public entry point makes on its arguments (DLPack
// tensors: dtype, shape, device, strides, alignment), the Status a thrown moekit::Error becomes,
// and checkpoint tensors as host views. Shared by the layer API (layer.cpp) and the EP API
// (ep.cpp). Not public API.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <initializer_list>
#include <new>
#include <string>
#include <span>
#include <vector>

#include "moekit/common/error.h"
#include "moekit/experts/weights.h"
#include "moekit/moekit.hpp"

namespace moekit::api {

Status error_status(const std::string& msg);

// Runs f; a thrown error becomes the Status (one line).
template <class F>
Status guarded(F&& f) {
  try {
    f();
    return {};
  } catch (const Error& e) {
    return error_status(e.what());
  } catch (const std::bad_alloc&) {
    return {StatusCode::kRuntimeError, "out of host memory"};
  } catch (const std::exception& e) {
    return {StatusCode::kRuntimeError, e.what()};
  }
}

std::string device_name(DLDevice d);
std::string dtype_name(DLDataType t);

// What a tensor slot takes.
enum class Kind {
  kBf16,   // bfloat16, or 16-bit integers holding bf16 bits (numpy has no bfloat16)
  kF32,
  kI32,
  kTokenIds,  // int32 or int64
  kBytes,     // any dtype (workspace): its size in bytes counts
};
bool kind_ok(Kind k, DLDataType t);
const char* kind_name(Kind k);
std::string shape_str(const DLTensor& t);

// The shape a tensor slot takes: up to three extents (-1: any extent), or any rank and extents
// (the workspace, packed buffers). A value on the stack: the checks of a forward call allocate
// nothing.
struct Want {
  int rank = -1;  // -1: any rank
  int64_t d[3] = {-1, -1, -1};
  Want(std::initializer_list<int64_t> dims) : rank(int(dims.size())) {
    int i = 0;
    for (int64_t v : dims) d[i++] = v;
  }
  static Want any() { return Want(); }

 private:
  Want() = default;
};

// A checked tensor: its data pointer, and the extents and strides (elements) of its first three
// dimensions (the callers read those of slots of rank <= 3 only).
struct Checked {
  void* data = nullptr;
  int64_t shape[3] = {0, 0, 0};
  int64_t stride[3] = {0, 0, 0};
};

// Checks dtype, rank, shape, device, strides and alignment. rows: the last dimension is
// contiguous and the others may have any non-overlapping stride (row layouts); otherwise dense.
Checked check_tensor(const DLTensor& t, const char* name, Kind kind, const Want& shape, DLDevice dev, bool rows,
                     int64_t align_bytes = 0);
int64_t bytes_of(const DLTensor& t);

// The checkpoint's tensors as host views, dtypes named as the slots of `spec` name them; device
// tensors are copied to `host`.
std::vector<CheckpointTensor> host_checkpoint(const LayerSpec& spec, std::span<const NamedTensor> ck,
                                              std::vector<std::vector<uint8_t>>* host);

}  // namespace moekit::api
