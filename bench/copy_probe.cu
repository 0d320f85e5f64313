// moekit_copy_probe: how fast a ring of bulk copies streams weights laid out as the decode GEMM's
// converted matrices (experts/sm90_layout.h: per 64-row group, per 64-K block, four 512-byte
// atoms, one per 16-row subtile, then 32 bytes of scales per atom), for three ways of cutting the
// work:
//   group     a task is one group over its whole K; a stage is 4 (or 3) k-blocks of all four
//             subtiles, one contiguous 8 KB copy + one 512 B scale copy (what the kernel does);
//   subtile   a task is one 16-row subtile over its whole K; a stage is 15 k-blocks of it,
//             atoms 2 KB apart: (a) one 3-D tensor-map copy for the atoms and one for the scales,
//             (b) one 1-D bulk copy per atom and per scale block (30 per stage);
//   permuted  the subtile task through a 5-D tensor map whose boxes land the k-blocks in the
//             order the consumer warps read them (16 per stage); checked byte for byte first.
// Same grid as the kernel (3 CTAs per SM, 5 stages each, one producer warp, four consumer warps
// that release each stage after an optional sleep standing in for the dequantization), tasks
// claimed from a global counter, L2 flushed before every run, median of 15 CUDA-event timings.
//
//   moekit_copy_probe
//
// GB/s count codes + scales (the permuted rows: codes only). A caveat measured on an H100: the
// kernel did not follow these rates for subtile tasks (one copy per atom held its producer a
// task behind; tensor-map gathers gained nothing), docs/perf/notebook.md, ninth section.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "moekit/common/ptx_sm90.cuh"

namespace {

using namespace moekit;

// A ring wait of the probe: bounded (10 s), a bare trap past it.
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  ptx::mbar_wait<20000>(bar, parity, 10ull * 1000 * 1000 * 1000, [] { __trap(); });
}

#define PROBE_CHECK(x)                                                                   \
  do {                                                                                   \
    const cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));   \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

constexpr int kKb = 45;        // k-blocks per group (GPT-OSS-120B: K = 2880)
constexpr int kAtom = 512, kScale = 32, kSub = 4;
constexpr int kStages = 5, kStageBytes = 16 * kAtom + 16 * kScale + 256;
static_assert(2 * kStages * 8 <= ptx::kBarrierLine, "the ring's barriers fit their line");
constexpr int kThreads = 160;  // 4 consumer warps + 1 producer
enum Mode { kGroup, kTensor, kPerAtom, kPermuted, kModes };
const char* kModeName[kModes] = {"group (linear 8 KB)", "subtile, 3-D tensor map", "subtile, one copy per atom",
                                 "subtile, permuted 5-D map"};

struct Args {
  const uint8_t* codes;
  const uint8_t* scales;
  int groups, mode, sleep_ns;
  int* counter;
  int* exit_count;
};

__device__ __forceinline__ void tensor3(uint32_t dst, const CUtensorMap* m, int c0, int c1, int c2, uint32_t bar,
                                        uint64_t pol) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
      "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(pol)
      : "memory");
}
__device__ __forceinline__ void tensor5(uint32_t dst, const CUtensorMap* m, int c3, int c4, uint32_t bar,
                                        uint64_t pol) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %2, %2, %3, %4}], [%5], %6;" ::"r"(dst),
      "l"(m), "r"(0), "r"(c3), "r"(c4), "r"(bar), "l"(pol)
      : "memory");
}

// Stage k-blocks of a task: group tasks nine of 4 and three of 3 (the kernel's split of 45),
// subtile tasks three of 15, permuted 16 + 16 + 13 (boxes of 16; the last reads 3 past the task).
__device__ __forceinline__ int stage_kb(int mode, int st) {
  return mode == kGroup ? (st < 9 ? 4 : 3) : mode == kPermuted ? (st < 2 ? 16 : 13) : 15;
}

