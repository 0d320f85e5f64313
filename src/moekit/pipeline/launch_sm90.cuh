// moekit/pipeline/launch_sm90.cuh — how the SM90 layer's kernels reach the GPU.
//
//   launch      every kernel of a layer call goes through it: cudaLaunchKernelEx, with the
//               programmatic-dependent-launch attribute where asked, or, while a LaunchList is
//               recording on this thread, into that list instead (nothing reaches the GPU).
//   LaunchList  one call's launches as data: function, grid, block, shared memory, PDL and the
//               argument bytes (each argument converted to the kernel's parameter type first).
//   LaunchGraphs
//               runs a list on a stream. Eager calls replay a CUDA graph of the same shape
//               (launch count and PDL edges) and the same compile-time cluster dimensions of
//               each launch's kernel, kept per layer: built once by capturing the list on a
//               private stream, then per call only the nodes whose launch differs from the
//               graph's are updated (cudaGraphExecKernelNodeSetParams) before one cudaGraphLaunch.
//               A node keeps the cluster shape it was captured with, so it is never updated
//               from a non-cluster kernel to a cluster kernel or between cluster sizes (the
//               fused routing kernel's one CTA and clusters of 2-8 get a graph each).
//               A repeated call (same tensors, same token count) updates nothing: the host pays
//               one graph launch instead of one launch per kernel (H100: 3 launches with PDL
//               8.3 us, a graph of 3 1.5 us; docs/perf/log.md). On a stream that is being
//               captured (the caller's own graph) the list is launched kernel by kernel, as
//               before. Not thread-safe: one per layer, whose calls come from one thread.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace moekit::sm90 {

struct LaunchList {
  static constexpr int kMaxLaunches = 12;
  static constexpr int kMaxArgs = 16;
  static constexpr int kArgBytes = 8192;
  static constexpr int kLaunchArgBytes = 1024;  // one launch's arguments (FusedArgs: 496)

  struct Launch {
    const void* func = nullptr;
    dim3 grid, block;
    size_t smem = 0;
    bool pdl = false;
    int nargs = 0;
    int arg_begin = 0, arg_end = 0;  // the launch's argument bytes in LaunchList::args
    int arg_off[kMaxArgs] = {};      // each argument's offset in LaunchList::args
  };

  int n = 0;
  int used = 0;  // argument bytes used
  Launch launches[kMaxLaunches];
  alignas(64) unsigned char args[kArgBytes];

  void clear() { n = used = 0; }
  // Pointers to launch i's arguments (what cudaLaunchKernelExC and kernel nodes take).
  void arg_pointers(int i, void** out) {
    for (int j = 0; j < launches[i].nargs; ++j) out[j] = args + launches[i].arg_off[j];
  }
  // The shape a graph of this list has: the launch count and which launches wait through PDL.
  uint32_t shape() const {
    uint32_t s = uint32_t(n);
    for (int i = 0; i < n; ++i) s |= uint32_t(launches[i].pdl) << (8 + i);
    return s;
  }

  template <typename... P>
  cudaError_t add(const void* func, dim3 grid, dim3 block, size_t smem, bool pdl, const P&... a) {
    static_assert(sizeof...(P) <= kMaxArgs, "LaunchList: too many kernel arguments");
    if (n == kMaxLaunches) return cudaErrorLaunchOutOfResources;
    used = (used + 63) / 64 * 64;  // each launch's bytes laid out alike wherever it sits in a list
    Launch& l = launches[n];
    l = Launch{func, grid, block, smem, pdl, 0, used, used, {}};
    bool fits = true;
    (put(l, a, fits), ...);
    if (!fits || used - l.arg_begin > kLaunchArgBytes) return cudaErrorLaunchOutOfResources;
    l.arg_end = used;
    ++n;
    return cudaSuccess;
  }

 private:
  template <typename T>
  void put(Launch& l, const T& v, bool& fits) {
    static_assert(std::is_trivially_copyable_v<T>, "kernel arguments are copied as bytes");
    const int off = int((size_t(used) + alignof(T) - 1) / alignof(T) * alignof(T));
    if (!fits || off + int(sizeof(T)) > kArgBytes) {
      fits = false;
      return;
    }
    std::memset(args + used, 0, size_t(off - used));  // alignment gaps compare equal
    std::memcpy(args + off, &v, sizeof(T));
    l.arg_off[l.nargs++] = off;
    used = off + int(sizeof(T));
  }
};

