#include "moekit/io/safetensors.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "moekit/common/bf16.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/io/files.h"

namespace moekit {

namespace {
struct DTypeInfo {
  DType d;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kF64, "F64", 8},   {DType::kF32, "F32", 4},         {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kF8E4M3, "F8_E4M3", 1},  {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kF8E8M0, "F8_E8M0", 1},
    {DType::kI64, "I64", 8},   {DType::kI32, "I32", 4},         {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},     {DType::kU64, "U64", 8},         {DType::kU32, "U32", 4},
    {DType::kU16, "U16", 2},   {DType::kU8, "U8", 1},           {DType::kBool, "BOOL", 1},
};
constexpr uint64_t kMaxHeader = 100u << 20;  // the reference implementation's limit

const DTypeInfo& info(DType d) {
  for (const auto& i : kDTypes)
    if (i.d == d) return i;
  fail("internal: unknown dtype");
}
}  // namespace

const char* dtype_name(DType d) { return info(d).name; }
size_t dtype_size(DType d) { return info(d).size; }
bool parse_dtype(const std::string& name, DType* out) {
  for (const auto& i : kDTypes)
    if (name == i.name) {
      *out = i.d;
      return true;
    }
  return false;
}

int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > INT64_MAX / d) return -1;
    n *= d;
  }
  return n;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void parse_safetensors(const uint8_t* bytes, size_t size, const std::string& what,
                       std::vector<TensorView>* tensors,
                       std::map<std::string, std::string>* metadata) {
  using nlohmann::json;
  MOEKIT_REQUIRE(size >= 8, what, ": truncated safetensors file (", size,
                 " bytes; the header length alone needs 8)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  MOEKIT_REQUIRE(n <= kMaxHeader, what, ": corrupt safetensors header length ", n);
  MOEKIT_REQUIRE(n <= size - 8, what, ": truncated safetensors file (header of ", n,
                 " bytes, file has ", size - 8, " after the length)");
  const uint8_t* data = bytes + 8 + n;
  const size_t data_size = size - 8 - n;

  json header = json::parse(bytes + 8, bytes + 8 + n, nullptr, /*allow_exceptions=*/false);
  MOEKIT_REQUIRE(!header.is_discarded(), what, ": corrupt safetensors header (not valid JSON)");
  MOEKIT_REQUIRE(header.is_object(), what, ": corrupt safetensors header (not a JSON object)");

  tensors->clear();
  metadata->clear();
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      MOEKIT_REQUIRE(v.is_object(), what, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        MOEKIT_REQUIRE(m.value().is_string(), what, ": __metadata__ value '", m.key(),
                       "' is not a string");
        (*metadata)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    MOEKIT_REQUIRE(v.is_object(), what, ": tensor ", name, ": entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    MOEKIT_REQUIRE(dt != v.end() && dt->is_string(), what, ": tensor ", name,
                   ": missing or non-string dtype");
    MOEKIT_REQUIRE(sh != v.end() && sh->is_array(), what, ": tensor ", name,
                   ": missing shape");
    MOEKIT_REQUIRE(off != v.end() && off->is_array() && off->size() == 2, what, ": tensor ",
                   name, ": data_offsets must be [begin, end]");
    TensorView t;
    t.name = name;
    const std::string dname = dt->get<std::string>();
    MOEKIT_REQUIRE(parse_dtype(dname, &t.dtype), what, ": tensor ", name, ": unknown dtype '",
                   dname, "'");
    for (const json& d : *sh) {
      MOEKIT_REQUIRE(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
                     what, ": tensor ", name, ": shape entries must be non-negative integers");
      MOEKIT_REQUIRE(d.get<uint64_t>() <= uint64_t(INT64_MAX), what, ": tensor ", name,
                     ": dimension too large");
      t.shape.push_back(d.get<int64_t>());
    }
    for (const json& o : *off)
      MOEKIT_REQUIRE(o.is_number_unsigned() || (o.is_number_integer() && o.get<int64_t>() >= 0),
                     what, ": tensor ", name, ": data_offsets must be non-negative integers");
    const uint64_t begin = (*off)[0].get<uint64_t>();
    const uint64_t end = (*off)[1].get<uint64_t>();
    MOEKIT_REQUIRE(begin <= end && end <= data_size, what, ": tensor ", name,
                   ": data_offsets [", begin, ", ", end, "] out of range (data buffer has ",
                   data_size, " bytes)");
    const int64_t numel = checked_numel(t.shape);
    MOEKIT_REQUIRE(numel >= 0 && uint64_t(numel) <= UINT64_MAX / dtype_size(t.dtype), what,
                   ": tensor ", name, ": shape ", shape_str(t.shape), " overflows");
    const uint64_t expect = uint64_t(numel) * dtype_size(t.dtype);
    MOEKIT_REQUIRE(end - begin == expect, what, ": tensor ", name, ": ", dname, " ",
                   shape_str(t.shape), " needs ", expect, " bytes but data_offsets span ",
                   end - begin);
    t.data = data + begin;
    t.nbytes = size_t(expect);
    tensors->push_back(std::move(t));
  }
  // Overlap check on the sorted offsets. A tensor of zero bytes occupies nothing: it may sit at
  // any offset, including inside or at the start of another tensor.
  std::vector<const TensorView*> byoff;
  for (const auto& t : *tensors)
    if (t.nbytes > 0) byoff.push_back(&t);
  std::sort(byoff.begin(), byoff.end(),
            [](const TensorView* a, const TensorView* b) { return a->data < b->data; });
  for (size_t i = 1; i < byoff.size(); ++i)
    MOEKIT_REQUIRE(byoff[i - 1]->data + byoff[i - 1]->nbytes <= byoff[i]->data, what,
                   ": tensors ", byoff[i - 1]->name, " and ", byoff[i]->name, " overlap");
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  const InputFile in = InputFile::open(path);  // a regular file, opened without blocking
  MOEKIT_REQUIRE(in.size() <= uint64_t(SIZE_MAX), path, ": too large to map");
  f.map_size_ = size_t(in.size());
  const uint8_t* bytes = nullptr;
  if (f.map_size_ > 0) {
    f.map_ = mmap(nullptr, f.map_size_, PROT_READ, MAP_PRIVATE, in.fd(), 0);
    if (f.map_ == MAP_FAILED) {
      f.map_ = nullptr;
      fail(path, ": cannot map (", std::strerror(errno), ")");
    }
    bytes = static_cast<const uint8_t*>(f.map_);
  }
  static const uint8_t kEmpty[1] = {0};
  parse_safetensors(bytes ? bytes : kEmpty, f.map_size_, path, &f.tensors_, &f.metadata_);
  f.by_name_.reserve(f.tensors_.size());
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.by_name_.emplace(f.tensors_[i].name, i);
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    if (map_) munmap(map_, map_size_);
    path_ = std::move(o.path_);
    map_ = o.map_;
    map_size_ = o.map_size_;
    tensors_ = std::move(o.tensors_);
    by_name_ = std::move(o.by_name_);
    metadata_ = std::move(o.metadata_);
    o.map_ = nullptr;
    o.map_size_ = 0;
  }
  return *this;
}
SafetensorsFile::~SafetensorsFile() {
  if (map_) munmap(map_, map_size_);
}