__global__ void __launch_bounds__(kThreads, 3)
    stream_kernel(const __grid_constant__ Args a, const __grid_constant__ CUtensorMap codes3,
                  const __grid_constant__ CUtensorMap scales3, const __grid_constant__ CUtensorMap codes5) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int s_end[kStages];
  // The barriers in a line of their own, the ring after it.
  const uint32_t bars = ptx::smem_base(smem), ring = bars + ptx::kBarrierLine;
  auto full = [&](int s) { return bars + 8u * uint32_t(s); };
  auto empty = [&](int s) { return bars + 8u * uint32_t(kStages + s); };
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) ptx::mbar_init(full(s), 1), ptx::mbar_init(empty(s), 128);
    ptx::fence_barrier_init();
  }
  if (threadIdx.x < kStages) s_end[threadIdx.x] = 0;
  __syncthreads();
  const bool subtile = a.mode != kGroup;
  const int tasks = subtile ? a.groups * kSub : a.groups;
  const int stages = a.mode == kGroup ? 12 : 3;
  if (warp == 4) {
    const uint64_t pol = ptx::l2_evict_first_policy();
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < tasks;) {
      int claim = 0;
      if (lane == 0) claim = int(gridDim.x) + atomicAdd(a.counter, 1);
      const int g = subtile ? t / kSub : t, s = subtile ? t % kSub : 0;
      int kb = 0;
      for (int st = 0; st < stages; ++st) {
        const int nkb = stage_kb(a.mode, st);
        wait(empty(stage), phase ^ 1);
        const uint32_t dst = ring + uint32_t(stage) * kStageBytes;
        const int64_t row = int64_t(g) * kKb + kb;  // k-block row of the group's first subtile
        if (a.mode == kGroup) {
          if (lane == 0) {
            ptx::mbar_arrive_expect_tx(full(stage), uint32_t(nkb * kSub * (kAtom + kScale)));
            ptx::bulk_g2s(dst, a.codes + row * kSub * kAtom, nkb * kSub * kAtom, full(stage), pol);
            ptx::bulk_g2s(dst + 16 * kAtom, a.scales + row * kSub * kScale, nkb * kSub * kScale, full(stage), pol);
          }
        } else if (a.mode == kTensor) {
          if (lane == 0) {
            ptx::mbar_arrive_expect_tx(full(stage), uint32_t(nkb * (kAtom + kScale)));
            tensor3(dst, &codes3, 0, s, int(row), full(stage), pol);
            tensor3(dst + 16 * kAtom, &scales3, 0, s, int(row), full(stage), pol);
          }
        } else if (a.mode == kPerAtom) {
          if (lane == 0) ptx::mbar_arrive_expect_tx(full(stage), uint32_t(nkb * (kAtom + kScale)));
          if (lane < nkb) {
            ptx::bulk_g2s(dst + lane * kAtom, a.codes + ((row + lane) * kSub + s) * kAtom, kAtom, full(stage), pol);
            ptx::bulk_g2s(dst + 16 * kAtom + lane * kScale, a.scales + ((row + lane) * kSub + s) * kScale, kScale,
                          full(stage), pol);
          }
        } else if (lane == 0) {
          ptx::mbar_arrive_expect_tx(full(stage), 16 * kAtom);  // a whole box, also past the task's end
          tensor5(dst, &codes5, s, int(row), full(stage), pol);
        }
        kb += nkb;
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      t = __shfl_sync(0xffffffffu, claim, 0);
    }
    wait(empty(stage), phase ^ 1);
    if (lane == 0) {
      s_end[stage] = 1;
      ptx::mbar_arrive(full(stage));
      ptx::fence_acq_rel_gpu();
      if (atomicAdd(a.exit_count, 1) == int(gridDim.x) - 1) *a.counter = 0, *a.exit_count = 0;
    }
  } else {
    int stage = 0;
    uint32_t phase = 0;
    while (true) {
      wait(full(stage), phase);
      if (s_end[stage]) break;
      if (a.sleep_ns) __nanosleep(uint32_t(a.sleep_ns));
      ptx::mbar_arrive(empty(stage));
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
  }
  ptx::mbar_inval_at_exit(bars, 2 * kStages);
}

