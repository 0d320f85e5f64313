// moekit/common/trap_record.cuh — where a kernel's bounded wait says what it waited for.
//
// A wait that cannot end (a protocol bug, a counter left from an earlier launch) traps, and the
// trap kills the context: printf's buffer is lost with it, and the host sees only "unspecified
// launch failure". So before it traps, the waiting thread writes a record of the wait (which
// wait, its block and thread, and the values it compared) to page-locked host memory mapped
// into the device (trap_record.h), which the host reads after the failed call. Several waiters
// may time out together: each site has its own slot, and in a slot the last writer wins.
#pragma once

#include <cstdint>

#include "moekit/common/ptx_sm90.cuh"
#include "moekit/common/trap_record.h"

namespace moekit::trap {

// Writes the record of site (when rec is set: host-mapped, kSlots x kInts ints): fill(put) puts
// the context values in order (at most kContext are kept).
template <typename Fill>
__device__ __forceinline__ void record_with(int* rec, int site, Fill&& fill) {
  if (!rec) return;
  volatile int* r = rec + (site % kSlots) * kInts;
  int n = 0;
  fill([&](int v) {
    if (n < kContext) r[4 + n++] = v;
  });
  r[1] = int(blockIdx.x);
  r[2] = int(threadIdx.x);
  r[3] = n;
  __threadfence_system();
  r[0] = site;  // last: a slot with its site set is complete
  __threadfence_system();
}
template <int N>
__device__ __forceinline__ void record(int* rec, int site, const int (&ctx)[N]) {
  static_assert(N <= kContext, "a trap record holds kContext values");
  record_with(rec, site, [&](auto put) {
#pragma unroll
    for (int i = 0; i < N; ++i) put(ctx[i]);
  });
}
template <int N>
__device__ __forceinline__ void record_and_trap(int* rec, int site, const int (&ctx)[N]) {
  record(rec, site, ctx);
  __trap();
}

}  // namespace moekit::trap
