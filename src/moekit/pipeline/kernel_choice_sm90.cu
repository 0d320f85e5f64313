#include "moekit/pipeline/kernel_choice_sm90.cuh"

#include "moekit/common/ptx_sm90.cuh"
#include "moekit/oracle/kernel_choice.h"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::sm90 {

namespace {

constexpr int kChoiceThreads = 256;

// Launched with PDL behind route_plan (which lets its dependents start at once): it sets up while
// route_plan runs, waits for its plan, and lets the kernels after it launch; they wait for this
// grid to finish before they read out[]. A plain launch would put a full launch gap between
// route_plan and the GEMMs of every call in the band.
__global__ void __launch_bounds__(kChoiceThreads) kernel_choice_kernel(ChoiceArgs a) {
  __shared__ unsigned long long s_streams, s_slabs;
  if (threadIdx.x == 0) s_streams = s_slabs = 0;
  __syncthreads();
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const int n = *a.num_active;
  ChoiceCounts c;
  for (int i = threadIdx.x; i < n; i += kChoiceThreads) add_expert_rows(c, a.count[i], a.decode_rows);
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
  return launch(kernel_choice_kernel, dim3(1), dim3(kChoiceThreads), 0, s, true, a);
}

}  // namespace moekit::sm90