const TensorView* SafetensorsFile::find(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}
bool SafetensorsFile::has(const std::string& name) const { return find(name) != nullptr; }
const TensorView& SafetensorsFile::get(const std::string& name) const {
  const TensorView* t = find(name);
  MOEKIT_REQUIRE(t, path_, ": no tensor ", name);
  return *t;
}

SafetensorsWriter::Entry& SafetensorsWriter::entry(const std::string& name, DType dtype,
                                                   std::vector<int64_t> shape, size_t nbytes) {
  const int64_t n = checked_numel(shape);
  MOEKIT_REQUIRE(n >= 0 && size_t(n) * dtype_size(dtype) == nbytes, "internal: tensor ", name,
                 " shape ", shape_str(shape), " does not match ", nbytes, " bytes");
  for (const auto& e : entries_)
    MOEKIT_REQUIRE(e.name != name, "internal: tensor ", name, " added twice");
  Entry& e = entries_.emplace_back();
  e.name = name;
  e.dtype = dtype;
  e.shape = std::move(shape);
  e.size = nbytes;
  return e;
}

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            const void* data, size_t nbytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  entry(name, dtype, std::move(shape), nbytes).bytes.assign(p, p + nbytes);
}

void SafetensorsWriter::add_view(const std::string& name, DType dtype, std::vector<int64_t> shape,
                                 const void* data, size_t nbytes) {
  entry(name, dtype, std::move(shape), nbytes).view = static_cast<const uint8_t*>(data);
}

void SafetensorsWriter::add_generated(const std::string& name, DType dtype, std::vector<int64_t> shape,
                                      std::function<void(uint64_t, uint8_t*, size_t)> fill) {
  const int64_t n = checked_numel(shape);
  MOEKIT_REQUIRE(n >= 0, "internal: tensor ", name, " shape ", shape_str(shape), " overflows");
  entry(name, dtype, std::move(shape), size_t(n) * dtype_size(dtype)).fill = std::move(fill);
}

void SafetensorsWriter::write(const std::string& path) const {
  using nlohmann::json;
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& e : entries_) {
    header[e.name] = {{"dtype", dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + e.size}}};
    offset += e.size;
  }
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // keep the data buffer 8-byte aligned

  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(h.size()) >> (8 * i));
  std::vector<Chunk> chunks = {{len, 8}, {h.data(), h.size()}};
  for (const auto& e : entries_) {
    if (e.fill) chunks.push_back({nullptr, e.size, e.fill});
    else chunks.push_back({e.view ? e.view : e.bytes.data(), e.size});
  }
  write_file_atomic(path, chunks);
}

std::vector<float> to_float(const TensorView& t, const std::string& file) {
  MOEKIT_REQUIRE(t.dtype == DType::kF32 || t.dtype == DType::kBF16 || t.dtype == DType::kF16 ||
                     t.dtype == DType::kF8E8M0,
                 file, ": tensor ", t.name, ": dtype ", dtype_name(t.dtype),
                 " is not a float type (expected F32, BF16, F16 or F8_E8M0)");
  const int64_t n = t.numel();
  require_host_memory(file + ": tensor " + t.name + " as F32", sat_mul({n, 4}));
  std::vector<float> out(static_cast<size_t>(n));
  switch (t.dtype) {
    case DType::kF32:
      std::memcpy(out.data(), t.data, size_t(n) * 4);
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, t.data + 2 * i, 2);
        out[size_t(i)] = bf16_to_float(b);
      }
      break;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * i, 2);
        const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
        float v = e == 0    ? std::ldexp(float(m), -24)
                  : e == 31 ? (m ? NAN : INFINITY)
                            : std::ldexp(float(m | 0x400), e - 25);
        out[size_t(i)] = (h & 0x8000) ? -v : v;
      }
      break;
    case DType::kF8E8M0:  // 2^(b - 127), exact in fp32 (2^-127 as a subnormal); 0xFF is NaN
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t b = t.data[i];
        out[size_t(i)] = b == 0xff ? NAN : std::ldexp(1.0f, int(b) - 127);
      }
      break;
    default:
      break;
  }
  return out;
}

}  // namespace moekit
