// Layer conversion (model/convert.h) and `moekit convert` / `moekit run --convert`: the same
// format copies bytes; another format is quantized from the exact values and its reported rel. L2
// error is the error of the weights it wrote; converted layer directories load back with their
// router and run from hidden_states alone; bad option combinations are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "hf_testutil.h"
#include "moe_testutil.h"
#include "st_edit.h"
#include "moekit/api/host_runner.h"
#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/experts/reference.h"
#include "moekit/formats/quantize.h"
#include "moekit/model/convert.h"
#include "moekit/model/layer_io.h"
#include "testutil.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;

constexpr int kDsFp8 = 1, kQwenBf16 = 4, kQwenNvfp4 = 6, kGptOss = 0;

// ||converted - exact|| / ||exact|| over both matrices, from the weights themselves.
double weight_error(const LayerWeights& got, const LayerWeights& exact) {
  double a = 0, b = 0;
  for (const auto& [g, x] : {std::pair{&got.w13, &exact.w13}, std::pair{&got.w2, &exact.w2}}) {
    std::vector<float> rg(size_t(x->K)), rx(size_t(x->K));
    for (int64_t e = 0; e < x->E; ++e)
      for (int64_t r = 0; r < x->N; ++r) {
        g->dequant_row(e, r, rg.data());
        x->dequant_row(e, r, rx.data());
        for (int64_t k = 0; k < x->K; ++k) {
          a += (double(rg[size_t(k)]) - rx[size_t(k)]) * (double(rg[size_t(k)]) - rx[size_t(k)]);
          b += double(rx[size_t(k)]) * rx[size_t(k)];
        }
      }
  }
  return std::sqrt(a / b);
}

std::string hidden_states(const std::string& path, const MoeConfig& cfg, int64_t T) {
  const LayerInputData in = make_synthetic_input(cfg, T, 4);
  SafetensorsWriter w;
  w.add("hidden_states", DType::kBF16, {T, int64_t(cfg.hidden)}, in.x);
  w.write(path);
  return path;
}

LayerOutput run_cpu(const MoeModel& m, const std::string& input) {
  const LayerInputData in = load_layer_input(input, m.cfg, &m.router);
  LayerOutput out;
  HostRunner(m, "cpu").run(in.view(), &out);
  return out;
}

TEST(Convert, SameFormatCopiesTheBytes) {
  for (int c : {kDsFp8, kQwenNvfp4, kGptOss}) {
    const auto ck = test::build_hf_checkpoint(test::hf_cases()[size_t(c)]);
    SCOPED_TRACE(ck->c.name);
    const MoeModel src = MoeModel::load(ck->path());
    ConvertReport rep;
    const MoeModel dst = convert_layer(src, src.cfg.format, ScaleRule::kFloor, &rep);
    EXPECT_TRUE(rep.copied);
    EXPECT_EQ(rep.err, 0.0);
    test::expect_same_weights(dst, src);
    EXPECT_EQ(dst.router.weight, src.router.weight);
  }
}

