// Bad Hugging Face checkpoint directories: each rejected by MoeModel::load with one line that
// names the file and the tensor (or the field, or the layer), and by `moekit run` with exit code
// 1, that one line and no output file. A missing shard, an index naming a tensor its shard lacks,
// expert counts that disagree with config.json, a layer out of range or dense, wrong dtypes and
// shapes, broken shards and indexes, unsupported models and quantizations.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "hf_testutil.h"
#include "moekit/common/error.h"
#include "moekit/io/safetensors_index.h"
#include "st_edit.h"
#include "testutil.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

json read_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}
void write_json(const std::string& path, const json& j) { std::ofstream(path) << j.dump(1); }

const char* kIndex = "model.safetensors.index.json";

// The shard file name the index gives a tensor.
std::string shard_of(const std::string& dir, const std::string& tensor) {
  return read_json(dir + "/" + kIndex)["weight_map"][tensor].get<std::string>();
}
// Rewrites the shard holding `tensor` with fn applied to its tensors.
void edit_shard_of(const std::string& dir, const std::string& tensor,
                   const std::function<void(std::vector<test::Tensor>&)>& fn) {
  test::edit(dir + "/" + shard_of(dir, tensor), fn);
}

struct BadCkpt {
  const char* name;
  int hf_case;   // index into test::hf_cases()
  int layer;     // --layer (-1: none)
  std::vector<std::string> needles;  // the message must contain each ({shard} = the damaged shard)
  std::function<std::string(const std::string& dir)> damage;  // returns the shard's name, or ""
};

constexpr int kGptOss = 0, kDsFp8 = 1, kQwenBf16 = 4;
const std::string kQ = "model.layers.1.mlp.experts.";  // Qwen3 layer 1's experts

std::vector<BadCkpt> bad_checkpoints() {
  return {
      {"missing_shard", kQwenBf16, 1, {"{shard}", "cannot open", kQ + "0.gate_proj.weight", kIndex},
       [](const std::string& d) {
         const std::string s = shard_of(d, kQ + "0.gate_proj.weight");
         fs::remove(d + "/" + s);
         return s;
       }},
      {"index_names_a_tensor_its_shard_lacks", kQwenBf16, 1, {"{shard}", "no tensor " + kQ + "3.up_proj.weight", kIndex},
       [](const std::string& d) {
         json j = read_json(d + "/" + kIndex);
         const std::string here = j["weight_map"][kQ + "3.up_proj.weight"];
         const std::string other = here == "model-00001-of-00003.safetensors" ? "model-00003-of-00003.safetensors"
                                                                               : "model-00001-of-00003.safetensors";
         j["weight_map"][kQ + "3.up_proj.weight"] = other;
         write_json(d + "/" + kIndex, j);
         return other;
       }},
      {"config_counts_more_experts", kQwenBf16, 1, {kIndex, "no tensor " + kQ + "16.gate_proj.weight", "num_experts = 20"},
       [](const std::string& d) {
         test::edit_config(d, [](json& j) { j["num_experts"] = 20; });
         return std::string();
       }},
      {"config_counts_fewer_experts", kQwenBf16, 1, {"{shard}", kQ + "12.", "expert 12", "num_experts = 12"},
       [](const std::string& d) {
         test::edit_config(d, [](json& j) { j["num_experts"] = 12; });
         return shard_of(d, kQ + "12.down_proj.weight");
       }},
      {"fused_experts_disagree_with_config", kGptOss, 0,
       {"{shard}", "model.layers.0.mlp.experts.gate_up_proj_blocks", "shape [8, ", "expected [6, ", "num_local_experts = 6"},
       [](const std::string& d) {
         test::edit_config(d, [](json& j) { j["num_local_experts"] = 6; });
         return shard_of(d, "model.layers.0.mlp.experts.gate_up_proj_blocks");
       }},
      {"layer_out_of_range", kQwenBf16, 3, {"layer 3 is out of range", "num_hidden_layers = 3", "config.json"},
       [](const std::string&) { return std::string(); }},
      {"dense_layer", kDsFp8, 0, {"layer 0 is a dense layer", "first_k_dense_replace", "MoE layers are 1-2"},
       [](const std::string&) { return std::string(); }},
      {"wrong_dtype", kQwenBf16, 1, {"{shard}", kQ + "5.down_proj.weight", "dtype F16, expected BF16"},
       [](const std::string& d) {
         edit_shard_of(d, kQ + "5.down_proj.weight",
                       [](auto& v) { test::tensor(v, kQ + "5.down_proj.weight").dtype = DType::kF16; });
         return shard_of(d, kQ + "5.down_proj.weight");
       }},
      {"wrong_shape", kQwenBf16, 1, {"{shard}", kQ + "2.down_proj.weight", "shape [96, 128], expected [128, 96]"},
       [](const std::string& d) {
         edit_shard_of(d, kQ + "2.down_proj.weight",
                       [](auto& v) { test::tensor(v, kQ + "2.down_proj.weight").shape = {96, 128}; });
         return shard_of(d, kQ + "2.down_proj.weight");
       }},
      {"truncated_shard", kQwenBf16, 1, {"{shard}"},
       [](const std::string& d) {
         const std::string s = shard_of(d, kQ + "0.gate_proj.weight");
         fs::resize_file(d + "/" + s, fs::file_size(d + "/" + s) - 100);
         return s;
       }},
      {"missing_router", kQwenBf16, 1, {kIndex, "no tensor model.layers.1.mlp.gate.weight"},
       [](const std::string& d) {
         json j = read_json(d + "/" + kIndex);
         j["weight_map"].erase("model.layers.1.mlp.gate.weight");
         write_json(d + "/" + kIndex, j);
         return std::string();
       }},
      {"nan_fp8_code", kDsFp8, 2, {"{shard}", "model.layers.2.mlp.experts.3.up_proj.weight", "NaN"},
       [](const std::string& d) {
         const std::string n = "model.layers.2.mlp.experts.3.up_proj.weight";
         edit_shard_of(d, n, [&](auto& v) { test::tensor(v, n).bytes[77] = 0x7f; });
         return shard_of(d, n);
       }},
      {"missing_fp8_scales", kDsFp8, 1, {kIndex, "no tensor model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"},
       [](const std::string& d) {
         json j = read_json(d + "/" + kIndex);
         j["weight_map"].erase("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv");
         write_json(d + "/" + kIndex, j);
         return std::string();
       }},
      {"index_not_json", kQwenBf16, 1, {kIndex, "not valid JSON"},
       [](const std::string& d) {
         std::ofstream(d + "/" + kIndex) << "{\"weight_map\": ";
         return std::string();
       }},
      {"shard_name_leaves_the_directory", kQwenBf16, 1, {kIndex, "'../x.safetensors'", "not a file name"},
       [](const std::string& d) {
         json j = read_json(d + "/" + kIndex);
         j["weight_map"]["model.norm.weight"] = "../x.safetensors";
         write_json(d + "/" + kIndex, j);
         return std::string();
       }},
      {"unknown_model_type", kQwenBf16, 1, {"config.json", "model_type 'llama'", "not supported"},
       [](const std::string& d) {
         test::edit_config(d, [](json& j) { j["model_type"] = "llama"; });
         return std::string();
       }},
      {"unsupported_quantization", kQwenBf16, 1, {"config.json", "quant_method 'gptq'"},
       [](const std::string& d) {
         test::edit_config(d, [](json& j) { j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}}; });
         return std::string();
       }},
      {"fp8_blocks_not_128", kDsFp8, 1, {"config.json", "weight_block_size must be [128, 128]"},
       [](const std::string& d) {
         test::edit_config(d, [](json& j) { j["quantization_config"]["weight_block_size"] = {64, 64}; });
         return std::string();
       }},
      {"missing_config_field", kGptOss, 0, {"config.json", "missing field num_local_experts"},
       [](const std::string& d) {
         test::edit_config(d, [](json& j) { j.erase("num_local_experts"); });
         return std::string();
       }},
  };
}

