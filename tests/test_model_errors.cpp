// Bad model directories and bad layer inputs: each rejected by MoeModel::load / load_layer_input
// with a moekit::Error that names the file and the field or tensor, and by `moekit run` with a
// non-zero exit, exactly one line of output and no output file (SPEC section 7).
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moe_testutil.h"
#include "st_edit.h"
#include "moekit/common/error.h"
#include "moekit/model/layer_io.h"
#include "moekit/model/synthetic.h"
#include "testutil.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::Tensor;
using test::bytes_of;
using test::drop;
using test::edit;
using test::edit_config;
using test::tensor;

constexpr int kE = test::kSmallE, kK = test::kSmallK, kH = test::kSmallH, kI = test::kSmallI, kT = test::kSmallT;

MoeConfig base_config(WeightFormat fmt) { return test::small_layer_config(fmt); }

// ---- the cases ---------------------------------------------------------------------------------

enum class Stage { kModel, kInput };

struct BadCase {
  const char* name;
  Stage stage;               // which loader must reject it
  const char* file;          // the file the message must name
  std::vector<std::string> needles;
  std::function<void(const std::string& model, const std::string& input)> damage;
  WeightFormat fmt = WeightFormat::kMxfp4;
  bool bypass_input = false;  // the good input carries topk_ids/topk_weights instead of logits
};

