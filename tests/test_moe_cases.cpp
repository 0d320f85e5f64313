// The golden MoE layer cases (testdata/moe, made by an independent float64 implementation) run
// through `moekit run` on every CPU backend, plus the backend-selection surface of the CLI:
// --explain, `moekit backends`, $MOEKIT_BACKEND and unknown backend names.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <utility>

#include "moe_testutil.h"
#include "moekit/model/layer_io.h"
#include "moekit/model/model.h"
#include "moekit/oracle/oracle.h"
#include "testutil.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;
using test::ScopedEnv;

const char* const kCases[] = {"bypass_mxfp4_minus1", "dsv3_small_nvfp4",  "gptoss_h2880_mxfp4",
                              "gptoss_small_mxfp4",  "qwen_small_mxfp8", "tiny_bf16_clamped"};
const char* const kCpuBackends[] = {"cpu", "cpu_batched"};

std::string case_dir(const std::string& name) { return test::testdata("moe/" + name); }

std::string run_args(const std::string& dir, const std::string& out) {
  return "run --model " + dir + " --input " + dir + "/input.safetensors --output " + out;
}

struct CaseOutput {
  std::vector<uint16_t> y;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

class GoldenCase : public ::testing::TestWithParam<const char*> {};

TEST_P(GoldenCase, MatchesReferenceOnEveryCpuBackend) {
  const ScopedEnv no_env("MOEKIT_BACKEND", nullptr);
  const std::string dir = case_dir(GetParam());
  const auto exp = SafetensorsFile::open(dir + "/expected.safetensors");
  const TensorView& yref_t = exp.get("y_ref");
  ASSERT_EQ(yref_t.shape.size(), 2u);
  const int64_t T = yref_t.shape[0], H = yref_t.shape[1];
  const int64_t k = exp.get("topk_ids").shape.at(1);
  const auto y_ref = test::tensor_as<float>(exp, "y_ref", DType::kF32, {T, H});
  const auto ids_ref = test::tensor_as<int32_t>(exp, "topk_ids", DType::kI32, {T, k});
  const auto w_ref = test::tensor_as<float>(exp, "topk_weights", DType::kF32, {T, k});
  ASSERT_GT(test::l2(y_ref), 0.0);

  std::map<std::string, CaseOutput> outs;
  for (const char* backend : kCpuBackends) {
    SCOPED_TRACE(backend);
    test::TempDir tmp;
    const std::string out = tmp / "out.safetensors";
    const auto r = test::run_cli(run_args(dir, out) + " --backend " + backend);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(std::string("backend ") + backend + ","), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(std::to_string(T) + " tokens"), std::string::npos) << r.out;
    const auto f = SafetensorsFile::open(out);
    CaseOutput& o = outs[backend];
    o.y = test::tensor_as<uint16_t>(f, "y", DType::kBF16, {T, H});
    o.ids = test::tensor_as<int32_t>(f, "topk_ids", DType::kI32, {T, k});
    o.w = test::tensor_as<float>(f, "topk_weights", DType::kF32, {T, k});
    ASSERT_EQ(o.y.size(), size_t(T * H));
    ASSERT_EQ(o.ids.size(), size_t(T * k));

    const std::vector<float> y = test::bf16_to_floats(o.y);
    for (size_t i = 0; i < y.size(); ++i) ASSERT_TRUE(std::isfinite(y[i])) << "y[" << i << "]";
    const double err = test::rel_l2_err(y, y_ref);
    EXPECT_LE(err, 1e-2) << "rel. L2 error of y against y_ref";
    RecordProperty(std::string("rel_l2_") + backend, test::fmt_e(err));
    std::vector<float> ref_bf16(y_ref.size());
    for (size_t i = 0; i < y_ref.size(); ++i) ref_bf16[i] = round_bf16(y_ref[i]);
    const double err_rounded = test::rel_l2_err(y, ref_bf16);
    RecordProperty(std::string("rel_l2_rounded_") + backend, test::fmt_e(err_rounded));
    // The CPU backends follow the reference numerics (SPEC section 7) in fp32: y is y_ref's bf16
    // rounding but for rare one-ulp flips, far inside the 1e-2 any backend is allowed.
    EXPECT_LE(err_rounded, 1e-3) << "rel. L2 error of y against bf16(y_ref)";

    // Ids as sets per token; weights matched by id.
    for (int64_t t = 0; t < T; ++t) {
      std::vector<std::pair<int32_t, float>> got, want;
      for (int64_t j = 0; j < k; ++j) {
        got.push_back({o.ids[size_t(t * k + j)], o.w[size_t(t * k + j)]});
        want.push_back({ids_ref[size_t(t * k + j)], w_ref[size_t(t * k + j)]});
      }
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      for (int64_t j = 0; j < k; ++j) {
        ASSERT_EQ(got[size_t(j)].first, want[size_t(j)].first) << "token " << t << ": ids differ as sets";
        const float g = got[size_t(j)].second, wv = want[size_t(j)].second;
        EXPECT_LE(std::abs(g - wv), 1e-5f * std::abs(wv))
            << "token " << t << " expert " << want[size_t(j)].first << ": weight " << g << " vs " << wv;
      }
    }
    EXPECT_TRUE(test::no_temp_files(tmp.path()));
  }
  ASSERT_EQ(outs.size(), 2u);
  const auto& a = outs["cpu"].y;
  const auto& b = outs["cpu_batched"].y;
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 2), 0) << "cpu and cpu_batched y differ";
  EXPECT_EQ(outs["cpu"].ids, outs["cpu_batched"].ids);
  EXPECT_EQ(outs["cpu"].w, outs["cpu_batched"].w);
}

