// moekit_swap_ab_probe: the tensor rate a prefill kernel with swapped operands could reach at
// 48-80 rows per expert, measured on data already in shared memory (no HBM, no producer, no
// barriers between roles: an upper bound, values are not checked).
//
// The prefill kernel (experts/sm90_prefill_gemm.cuh) multiplies weights (A, 64 rows per wgmma,
// dequantized in registers) by a token tile (B, N = the tile's rows: 64-80 at 2048 tokens). The
// alternative: tokens as A (64 rows from shared memory), the dequantized weights as B (N = 256
// rows, bf16 in shared memory, written there by warps of their own), so the tensor work runs at
// N = 256 while the dequantized weights pass through shared memory once per token tile. On paper
// (docs/perf/notebook.md, twenty-ninth section) shared memory then bounds it: an m64n256k16 wgmma
// reads 2 KB of A and 8 KB of B per 128 tensor cycles, and the writers store 8 KB per wgmma with
// one token tile per expert (4 KB with two).
//
// Roles, per CTA (one per SM): C consumer warpgroups, each issuing wgmmas over its own 64-row A
// tile and the shared B tiles (two alternating buffers of one k-block: 256 rows x 64 k; one
// wgmma in flight while the next is issued), and W writer warpgroups that together rewrite a
// whole B buffer every k-block from E2M1 codes in shared memory (the prefill kernel's unpack and
// scale multiplies: E2M1 tiny values x an E8M0 pair, 16 bytes per 32-bit code word, stored in the
// 128-byte swizzle). Both roles run the same number of k-blocks; each role's time is its slowest
// warpgroup's (thread 0's %globaltimer).
//
//   moekit_swap_ab_probe [kblocks]     (default 20000 k-blocks per role)
//   moekit_swap_ab_probe check         (the present and the swapped operand order, bit for bit)
//
// Prints per configuration the consumers' time and TFLOP/s (and the writers' time and GB/s of
// bf16 written), against the reference: the present kernel's wgmma shape (two m64n64 groups per
// warpgroup, A from registers, one wgmma in flight per group pair) without any dequantization.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "moekit/common/ptx_sm90.cuh"
#include "moekit/common/wgmma_sm90_ops.cuh"
#include "moekit/common/wgmma_sm90_ss_ops.cuh"
#include "moekit/experts/sm90_fragment.cuh"

namespace {

using namespace moekit;
using namespace moekit::sm90;

constexpr int kATile = 64 * 128;         // 64 rows x 64 k bf16 (128 B per row, 128-byte swizzle)
constexpr int kBTile = 256 * 128;        // 256 weight rows x 64 k bf16
constexpr int kCodes = 256 * 64 / 2;     // the B tile's E2M1 codes (8 KB)
constexpr int kSmem = 1024 + 2 * kATile + 2 * kBTile + kCodes + 1024;

enum Mode { kSS256 = 0, kRS64 = 1 };

__device__ __forceinline__ void sts128(uint32_t a, const uint32_t (&v)[4]) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}