// One permuted box into shared memory and back out, for the byte check.
__global__ void permuted_box(const __grid_constant__ CUtensorMap codes5, int s, int row, uint8_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t bar = ptx::smem_base(smem);
  if (threadIdx.x == 0) ptx::mbar_init(bar, 1), ptx::fence_barrier_init();
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::mbar_arrive_expect_tx(bar, 16 * kAtom);
    tensor5(bar + 128, &codes5, s, row, bar, ptx::l2_evict_first_policy());
  }
  wait(bar, 0);
  for (int i = threadIdx.x; i < 16 * kAtom; i += blockDim.x) out[i] = smem[128 + i];
  ptx::mbar_inval_at_exit(bar, 1);
}

__global__ void fill(uint32_t* p, size_t words) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint32_t(i) * 2654435761u;
}
__global__ void flush(const uint4* p, size_t n, unsigned* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) x ^= p[i].x;
  if (x == 0x9e3779b9u) *sink = x;
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// A tensor map of 8-byte elements: dims[0] elements innermost, strides in bytes for dims 1...
CUtensorMap make_map(EncodeTiled enc, void* base, std::vector<cuuint64_t> dims, std::vector<cuuint64_t> strides,
                     std::vector<cuuint32_t> box) {
  CUtensorMap m;
  const std::vector<cuuint32_t> one(dims.size(), 1);
  const CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_UINT64, cuuint32_t(dims.size()), base, dims.data(), strides.data(),
                         box.data(), one.data(), CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                         CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed (%d) for a rank-%zu map\n", int(r), dims.size());
    std::exit(1);
  }
  return m;
}

}  // namespace

