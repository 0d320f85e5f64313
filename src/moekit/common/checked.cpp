#include "moekit/common/checked.h"

#include <unistd.h>

#include <charconv>
#include <cstdio>

#include "moekit/common/error.h"

namespace moekit {

uint64_t sat_mul(std::initializer_list<int64_t> factors) {
  uint64_t p = 1;
  for (int64_t f : factors) {
    if (f < 0) return UINT64_MAX;
    if (__builtin_mul_overflow(p, uint64_t(f), &p)) return UINT64_MAX;
  }
  return p;
}

uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

bool parse_whole_int(std::string_view s, int64_t lo, int64_t hi, int64_t* out) {
  if (s.empty()) return false;
  int64_t v = 0;
  // from_chars takes an optional '-' and decimal digits only; the whole string must be used.
  const auto r = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size()) return false;
  if (v < lo || v > hi) return false;
  *out = v;
  return true;
}

uint64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return UINT64_MAX;  // unknown: no bound beyond the allocator's
  return sat_mul({int64_t(pages), int64_t(page)});
}

std::string human_bytes(uint64_t bytes) {
  if (bytes == UINT64_MAX) return "more than 16 EiB";
  if (bytes < 1024) return std::to_string(bytes) + " bytes";
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = double(bytes) / 1024.0;
  int u = 0;
  while (v >= 1024.0 && u < 5) v /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

void require_host_memory(const std::string& what, uint64_t bytes) {
  const uint64_t have = host_memory_bytes();
  MOEKIT_REQUIRE(bytes <= have, what, ": needs ", human_bytes(bytes),
                 " of host memory; this machine has ", human_bytes(have));
}

}  // namespace moekit