template <int kMode, int C, int W>
__global__ void __launch_bounds__(128 * (C + W), 1) probe_kernel(int kblocks, unsigned long long* role_ns, float* sink) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (ptx::smem_base(smem_raw) + 1023u) & ~1023u;
  const uint32_t a_tiles = base, b_tiles = base + 2 * kATile, codes = b_tiles + 2 * kBTile;
  // Random non-zero bf16 everywhere (finite: exponent bit 14 cleared), random codes.
  uint32_t seed = 0x9e3779b9u * (threadIdx.x + 1) + blockIdx.x;
  for (uint32_t i = threadIdx.x; i < uint32_t(2 * kATile + 2 * kBTile + kCodes) / 4; i += blockDim.x) {
    seed = seed * 1664525u + 1013904223u;
    const uint32_t v = i < uint32_t(2 * kATile + 2 * kBTile) / 4 ? (seed & 0xbfffbfffu) | 0x00800080u : seed;
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(base + 4 * i), "r"(v) : "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const uint64_t t0 = ptx::globaltimer_ns();
  float keep = 0;
  if (wg < C) {
    if constexpr (kMode == kSS256) {
      float acc[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      const uint64_t da = ptx::smem_desc_k128(a_tiles + wg * kATile);
      for (int kb = 0; kb < kblocks; ++kb) {
        const uint64_t db = ptx::smem_desc_k128(b_tiles + (kb & 1) * kBTile);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          ptx::wgmma_fence();
          ptx::wgmma_m64n256k16_ss<1>(acc, da + 2 * q, db + 2 * q);
          ptx::wgmma_commit();
          ptx::wgmma_wait<1>();
        }
      }
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) keep += acc[i];
    } else {
      // The present kernel's short-tile shape: two groups (m64, A from registers) per warpgroup
      // against a 64-row token tile (B), each step's two wgmmas in flight in turns.
      float acc[2][32];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[j][i] = 0.f;
      uint32_t a[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) a[j][i] = ptx::lds32(b_tiles + 16u * t + 4u * i + 2048u * j);
      const uint64_t db = ptx::smem_desc_k128(a_tiles + wg * kATile);
      for (int kb = 0; kb < kblocks; ++kb) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            ptx::wgmma_fence();
            ptx::wgmma_m64n64k16_rs<1>(acc[j], a[j], db + 2 * q);
            ptx::wgmma_commit();
            ptx::wgmma_wait<1>();
          }
        }
      }
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 32; ++i) keep += acc[j][i];
    }
  } else {
    // Writers: every k-block, the whole B buffer kb & 1 (2048 chunks of 16 bytes: row r, chunk c
    // at r * 128 + ((c ^ (r % 8)) * 16)), each chunk from one 32-bit code word.
    // A thread's chunks idx = wt + i * 128 W: the same chunk column and row % 8 for every i, so
    // its addresses are one base plus immediates; the chunks are unrolled (independent chains).
    const int wt = (wg - C) * 128 + t;
    constexpr int kPer = kBTile / 16 / (128 * (W > 0 ? W : 1));
    const int r0 = wt >> 3, c = wt & 7;
    uint32_t m[2];
    mx_pair_multipliers((ptx::lds32(codes + 4u * uint32_t(wt % 64)) & 0x03030303u) | 0x76767676u, kE2M1TinyExp, m);
    const uint32_t mc = m[c & 1];
    const uint32_t code0 = codes + 4u * uint32_t(wt);
    const uint32_t st0 = uint32_t(r0) * 128u + uint32_t((c ^ (r0 & 7)) * 16);
    for (int kb = 0; kb < kblocks; ++kb) {
      const uint32_t b = b_tiles + (kb & 1) * kBTile + st0;
      uint32_t w[kPer];  // the loads first: the volatile loads and stores keep their order
#pragma unroll
      for (int i = 0; i < kPer; ++i) w[i] = ptx::lds32(code0 + uint32_t(i * 128 * W * 4));
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        uint32_t v[4];
        tiny_values<WeightFormat::kMxfp4>(&w[i], v);
        mul_pair(v, mc, v);
        sts128(b + uint32_t(i * 16 * W * 128), v);
      }
    }
  }
  const uint64_t ns = ptx::globaltimer_ns() - t0;
  if (keep == 1234.5f) *sink = keep;  // keeps the work alive
  if (t == 0) atomicMax(&role_ns[wg < C ? 0 : 1], (unsigned long long)ns);
}

