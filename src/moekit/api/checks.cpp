// The checks every public entry point makes (api/checks.h).
#include "moekit/api/checks.h"

#include "moekit/api/device.h"

namespace moekit::api {

Status error_status(const std::string& msg) {
  const bool runtime = msg.find("CUDA error") != std::string::npos;
  return {runtime ? StatusCode::kRuntimeError : StatusCode::kInvalidArgument, msg};
}

std::string device_name(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(d.device_id);
    default: return "device type " + std::to_string(int(d.device_type)) + ":" + std::to_string(d.device_id);
  }
}

std::string dtype_name(DLDataType t) {
  std::string base;
  switch (t.code) {
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLFloat: base = "float"; break;
    case kDLBfloat: base = "bfloat"; break;
    case 10: return "float8_e4m3fn";
    case 14: return "float8_e8m0fnu";
    default: base = "type" + std::to_string(int(t.code)) + "_"; break;
  }
  std::string s = base + std::to_string(int(t.bits));
  if (t.lanes != 1) s += "x" + std::to_string(int(t.lanes));
  return s;
}

bool kind_ok(Kind k, DLDataType t) {
  if (t.lanes != 1) return false;
  switch (k) {
    case Kind::kBf16: return (t.code == kDLBfloat && t.bits == 16) || ((t.code == kDLUInt || t.code == kDLInt) && t.bits == 16);
    case Kind::kF32: return t.code == kDLFloat && t.bits == 32;
    case Kind::kI32: return t.code == kDLInt && t.bits == 32;
    case Kind::kTokenIds: return t.code == kDLInt && (t.bits == 32 || t.bits == 64);
    case Kind::kBytes: return t.bits % 8 == 0;
  }
  return false;
}
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kBf16: return "bfloat16";
    case Kind::kF32: return "float32";
    case Kind::kI32: return "int32";
    case Kind::kTokenIds: return "int32 or int64";
    case Kind::kBytes: return "bytes";
  }
  return "?";
}

std::string shape_str(const DLTensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

namespace {

std::string want_str(const Want& w) {
  if (w.rank < 0) return "any shape";
  std::string s = "[";
  for (int i = 0; i < w.rank; ++i) s += (i ? ", " : "") + (w.d[i] < 0 ? std::string("*") : std::to_string(w.d[i]));
  return s + "]";
}

std::string strides_str(const DLTensor& t) {
  if (!t.strides) return "compact";
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.strides[i]);
  return s + "]";
}

int64_t stride_of(const DLTensor& t, int i) {
  if (t.strides) return t.strides[i];
  int64_t s = 1;
  for (int j = i + 1; j < t.ndim; ++j) s *= t.shape[j];
  return s;
}

}  // namespace

// Checks dtype, rank, shape, device, strides and alignment. rows: the last dimension is
// contiguous and the others may have any non-overlapping stride (row layouts); otherwise dense.
Checked check_tensor(const DLTensor& t, const char* name, Kind kind, const Want& shape, DLDevice dev, bool rows,
                     int64_t align_bytes) {
  MOEKIT_REQUIRE(kind_ok(kind, t.dtype), name, ": dtype ", dtype_name(t.dtype), ", expected ", kind_name(kind));
  MOEKIT_REQUIRE(t.ndim >= 0 && (shape.rank < 0 || t.ndim == shape.rank), name, ": shape ", shape_str(t), ", expected ",
                 want_str(shape));
  for (int i = 0; i < t.ndim; ++i)
    MOEKIT_REQUIRE(t.shape[i] >= 0 && (shape.rank < 0 || shape.d[i] < 0 || t.shape[i] == shape.d[i]), name,
                   ": shape ", shape_str(t), ", expected ", want_str(shape));
  MOEKIT_REQUIRE(t.device.device_type == dev.device_type && t.device.device_id == dev.device_id, name,
                 ": on ", device_name(t.device), ", the layer is on ", device_name(dev));
  Checked c;
  int64_t numel = 1;
  for (int i = 0; i < t.ndim; ++i) numel *= t.shape[i];
  MOEKIT_REQUIRE(numel == 0 || t.data, name, ": null data");
  c.data = static_cast<char*>(t.data) + t.byte_offset;
  for (int i = 0; i < t.ndim && i < 3; ++i) {
    c.shape[i] = t.shape[i];
    c.stride[i] = stride_of(t, i);
  }
  if (numel == 0) return c;
  // Dimensions of size 1 may carry any stride: give them the compact one.
  int64_t dense = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    const int64_t st = t.shape[i] == 1 ? dense : stride_of(t, i);
    if (i < 3) c.stride[i] = st;
    MOEKIT_REQUIRE(st >= 0, name, ": negative strides are not supported");
    if (!rows || i == t.ndim - 1)
      MOEKIT_REQUIRE(st == dense, name, ": ", rows ? "the last dimension" : "the tensor",
                     " must be contiguous (strides ", strides_str(t), ")");
    else
      MOEKIT_REQUIRE(st >= dense, name, ": rows overlap (stride ", st, " < ", dense, ")");
    dense = st * t.shape[i];
  }
  if (align_bytes > 0) {
    const int64_t esize = t.dtype.bits / 8;
    MOEKIT_REQUIRE(reinterpret_cast<uintptr_t>(c.data) % uintptr_t(align_bytes) == 0, name, ": data must be ",
                   align_bytes, "-byte aligned");
    for (int i = 0; i + 1 < t.ndim && i < 3; ++i)  // row slots: rank <= 3
      MOEKIT_REQUIRE(c.stride[i] * esize % align_bytes == 0, name, ": row stride of ", c.stride[i] * esize,
                     " bytes is not a multiple of ", align_bytes);
  }
  return c;
}

