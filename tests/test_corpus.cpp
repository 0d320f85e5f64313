// The bad-input corpus: one table of cases in seven families (container, config, weights, inputs,
// cli, output, sizes), each run through the `moekit` binary. A case builds a good model directory
// (config.json + experts.safetensors) and input in a fresh temporary directory, damages one thing
// (or builds one bad command line), runs the command, and checks:
//   - it ends (under a 60 s limit: a hang fails the case, it does not stall the run);
//   - the exit code: 1 bad input, 2 usage error (docs/USAGE.md), 0 for the valid edge cases kept as
//     controls (zero tokens, repeated -1 ids, scores that all underflow, ...);
//   - stderr is one line "moekit: error: ..." that names the file, tensor, field or option
//     (the case's needles), and stdout is empty;
//   - nothing in the directory changed: no output file, no temporary leftover, every file there
//     before (inputs, model, FIFOs, links, a pre-existing output) exactly as it was.
// Every case runs twice: with no output file, and with a pre-existing output that must survive.
//
// The backend is the binary's choice, or $MOEKIT_BACKEND, which the command inherits: on an H100
//   MOEKIT_BACKEND=sm90_decode build/tests/moekit_tests --gtest_filter='Corpus/*'
// (or `scripts/gpu_check.sh corpus` after scripts/device_prep.sh) runs the same cases through an
// SM90 backend, and they must give the same exit codes and messages (the checks run before any
// backend does).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moekit/common/bf16.h"
#include "moekit/common/checked.h"
#include "moekit/io/quantize_file.h"
#include "moekit/model/layer_io.h"
#include "moe_testutil.h"
#include "moekit/model/synthetic.h"
#include "st_edit.h"
#include "testutil.h"