INSTANTIATE_TEST_SUITE_P(Moe, GoldenCase, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param); });

TEST(MoeCli, GoldenCasesAreAllPresent) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(test::testdata("moe"))) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(std::find_if(std::begin(kCases), std::end(kCases),
                             [&](const char* c) { return name == c; }) != std::end(kCases))
        << "case " << name << " is not covered";
    ++n;
  }
  EXPECT_EQ(n, int(std::size(kCases)));
}

// The oracle's own choice for a case (no request), computed in-process.
std::string oracle_choice(const std::string& dir, int64_t tokens) {
  const MoeModel m = MoeModel::load(dir);
  const Problem p = Problem::of(m, tokens);
  const Decision d = choose_backend(p, DeviceInfo::detect(), "");
  return d.chosen ? d.chosen->caps().name : "";
}

bool has_line_with(const std::string& text, const std::vector<std::string>& needles) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    bool all = true;
    for (const auto& n : needles) all = all && line.find(n) != std::string::npos;
    if (all) return true;
    pos = end + 1;
  }
  return false;
}

TEST(MoeCli, ExplainPrintsChoiceAndEveryBackend) {
  const ScopedEnv no_env("MOEKIT_BACKEND", nullptr);
  const std::string dir = case_dir("qwen_small_mxfp8");
  const std::string chosen = oracle_choice(dir, 16);
  ASSERT_FALSE(chosen.empty());
  test::TempDir tmp;
  auto r = test::run_cli(run_args(dir, tmp / "out.safetensors") + " --explain");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has_line_with(r.out, {"chosen:", chosen})) << r.out;
  EXPECT_TRUE(has_line_with(r.out, {"moekit run: backend " + chosen + ","})) << r.out;
  const auto& all = all_backends();
  ASSERT_GE(all.size(), 2u);
  const MoeModel m = MoeModel::load(dir);
  const Decision dec = choose_backend(Problem::of(m, 16), DeviceInfo::detect(), "");
  ASSERT_EQ(dec.rows.size(), all.size());
  for (const auto& row : dec.rows) {
    // One line per backend: its name and its verdict (with the reason when rejected).
    const std::string name = row.backend->caps().name;
    if (name == chosen)
      EXPECT_TRUE(has_line_with(r.out, {"* " + name + " ", "chosen"})) << name << "\n" << r.out;
    else if (row.support.ok)
      EXPECT_TRUE(has_line_with(r.out, {"  " + name + " ", "supported"})) << name << "\n" << r.out;
    else
      EXPECT_TRUE(has_line_with(r.out, {"  " + name + " ", "rejected: " + row.support.reason}))
          << name << "\n" << r.out;
  }
  // problem, device, chosen, a line per backend, the summary.
  EXPECT_EQ(test::count_lines(r.out), int(all.size()) + 4) << r.out;
  EXPECT_TRUE(fs::exists(tmp / "out.safetensors"));

  // An explicit request shows up as the reason.
  r = test::run_cli(run_args(dir, tmp / "out2.safetensors") + " --explain --backend cpu_batched");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has_line_with(r.out, {"chosen:", "cpu_batched", "--backend"})) << r.out;
  EXPECT_TRUE(has_line_with(r.out, {"* cpu_batched"})) << r.out;
  EXPECT_NE(r.out.find("moekit run: backend cpu_batched,"), std::string::npos) << r.out;

  // Without --explain only the summary line is printed.
  r = test::run_cli(run_args(dir, tmp / "out3.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(test::count_lines(r.out), 1) << r.out;
}

TEST(MoeCli, BackendsCommandNamesEveryBackend) {
  const ScopedEnv no_env("MOEKIT_BACKEND", nullptr);
  const std::string dir = case_dir("gptoss_small_mxfp4");
  const auto r = test::run_cli("backends --model " + dir + " --tokens 4");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const Backend* b : all_backends())
    EXPECT_NE(r.out.find(" " + b->caps().name + " "), std::string::npos) << b->caps().name << "\n" << r.out;
  EXPECT_NE(r.out.find("4 tokens"), std::string::npos) << r.out;
  EXPECT_TRUE(has_line_with(r.out, {"chosen:", oracle_choice(dir, 4)})) << r.out;
  EXPECT_NE(r.out.find("mxfp4"), std::string::npos) << r.out;

  // Without a model: the capabilities of each backend.
  const auto r2 = test::run_cli("backends");
  ASSERT_EQ(r2.code, 0) << r2.out;
  for (const Backend* b : all_backends())
    EXPECT_NE(r2.out.find(b->caps().name), std::string::npos) << r2.out;
}

