// The device side of moekit_host_overhead (host_overhead.cpp): a kernel that keeps the GPU busy,
// and the launches whose host cost it measures. C++17 (the CUDA dialect CMake gives nvcc here).
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>

#include "host_overhead.h"
#include "moekit/experts/sm90_moe_gemm.h"
#include "moekit/experts/sm90_prefill_gemm.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::host_overhead {

namespace {

// Keeps the GPU busy for `ns` nanoseconds (%globaltimer).
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

__global__ void empty_kernel() {}

// An argument of the decode GEMM's size (sm90::FusedArgs), as the layer's launches pass.
struct BigArg {
  unsigned char bytes[sizeof(sm90::FusedArgs)];
};
__global__ void big_arg_kernel(const BigArg a) {
  if (a.bytes[0] == 0xff && threadIdx.x == 1234) asm volatile("trap;");
}

using LaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);

}  // namespace

void spin(void* stream, unsigned long long ns) {
  spin_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(ns);
}

struct Probe::State {
  BigArg big{};
  LaunchEx launch_ex = nullptr;
  cudaKernel_t kernel = nullptr;
  cudaGraphExec_t graph = nullptr;
};

Probe::Probe(void* stream) : s_(new State) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuLaunchKernelEx", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
      q == cudaDriverEntryPointSuccess && cudaGetKernel(&s_->kernel, reinterpret_cast<const void*>(big_arg_kernel)) == cudaSuccess)
    s_->launch_ex = reinterpret_cast<LaunchEx>(fn);
  // Three launches as the layer's decode path makes them (the first without PDL), as one graph.
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaGraph_t g = nullptr;
  if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
    for (int i = 0; i < 3; ++i) sm90::launch(big_arg_kernel, dim3(1), dim3(32), 0, s, i > 0, s_->big);
    if (cudaStreamEndCapture(s, &g) == cudaSuccess && cudaGraphInstantiate(&s_->graph, g, 0) != cudaSuccess)
      s_->graph = nullptr;
    if (g) cudaGraphDestroy(g);
  }
  cudaGetLastError();
}

Probe::~Probe() {
  if (s_->graph) cudaGraphExecDestroy(s_->graph);
}

bool Probe::available(Kind k) const {
  if (k == kDriverPdl) return s_->launch_ex != nullptr;
  if (k == kGraph3) return s_->graph != nullptr;
  return true;
}

int Probe::launch(Kind k, void* stream) const {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (k) {
    case kEmpty: empty_kernel<<<1, 32, 0, s>>>(); return int(cudaGetLastError());
    case kChevron: big_arg_kernel<<<1, 32, 0, s>>>(s_->big); return int(cudaGetLastError());
    case kRuntime: return int(sm90::launch(big_arg_kernel, dim3(1), dim3(32), 0, s, false, s_->big));
    case kRuntimePdl: return int(sm90::launch(big_arg_kernel, dim3(1), dim3(32), 0, s, true, s_->big));
    case kDriverPdl: {
      CUlaunchAttribute attr{};
      attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attr.value.programmaticStreamSerializationAllowed = 1;
      CUlaunchConfig cfg{};
      cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
      cfg.blockDimX = 32;
      cfg.blockDimY = cfg.blockDimZ = 1;
      cfg.hStream = reinterpret_cast<CUstream>(s);
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      void* params[] = {&s_->big};
      return s_->launch_ex(&cfg, reinterpret_cast<CUfunction>(s_->kernel), params, nullptr) == CUDA_SUCCESS
                 ? 0
                 : int(cudaErrorLaunchFailure);
    }
    case kGraph3: return int(cudaGraphLaunch(s_->graph, s));
  }
  return int(cudaErrorInvalidValue);
}

double encode_us(int n) {
  void* buf = nullptr;
  if (cudaMalloc(&buf, 1 << 20) != cudaSuccess) return -1;
  CUtensorMap map{};
  bool ok = true;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i)
    ok &= sm90::prefill::make_rows_map(&map, static_cast<const uint16_t*>(buf), 2048 + (i & 7), 2880, 16) == cudaSuccess;
  const auto t1 = std::chrono::steady_clock::now();
  cudaFree(buf);
  return ok ? std::chrono::duration<double, std::micro>(t1 - t0).count() / n : -1;
}

}  // namespace moekit::host_overhead