std::vector<BadCase> bad_cases() {
  using W = WeightFormat;
  const auto cfg = [](std::function<void(json&)> fn) {
    return [fn](const std::string& m, const std::string&) { edit_config(m, fn); };
  };
  const auto experts = [](std::function<void(std::vector<Tensor>&)> fn) {
    return [fn](const std::string& m, const std::string&) { edit(m + "/experts.safetensors", fn); };
  };
  const auto input = [](std::function<void(std::vector<Tensor>&)> fn) {
    return [fn](const std::string&, const std::string& in) { edit(in, fn); };
  };
  return {
      // config.json
      {"missing config.json", Stage::kModel, "config.json", {"cannot open"},
       [](const std::string& m, const std::string&) { fs::remove(m + "/config.json"); }},
      {"config.json not JSON", Stage::kModel, "config.json", {"JSON"},
       [](const std::string& m, const std::string&) { std::ofstream(m + "/config.json") << "{\"num_experts\": 4,"; }},
      {"missing required field", Stage::kModel, "config.json", {"missing field", "num_experts_per_tok"},
       cfg([](json& j) { j.erase("num_experts_per_tok"); })},
      {"missing hidden_size", Stage::kModel, "config.json", {"hidden_size"},
       cfg([](json& j) { j.erase("hidden_size"); })},
      {"field of wrong type", Stage::kModel, "config.json", {"intermediate_size"},
       cfg([](json& j) { j["intermediate_size"] = "64"; })},
      {"unknown hidden_act", Stage::kModel, "config.json", {"hidden_act", "gelu"},
       cfg([](json& j) { j["hidden_act"] = "gelu"; })},
      {"unknown scoring_func", Stage::kModel, "config.json", {"scoring_func", "tanh"},
       cfg([](json& j) { j["scoring_func"] = "tanh"; })},
      {"unknown format", Stage::kModel, "config.json", {"int4"},
       cfg([](json& j) { j["quantization"]["format"] = "int4"; })},
      {"missing quantization", Stage::kModel, "config.json", {"quantization"},
       cfg([](json& j) { j.erase("quantization"); })},
      {"k > E", Stage::kModel, "config.json", {"num_experts_per_tok", "5", "num_experts"},
       cfg([](json& j) { j["num_experts_per_tok"] = 5; })},
      {"E not divisible by n_group", Stage::kModel, "config.json", {"n_group", "3"},
       cfg([](json& j) { j["n_group"] = 3; })},
      {"topk_group > n_group", Stage::kModel, "config.json", {"topk_group", "3"},
       cfg([](json& j) { j["n_group"] = 2; j["topk_group"] = 3; })},
      {"H not a multiple of the block", Stage::kModel, "config.json", {"hidden_size", "80", "block"},
       cfg([](json& j) { j["hidden_size"] = 80; })},
      {"I not a multiple of the block", Stage::kModel, "config.json", {"intermediate_size", "48", "block"},
       cfg([](json& j) { j["intermediate_size"] = 48; })},
      {"nvfp4 H not a multiple of 16", Stage::kModel, "config.json", {"hidden_size", "40", "nvfp4"},
       cfg([](json& j) { j["hidden_size"] = 40; }), W::kNvfp4},
      // experts.safetensors
      {"H in config inconsistent with the tensors", Stage::kModel, "experts.safetensors",
       {"gate_up_proj_blocks", "shape", "[4, 128, 4, 16]"}, cfg([](json& j) { j["hidden_size"] = 128; })},
      {"E in config inconsistent with the tensors", Stage::kModel, "experts.safetensors",
       {"gate_up_proj_blocks", "shape"}, cfg([](json& j) { j["num_experts"] = 8; })},
      {"missing tensor", Stage::kModel, "experts.safetensors", {"missing tensor", "down_proj_scales"},
       experts([](auto& v) { drop(v, "down_proj_scales"); })},
      {"missing nvfp4 scale_2", Stage::kModel, "experts.safetensors", {"w13_weight_scale_2"},
       experts([](auto& v) { drop(v, "w13_weight_scale_2"); }), W::kNvfp4},
      {"tensor with wrong shape", Stage::kModel, "experts.safetensors", {"gate_up_proj_scales", "shape"},
       experts([](auto& v) {
         Tensor& t = tensor(v, "gate_up_proj_scales");
         t.shape = {t.shape[0], t.shape[1] * t.shape[2]};
       })},
      {"nvfp4 scale_2 with wrong shape", Stage::kModel, "experts.safetensors", {"w13_weight_scale_2", "shape"},
       experts([](auto& v) {
         Tensor& t = tensor(v, "w13_weight_scale_2");  // [E, 2]
         t.shape = {2 * kE};
       }), W::kNvfp4},
      {"tensor with wrong dtype", Stage::kModel, "experts.safetensors", {"down_proj_blocks", "dtype", "I8"},
       experts([](auto& v) { tensor(v, "down_proj_blocks").dtype = DType::kI8; })},
      {"bf16 weight stored as F16", Stage::kModel, "experts.safetensors", {"w2_weight", "dtype", "F16"},
       experts([](auto& v) { tensor(v, "w2_weight").dtype = DType::kF16; }), W::kBf16},
      {"mxfp8 weight stored as U8", Stage::kModel, "experts.safetensors", {"w13_weight", "dtype", "U8"},
       experts([](auto& v) { tensor(v, "w13_weight").dtype = DType::kU8; }), W::kMxfp8},
      {"NaN E8M0 scale in gate_up_proj_scales", Stage::kModel, "experts.safetensors",
       {"gate_up_proj_scales", "NaN"}, experts([](auto& v) { tensor(v, "gate_up_proj_scales").bytes[37] = 0xff; })},
      {"NaN E8M0 scale in down_proj_scales", Stage::kModel, "experts.safetensors",
       {"down_proj_scales", "NaN"}, experts([](auto& v) { tensor(v, "down_proj_scales").bytes.back() = 0xff; })},
      {"NaN E8M0 scale in mxfp8 w2_weight_scale", Stage::kModel, "experts.safetensors",
       {"w2_weight_scale", "NaN"}, experts([](auto& v) { tensor(v, "w2_weight_scale").bytes[3] = 0xff; }),
       W::kMxfp8},
      {"NaN E4M3 code in mxfp8 weights", Stage::kModel, "experts.safetensors", {"w13_weight", "NaN"},
       experts([](auto& v) { tensor(v, "w13_weight").bytes[100] = 0xff; }), W::kMxfp8},
      {"NaN E4M3 block scale in nvfp4", Stage::kModel, "experts.safetensors", {"w13_weight_scale", "NaN"},
       experts([](auto& v) { tensor(v, "w13_weight_scale").bytes[5] = 0x7f; }), W::kNvfp4},
      {"Inf nvfp4 tensor scale", Stage::kModel, "experts.safetensors", {"w2_weight_scale_2"},
       experts([](auto& v) {
         Tensor& t = tensor(v, "w2_weight_scale_2");
         const float inf = INFINITY;
         std::memcpy(t.bytes.data() + 4, &inf, 4);
       }), W::kNvfp4},
      {"NaN in a bias", Stage::kModel, "experts.safetensors", {"gate_up_proj_bias", "non-finite"},
       experts([](auto& v) {
         Tensor& t = tensor(v, "gate_up_proj_bias");  // BF16
         t.bytes[10] = 0xc0;
         t.bytes[11] = 0x7f;
       })},
      {"bias with wrong shape", Stage::kModel, "experts.safetensors", {"down_proj_bias", "shape"},
       experts([](auto& v) {
         Tensor& t = tensor(v, "down_proj_bias");
         t.shape = {t.shape[1], t.shape[0]};
       })},
      {"truncated experts.safetensors", Stage::kModel, "experts.safetensors", {},
       [](const std::string& m, const std::string&) {
         const std::string p = m + "/experts.safetensors";
         fs::resize_file(p, fs::file_size(p) - 100);
       }},
      {"missing experts.safetensors", Stage::kModel, "experts.safetensors", {"cannot open"},
       [](const std::string& m, const std::string&) { fs::remove(m + "/experts.safetensors"); }},
      // input.safetensors
      {"missing input file", Stage::kInput, "input.safetensors", {"cannot open"},
       [](const std::string&, const std::string& in) { fs::remove(in); }},
      {"input without router_logits and topk_ids", Stage::kInput, "input.safetensors", {"router_logits"},
       input([](auto& v) { drop(v, "router_logits"); })},
      {"input without hidden_states", Stage::kInput, "input.safetensors", {"hidden_states"},
       input([](auto& v) { drop(v, "hidden_states"); })},
      {"hidden_states with wrong width", Stage::kInput, "input.safetensors", {"hidden_states", "shape"},
       input([](auto& v) {
         Tensor& t = tensor(v, "hidden_states");
         t.shape = {t.shape[0] * 2, t.shape[1] / 2};
       })},
      {"hidden_states as I16", Stage::kInput, "input.safetensors", {"hidden_states", "dtype"},
       input([](auto& v) {
         Tensor& t = tensor(v, "hidden_states");
         t.dtype = DType::kI16;
       })},
      {"router_logits for the wrong E", Stage::kInput, "input.safetensors", {"router_logits", "shape"},
       input([](auto& v) {
         Tensor& t = tensor(v, "router_logits");
         t.shape = {t.shape[0] * 2, t.shape[1] / 2};
       })},
      {"router_logits as BF16", Stage::kInput, "input.safetensors", {"router_logits", "dtype"},
       input([](auto& v) {
         Tensor& t = tensor(v, "router_logits");
         t.dtype = DType::kBF16;
         t.shape = {t.shape[0] * 2, t.shape[1]};
       })},
      {"NaN in hidden_states", Stage::kInput, "input.safetensors", {"hidden_states", "non-finite"},
       input([](auto& v) {
         Tensor& t = tensor(v, "hidden_states");  // BF16
         t.bytes[2 * (3 * kH + 7)] = 0xc0;
         t.bytes[2 * (3 * kH + 7) + 1] = 0x7f;
       })},
      {"Inf in F32 hidden_states", Stage::kInput, "input.safetensors", {"hidden_states", "non-finite"},
       input([](auto& v) {
         Tensor& t = tensor(v, "hidden_states");
         std::vector<float> f(t.bytes.size() / 2, 0.5f);
         f[f.size() - 1] = -INFINITY;
         t.dtype = DType::kF32;
         t.bytes = bytes_of(f);
       })},
      {"NaN in router_logits", Stage::kInput, "input.safetensors", {"router_logits", "non-finite"},
       input([](auto& v) {
         Tensor& t = tensor(v, "router_logits");
         const float nan = NAN;
         std::memcpy(t.bytes.data() + 4 * (2 * kE + 1), &nan, 4);
       })},
      {"topk_ids with an id >= E", Stage::kInput, "input.safetensors", {"topk_ids", "out of range", "4"},
       input([](auto& v) {
         Tensor& t = tensor(v, "topk_ids");
         const int32_t bad = kE;
         std::memcpy(t.bytes.data() + 4 * 3, &bad, 4);
       }), WeightFormat::kMxfp4, true},
      {"topk_ids with id -2", Stage::kInput, "input.safetensors", {"topk_ids", "out of range", "-2"},
       input([](auto& v) {
         Tensor& t = tensor(v, "topk_ids");
         const int32_t bad = -2;
         std::memcpy(t.bytes.data(), &bad, 4);
       }), WeightFormat::kMxfp4, true},
      {"topk_ids as I64", Stage::kInput, "input.safetensors", {"topk_ids", "dtype"},
       input([](auto& v) {
         Tensor& t = tensor(v, "topk_ids");
         t.dtype = DType::kI64;
         t.shape = {t.shape[0], t.shape[1] / 2};
       }), WeightFormat::kMxfp4, true},
      {"NaN in topk_weights", Stage::kInput, "input.safetensors", {"topk_weights", "non-finite"},
       input([](auto& v) {
         Tensor& t = tensor(v, "topk_weights");
         const float nan = NAN;
         std::memcpy(t.bytes.data() + 4 * 5, &nan, 4);
       }), WeightFormat::kMxfp4, true},
      {"topk_ids without topk_weights", Stage::kInput, "input.safetensors", {"topk_weights"},
       input([](auto& v) { drop(v, "topk_weights"); }), WeightFormat::kMxfp4, true},
      {"topk_weights of another shape", Stage::kInput, "input.safetensors", {"topk_weights", "shape"},
       input([](auto& v) {
         Tensor& t = tensor(v, "topk_weights");
         t.shape = {t.shape[1], t.shape[0]};
       }), WeightFormat::kMxfp4, true},
  };
}