namespace moekit {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::Tensor;
using Args = std::vector<std::string>;

constexpr int kE = test::kSmallE, kK = test::kSmallK, kH = test::kSmallH, kT = test::kSmallT;
constexpr int kTimeoutSeconds = 60;

// ---- running the binary ------------------------------------------------------------------------

struct CmdResult {
  int code = -1;
  bool timed_out = false;
  std::string out, err;
};

// Runs moekit ARGS with stdout and stderr captured apart, killed after kTimeoutSeconds. With
// fsize_zero, the command may not write a single byte to a file (RLIMIT_FSIZE 0): every write
// of an output fails.
CmdResult run_moekit(const Args& args, bool fsize_zero) {
  std::vector<std::string> all = {test::moekit_bin()};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  int po[2], pe[2];
  CmdResult r;
  if (pipe2(po, O_CLOEXEC) != 0 || pipe2(pe, O_CLOEXEC) != 0) return r;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(po[1], 1);
    dup2(pe[1], 2);
    if (fsize_zero) {
      const struct rlimit lim = {0, 0};
      setrlimit(RLIMIT_FSIZE, &lim);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(po[1]);
  close(pe[1]);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kTimeoutSeconds);
  struct pollfd fds[2] = {{po[0], POLLIN, 0}, {pe[0], POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  while (open_fds > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    if (poll(fds, 2, int(left.count())) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      const ssize_t n = read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        sinks[i]->append(buf, size_t(n));
      } else {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (auto& f : fds)
    if (f.fd >= 0) close(f.fd);
  int st = 0;
  waitpid(pid, &st, 0);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  return r;
}

// ---- the state of a directory ------------------------------------------------------------------

// Path -> what it is and holds: file contents (size and mtime for files over 64 MiB: the sparse
// files of the size cases), link targets, or the kind of special file. Never opens a FIFO.
std::map<std::string, std::string> snapshot(const std::string& root) {
  std::map<std::string, std::string> s;
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::skip_permission_denied);
       it != fs::recursive_directory_iterator(); ++it) {
    const std::string p = it->path().string();
    struct stat st;
    if (lstat(p.c_str(), &st) != 0) continue;
    if (S_ISREG(st.st_mode)) {
      if (st.st_size > (64 << 20)) {
        s[p] = "big file " + std::to_string(st.st_size) + " " + std::to_string(st.st_mtim.tv_sec) + "." +
               std::to_string(st.st_mtim.tv_nsec);
      } else {
        std::ifstream in(p, std::ios::binary);
        s[p] = "file " + std::string(std::istreambuf_iterator<char>(in), {});
      }
    } else if (S_ISLNK(st.st_mode)) {
      s[p] = "link " + fs::read_symlink(p).string();
    } else {
      s[p] = "mode " + std::to_string(st.st_mode) + " rdev " + std::to_string(st.st_rdev);
    }
  }
  return s;
}

std::string describe_diff(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  std::string d;
  for (const auto& [p, v] : a) {
    auto it = b.find(p);
    if (it == b.end()) d += " removed " + p + ";";
    else if (it->second != v) d += " changed " + p + ";";
  }
  for (const auto& [p, v] : b)
    if (!a.count(p)) d += " created " + p + ";";
  return d;
}

// ---- the fixture: a good model and input in a temporary directory -----------------------------

struct Skip {
  std::string why;
};

struct Fx {
  test::TempDir tmp;
  std::string model = tmp / "model", input = tmp / "input.safetensors", out = tmp / "out.safetensors";

  std::string p(const std::string& name) const { return tmp / name; }
  std::string config() const { return model + "/config.json"; }
  std::string experts() const { return model + "/experts.safetensors"; }
  Args run() const { return {"run", "--model", model, "--input", input, "--output", out}; }
  Args bench(std::vector<std::string> extra) const {
    Args a = {"bench", "--shape", "4,2,64,64", "--format", "bf16", "--tokens", "1", "--reps", "1"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  // A small F32 tensor file for quantize, and its mxfp4 quantization for dequantize.
  std::string quant_in() const {
    SafetensorsWriter w;
    std::vector<float> x(4 * 64);
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 11) - 5) * 0.25f;
    w.add("w", DType::kF32, {4, 64}, x);
    w.write(p("q_in.safetensors"));
    return p("q_in.safetensors");
  }
  std::string quantized() const {
    quantize_file(quant_in(), p("q.safetensors"), WeightFormat::kMxfp4, ScaleRule::kFloor);
    return p("q.safetensors");
  }
  void replace_with_fifo(const std::string& path) const {
    fs::remove_all(path);
    if (mkfifo(path.c_str(), 0644) != 0) throw Skip{"mkfifo failed"};
  }
  void replace_with_directory(const std::string& path) const {
    fs::remove_all(path);
    fs::create_directory(path);
  }
  void replace_with_link(const std::string& path, const std::string& target) const {
    fs::remove_all(path);
    fs::create_symlink(target, path);
  }
};

void require_non_root() {
  if (geteuid() == 0) throw Skip{"root may read and write anything"};
}

// A safetensors file whose header claims `tensors` (name, dtype, shape) laid end to end, made
// sparse: the data is never written, so claims far beyond the disk cost nothing.
void sparse_safetensors(const std::string& path,
                        const std::vector<std::tuple<std::string, DType, std::vector<int64_t>>>& tensors) {
  json h = json::object();
  uint64_t off = 0;
  for (const auto& [name, dt, shape] : tensors) {
    const uint64_t n = uint64_t(checked_numel(shape)) * dtype_size(dt);
    h[name] = {{"dtype", dtype_name(dt)}, {"shape", shape}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  std::string header = h.dump();
  test::write_raw(path, test::raw_safetensors(header));
  fs::resize_file(path, 8 + header.size() + off);
}

// ---- the cases ---------------------------------------------------------------------------------

enum Flags : unsigned {
  kBypass = 1,         // the good input carries topk_ids/topk_weights instead of router_logits
  kFsizeZero = 2,      // the command may not write any file byte (RLIMIT_FSIZE 0)
  kStdoutOk = 4,       // output on stdout is expected (bench prints its table before the write)
  kOutputMade = 8,     // valid case: `out` must hold a layer output afterwards
};

struct Case {
  const char* family;
  std::string name;
  std::function<Args(Fx&)> setup;
  int code;
  std::vector<std::string> needles;
  unsigned flags = 0;
  WeightFormat fmt = WeightFormat::kMxfp4;
  std::function<void(const Fx&)> verify = {};  // valid cases: extra checks of the result
};

using CfgFn = std::function<void(json&)>;
using TensorsFn = std::function<void(std::vector<Tensor>&)>;

std::function<Args(Fx&)> cfg(CfgFn fn) {
  return [fn](Fx& f) {
    test::edit_config(f.model, fn);
    return f.run();
  };
}
std::function<Args(Fx&)> experts(TensorsFn fn) {
  return [fn](Fx& f) {
    test::edit(f.experts(), fn);
    return f.run();
  };
}
std::function<Args(Fx&)> input(TensorsFn fn) {
  return [fn](Fx& f) {
    test::edit(f.input, fn);
    return f.run();
  };
}
// Replaces the input (or, with model = true, experts.safetensors) by raw bytes.
std::function<Args(Fx&)> raw_input(std::string bytes, bool model = false) {
  return [bytes, model](Fx& f) {
    test::write_raw(model ? f.experts() : f.input, bytes);
    return f.run();
  };
}
std::function<Args(Fx&)> raw_config(std::string text) {
  return [text](Fx& f) {
    test::write_raw(f.config(), text);
    return f.run();
  };
}
std::function<Args(Fx&)> args(Args a) {
  return [a](Fx&) { return a; };
}

template <typename T>
void put(Tensor& t, size_t i, T v) {
  std::memcpy(t.bytes.data() + i * sizeof(T), &v, sizeof(T));
}
void put_bf16(Tensor& t, size_t i, uint16_t bits) { put<uint16_t>(t, i, bits); }

// One hidden_states tensor of F32 values everywhere (for overflow cases).
TensorsFn f32_hidden(float v) {
  return [v](std::vector<Tensor>& ts) {
    Tensor& t = test::tensor(ts, "hidden_states");
    t.dtype = DType::kF32;
    t.bytes = test::bytes_of(std::vector<float>(size_t(kT * kH), v));
  };
}

// topk_ids / topk_weights of shape [T, k] with the given ids (row-major) and weights 0.5.
TensorsFn topk(int k, std::vector<int32_t> ids) {
  return [k, ids](std::vector<Tensor>& ts) {
    Tensor& t = test::tensor(ts, "topk_ids");
    t.shape = {kT, k};
    t.bytes = test::bytes_of(ids);
    Tensor& w = test::tensor(ts, "topk_weights");
    w.shape = {kT, k};
    w.bytes = test::bytes_of(std::vector<float>(ids.size(), 0.5f));
  };
}

std::string header_of(const std::string& entries) { return "{" + entries + "}"; }
const char* const kGoodEntry = R"("hidden_states":{"dtype":"BF16","shape":[5,64],"data_offsets":[0,640]})";

std::vector<Case> container_cases() {
  const auto entry = [](const std::string& body) {
    return test::raw_safetensors(header_of(std::string(R"("hidden_states":)") + body), std::string(640, '\0'));
  };
  return {
      {"container", "empty_input_file", raw_input(""), 1, {"input.safetensors", "truncated"}},
      {"container", "experts_of_7_bytes", raw_input(std::string(7, '\0'), true), 1, {"experts.safetensors", "truncated"}},
      {"container", "header_longer_than_file", raw_input(test::raw_safetensors("{}", "", 4096)), 1,
       {"input.safetensors", "truncated"}},
      {"container", "header_length_2_40", raw_input(test::raw_safetensors("{}", "", uint64_t(1) << 40)), 1,
       {"input.safetensors", "corrupt safetensors header length"}},
      {"container", "header_length_all_ones", raw_input(test::raw_safetensors("{}", "", UINT64_MAX), true), 1,
       {"experts.safetensors", "corrupt safetensors header length"}},
      {"container", "header_length_zero", raw_input(test::raw_safetensors("", std::string(64, '\0'))), 1,
       {"input.safetensors", "not valid JSON"}},
      {"container", "header_not_json", raw_input(test::raw_safetensors("{\"a\": nonsense}")), 1,
       {"input.safetensors", "not valid JSON"}},
      {"container", "header_truncated_json", raw_input(test::raw_safetensors("{\"hidden_states\": {")), 1,
       {"input.safetensors", "not valid JSON"}},
      {"container", "header_is_an_array", raw_input(test::raw_safetensors("[1, 2, 3]"), true), 1,
       {"experts.safetensors", "not a JSON object"}},
      {"container", "header_of_spaces", raw_input(test::raw_safetensors("        ")), 1,
       {"input.safetensors", "not valid JSON"}},
      {"container", "entry_not_an_object", raw_input(entry("3")), 1,
       {"input.safetensors", "hidden_states", "not an object"}},
      {"container", "missing_dtype", raw_input(entry(R"({"shape":[5,64],"data_offsets":[0,640]})")), 1,
       {"input.safetensors", "hidden_states", "dtype"}},
      {"container", "dtype_a_number", raw_input(entry(R"({"dtype":16,"shape":[5,64],"data_offsets":[0,640]})")), 1,
       {"input.safetensors", "hidden_states", "dtype"}},
      {"container", "unknown_dtype", raw_input(entry(R"({"dtype":"F4","shape":[5,64],"data_offsets":[0,640]})")), 1,
       {"input.safetensors", "unknown dtype 'F4'"}},
      {"container", "missing_shape", raw_input(entry(R"({"dtype":"BF16","data_offsets":[0,640]})")), 1,
       {"input.safetensors", "hidden_states", "missing shape"}},
      {"container", "negative_shape", raw_input(entry(R"({"dtype":"BF16","shape":[-5,64],"data_offsets":[0,640]})")),
       1, {"input.safetensors", "non-negative"}},
      {"container", "fractional_shape", raw_input(entry(R"({"dtype":"BF16","shape":[2.5,64],"data_offsets":[0,640]})")),
       1, {"input.safetensors", "non-negative integers"}},
      {"container", "string_shape", raw_input(entry(R"({"dtype":"BF16","shape":["5","64"],"data_offsets":[0,640]})")),
       1, {"input.safetensors", "non-negative integers"}},
      {"container", "missing_data_offsets", raw_input(entry(R"({"dtype":"BF16","shape":[5,64]})")), 1,
       {"input.safetensors", "data_offsets"}},
      {"container", "three_data_offsets", raw_input(entry(R"({"dtype":"BF16","shape":[5,64],"data_offsets":[0,640,640]})")),
       1, {"input.safetensors", "data_offsets"}},
      {"container", "negative_data_offsets", raw_input(entry(R"({"dtype":"BF16","shape":[5,64],"data_offsets":[-640,0]})")),
       1, {"input.safetensors", "data_offsets"}},
      {"container", "offsets_reversed", raw_input(entry(R"({"dtype":"BF16","shape":[5,64],"data_offsets":[640,0]})")),
       1, {"input.safetensors", "out of range"}},
      {"container", "offsets_past_the_data", raw_input(entry(R"({"dtype":"BF16","shape":[5,64],"data_offsets":[8,648]})")),
       1, {"input.safetensors", "out of range"}},
      {"container", "size_not_numel_times_dtype", raw_input(entry(R"({"dtype":"F32","shape":[5,64],"data_offsets":[0,640]})")),
       1, {"input.safetensors", "hidden_states", "needs 1280 bytes"}},
      {"container", "overlapping_tensors",
       raw_input(test::raw_safetensors(header_of(std::string(kGoodEntry) +
                                                 R"(,"router_logits":{"dtype":"F32","shape":[5,4],"data_offsets":[560,640]})"),
                                       std::string(640, '\0'))),
       1, {"input.safetensors", "overlap"}},
      {"container", "shape_product_overflows",
       raw_input(entry(R"({"dtype":"BF16","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,640]})")),
       1, {"input.safetensors", "overflows"}},
      {"container", "metadata_not_an_object",
       raw_input(test::raw_safetensors(header_of(std::string(kGoodEntry) + R"(,"__metadata__":[1])"), std::string(640, '\0'))),
       1, {"input.safetensors", "__metadata__"}},
      {"container", "metadata_value_not_a_string",
       raw_input(test::raw_safetensors(header_of(std::string(kGoodEntry) + R"(,"__metadata__":{"format":7})"),
                                       std::string(640, '\0'))),
       1, {"input.safetensors", "__metadata__"}},
      {"container", "experts_truncated",
       [](Fx& f) {
         fs::resize_file(f.experts(), fs::file_size(f.experts()) - 100);
         return f.run();
       },
       1, {"experts.safetensors"}},
      {"container", "input_is_a_fifo", [](Fx& f) { f.replace_with_fifo(f.input); return f.run(); }, 1,
       {"input.safetensors", "not a regular file", "FIFO"}},
      {"container", "experts_is_a_fifo", [](Fx& f) { f.replace_with_fifo(f.experts()); return f.run(); }, 1,
       {"experts.safetensors", "FIFO"}},
      {"container", "input_links_to_dev_zero", [](Fx& f) { f.replace_with_link(f.input, "/dev/zero"); return f.run(); },
       1, {"input.safetensors", "character device"}},
      {"container", "input_is_a_directory",
       [](Fx& f) { f.replace_with_directory(f.input); return f.run(); },
       1, {"input.safetensors", "directory"}},
      {"container", "experts_is_a_directory",
       [](Fx& f) { f.replace_with_directory(f.experts()); return f.run(); },
       1, {"experts.safetensors", "directory"}},
      {"container", "input_missing", [](Fx& f) { fs::remove(f.input); return f.run(); }, 1,
       {"input.safetensors", "cannot open"}},
      {"container", "input_dangling_link", [](Fx& f) { f.replace_with_link(f.input, f.p("nowhere")); return f.run(); },
       1, {"input.safetensors", "cannot open"}},
      {"container", "model_dir_is_a_file",
       [](Fx& f) {
         fs::remove_all(f.model);
         test::write_raw(f.model, "x");
         return f.run();
       },
       1, {"config.json", "cannot open"}},
      {"container", "model_dir_missing", [](Fx& f) { fs::remove_all(f.model); return f.run(); }, 1,
       {"config.json", "cannot open"}},
      {"container", "quantize_input_is_a_fifo",
       [](Fx& f) {
         f.replace_with_fifo(f.p("q_in.safetensors"));
         return Args{"quantize", "--format", "mxfp4", f.p("q_in.safetensors"), f.out};
       },
       1, {"q_in.safetensors", "FIFO"}},
      {"container", "dequantize_input_links_to_dev_zero",
       [](Fx& f) {
         f.replace_with_link(f.p("q.safetensors"), "/dev/zero");
         return Args{"dequantize", f.p("q.safetensors"), f.out};
       },
       1, {"q.safetensors", "character device"}},
      {"container", "input_unreadable",
       [](Fx& f) {
         require_non_root();
         chmod(f.input.c_str(), 0);
         return f.run();
       },
       1, {"input.safetensors", "Permission denied"}},
      // Valid: a zero-size tensor at another tensor's offset is no overlap.
      {"container", "valid_zero_size_tensor_at_another_offset",
       input([](std::vector<Tensor>& ts) { ts.push_back({"empty", DType::kF32, {0, 4}, {}}); }), 0, {}, kOutputMade},
  };
}

std::vector<Case> config_cases() {
  const uint64_t two32 = uint64_t(1) << 32;
  return {
      {"config", "missing", [](Fx& f) { fs::remove(f.config()); return f.run(); }, 1, {"config.json", "cannot open"}},
      {"config", "a_directory",
       [](Fx& f) { f.replace_with_directory(f.config()); return f.run(); },
       1, {"config.json", "directory"}},
      {"config", "a_fifo", [](Fx& f) { f.replace_with_fifo(f.config()); return f.run(); }, 1, {"config.json", "FIFO"}},
      {"config", "links_to_dev_zero", [](Fx& f) { f.replace_with_link(f.config(), "/dev/zero"); return f.run(); }, 1,
       {"config.json", "character device"}},
      {"config", "larger_than_the_cap",
       [](Fx& f) {
         fs::resize_file(f.config(), 2 << 20);
         return f.run();
       },
       1, {"config.json", "more than"}},
      {"config", "not_json", raw_config("{\"num_experts\": 4,"), 1, {"config.json", "not valid JSON"}},
      {"config", "a_json_array", raw_config("[4, 2, 64, 64]"), 1, {"config.json", "not a JSON object"}},
      {"config", "empty", raw_config(""), 1, {"config.json", "not valid JSON"}},
      {"config", "number_beyond_double", raw_config("{\"num_experts\": 4, \"swiglu_limit\": 1e400}"), 1,
       {"config.json", "not valid JSON"}},
      {"config", "num_experts_2_32_plus_8", cfg([=](json& j) { j["num_experts"] = two32 + 8; }), 1,
       {"config.json", "num_experts", "32-bit"}},
      {"config", "num_experts_uint64_max", cfg([](json& j) { j["num_experts"] = UINT64_MAX; }), 1,
       {"config.json", "num_experts", "32-bit"}},
      {"config", "num_experts_negative", cfg([](json& j) { j["num_experts"] = -1; }), 1,
       {"config.json", "num_experts", "positive"}},
      {"config", "num_experts_zero", cfg([](json& j) { j["num_experts"] = 0; }), 1, {"config.json", "num_experts", "positive"}},
      {"config", "num_experts_float", cfg([](json& j) { j["num_experts"] = 4.0; }), 1,
       {"config.json", "num_experts", "integer"}},
      {"config", "num_experts_string", cfg([](json& j) { j["num_experts"] = "4"; }), 1,
       {"config.json", "num_experts", "integer"}},
      {"config", "num_experts_1e20", cfg([](json& j) { j["num_experts"] = 1e20; }), 1,
       {"config.json", "num_experts", "integer"}},
      {"config", "missing_num_experts", cfg([](json& j) { j.erase("num_experts"); }), 1,
       {"config.json", "missing field num_experts"}},
      {"config", "missing_intermediate_size", cfg([](json& j) { j.erase("intermediate_size"); }), 1,
       {"config.json", "intermediate_size"}},
      {"config", "top_k_zero", cfg([](json& j) { j["num_experts_per_tok"] = 0; }), 1,
       {"config.json", "num_experts_per_tok", "positive"}},
      {"config", "top_k_above_E", cfg([](json& j) { j["num_experts_per_tok"] = 5; }), 1,
       {"config.json", "num_experts_per_tok", "exceeds"}},
      {"config", "top_k_2_31", cfg([](json& j) { j["num_experts_per_tok"] = int64_t(1) << 31; }), 1,
       {"config.json", "num_experts_per_tok", "32-bit"}},
      {"config", "top_k_below_int_min", cfg([](json& j) { j["num_experts_per_tok"] = int64_t(INT_MIN) - 1; }), 1,
       {"config.json", "num_experts_per_tok", "32-bit"}},
      {"config", "hidden_size_2_31", cfg([](json& j) { j["hidden_size"] = int64_t(1) << 31; }), 1,
       {"config.json", "hidden_size", "32-bit"}},
      {"config", "hidden_size_negative", cfg([](json& j) { j["hidden_size"] = -64; }), 1,
       {"config.json", "hidden_size", "positive"}},
      {"config", "intermediate_size_zero", cfg([](json& j) { j["intermediate_size"] = 0; }), 1,
       {"config.json", "intermediate_size", "positive"}},
      {"config", "hidden_size_off_the_block", cfg([](json& j) { j["hidden_size"] = 80; }), 1,
       {"config.json", "hidden_size", "block"}},
      {"config", "intermediate_size_off_the_block", cfg([](json& j) { j["intermediate_size"] = 48; }), 1,
       {"config.json", "intermediate_size", "block"}},
      {"config", "routed_scaling_factor_1e39", cfg([](json& j) { j["routed_scaling_factor"] = 1e39; }), 1,
       {"config.json", "routed_scaling_factor", "float range"}},
      {"config", "routed_scaling_factor_zero", cfg([](json& j) { j["routed_scaling_factor"] = 0; }), 1,
       {"config.json", "routed_scaling_factor", "positive"}},
      {"config", "routed_scaling_factor_negative", cfg([](json& j) { j["routed_scaling_factor"] = -1.0; }), 1,
       {"config.json", "routed_scaling_factor", "positive"}},
      {"config", "routed_scaling_factor_underflows", cfg([](json& j) { j["routed_scaling_factor"] = 1e-50; }), 1,
       {"config.json", "routed_scaling_factor", "positive"}},
      {"config", "routed_scaling_factor_string", cfg([](json& j) { j["routed_scaling_factor"] = "1"; }), 1,
       {"config.json", "routed_scaling_factor", "number"}},
      {"config", "swiglu_limit_zero", cfg([](json& j) { j["swiglu_limit"] = 0; }), 1, {"config.json", "swiglu_limit"}},
      {"config", "swiglu_limit_negative", cfg([](json& j) { j["swiglu_limit"] = -7.0; }), 1,
       {"config.json", "swiglu_limit", "positive"}},
      {"config", "swiglu_limit_1e39", cfg([](json& j) { j["swiglu_limit"] = 1e39; }), 1,
       {"config.json", "swiglu_limit", "float range"}},
      {"config", "swiglu_alpha_1e39", cfg([](json& j) { j["swiglu_alpha"] = 1e39; }), 1,
       {"config.json", "swiglu_alpha", "float range"}},
      {"config", "swiglu_beta_minus_1e39", cfg([](json& j) { j["swiglu_beta"] = -1e39; }), 1,
       {"config.json", "swiglu_beta", "float range"}},
      {"config", "swiglu_alpha_string", cfg([](json& j) { j["swiglu_alpha"] = "1.7"; }), 1,
       {"config.json", "swiglu_alpha", "number"}},
      {"config", "n_group_zero", cfg([](json& j) { j["n_group"] = 0; }), 1, {"config.json", "n_group", "positive"}},
      {"config", "n_group_not_dividing_E", cfg([](json& j) { j["n_group"] = 3; }), 1, {"config.json", "n_group = 3"}},
      {"config", "n_group_2_32_plus_2", cfg([=](json& j) { j["n_group"] = two32 + 2; }), 1,
       {"config.json", "n_group", "32-bit"}},
      {"config", "topk_group_zero", cfg([](json& j) { j["topk_group"] = 0; }), 1, {"config.json", "topk_group"}},
      {"config", "topk_group_above_n_group",
       cfg([](json& j) {
         j["n_group"] = 2;
         j["topk_group"] = 3;
       }),
       1, {"config.json", "topk_group = 3"}},
      {"config", "top_k_above_the_kept_groups",
       cfg([](json& j) {
         j["n_group"] = 4;
         j["topk_group"] = 1;
       }),
       1, {"config.json", "num_experts_per_tok", "topk_group"}},
      {"config", "norm_topk_prob_string", cfg([](json& j) { j["norm_topk_prob"] = "yes"; }), 1,
       {"config.json", "norm_topk_prob"}},
      {"config", "hidden_act_unknown", cfg([](json& j) { j["hidden_act"] = "gelu"; }), 1, {"config.json", "hidden_act", "gelu"}},
      {"config", "hidden_act_number", cfg([](json& j) { j["hidden_act"] = 3; }), 1, {"config.json", "hidden_act"}},
      {"config", "scoring_func_unknown", cfg([](json& j) { j["scoring_func"] = "tanh"; }), 1,
       {"config.json", "scoring_func", "tanh"}},
      {"config", "quantization_missing", cfg([](json& j) { j.erase("quantization"); }), 1, {"config.json", "quantization"}},
      {"config", "quantization_a_string", cfg([](json& j) { j["quantization"] = "mxfp4"; }), 1,
       {"config.json", "quantization"}},
      {"config", "quantization_format_unknown", cfg([](json& j) { j["quantization"]["format"] = "int4"; }), 1,
       {"config.json", "quantization", "int4"}},
      {"config", "scale_rule_unknown", cfg([](json& j) { j["quantization"]["scale_rule"] = "ceil"; }), 1,
       {"config.json", "ceil"}},
      {"config", "weights_overflow_64_bits",
       cfg([](json& j) {
         j["num_experts"] = 1 << 30;
         j["hidden_size"] = 1 << 30;
         j["intermediate_size"] = 1 << 30;
       }),
       1, {"config.json", "overflow"}},
  };
}

std::vector<Case> weights_cases() {
  using W = WeightFormat;
  const auto nan_f32 = [](const char* name, float v, size_t at) {
    return experts([=](std::vector<Tensor>& ts) { put<float>(test::tensor(ts, name), at, v); });
  };
  const auto byte = [](const char* name, size_t at, uint8_t v) {
    return experts([=](std::vector<Tensor>& ts) { test::tensor(ts, name).bytes.at(at) = v; });
  };
  const auto bf16 = [](const char* name, size_t at, uint16_t bits) {
    return experts([=](std::vector<Tensor>& ts) { put_bf16(test::tensor(ts, name), at, bits); });
  };
  const auto drop = [](const char* name) { return experts([=](std::vector<Tensor>& ts) { test::drop(ts, name); }); };
  const auto dtype = [](const char* name, DType d) {
    return experts([=](std::vector<Tensor>& ts) {
      Tensor& t = test::tensor(ts, name);
      const size_t old = dtype_size(t.dtype), now = dtype_size(d);
      t.dtype = d;
      t.shape.back() = t.shape.back() * int64_t(old) / int64_t(now);  // keep the byte size
    });
  };
  const float nan = NAN, inf = INFINITY;
  return {
      {"weights", "bf16_w13_nan", bf16("w13_weight", 17, 0x7fc1), 1, {"experts.safetensors", "w13_weight", "NaN"}, 0, W::kBf16},
      {"weights", "bf16_w13_inf", bf16("w13_weight", 0, 0x7f80), 1, {"experts.safetensors", "w13_weight", "Inf"}, 0, W::kBf16},
      {"weights", "bf16_w2_minus_inf", bf16("w2_weight", 4000, 0xff80), 1, {"experts.safetensors", "w2_weight", "Inf"}, 0,
       W::kBf16},
      {"weights", "bf16_w2_negative_nan", bf16("w2_weight", 16383, 0xffc1), 1, {"experts.safetensors", "w2_weight", "NaN"},
       0, W::kBf16},
      {"weights", "mxfp8_w13_nan_code", byte("w13_weight", 100, 0x7f), 1, {"experts.safetensors", "w13_weight", "NaN"}, 0,
       W::kMxfp8},
      {"weights", "mxfp8_w2_negative_nan_code", byte("w2_weight", 3, 0xff), 1, {"experts.safetensors", "w2_weight", "NaN"},
       0, W::kMxfp8},
      {"weights", "mxfp8_w13_scale_nan", byte("w13_weight_scale", 0, 0xff), 1,
       {"experts.safetensors", "w13_weight_scale", "NaN"}, 0, W::kMxfp8},
      {"weights", "mxfp8_w2_scale_nan", byte("w2_weight_scale", 9, 0xff), 1, {"experts.safetensors", "w2_weight_scale", "NaN"},
       0, W::kMxfp8},
      {"weights", "mxfp4_gate_up_scale_nan", byte("gate_up_proj_scales", 37, 0xff), 1,
       {"experts.safetensors", "gate_up_proj_scales", "NaN"}},
      {"weights", "mxfp4_down_scale_nan", byte("down_proj_scales", 511, 0xff), 1,
       {"experts.safetensors", "down_proj_scales", "NaN"}},
      {"weights", "nvfp4_w13_block_scale_nan", byte("w13_weight_scale", 5, 0x7f), 1,
       {"experts.safetensors", "w13_weight_scale", "NaN"}, 0, W::kNvfp4},
      {"weights", "nvfp4_w2_block_scale_nan", byte("w2_weight_scale", 0, 0xff), 1,
       {"experts.safetensors", "w2_weight_scale", "NaN"}, 0, W::kNvfp4},
      {"weights", "nvfp4_w13_scale_2_nan", nan_f32("w13_weight_scale_2", nan, 1), 1,
       {"experts.safetensors", "w13_weight_scale_2"}, 0, W::kNvfp4},
      {"weights", "nvfp4_w13_scale_2_inf", nan_f32("w13_weight_scale_2", inf, 3), 1,
       {"experts.safetensors", "w13_weight_scale_2"}, 0, W::kNvfp4},
      {"weights", "nvfp4_w2_scale_2_zero", nan_f32("w2_weight_scale_2", 0.0f, 2), 1,
       {"experts.safetensors", "w2_weight_scale_2", "positive"}, 0, W::kNvfp4},
      {"weights", "nvfp4_w2_scale_2_negative", nan_f32("w2_weight_scale_2", -0.01f, 0), 1,
       {"experts.safetensors", "w2_weight_scale_2", "positive"}, 0, W::kNvfp4},
      {"weights", "nvfp4_w13_scale_2_minus_zero", nan_f32("w13_weight_scale_2", -0.0f, 0), 1,
       {"experts.safetensors", "w13_weight_scale_2", "positive"}, 0, W::kNvfp4},
      {"weights", "mxfp4_gate_up_bias_nan", bf16("gate_up_proj_bias", 5, 0x7fc0), 1,
       {"experts.safetensors", "gate_up_proj_bias", "non-finite"}},
      {"weights", "mxfp4_down_bias_f32_inf",
       experts([](std::vector<Tensor>& ts) {
         Tensor& t = test::tensor(ts, "down_proj_bias");
         std::vector<float> v(size_t(kE * kH), 0.01f);
         v[7] = INFINITY;
         t.dtype = DType::kF32;
         t.bytes = test::bytes_of(v);
       }),
       1, {"experts.safetensors", "down_proj_bias", "non-finite"}},
      {"weights", "bf16_w13_bias_inf", bf16("w13_bias", 0, 0x7f80), 1, {"experts.safetensors", "w13_bias", "non-finite"}, 0,
       W::kBf16},
      {"weights", "mxfp8_w2_bias_nan", bf16("w2_bias", 100, 0xffc0), 1, {"experts.safetensors", "w2_bias", "non-finite"}, 0,
       W::kMxfp8},
      {"weights", "score_bias_nan", nan_f32("e_score_correction_bias", nan, 2), 1,
       {"experts.safetensors", "e_score_correction_bias", "non-finite"}},
      {"weights", "score_bias_wrong_shape",
       experts([](std::vector<Tensor>& ts) {
         Tensor& t = test::tensor(ts, "e_score_correction_bias");
         t.shape = {kE / 2, 2};
       }),
       1, {"experts.safetensors", "e_score_correction_bias", "shape"}},
      {"weights", "score_bias_bf16", dtype("e_score_correction_bias", DType::kBF16), 1,
       {"experts.safetensors", "e_score_correction_bias", "dtype"}},
      {"weights", "mxfp4_missing_down_scales", drop("down_proj_scales"), 1, {"experts.safetensors", "missing tensor", "down_proj_scales"}},
      {"weights", "nvfp4_missing_w2_scale_2", drop("w2_weight_scale_2"), 1, {"experts.safetensors", "w2_weight_scale_2"}, 0,
       W::kNvfp4},
      {"weights", "mxfp8_missing_w13_scale", drop("w13_weight_scale"), 1, {"experts.safetensors", "w13_weight_scale"}, 0,
       W::kMxfp8},
      {"weights", "bf16_missing_w2", drop("w2_weight"), 1, {"experts.safetensors", "missing tensor", "w2_weight"}, 0, W::kBf16},
      {"weights", "mxfp4_blocks_as_i8", dtype("down_proj_blocks", DType::kI8), 1,
       {"experts.safetensors", "down_proj_blocks", "dtype", "I8"}},
      {"weights", "nvfp4_block_scale_as_u8", dtype("w13_weight_scale", DType::kU8), 1,
       {"experts.safetensors", "w13_weight_scale", "dtype"}, 0, W::kNvfp4},
      {"weights", "mxfp8_w2_as_u8", dtype("w2_weight", DType::kU8), 1, {"experts.safetensors", "w2_weight", "dtype"}, 0,
       W::kMxfp8},
      {"weights", "bf16_w13_as_f16", dtype("w13_weight", DType::kF16), 1, {"experts.safetensors", "w13_weight", "F16"}, 0,
       W::kBf16},
      {"weights", "nvfp4_scale_2_as_bf16",
       experts([](std::vector<Tensor>& ts) {
         Tensor& t = test::tensor(ts, "w2_weight_scale_2");
         t.dtype = DType::kBF16;
         t.bytes.resize(t.bytes.size() / 2);
       }),
       1, {"experts.safetensors", "w2_weight_scale_2", "dtype"}, 0, W::kNvfp4},
      {"weights", "bias_as_i32", dtype("gate_up_proj_bias", DType::kI32), 1, {"experts.safetensors", "gate_up_proj_bias", "dtype"}},
      {"weights", "mxfp4_blocks_wrong_shape",
       experts([](std::vector<Tensor>& ts) {
         Tensor& t = test::tensor(ts, "gate_up_proj_blocks");
         t.shape = {t.shape[0], t.shape[1] * t.shape[2], t.shape[3]};
       }),
       1, {"experts.safetensors", "gate_up_proj_blocks", "shape"}},
      {"weights", "nvfp4_w2_scale_2_split",
       experts([](std::vector<Tensor>& ts) { test::tensor(ts, "w2_weight_scale_2").shape = {kE / 2, 2}; }), 1,
       {"experts.safetensors", "w2_weight_scale_2", "shape"}, 0, W::kNvfp4},
      {"weights", "config_E_beyond_the_tensors", cfg([](json& j) { j["num_experts"] = 8; }), 1,
       {"experts.safetensors", "gate_up_proj_blocks", "shape"}},
      {"weights", "config_H_beyond_the_tensors", cfg([](json& j) { j["hidden_size"] = 128; }), 1,
       {"experts.safetensors", "shape", "[4, 128, 4, 16]"}},
  };
}

std::vector<Case> inputs_cases() {
  const auto drop = [](const char* name) { return input([=](std::vector<Tensor>& ts) { test::drop(ts, name); }); };
  const auto retype = [](const char* name, DType d, std::vector<int64_t> shape) {
    return input([=](std::vector<Tensor>& ts) {
      Tensor& t = test::tensor(ts, name);
      t.dtype = d;
      t.shape = shape;
    });
  };
  const auto reshape = [](const char* name, std::vector<int64_t> shape) {
    return input([=](std::vector<Tensor>& ts) { test::tensor(ts, name).shape = shape; });
  };
  const auto f32_at = [](const char* name, size_t at, float v) {
    return input([=](std::vector<Tensor>& ts) { put<float>(test::tensor(ts, name), at, v); });
  };
  const auto id_at = [](size_t at, int32_t v) {
    return input([=](std::vector<Tensor>& ts) { put<int32_t>(test::tensor(ts, "topk_ids"), at, v); });
  };
  // Good bypass ids are (t + j) % E; the cases below change one.
  const auto add_logits = [](std::function<void(Tensor&)> fn) {
    return input([=](std::vector<Tensor>& ts) {
      Tensor t{"router_logits", DType::kF32, {kT, kE}, test::bytes_of(std::vector<float>(size_t(kT * kE), 0.5f))};
      fn(t);
      ts.push_back(t);
    });
  };
  return {
      {"inputs", "missing_hidden_states", drop("hidden_states"), 1, {"input.safetensors", "hidden_states"}},
      {"inputs", "hidden_states_i16", retype("hidden_states", DType::kI16, {kT, kH}), 1,
       {"input.safetensors", "hidden_states", "dtype"}},
      {"inputs", "hidden_states_f16", retype("hidden_states", DType::kF16, {kT, kH}), 1,
       {"input.safetensors", "hidden_states", "F16"}},
      {"inputs", "hidden_states_wrong_width", reshape("hidden_states", {kT * 2, kH / 2}), 1,
       {"input.safetensors", "hidden_states", "shape"}},
      {"inputs", "hidden_states_1d", reshape("hidden_states", {kT * kH}), 1, {"input.safetensors", "hidden_states", "shape"}},
      {"inputs", "hidden_states_3d", reshape("hidden_states", {1, kT, kH}), 1, {"input.safetensors", "hidden_states", "shape"}},
      {"inputs", "hidden_states_nan",
       input([](std::vector<Tensor>& ts) { put_bf16(test::tensor(ts, "hidden_states"), 3 * kH + 7, 0x7fc0); }), 1,
       {"input.safetensors", "hidden_states", "non-finite", "token 3"}},
      {"inputs", "hidden_states_f32_inf",
       input([](std::vector<Tensor>& ts) {
         f32_hidden(0.5f)(ts);
         put<float>(test::tensor(ts, "hidden_states"), kT * kH - 1, -INFINITY);
       }),
       1, {"input.safetensors", "hidden_states", "non-finite", "token 4"}},
      {"inputs", "hidden_states_overflow_bf16", input(f32_hidden(3.4e38f)), 1,
       {"input.safetensors", "hidden_states", "overflows bf16"}},
      {"inputs", "missing_router_logits", drop("router_logits"), 1, {"input.safetensors", "router_logits"}},
      {"inputs", "router_logits_bf16", retype("router_logits", DType::kBF16, {kT * 2, kE}), 1,
       {"input.safetensors", "router_logits", "dtype"}},
      {"inputs", "router_logits_wrong_E", reshape("router_logits", {kT * 2, kE / 2}), 1,
       {"input.safetensors", "router_logits", "shape"}},
      {"inputs", "router_logits_wrong_T", reshape("router_logits", {kT - 1, kE + 1}), 1,
       {"input.safetensors", "router_logits", "shape"}},
      {"inputs", "router_logits_nan", f32_at("router_logits", 2 * kE + 1, NAN), 1,
       {"input.safetensors", "router_logits", "non-finite", "token 2"}},
      {"inputs", "router_logits_minus_inf", f32_at("router_logits", 0, -INFINITY), 1,
       {"input.safetensors", "router_logits", "non-finite"}},
      {"inputs", "topk_ids_without_weights", drop("topk_weights"), 1, {"input.safetensors", "topk_weights"}, kBypass},
      {"inputs", "topk_weights_without_ids", drop("topk_ids"), 1, {"input.safetensors", "topk_ids"}, kBypass},
      {"inputs", "topk_ids_i64", retype("topk_ids", DType::kI64, {kT, kK / 2}), 1, {"input.safetensors", "topk_ids", "dtype"},
       kBypass},
      {"inputs", "topk_weights_bf16", retype("topk_weights", DType::kBF16, {kT, kK * 2}), 1,
       {"input.safetensors", "topk_weights", "dtype"}, kBypass},
      {"inputs", "topk_id_equal_to_E", id_at(3, kE), 1, {"input.safetensors", "topk_ids", "out of range", "token 1"}, kBypass},
      {"inputs", "topk_id_minus_2", id_at(0, -2), 1, {"input.safetensors", "topk_ids", "out of range", "-2"}, kBypass},
      {"inputs", "topk_id_int_max", id_at(9, INT_MAX), 1, {"input.safetensors", "topk_ids", "out of range"}, kBypass},
      {"inputs", "topk_id_int_min", id_at(4, INT_MIN), 1, {"input.safetensors", "topk_ids", "out of range"}, kBypass},
      {"inputs", "duplicate_expert_in_a_token", id_at(5, 2), 1,  // token 2: {2, 3} -> {2, 2}
       {"input.safetensors", "topk_ids", "token 2", "more than once"}, kBypass},
      {"inputs", "k_below_top_k", input(topk(1, {0, 1, 2, 3, 0})), 1,
       {"input.safetensors", "topk_ids", "num_experts_per_tok"}, kBypass},
      {"inputs", "k_above_E", input(topk(5, std::vector<int32_t>(size_t(5 * kT), -1))), 1,
       {"input.safetensors", "topk_ids", "num_experts_per_tok"}, kBypass},
      {"inputs", "k_zero", input(topk(0, {})), 1, {"input.safetensors", "topk_ids", "num_experts_per_tok"}, kBypass},
      {"inputs", "topk_weights_nan", f32_at("topk_weights", 5, NAN), 1, {"input.safetensors", "topk_weights", "non-finite"},
       kBypass},
      {"inputs", "topk_weights_inf", f32_at("topk_weights", 0, INFINITY), 1,
       {"input.safetensors", "topk_weights", "non-finite"}, kBypass},
      {"inputs", "topk_weights_other_shape", reshape("topk_weights", {kK, kT}), 1,
       {"input.safetensors", "topk_weights", "shape"}, kBypass},
      {"inputs", "topk_ids_wrong_T",
       input([](std::vector<Tensor>& ts) {
         for (const char* n : {"topk_ids", "topk_weights"}) {
           Tensor& t = test::tensor(ts, n);
           t.shape = {kT - 1, kK};
           t.bytes.resize(size_t((kT - 1) * kK * 4));
         }
       }),
       1, {"input.safetensors", "topk_ids", "shape"}, kBypass},
      {"inputs", "router_logits_wrong_shape_beside_topk_ids", add_logits([](Tensor& t) { t.shape = {kT * 2, kE / 2}; }), 1,
       {"input.safetensors", "router_logits", "shape"}, kBypass},
      {"inputs", "router_logits_nan_beside_topk_ids", add_logits([](Tensor& t) { put<float>(t, 3, NAN); }), 1,
       {"input.safetensors", "router_logits", "non-finite"}, kBypass},
      {"inputs", "router_logits_bf16_beside_topk_ids",
       add_logits([](Tensor& t) {
         t.dtype = DType::kBF16;
         t.shape = {kT * 2, kE};
       }),
       1, {"input.safetensors", "router_logits", "dtype"}, kBypass},
      {"inputs", "finite_inputs_that_overflow_the_layer",
       [](Fx& f) {
         test::edit_config(f.model, [](json& j) { j["hidden_act"] = "silu"; });
         test::edit(f.input, f32_hidden(3.0e38f));
         return f.run();
       },
       1, {"y:", "from finite inputs", "overflowed"}},
      // Valid edge cases: defined answers, exit 0.
      {"inputs", "valid_zero_tokens",
       input([](std::vector<Tensor>& ts) {
         test::tensor(ts, "hidden_states") = {"hidden_states", DType::kBF16, {0, kH}, {}};
         test::tensor(ts, "router_logits") = {"router_logits", DType::kF32, {0, kE}, {}};
       }),
       0, {}, kOutputMade},
      {"inputs", "valid_zero_tokens_with_topk_ids",
       input([](std::vector<Tensor>& ts) {
         test::tensor(ts, "hidden_states") = {"hidden_states", DType::kBF16, {0, kH}, {}};
         test::tensor(ts, "topk_ids") = {"topk_ids", DType::kI32, {0, kK}, {}};
         test::tensor(ts, "topk_weights") = {"topk_weights", DType::kF32, {0, kK}, {}};
       }),
       0, {}, kOutputMade | kBypass},
      {"inputs", "valid_repeated_minus_one_ids", input(topk(kK, {-1, -1, 0, -1, -1, 3, 2, 1, -1, -1})), 0, {},
       kOutputMade | kBypass},
      {"inputs", "valid_sigmoid_scores_that_all_underflow",
       [](Fx& f) {
         test::edit_config(f.model, [](json& j) {
           j["scoring_func"] = "sigmoid";
           j["norm_topk_prob"] = true;
         });
         test::edit(f.input, [](std::vector<Tensor>& ts) {
           test::tensor(ts, "router_logits").bytes = test::bytes_of(std::vector<float>(size_t(kT * kE), -200.0f));
         });
         return f.run();
       },
       0, {}, kOutputMade, WeightFormat::kMxfp4,
       [](const Fx& f) {  // weights 0 / (0 + 1e-20) = 0: y is exactly zero, not NaN
         const auto o = SafetensorsFile::open(f.out);
         const TensorView& w = o.get("topk_weights");
         for (int64_t i = 0; i < w.numel(); ++i) EXPECT_EQ(w.as<float>()[i], 0.0f);
         const TensorView& y = o.get("y");
         for (int64_t i = 0; i < y.numel(); ++i) EXPECT_EQ(y.as<uint16_t>()[i] & 0x7fff, 0) << i;
       }},
  };
}

std::vector<Case> cli_cases() {
  const auto bench_tokens = [](std::string t) {
    return args({"bench", "--shape", "4,2,64,64", "--format", "bf16", "--tokens", t});
  };
  const auto bench_shape = [](std::string s) { return args({"bench", "--shape", s, "--format", "bf16", "--tokens", "1"}); };
  return {
      {"cli", "no_subcommand", args({}), 2, {"subcommand"}},
      {"cli", "unknown_subcommand", args({"frobnicate"}), 2, {"frobnicate"}},
      {"cli", "unknown_option", [](Fx& f) { Args a = f.run(); a.push_back("--fast"); return a; }, 2, {"--fast"}},
      {"cli", "run_without_model", [](Fx& f) { return Args{"run", "--input", f.input, "--output", f.out}; }, 2, {"--model"}},
      {"cli", "run_without_output", [](Fx& f) { return Args{"run", "--model", f.model, "--input", f.input}; }, 2,
       {"--output"}},
      {"cli", "run_model_without_value", [](Fx& f) { return Args{"run", "--input", f.input, "--output", f.out, "--model"}; },
       2, {"--model"}},
      {"cli", "bench_tokens_8abc", bench_tokens("8abc"), 2, {"--tokens", "8abc"}},
      {"cli", "bench_tokens_empty", bench_tokens(""), 2, {"--tokens"}},
      {"cli", "bench_tokens_empty_item", bench_tokens("1,,2"), 2, {"--tokens"}},
      {"cli", "bench_tokens_trailing_comma", bench_tokens("1,2,"), 2, {"--tokens"}},
      {"cli", "bench_tokens_negative", bench_tokens("-1"), 2, {"--tokens", "-1"}},
      {"cli", "bench_tokens_hex", bench_tokens("0x10"), 2, {"--tokens", "0x10"}},
      {"cli", "bench_tokens_leading_space", bench_tokens(" 8"), 2, {"--tokens"}},
      {"cli", "bench_tokens_plus_sign", bench_tokens("+8"), 2, {"--tokens", "+8"}},
      {"cli", "bench_tokens_exponent", bench_tokens("1e3"), 2, {"--tokens", "1e3"}},
      {"cli", "bench_tokens_fraction", bench_tokens("8.5"), 2, {"--tokens", "8.5"}},
      {"cli", "bench_tokens_beyond_int64", bench_tokens("99999999999999999999"), 2, {"--tokens"}},
      {"cli", "bench_shape_fraction", bench_shape("8.5,2,64,64"), 2, {"--shape", "8.5"}},
      {"cli", "bench_shape_three_numbers", bench_shape("8,2,64"), 2, {"--shape"}},
      {"cli", "bench_shape_suffix", bench_shape("8,2,64,64abc"), 2, {"--shape", "64abc"}},
      {"cli", "bench_shape_beyond_int", bench_shape("99999999999,2,64,64"), 2, {"--shape"}},
      {"cli", "bench_shape_k_above_E", bench_shape("4,5,64,64"), 2, {"--shape", "num_experts_per_tok"}},
      {"cli", "bench_shape_unknown_name", bench_shape("gpt-5"), 2, {"--shape", "gpt-5"}},
      {"cli", "bench_shape_off_the_block", args({"bench", "--shape", "4,2,48,64", "--format", "mxfp4", "--tokens", "1"}), 1,
       {"--shape", "hidden_size", "block"}},
      {"cli", "bench_reps_suffix", args({"bench", "--reps", "5x"}), 2, {"--reps", "5x"}},
      {"cli", "bench_reps_zero", args({"bench", "--reps", "0"}), 2, {"--reps"}},
      {"cli", "bench_format_unknown", args({"bench", "--format", "int4"}), 2, {"--format", "int4"}},
      {"cli", "bench_seed_negative", args({"bench", "--seed", "-1"}), 2, {"--seed"}},
      {"cli", "bench_steady_negative", args({"bench", "--steady", "-1"}), 2, {"--steady"}},
      {"cli", "backends_tokens_suffix", args({"backends", "--tokens", "8abc"}), 2, {"--tokens"}},
      {"cli", "backends_tokens_negative", args({"backends", "--tokens", "-3"}), 2, {"--tokens"}},
      {"cli", "demo_tokens_fraction", args({"demo", "--tokens", "1.5"}), 2, {"--tokens"}},
      {"cli", "demo_tokens_zero", args({"demo", "--tokens", "0"}), 2, {"--tokens"}},
      {"cli", "quantize_without_out", [](Fx& f) { return Args{"quantize", "--format", "mxfp4", f.quant_in()}; }, 2, {"OUT"}},
      {"cli", "quantize_format_bf16", [](Fx& f) { return Args{"quantize", "--format", "bf16", f.quant_in(), f.out}; }, 2,
       {"--format", "bf16"}},
      {"cli", "quantize_scale_rule_unknown",
       [](Fx& f) { return Args{"quantize", "--format", "mxfp4", "--scale-rule", "ceil", f.quant_in(), f.out}; }, 2,
       {"--scale-rule", "ceil"}},
      {"cli", "quantize_extra_argument",
       [](Fx& f) { return Args{"quantize", "--format", "mxfp4", f.quant_in(), f.out, f.p("more")}; }, 2, {"more"}},
      {"cli", "run_unknown_backend", [](Fx& f) { Args a = f.run(); a.insert(a.end(), {"--backend", "nosuch"}); return a; },
       1, {"nosuch"}},
  };
}

std::vector<Case> output_cases() {
  const auto run_to = [](std::function<std::string(Fx&)> out) {
    return [out](Fx& f) { return Args{"run", "--model", f.model, "--input", f.input, "--output", out(f)}; };
  };
  const char* kSame = "same file as the input";
  return {
      {"output", "run_output_is_the_input", run_to([](Fx& f) { return f.input; }), 1, {"input.safetensors", kSame}},
      {"output", "run_output_is_the_experts", run_to([](Fx& f) { return f.experts(); }), 1, {"experts.safetensors", kSame}},
      {"output", "run_output_is_the_config", run_to([](Fx& f) { return f.config(); }), 1, {"config.json", kSame}},
      {"output", "run_output_hard_link_to_input",
       run_to([](Fx& f) {
         fs::create_hard_link(f.input, f.p("link.safetensors"));
         return f.p("link.safetensors");
       }),
       1, {"link.safetensors", kSame}},
      {"output", "run_output_symlink_to_input",
       run_to([](Fx& f) {
         fs::create_symlink(f.input, f.p("link.safetensors"));
         return f.p("link.safetensors");
       }),
       1, {"link.safetensors", kSame}},
      {"output", "run_output_experts_by_another_path",
       run_to([](Fx& f) { return f.model + "/../model/./experts.safetensors"; }), 1, {"experts.safetensors", kSame}},
      {"output", "run_output_is_a_directory",
       run_to([](Fx& f) {
         fs::create_directory(f.out);
         return f.out;
       }),
       1, {"out.safetensors", "directory"}},
      {"output", "run_output_is_a_fifo",
       run_to([](Fx& f) {
         f.replace_with_fifo(f.out);
         return f.out;
       }),
       1, {"out.safetensors", "FIFO"}},
      {"output", "run_output_links_to_dev_null",
       run_to([](Fx& f) {
         f.replace_with_link(f.out, "/dev/null");
         return f.out;
       }),
       1, {"out.safetensors", "character device"}},
      {"output", "run_output_is_a_device_node",
       run_to([](Fx& f) {
         if (mknod(f.out.c_str(), S_IFCHR | 0666, makedev(1, 3)) != 0) throw Skip{"mknod not permitted here"};
         return f.out;
       }),
       1, {"out.safetensors", "character device"}},
      {"output", "run_output_is_dev_null",
       run_to([](Fx&) {
         require_non_root();  // as root a regression would replace the machine's /dev/null
         return std::string("/dev/null");
       }),
       1, {"/dev/null", "character device"}},
      {"output", "run_output_dangling_link",
       run_to([](Fx& f) {
         f.replace_with_link(f.out, f.p("nowhere"));
         return f.out;
       }),
       1, {"out.safetensors", "symbolic link to nothing"}},
      {"output", "run_output_in_a_missing_directory", run_to([](Fx& f) { return f.p("nodir/out.safetensors"); }), 1,
       {"nodir/out.safetensors", "cannot write"}},
      {"output", "run_output_links_to_a_directory",
       run_to([](Fx& f) {
         fs::create_directory(f.p("d"));
         f.replace_with_link(f.out, f.p("d"));
         return f.out;
       }),
       1, {"out.safetensors", "directory"}},
      {"output", "run_output_is_the_model_directory", run_to([](Fx& f) { return f.model; }), 1, {"model", "directory"}},
      {"output", "run_output_in_a_read_only_directory",
       run_to([](Fx& f) {
         require_non_root();
         fs::create_directory(f.p("ro"));
         chmod(f.p("ro").c_str(), 0555);
         return f.p("ro/out.safetensors");
       }),
       1, {"ro/out.safetensors", "cannot write"}},
      {"output", "run_write_fails", [](Fx& f) { return f.run(); }, 1, {"out.safetensors", "cannot write"}, kFsizeZero},
      {"output", "quantize_in_place", [](Fx& f) { return Args{"quantize", "--format", "nvfp4", f.quant_in(), f.quant_in()}; },
       1, {"q_in.safetensors", kSame}},
      {"output", "quantize_out_links_to_in",
       [](Fx& f) {
         const std::string in = f.quant_in();
         fs::create_symlink(in, f.p("l.safetensors"));
         return Args{"quantize", "--format", "mxfp8", in, f.p("l.safetensors")};
       },
       1, {"l.safetensors", kSame}},
      {"output", "dequantize_in_place", [](Fx& f) { return Args{"dequantize", f.quantized(), f.quantized()}; }, 1,
       {"q.safetensors", kSame}},
      {"output", "quantize_out_is_a_fifo",
       [](Fx& f) {
         f.replace_with_fifo(f.out);
         return Args{"quantize", "--format", "mxfp4", f.quant_in(), f.out};
       },
       1, {"out.safetensors", "FIFO"}},
      {"output", "dequantize_out_is_a_directory",
       [](Fx& f) {
         fs::create_directory(f.out);
         return Args{"dequantize", f.quantized(), f.out};
       },
       1, {"out.safetensors", "directory"}},
      {"output", "quantize_write_fails", [](Fx& f) { return Args{"quantize", "--format", "mxfp4", f.quant_in(), f.out}; }, 1,
       {"out.safetensors", "cannot write"}, kFsizeZero},
      {"output", "bench_json_is_a_fifo",
       [](Fx& f) {
         f.replace_with_fifo(f.out);
         return f.bench({"--json", f.out});
       },
       1, {"out.safetensors", "FIFO"}},
      {"output", "bench_json_is_a_directory",
       [](Fx& f) {
         fs::create_directory(f.out);
         return f.bench({"--json", f.out});
       },
       1, {"out.safetensors", "directory"}},
      {"output", "bench_json_in_a_missing_directory", [](Fx& f) { return f.bench({"--json", f.p("nodir/b.json")}); }, 1,
       {"nodir/b.json", "cannot write"}},
      {"output", "bench_json_links_to_dev_null",
       [](Fx& f) {
         f.replace_with_link(f.out, "/dev/null");
         return f.bench({"--json", f.out});
       },
       1, {"out.safetensors", "character device"}},
      {"output", "bench_json_write_fails", [](Fx& f) { return f.bench({"--json", f.out}); }, 1,
       {"out.safetensors", "cannot write"}, kFsizeZero | kStdoutOk},
      // Valid: an output that is a symbolic link to a regular file replaces that file; the link stays.
      {"output", "valid_output_links_to_a_regular_file",
       run_to([](Fx& f) {
         test::write_raw(f.p("target.safetensors"), "old");
         f.replace_with_link(f.out, f.p("target.safetensors"));
         return f.out;
       }),
       0, {}, kOutputMade, WeightFormat::kMxfp4,
       [](const Fx& f) { EXPECT_TRUE(fs::is_symlink(f.out)); }},
  };
}

std::vector<Case> sizes_cases() {
  const uint64_t ram = host_memory_bytes();
  return {
      {"sizes", "bench_tokens_1e12", args({"bench", "--shape", "4,2,64,64", "--format", "bf16", "--tokens", "1000000000000"}),
       1, {"1000000000000 tokens", "host memory"}},
      {"sizes", "bench_tokens_int64_max",
       args({"bench", "--shape", "4,2,64,64", "--format", "bf16", "--tokens", "9223372036854775807"}), 1,
       {"9223372036854775807 tokens", "host memory"}},
      {"sizes", "bench_token_list_with_1e12",
       args({"bench", "--shape", "4,2,64,64", "--format", "bf16", "--tokens", "1,1000000000000"}), 1, {"host memory"}},
      {"sizes", "bench_deepseek_v3_1e11_tokens",
       args({"bench", "--shape", "deepseek-v3", "--format", "mxfp4", "--tokens", "100000000000"}), 1, {"tokens", "host memory"}},
      {"sizes", "bench_weights_beyond_memory",
       // E within every backend's limit (1024), so that the size, not the expert count, is refused:
       // host memory on the CPU, GPU memory on an SM90 backend.
       args({"bench", "--shape", "1000,1,65536,65536", "--format", "bf16", "--tokens", "1"}), 1,
       {"weights", "memory"}},
      {"sizes", "bench_shape_overflows_64_bits",
       args({"bench", "--shape", "2147483647,1,2147483616,2147483616", "--format", "bf16", "--tokens", "1"}), 2,
       {"--shape", "overflow"}},
      {"sizes", "demo_tokens_1e12", args({"demo", "--tokens", "1000000000000"}), 1, {"1000000000000 tokens", "host memory"}},
      {"sizes", "input_claims_more_tokens_than_memory",
       [=](Fx& f) {
         const int64_t T = int64_t(ram / 4 / (kH * 2));
         sparse_safetensors(f.input, {{"hidden_states", DType::kBF16, {T, kH}}, {"router_logits", DType::kF32, {T, kE}}});
         return f.run();
       },
       1, {"input.safetensors", "tokens", "host memory"}},
      {"sizes", "bypass_input_claims_more_tokens_than_memory",
       [=](Fx& f) {
         const int64_t T = int64_t(ram / 4 / (kH * 2));
         sparse_safetensors(f.input, {{"hidden_states", DType::kBF16, {T, kH}},
                                      {"topk_ids", DType::kI32, {T, kK}},
                                      {"topk_weights", DType::kF32, {T, kK}}});
         return f.run();
       },
       1, {"input.safetensors", "tokens", "host memory"}},
      {"sizes", "input_shape_overflows",
       raw_input(test::raw_safetensors(
           R"({"hidden_states":{"dtype":"BF16","shape":[4611686018427387904,64],"data_offsets":[0,640]}})",
           std::string(640, '\0'))),
       1, {"input.safetensors", "hidden_states", "overflows"}},
      {"sizes", "config_json_sparse_gigabyte",
       [](Fx& f) {
         fs::resize_file(f.config(), uint64_t(1) << 30);
         return f.run();
       },
       1, {"config.json", "more than"}},
      {"sizes", "safetensors_header_above_100_MiB",
       [](Fx& f) {
         test::write_raw(f.input, test::raw_safetensors("{", "", uint64_t(200) << 20));
         fs::resize_file(f.input, (uint64_t(200) << 20) + 4096);
         return f.run();
       },
       1, {"input.safetensors", "corrupt safetensors header length"}},
      {"sizes", "quantize_tensor_beyond_memory",
       [=](Fx& f) {
         const int64_t rows = int64_t(ram * 3 / 4 / (64 * 2));
         sparse_safetensors(f.p("big.safetensors"), {{"w", DType::kBF16, {rows, 64}}});
         return Args{"quantize", "--format", "mxfp4", f.p("big.safetensors"), f.out};
       },
       1, {"big.safetensors", "tensor w", "host memory"}},
      {"sizes", "dequantize_tensor_beyond_memory",
       [=](Fx& f) {
         const int64_t rows = int64_t(ram / 4 / 17);
         sparse_safetensors(f.p("big.safetensors"),
                            {{"w_blocks", DType::kU8, {rows, 1, 16}}, {"w_scales", DType::kU8, {rows, 1}}});
         return Args{"dequantize", f.p("big.safetensors"), f.out};
       },
       1, {"big.safetensors", "tensor w", "host memory"}},
      {"sizes", "config_sizes_overflow",
       cfg([](json& j) {
         j["num_experts"] = INT_MAX;
         j["hidden_size"] = 2147483616;
         j["intermediate_size"] = 2147483616;
       }),
       1, {"config.json", "overflow"}},
      {"sizes", "valid_backends_with_1e18_tokens",
       [](Fx& f) { return Args{"backends", "--model", f.model, "--tokens", "1000000000000000000"}; }, 0, {}, kStdoutOk},
  };
}

std::vector<Case> all_cases() {
  std::vector<Case> all;
  for (auto family : {container_cases, config_cases, weights_cases, inputs_cases, cli_cases, output_cases, sizes_cases})
    for (Case& c : family()) all.push_back(std::move(c));
  return all;
}

// ---- the runner --------------------------------------------------------------------------------

void PrintTo(const Case& c, std::ostream* os) { *os << c.family << "/" << c.name; }

class Corpus : public ::testing::TestWithParam<Case> {};

TEST_P(Corpus, Case) {
  const Case& c = GetParam();
  for (const bool preexisting : {false, true}) {
    SCOPED_TRACE(preexisting ? "with a pre-existing output" : "without an output file");
    Fx f;
    Args a;
    try {
      test::write_small_layer(f.model, f.input, c.fmt, c.flags & kBypass);
      a = c.setup(f);
    } catch (const Skip& s) {
      GTEST_SKIP() << s.why;
    }
    struct stat st;
    if (preexisting && lstat(f.out.c_str(), &st) != 0) test::write_raw(f.out, "a pre-existing output");
    const auto before = snapshot(f.tmp.path());
    const CmdResult r = run_moekit(a, c.flags & kFsizeZero);
    std::string cmd = "moekit";
    for (const auto& x : a) cmd += " '" + x + "'";
    SCOPED_TRACE(cmd);
    ASSERT_FALSE(r.timed_out) << "hung for " << kTimeoutSeconds << " s";
    EXPECT_EQ(r.code, c.code) << "stderr: " << r.err << "\nstdout: " << r.out;
    if (!preexisting) RecordProperty("message", r.err.empty() ? "" : r.err.substr(0, r.err.size() - 1));
    if (c.code != 0 && !(c.flags & kStdoutOk)) {
      EXPECT_EQ(r.out, "") << "stdout";
    }
    const auto after = snapshot(f.tmp.path());
    if (c.code == 0) {
      EXPECT_EQ(r.err, "");
      EXPECT_TRUE(test::no_temp_files(f.tmp.path()));
      if (c.flags & kOutputMade) {
        const auto o = SafetensorsFile::open(f.out);
        EXPECT_TRUE(o.has("y") && o.has("topk_ids") && o.has("topk_weights"));
      }
      if (c.verify) c.verify(f);
      continue;
    }
    EXPECT_EQ(test::count_lines(r.err), 1) << r.err;
    EXPECT_EQ(r.err.rfind("moekit: error: ", 0), 0u) << r.err;
    for (const auto& n : c.needles) EXPECT_NE(r.err.find(n), std::string::npos) << "'" << n << "' not in: " << r.err;
    // No output, no temporary file, and every file as it was (a pre-existing output included).
    EXPECT_EQ(before, after) << "the directory changed:" << describe_diff(before, after);
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return std::string(info.param.family) + "_" + info.param.name;
}

INSTANTIATE_TEST_SUITE_P(Corpus, Corpus, ::testing::ValuesIn(all_cases()), case_name);

// The corpus holds at least 150 bad inputs, across every family.
TEST(CorpusSize, AtLeast150BadInputsInEveryFamily) {
  std::map<std::string, int> bad;
  for (const Case& c : all_cases()) bad[c.family] += c.code != 0;
  int total = 0;
  for (const char* fam : {"container", "config", "weights", "inputs", "cli", "output", "sizes"}) {
    EXPECT_GE(bad[fam], 10) << fam;
    total += bad[fam];
  }
  EXPECT_GE(total, 150);
}

}  // namespace
}  // namespace moekit
