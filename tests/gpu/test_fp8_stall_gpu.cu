// FP8Stall (issue 49): the FP8 grouped GEMM (experts/sm90_fp8_gemm.cuh) at the timings' sizes
// with every barrier wait of the kernel bounded at kWaitLimitNs (2 s), each launch timed and its
// line flushed at once, so that one short run tells a hang, a stall and a slowdown apart.
//
// Why: fp8-regs's first H200 run printed no FP8BENCH line under `timeout 120` with stdout in a
// file. FP8Bench.Presets is one gtest test of 12 cases (~11 s each on main, mostly host data), and
// stdout to a file is fully buffered: its lines reach the file when the test ends, which it did
// not within 120 s; the timeout's SIGTERM dropped the buffer. That run cannot tell a hang from a
// correct kernel.
//
// Each case: the bench's routing (FP8Bench: T = 4096 tokens, top-k over E experts, T k / E rows
// each, one GEMM), the bench's presets, MXFP4 (the bench's format) and MXFP8 weights; weights,
// activations and scales made on the device from a hash (no host data: a case takes milliseconds;
// no NaN codes, so every output is finite), outputs poisoned. A launch:
//   - whose ring wait cannot end fails within ~2 s with its trap record (ring_wait: which barrier,
//     parity, every barrier's phase, both tile slots, the SM): the line says FAILED and the record;
//   - still running after kWatchdogS (stuck outside the ring's waits: setmaxnreg, a named barrier,
//     a loop) ends the process with exit code 3 and a line saying so;
//   - that completes: a line with its time, every output must be written (no NaN left of the
//     poison), the tile counters back at zero; then a line with one more launch timed alone and
//     the median of 10, as TFLOP/s (2 rows N K / time, the bench's figure; main's FP8Bench on an
//     H200: 300-354 TFLOP/s).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "fp8_chain.h"
#include "gpu_util.h"
#include "moekit/common/trap_record.h"
#include "moekit/experts/sm90_fp8_gemm.h"
#include "moekit/formats/kernel_pack.h"

namespace moekit {
namespace {

using test::DeviceBuffer;
namespace fp8 = sm90::fp8;

constexpr uint64_t kWaitLimitNs = 2ull * 1000 * 1000 * 1000;  // every barrier wait of the kernel
constexpr int kWatchdogS = 20;                                 // a launch not done by then: exit(3)
constexpr int kTimedLaunches = 10;

__device__ __forceinline__ uint64_t stall_hash(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

enum class ByteKind : int { kAny, kE4m3, kE4m3Packed, kE8m0 };
// kAny: E2M1 pairs; kE4m3: no NaN codes (0x7f, 0xff) in natural bytes (activations); kE4m3Packed:
// MXFP8 weight words (kernel_pack.h's pack_e4m3x4 moves the codes' nibbles across the word's
// bytes, so random bytes there hold NaN codes: n a multiple of 4); kE8m0: block scales 2^-2 .. 2^1.
__device__ __forceinline__ uint8_t stall_e4m3(uint64_t h) {
  const uint8_t b = uint8_t(h);
  return (b & 0x7f) == 0x7f ? uint8_t(b ^ 1) : b;
}
__global__ void stall_fill_bytes(uint8_t* p, int64_t n, uint64_t seed, ByteKind kind) {
  if (kind == ByteKind::kE4m3Packed) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n / 4; i += int64_t(gridDim.x) * blockDim.x) {
      const uint64_t h = stall_hash(seed + uint64_t(i));
      const uint8_t c[4] = {stall_e4m3(h), stall_e4m3(h >> 8), stall_e4m3(h >> 16), stall_e4m3(h >> 24)};
      reinterpret_cast<uint32_t*>(p)[i] = pack_e4m3x4(c);
    }
    return;
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint8_t b = uint8_t(stall_hash(seed + uint64_t(i)));
    if (kind == ByteKind::kE4m3) b = stall_e4m3(b);
    if (kind == ByteKind::kE8m0) b = uint8_t(125 + (b & 3));
    p[i] = b;
  }
}
// Activation scales in [1, 2) / 448: |x| < 2.
__global__ void stall_fill_scales(float* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = (1.0f + float(stall_hash(seed + uint64_t(i)) & 255u) / 256.0f) / 448.0f;
}
// Outputs still NaN (the poison): bf16 (bytes 2) or fp32 (bytes 4).
__global__ void stall_count_nan(const void* p, int64_t n, int bytes, unsigned long long* count) {
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (bytes == 2) c += (static_cast<const uint16_t*>(p)[i] & 0x7fffu) > 0x7f80u;
    else c += (static_cast<const uint32_t*>(p)[i] & 0x7fffffffu) > 0x7f800000u;
  }
  if (c) atomicAdd(count, c);
}

