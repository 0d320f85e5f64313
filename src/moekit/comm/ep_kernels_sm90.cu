#include <cuda_bf16.h>

#include <algorithm>

#include "moekit/comm/ep_kernels_sm90.cuh"
#include "moekit/formats/codes.h"
#include "moekit/formats/dequant.cuh"
#include "moekit/formats/mxfp8.h"
#include "moekit/formats/nvfp4.h"

namespace moekit::ep {

namespace {

// ---- system-scope flags and the bounded wait ---------------------------------------------------

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t* ctrl_of(uint8_t* window) { return reinterpret_cast<uint64_t*>(window); }

// Writes the rank's error record (host-mapped); phase last: the host reads phase != 0 as "a
// record is there".
__device__ void write_record(const RankCtx& c, Phase phase, int peer, uint64_t expected, uint64_t seen, uint64_t n) {
  volatile ErrorRecord* dst = c.error;
  dst->rank = c.rank;
  dst->peer = peer;
  dst->expected = expected;
  dst->seen = seen;
  dst->round = n;
  __threadfence_system();
  dst->phase = int32_t(phase);
  __threadfence_system();
}

// A wait that failed: the rank's first failure is recorded (later ones are dropped) and its
// abort word raised, so that its other CTAs stop waiting too. The group is poisoned until reset.
__device__ void fail_round(const RankCtx& c, Phase phase, int peer, uint64_t expected, uint64_t seen, uint64_t n) {
  uint64_t* ctrl = ctrl_of(c.window);
  if (atomicCAS(reinterpret_cast<unsigned long long*>(ctrl + kAbort), 0ull, 1ull) == 0ull)
    write_record(c, phase, peer, expected, seen, n);
}

// Waits until (*flag >> shift) == n. False after timeout_ns or when the group's or the rank's
// abort word is raised (then the rank's error record says why).
__device__ bool wait_epoch(const Params& p, const RankCtx& c, const uint64_t* flag, int shift, uint64_t n,
                           Phase phase, int peer, uint64_t* seen = nullptr) {
  uint64_t v = ld_acquire_sys(flag);
  if (seen) *seen = v;
  if ((v >> shift) == n) return true;
  const uint64_t t0 = globaltimer_ns();
  const volatile uint64_t* my_abort = ctrl_of(c.window) + kAbort;
  for (uint32_t spin = 1;; ++spin) {
    v = ld_acquire_sys(flag);
    if (seen) *seen = v;
    if ((v >> shift) == n) return true;
    if ((spin & 63) == 0) {
      if (*my_abort != 0) return false;
      if (p.abort && *p.abort != 0) {
        fail_round(c, Phase::kAborted, peer, n, v >> shift, n);
        return false;
      }
      if (globaltimer_ns() - t0 > p.timeout_ns) {
        fail_round(c, phase, peer, n, v >> shift, n);
        return false;
      }
      __nanosleep(64);
    }
  }
}

__device__ __forceinline__ bool rank_active(const Params& p, int rank) { return (p.active >> rank) & 1ull; }

// ---- quantize: x rows -> payload rows; one CTA per (token, rank), one thread per scale block -----

template <Payload P>
__global__ void quantize_kernel(const Params p, const RankCtx* ctxs) {
  constexpr int kBlock = P == Payload::kMxfp8 ? kMxBlock : kNvfp4Block;
  constexpr int kCodeBytes = P == Payload::kMxfp8 ? kBlock : kBlock / 2;
  const RankCtx& c = ctxs[blockIdx.y];
  const int64_t t = blockIdx.x;
  if (t >= c.T) return;
  const Shape& s = p.shape;
  const int per_row = s.hidden / kBlock;
  const int64_t code_bytes = align_up(payload_code_bytes(P, s.hidden), 16);
  uint8_t* row = const_cast<uint8_t*>(c.src_rows) + t * c.src_stride;
  for (int b = threadIdx.x; b < per_row; b += blockDim.x) {
    // kBlock bf16 values in 16-byte loads, then the formats/ block quantizer in registers.
    const uint4* src = reinterpret_cast<const uint4*>(c.x + t * c.x_stride + int64_t(b) * kBlock);
    float v[kBlock];
#pragma unroll
    for (int i = 0; i < kBlock / 8; ++i) {
      const uint4 w = __ldg(src + i);
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        v[8 * i + 2 * h] = __uint_as_float(u[h] << 16);
        v[8 * i + 2 * h + 1] = __uint_as_float(u[h] & 0xffff0000u);
      }
    }
    alignas(16) uint8_t q[kCodeBytes];
    uint8_t sc;
    if constexpr (P == Payload::kMxfp8)
      sc = quantize_block_mxfp8(v, p.mx_rceil ? ScaleRule::kRceil : ScaleRule::kFloor, q);
    else
      sc = quantize_block_nvfp4(v, p.nvfp4_g, q);
#pragma unroll
    for (int i = 0; i < kCodeBytes; i += 8)
      *reinterpret_cast<uint2*>(row + int64_t(b) * kCodeBytes + i) = *reinterpret_cast<const uint2*>(q + i);
    row[code_bytes + b] = sc;
  }
}

// ---- dispatch -----------------------------------------------------------------------------------

__device__ __forceinline__ void red_release_sys_add(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Source rows are prefetched into L2 while the counts are exchanged when all ranks' rows of the
// launch fit in this many bytes (else they would push each other out before the copies).
constexpr int64_t kPrefetchBytes = int64_t(16) << 20;

// A CTA's share of a round's done count: the G CTAs of a rank add 2^32 together (CTA 0 adds
// 2^32 - (G - 1), the others 1 each), so dflag[src] >> 32 reaches round n exactly when every CTA
// of src has written its rows of round n, whatever G is on src.
__device__ __forceinline__ uint64_t done_share(int cta, int G) {
  return cta == 0 ? (uint64_t(1) << 32) - uint64_t(G - 1) : uint64_t(1);
}

// Shared memory: the peer table [R] (pointers), then base[E] (rows of earlier ranks per expert),
// total[E], the counts [R][E].
__global__ void __launch_bounds__(kThreads) dispatch_kernel(const Params p, const RankCtx* ctxs) {
  const RankCtx& c = ctxs[blockIdx.y];
  if (!rank_active(p, c.rank)) return;
  extern __shared__ uint64_t smem_u64[];
  const Shape& s = p.shape;
  const int R = s.world, E = s.num_experts, El = s.local_experts(), k = s.top_k, cap = s.capacity;
  const int r = c.rank;
  uint8_t** peer = reinterpret_cast<uint8_t**>(smem_u64);  // [R]
  int* base = reinterpret_cast<int*>(smem_u64 + R);        // [E]
  int* total = base + E;                                   // [E]
  int* rank_cnt = base + 2 * E;                            // [R][E]
  __shared__ uint64_t s_n;
  __shared__ int s_over;
  uint64_t* ctrl = ctrl_of(c.window);
  const int G = gridDim.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int64_t T = c.T, N = T * k;
  const int64_t slot_step = int64_t(G) * warps;  // a warp takes slots w, w + slot_step, ...
  const int64_t stride = s.payload_stride(), bytes = s.payload_bytes();

  // 0. What needs no counts is read before the exchange, so that its latency hides behind it:
  //    the epoch, the peer table, this thread's published count, the warp's first 32 slots (lane
  //    j: slot j's id, dest and weight) and, into L2, this CTA's share of the source rows.
  const int pub0 = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t pub_rows = pub0 < R * E && T > 0 ? uint32_t(c.expert_count[pub0 % E]) : 0u;
  const int64_t warp_slot = int64_t(blockIdx.x) * warps + warp;  // the warp's first slot
  const int64_t slot0 = warp_slot + lane * slot_step;
  int my_e = -1, my_d = -1;
  float my_w = 0.0f;
  if (slot0 < N) my_e = c.ids[slot0], my_d = c.dest[slot0], my_w = c.weights[slot0];
  if (T * bytes * gridDim.y <= kPrefetchBytes) {
    const int64_t lines = (bytes + 127) / 128;
    for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < T * lines; u += int64_t(G) * blockDim.x)
      prefetch_l2(c.src_rows + (u / lines) * c.src_stride + (u % lines) * 128);
  }
  if (threadIdx.x < R) peer[threadIdx.x] = c.peers[threadIdx.x];
  if (threadIdx.x == 0) {
    s_n = *reinterpret_cast<volatile uint64_t*>(ctrl + kEpoch) + 1;
    s_over = E;
  }
  __syncthreads();
  const uint64_t n = s_n;

  // 1. publish this rank's counts into every peer: cnt[r][e] = {n, rows}.
  for (int i = pub0; i < R * E; i += G * blockDim.x) {
    const int q = i / E, e = i % E;
    const uint32_t rows = i == pub0 ? pub_rows : T > 0 ? uint32_t(c.expert_count[e]) : 0u;
    st_relaxed_sys(reinterpret_cast<uint64_t*>(peer[q] + p.win.cnt) + int64_t(r) * E + e, n << 32 | rows);
  }

  // 2. gather every rank's counts (each CTA: it needs the offsets of the experts it sends to):
  //    four words per thread in flight, the slow (bounded) wait only for words not there yet.
  bool failed = false;
  const uint64_t* cnt = reinterpret_cast<const uint64_t*>(c.window + p.win.cnt);
  for (int i0 = threadIdx.x; i0 < R * E && !failed; i0 += 4 * blockDim.x) {
    uint64_t v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + u * blockDim.x;
      v[u] = i < R * E ? ld_relaxed_sys(cnt + i) : n << 32;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i >= R * E) continue;
      if ((v[u] >> 32) != n && !wait_epoch(p, c, cnt + i, 32, n, Phase::kCounts, i / E, &v[u])) {
        failed = true;
        break;
      }
      rank_cnt[i] = int(uint32_t(v[u]));
    }
  }
  if (__syncthreads_or(failed)) return;  // timed out: the record is written, the group poisoned
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int b = 0, t = 0;
    for (int src = 0; src < R; ++src) {
      const int rows = rank_cnt[src * E + e];
      if (src < r) b += rows;
      t += rows;
    }
    base[e] = b;
    total[e] = t;
    if (t > cap) atomicMin(&s_over, e);
  }
  __syncthreads();
  const int over = s_over;

  // 3. the receiving side: the work list of the local experts and the empty rows' meta.
  RowMeta* meta = reinterpret_cast<RowMeta*>(c.window + p.win.meta);
  if (over < E) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      // Every rank decides alike from the same counts; the group stays usable (the host clears
      // the record when it reports it).
      write_record(c, Phase::kCapacity, over, uint64_t(cap), uint64_t(total[over]), n);
      *c.num_active = 0;
      c.chunk_prefix[0] = 0;
      ctrl[kFailed] = n;
    }
  } else {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      int active = 0, chunks = 0;
      c.chunk_prefix[0] = 0;
      for (int el = 0; el < El; ++el) {
        const int rows = total[r * El + el];
        if (rows == 0) continue;
        c.expert[active] = el;
        c.count[active] = rows;
        c.row_start[active] = el * cap;
        chunks += (rows + p.chunk_rows - 1) / p.chunk_rows;
        c.chunk_prefix[++active] = chunks;
      }
      *c.num_active = active;
    }
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < int64_t(El) * cap;
         i += int64_t(G) * blockDim.x) {
      const int el = int(i / cap), row = int(i % cap);
      if (row >= total[r * El + el]) meta[i] = RowMeta{-1, 0, 0, 0.0f};
    }

    // 4. data, 32 slots of a warp at a time: lane j places slot j (its row, meta and slot_row),
    //    then the warp copies the slots' payload rows one after the other.
    const int64_t vecs = bytes / 16;
    for (int64_t i0 = warp_slot; i0 < N; i0 += 32 * slot_step) {
      const int64_t i = i0 + lane * slot_step;
      if (i0 != warp_slot) {  // the first 32 were read before the exchange
        my_e = -1, my_d = -1, my_w = 0.0f;
        if (i < N) my_e = c.ids[i], my_d = c.dest[i], my_w = c.weights[i];
      }
      int64_t g = -1;
      int q = 0;
      if (i < N) {
        if (my_e >= 0 && my_d >= 0) {
          q = my_e / El;
          g = int64_t(my_e % El) * cap + base[my_e] + (my_d - my_e * int(T));
          const RowMeta m{my_e, int32_t(r << kSrcTokenBits) | int32_t(i / k), int32_t(i % k), my_w};
          reinterpret_cast<RowMeta*>(peer[q] + p.win.meta)[g] = m;
        }
        c.slot_row[i] = int32_t(g);
      }
      const int64_t left = (N - i0 + slot_step - 1) / slot_step;
      const int n_here = left < 32 ? int(left) : 32;
      for (int j = 0; j < n_here; ++j) {
        const long long gj = __shfl_sync(0xffffffffu, static_cast<long long>(g), j);
        if (gj < 0) continue;
        const int qj = __shfl_sync(0xffffffffu, q, j);
        const int64_t ij = i0 + j * slot_step;
        const uint4* src = reinterpret_cast<const uint4*>(c.src_rows + (ij / k) * c.src_stride);
        uint4* dst = reinterpret_cast<uint4*>(peer[qj] + p.win.payload + gj * stride);
        // Up to eight 16-byte loads in flight per lane, then their stores.
        for (int64_t v0 = lane; v0 < vecs; v0 += 32 * 8) {
          uint4 a[8];
#pragma unroll
          for (int u = 0; u < 8; ++u)
            if (v0 + 32 * u < vecs) a[u] = __ldg(src + v0 + 32 * u);
#pragma unroll
          for (int u = 0; u < 8; ++u)
            if (v0 + 32 * u < vecs) dst[v0 + 32 * u] = a[u];
        }
      }
    }
  }

  // 5. done: each CTA adds its share of round n to dflag[r] of every peer (a release at system
  //    scope after the CTA barrier: this CTA's rows and meta before it), then CTA 0 waits until
  //    every peer's CTAs have added theirs and records n as the rank's epoch. A failed round
  //    (capacity) counts too, so the counts stay in step; its wait is short (no rows moved).
  __syncthreads();
  if (threadIdx.x < R)
    red_release_sys_add(reinterpret_cast<uint64_t*>(peer[threadIdx.x] + p.win.dflag) + r, done_share(blockIdx.x, G));
  if (blockIdx.x != 0) return;
  bool ok = true;
  const uint64_t* dflag = reinterpret_cast<const uint64_t*>(c.window + p.win.dflag);
  if (threadIdx.x < R) ok = wait_epoch(p, c, dflag + threadIdx.x, 32, n, Phase::kData, threadIdx.x);
  if (__syncthreads_and(ok) && threadIdx.x == 0)
    *reinterpret_cast<volatile uint64_t*>(ctrl + kEpoch) = n;  // the round is this rank's now
}