TEST(Convert, ReportedErrorIsTheErrorOfTheWrittenWeights) {
  struct Step {
    int c;
    WeightFormat to;
    ScaleRule rule;
    double lo, hi;  // the rel. L2 error a format of that many bits gives on Gaussian-like weights
  };
  for (const Step& s : {Step{kDsFp8, WeightFormat::kBf16, ScaleRule::kFloor, 1e-4, 4e-3},
                        Step{kDsFp8, WeightFormat::kMxfp8, ScaleRule::kRceil, 5e-3, 6e-2},
                        Step{kQwenBf16, WeightFormat::kMxfp4, ScaleRule::kFloor, 3e-2, 0.3},
                        Step{kQwenBf16, WeightFormat::kMxfp4, ScaleRule::kRceil, 3e-2, 0.3},
                        Step{kQwenBf16, WeightFormat::kNvfp4, ScaleRule::kFloor, 3e-2, 0.2},
                        Step{kGptOss, WeightFormat::kBf16, ScaleRule::kFloor, 0.0, 0.0}}) {
    const auto ck = test::build_hf_checkpoint(test::hf_cases()[size_t(s.c)]);
    const MoeModel src = MoeModel::load(ck->path());
    SCOPED_TRACE(std::string(ck->c.name) + " -> " + format_name(s.to));
    ConvertReport rep;
    int64_t last = 0;
    const MoeModel dst = convert_layer(src, s.to, s.rule, &rep, [&](int64_t done, int64_t total) {
      EXPECT_GT(done, last);
      EXPECT_EQ(total, src.cfg.num_experts);
      last = done;
    });
    EXPECT_EQ(last, src.cfg.num_experts);
    EXPECT_FALSE(rep.copied);
    EXPECT_EQ(dst.cfg.format, s.to);
    const double err = weight_error(dst, src);
    EXPECT_NEAR(rep.err, err, 1e-9 + 1e-6 * err);
    EXPECT_GE(rep.err, s.lo);
    EXPECT_LE(rep.err, s.hi);
    RecordProperty(std::string(ck->c.name) + "_to_" + format_name(s.to) + (s.rule == ScaleRule::kRceil ? "_rceil" : ""),
                   test::fmt_e(rep.err));
    // The quantizer's own result, expert by expert (formats/quantize.h) for the block formats.
    if (s.to != WeightFormat::kBf16) {
      std::vector<float> x(size_t(src.w2.N * src.w2.K));
      for (int64_t r = 0; r < src.w2.N; ++r) src.w2.dequant_row(1, r, x.data() + r * src.w2.K);
      const QuantizedTensor q = quantize_tensor(x.data(), src.w2.N, src.w2.K, s.to, s.rule, "w2");
      EXPECT_EQ(0, std::memcmp(q.codes.data(), dst.w2.row_codes(1, 0), q.codes.size()));
      EXPECT_EQ(0, std::memcmp(q.scales.data(), dst.w2.row_scales(1, 0), q.scales.size()));
    } else {
      std::vector<float> x(size_t(src.w13.K));
      src.w13.dequant_row(3, 5, x.data());
      for (int64_t k = 0; k < src.w13.K; ++k)
        EXPECT_EQ(float_to_bf16(x[size_t(k)]), uint16_t(dst.w13.row_codes(3, 5)[2 * k] | dst.w13.row_codes(3, 5)[2 * k + 1] << 8));
    }
    // Written and read back: the same weights, the router along.
    write_layer_dir(dst, ck->dir / "out");
    const MoeModel back = MoeModel::load(ck->dir / "out");
    test::expect_same_weights(back, dst);
    EXPECT_EQ(back.router.weight, src.router.weight);
    EXPECT_EQ(back.router.bias, src.router.bias);
    // And it runs from hidden_states alone, close to the exact layer.
    const std::string x = hidden_states(ck->dir / "x.safetensors", src.cfg, 11);
    const LayerOutput exact = run_cpu(src, x), conv = run_cpu(back, x);
    if (rep.err == 0) {
      EXPECT_EQ(conv.y, exact.y);
    } else if (s.to == WeightFormat::kBf16) {
      EXPECT_LE(test::rel_l2_err(test::bf16_to_floats(conv.y), test::bf16_to_floats(exact.y)), 1e-2);
    }
  }
}

TEST(Convert, FormatsTheLayerCannotTakeAreRefused) {
  const auto ck = test::build_hf_checkpoint(test::hf_cases()[kQwenBf16]);
  const MoeModel src = MoeModel::load(ck->path());
  EXPECT_THROW(convert_layer(src, WeightFormat::kFp8, ScaleRule::kFloor, nullptr), Error);
  test::HfCase c = test::hf_cases()[kQwenBf16];
  c.I = 80;  // not a multiple of the MX block
  const auto odd = test::build_hf_checkpoint(c);
  try {
    convert_layer(MoeModel::load(odd->path()), WeightFormat::kMxfp4, ScaleRule::kFloor, nullptr);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("intermediate_size 80 is not a multiple of the mxfp4 block"), std::string::npos)
        << e.what();
  }
}