void print_flush(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// One launch, waited for by polling (a launch past kWatchdogS ends the process); its time on the
// stream in ms, or the error with the trap record in *err.
float timed_launch(const fp8::Fp8Args& a, int sms, const std::string& what, std::string* err) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  cudaEventRecord(e0);
  cudaError_t e = fp8::launch_fp8_gemm(a, sms, nullptr, false);
  if (e == cudaSuccess) e = cudaEventRecord(e1);
  const auto t0 = std::chrono::steady_clock::now();
  // (cudaErrorNotReady is "still running": polled again, never kept as the launch's result)
  while (e == cudaSuccess) {
    const cudaError_t q = cudaEventQuery(e1);
    if (q != cudaErrorNotReady) {
      e = q;
      break;
    }
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(kWatchdogS)) {
      print_flush("FP8STALL " + what + ": STILL RUNNING after " + std::to_string(kWatchdogS) +
                  " s, every ring wait bounded at 2 s: stuck outside them (setmaxnreg, a named barrier, a loop)" +
                  trap::report_suffix());
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  float ms = -1.0f;
  if (e == cudaSuccess) cudaEventElapsedTime(&ms, e0, e1);
  else *err = std::string(cudaGetErrorName(e)) + trap::report_suffix();
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return ms;
}

// One bench-sized GEMM; false when it failed (the context is then lost: the caller stops).
bool stall_case(const test::Fp8BenchPreset& p, int64_t T, bool gemm2, WeightFormat f) {
  const std::string what = std::string(p.name) + " T=" + std::to_string(T) + " " +
                           (f == WeightFormat::kMxfp4 ? "mxfp4" : "mxfp8") + (gemm2 ? " gemm2" : " gemm1");
  const int E = p.E, per = int(T * p.k / p.E);
  const int64_t R = int64_t(per) * E;
  const int64_t N = gemm2 ? p.H : 2 * p.I, K = gemm2 ? p.I : p.H;  // logical, as FP8Bench
  sm90::LayoutDims dims;
  dims.format = f;
  dims.E = E;
  dims.N_pad = sm90::pad_to(N, sm90::kGroupRows);
  dims.K_pad = sm90::pad_to(K, sm90::kKBlock);
  const int64_t groups = (dims.K_pad + 127) / 128, rows_pad = fp8::fp8_scale_rows_pad(R);
  const int64_t out_cols = gemm2 ? N : dims.N_pad / 2, out_elems = R * out_cols;

  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  DeviceBuffer<uint8_t> codes(size_t(dims.code_bytes())), scales(size_t(dims.scale_bytes())),
      x(size_t(R * dims.K_pad));
  DeviceBuffer<float> sx(size_t(groups * rows_pad)), topk(std::vector<float>(size_t(R), 0.5f));
  std::vector<int> expert(static_cast<size_t>(E)), count(static_cast<size_t>(E), per), start(static_cast<size_t>(E));
  std::vector<int32_t> row_src(static_cast<size_t>(R));
  for (int e = 0; e < E; ++e) expert[size_t(e)] = e, start[size_t(e)] = e * per;
  for (int64_t r = 0; r < R; ++r) row_src[size_t(r)] = int32_t(r);
  DeviceBuffer<int> d_num(std::vector<int>{E}), d_expert(expert), d_count(count), d_start(start),
      d_counters(std::vector<int>{0, 0});
  DeviceBuffer<int32_t> d_row_src(row_src);
  DeviceBuffer<float> out_f32(gemm2 ? size_t(out_elems) : 1);
  DeviceBuffer<uint16_t> out_act(gemm2 ? 1 : size_t(out_elems));
  DeviceBuffer<unsigned long long> nan_count(std::vector<unsigned long long>{0});
  if (!codes.ptr || !scales.ptr || !x.ptr || !sx.ptr || !out_f32.ptr || !out_act.ptr) {
    ADD_FAILURE() << what << ": out of device memory";
    return false;
  }
  const unsigned fill_grid = unsigned(sms * 8);
  stall_fill_bytes<<<fill_grid, 256>>>(codes.ptr, int64_t(codes.n), 1,
                                       f == WeightFormat::kMxfp4 ? ByteKind::kAny : ByteKind::kE4m3Packed);
  stall_fill_bytes<<<fill_grid, 256>>>(scales.ptr, int64_t(scales.n), 2, ByteKind::kE8m0);
  stall_fill_bytes<<<fill_grid, 256>>>(x.ptr, int64_t(x.n), 3, ByteKind::kE4m3);
  stall_fill_scales<<<fill_grid, 256>>>(sx.ptr, int64_t(sx.n), 4);
  out_f32.poison();
  out_act.poison();
  if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    ADD_FAILURE() << what << ": the data fill failed: " << cudaGetErrorName(e);
    return false;
  }

  fp8::Fp8Args a{};
  const bool maps = fp8::make_fp8_rows_map(&a.base.in_map, x.ptr, R, dims.K_pad, 16) == cudaSuccess &&
                    fp8::make_fp8_rows_map(&a.base.in_map_big, x.ptr, R, dims.K_pad,
                                           sm90::prefill::kBigBoxRows) == cudaSuccess &&
                    fp8::make_fp8_scale_map(&a.sx_map, sx.ptr, rows_pad, groups) == cudaSuccess;
  if (!maps) {
    ADD_FAILURE() << what << ": a tensor map was refused";
    return false;
  }
  a.base.dims = dims;
  a.base.codes = codes.ptr;
  a.base.scales = scales.ptr;
  a.base.work.num_active = d_num.ptr;
  a.base.work.expert = d_expert.ptr;
  a.base.work.count = d_count.ptr;
  a.base.work.row_start = d_start.ptr;
  a.base.out_act = out_act.ptr;
  a.base.out_f32 = out_f32.ptr;
  a.base.out_cols = out_cols;
  a.base.row_src = d_row_src.ptr;
  a.base.topk_weights = topk.ptr;
  a.base.tile_counter = d_counters.ptr;
  a.base.exit_count = d_counters.ptr + 1;
  a.base.trap = trap::device_record();
  a.base.act = ActivationParams{Activation::kSilu, 1.702f, 1.0f, 7.0f};
  a.base.gemm2 = gemm2;
  a.wait_limit_ns = kWaitLimitNs;

  const int64_t tiles = int64_t(E) * ((per + fp8::kRows - 1) / fp8::kRows) *
                        ((dims.groups() + fp8::kTileGroups - 1) / fp8::kTileGroups);
  const int stages = f == WeightFormat::kMxfp4 ? fp8::Traits<WeightFormat::kMxfp4>::kStages
                                               : fp8::Traits<WeightFormat::kMxfp8>::kStages;
  char head[256];
  std::snprintf(head, sizeof head, "FP8STALL %s: %lld tiles on %d CTAs (%.1f each), %lld k-groups, %d stages:",
                what.c_str(), (long long)tiles, sms, double(tiles) / sms, (long long)groups, stages);
  std::string err;
  const float first = timed_launch(a, sms, what, &err);
  if (first < 0) {
    print_flush(std::string(head) + " FAILED: " + err);
    ADD_FAILURE() << what << ": " << err;
    return false;
  }
  stall_count_nan<<<fill_grid, 256>>>(gemm2 ? static_cast<const void*>(out_f32.ptr) : out_act.ptr, out_elems,
                                      gemm2 ? 4 : 2, nan_count.ptr);
  const unsigned long long unwritten = nan_count.to_host()[0];
  const std::vector<int> counters = d_counters.to_host();
  const double tflop = 2.0 * double(R) * double(N) * double(K) / 1e12;
  char line[512];
  std::snprintf(line, sizeof line, "%s first launch %.3f ms (%.1f TFLOP/s), %llu of %lld outputs unwritten, counters %d %d",
                head, first, tflop / (first * 1e-3), unwritten, (long long)out_elems, counters[0], counters[1]);
  print_flush(line);
  EXPECT_EQ(unwritten, 0ull) << what;
  EXPECT_EQ(counters[0], 0) << what;
  EXPECT_EQ(counters[1], 0) << what;
  // Then one launch alone and the median of kTimedLaunches (2 when the first took over 100 ms:
  // a slowdown shows in the first line, and the run stays short).
  const int reps = first > 100.0f ? 2 : kTimedLaunches;
  std::vector<float> ms;
  for (int i = 0; i <= reps && err.empty(); ++i) ms.push_back(timed_launch(a, sms, what, &err));
  if (!err.empty()) {
    print_flush("FP8STALL " + what + ": a later launch FAILED: " + err);
    ADD_FAILURE() << what << ": " << err;
    return false;
  }
  std::vector<float> rest(ms.begin() + 1, ms.end());
  std::sort(rest.begin(), rest.end());
  const float median = rest[rest.size() / 2];
  std::snprintf(line, sizeof line, "FP8STALL %s: one more launch %.3f ms, median of %d %.3f ms = %.1f TFLOP/s",
                what.c_str(), ms[0], reps, median, tflop / (median * 1e-3));
  print_flush(line);
  return true;
}

TEST(FP8Stall, BenchSizesBoundedWaits) {
  NEED_SM90();
  ASSERT_NE(trap::device_record(), nullptr) << "no trap record: a timed-out wait could not say what it waited for";
  // The bench's first case first (gpt-oss-120b GEMM1, 4096 tokens: where fp8-regs's run stopped
  // printing), then its other presets and GEMM2; then MXFP8, whose consumers hold the most registers.
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kMxfp8})
    for (const test::Fp8BenchPreset& p : test::kFp8BenchPresets)
      for (bool gemm2 : {false, true})
        if (!stall_case(p, 4096, gemm2, f)) return;
}

}  // namespace
}  // namespace moekit