// ---- dequant: quantized payload rows -> bf16 rows of the experts; one CTA per (row, rank) -----
// Exact decoders of formats/dequant.cuh; rows whose meta is -1 (past the count) are skipped.

template <Payload P>
__global__ void dequant_kernel(const Params p, const RankCtx* ctxs) {
  constexpr int kBlock = P == Payload::kMxfp8 ? kMxBlock : kNvfp4Block;
  constexpr int kCodeBytes = P == Payload::kMxfp8 ? kBlock : kBlock / 2;
  const RankCtx& c = ctxs[blockIdx.y];
  if (!rank_active(p, c.rank)) return;
  const Shape& s = p.shape;
  const int64_t g = blockIdx.x;
  if (reinterpret_cast<const RowMeta*>(c.window + p.win.meta)[g].expert < 0) return;
  const uint8_t* row = c.window + p.win.payload + g * s.payload_stride();
  const int64_t code_bytes = align_up(payload_code_bytes(P, s.hidden), 16);
  const int per_row = s.hidden / kBlock;
  const float scale_2 = 1.0f / p.nvfp4_g;
  for (int b = threadIdx.x; b < per_row; b += blockDim.x) {
    alignas(16) uint8_t q[kCodeBytes];
#pragma unroll
    for (int i = 0; i < kCodeBytes; i += 8)
      *reinterpret_cast<uint2*>(q + i) = *reinterpret_cast<const uint2*>(row + int64_t(b) * kCodeBytes + i);
    const uint32_t sb = row[code_bytes + b];
    alignas(16) uint16_t out[kBlock];
    if constexpr (P == Payload::kMxfp8) {
      const float sc = dev::e8m0_to_f32(sb);
#pragma unroll
      for (int j = 0; j < kBlock; ++j) out[j] = __bfloat16_as_ushort(__float2bfloat16_rn(dev::e4m3_to_f32(q[j]) * sc));
    } else {
      const float sf = dev::e4m3_to_f32(sb);
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        const float qs = dev::e2m1_to_f32(j & 1 ? q[j / 2] >> 4 : q[j / 2] & 15u) * sf;  // exact
        out[j] = __bfloat16_as_ushort(__float2bfloat16_rn(qs * scale_2));
      }
    }
    uint4* dst = reinterpret_cast<uint4*>(c.rows_bf16 + g * s.hidden_pad + int64_t(b) * kBlock);
#pragma unroll
    for (int i = 0; i < kBlock / 8; ++i) dst[i] = reinterpret_cast<const uint4*>(out)[i];
  }
}

