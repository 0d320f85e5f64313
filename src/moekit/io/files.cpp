#include "moekit/io/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "moekit/common/checked.h"
#include "moekit/common/error.h"

namespace moekit {

namespace {

const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

std::string errno_str(int err) { return std::strerror(err); }

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// The checks of check_output_path; returns the path to rename the new file onto (the output, or
// the regular file an output symbolic link points to).
std::string output_target(const std::string& out, const std::vector<std::string>& inputs) {
  MOEKIT_REQUIRE(!out.empty(), "empty output path");
  struct stat lst, st;
  if (lstat(out.c_str(), &lst) != 0) {
    const int err = errno;
    MOEKIT_REQUIRE(err == ENOENT, out, ": cannot write (", errno_str(err), ")");
    // A new file: its directory must exist and be writable.
    const std::string dir = parent_dir(out);
    struct stat dst;
    MOEKIT_REQUIRE(stat(dir.c_str(), &dst) == 0, out, ": cannot write (directory ", dir, ": ",
                   errno_str(errno), ")");
    MOEKIT_REQUIRE(S_ISDIR(dst.st_mode), out, ": cannot write (", dir, " is not a directory)");
    MOEKIT_REQUIRE(access(dir.c_str(), W_OK) == 0, out, ": cannot write (directory ", dir, ": ",
                   errno_str(errno), ")");
    return out;
  }
  std::string target = out;
  if (S_ISLNK(lst.st_mode)) {
    MOEKIT_REQUIRE(stat(out.c_str(), &st) == 0, out, ": is a symbolic link to nothing (",
                   errno_str(errno), "); refusing to write through it");
    MOEKIT_REQUIRE(S_ISREG(st.st_mode), out, ": is a symbolic link to ", kind_of(st.st_mode),
                   ", not a regular file; refusing to replace it");
    char buf[PATH_MAX];
    MOEKIT_REQUIRE(realpath(out.c_str(), buf) != nullptr, out, ": cannot resolve (",
                   errno_str(errno), ")");
    target = buf;
  } else {
    st = lst;
    MOEKIT_REQUIRE(S_ISREG(st.st_mode), out, ": exists and is ", kind_of(st.st_mode),
                   ", not a regular file; refusing to replace it");
  }
  for (const std::string& in : inputs) {
    struct stat ist;
    if (stat(in.c_str(), &ist) != 0) continue;
    MOEKIT_REQUIRE(ist.st_dev != st.st_dev || ist.st_ino != st.st_ino, out,
                   ": is the same file as the input ", in, "; refusing to overwrite an input");
  }
  const std::string dir = parent_dir(target);
  MOEKIT_REQUIRE(access(dir.c_str(), W_OK) == 0, out, ": cannot write (directory ", dir, ": ",
                 errno_str(errno), ")");
  return target;
}

// Writes all of [p, p + n) to fd; false with errno set on failure.
bool write_all(int fd, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, b, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    b += w;
    n -= size_t(w);
  }
  return true;
}

}  // namespace

InputFile InputFile::open(const std::string& path) {
  struct stat st;
  MOEKIT_REQUIRE(stat(path.c_str(), &st) == 0, path, ": cannot open (", errno_str(errno), ")");
  MOEKIT_REQUIRE(S_ISREG(st.st_mode), path, ": not a regular file (", kind_of(st.st_mode), ")");
  // O_NONBLOCK: if the path was swapped for a FIFO since the stat, the open still returns.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  MOEKIT_REQUIRE(fd >= 0, path, ": cannot open (", errno_str(errno), ")");
  InputFile f(fd, 0);
  MOEKIT_REQUIRE(fstat(fd, &st) == 0, path, ": cannot open (", errno_str(errno), ")");
  MOEKIT_REQUIRE(S_ISREG(st.st_mode), path, ": not a regular file (", kind_of(st.st_mode), ")");
  f.size_ = uint64_t(st.st_size);
  return f;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string read_file(const std::string& path, uint64_t max_bytes) {
  const InputFile f = InputFile::open(path);
  MOEKIT_REQUIRE(f.size() <= max_bytes, path, ": ", human_bytes(f.size()),
                 ", more than the ", human_bytes(max_bytes), " such a file may have");
  std::string s(size_t(f.size()), '\0');
  size_t got = 0;
  while (got < s.size()) {
    const ssize_t r = ::read(f.fd(), s.data() + got, s.size() - got);
    if (r < 0 && errno == EINTR) continue;
    MOEKIT_REQUIRE(r >= 0, path, ": cannot read (", errno_str(errno), ")");
    if (r == 0) break;  // shrank since the fstat: what is there is all there is
    got += size_t(r);
  }
  s.resize(got);
  return s;
}

void check_output_path(const std::string& out, const std::vector<std::string>& inputs) {
  output_target(out, inputs);
}

void write_file_atomic(const std::string& out, const std::vector<Chunk>& chunks) {
  const std::string target = output_target(out, {});
  std::random_device rd;
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    char suffix[24];
    std::snprintf(suffix, sizeof suffix, ".tmp-%08x", unsigned(rd()));
    tmp = target + suffix;
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  MOEKIT_REQUIRE(fd >= 0, out, ": cannot write (", errno_str(errno), ")");
  bool ok = true;
  int err = 0;
  std::vector<uint8_t> piece;
  for (const Chunk& c : chunks) {
    if (!ok || c.size == 0) continue;
    if (!c.fill) {
      if (!write_all(fd, c.data, c.size)) ok = false, err = errno;
      continue;
    }
    piece.resize(std::min<size_t>(c.size, size_t(8) << 20));
    for (uint64_t off = 0; ok && off < c.size; off += piece.size()) {
      const size_t n = size_t(std::min<uint64_t>(piece.size(), c.size - off));
      try {
        c.fill(off, piece.data(), n);
      } catch (...) {  // the maker failed: no partial file stays behind
        ::close(fd);
        ::unlink(tmp.c_str());
        throw;
      }
      if (!write_all(fd, piece.data(), n)) ok = false, err = errno;
    }
  }
  if (ok && fsync(fd) != 0) ok = false, err = errno;
  if (::close(fd) != 0 && ok) ok = false, err = errno;
  if (ok) {
    // The output may have changed while this command ran: check it again just before the rename.
    try {
      output_target(out, {});
    } catch (const Error&) {
      ::unlink(tmp.c_str());
      throw;
    }
    if (std::rename(tmp.c_str(), target.c_str()) != 0) ok = false, err = errno;
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    fail(out, ": cannot write (", errno_str(err), ")");
  }
}

void write_file_atomic(const std::string& out, const std::string& text) {
  write_file_atomic(out, std::vector<Chunk>{{text.data(), text.size()}});
}

}  // namespace moekit