// A good model directory and input file, with `bc`'s damage applied.
void make_case(const test::TempDir& dir, const BadCase& bc) {
  test::write_small_layer(dir / "model", dir / "input.safetensors", bc.fmt, bc.bypass_input);
  // The undamaged pair is good.
  const MoeModel good = MoeModel::load(dir / "model");
  const LayerInputData gi = load_layer_input(dir / "input.safetensors", good.cfg);
  ASSERT_EQ(gi.tokens, kT);
  bc.damage(dir / "model", dir / "input.safetensors");
}

void check_message(const std::string& msg, const BadCase& bc) {
  EXPECT_NE(msg.find(bc.file), std::string::npos) << "message must name " << bc.file << ": " << msg;
  for (const auto& n : bc.needles) EXPECT_NE(msg.find(n), std::string::npos) << "expected '" << n << "' in: " << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
}

void PrintTo(const BadCase& b, std::ostream* os) { *os << b.name; }

class BadModel : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadModel, LoaderRejectsWithMessage) {
  const BadCase& bc = GetParam();
  test::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(make_case(dir, bc));
  try {
    const MoeModel m = MoeModel::load(dir / "model");
    ASSERT_EQ(bc.stage, Stage::kInput) << "MoeModel::load accepted a bad model directory";
    const LayerInputData in = load_layer_input(dir / "input.safetensors", m.cfg);
    ADD_FAILURE() << "load_layer_input accepted a bad input (" << in.tokens << " tokens)";
  } catch (const Error& e) {
    check_message(e.what(), bc);
  }
}

