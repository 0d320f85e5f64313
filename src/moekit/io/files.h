// moekit/io/files.h — how every file is opened for reading and how every output is written.
//
// Reading: the path must name a regular file (symbolic links followed). It is checked with
// stat() before the open, opened with O_NONBLOCK (a FIFO or device swapped in between cannot
// block the open) and checked again on the descriptor. Reads are bounded by the size the format
// allows (read_file's max_bytes; safetensors files are mapped, never read past their size).
//
// Writing: check_output_path() runs before any work. It refuses an output that is the same file
// (device and inode, after symbolic links) as one of the inputs, an existing output that is not a
// regular file (directory, FIFO, device, socket, or a symbolic link to one, or to nothing), and
// an output whose directory does not exist. write_file_atomic() writes to a temporary name in the
// output's directory (the target's directory when the output is a symbolic link to a regular
// file, which then keeps its link), flushes it to disk and renames it over the output; on any
// failure the temporary file is removed and an existing output is left as it was.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace moekit {

// An open regular file (read-only); closed when the object dies.
class InputFile {
 public:
  // Throws moekit::Error "PATH: cannot open (...)" / "PATH: not a regular file (a FIFO)".
  static InputFile open(const std::string& path);
  InputFile(InputFile&& o) noexcept : fd_(o.fd_), size_(o.size_) { o.fd_ = -1; }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile();

  int fd() const { return fd_; }
  uint64_t size() const { return size_; }

 private:
  InputFile(int fd, uint64_t size) : fd_(fd), size_(size) {}
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The whole of a regular file; throws when it is larger than max_bytes.
std::string read_file(const std::string& path, uint64_t max_bytes);

// See the header comment. `inputs` are paths the command reads (missing ones are skipped).
void check_output_path(const std::string& out, const std::vector<std::string>& inputs);

struct Chunk {
  const void* data;
  size_t size;
  // Or, when set, bytes made on the way out (data unused): fill(offset, dst, n) writes bytes
  // [offset, offset + n) of the chunk to dst, piece by piece, so that a large output never needs
  // to be in memory at once.
  std::function<void(uint64_t offset, uint8_t* dst, size_t n)> fill = {};
};
// Checks `out` as check_output_path(out, {}) does, then writes the chunks atomically.
void write_file_atomic(const std::string& out, const std::vector<Chunk>& chunks);
void write_file_atomic(const std::string& out, const std::string& text);

}  // namespace moekit
