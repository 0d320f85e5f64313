// The backends built into this binary. GPU backends are listed only when CUDA was built
// (MOEKIT_WITH_CUDA); the CPU ones always are.
#include <algorithm>

#include "moekit/backends/cpu_backend.h"
#include "moekit/oracle/oracle.h"

#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "moekit/backends/sm90_backend.h"
#endif

namespace moekit {

const std::vector<const Backend*>& all_backends() {
  static const std::vector<const Backend*> list = [] {
    std::vector<const Backend*> v = {&cpu_backend(), &cpu_batched_backend()};
#ifdef MOEKIT_WITH_CUDA
    for (const Backend* b : sm90_backends()) v.push_back(b);
#endif
    std::stable_sort(v.begin(), v.end(), [](const Backend* a, const Backend* b) {
      return a->caps().priority > b->caps().priority;
    });
    return v;
  }();
  return list;
}

DeviceInfo DeviceInfo::detect(int index) {
  DeviceInfo d;
#ifdef MOEKIT_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess) d.gpus = n;
  else cudaGetLastError();  // clear the "no device" error
  if (n > index && index >= 0) {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, index) == cudaSuccess) {
      d.gpu = true;
      d.index = index;
      d.name = p.name;
      d.cc_major = p.major;
      d.cc_minor = p.minor;
      d.sm_count = p.multiProcessorCount;
      d.memory = p.totalGlobalMem;
    }
  }
#else
  (void)index;
#endif
  return d;
}

}  // namespace moekit
