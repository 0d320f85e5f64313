// Helpers shared by the CPU tests: temp dirs, running the CLI, golden-data paths, poison.
#pragma once

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <sys/wait.h>

namespace moekit::test {

// ../shared/testdata beside the repo, or $MOEKIT_TESTDATA where the tests run elsewhere.
inline std::string testdata(const std::string& rel) {
  const char* env = std::getenv("MOEKIT_TESTDATA");
  return std::string(env && *env ? env : MOEKIT_TESTDATA) + "/" + rel;
}

// Sets an environment variable for the life of the object and restores what it was (a CLI child
// inherits it; a layer reads its overrides when it is made).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

// A fresh directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "moekit-test-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct RunResult {
  int code = -1;
  std::string out;  // stdout and stderr together
};

#ifdef MOEKIT_BIN
// The moekit binary: the one built beside the tests, or $MOEKIT_BIN where the tests run elsewhere
// (a GPU machine that got the binaries from scripts/device_prep.sh).
inline std::string moekit_bin() {
  const char* env = std::getenv("MOEKIT_BIN");
  return env && *env ? env : MOEKIT_BIN;
}

// Runs `moekit ARGS` through the shell; returns the exit code and the output.
inline RunResult run_cli(const std::string& args) {
  RunResult r;
  const std::string cmd = moekit_bin() + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}
#endif

inline int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

}  // namespace moekit::test
