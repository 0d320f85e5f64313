#include "moekit/pipeline/kernel_choice_sm90.cuh"

#include "moekit/oracle/kernel_choice.h"

namespace moekit::sm90 {

namespace {

constexpr int kChoiceThreads = 256;

// Launched without PDL: it starts once route_plan has finished, and the kernels after it (PDL)
// wait for it to finish before they read out[].
__global__ void __launch_bounds__(kChoiceThreads) kernel_choice_kernel(ChoiceArgs a) {
  __shared__ unsigned long long s_streams, s_slabs;
  if (threadIdx.x == 0) s_streams = s_slabs = 0;
  __syncthreads();
  const int n = *a.num_active;
  ChoiceCounts c;
  for (int i = threadIdx.x; i < n; i += kChoiceThreads) add_expert_rows(c, a.count[i]);
  atomicAdd(&s_streams, (unsigned long long)c.streams);
  atomicAdd(&s_slabs, (unsigned long long)c.slabs);
  __syncthreads();
  if (threadIdx.x == 0) {
    ChoiceCounts all;
    all.streams = int64_t(s_streams);
    all.slabs = int64_t(s_slabs);
    const bool prefill = prefill_wins(all, a.ratio_q);
    a.out[0] = prefill ? 0 : n;
    a.out[1] = prefill ? n : 0;
    a.out[2] = prefill ? 1 : 0;
  }
}

}  // namespace

cudaError_t launch_kernel_choice(const ChoiceArgs& a, cudaStream_t s) {
  kernel_choice_kernel<<<1, kChoiceThreads, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace moekit::sm90