TEST_P(BadModel, CliFailsWithOneLineAndNoOutput) {
  const BadCase& bc = GetParam();
  test::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(make_case(dir, bc));
  const auto r = test::run_cli("run --model " + (dir / "model") + " --input " + (dir / "input.safetensors") +
                               " --output " + (dir / "out.safetensors") + " --backend cpu");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(test::count_lines(r.out), 1) << r.out;
  EXPECT_EQ(r.out.rfind("moekit: error: ", 0), 0u) << r.out;
  check_message(r.out.substr(0, r.out.size() - (r.out.empty() ? 0 : 1)), bc);
  EXPECT_FALSE(fs::exists(dir / "out.safetensors"));
  EXPECT_TRUE(test::no_temp_files(dir.path()));
}

std::string case_name(const ::testing::TestParamInfo<BadCase>& info) {
  // "k > E" -> "k_gt_E", "topk_ids with an id >= E" -> "topk_ids_with_an_id_ge_E"
  std::string in = info.param.name, words;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in.compare(i, 2, ">=") == 0) {
      words += " ge ";
      ++i;
    } else if (in[i] == '>') {
      words += " gt ";
    } else if (in[i] == '<') {
      words += " lt ";
    } else {
      words += std::isalnum(static_cast<unsigned char>(in[i])) ? in[i] : ' ';
    }
  }
  std::string s;
  for (char c : words) {
    if (c != ' ') s += c;
    else if (!s.empty() && s.back() != '_') s += '_';
  }
  while (!s.empty() && s.back() == '_') s.pop_back();
  return s;
}