TEST(ConvertCli, OneLayerToBf16RunsFromHiddenStates) {
  const auto ck = test::build_hf_checkpoint(test::hf_cases()[kDsFp8]);
  const std::string out = ck->dir / "l2";
  const test::RunResult r = test::run_cli("convert --model " + ck->path() + " --layer 2 --to bf16 --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("layer 2: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fp8 -> bf16: rel. L2 error of the weights"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("shared experts"), std::string::npos) << r.out;
  const MoeModel conv = MoeModel::load(out), src = MoeModel::load(ck->path(), 2);
  EXPECT_EQ(conv.cfg.format, WeightFormat::kBf16);
  EXPECT_EQ(conv.cfg.scoring, Scoring::kSigmoid);
  EXPECT_EQ(conv.score_bias, src.score_bias);
  const std::string x = hidden_states(ck->dir / "x.safetensors", src.cfg, 6);
  const test::RunResult run = test::run_cli("run --model " + out + " --input " + x + " --output " + (ck->dir / "y.safetensors"));
  EXPECT_EQ(run.code, 0) << run.out;
  // run --convert does the same in memory, and says so.
  const test::RunResult rc = test::run_cli("run --model " + ck->path() + " --layer 2 --convert bf16 --backend cpu --input " + x +
                                           " --output " + (ck->dir / "y2.safetensors"));
  EXPECT_EQ(rc.code, 0) << rc.out;
  EXPECT_NE(rc.out.find("convert: fp8 -> bf16: rel. L2 error"), std::string::npos) << rc.out;
  const auto y1 = SafetensorsFile::open(ck->dir / "y.safetensors"), y2 = SafetensorsFile::open(ck->dir / "y2.safetensors");
  EXPECT_EQ(test::tensor_as<uint16_t>(y1, "y", DType::kBF16, {6, src.cfg.hidden}),
            test::tensor_as<uint16_t>(y2, "y", DType::kBF16, {6, src.cfg.hidden}));
}

TEST(ConvertCli, AllLayersKeepTheirBytes) {
  const auto ck = test::build_hf_checkpoint(test::hf_cases()[kQwenBf16]);
  const test::RunResult r = test::run_cli("convert --model " + ck->path() + " --all --out " + (ck->dir / "all"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("3 layers"), std::string::npos) << r.out;
  for (int l = 0; l < 3; ++l) {
    SCOPED_TRACE(l);
    const MoeModel m = MoeModel::load(ck->dir / ("all/layer_" + std::to_string(l)));
    test::expect_same_weights(m, ck->layers[size_t(l)]);
    EXPECT_EQ(m.router.weight, ck->routers[size_t(l)].weight);
  }
  EXPECT_NE(r.out.find("the checkpoint's bytes, unchanged"), std::string::npos) << r.out;
}

TEST(ConvertCli, BadOptionsAndOutputs) {
  const auto ck = test::build_hf_checkpoint(test::hf_cases()[kQwenBf16]);
  const std::string m = " --model " + ck->path();
  struct Bad {
    std::string args;
    int code;
    const char* needle;
  };
  for (const Bad& b : {Bad{m + " --layer 1 --all --out x", 2, "excludes"},
                       Bad{m + " --to fp8 --out x", 2, "--to"},
                       Bad{m + " --layer 9 --out " + (ck->dir / "o"), 1, "layer 9 is out of range"},
                       Bad{m + " --out " + ck->path(), 1, "refusing to overwrite an input"}}) {
    SCOPED_TRACE(b.args);
    const test::RunResult r = test::run_cli("convert" + b.args);
    EXPECT_EQ(r.code, b.code) << r.out;
    EXPECT_EQ(test::count_lines(r.out), 1) << r.out;
    EXPECT_NE(r.out.find(b.needle), std::string::npos) << r.out;
  }
  test::TempDir d;
  test::write_small_layer(d / "model", d / "x.safetensors", WeightFormat::kMxfp4, false);
  const test::RunResult r = test::run_cli("convert --model " + (d / "model") + " --all --out " + (d / "o"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("--all converts the MoE layers of a Hugging Face checkpoint"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace moekit