// ---- combine ------------------------------------------------------------------------------------

constexpr int kCombineUnroll = 8;

__global__ void __launch_bounds__(kThreads) combine_kernel(const Params p, const RankCtx* ctxs) {
  const RankCtx& c = ctxs[blockIdx.y];
  if (!rank_active(p, c.rank)) return;
  const Shape& s = p.shape;
  const int R = s.world, El = s.local_experts(), k = s.top_k;
  const int64_t H = s.hidden;
  uint64_t* ctrl = ctrl_of(c.window);
  const uint64_t n = *reinterpret_cast<volatile uint64_t*>(ctrl + kEpoch);
  if (*reinterpret_cast<volatile uint64_t*>(ctrl + kFailed) == n) return;  // the dispatch failed
  // "My expert outputs of round n are complete" to every peer (the GEMMs ran before).
  if (blockIdx.x == 0 && threadIdx.x < R) {
    __threadfence_system();
    st_release_sys(reinterpret_cast<uint64_t*>(c.peers[threadIdx.x] + p.win.cflag) + c.rank, n);
  }
  const uint64_t* cflag = reinterpret_cast<const uint64_t*>(c.window + p.win.cflag);
  bool ok = true;
  if (threadIdx.x < R) ok = wait_epoch(p, c, cflag + threadIdx.x, 0, n, Phase::kCombine, threadIdx.x);
  if (!__syncthreads_and(ok)) return;

  // y[t, c..c+3] = bf16(sum over j in order of Y[slot (t, j)][c..c+3]), fp32. One warp per
  // (token, 128 columns): lane j < k finds slot j's row once, the lanes stream the columns.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int64_t chunks = (H + 127) / 128;
  for (int64_t u = int64_t(blockIdx.x) * warps + warp; u < c.T * chunks; u += int64_t(gridDim.x) * warps) {
    const int64_t t = u / chunks, col = (u % chunks) * 128 + lane * 4;
    const float* row = nullptr;  // lane j: slot j's fp32 row on its expert's rank
    if (lane < k) {
      const int g = c.slot_row[t * k + lane];
      if (g >= 0) row = reinterpret_cast<const float*>(c.peers[c.ids[t * k + lane] / El] + p.win.y) + int64_t(g) * H;
    }
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int j0 = 0; j0 < k; j0 += kCombineUnroll) {
      const float* src[kCombineUnroll];
#pragma unroll
      for (int jj = 0; jj < kCombineUnroll; ++jj) {
        const unsigned long long r = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), (j0 + jj) & 31);
        src[jj] = j0 + jj < k && col < H ? reinterpret_cast<const float*>(r) : nullptr;
      }
      float4 v[kCombineUnroll];