template <int kMode, int C, int W>
void run(const char* what, int sms, int kblocks, unsigned long long* role_ns, float* sink) {
  auto k = probe_kernel<kMode, C, W>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  cudaFuncAttributes fa{};
  cudaFuncGetAttributes(&fa, k);
  k<<<sms, 128 * (C + W), kSmem>>>(8, role_ns, sink);  // warm-up
  cudaMemset(role_ns, 0, 2 * sizeof(unsigned long long));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k<<<sms, 128 * (C + W), kSmem>>>(kblocks, role_ns, sink);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  unsigned long long ns[2] = {0, 0};
  cudaMemcpy(ns, role_ns, sizeof(ns), cudaMemcpyDeviceToHost);
  std::printf("%-44s %3d regs  kernel %8.3f ms", what, fa.numRegs, ms);
  if (C > 0) {
    // FLOPs per k-block per consumer warpgroup: 4 x m64n256k16, or 4 x 2 x m64n64k16.
    const double flop = kMode == kSS256 ? 4.0 * 2 * 64 * 256 * 16 : 8.0 * 2 * 64 * 64 * 16;
    const double tf = flop * kblocks * C * sms / (double(ns[0]) * 1e-9) / 1e12;
    std::printf("  consumers %8.3f ms %6.1f TFLOP/s", ns[0] * 1e-6, tf);
  }
  if (W > 0) {
    const double gbs = double(kBTile) * kblocks * sms / (double(ns[1]) * 1e-9) / 1e9;
    std::printf("  writers %8.3f ms %7.1f GB/s of bf16 (%.1f B per SM cycle at 1.755 GHz)", ns[1] * 1e-6, gbs,
                gbs * 1e9 / sms / 1.755e9);
  }
  std::printf("\n");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

// ---- check: the same products in both operand orders, bit for bit ----------------------------
// One warpgroup, one k16 step: D_rs[w][t] = sum_k W[w][k] X[t][k] as the present kernel forms it
// (m64n64k16, W as A from registers in the mma.m16n8k16 fragment layout, X as B from shared
// memory) and D_ss[t][w] as the swapped structure would (m64n256k16, X as A, W as B, both from
// shared memory; W's rows 64..255 zero). Whether the tensor core's sums give the same bits in both
// orders decides whether a swapped kernel can keep the present numerics.
constexpr int kCheckRows = 64, kCheckK = 16;

// Byte offset of element (r, k) of a K-major tile with 128-byte rows in the 128-byte swizzle.
__host__ __device__ constexpr uint32_t swizzled(int r, int k) {
  return uint32_t(r) * 128u + ((uint32_t(k * 2 / 16) ^ uint32_t(r % 8)) * 16u) + uint32_t(k * 2 % 16);
}

__global__ void __launch_bounds__(128, 1)
    check_kernel(const uint16_t* w, const uint16_t* x, float* d_rs, float* d_ss) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (ptx::smem_base(smem_raw) + 1023u) & ~1023u;
  const uint32_t xs = base, ws = base + kATile;  // X: 64 rows, W: 256 rows (rows >= 64 zero)
  for (int i = threadIdx.x; i < (kATile + kBTile) / 4; i += blockDim.x)
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(base + 4u * uint32_t(i)), "r"(0u) : "memory");
  __syncthreads();
  for (int i = threadIdx.x; i < kCheckRows * kCheckK; i += blockDim.x) {
    const int r = i / kCheckK, k = i % kCheckK;
    asm volatile("st.shared.u16 [%0], %1;" ::"r"(xs + swizzled(r, k)), "h"(x[i]) : "memory");
    asm volatile("st.shared.u16 [%0], %1;" ::"r"(ws + swizzled(r, k)), "h"(w[i]) : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic stores -> wgmma reads
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  // A fragment of rows 16 warp + g (+ 8), columns 2 c (+ 8) and the next.
  auto pair = [&](int r, int k) { return uint32_t(w[r * kCheckK + k]) | (uint32_t(w[r * kCheckK + k + 1]) << 16); };
  const int r = 16 * warp + g;
  uint32_t a[4] = {pair(r, 2 * c), pair(r + 8, 2 * c), pair(r, 2 * c + 8), pair(r + 8, 2 * c + 8)};
  float acc_rs[32], acc_ss[128];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc_rs[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) acc_ss[i] = 0.f;
  ptx::wgmma_fence();
  ptx::wgmma_m64n64k16_rs<0>(acc_rs, a, ptx::smem_desc_k128(xs));
  ptx::wgmma_m64n256k16_ss<0>(acc_ss, ptx::smem_desc_k128(xs), ptx::smem_desc_k128(ws));
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  // Accumulator i: row 16 warp + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2 c + i % 2.
#pragma unroll
  for (int i = 0; i < 32; ++i)
    d_rs[(r + 8 * ((i / 2) % 2)) * kCheckRows + 8 * (i / 4) + 2 * c + i % 2] = acc_rs[i];
#pragma unroll
  for (int i = 0; i < 128; ++i) d_ss[(r + 8 * ((i / 2) % 2)) * 256 + 8 * (i / 4) + 2 * c + i % 2] = acc_ss[i];
}

float bf16_value(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Values with exponents over a wide range, so that the order of the sum over k shows in the bits.
int check_orders() {
  std::vector<uint16_t> w(kCheckRows * kCheckK), x(kCheckRows * kCheckK);
  uint32_t seed = 12345u;
  auto next = [&] { return seed = seed * 1664525u + 1013904223u; };
  for (auto* v : {&w, &x})
    for (uint16_t& h : *v) {
      const uint32_t s = next();
      h = uint16_t(((s >> 31) << 15) | ((100u + (s >> 8) % 56u) << 7) | (s & 0x7fu));  // exponents 2^-27..2^28
    }
  uint16_t *dw, *dx;
  float *drs, *dss;
  cudaMalloc(&dw, w.size() * 2);
  cudaMalloc(&dx, x.size() * 2);
  cudaMalloc(&drs, kCheckRows * kCheckRows * 4);
  cudaMalloc(&dss, kCheckRows * 256 * 4);
  cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice);
  cudaFuncSetAttribute(check_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  check_kernel<<<1, 128, kSmem>>>(dw, dx, drs, dss);
  std::vector<float> rs(kCheckRows * kCheckRows), ss(kCheckRows * 256);
  cudaMemcpy(rs.data(), drs, rs.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(ss.data(), dss, ss.size() * 4, cudaMemcpyDeviceToHost);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
  // Both against the exact sum (double: the 16 products are exact, their sum nearly so) within
  // 1e-4 of the sum of magnitudes: a layout error (a wrong product in the sum) fails this, the
  // tensor core's order and rounding of the sum (its fp32 accumulation is not IEEE order) do not.
  int bad_rs = 0, bad_ss = 0, differ = 0, zero_cols = 0;
  for (int wr = 0; wr < kCheckRows; ++wr)
    for (int t = 0; t < kCheckRows; ++t) {
      double exact = 0, mag = 0;
      for (int k = 0; k < kCheckK; ++k) {
        const double p = double(bf16_value(w[wr * kCheckK + k])) * double(bf16_value(x[t * kCheckK + k]));
        exact += p;
        mag += std::fabs(p);
      }
      const float a = rs[wr * kCheckRows + t], b = ss[t * 256 + wr];
      bad_rs += std::fabs(a - exact) > 1e-4 * mag;
      bad_ss += std::fabs(b - exact) > 1e-4 * mag;
      uint32_t ua, ub;
      std::memcpy(&ua, &a, 4);
      std::memcpy(&ub, &b, 4);
      differ += ua != ub;
    }
  for (int t = 0; t < kCheckRows; ++t)
    for (int col = kCheckRows; col < 256; ++col) zero_cols += ss[t * 256 + col] != 0.f;
  std::printf("check (one k16 step, 64 x 64 outputs): present order off the exact sum at %d, swapped at %d, "
              "columns past W's rows nonzero at %d; the two orders differ in %d of %d results\n",
              bad_rs, bad_ss, zero_cols, differ, kCheckRows * kCheckRows);
  return bad_rs || bad_ss || zero_cols ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "check") == 0) return check_orders();
  const int kblocks = argc > 1 ? std::atoi(argv[1]) : 20000;
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, dev);
  std::printf("moekit_swap_ab_probe: %s, %d SMs, %d k-blocks per role, shared-memory data only\n", prop.name, sms,
              kblocks);
  unsigned long long* role_ns = nullptr;
  float* sink = nullptr;
  cudaMalloc(&role_ns, 2 * sizeof(unsigned long long));
  cudaMalloc(&sink, 4);
  run<kRS64, 2, 0>("present shape: 2 WG x 2 x m64n64 (A regs)", sms, kblocks, role_ns, sink);
  run<kSS256, 1, 0>("swapped: 1 WG x m64n256 (SS)", sms, kblocks, role_ns, sink);
  run<kSS256, 2, 0>("swapped: 2 WG x m64n256 (SS), one B", sms, kblocks, role_ns, sink);
  run<kSS256, 0, 1>("writers alone: 1 WG", sms, kblocks, role_ns, sink);
  run<kSS256, 0, 2>("writers alone: 2 WG", sms, kblocks, role_ns, sink);
  run<kSS256, 1, 1>("1 token tile per B (2048): 1 WG + 1 writer WG", sms, kblocks, role_ns, sink);
  run<kSS256, 1, 2>("1 token tile per B (2048): 1 WG + 2 writer WG", sms, kblocks, role_ns, sink);
  run<kSS256, 2, 1>("2 token tiles per B (4096): 2 WG + 1 writer WG", sms, kblocks, role_ns, sink);
  run<kSS256, 1, 1>("repeat: 1 WG + 1 writer WG", sms, kblocks, role_ns, sink);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