TEST(MoeCli, EnvironmentSelectsBackend) {
  const std::string dir = case_dir("tiny_bf16_clamped");
  test::TempDir tmp;
  {
    const ScopedEnv env("MOEKIT_BACKEND", "cpu_batched");
    auto r = test::run_cli(run_args(dir, tmp / "a.safetensors"));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("moekit run: backend cpu_batched,"), std::string::npos) << r.out;
    // --explain says where the request came from.
    r = test::run_cli(run_args(dir, tmp / "b.safetensors") + " --explain");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(has_line_with(r.out, {"chosen:", "cpu_batched", "MOEKIT_BACKEND"})) << r.out;
    // The command-line flag wins over the environment.
    r = test::run_cli(run_args(dir, tmp / "c.safetensors") + " --backend cpu");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("moekit run: backend cpu,"), std::string::npos) << r.out;
  }
  {
    const ScopedEnv env("MOEKIT_BACKEND", "cpu");
    const auto r = test::run_cli(run_args(dir, tmp / "d.safetensors"));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("moekit run: backend cpu,"), std::string::npos) << r.out;
  }
  {
    const ScopedEnv env("MOEKIT_BACKEND", "warp_drive");
    const auto r = test::run_cli(run_args(dir, tmp / "e.safetensors"));
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_EQ(test::count_lines(r.out), 1) << r.out;
    EXPECT_NE(r.out.find("warp_drive"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("MOEKIT_BACKEND"), std::string::npos) << r.out;
    EXPECT_FALSE(fs::exists(tmp / "e.safetensors"));
  }
}

TEST(MoeCli, UnknownBackendFailsWithOneLine) {
  const ScopedEnv no_env("MOEKIT_BACKEND", nullptr);
  const std::string dir = case_dir("qwen_small_mxfp8");
  test::TempDir tmp;
  const auto r = test::run_cli(run_args(dir, tmp / "out.safetensors") + " --backend nosuch");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(test::count_lines(r.out), 1) << r.out;
  EXPECT_NE(r.out.find("nosuch"), std::string::npos) << r.out;
  for (const Backend* b : all_backends())
    EXPECT_NE(r.out.find(b->caps().name), std::string::npos) << b->caps().name << "\n" << r.out;
  EXPECT_FALSE(fs::exists(tmp / "out.safetensors"));
  EXPECT_TRUE(test::no_temp_files(tmp.path()));
}

TEST(MoeCli, UnwritableOutputFailsWithOneLine) {
  const std::string dir = case_dir("tiny_bf16_clamped");
  const auto r = test::run_cli(run_args(dir, "/nonexistent-moekit-dir/out.safetensors"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(test::count_lines(r.out), 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent-moekit-dir/out.safetensors"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace moekit