int64_t bytes_of(const DLTensor& t) {
  int64_t n = t.dtype.bits / 8 * t.dtype.lanes;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

// The checkpoint's tensors as host views, dtypes named as the slots name them; device tensors
// are copied to `host`.
std::vector<CheckpointTensor> host_checkpoint(const LayerSpec& spec, std::span<const NamedTensor> ck,
                                              std::vector<std::vector<uint8_t>>* host) {
  const std::vector<CheckpointSlot> slots = checkpoint_slots(spec);
  std::vector<CheckpointTensor> out;
  for (const NamedTensor& nt : ck) {
    const CheckpointSlot* slot = nullptr;
    for (const CheckpointSlot& s : slots)
      if (s.name == nt.name) slot = &s;
    if (!slot) {
      std::string names;
      for (const CheckpointSlot& s : slots) names += (names.empty() ? "" : ", ") + s.name;
      fail("checkpoint: unknown tensor ", nt.name, " for ", format_name(spec.format), " weights (expected ", names, ")");
    }
    const DLTensor& t = nt.tensor;
    const std::string what = "checkpoint tensor " + nt.name;
    // The dtype in safetensors terms; fp8 and bf16 bits may come as integers of their width.
    std::string dt = "?";
    const bool want_f8 = slot->dtype == "F8_E4M3", want_bf16 = slot->dtype.find("BF16") != std::string::npos;
    if (t.dtype.lanes == 1) {
      if (t.dtype.code == kDLUInt && t.dtype.bits == 8) dt = want_f8 ? "F8_E4M3" : "U8";
      else if (t.dtype.code == 10 && t.dtype.bits == 8) dt = "F8_E4M3";
      else if (t.dtype.code == 14 && t.dtype.bits == 8) dt = "U8";  // E8M0 scales
      else if (t.dtype.code == kDLBfloat && t.dtype.bits == 16) dt = "BF16";
      else if ((t.dtype.code == kDLUInt || t.dtype.code == kDLInt) && t.dtype.bits == 16 && want_bf16) dt = "BF16";
      else if (t.dtype.code == kDLFloat && t.dtype.bits == 32) dt = "F32";
      else if (t.dtype.code == kDLFloat && t.dtype.bits == 16) dt = "F16";
      else if (t.dtype.code == kDLInt && t.dtype.bits == 8) dt = "I8";
      else if (t.dtype.code == kDLInt && t.dtype.bits == 32) dt = "I32";
      else if (t.dtype.code == kDLInt && t.dtype.bits == 64) dt = "I64";
    }
    if (dt == "?") dt = dtype_name(t.dtype);
    MOEKIT_REQUIRE(t.device.device_type == kDLCPU || t.device.device_type == kDLCUDA, what, ": on ",
                   device_name(t.device), " (CPU or CUDA memory)");
    const Checked c = check_tensor(t, what.c_str(), Kind::kBytes, Want::any(), t.device, false);
    CheckpointTensor ct{nt.name, dt, std::vector<int64_t>(t.shape, t.shape + t.ndim), static_cast<const uint8_t*>(c.data),
                        size_t(bytes_of(t))};
    if (t.device.device_type != kDLCPU) {
      host->emplace_back(ct.nbytes);
      api::copy_to_host(t.device, host->back().data(), c.data, int64_t(ct.nbytes));
      ct.data = host->back().data();
    }
    out.push_back(std::move(ct));
  }
  return out;
}

}  // namespace moekit::api
