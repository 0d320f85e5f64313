// moekit_consumer_rate: how fast the decode GEMM's consumer loop (sm90_moe_gemm.cuh
// consume_stage: dequantize + mma.sync) runs when its data is already in shared memory, for a
// given number of consumer warps per CTA and CTAs per SM. No HBM traffic, no producer, no
// barriers: the upper bound on what the consumers of the real kernel can take in.
//
//   moekit_consumer_rate [stages]      (default 4000 stages of 4 k-blocks per warp)
//
// Prints, per configuration, ns per 16 x 64 atom per warp and the weight bytes (codes + scales)
// per second the whole GPU would consume at that rate.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "moekit/experts/sm90_moe_gemm.cuh"

namespace {

using namespace moekit;
using namespace moekit::sm90;
constexpr WeightFormat kF = WeightFormat::kMxfp4;
using T = Traits<kF>;

// Two stages in shared memory, filled with random codes, scales in the single-multiply range and
// random bf16 activations; every warp consumes them alternately, `stages` in all (as subtile
// warp % 4; the alternation keeps the compiler from hoisting the loads out of the loop).
template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32) consumer_kernel(int stages, float* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint32_t seed = 0x9e3779b9u * (threadIdx.x + 1);
  for (int i = threadIdx.x; i < 2 * T::kStageBytes / 4; i += blockDim.x) {
    seed = seed * 1664525u + 1013904223u;
    uint32_t v = seed;
    const int byte = (i * 4) % T::kStageBytes;
    if (byte >= T::kStageCode && byte < T::kStageCode + T::kStageScale) v = 0x76777879u;  // E8M0 118..121
    if (byte >= T::kStageCode + T::kStageScale) v &= 0xbfffbfffu;                      // finite bf16
    reinterpret_cast<uint32_t*>(smem)[i] = v;
  }
  __syncthreads();
  const int warp = (threadIdx.x >> 5) % kSubtiles, lane = threadIdx.x & 31;
  const uint32_t base = ptx::smem_base(smem);
  const uint32_t cs = base + warp * T::kAtomCode;
  const uint32_t ss = base + T::kStageCode + warp * T::kAtomScale;
  const uint32_t xs = base + T::kStageCode + T::kStageScale + (lane & 7) * T::kXRow + (lane >> 3) * 16;
  float acc2[2][kTokens / 8][4] = {};
  for (int s = 0; s < stages; ++s) {
    const int o = (s & 1) * T::kStageBytes;
    consume_stage<kF, true, T::kStageK, kTokens>(cs + o, ss + o, xs + uint32_t(o), lane, T::kStageK, 1, acc2);
  }
  float v = 0;
  for (int c = 0; c < 2; ++c)
    for (int i = 0; i < 4; ++i) v += acc2[c][0][i];
  if (v == 1234.5f) *sink = v;  // keeps the work alive
}

template <int kWarps>
void run(int ctas_per_sm, int sms, int stages, float* sink) {
  auto k = consumer_kernel<kWarps>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * T::kStageBytes);
  int fit = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, k, kWarps * 32, 2 * T::kStageBytes);
  if (fit < ctas_per_sm) {
    std::printf("%2d warps x %d CTAs/SM: does not fit (%d)\n", kWarps, ctas_per_sm, fit);
    return;
  }
  cudaFuncAttributes fa{};
  cudaFuncGetAttributes(&fa, k);
  const int grid = sms * ctas_per_sm;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  k<<<grid, kWarps * 32, 2 * T::kStageBytes>>>(8, sink);  // warm-up
  cudaEventRecord(a);
  k<<<grid, kWarps * 32, 2 * T::kStageBytes>>>(stages, sink);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  const double atoms_per_warp = double(stages) * T::kStageK;
  const double ns_atom = ms * 1e6 / atoms_per_warp;
  const double bytes = double(grid) * kWarps * atoms_per_warp * (T::kAtomCode + T::kAtomScale);
  std::printf("%2d consumer warps x %d CTAs/SM (%3d regs): %6.1f ns per atom per warp, %5.2f TB/s of weights\n",
              kWarps, ctas_per_sm, fa.numRegs, ns_atom, bytes / (ms * 1e-3) / 1e12);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

}  // namespace

int main(int argc, char** argv) {
  const int stages = argc > 1 ? std::atoi(argv[1]) : 4000;
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, dev);
  std::printf("moekit_consumer_rate: %s, %d SMs; MXFP4 consume_stage on shared-memory data, %d stages of %d k-blocks\n",
              prop.name, sms, stages, T::kStageK);
  float* sink = nullptr;
  cudaMalloc(&sink, 4);
  for (int c = 1; c <= 4; ++c) run<4>(c, sms, stages, sink);
  run<8>(1, sms, stages, sink);
  run<8>(2, sms, stages, sink);
  run<12>(1, sms, stages, sink);
  run<16>(1, sms, stages, sink);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
