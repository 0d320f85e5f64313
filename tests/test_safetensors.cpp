// safetensors: round trips and every kind of malformed file, each rejected with a message
// that names the file, before any data is touched.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "moekit/common/error.h"
#include "moekit/io/safetensors.h"
#include "testutil.h"

namespace moekit {
namespace {

std::string raw_file(const std::string& header, size_t data_bytes) {
  std::string s(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char((n >> (8 * i)) & 0xff);
  s += header;
  s.append(data_bytes, '\x01');
  return s;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

// Parses `bytes` and expects an Error whose message contains `needle`.
void expect_reject(const std::string& bytes, const std::string& needle) {
  std::vector<TensorView> t;
  std::map<std::string, std::string> m;
  try {
    parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "f.st", &t, &m);
    ADD_FAILURE() << "accepted; expected: " << needle;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_EQ(msg.rfind("f.st", 0), 0u) << "message must start with the file: " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
  }
}

TEST(Safetensors, RoundTripEveryDtype) {
  test::TempDir dir;
  SafetensorsWriter w;
  const DType all[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3,
                       DType::kF8E5M2, DType::kI64, DType::kI32, DType::kI16, DType::kI8,
                       DType::kU64, DType::kU32, DType::kU16, DType::kU8, DType::kBool};
  std::vector<std::vector<uint8_t>> payloads;
  for (DType d : all) {
    std::vector<uint8_t> p(3 * 5 * dtype_size(d));
    for (size_t i = 0; i < p.size(); ++i) p[i] = uint8_t(i * 7 + dtype_size(d));
    w.add(std::string("t_") + dtype_name(d), d, {3, 5}, p.data(), p.size());
    payloads.push_back(p);
  }
  w.add("scalar", DType::kF32, {}, std::vector<float>{2.5f});
  w.add("empty", DType::kU8, {0, 4}, nullptr, 0);
  w.set_metadata("format", "mxfp4");
  w.write(dir / "a.safetensors");

  const auto f = SafetensorsFile::open(dir / "a.safetensors");
  EXPECT_EQ(f.metadata().at("format"), "mxfp4");
  for (size_t i = 0; i < std::size(all); ++i) {
    const TensorView& t = f.get(std::string("t_") + dtype_name(all[i]));
    EXPECT_EQ(t.dtype, all[i]);
    EXPECT_EQ(t.shape, (std::vector<int64_t>{3, 5}));
    ASSERT_EQ(t.nbytes, payloads[i].size());
    EXPECT_EQ(std::memcmp(t.data, payloads[i].data(), t.nbytes), 0);
  }
  EXPECT_EQ(to_float(f.get("scalar"), "")[0], 2.5f);
  EXPECT_EQ(f.get("empty").numel(), 0);
  EXPECT_THROW(f.get("missing"), Error);
  // No temporary file left beside the output.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) { (void)e; ++files; }
  EXPECT_EQ(files, 1);
}

TEST(Safetensors, ReadsGoldenFiles) {
  const auto f = SafetensorsFile::open(test::testdata("moe/dsv3_small_nvfp4/experts.safetensors"));
  EXPECT_EQ(f.get("w13_weight_scale").dtype, DType::kF8E4M3);
  EXPECT_EQ(f.get("w13_weight").shape, (std::vector<int64_t>{16, 256, 128}));
}

TEST(Safetensors, RejectsTruncatedAndCorrupt) {
  const std::string good_header = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  expect_reject(std::string(5, '\0'), "truncated");
  expect_reject(raw_file(good_header, 16).substr(0, 30), "truncated");
  std::string huge = raw_file(good_header, 16);
  huge[7] = '\x7f';
  expect_reject(huge, "corrupt safetensors header length");
  expect_reject(raw_file("{\"a\": [1, 2", 0), "not valid JSON");
  expect_reject(raw_file("[1,2,3]", 0), "not a JSON object");
  expect_reject(raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 12),
                "out of range");
  expect_reject(raw_file(R"({"a":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,2]}})", 2),
                "unknown dtype 'Q4_K'");
  expect_reject(raw_file(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", 16),
                "needs 24 bytes");
  expect_reject(raw_file(R"({"a":{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}})", 16),
                "non-negative");
  expect_reject(raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}})", 16),
                "out of range");
  expect_reject(raw_file(R"({"a":{"dtype":"F32","shape":[2,2]}})", 16), "data_offsets");
  expect_reject(raw_file(R"({"a":{"shape":[2,2],"data_offsets":[0,16]}})", 16), "dtype");
  expect_reject(
      raw_file(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", 16),
      "overflows");
  expect_reject(raw_file(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})", 12),
                "overlap");
  expect_reject(raw_file(R"({"__metadata__":{"k":1}})", 0), "not a string");
}

// A tensor of zero bytes occupies nothing: at another tensor's offset (start or inside) it is
// valid, and it reads back empty.
TEST(Safetensors, ZeroSizeTensorsMaySitAnywhere) {
  const std::string bytes = raw_file(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                                     R"("e0":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},)"
                                     R"("e4":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},)"
                                     R"("e8":{"dtype":"U8","shape":[0],"data_offsets":[8,8]}})", 8);
  std::vector<TensorView> t;
  std::map<std::string, std::string> m;
  ASSERT_NO_THROW(parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "f.st", &t, &m));
  ASSERT_EQ(t.size(), 4u);
  for (const auto& v : t) EXPECT_EQ(v.nbytes, v.name == "a" ? 8u : 0u) << v.name;
}

// A FIFO, a device or a directory is refused before any read: the open never blocks.
TEST(Safetensors, NonRegularFilesAreRefusedWithoutBlocking) {
  test::TempDir dir;
  ASSERT_EQ(mkfifo((dir / "fifo").c_str(), 0600), 0);
  for (const std::string& p : {dir / "fifo", std::string("/dev/zero"), dir.path()}) {
    try {
      SafetensorsFile::open(p);
      ADD_FAILURE() << p << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
    }
  }
}

TEST(Safetensors, OpenNamesTheFile) {
  test::TempDir dir;
  write_bytes(dir / "t.safetensors", raw_file("{\"a\":", 0));
  try {
    SafetensorsFile::open(dir / "t.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir / "t.safetensors"), std::string::npos);
  }
  EXPECT_THROW(SafetensorsFile::open(dir / "absent.safetensors"), Error);
  EXPECT_THROW(SafetensorsFile::open(dir.path()), Error);  // a directory
}

TEST(Safetensors, UnwritablePathLeavesNothing) {
  SafetensorsWriter w;
  w.add("a", DType::kF32, {1}, std::vector<float>{1.0f});
  EXPECT_THROW(w.write("/nonexistent-dir/x.safetensors"), Error);
  test::TempDir dir;
  std::filesystem::create_directory(dir / "sub");
  EXPECT_THROW(w.write(dir / "sub"), Error);  // a directory where the file should go
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir / "sub")) { (void)e; ++files; }
  EXPECT_EQ(files, 0);
}

}  // namespace
}  // namespace moekit
