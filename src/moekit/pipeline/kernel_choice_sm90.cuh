// moekit/pipeline/kernel_choice_sm90.cuh — the decode/prefill choice on the device, between
// route_plan and the GEMMs (oracle/kernel_choice.h says what it computes, oracle/tuning.h when
// the layer runs it: a band of token counts around the tuned crossover).
//
// One CTA reads the plan's per-active-expert row counts, sums the decode kernel's weight streams
// and the prefill kernel's slabs, and writes three ints:
//   out[0] = num_active if the decode kernel runs, else 0   (the decode GEMM's num_active)
//   out[1] = num_active if the prefill kernel runs, else 0  (the prefill GEMMs' num_active)
//   out[2] = 1: the prefill kernel, 0: the decode kernel    (permute's run flag; bench, tests)
// The layer launches both GEMM kernels after it; the one not chosen sees no active expert and
// returns at once with its counters at zero (the prefill kernel before its tile scan). Integer
// sums: the same choice on every run; no host sync, nothing allocated, capturable.
#pragma once

#include <cuda_runtime.h>

namespace moekit::sm90 {

struct ChoiceArgs {
  const int* num_active = nullptr;  // the plan's
  const int* count = nullptr;       // [num_active] rows per active expert
  int ratio_q = 0;                  // oracle/kernel_choice.h ratio_fixed(stream ratio)
  int decode_rows = 8;              // the decode kernel's chunk rows for this call (decode_chunk_rows)
  int* out = nullptr;               // [3]
};

cudaError_t launch_kernel_choice(const ChoiceArgs& a, cudaStream_t s);

}  // namespace moekit::sm90
