// Entry of the GPU test binary: without a CUDA device it says so and exits 77, which CTest
// reports as "Skipped" (SKIP_RETURN_CODE), so a CPU-only run shows the GPU tests were not run.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>

int main(int argc, char** argv) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIPPED: no CUDA device; the GPU tests (label gpu) need an H100 or H200\n");
    return 77;
  }
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  std::printf("GPU: %s, %d SMs, sm_%d%d\n", p.name, p.multiProcessorCount, p.major, p.minor);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
