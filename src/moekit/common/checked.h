// moekit/common/checked.h — sizes in 64 bits that cannot wrap, whole-string number parsing, and
// the host-memory bound that large allocations are checked against before they are made.
//
// Sizes that come from files or the command line are multiplied with saturating arithmetic: a
// product that does not fit 64 bits becomes UINT64_MAX, which no machine has, so the memory check
// refuses it with the same message as any other request that is too large.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

namespace moekit {

// Saturating unsigned arithmetic: UINT64_MAX on overflow (or for a negative factor).
uint64_t sat_mul(std::initializer_list<int64_t> factors);
uint64_t sat_add(uint64_t a, uint64_t b);

// A decimal integer spelled by the whole string: an optional '-' and digits, nothing else (no
// spaces, '+', hex, exponent or fraction). False when malformed or outside [lo, hi].
bool parse_whole_int(std::string_view s, int64_t lo, int64_t hi, int64_t* out);

// Physical memory of this machine in bytes: the bound for one command's host allocations.
uint64_t host_memory_bytes();
// "1.5 GiB", "12 bytes", or "more than 16 EiB" for UINT64_MAX (an overflowed size).
std::string human_bytes(uint64_t bytes);
// Throws moekit::Error "WHAT: needs N of host memory; this machine has M" when bytes exceeds the
// host's physical memory.
void require_host_memory(const std::string& what, uint64_t bytes);

}  // namespace moekit