#pragma unroll
      for (int jj = 0; jj < kCombineUnroll; ++jj)
        if (src[jj]) v[jj] = *reinterpret_cast<const float4*>(src[jj] + col);
#pragma unroll
      for (int jj = 0; jj < kCombineUnroll; ++jj)
        if (src[jj]) acc.x += v[jj].x, acc.y += v[jj].y, acc.z += v[jj].z, acc.w += v[jj].w;
    }
    if (col >= H) continue;
    const __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x, acc.y), hi = __floats2bfloat162_rn(acc.z, acc.w);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&lo);
    packed.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(c.y + t * c.y_stride + col) = packed;
  }
}

size_t dispatch_smem(const Shape& s) {
  return size_t(s.world) * sizeof(uint8_t*) + size_t(2 + s.world) * s.num_experts * sizeof(int);
}

cudaError_t cooperative(const void* kernel, dim3 grid, size_t smem, cudaStream_t s, const Params& p,
                        const RankCtx* ctx) {
  void* args[] = {const_cast<Params*>(&p), &ctx};
  return cudaLaunchCooperativeKernel(kernel, grid, dim3(kThreads), args, smem, s);
}

}  // namespace

int ctas_per_rank(const Shape& s, int ranks, int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  const size_t smem = dispatch_smem(s);
  if (cudaFuncSetAttribute(dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
    return 0;
  // Both kernels: 512 threads; the smaller occupancy, at most 2 CTAs per SM (each CTA of a rank
  // reads all the counts: more CTAs, more of that).
  int a = 0, b = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&a, dispatch_kernel, kThreads, smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, combine_kernel, kThreads, 0) != cudaSuccess)
    return 0;
  const int per_sm = std::min({a, b, 2});
  return per_sm * sms / std::max(ranks, 1);
}