class HfBad : public ::testing::TestWithParam<BadCkpt> {};

TEST_P(HfBad, OneLineNamingFileAndTensor) {
  const BadCkpt& b = GetParam();
  const auto ck = test::build_hf_checkpoint(test::hf_cases()[size_t(b.hf_case)]);
  const MoeConfig cfg = test::hf_case_config(ck->c);
  // A good input first (hidden_states alone), then the damage.
  const std::string x = ck->dir / "x.safetensors";
  {
    const LayerInputData in = make_synthetic_input(cfg, 3, 1);
    SafetensorsWriter w;
    w.add("hidden_states", DType::kBF16, {3, int64_t(cfg.hidden)}, in.x);
    w.write(x);
  }
  const std::string shard = b.damage(ck->path());
  std::vector<std::string> needles;
  for (const std::string& n : b.needles) needles.push_back(n == "{shard}" ? shard : n);

  std::string msg;
  try {
    MoeModel::load(ck->path(), b.layer);
  } catch (const Error& e) {
    msg = e.what();
  }
  ASSERT_FALSE(msg.empty()) << "accepted";
  RecordProperty("message", msg);
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;

  const std::string y = ck->dir / "y.safetensors";
  const test::RunResult r = test::run_cli("run --model " + ck->path() + (b.layer >= 0 ? " --layer " + std::to_string(b.layer) : "") +
                                          " --input " + x + " --output " + y);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(test::count_lines(r.out), 1) << r.out;
  EXPECT_EQ(r.out.rfind("moekit: error: ", 0), 0u) << r.out;
  for (const std::string& n : needles) EXPECT_NE(r.out.find(n), std::string::npos) << "missing '" << n << "' in: " << r.out;
  EXPECT_FALSE(fs::exists(y));
}

INSTANTIATE_TEST_SUITE_P(Hf, HfBad, ::testing::ValuesIn(bad_checkpoints()),
                         [](const ::testing::TestParamInfo<BadCkpt>& i) { return std::string(i.param.name); });

TEST(HfBadCli, LayerOnALayerDirectoryIsRefused) {
  test::TempDir dir;
  test::write_small_layer(dir / "model", dir / "x.safetensors", WeightFormat::kMxfp4, false);
  const test::RunResult r = test::run_cli("run --model " + (dir / "model") + " --layer 1 --input " + (dir / "x.safetensors") +
                                          " --output " + (dir / "y.safetensors"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(test::count_lines(r.out), 1) << r.out;
  EXPECT_NE(r.out.find("--layer 1 picks a layer of a Hugging Face checkpoint directory"), std::string::npos) << r.out;
}

TEST(HfBadCli, LayerMustBeAWholeNumber) {
  const test::RunResult r = test::run_cli("run --model x --layer 1.5 --input x --output y");
  EXPECT_EQ(r.code, 2) << r.out;
}

TEST(HfBadCli, AnOutputThatIsAShardIsRefused) {
  const auto ck = test::build_hf_checkpoint(test::hf_cases()[kQwenBf16]);
  const std::string shard = ck->path() + "/" + shard_of(ck->path(), kQ + "0.gate_proj.weight");
  const auto before = fs::file_size(shard);
  const test::RunResult r = test::run_cli("run --model " + ck->path() + " --layer 1 --input " + shard + " --output " + shard);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("refusing to overwrite an input"), std::string::npos) << r.out;
  EXPECT_EQ(fs::file_size(shard), before);
}

}  // namespace
}  // namespace moekit
