// The host side of the kernels' trap records (trap_record.h, trap_record.cuh).
#include "moekit/common/trap_record.h"

#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <string>


namespace moekit::trap {

namespace {
int* g_host = nullptr;
int* g_device = nullptr;
std::once_flag g_once;

struct SiteInfo {
  const char* what;
  const char* names[kContext];  // the context values in the order the kernel writes them
};
// The prefill kernel's waits record the same context (sm90_prefill_gemm.cuh wait_bar).
SiteInfo prefill_wait(const char* what) {
  return {what,
          {"barrier", "parity", "stages", "phase parities (bit b: barrier b)", "slot 0 tile", "slot 0 rows",
           "slot 0 variant", "slot 0 first group", "slot 1 tile", "slot 1 rows", "slot 1 variant",
           "slot 1 first group", "SM"}};
}
const SiteInfo* info(int site) {
  static const SiteInfo kGemm2{"decode GEMM2 wait for GEMM1 columns",
                               {"active expert", "expert", "first group", "last group", "target", "ready end",
                                "done[first]", "task", "tasks", "phase-1 tasks", "phase-2 tasks", "task counter",
                                "exit count", "active experts", "chunks", "chunk rows", "grid", "groups"}};
  static const SiteInfo kSlice{"decode slice wait",
                               {"segment", "counter", "slices", "task counter", "exit count", "chunk rows", "grid"}};
  static const SiteInfo kEmpty{"decode producer wait for a free stage",
                               {"stage", "parity", "task", "tasks", "task counter", "exit count", "chunk rows", "grid"}};
  static const SiteInfo kFull{"decode consumer wait for a filled stage",
                              {"stage", "parity", "task phase", "task", "step", "chunk rows", "grid"}};
  static const SiteInfo kPFull = prefill_wait("prefill consumer wait for a filled stage");
  static const SiteInfo kPEmpty = prefill_wait("prefill producer wait for a free stage");
  static const SiteInfo kPTileFull = prefill_wait("prefill consumer wait for a tile slot");
  static const SiteInfo kPTileEmpty = prefill_wait("prefill producer wait for a tile slot's release");
  switch (site) {
    case kPrefillFull: return &kPFull;
    case kPrefillEmpty: return &kPEmpty;
    case kPrefillTileFull: return &kPTileFull;
    case kPrefillTileEmpty: return &kPTileEmpty;
    case kDecodeGemm2Wait: return &kGemm2;
    case kDecodeSliceWait: return &kSlice;
    case kDecodeEmptyWait: return &kEmpty;
    case kDecodeFullWait: return &kFull;
    default: return nullptr;
  }
}
}  // namespace

int* device_record() {
  std::call_once(g_once, [] {
    void* h = nullptr;
    const size_t bytes = size_t(kSlots) * kInts * sizeof(int);
    if (cudaHostAlloc(&h, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    std::memset(h, 0, bytes);
    void* d = nullptr;
    if (cudaHostGetDevicePointer(&d, h, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaFreeHost(h);
      return;
    }
    g_host = static_cast<int*>(h);
    g_device = static_cast<int*>(d);
  });
  return g_device;
}

int* device_record_if_ready() { return g_device; }

std::string report() {
  if (!g_host) return "";
  std::string out;
  for (int s = 0; s < kSlots; ++s) {
    const volatile int* r = g_host + s * kInts;
    if (r[0] == 0) continue;
    const SiteInfo* si = info(r[0]);
    out += out.empty() ? "" : "\n";
    out += si ? si->what : "a bounded wait";
    out += " timed out (block ";
    out += std::to_string(r[1]);
    out += ", thread ";
    out += std::to_string(r[2]);
    out += ')';
    const int n = r[3] < 0 ? 0 : r[3] > kContext ? kContext : r[3];
    for (int i = 0; i < n; ++i) {
      const char* name = si && si->names[i] ? si->names[i] : nullptr;
      out += i == 0 ? ": " : ", ";
      if (name)
        out += name;
      else
        out += 'v', out += std::to_string(i);
      out += ' ';
      out += std::to_string(r[4 + i]);
    }
  }
  return out;
}

std::string report_suffix() {
  const std::string r = report();
  return r.empty() ? r : "; " + r;
}

}  // namespace moekit::trap
