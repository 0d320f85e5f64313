// moekit_host_overhead's device side (host_overhead_launch.cu), callable from C++20 host code.
#pragma once

#include <memory>

namespace moekit::host_overhead {

// Enqueues a kernel that keeps the GPU busy for `ns` nanoseconds on `stream`.
void spin(void* stream, unsigned long long ns);

// One kernel launch of a kind, for timing its host cost.
class Probe {
 public:
  enum Kind {
    kEmpty,       // <<<1, 32>>> of an empty kernel
    kChevron,     // <<<1, 32>>> with an argument of the decode GEMM's size (cudaLaunchKernel)
    kRuntime,     // cudaLaunchKernelEx (sm90::launch) with an argument of the decode GEMM's size
    kRuntimePdl,  // the same with the programmatic-dependent-launch attribute
    kDriverPdl,   // cuLaunchKernelEx (the driver's entry, through the runtime) with the same
    kGraph3,      // cudaGraphLaunch of three such launches captured as one graph
  };
  explicit Probe(void* stream);  // captures kGraph3's graph on stream
  ~Probe();
  bool available(Kind k) const;
  int launch(Kind k, void* stream) const;  // a cudaError_t

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// Host time of one cuTensorMapEncodeTiled (sm90::prefill::make_rows_map), us; -1 on failure.
double encode_us(int n);

}  // namespace moekit::host_overhead
