// moekit/common/trap_record.h — the host side of the kernels' trap records (trap_record.cuh).
#pragma once

#include <cstdint>
#include <string>

namespace moekit::trap {

constexpr int kSlots = 16;  // one per wait site (Site)
constexpr int kInts = 96;   // per slot: site, block, thread, count, then up to kContext values
constexpr int kContext = kInts - 4;
// A bounded wait gives up after this long (ns of %globaltimer): far beyond any wait a correct
// launch has (milliseconds at most, seconds under compute-sanitizer), short enough that a hang
// ends as an error within a minute.
constexpr uint64_t kWaitLimitNs = 30ull * 1000 * 1000 * 1000;

// Wait sites, the slot each writes (trap_record.cpp names them).
enum Site : int {
  kDecodeGemm2Wait = 1,  // decode kernel: a GEMM2 stage's GEMM1 columns (done1)
  kDecodeSliceWait = 2,  // decode kernel: a segment's earlier slices (counters)
  kDecodeEmptyWait = 3,  // decode kernel producer: a free ring stage
  kDecodeFullWait = 4,   // decode kernel consumers: a filled ring stage
  kPrefillFull = 5,      // prefill kernel consumers: a filled stage
  kPrefillEmpty = 6,     // prefill kernel producer: a free stage
  kPrefillTileFull = 7,  // prefill kernel consumers: the next tile's slot
  kPrefillTileEmpty = 8, // prefill kernel producer: a tile slot's release
};

// The device address of the process's record (page-locked, mapped, zeroed), allocated at the
// first call; nullptr where it cannot be (no device, out of page-locked memory: the kernels then
// trap without a record). Call it outside stream capture (a layer does at construction); later
// calls return the same address.
int* device_record();
// The device address if device_record() has run, else nullptr (no allocation: safe anywhere,
// including during capture).
int* device_record_if_ready();
// What the records say, one line per site that wrote one ("" when none did), e.g.
// "decode GEMM2 wait for GEMM1 columns timed out (block 17, thread 128): active expert 3, ...".
// Reading is safe after a failed call: the memory is the host's.
std::string report();
// "; " + report(), or "" when no record was written: the end of a failed call's error message.
std::string report_suffix();

}  // namespace moekit::trap
