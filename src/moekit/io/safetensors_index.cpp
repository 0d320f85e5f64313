#include "moekit/io/safetensors_index.h"

#include <sys/stat.h>

#include <nlohmann/json.hpp>
#include <set>

#include "moekit/common/error.h"
#include "moekit/io/json_file.h"

namespace moekit {

namespace {
// DeepSeek-V3's index (91k tensors) is about 9 MB.
constexpr uint64_t kMaxIndexBytes = 64u << 20;
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

bool exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}
}  // namespace

SafetensorsIndex SafetensorsIndex::open(const std::string& dir) {
  using nlohmann::json;
  SafetensorsIndex x;
  x.dir_ = dir;
  const std::string index = dir + "/" + kIndexName;
  if (!exists(index) && exists(dir + "/" + kSingleName)) {
    // One file: its header is the index; it is opened now (header only).
    x.index_path_ = dir + "/" + kSingleName;
    auto f = std::make_unique<SafetensorsFile>(SafetensorsFile::open(x.index_path_));
    for (const TensorView& t : f->tensors()) x.where_.emplace(t.name, kSingleName);
    x.open_.emplace(kSingleName, std::move(f));
    return x;
  }
  x.index_path_ = index;
  MOEKIT_REQUIRE(exists(index), dir, ": no ", kIndexName, " or ", kSingleName,
                 " (not a Hugging Face checkpoint directory)");
  const json j = read_json_object(index, kMaxIndexBytes);
  const auto wm = j.find("weight_map");
  MOEKIT_REQUIRE(wm != j.end() && wm->is_object(), index, ": missing object weight_map");
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    MOEKIT_REQUIRE(it.value().is_string(), index, ": weight_map entry ", it.key(), " is not a file name");
    const std::string file = it.value().get<std::string>();
    // A shard is a file beside the index: never a path that leaves the directory.
    MOEKIT_REQUIRE(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", index,
                   ": weight_map names shard '", file, "' for tensor ", it.key(), ", not a file name in ", dir);
    x.where_.emplace(it.key(), file);
  }
  return x;
}

std::string SafetensorsIndex::shard_path(const std::string& name) const {
  const auto it = where_.find(name);
  return it == where_.end() ? "" : dir_ + "/" + it->second;
}

SafetensorsFile& SafetensorsIndex::shard(const std::string& file, const std::string& for_tensor) {
  auto it = open_.find(file);
  if (it != open_.end()) return *it->second;
  const std::string path = dir_ + "/" + file;
  std::unique_ptr<SafetensorsFile> f;
  try {
    f = std::make_unique<SafetensorsFile>(SafetensorsFile::open(path));
  } catch (const Error& e) {
    // "DIR/model-00002-of-00003.safetensors: cannot open (No such file or directory)", and who
    // sent us there.
    fail(e.what(), " (the shard ", index_path_, " names for tensor ", for_tensor, ")");
  }
  return *open_.emplace(file, std::move(f)).first->second;
}

const TensorView* SafetensorsIndex::find(const std::string& name) {
  const auto it = where_.find(name);
  if (it == where_.end()) return nullptr;
  SafetensorsFile& f = shard(it->second, name);
  const TensorView* t = f.find(name);
  MOEKIT_REQUIRE(t, f.path(), ": no tensor ", name, " (", index_path_, " places it in this shard)");
  return t;
}

const TensorView& SafetensorsIndex::get(const std::string& name) {
  const TensorView* t = find(name);
  MOEKIT_REQUIRE(t, index_path_, ": no tensor ", name);
  return *t;
}

std::vector<std::string> SafetensorsIndex::names_with_prefix(const std::string& prefix) const {
  std::vector<std::string> v;
  for (auto it = where_.lower_bound(prefix); it != where_.end() && it->first.compare(0, prefix.size(), prefix) == 0;
       ++it)
    v.push_back(it->first);
  return v;
}

std::vector<std::string> SafetensorsIndex::shard_paths() const {
  std::set<std::string> files;
  for (const auto& [name, file] : where_) files.insert(file);
  std::vector<std::string> v;
  for (const std::string& f : files) v.push_back(dir_ + "/" + f);
  return v;
}

std::vector<std::string> SafetensorsIndex::opened_paths() const {
  std::vector<std::string> v;
  for (const auto& [file, f] : open_) v.push_back(f->path());
  return v;
}

}  // namespace moekit
