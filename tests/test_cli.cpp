// The `quantize` / `dequantize` commands: golden vectors reproduced from x through the CLI, and
// bad input ending in a non-zero exit, one line naming the problem, and no output file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "moekit/common/bf16.h"
#include "moekit/formats/quantize.h"
#include "moekit/io/safetensors.h"
#include "testutil.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;

// Writes {x: the golden x} into dir/in.safetensors.
std::string golden_x(const test::TempDir& dir, const SafetensorsFile& g) {
  SafetensorsWriter w;
  const TensorView& x = g.get("x");
  w.add("x", x.dtype, x.shape, x.data, x.nbytes);
  w.write(dir / "in.safetensors");
  return dir / "in.safetensors";
}

void expect_same_bytes(const TensorView& a, const TensorView& b) {
  ASSERT_EQ(a.shape, b.shape) << a.name << " vs " << b.name;
  ASSERT_EQ(a.nbytes, b.nbytes);
  EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes), 0) << a.name << " vs " << b.name;
}

TEST(Cli, QuantizeReproducesEveryGoldenFile) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(test::testdata("formats"))) {
    const std::string name = e.path().filename().string();
    if (name.find("decode_tables") != std::string::npos) continue;
    SCOPED_TRACE(name);
    test::TempDir dir;
    const auto g = SafetensorsFile::open(e.path().string());
    const std::string fmt = format_name(parse_format(g.metadata().at("format")));
    std::string args = "quantize --format " + fmt + " ";
    if (fmt != "nvfp4") args += "--scale-rule " + g.metadata().at("scale_rule") + " ";
    const auto r = test::run_cli(args + golden_x(dir, g) + " " + (dir / "q.safetensors"));
    ASSERT_EQ(r.code, 0) << r.out;
    const auto q = SafetensorsFile::open(dir / "q.safetensors");
    EXPECT_EQ(q.metadata().at("format"), fmt);
    if (fmt == "mxfp4") {
      expect_same_bytes(q.get("x_blocks"), g.get("q_blocks"));
      expect_same_bytes(q.get("x_scales"), g.get("q_scales"));
    } else {
      expect_same_bytes(q.get("x"), g.get("q"));
      expect_same_bytes(q.get("x_scale"), g.get("q_scale"));
      if (fmt == "nvfp4") {
        EXPECT_EQ(q.get("x_scale_2").shape, std::vector<int64_t>{});
        EXPECT_EQ(std::memcmp(q.get("x_scale_2").data, g.get("q_scale_2").data, 4), 0);
        EXPECT_EQ(q.get("x_scale").dtype, DType::kF8E4M3);
      } else {
        EXPECT_EQ(q.get("x").dtype, DType::kF8E4M3);
      }
    }
    // dequantize gives dq bit for bit.
    const auto r2 = test::run_cli("dequantize " + (dir / "q.safetensors") + " " + (dir / "d.safetensors"));
    ASSERT_EQ(r2.code, 0) << r2.out;
    const auto d = SafetensorsFile::open(dir / "d.safetensors");
    EXPECT_EQ(d.get("x").dtype, DType::kF32);
    expect_same_bytes(d.get("x"), g.get("dq"));
    ++n;
  }
  EXPECT_EQ(n, 20);
}

TEST(Cli, OtherTensorsPassThroughAndBf16Input) {
  test::TempDir dir;
  SafetensorsWriter w;
  std::vector<uint16_t> xb(2 * 64);
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = float_to_bf16(float(int(i % 13) - 6) * 0.37f);
  w.add("w", DType::kBF16, {2, 64}, xb);
  w.add("ids", DType::kI32, {3}, std::vector<int32_t>{1, 2, 3});
  w.write(dir / "in.safetensors");
  for (const char* fmt : {"mxfp4", "mxfp8", "nvfp4"}) {
    SCOPED_TRACE(fmt);
    auto r = test::run_cli(std::string("quantize --format ") + fmt + " " + (dir / "in.safetensors") + " " +
                           (dir / "q.safetensors"));
    ASSERT_EQ(r.code, 0) << r.out;
    r = test::run_cli("dequantize " + (dir / "q.safetensors") + " " + (dir / "d.safetensors"));
    ASSERT_EQ(r.code, 0) << r.out;
    const auto d = SafetensorsFile::open(dir / "d.safetensors");
    EXPECT_EQ(d.get("ids").dtype, DType::kI32);
    const auto y = to_float(d.get("w"), "");
    ASSERT_EQ(y.size(), xb.size());
    double num = 0, den = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      const double x = bf16_to_float(xb[i]);
      num += (y[i] - x) * (y[i] - x);
      den += x * x;
    }
    EXPECT_LT(std::sqrt(num / den), 0.2);
    EXPECT_GT(den, 0.0);
  }
}

