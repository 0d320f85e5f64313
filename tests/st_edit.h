// Test helpers that damage files on purpose: a small good layer to start from, safetensors
// tensors read, edited and written back, config.json edited as JSON, raw safetensors bytes.
#pragma once

#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "moekit/io/safetensors.h"
#include "moekit/model/layer_io.h"
#include "moekit/model/synthetic.h"

namespace moekit::test {

struct Tensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline std::vector<Tensor> read_all(const std::string& path) {
  const auto f = SafetensorsFile::open(path);
  std::vector<Tensor> v;
  for (const TensorView& t : f.tensors())
    v.push_back({t.name, t.dtype, t.shape, std::vector<uint8_t>(t.data, t.data + t.nbytes)});
  return v;
}

inline void write_all(const std::string& path, const std::vector<Tensor>& v) {
  SafetensorsWriter w;
  for (const Tensor& t : v) w.add(t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size());
  w.write(path);
}

inline Tensor& tensor(std::vector<Tensor>& v, const std::string& name) {
  for (Tensor& t : v)
    if (t.name == name) return t;
  throw std::runtime_error("test setup: no tensor " + name);
}

// Reads the tensors of `path`, lets `fn` change them, writes them back.
inline void edit(const std::string& path, const std::function<void(std::vector<Tensor>&)>& fn) {
  auto v = read_all(path);
  fn(v);
  write_all(path, v);
}

inline void drop(std::vector<Tensor>& v, const std::string& name) {
  std::erase_if(v, [&](const Tensor& t) { return t.name == name; });
}

inline void edit_config(const std::string& dir, const std::function<void(nlohmann::json&)>& fn) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str());
  fn(j);
  std::ofstream(path) << j.dump(1);
}

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

inline void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

// A safetensors file of any header text: u64 length (the true length, or `claimed`), header, data.
inline std::string raw_safetensors(const std::string& header, const std::string& data = "",
                                   std::optional<uint64_t> claimed = std::nullopt) {
  const uint64_t n = claimed ? *claimed : header.size();
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char(uint8_t(n >> (8 * i)));
  return s + header + data;
}

// A small, good layer for the bad-input tests to damage: E = 4 experts, top-2, H = I = 64,
// swiglu_oai, biases and an e_score_correction_bias, T = 5 tokens of input (router logits, or
// top-k ids (t + j) % E with weights 0.25, 0.75 when bypass).
inline constexpr int kSmallE = 4, kSmallK = 2, kSmallH = 64, kSmallI = 64, kSmallT = 5;

inline MoeConfig small_layer_config(WeightFormat fmt) {
  MoeConfig c;
  c.num_experts = kSmallE;
  c.top_k = kSmallK;
  c.hidden = kSmallH;
  c.intermediate = kSmallI;
  c.act = Activation::kSwigluOai;
  c.norm_topk_prob = true;
  c.format = fmt;
  return c;
}

inline void write_small_layer(const std::string& model_dir, const std::string& input, WeightFormat fmt, bool bypass) {
  const MoeConfig cfg = small_layer_config(fmt);
  SyntheticOptions opt;
  opt.seed = 77;
  opt.biases = true;
  opt.score_bias = true;
  opt.split_scale_2 = fmt == WeightFormat::kNvfp4;
  write_model_dir(make_synthetic_model(cfg, opt), model_dir);
  LayerInputData in = make_synthetic_input(cfg, kSmallT, 78);
  if (bypass) {
    in.logits.clear();
    in.bypass = true;
    in.k = kSmallK;
    for (int64_t t = 0; t < kSmallT; ++t)
      for (int j = 0; j < kSmallK; ++j) {
        in.ids.push_back(int32_t((t + j) % kSmallE));
        in.weights.push_back(0.25f + 0.5f * float(j));
      }
  }
  write_layer_input(input, in, kSmallH, kSmallE);
}

}  // namespace moekit::test