INSTANTIATE_TEST_SUITE_P(Moe, BadModel, ::testing::ValuesIn(bad_cases()), case_name);

// The good directories written by write_model_dir load back to the same weights and biases.
TEST(ModelDir, RoundTripOfEveryFormat) {
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8, WeightFormat::kBf16}) {
    for (bool split : {false, true}) {
      if (split && f != WeightFormat::kNvfp4) continue;
      SCOPED_TRACE(std::string(format_name(f)) + (split ? " split scale_2" : ""));
      test::TempDir dir;
      MoeConfig c = base_config(f);
      c.scoring = Scoring::kSigmoid;
      c.n_group = 2;
      c.topk_group = 1;
      c.routed_scaling_factor = 2.5f;
      c.act = Activation::kSiluClamped;
      c.swiglu_limit = 3.0f;
      SyntheticOptions opt;
      opt.seed = 5;
      opt.biases = true;
      opt.score_bias = true;
      opt.split_scale_2 = split;
      const MoeModel m = make_synthetic_model(c, opt);
      write_model_dir(m, dir / "model");
      const MoeModel l = MoeModel::load(dir / "model");
      EXPECT_EQ(l.cfg.num_experts, kE);
      EXPECT_EQ(l.cfg.top_k, kK);
      EXPECT_EQ(l.cfg.scoring, Scoring::kSigmoid);
      EXPECT_EQ(l.cfg.n_group, 2);
      EXPECT_EQ(l.cfg.routed_scaling_factor, 2.5f);
      EXPECT_EQ(l.cfg.act, Activation::kSiluClamped);
      EXPECT_EQ(l.cfg.swiglu_limit, 3.0f);
      EXPECT_EQ(l.cfg.format, f);
      EXPECT_EQ(l.b13, m.b13);
      EXPECT_EQ(l.b2, m.b2);
      EXPECT_EQ(l.score_bias, m.score_bias);
      std::vector<float> a(kH), b(kH);
      for (int e = 0; e < kE; ++e)
        for (int r = 0; r < 2 * kI; ++r) {
          m.w13.dequant_row(e, r, a.data());
          l.w13.dequant_row(e, r, b.data());
          ASSERT_EQ(a, b) << "w13 expert " << e << " row " << r;
        }
      std::vector<float> a2(kI), b2(kI);
      for (int e = 0; e < kE; ++e)
        for (int r = 0; r < kH; ++r) {
          m.w2.dequant_row(e, r, a2.data());
          l.w2.dequant_row(e, r, b2.data());
          ASSERT_EQ(a2, b2) << "w2 expert " << e << " row " << r;
        }
    }
  }
}

// Missing optional fields take the documented defaults.
TEST(ModelDir, ConfigDefaults) {
  test::TempDir dir;
  const MoeModel m = make_synthetic_model(base_config(WeightFormat::kMxfp4), {});
  write_model_dir(m, dir / "model");
  edit_config(dir / "model", [](json& j) {
    json q = {{"format", "mxfp4"}};
    j = json{{"num_experts", kE}, {"num_experts_per_tok", kK}, {"hidden_size", kH},
             {"intermediate_size", kI}, {"quantization", q}};
  });
  const MoeConfig c = load_config(dir / "model/config.json");
  EXPECT_EQ(c.act, Activation::kSilu);
  EXPECT_EQ(c.swiglu_alpha, 1.702f);
  EXPECT_EQ(c.swiglu_beta, 1.0f);
  EXPECT_EQ(c.swiglu_limit, 7.0f);
  EXPECT_EQ(c.scoring, Scoring::kSoftmax);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.routed_scaling_factor, 1.0f);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.scale_rule, ScaleRule::kFloor);
}

}  // namespace
}  // namespace moekit