cudaError_t launch_quantize(const Params& p, const RankCtx* ctx, int ranks, int64_t max_tokens, cudaStream_t s) {
  if (p.shape.payload == Payload::kBf16 || max_tokens == 0 || ranks == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(max_tokens), static_cast<unsigned>(ranks));
  if (p.shape.payload == Payload::kMxfp8) quantize_kernel<Payload::kMxfp8><<<grid, 128, 0, s>>>(p, ctx);
  else quantize_kernel<Payload::kNvfp4><<<grid, 128, 0, s>>>(p, ctx);
  return cudaGetLastError();
}

cudaError_t launch_dispatch(const Params& p, const RankCtx* ctx, int ranks, int ctas, cudaStream_t s) {
  return cooperative(reinterpret_cast<const void*>(dispatch_kernel), dim3(unsigned(ctas), unsigned(ranks)),
                     dispatch_smem(p.shape), s, p, ctx);
}

cudaError_t launch_dequant(const Params& p, const RankCtx* ctx, int ranks, cudaStream_t s) {
  if (p.shape.payload == Payload::kBf16 || ranks == 0) return cudaSuccess;
  const dim3 grid(unsigned(p.shape.rows()), unsigned(ranks));
  if (p.shape.payload == Payload::kMxfp8) dequant_kernel<Payload::kMxfp8><<<grid, 128, 0, s>>>(p, ctx);
  else dequant_kernel<Payload::kNvfp4><<<grid, 128, 0, s>>>(p, ctx);
  return cudaGetLastError();
}

cudaError_t launch_combine(const Params& p, const RankCtx* ctx, int ranks, int ctas, cudaStream_t s) {
  return cooperative(reinterpret_cast<const void*>(combine_kernel), dim3(unsigned(ctas), unsigned(ranks)), 0, s, p,
                     ctx);
}

}  // namespace moekit::ep