TEST(Cli, HelpDescribesTheLayouts) {
  auto r = test::run_cli("quantize --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("NAME_blocks"), std::string::npos);
  EXPECT_NE(r.out.find("--scale-rule"), std::string::npos);
  r = test::run_cli("dequantize --help");
  EXPECT_EQ(r.code, 0);
  r = test::run_cli("--help");
  EXPECT_EQ(r.code, 0);
}

struct BadCase {
  const char* name;
  std::function<std::string(const test::TempDir&)> make;  // returns the args after `moekit`
  const char* needle;
};

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

std::string valid_input(const test::TempDir& dir, std::vector<float> x, std::vector<int64_t> shape) {
  SafetensorsWriter w;
  w.add("weight", DType::kF32, std::move(shape), x);
  w.write(dir / "in.safetensors");
  return dir / "in.safetensors";
}

TEST(Cli, BadInputFailsCleanly) {
  const std::vector<BadCase> cases = {
      {"missing file", [](const test::TempDir& d) { return "quantize --format mxfp4 " + (d / "none.st") + " " + (d / "out.st"); },
       "cannot open"},
      {"truncated file",
       [](const test::TempDir& d) {
         valid_input(d, std::vector<float>(64, 1.0f), {2, 32});
         std::ifstream in(d / "in.safetensors", std::ios::binary);
         std::string s((std::istreambuf_iterator<char>(in)), {});
         write_raw(d / "trunc.st", s.substr(0, s.size() - 9));
         return "quantize --format mxfp4 " + (d / "trunc.st") + " " + (d / "out.st");
       },
       "out of range"},
      {"corrupt header",
       [](const test::TempDir& d) {
         write_raw(d / "bad.st", std::string("\x10\0\0\0\0\0\0\0{\"x\": nonsense}", 24));
         return "dequantize " + (d / "bad.st") + " " + (d / "out.st");
       },
       "not valid JSON"},
      {"unknown dtype",
       [](const test::TempDir& d) {
         const std::string h = R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})";
         std::string s(8, '\0');
         s[0] = char(h.size());
         write_raw(d / "bad.st", s + h + "x");
         return "quantize --format nvfp4 " + (d / "bad.st") + " " + (d / "out.st");
       },
       "unknown dtype 'F4'"},
      {"K not a multiple of the block",
       [](const test::TempDir& d) {
         return "quantize --format mxfp4 " + valid_input(d, std::vector<float>(48, 1.0f), {2, 24}) + " " + (d / "out.st");
       },
       "not a multiple of the mxfp4 block (32)"},
      {"NaN",
       [](const test::TempDir& d) {
         std::vector<float> x(64, 0.5f);
         x[40] = NAN;
         return "quantize --format mxfp8 " + valid_input(d, x, {2, 32}) + " " + (d / "out.st");
       },
       "cannot quantize NaN at row 1, column 8"},
      {"Inf",
       [](const test::TempDir& d) {
         std::vector<float> x(64, 0.5f);
         x[3] = -INFINITY;
         return "quantize --format nvfp4 " + valid_input(d, x, {4, 16}) + " " + (d / "out.st");
       },
       "cannot quantize Inf"},
      {"output not writable",
       [](const test::TempDir& d) {
         return "quantize --format mxfp4 " + valid_input(d, std::vector<float>(64, 1.0f), {2, 32}) +
                " /nonexistent-dir/out.st";
       },
       "cannot write"},
      {"unknown format", [](const test::TempDir& d) { return "quantize --format int4 " + (d / "a") + " " + (d / "out.st"); },
       "int4"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    test::TempDir dir;
    const std::string args = c.make(dir);
    const auto r = test::run_cli(args);
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(c.needle), std::string::npos) << r.out;
    EXPECT_EQ(test::count_lines(r.out), 1) << r.out;
    EXPECT_FALSE(fs::exists(dir / "out.st"));
    for (const auto& e : fs::directory_iterator(dir.path()))
      EXPECT_EQ(e.path().string().find(".tmp-"), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace moekit
