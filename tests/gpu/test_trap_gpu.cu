// A bounded mbarrier wait that cannot end: it must trap with a record, and the host must read
// the record after the failed call (common/trap_record.h). The trap ends the CUDA context, so the
// case runs in a child process (a death test, re-executed: the parent's context stays out of it).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "moekit/common/ptx_sm90.cuh"
#include "moekit/common/trap_record.cuh"
#include "moekit/common/trap_record.h"

namespace {

// Every thread waits on a barrier that counts two arrivals and gets one: past limit_ns each
// records (site kDecodeFullWait, context 7, 11) and traps.
__global__ void wait_forever(int* rec, unsigned long long limit_ns) {
  __shared__ alignas(moekit::ptx::kBarrierLine) unsigned long long bar[moekit::ptx::kBarrierLine / 8];
  const uint32_t b = moekit::ptx::smem_addr(bar);
  if (threadIdx.x == 0) {
    moekit::ptx::mbar_init(b, 2);
    moekit::ptx::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) moekit::ptx::mbar_arrive(b);
  moekit::ptx::mbar_wait<1000>(b, 0, limit_ns, [&] {
    const int ctx[] = {7, 11};
    moekit::trap::record_and_trap(rec, moekit::trap::kDecodeFullWait, ctx);
  });
}

// The child's side: launch, read the error and the record, exit 3 on a failed launch.
[[noreturn]] void run_the_wait() {
  int* rec = moekit::trap::device_record();
  if (!rec) std::exit(4);
  wait_forever<<<1, 64>>>(rec, 1000ull * 1000);  // 1 ms
  const cudaError_t e = cudaDeviceSynchronize();
  std::fprintf(stderr, "%s; %s\n", cudaGetErrorString(e), moekit::trap::report().c_str());
  std::exit(e == cudaSuccess ? 5 : 3);
}

}  // namespace

TEST(TrapRecord, ATimedOutWaitTrapsAndSaysWhat) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(run_the_wait(), testing::ExitedWithCode(3),
              "decode consumer wait for a filled stage timed out \\(block 0, thread [0-9]+\\): stage 7, parity 11");
}
