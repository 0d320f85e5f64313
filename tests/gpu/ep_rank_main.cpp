// Entry of moekit_ep_rank_tests: one rank's side of the multi-process EP scenarios
// (test_ep_rank.cpp), started by EpMultiProcess.* once per rank. The layers' split-K choice is
// fixed (whole segments) so that a rank's GEMMs add in the same order as the single-GPU layer's.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  setenv("MOEKIT_SLICE_COST", "1000000", 1);
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off (nothing here uses it)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
