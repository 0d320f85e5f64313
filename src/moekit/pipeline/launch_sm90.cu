// The SM90 layer's launches: recorded lists and the graphs that replay them (launch_sm90.cuh).
#include "moekit/pipeline/launch_sm90.cuh"

#include <algorithm>

namespace moekit::sm90 {

LaunchList*& launch_recorder() {
  thread_local LaunchList* r = nullptr;
  return r;
}

cudaError_t launch_recorded(LaunchList& l, int i, cudaStream_t s) {
  const LaunchList::Launch& x = l.launches[i];
  void* argv[LaunchList::kMaxArgs];
  l.arg_pointers(i, argv);
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = launch_config(x.grid, x.block, x.smem, s, x.pdl, &attr);
  return cudaLaunchKernelExC(&cfg, x.func, argv);
}

struct LaunchGraphs::Entry {
  uint32_t shape = 0;     // LaunchList::shape(); 0: free
  uint64_t clusters = 0;  // list_clusters() of the list it was built from
  long last_used = 0;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  struct Node {
    cudaGraphNode_t handle = nullptr;
    LaunchList::Launch launch;                        // what the executable graph launches now
    unsigned char bytes[LaunchList::kLaunchArgBytes];  // its argument bytes
    bool same(const LaunchList& l, int i) const {
      const LaunchList::Launch &a = l.launches[i], &b = launch;
      return a.func == b.func && a.grid.x == b.grid.x && a.grid.y == b.grid.y && a.grid.z == b.grid.z &&
             a.block.x == b.block.x && a.block.y == b.block.y && a.block.z == b.block.z && a.smem == b.smem &&
             a.arg_end - a.arg_begin == b.arg_end - b.arg_begin &&
             std::memcmp(l.args + a.arg_begin, bytes, size_t(a.arg_end - a.arg_begin)) == 0;
    }
    int first_diff(const LaunchList& l, int i) const {
      const LaunchList::Launch& a = l.launches[i];
      if (a.func != launch.func || a.arg_end - a.arg_begin != launch.arg_end - launch.arg_begin) return -1;
      for (int j = 0; j < a.arg_end - a.arg_begin; ++j)
        if (l.args[a.arg_begin + j] != bytes[j]) return j;
      return -1;
    }
    void keep(const LaunchList& l, int i) {
      launch = l.launches[i];
      std::memcpy(bytes, l.args + launch.arg_begin, size_t(launch.arg_end - launch.arg_begin));
    }
  } node[LaunchList::kMaxLaunches];
};

LaunchGraphs::~LaunchGraphs() {
  if (entries_) {
    for (int i = 0; i < kEntries; ++i) release(entries_[i]);
    delete[] entries_;
  }
  if (capture_) cudaStreamDestroy(capture_);
}

void LaunchGraphs::release(Entry& e) {
  // An executable graph still running is freed when it completes.
  if (e.exec) cudaGraphExecDestroy(e.exec);
  if (e.graph) cudaGraphDestroy(e.graph);
  e.exec = nullptr;
  e.graph = nullptr;
  e.shape = 0;
}

// The CTAs per cluster a kernel was compiled for (__cluster_dims__; 0: none), cached per kernel.
cudaError_t LaunchGraphs::cluster_of(const void* func, int* ctas) {
  for (int i = 0; i < n_known_; ++i)
    if (known_[i].func == func) {
      *ctas = known_[i].ctas;
      return cudaSuccess;
    }
  cudaFuncAttributes fa;
  if (const cudaError_t err = cudaFuncGetAttributes(&fa, func); err != cudaSuccess) return err;
  const int c = fa.requiredClusterWidth * fa.requiredClusterHeight * fa.requiredClusterDepth;
  if (n_known_ < kKnown) known_[n_known_++] = {func, c};
  *ctas = c;
  return cudaSuccess;
}

// Every launch's cluster_of in 5 bits (portable clusters are 1-8 CTAs, others up to 16).
cudaError_t LaunchGraphs::list_clusters(const LaunchList& l, uint64_t* out) {
  static_assert(LaunchList::kMaxLaunches * 5 <= 64, "LaunchGraphs: cluster key bits");
  uint64_t key = 0;
  for (int i = 0; i < l.n; ++i) {
    int c = 0;
    if (const cudaError_t err = cluster_of(l.launches[i].func, &c); err != cudaSuccess) return err;
    key |= uint64_t(std::min(c, 31)) << (5 * i);
  }
  *out = key;
  return cudaSuccess;
}

cudaError_t LaunchGraphs::direct(LaunchList& l, cudaStream_t s) {
  ++stats_.direct;
  for (int i = 0; i < l.n; ++i)
    if (const cudaError_t e = launch_recorded(l, i, s); e != cudaSuccess) return e;
  return cudaSuccess;
}

// Captures the list on the private stream: the graph's PDL edges are the ones stream launches
// make, and each launch's node is the capture's dependency right after it.
cudaError_t LaunchGraphs::build(Entry& e, LaunchList& l, uint64_t clusters) {
  if (!capture_)
    if (const cudaError_t err = cudaStreamCreateWithFlags(&capture_, cudaStreamNonBlocking); err != cudaSuccess)
      return err;
  cudaError_t err = cudaStreamBeginCapture(capture_, cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) return err;
  for (int i = 0; i < l.n && err == cudaSuccess; ++i) {
    err = launch_recorded(l, i, capture_);
    cudaStreamCaptureStatus st;
    const cudaGraphNode_t* deps = nullptr;
    size_t nd = 0;
    if (err == cudaSuccess) err = cudaStreamGetCaptureInfo(capture_, &st, nullptr, nullptr, &deps, nullptr, &nd);
    if (err == cudaSuccess && nd != 1) err = cudaErrorStreamCaptureUnsupported;
    if (err == cudaSuccess) e.node[i].handle = deps[0];
  }
  cudaGraph_t g = nullptr;
  const cudaError_t end = cudaStreamEndCapture(capture_, &g);
  if (err == cudaSuccess) err = end;
  if (err == cudaSuccess) err = cudaGraphInstantiate(&e.exec, g, 0);
  if (err != cudaSuccess) {
    if (g) cudaGraphDestroy(g);
    e.exec = nullptr;
    return err;
  }
  e.graph = g;
  e.shape = l.shape();
  e.clusters = clusters;
  for (int i = 0; i < l.n; ++i) e.node[i].keep(l, i);
  ++stats_.builds;
  return cudaSuccess;
}

cudaError_t LaunchGraphs::run(LaunchList& l, cudaStream_t s) {
  if (l.n == 0) return cudaSuccess;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (!enabled_ || cudaStreamIsCapturing(s, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return direct(l, s);
  }
  // A kernel node keeps the cluster shape it was captured with (cudaKernelNodeParams has none):
  // the node of route_plan_fused's one-CTA kernel updated to its cluster kernel ended in an
  // illegal instruction (error 715) on an H200. Lists whose kernels differ in compile-time
  // cluster dimensions get graphs of their own.
  uint64_t clusters = 0;
  if (const cudaError_t err = list_clusters(l, &clusters); err != cudaSuccess) {
    cudaGetLastError();
    return direct(l, s);
  }
  if (!entries_) entries_ = new Entry[kEntries];
  const uint32_t shape = l.shape();
  Entry* e = nullptr;
  for (int i = 0; i < kEntries && !e; ++i)
    if (entries_[i].shape == shape && entries_[i].clusters == clusters) e = &entries_[i];
  if (!e) {
    stats_.last_updated = 0;
    e = &entries_[0];  // a free entry, else the least recently used
    for (int i = 1; i < kEntries; ++i)
      if (e->shape != 0 && (entries_[i].shape == 0 || entries_[i].last_used < e->last_used)) e = &entries_[i];
    release(*e);
    if (build(*e, l, clusters) != cudaSuccess) {
      // No graph for this layer (a driver without programmatic edges in graphs, say): launch as
      // before from now on.
      cudaGetLastError();
      release(*e);
      enabled_ = false;
      return direct(l, s);
    }
  } else {
    // Launch lists of one shape differ in their arguments, grids and kernels (token count,
    // chunk rows, buffers): update the nodes that differ.
    stats_.last_updated = 0;
    for (int i = 0; i < l.n; ++i) {
      Entry::Node& nd = e->node[i];
      if (nd.same(l, i)) continue;
      stats_.last_updated |= 1u << i;
      stats_.first_diff[i] = nd.first_diff(l, i);
      const LaunchList::Launch& x = l.launches[i];
      void* argv[LaunchList::kMaxArgs];
      l.arg_pointers(i, argv);
      cudaKernelNodeParams p = {};
      p.func = const_cast<void*>(x.func);
      p.gridDim = x.grid;
      p.blockDim = x.block;
      p.sharedMemBytes = unsigned(x.smem);
      p.kernelParams = argv;
      if (const cudaError_t err = cudaGraphExecKernelNodeSetParams(e->exec, nd.handle, &p); err != cudaSuccess)
        return err;
      nd.keep(l, i);
      ++stats_.node_updates;
    }
  }
  e->last_used = ++tick_;
  ++stats_.graph_launches;
  return cudaGraphLaunch(e->exec, s);
}

}  // namespace moekit::sm90
