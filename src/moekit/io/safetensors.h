// moekit/io/safetensors.h — safetensors files: memory-mapped, validated reads; atomic writes.
//
// File layout: u64 little-endian header length N, N bytes of JSON header
//   {"NAME": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value"}}
// then the data buffer; offsets are relative to its start.
//
// SafetensorsFile::open checks everything before any tensor byte is touched: a regular file
// (io/files.h: never a FIFO or device, never a blocking open), header length within the file and
// at most 100 MiB, JSON well-formed, known dtypes, non-negative shapes, offsets inside the data
// buffer, byte size == numel * element size (overflow-checked), no two tensors overlapping
// (tensors of zero bytes occupy nothing). Every failure is a moekit::Error whose message starts
// with the file name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <unordered_map>
#include <memory>
#include <string>
#include <vector>

namespace moekit {

// F8_E8M0: power-of-two scale bytes (2^(b - 127), 0xFF NaN), as DeepSeek-V4 publishes its MXFP4
// and FP8 block scales.
enum class DType { kF64, kF32, kF16, kBF16, kF8E4M3, kF8E5M2, kF8E8M0, kI64, kI32, kI16, kI8, kU64, kU32,
                   kU16, kU8, kBool };

const char* dtype_name(DType d);
size_t dtype_size(DType d);
// Returns false for names the safetensors format does not define.
bool parse_dtype(const std::string& name, DType* out);

// Product of dims, or -1 when it overflows int64.
int64_t checked_numel(const std::vector<int64_t>& shape);
std::string shape_str(const std::vector<int64_t>& shape);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const { return checked_numel(shape); }
  template <typename T>
  const T* as() const { return reinterpret_cast<const T*>(data); }
};

class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);
  SafetensorsFile() = default;  // empty: no tensors
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool has(const std::string& name) const;
  // Throws "FILE: no tensor NAME" when absent.
  const TensorView& get(const std::string& name) const;
  const TensorView* find(const std::string& name) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<TensorView> tensors_;
  std::unordered_map<std::string, size_t> by_name_;  // index into tensors_
  std::map<std::string, std::string> metadata_;
};

// Parses and validates a header and data buffer already in memory (the fuzz target's entry;
// open() uses it on the mapped file). `what` names the source in error messages.
void parse_safetensors(const uint8_t* bytes, size_t size, const std::string& what,
                       std::vector<TensorView>* tensors,
                       std::map<std::string, std::string>* metadata);

// Collects tensors, then writes them with write_file_atomic (io/files.h): to a temporary name
// renamed to PATH on success, so that a failed write never leaves a partial file at PATH.
class SafetensorsWriter {
 public:
  // Copies the bytes. nbytes must equal numel(shape) * dtype_size(dtype).
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t nbytes);
  template <typename T>
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape,
           const std::vector<T>& v) {
    add(name, dtype, std::move(shape), v.data(), v.size() * sizeof(T));
  }
  // Borrows the bytes instead: they must stay alive and unchanged until write() returns.
  void add_view(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
                size_t nbytes);
  // Bytes made while writing: fill(offset, dst, n) writes bytes [offset, offset + n) of the
  // tensor to dst (io/files.h Chunk), so that a large file never sits in memory whole.
  void add_generated(const std::string& name, DType dtype, std::vector<int64_t> shape,
                     std::function<void(uint64_t, uint8_t*, size_t)> fill);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;        // owned, or
    const uint8_t* view = nullptr;     // borrowed (size), or
    std::function<void(uint64_t, uint8_t*, size_t)> fill;  // generated (size)
    size_t size = 0;
  };
  Entry& entry(const std::string& name, DType dtype, std::vector<int64_t> shape, size_t nbytes);
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Tensor contents as fp32 (F32, BF16, F16, F8_E8M0 sources; exact); throws for other dtypes, and
// when the floats would not fit in host memory.
std::vector<float> to_float(const TensorView& t, const std::string& file);

}  // namespace moekit
