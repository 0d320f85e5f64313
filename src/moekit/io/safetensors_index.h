// moekit/io/safetensors_index.h — the tensors of a Hugging Face checkpoint directory: sharded
// safetensors files named by model.safetensors.index.json, or one model.safetensors.
//
//   model.safetensors.index.json   {"metadata": {...}, "weight_map": {"NAME": "SHARD", ...}}
//   SHARD                          a safetensors file in the same directory
//
// Only what is asked for is touched: the index is read whole (it is small), a shard is opened
// (mapped, its header parsed and validated by SafetensorsFile) the first time one of its tensors
// is asked for, and tensor bytes are read by whoever dereferences the views, page by page. So
// one layer of a 60 GB checkpoint costs that layer's bytes, a few headers and the index.
//
// Every error is one line naming the file and the tensor: a shard the index names that is missing
// or broken, a shard name that is not a plain file name, a tensor the index places in a shard
// that does not hold it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "moekit/io/safetensors.h"

namespace moekit {

class SafetensorsIndex {
 public:
  // DIR/model.safetensors.index.json, or else DIR/model.safetensors (whose header is the index).
  static SafetensorsIndex open(const std::string& dir);
  SafetensorsIndex() = default;
  SafetensorsIndex(SafetensorsIndex&&) = default;
  SafetensorsIndex& operator=(SafetensorsIndex&&) = default;

  const std::string& dir() const { return dir_; }
  // The index file (or model.safetensors), for messages.
  const std::string& index_path() const { return index_path_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // The shard's path (DIR/SHARD) of a tensor the index names; "" when it names none.
  std::string shard_path(const std::string& name) const;
  // The tensor's view, its shard opened on first use; nullptr when the index does not name it.
  // Throws when the shard is missing or broken or does not hold the tensor.
  const TensorView* find(const std::string& name);
  // Like find, but a tensor the index does not name is an error ("INDEX: no tensor NAME").
  const TensorView& get(const std::string& name);
  // The names the index holds that start with prefix, in sorted order.
  std::vector<std::string> names_with_prefix(const std::string& prefix) const;
  // Every shard file the index names (paths), and those opened so far.
  std::vector<std::string> shard_paths() const;
  std::vector<std::string> opened_paths() const;

 private:
  SafetensorsFile& shard(const std::string& file, const std::string& for_tensor);
  std::string dir_, index_path_;
  std::map<std::string, std::string> where_;  // tensor -> shard file name
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;  // shard file name -> file
};

}  // namespace moekit