int main() {
  EncodeTiled enc = nullptr;
  cudaDriverEntryPointQueryResult q;
  PROBE_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&enc), 12000,
                                               cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || !enc) {
    std::fprintf(stderr, "no cuTensorMapEncodeTiled in this driver\n");
    return 1;
  }
  const int G = 5760;  // groups in the buffers (530 MB of codes, 10x the L2)
  const size_t rows = size_t(G) * kKb, cbytes = rows * kSub * kAtom, sbytes = rows * kSub * kScale;
  uint8_t *codes, *scales, *flushbuf;
  unsigned* sink;
  int* ctr;
  PROBE_CHECK(cudaMalloc(&codes, cbytes + (64 << 10)));  // + the permuted boxes' read past the end
  PROBE_CHECK(cudaMalloc(&scales, sbytes));
  const size_t fbytes = size_t(256) << 20;
  PROBE_CHECK(cudaMalloc(&flushbuf, fbytes));
  PROBE_CHECK(cudaMalloc(&sink, 64));
  PROBE_CHECK(cudaMalloc(&ctr, 8));
  PROBE_CHECK(cudaMemset(ctr, 0, 8));
  fill<<<1024, 256>>>(reinterpret_cast<uint32_t*>(codes), cbytes / 4);
  fill<<<1024, 256>>>(reinterpret_cast<uint32_t*>(scales), sbytes / 4);
  PROBE_CHECK(cudaDeviceSynchronize());

  // 3-D: [atom words][subtile, 512 B apart][k-block row, 2 KB apart]; a box is 15 k-blocks of one subtile.
  const CUtensorMap codes3 = make_map(enc, codes, {kAtom / 8, kSub, rows}, {kAtom, kSub * kAtom}, {kAtom / 8, 1, 15});
  const CUtensorMap scales3 =
      make_map(enc, scales, {kScale / 8, kSub, rows}, {kScale, kSub * kScale}, {kScale / 8, 1, 15});
  // 5-D: [atom words][hi 4, 4 k-blocks apart][lo 4, 1 k-block apart][subtile][k-block row]: box
  // slot lo x 4 + hi holds k-block 4 hi + lo (strides not in increasing order).
  const CUtensorMap codes5 = make_map(enc, codes, {kAtom / 8, 4, 4, kSub, rows},
                                      {4 * kSub * kAtom, kSub * kAtom, kAtom, kSub * kAtom}, {kAtom / 8, 4, 4, 1, 1});
  {
    uint8_t* out;
    PROBE_CHECK(cudaMalloc(&out, 16 * kAtom));
    const int g = 7, s = 2, kb0 = 16;
    PROBE_CHECK(cudaFuncSetAttribute(permuted_box, cudaFuncAttributeMaxDynamicSharedMemorySize, 16 * kAtom + 128));
    permuted_box<<<1, 128, 16 * kAtom + 128>>>(codes5, s, g * kKb + kb0, out);
    PROBE_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> box(16 * kAtom), src(size_t(g + 1) * kKb * kSub * kAtom);
    PROBE_CHECK(cudaMemcpy(box.data(), out, box.size(), cudaMemcpyDeviceToHost));
    PROBE_CHECK(cudaMemcpy(src.data(), codes, src.size(), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int slot = 0; slot < 16; ++slot) {
      const int kb = kb0 + 4 * (slot % 4) + slot / 4;
      const size_t off = (size_t(g) * kKb + kb) * kSub * kAtom + size_t(s) * kAtom;
      for (int i = 0; i < kAtom; ++i) bad += box[size_t(slot) * kAtom + i] != src[off + i];
    }
    std::printf("permuted 5-D box: %d of %d bytes differ from the expected k-block order\n", bad, 16 * kAtom);
    PROBE_CHECK(cudaFree(out));
    if (bad != 0) return 1;  // the permuted rows below would stream the wrong bytes
  }

  int sms = 0, dev = 0;
  PROBE_CHECK(cudaGetDevice(&dev));
  PROBE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int smem = 72 << 10;  // three CTAs per SM, as the kernel
  static_assert(ptx::kBarrierLine + kStages * kStageBytes <= (72 << 10), "the ring fits");
  PROBE_CHECK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int* exit_count;
  PROBE_CHECK(cudaMalloc(&exit_count, 4));
  PROBE_CHECK(cudaMemset(exit_count, 0, 4));
  cudaEvent_t e0, e1;
  PROBE_CHECK(cudaEventCreate(&e0));
  PROBE_CHECK(cudaEventCreate(&e1));
  std::printf("%6s %8s  %-28s %10s %10s %8s\n", "groups", "sleep_ns", "copies", "median_us", "min_us", "GB/s");
  for (int groups : {360, 1440})
    for (int sleep_ns : {0, 600})
      for (int mode = 0; mode < kModes; ++mode) {
        Args a{codes, scales, groups, mode, sleep_ns, ctr, exit_count};
        std::vector<float> us;
        for (int rep = 0; rep < 15; ++rep) {
          flush<<<1024, 256>>>(reinterpret_cast<const uint4*>(flushbuf), fbytes / 16, sink);
          PROBE_CHECK(cudaEventRecord(e0));
          stream_kernel<<<sms * 3, kThreads, smem>>>(a, codes3, scales3, codes5);
          PROBE_CHECK(cudaEventRecord(e1));
          PROBE_CHECK(cudaEventSynchronize(e1));
          float ms = 0;
          PROBE_CHECK(cudaEventElapsedTime(&ms, e0, e1));
          us.push_back(ms * 1000);
        }
        PROBE_CHECK(cudaGetLastError());
        std::sort(us.begin(), us.end());
        const double bytes = double(groups) * kKb * kSub * (kAtom + (mode == kPermuted ? 0 : kScale));
        std::printf("%6d %8d  %-28s %10.2f %10.2f %8.0f\n", groups, sleep_ns, kModeName[mode], us[us.size() / 2],
                    us[0], bytes / us[us.size() / 2] / 1e3);
      }
  return 0;
}