// The list recording this thread's launches (nullptr: launches go to the GPU).
LaunchList*& launch_recorder();

// Records this thread's launches into l for its lifetime.
class RecordLaunches {
 public:
  explicit RecordLaunches(LaunchList* l) : prev_(launch_recorder()) {
    l->clear();
    launch_recorder() = l;
  }
  ~RecordLaunches() { launch_recorder() = prev_; }
  RecordLaunches(const RecordLaunches&) = delete;
  RecordLaunches& operator=(const RecordLaunches&) = delete;

 private:
  LaunchList* prev_;
};

// An argument as the kernel's parameter type P: the caller's object itself where it has that
// type (no copy), else converted as cudaLaunchKernelEx would convert it.
template <typename P, typename A>
decltype(auto) as_param(const A& a) {
  if constexpr (std::is_same_v<std::remove_cv_t<P>, A>) return (a);
  else return static_cast<std::remove_cv_t<P>>(a);
}

// A launch's configuration on s, with the programmatic-dependent-launch attribute (in *attr)
// when pdl is set.
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t s, bool pdl,
                                        cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr->val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cfg;
}

// Launches with the programmatic-dependent-launch attribute when pdl is set (or records).
// Argument structs are compared bytewise (LaunchGraphs), so they have no implicit padding: a
// compiler may leave any bytes there, even in a value-initialized copy (tests/test_launch_args.cu
// checks every struct the layer launches with).
template <typename... P, typename... Args>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, bool pdl,
                   const Args&... args) {
  static_assert(sizeof...(P) == sizeof...(Args), "launch: argument count");
  if (LaunchList* r = launch_recorder())
    return r->add(reinterpret_cast<const void*>(kernel), grid, block, smem, pdl, as_param<P>(args)...);
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = launch_config(grid, block, smem, s, pdl, &attr);
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// Launch i of a recorded list, now, on s.
cudaError_t launch_recorded(LaunchList& l, int i, cudaStream_t s);

class LaunchGraphs {
 public:
  struct Stats {
    long graph_launches = 0;  // calls that replayed a graph
    long node_updates = 0;    // kernel nodes updated before a replay
    long builds = 0;          // graphs built (one per shape, or again after eviction)
    long direct = 0;          // calls launched kernel by kernel (capturing stream, graphs off)
    // The last replay: which nodes it updated (bit i: launch i) and, for each, the first
    // argument byte that differed (-1: the launch itself, grid, block or kernel, differed).
    uint32_t last_updated = 0;
    int first_diff[LaunchList::kMaxLaunches] = {};
  };
  explicit LaunchGraphs(bool enabled) : enabled_(enabled) {}
  ~LaunchGraphs();
  LaunchGraphs(const LaunchGraphs&) = delete;
  LaunchGraphs& operator=(const LaunchGraphs&) = delete;

  // Runs the list on s (see the header comment). A graph that cannot be built turns the graphs
  // off for this object and the list is launched kernel by kernel.
  cudaError_t run(LaunchList& l, cudaStream_t s);
  bool enabled() const { return enabled_; }
  const Stats& stats() const { return stats_; }

 private:
  // Graphs kept: a shape can take one per cluster configuration of its launches (the fused
  // routing kernel: one CTA, or a cluster of 2, 4 or 8).
  static constexpr int kEntries = 8;
  static constexpr int kKnown = 32;  // kernels whose cluster dimensions are cached
  struct Entry;
  cudaError_t direct(LaunchList& l, cudaStream_t s);
  cudaError_t build(Entry& e, LaunchList& l, uint64_t clusters);
  void release(Entry& e);
  cudaError_t cluster_of(const void* func, int* ctas);
  cudaError_t list_clusters(const LaunchList& l, uint64_t* out);

  bool enabled_;
  Stats stats_;
  cudaStream_t capture_ = nullptr;
  Entry* entries_ = nullptr;  // kEntries, allocated with the first graph
  long tick_ = 0;
  struct Known {
    const void* func;
    int ctas;
  } known_[kKnown] = {};
  int n_known_ = 0;
};

}  // namespace moekit::sm90
