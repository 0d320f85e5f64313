#include <cuda_bf16.h>

#include <algorithm>
#include <cub/block/block_scan.cuh>

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

// Writes the rank's error record (host-mapped) unless one is there (the first writer wins: the
// device flag c.recorded); phase last: the host reads phase != 0 as "a record is there".
__device__ void write_record(const RankCtx& c, Phase phase, int peer, uint64_t expected, uint64_t seen, uint64_t n) {
  if (atomicCAS(c.recorded, 0, 1) != 0) return;
  volatile ErrorRecord* dst = c.error;
  dst->rank = c.rank;
  dst->layer = c.layer;
  dst->peer = peer;
  dst->expected = expected;
  dst->seen = seen;
  dst->round = n;
  __threadfence_system();
  dst->phase = int32_t(phase);
  __threadfence_system();
}

// A wait that failed: the rank's abort word (in its window, which the layers of a group share)
// is raised, so that its other CTAs, and every later call of any layer, stop waiting; the rank's
// first failure is recorded (later ones are dropped). The group is poisoned until reset.
__device__ void fail_round(const RankCtx& c, Phase phase, int peer, uint64_t expected, uint64_t seen, uint64_t n) {
  uint64_t* ctrl = ctrl_of(c.window);
  atomicCAS(reinterpret_cast<unsigned long long*>(ctrl + kAbort), 0ull, 1ull);
  write_record(c, phase, peer, expected, seen, n);
}

// The host's abort word is read at most once per this many ns per CTA (each read crosses PCIe;
// thousands of waiting threads reading it every few spins were what made a real-GPU dispatch take
// a millisecond: docs/perf/log.md, "EP dispatch over NVLink").
constexpr uint64_t kHostPollNs = 100'000;

// Waits until (*flag >> shift) == n. False after timeout_ns or when the group's or the rank's
// abort word is raised (then the rank's error record says why). last_host_poll: the CTA's
// shared-memory time of its last read of the host's abort word.
__device__ bool wait_epoch(const Params& p, const RankCtx& c, const uint64_t* flag, int shift, uint64_t n,
                           Phase phase, int peer, unsigned long long* last_host_poll, uint64_t* seen = nullptr) {
  uint64_t v = ld_acquire_sys(flag);
  if (seen) *seen = v;
  if ((v >> shift) == n) return true;
  const uint64_t t0 = globaltimer_ns();
  const volatile uint64_t* my_abort = ctrl_of(c.window) + kAbort;
  for (uint32_t spin = 1;; ++spin) {
    v = ld_relaxed_sys(flag);
    if ((v >> shift) == n) {
      v = ld_acquire_sys(flag);  // the value is final for this round: its acquire orders what follows
      if (seen) *seen = v;
      return true;
    }
    if (seen) *seen = v;
    if ((spin & 31) == 0) {
      if (*my_abort != 0) {  // an earlier failure of this rank (this call's or an earlier one's)
        fail_round(c, Phase::kAborted, peer, n, v >> shift, n);
        return false;
      }
      const uint64_t now = globaltimer_ns();
      bool host = false;
      if (p.abort) {
        if (p.host_poll_every_spin) {
          host = (spin & 63) == 0;
        } else {
          const unsigned long long last = *reinterpret_cast<volatile unsigned long long*>(last_host_poll);
          host = now - last > kHostPollNs && atomicCAS(last_host_poll, last, now) == last;
        }
      }
      if (host && *p.abort != 0) {
        fail_round(c, Phase::kAborted, peer, n, v >> shift, n);
        return false;
      }
      if (now - t0 > p.timeout_ns) {
        fail_round(c, phase, peer, n, v >> shift, n);
        return false;
      }
    }
    __nanosleep(32);
  }
}

__device__ __forceinline__ void trace_stamp(const Params& p, int event) {
  if (p.trace && threadIdx.x == 0)
    p.trace[(int64_t(blockIdx.y) * p.trace_ctas + blockIdx.x) * kTraceEvents + event] = globaltimer_ns();
}

__device__ __forceinline__ bool rank_active(const Params& p, int rank) { return (p.active >> rank) & 1ull; }

// ---- quantize: x rows -> payload rows; one CTA per (token, rank), one thread per scale block -----

template <Payload P>
__global__ void quantize_kernel(const Params p, const __grid_constant__ Ctxs cs) {
  constexpr int kBlock = P == Payload::kMxfp8 ? kMxBlock : kNvfp4Block;
  constexpr int kCodeBytes = P == Payload::kMxfp8 ? kBlock : kBlock / 2;
  const RankCtx& c = cs.r[blockIdx.y];
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

__device__ __forceinline__ void red_relaxed_sys_add(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Source rows are prefetched into L2 while the counts are exchanged when all ranks' rows of the
// launch fit in this many bytes (else they would push each other out before the copies).
constexpr int64_t kPrefetchBytes = int64_t(16) << 20;

// The 16-byte vectors of a dispatch copy item (2 KB: a bf16 row of H = 7168 is 7 items); at most
// kMaxChunkVecs ($MOEKIT_EP_CHUNK, diagnostics: Params::chunk_vecs).
constexpr int kChunkVecs = 128, kMaxChunkVecs = 256;

// A CTA's share of a round's done count: the G CTAs of a rank add 2^32 together (CTA 0 adds
// 2^32 - (G - 1), the others 1 each), so dflag[src] >> 32 reaches round n exactly when every CTA
// of src has written its rows of round n, whatever G is on src.
__device__ __forceinline__ uint64_t done_share(int cta, int G) {
  return cta == 0 ? (uint64_t(1) << 32) - uint64_t(G - 1) : uint64_t(1);
}

// A warp's copy item: nv <= kMaxChunkVecs 16-byte vectors, lane + 32 w each, all loads in flight
// before the stores. kL2: loads through L2 only (ld.cg: rows another GPU wrote this round).
using Item = uint4[kMaxChunkVecs / 32];
template <bool kL2 = false>
__device__ __forceinline__ void load_item(const uint4* src, int64_t nv, int lane, Item& a) {
#pragma unroll
  for (int w = 0; w < kMaxChunkVecs / 32; ++w)
    if (lane + 32 * w < nv) {
      if constexpr (kL2) a[w] = __ldcg(src + lane + 32 * w);
      else a[w] = __ldg(src + lane + 32 * w);
    }
}
__device__ __forceinline__ void store_item(uint4* dst, int64_t nv, int lane, const Item& a) {
#pragma unroll
  for (int w = 0; w < kMaxChunkVecs / 32; ++w)
    if (lane + 32 * w < nv) dst[lane + 32 * w] = a[w];
}

// Shared memory: the peer table [R] (pointers), then base[E] (rows of earlier ranks per expert),
// total[E], the counts [R][E], and (fan-out) the prefix of the received rows per local expert
// [E_l + 1].
__global__ void __launch_bounds__(kThreads) dispatch_kernel(const Params p, const __grid_constant__ Ctxs cs) {
  const RankCtx& c = cs.r[blockIdx.y];
  if (!rank_active(p, c.rank)) return;
  trace_stamp(p, kTrStart);
  extern __shared__ uint64_t smem_u64[];
  const Shape& s = p.shape;
  const int R = s.world, E = s.num_experts, El = s.local_experts(), k = s.top_k, cap = s.capacity;
  const int r = c.rank;
  uint8_t** peer = reinterpret_cast<uint8_t**>(smem_u64);  // [R]
  int* base = reinterpret_cast<int*>(smem_u64 + R);        // [E]
  int* total = base + E;                                   // [E]
  int* rank_cnt = base + 2 * E;                            // [R][E]
  int* fan_prefix = rank_cnt + R * E;                      // [E_l + 1]
  __shared__ uint64_t s_n;
  __shared__ int s_over;
  __shared__ unsigned long long s_fan_src;  // bit q: rank q sends this round fanned out
  __shared__ unsigned long long s_host_poll;
  uint64_t* ctrl = ctrl_of(c.window);
  const int G = gridDim.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int64_t T = c.T, N = T * k;
  const int64_t slot_step = int64_t(G) * warps;  // a warp takes items w, w + slot_step, ...
  const int64_t stride = s.payload_stride(), bytes = s.payload_bytes();

  // 0. What needs no counts is read before the exchange, so that its latency hides behind it:
  //    the epoch, the peer table and, into L2, this CTA's share of the source rows.
  // The warp's first copy item: the warps interleaved over the CTAs, so that a last partial
  // pass of items spreads over every SM rather than filling the first CTAs.
  const int64_t warp_slot = int64_t(warp) * G + blockIdx.x;
  if (T * bytes * gridDim.y <= kPrefetchBytes) {
    const int64_t lines = (bytes + 127) / 128;
    for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < T * lines; u += int64_t(G) * blockDim.x)
      prefetch_l2(c.src_rows + (u / lines) * c.src_stride + (u % lines) * 128);
  }
  if (threadIdx.x < R) peer[threadIdx.x] = c.peers[threadIdx.x];
  if (threadIdx.x == 0) {
    s_n = *reinterpret_cast<volatile uint64_t*>(ctrl + kEpoch) + 1;
    s_over = E;
    s_fan_src = 0;
    s_host_poll = globaltimer_ns();
  }
  __syncthreads();
  const uint64_t n = s_n;
  // An earlier failure of this rank (a call the host has not checked yet): nothing goes to any
  // peer, which may be gone; the call fails with the reason on record.
  if (*reinterpret_cast<volatile uint64_t*>(ctrl + kAbort) != 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0) fail_round(c, Phase::kAborted, r, n, 0, n);
    return;
  }

  // 1. CTA 0 publishes this rank's counts into every peer: cnt[r][e] = {n, variant, rows}
  //    (rows < 2^31: Shape::rows() is; variant: this rank's rows for peers come fanned out, its
  //    own choice for this round: ranks may differ, a receiver fans out the rows of those that do).
  const uint64_t variant = p.fanout ? 1u : 0u;
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < R * E; i += blockDim.x) {
      const int q = i / E, e = i % E;
      const uint32_t rows = T > 0 ? uint32_t(c.expert_count[e]) : 0u;
      st_relaxed_sys(reinterpret_cast<uint64_t*>(peer[q] + p.win.cnt) + int64_t(r) * E + e,
                     n << 32 | variant << 31 | rows);
    }
  trace_stamp(p, kTrPublished);

  // 2. gather every rank's counts (each CTA: it needs the offsets of the experts it sends to):
  //    four words per thread in flight, the (bounded) wait only for words not there yet.
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
      if ((v[u] >> 32) != n && !wait_epoch(p, c, cnt + i, 32, n, Phase::kCounts, i / E, &s_host_poll, &v[u])) {
        failed = true;
        break;
      }
      rank_cnt[i] = int(uint32_t(v[u]) & 0x7fffffffu);
      if (i % E == 0 && ((v[u] >> 31) & 1u)) atomicOr(&s_fan_src, 1ull << (i / E));  // a rank's words agree
    }
  }
  if (__syncthreads_or(failed)) return;  // timed out: the record is written, the group poisoned
  trace_stamp(p, kTrCountsSeen);
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
  const uint64_t fan_src = s_fan_src;
  const bool refused = over < E;  // no row moves this round, on every rank alike

  // 3. the receiving side: the work list of the local experts, their row counts and the empty
  //    rows' meta.
  RowMeta* meta = reinterpret_cast<RowMeta*>(c.window + p.win.meta);
  if (refused) {
    if (blockIdx.x == 0) {
      for (int el = threadIdx.x; el < El; el += blockDim.x) c.expert_rows[el] = 0;
      if (threadIdx.x == 0) {
        // Every rank decides alike from the same counts; the group stays usable (the host clears
        // the record when it reports it).
        write_record(c, Phase::kCapacity, over, uint64_t(cap), uint64_t(total[over]), n);
        *c.num_active = 0;
        c.chunk_prefix[0] = 0;
        ctrl[kFailed] = n;
      }
    }
  } else {
    if (blockIdx.x == 0) {
      // The work list by the whole CTA: a block scan of (active, chunks) over the local experts,
      // kThreads experts a pass. (Thread 0 alone, storing through the context's pointers, took
      // ~15 us at 128 local experts: CTA 0 was the round's last by that much, docs/perf/log.md.)
      using Scan = cub::BlockScan<unsigned long long, kThreads>;
      __shared__ typename Scan::TempStorage scan_tmp;
      int* const expert = c.expert;
      int* const count = c.count;
      int* const row_start = c.row_start;
      int* const chunk_prefix = c.chunk_prefix;
      int32_t* const expert_rows = c.expert_rows;
      unsigned long long carry = 0;  // active << 32 | chunks of the passes before
      for (int el0 = 0; el0 < El; el0 += kThreads) {
        const int el = el0 + int(threadIdx.x);
        const int rows = el < El ? total[r * El + el] : 0;
        if (el < El) expert_rows[el] = rows;
        const unsigned long long mine =
            rows > 0 ? (1ull << 32) | unsigned((rows + p.chunk_rows - 1) / p.chunk_rows) : 0ull;
        unsigned long long before, pass;
        Scan(scan_tmp).ExclusiveSum(mine, before, pass);
        before += carry;
        if (rows > 0) {
          const int a = int(before >> 32);
          expert[a] = el;
          count[a] = rows;
          row_start[a] = el * cap;
          chunk_prefix[a + 1] = int(uint32_t(before) + uint32_t(mine));
        }
        carry += pass;
        __syncthreads();  // scan_tmp is reused
      }
      if (threadIdx.x == 0) {
        chunk_prefix[0] = 0;
        *c.num_active = int(carry >> 32);
      }
    }
    // The work spread by thread below (the empty rows' meta, the slots, the bf16_sum lists) goes
    // 32 consecutive items a warp, the warps interleaved over the CTAs (warp w of CTA b takes
    // items (w G + b') 32 + lane, b' = G - 1 - b: CTA 0, which published the counts and made the
    // work list, last): a few hundred slots no longer load the first CTAs alone (at 512 tokens
    // those 8 CTAs were the round's last by ~7 us, docs/perf/log.md).
    const int64_t cta_rev = G - 1 - int64_t(blockIdx.x);
    const int64_t spread0 = (int64_t(warp) * G + cta_rev) * 32 + lane, spread_step = int64_t(G) * blockDim.x;
    const int rows_all = El * cap;  // < 2^31 (Shape::rows)
    for (int64_t i64 = spread0; i64 < rows_all; i64 += spread_step) {
      const int i = int(i64), el = i / cap, row = i - el * cap;  // 32-bit division
      if (row >= total[r * El + el]) meta[i] = RowMeta{-1, 0, 0, 0.0f};
    }

    // 4. data. a: every thread places slots (a slot's row, meta and slot_row); b: the warps copy
    //    the payload rows in chunks of kChunkVecs 16-byte vectors, a (slot, chunk) item per warp
    //    at a time: a row is copied by several warps at once (one warp per row left a 14 KB bf16
    //    row latency-bound at small batches: docs/perf/log.md).
    //    frow[g] of the slot's row on its expert's rank: the row its bytes come from, g itself
    //    but for a fanned-out token's later slots on a peer, which take the first one's (the
    //    lowest slot j of the token on that rank, where the sender writes the token's copy).
    for (int64_t i = spread0; i < N; i += spread_step) {
      const int e = c.ids[i], d = c.dest[i];
      int64_t g = -1;
      if (e >= 0 && d >= 0) {
        g = int64_t(e % El) * cap + base[e] + (d - e * int(T));
        const int q = e / El;
        const RowMeta m{e, int32_t(r << kSrcTokenBits) | int32_t(i / k), int32_t(i % k), c.weights[i]};
        reinterpret_cast<RowMeta*>(peer[(p.diag & 4) ? r : q] + p.win.meta)[g] = m;
        int64_t from = g;
        if (p.fanout && q != r)
          for (int64_t i0 = i - i % k; i0 < i; ++i0) {  // the token's earlier slots
            const int e0 = c.ids[i0], d0 = c.dest[i0];
            if (e0 >= 0 && d0 >= 0 && e0 / El == q) {
              from = int64_t(e0 % El) * cap + base[e0] + (d0 - e0 * int(T));
              break;
            }
          }
        reinterpret_cast<int32_t*>(peer[(p.diag & 4) ? r : q] + p.win.frow)[g] = int32_t(from);
      }
      c.slot_row[i] = int32_t(g);
    }
    const int cv = p.chunk_vecs > 0 ? p.chunk_vecs : kChunkVecs;
    const int64_t vecs = bytes / 16, chunks = (vecs + cv - 1) / cv;
    // The context's pointers in registers: the stores below go through generic pointers, which
    // the compiler cannot tell apart from the parameter space.
    const int32_t* const ids = c.ids;
    const int32_t* const dest = c.dest;
    const uint8_t* const src_rows = c.src_rows;
    const int64_t src_stride = c.src_stride;
    if (s.combine == CombineRows::kBf16Sum) {
      // Every rank's list of this rank's tokens' slots on it: {row, weight}, row -1 for a slot
      // elsewhere or empty (ep_layout.h flist); a thread per (token, rank, slot), u = (t R + q) k
      // + j. Then this round's token count in every rank's ftok[r].
      const int Rk = R * k;
      const float* const weights = c.weights;
      for (int64_t u = spread0; u < T * Rk; u += spread_step) {
        const int64_t t = u / Rk;
        const int q = int(u % Rk) / k, j = int(u % k);
        const int e = ids[t * k + j], d = dest[t * k + j];
        int2 v = make_int2(-1, 0);
        if (e >= 0 && d >= 0 && e / El == q)
          v = make_int2(int(int64_t(e % El) * cap + base[e] + (d - e * int(T))), __float_as_int(weights[t * k + j]));
        reinterpret_cast<int2*>(peer[q] + p.win.flist)[(int64_t(r) * s.max_tokens + t) * k + j] = v;
      }
      if (blockIdx.x == 0 && int(threadIdx.x) < R)
        reinterpret_cast<uint64_t*>(peer[threadIdx.x] + p.win.ftok)[r] = n << 32 | uint64_t(T);
    }
    if (p.fanout) {
      // Fan-out: items (chunk c, token t, destination rank q) with u = c T R + t R + q (with the
      // interleaved warp_slot and G a multiple of R, every warp of CTA b writes to rank b mod R).
      // Lane j < k tells whether slot j of t goes to q; a token with none for q is skipped
      // (warp-uniform). To a peer: one copy into the row of t's first slot there (q copies it
      // into the others: frow); to this rank: a copy per slot straight into its row.
      const int64_t TR = T * R;
      for (int64_t u = warp_slot; u < TR * chunks; u += slot_step) {
        const int64_t t = (u % TR) / R, v_begin = (u / TR) * cv;
        const int q = int(u % R);
        int e = -1, d = -1;
        if (lane < k) e = ids[t * k + lane], d = dest[t * k + lane];
        const unsigned to_q = __ballot_sync(0xffffffffu, e >= 0 && d >= 0 && e / El == q);
        if (to_q == 0) continue;
        const uint4* src = reinterpret_cast<const uint4*>(src_rows + t * src_stride) + v_begin;
        const int64_t nv = vecs - v_begin < cv ? vecs - v_begin : cv;
        Item a;
        load_item(src, nv, lane, a);
        if (q != r) {
          const int j0 = __ffs(to_q) - 1;
          const int e0 = __shfl_sync(0xffffffffu, e, j0), d0 = __shfl_sync(0xffffffffu, d, j0);
          const int64_t g0 = int64_t(e0 % El) * cap + base[e0] + (d0 - e0 * int(T));
          uint4* dst = reinterpret_cast<uint4*>(peer[(p.diag & 1) ? r : q] + p.win.payload + g0 * stride) + v_begin;
          if (!(p.diag & 2)) store_item(dst, nv, lane, a);
        } else {
          for (unsigned m = to_q; m != 0; m &= m - 1) {
            const int j = __ffs(m) - 1;
            const int ej = __shfl_sync(0xffffffffu, e, j), dj = __shfl_sync(0xffffffffu, d, j);
            const int64_t g = int64_t(ej % El) * cap + base[ej] + (dj - ej * int(T));
            if (!(p.diag & 2))
              store_item(reinterpret_cast<uint4*>(peer[r] + p.win.payload + g * stride) + v_begin, nv, lane, a);
          }
        }
      }
    } else {
      // Items (slot i, chunk c) with u = c N + i: the warps of a CTA take different slots, so every
      // CTA has a share of the remote and the local rows.
      for (int64_t u = warp_slot; u < N * chunks; u += slot_step) {
        const int64_t i = u % N, v_begin = (u / N) * cv;
        const int e = ids[i], d = dest[i];
        if (e < 0 || d < 0) continue;
        const int64_t g = int64_t(e % El) * cap + base[e] + (d - e * int(T));
        const uint4* src = reinterpret_cast<const uint4*>(src_rows + (i / k) * src_stride) + v_begin;
        uint4* dst = reinterpret_cast<uint4*>(peer[(p.diag & 1) ? r : e / El] + p.win.payload + g * stride) + v_begin;
        const int64_t nv = vecs - v_begin < cv ? vecs - v_begin : cv;
        Item a;  // cv / 32 loads in flight per lane, then their stores
        load_item(src, nv, lane, a);
        if (!(p.diag & 2)) store_item(dst, nv, lane, a);
      }
    }
  }

  // 5. done: the CTA's rows and meta, then its share of round n in dflag[r] of every peer: one
  //    system-scope fence by thread 0 after the CTA barrier (cumulative over what the barrier
  //    ordered before it), then relaxed adds. CTA 0 then waits until every peer's CTAs have
  //    added theirs and records n as the rank's epoch. A failed round (capacity) counts too, so
  //    the counts stay in step; its wait is short (no rows moved).
  __syncthreads();
  trace_stamp(p, kTrDataDone);
  if (threadIdx.x == 0) {
    __threadfence_system();
    const uint64_t share = done_share(blockIdx.x, G);
    for (int q = 0; q < R; ++q) red_relaxed_sys_add(reinterpret_cast<uint64_t*>(peer[q] + p.win.dflag) + r, share);
  }
  trace_stamp(p, kTrSignaled);
  // When a peer fanned out its rows to this rank, every CTA waits (the received rows are copied
  // by all of them); else CTA 0 alone.
  const bool fan = (fan_src & ~(1ull << r)) != 0 && !refused && R > 1;
  if (blockIdx.x != 0 && !fan) return;
  if (fan && warp == 0) {  // the received rows' prefix over the local experts (a warp scan), while waiting
    int acc = 0;
    for (int el0 = 0; el0 < El; el0 += 32) {
      const int el = el0 + lane, v = el < El ? total[r * El + el] : 0;
      int x = v;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
      }
      if (el < El) fan_prefix[el] = acc + x - v;
      acc += __shfl_sync(0xffffffffu, x, 31);
    }
    if (lane == 0) fan_prefix[El] = acc;
  }
  bool ok = true;
  const uint64_t* dflag = reinterpret_cast<const uint64_t*>(c.window + p.win.dflag);
  for (int q = threadIdx.x; q < R; q += blockDim.x)
    if (!wait_epoch(p, c, dflag + q, 32, n, Phase::kData, q, &s_host_poll)) ok = false;
  if (!__syncthreads_and(ok)) return;  // timed out: the record is written, the group poisoned
  if (fan) {
    // 6. fan-out, local: a row g of this rank's experts whose frow[g] names another row (a
    //    later slot of a token a peer fanned out) takes that row's bytes. Every row below its
    //    expert's count got its frow this round from its sender, with its meta (g itself from
    //    a direct sender and for this rank's own tokens). Ordering: the sender wrote the first
    //    slot's row and the frows (weak stores), then its CTA barrier, __threadfence_system and
    //    the relaxed add of its done share; thread q of this CTA saw the count complete with an
    //    acquire load (wait_epoch), then the barrier above: every thread here reads after it.
    //    The reads go to L2 (ld.cg: nothing of this round's rows or frows can be in L1,
    //    whatever the model allows). The rows written here are later slots', disjoint from
    //    every row a sender wrote. A warp's next item's frow loads before the current item's
    //    row. Reuse: a peer writes its next round's rows only after that round's count
    //    exchange, which this rank enters after this kernel (and its combine) ended.
    trace_stamp(p, kTrFanWait);
    const int64_t received = fan_prefix[El];
    // Local copies: the largest items (4 KB a warp in flight; 2 KB ran the copy at ~2 TB/s).
    const int cv = p.chunk_vecs > 0 ? p.chunk_vecs : kMaxChunkVecs;
    const int64_t vecs = bytes / 16, chunks = (vecs + cv - 1) / cv, items = received * chunks;
    const int32_t* const frow = reinterpret_cast<const int32_t*>(c.window + p.win.frow);
    auto row_of = [&](int64_t u) {  // item u's row: i = u % received, by local expert
      const int64_t i = u % received;
      int lo = 0, hi = El - 1;  // the local expert: the last el with fan_prefix[el] <= i
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (fan_prefix[mid] <= i) lo = mid;
        else hi = mid - 1;
      }
      return int64_t(lo) * cap + (i - fan_prefix[lo]);
    };
    int64_t u = warp_slot;
    int32_t from = u < items ? __ldcg(frow + row_of(u)) : 0;
    for (; u < items; u += slot_step) {
      const int64_t g = row_of(u), v_begin = (u / received) * cv;
      const int32_t from_here = from;
      if (u + slot_step < items) from = __ldcg(frow + row_of(u + slot_step));
      if (from_here == g) continue;  // written in place by its sender
      const uint4* src = reinterpret_cast<const uint4*>(c.window + p.win.payload + int64_t(from_here) * stride) + v_begin;
      uint4* dst = reinterpret_cast<uint4*>(c.window + p.win.payload + g * stride) + v_begin;
      const int64_t nv = vecs - v_begin < cv ? vecs - v_begin : cv;
      Item a;
      load_item<true>(src, nv, lane, a);
      store_item(dst, nv, lane, a);
    }
    trace_stamp(p, kTrFanned);
  }
  if (blockIdx.x == 0) {
    // CTA 0's wait covered every rank's done count: the round is this rank's now. (The other
    // CTAs read the epoch at their start, before their done share, which this wait included.)
    if (threadIdx.x == 0) *reinterpret_cast<volatile uint64_t*>(ctrl + kEpoch) = n;
    trace_stamp(p, kTrAllDone);
  }
}

// ---- dequant: quantized payload rows -> bf16 rows of the experts; a CTA per row (grid-stride) --

constexpr int64_t kDequantMaxCtas = 4096;
// Exact decoders of formats/dequant.cuh; rows whose meta is -1 (past the count) are skipped.

template <Payload P>
__global__ void dequant_kernel(const Params p, const __grid_constant__ Ctxs cs) {
  constexpr int kBlock = P == Payload::kMxfp8 ? kMxBlock : kNvfp4Block;
  constexpr int kCodeBytes = P == Payload::kMxfp8 ? kBlock : kBlock / 2;
  const RankCtx& c = cs.r[blockIdx.y];
  if (!rank_active(p, c.rank)) return;
  const Shape& s = p.shape;
  const int64_t code_bytes = align_up(payload_code_bytes(P, s.hidden), 16);
  const int per_row = s.hidden / kBlock;
  const float scale_2 = 1.0f / p.nvfp4_g;
  for (int64_t g = blockIdx.x; g < s.rows(); g += gridDim.x) {
    if (reinterpret_cast<const RowMeta*>(c.window + p.win.meta)[g].expert < 0) continue;
    const uint8_t* row = c.window + p.win.payload + g * s.payload_stride();
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
}

// ---- combine ------------------------------------------------------------------------------------

constexpr int kCombineUnroll = 8;
constexpr int kMaxPeers = 64;  // the most ranks (validate): the combines keep the peer table in shared memory

// kCols columns of a row at col: fp32 rows (16-byte loads of 4) or bf16 rows (8 or 16 bytes).
template <bool kBf16Rows, int kCols>
__device__ __forceinline__ void load_cols(const uint8_t* row, int64_t col, float (&v)[kCols]) {
  if constexpr (!kBf16Rows) {
    static_assert(kCols == 4, "fp32 rows: 4 columns a lane");
    const float4 f = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(row) + col);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(row) + col;
    uint32_t u[kCols / 2];
    if constexpr (kCols == 8) {
      const uint4 w = *reinterpret_cast<const uint4*>(h);
      u[0] = w.x, u[1] = w.y, u[2] = w.z, u[3] = w.w;
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(h);
      u[0] = w.x, u[1] = w.y;
    }
#pragma unroll
    for (int i = 0; i < kCols / 2; ++i) v[2 * i] = __uint_as_float(u[i] << 16), v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

// acc[x] over the slots j < k in j order, slot j's row and weight held by lane j: fma(w_j, row_j,
// acc) (bf16 rows) or acc + row_j (fp32 rows, weighted by GEMM2), at col (no load past H or for a
// null row), kCombineUnroll rows' loads in flight before their sums.
template <bool kBf16Rows, int kCols>
__device__ __forceinline__ void sum_slot_rows(const uint8_t* row, float w, int k, int64_t col, int64_t H,
                                              float (&acc)[kCols]) {
  for (int j0 = 0; j0 < k; j0 += kCombineUnroll) {
    const uint8_t* src[kCombineUnroll];
    float wj[kCombineUnroll];
#pragma unroll
    for (int jj = 0; jj < kCombineUnroll; ++jj) {
      const unsigned long long a = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), (j0 + jj) & 31);
      wj[jj] = __shfl_sync(0xffffffffu, w, (j0 + jj) & 31);
      src[jj] = j0 + jj < k && col < H ? reinterpret_cast<const uint8_t*>(a) : nullptr;
    }
    float v[kCombineUnroll][kCols];
#pragma unroll
    for (int jj = 0; jj < kCombineUnroll; ++jj)
      if (src[jj]) load_cols<kBf16Rows, kCols>(src[jj], col, v[jj]);
#pragma unroll
    for (int jj = 0; jj < kCombineUnroll; ++jj)
      if (src[jj])
#pragma unroll
        for (int i = 0; i < kCols; ++i) acc[i] = kBf16Rows ? __fmaf_rn(wj[jj], v[jj][i], acc[i]) : __fadd_rn(acc[i], v[jj][i]);
  }
}

// kCols fp32 values rounded to bf16 into dst (8-byte or, kCols 8, 16-byte aligned).
template <int kCols>
__device__ __forceinline__ void store_bf16_cols(uint16_t* dst, const float (&acc)[kCols]) {
  uint32_t packed[kCols / 2];
#pragma unroll
  for (int i = 0; i < kCols / 2; ++i) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    packed[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  if constexpr (kCols == 8)
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  else
    *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
}

// y[t, col..col+kCols) = bf16(acc [+ the shared expert's row t, added before the one rounding]).
template <int kCols>
__device__ __forceinline__ void finish_cols(float (&acc)[kCols], const uint16_t* shared, int64_t shared_stride,
                                            uint16_t* y, int64_t y_stride, int64_t t, int64_t col) {
  if (shared) {
    float sh[kCols];
    load_cols<true, kCols>(reinterpret_cast<const uint8_t*>(shared + t * shared_stride), col, sh);
#pragma unroll
    for (int i = 0; i < kCols; ++i) acc[i] = __fadd_rn(acc[i], sh[i]);
  }
  store_bf16_cols<kCols>(y + t * y_stride + col, acc);
}

// What both combine kernels read and write per token, the context's fields held in registers:
// the stores of y go through generic pointers, after which the compiler would reload them from
// the kernel parameter.
struct TokenRows {
  const int32_t* slot_row;
  const int32_t* ids;
  uint16_t* y;
  int64_t y_stride;
  const uint16_t* shared;
  int64_t shared_stride;
  __device__ explicit TokenRows(const RankCtx& c)
      : slot_row(c.slot_row), ids(c.ids), y(c.y), y_stride(c.y_stride), shared(c.shared),
        shared_stride(c.shared_stride) {}
  // Lane j < k: {slot_row, expert id} of slot j of item u's token (u / chunks); {-1, 0} past the
  // items (the combine loops load the next item's before the current one's rows).
  __device__ __forceinline__ int2 slot(int64_t u, int64_t items, int64_t chunks, int k, int lane) const {
    if (u >= items || lane >= k) return make_int2(-1, 0);
    const int64_t t = u / chunks;
    return make_int2(slot_row[t * k + lane], ids[t * k + lane]);
  }
  template <int kCols>
  __device__ __forceinline__ void finish(float (&acc)[kCols], int64_t t, int64_t col) const {
    finish_cols<kCols>(acc, shared, shared_stride, y, y_stride, t, col);
  }
};

// y[t, c..c+kCols) = bf16(sum over j in order of the slot rows [+ shared]), fp32. One warp per
// (token, 32 x kCols columns): lane j < k finds slot j's row (and, for bf16 rows, its weight)
// once, the lanes stream the columns.
template <bool kBf16Rows, int kCols>
__global__ void __launch_bounds__(kThreads) combine_kernel(const Params p, const __grid_constant__ Ctxs cs) {
  const RankCtx& c = cs.r[blockIdx.y];
  if (!rank_active(p, c.rank)) return;
  trace_stamp(p, kTrStart);
  const Shape& s = p.shape;
  const int R = s.world, El = s.local_experts(), k = s.top_k;
  const int64_t H = s.hidden, row_bytes = s.y_row_bytes();
  __shared__ unsigned long long s_host_poll;
  uint64_t* ctrl = ctrl_of(c.window);
  const uint64_t n = *reinterpret_cast<volatile uint64_t*>(ctrl + kEpoch);
  if (*reinterpret_cast<volatile uint64_t*>(ctrl + kFailed) == n) return;  // the dispatch failed
  if (*reinterpret_cast<volatile uint64_t*>(ctrl + kAbort) != 0) {  // so did this call's (a wait)
    if (blockIdx.x == 0 && threadIdx.x == 0) fail_round(c, Phase::kAborted, c.rank, n, 0, n);
    return;
  }
  if (threadIdx.x == 0) s_host_poll = globaltimer_ns();
  if (!p.net) {
    // "My expert outputs of round n are complete" to every peer (the GEMMs ran before).
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      __threadfence_system();
      for (int q = 0; q < R; ++q) st_relaxed_sys(reinterpret_cast<uint64_t*>(c.peers[q] + p.win.cflag) + c.rank, n);
    }
    __syncthreads();
    const uint64_t* cflag = reinterpret_cast<const uint64_t*>(c.window + p.win.cflag);
    bool ok = true;
    for (int q = threadIdx.x; q < R; q += blockDim.x)
      if (!wait_epoch(p, c, cflag + q, 0, n, Phase::kCombine, q, &s_host_poll)) ok = false;
    if (!__syncthreads_and(ok)) return;
  }
  trace_stamp(p, kTrFlagsSeen);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  constexpr int kChunk = 32 * kCols;
  const int64_t chunks = (H + kChunk - 1) / kChunk;
  // The context's fields in registers (TokenRows) and the peer table in shared memory.
  __shared__ const uint8_t* s_peer[kMaxPeers];
  if (!p.net)  // (the network path reads its returned blocks, not the peers' windows)
    for (int q = threadIdx.x; q < R; q += blockDim.x) s_peer[q] = c.peers[q];
  __syncthreads();
  const int64_t T = c.T;
  const TokenRows out(c);
  const float* const weights = c.weights;
  // A warp's next item's slot (lane j < k: its row and expert) loads before the current item's
  // rows: one memory round trip an item instead of two.
  const int64_t items = T * chunks, step = int64_t(gridDim.x) * warps;
  int64_t u = int64_t(blockIdx.x) * warps + warp;
  int2 ge = out.slot(u, items, chunks, k, lane);
  for (; u < items; u += step) {
    const int64_t t = u / chunks, col = (u % chunks) * kChunk + lane * kCols;
    const int g = ge.x, e = ge.y;
    ge = out.slot(u + step, items, chunks, k, lane);
    const uint8_t* row = nullptr;  // lane j: slot j's row on its expert's rank
    float w = 0.0f;
    if (lane < k) {
      if (g >= 0) {
        if (p.net)  // the row came back in e's rank's block, where this rank's pack put the slot
          row = c.net_back +
                (int64_t(e / El) * p.net_block + c.net_pre[e] + (c.dest[t * k + lane] - e * int(T))) * row_bytes;
        else
          row = s_peer[e / El] + p.win.y + int64_t(g) * row_bytes;
        if constexpr (kBf16Rows) w = weights[t * k + lane];
      }
    }
    float acc[kCols];
#pragma unroll
    for (int i = 0; i < kCols; ++i) acc[i] = 0.0f;
    sum_slot_rows<kBf16Rows, kCols>(row, w, k, col, H, acc);
    if (col >= H) continue;
    out.finish<kCols>(acc, t, col);
  }
  __syncthreads();
  trace_stamp(p, kTrCombined);
}

// CombineRows::kBf16Sum (ep_layout.h): a. this rank's partial sum of each (source s, token t)
// with slots here, bf16(fma(w_j, row_j, p) over them in j order), stored into part[r, t] of
// rank s (a warp per (s, t, 32 x kCols columns), the slots from flist[s, t]); b. the CTAs'
// shares of the rank's ticket (ctrl[kSumTicket], each after a system-scope fence): the CTA that
// completes it raises this rank's ready flag on every rank; c. after every rank's flag, y[t] =
// bf16(sum over the ranks q holding slots of t, in rank order, of its own part[q, t] [+ shared])
// in fp32.
template <int kCols>
__global__ void __launch_bounds__(kThreads) combine_sum_kernel(const Params p, const __grid_constant__ Ctxs cs) {
  const RankCtx& c = cs.r[blockIdx.y];
  if (!rank_active(p, c.rank)) return;
  trace_stamp(p, kTrStart);
  const Shape& s = p.shape;
  const int R = s.world, El = s.local_experts(), k = s.top_k, r = c.rank;
  const int64_t H = s.hidden, Tmax = s.max_tokens;
  __shared__ unsigned long long s_host_poll;
  __shared__ int64_t s_tok[kMaxPeers + 1];  // prefix of the sources' token counts this round
  __shared__ const uint8_t* s_peer[kMaxPeers];
  uint64_t* ctrl = ctrl_of(c.window);
  const uint64_t n = *reinterpret_cast<volatile uint64_t*>(ctrl + kEpoch);
  if (*reinterpret_cast<volatile uint64_t*>(ctrl + kFailed) == n) return;  // the dispatch failed
  if (*reinterpret_cast<volatile uint64_t*>(ctrl + kAbort) != 0) {  // so did this call's (a wait)
    if (blockIdx.x == 0 && threadIdx.x == 0) fail_round(c, Phase::kAborted, r, n, 0, n);
    return;
  }
  for (int q = threadIdx.x; q < R; q += blockDim.x) s_peer[q] = c.peers[q];
  if (threadIdx.x == 0) {
    s_host_poll = globaltimer_ns();
    const uint64_t* ftok = reinterpret_cast<const uint64_t*>(c.window + p.win.ftok);
    int64_t acc = 0;
    for (int q = 0; q < R; ++q) {
      s_tok[q] = acc;
      const uint64_t v = __ldcg(reinterpret_cast<const unsigned long long*>(ftok + q));
      acc += (v >> 32) == n ? int64_t(uint32_t(v)) : 0;
    }
    s_tok[R] = acc;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  constexpr int kChunk = 32 * kCols;
  const int64_t chunks = (H + kChunk - 1) / kChunk;
  const int64_t y_row_bytes = H * 2;

  // a. the partial sums, each stored straight into its token's rank (part[r, t] there): the
  //    stores cross NVLink while the next rows load, and the token's rank reads its partials
  //    locally. Items (token t, source offset o, chunk) with the sources interleaved, rank r's
  //    offset o being source (r + 1 + o) mod R: at any moment every rank stores into every
  //    other (in source order, all ranks stored into rank 0 first: its links were the
  //    bottleneck, docs/perf/log.md). A warp's next item's slot list loads before the current
  //    item's rows.
  {
    const uint8_t* const y_rows = c.window + p.win.y;
    const int2* const flist = reinterpret_cast<const int2*>(c.window + p.win.flist);
    int64_t t_max = 0;  // the most tokens a source sent this round
    for (int q = 0; q < R; ++q) t_max = max(t_max, s_tok[q + 1] - s_tok[q]);
    // Two column chunks an item, the token's slots here compacted and loaded kSumUnroll at a
    // time (one chunk an item over all k lanes left ~2 slots' 512 bytes a warp in flight at
    // k = 8 over 4 ranks: the pass ran at ~1.4 TB/s, docs/perf/log.md). Per column the same
    // fma(w_j, row_j, p) in j order as sum_slot_rows.
    constexpr int kSumUnroll = 4;
    const int64_t spans = (chunks + 1) / 2, items = t_max * R * spans, step = int64_t(gridDim.x) * warps;
    auto slot_of = [&](int64_t u) {  // lane j < k: slot j of item u's token here, {row, weight}
      int2 v = make_int2(-1, 0);
      if (u < items && lane < k) {
        const int64_t i = u / spans, t = i / R;
        const int src = int((r + 1 + i % R) % R);
        if (t < s_tok[src + 1] - s_tok[src]) v = __ldcg(flist + (src * Tmax + t) * k + lane);
      }
      return v;
    };
    int64_t u = int64_t(blockIdx.x) * warps + warp;
    int2 v = slot_of(u);
    for (; u < items; u += step) {
      const int2 v_next = slot_of(u + step);
      const int64_t i = u / spans, t = i / R, col0 = (u % spans) * 2 * kChunk + lane * kCols;
      const int src = int((r + 1 + i % R) % R);
      const uint8_t* row = nullptr;  // lane j: slot j's row here
      float w = 0.0f;
      if (v.x >= 0) row = y_rows + int64_t(v.x) * y_row_bytes, w = __int_as_float(v.y);
      v = v_next;
      unsigned m = __ballot_sync(0xffffffffu, row != nullptr);  // the token's slots here
      if (m == 0) continue;  // no slot of this token here (or no such token)
      float acc[2][kCols];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int x = 0; x < kCols; ++x) acc[h][x] = 0.0f;
      while (m != 0) {  // warp-uniform
        const uint8_t* srcs[kSumUnroll];
        float wj[kSumUnroll];
#pragma unroll
        for (int jj = 0; jj < kSumUnroll; ++jj) {
          srcs[jj] = nullptr;
          wj[jj] = 0.0f;
          if (m != 0) {
            const int j = __ffs(m) - 1;
            m &= m - 1;
            srcs[jj] = reinterpret_cast<const uint8_t*>(
                __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), j));
            wj[jj] = __shfl_sync(0xffffffffu, w, j);
          }
        }
        float vv[kSumUnroll][2][kCols];
#pragma unroll
        for (int jj = 0; jj < kSumUnroll; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (srcs[jj] && col0 + h * kChunk < H) load_cols<true, kCols>(srcs[jj], col0 + h * kChunk, vv[jj][h]);
#pragma unroll
        for (int jj = 0; jj < kSumUnroll; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (srcs[jj] && col0 + h * kChunk < H)
#pragma unroll
              for (int x = 0; x < kCols; ++x) acc[h][x] = __fmaf_rn(wj[jj], vv[jj][h][x], acc[h][x]);
      }
      uint16_t* const part = reinterpret_cast<uint16_t*>(const_cast<uint8_t*>(s_peer[src]) + p.win.part) +
                             (int64_t(r) * Tmax + t) * H;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (col0 + h * kChunk < H) store_bf16_cols<kCols>(part + col0 + h * kChunk, acc[h]);
    }
  }
  // b. the ticket: the last CTA of this rank's combine raises its ready flag everywhere.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this CTA's partials (in the tokens' ranks), before its share
    const uint64_t share = done_share(blockIdx.x, gridDim.x);
    const unsigned long long old = atomicAdd(reinterpret_cast<unsigned long long*>(ctrl + kSumTicket), share);
    if (uint32_t(old + share) == 0) {  // the shares of every CTA are in: every partial is written
      __threadfence_system();
      for (int q = 0; q < R; ++q) st_relaxed_sys(reinterpret_cast<uint64_t*>(const_cast<uint8_t*>(s_peer[q]) + p.win.cflag) + r, n);
    }
  }
  trace_stamp(p, kTrSummed);
  const uint64_t* cflag = reinterpret_cast<const uint64_t*>(c.window + p.win.cflag);
  bool ok = true;
  for (int q = threadIdx.x; q < R; q += blockDim.x)
    if (!wait_epoch(p, c, cflag + q, 0, n, Phase::kCombine, q, &s_host_poll)) ok = false;
  if (!__syncthreads_and(ok)) return;
  trace_stamp(p, kTrFlagsSeen);

  // c. the token's rank: the ranks' partials (here, part[q, t]) in rank order
  const int64_t T = c.T;
  const TokenRows out(c);
  // Items (token t, two column chunks): each lane loads a partial's kCols columns at col and at
  // col + kChunk, kPartUnroll ranks' partials at a time: twice the bytes in flight of one chunk
  // an item (one chunk an item moved the partials at ~1-1.4 TB/s: 2-4 partials of 512 bytes a
  // warp in flight, docs/perf/log.md). A warp's next item's slots load before the current
  // item's partials (as in combine_kernel). The adds: per column, the ranks in order, as before.
  constexpr int kPartUnroll = 4;
  const int64_t spans = (chunks + 1) / 2, items_c = T * spans, step_c = int64_t(gridDim.x) * warps;
  int64_t uc = int64_t(blockIdx.x) * warps + warp;
  int2 ge = out.slot(uc, items_c, spans, k, lane);
  for (; uc < items_c; uc += step_c) {
    const int64_t t = uc / spans, col0 = (uc % spans) * 2 * kChunk + lane * kCols;
    int qj = -1;
    if (lane < k && ge.x >= 0) qj = ge.y / El;
    ge = out.slot(uc + step_c, items_c, spans, k, lane);
    unsigned long long ranks = 0;  // the ranks holding slots of t
    for (int j = 0; j < k; ++j) {
      const int q = __shfl_sync(0xffffffffu, qj, j);
      if (q >= 0) ranks |= 1ull << q;
    }
    float acc[2][kCols];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int x = 0; x < kCols; ++x) acc[h][x] = 0.0f;
    while (ranks != 0) {
      const uint8_t* src_row[kPartUnroll];
#pragma unroll
      for (int jj = 0; jj < kPartUnroll; ++jj) {
        src_row[jj] = nullptr;
        if (ranks != 0) {
          const int q = __ffsll(static_cast<long long>(ranks)) - 1;
          ranks &= ranks - 1;
          src_row[jj] = c.window + p.win.part + (int64_t(q) * Tmax + t) * y_row_bytes;
        }
      }
      float v[kPartUnroll][2][kCols];
#pragma unroll
      for (int jj = 0; jj < kPartUnroll; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (src_row[jj] && col0 + h * kChunk < H) load_cols<true, kCols>(src_row[jj], col0 + h * kChunk, v[jj][h]);
#pragma unroll
      for (int jj = 0; jj < kPartUnroll; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (src_row[jj] && col0 + h * kChunk < H)
#pragma unroll
            for (int x = 0; x < kCols; ++x) acc[h][x] = __fadd_rn(acc[h][x], v[jj][h][x]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (col0 + h * kChunk < H) out.finish<kCols>(acc[h], t, col0 + h * kChunk);
  }
  __syncthreads();
  trace_stamp(p, kTrCombined);
}

size_t dispatch_smem(const Shape& s) {
  return size_t(s.world) * sizeof(uint8_t*) + size_t(2 + s.world) * s.num_experts * sizeof(int) +
         size_t(s.local_experts() + 1) * sizeof(int);
}

cudaError_t cooperative(const void* kernel, dim3 grid, size_t smem, cudaStream_t s, const Params& p, const Ctxs& cs) {
  void* args[] = {const_cast<Params*>(&p), const_cast<Ctxs*>(&cs)};
  return cudaLaunchCooperativeKernel(kernel, grid, dim3(kThreads), args, smem, s);
}

// The combine kernel of a round's rows and its callers' alignment: bf16 rows take 8 columns a
// lane (16-byte loads) when H and every y / shared row allow it.
bool combine_wide(const Shape& s, const Ctxs& cs, int ranks) {
  if (!bf16_rows(s.combine) || s.hidden % 8 != 0) return false;
  for (int i = 0; i < ranks; ++i) {
    const RankCtx& c = cs.r[i];
    if (reinterpret_cast<uintptr_t>(c.y) % 16 != 0 || c.y_stride % 8 != 0) return false;
    if (c.shared && (reinterpret_cast<uintptr_t>(c.shared) % 16 != 0 || c.shared_stride % 8 != 0)) return false;
  }
  return true;
}

}  // namespace

int ctas_per_rank(const Shape& s, int ranks, int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  const size_t smem = dispatch_smem(s);
  if (cudaFuncSetAttribute(dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
    return 0;
  // Both kernels: 512 threads; the smaller occupancy, at most 2 CTAs per SM.
  int a = 0, b = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&a, dispatch_kernel, kThreads, smem) != cudaSuccess) return 0;
  for (auto* kern : {combine_kernel<false, 4>, combine_kernel<true, 4>, combine_kernel<true, 8>,
                     combine_sum_kernel<4>, combine_sum_kernel<8>}) {
    int m = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&m, kern, kThreads, 0) != cudaSuccess) return 0;
    b = b == 0 ? m : std::min(b, m);
  }
  const int per_sm = std::min({a, b, 2});
  return per_sm * sms / std::max(ranks, 1);
}

int dispatch_ctas(const Shape& s, int64_t T, int max_ctas, int chunk_vecs) {
  const int cv = chunk_vecs > 0 ? std::min(chunk_vecs, kMaxChunkVecs) : kChunkVecs;
  const int64_t warps = kThreads / 32, chunks = (s.payload_bytes() / 16 + cv - 1) / cv;
  const int64_t items = T * s.top_k * chunks;
  // At least kMinDispatchCtas: CTA 0 publishes the counts and makes the work list, the others
  // share the empty rows' meta and the slots (one CTA alone at one NVFP4 token: 15.7 us, four
  // bf16 CTAs: 11.5).
  constexpr int64_t kMinDispatchCtas = 4;
  return int(std::clamp<int64_t>(std::max((items + warps - 1) / warps, kMinDispatchCtas), 1, std::max(max_ctas, 1)));
}

int combine_ctas(const Shape& s, int64_t T, int max_ctas) {
  const int64_t warps = kThreads / 32, units = T * ((s.hidden + 127) / 128);
  return int(std::clamp<int64_t>((units + warps - 1) / warps, 1, std::max(max_ctas, 1)));
}

cudaError_t launch_quantize(const Params& p, const Ctxs& cs, int ranks, int64_t max_tokens, cudaStream_t s) {
  if (p.shape.payload == Payload::kBf16 || max_tokens == 0 || ranks == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(max_tokens), static_cast<unsigned>(ranks));
  if (p.shape.payload == Payload::kMxfp8) quantize_kernel<Payload::kMxfp8><<<grid, 128, 0, s>>>(p, cs);
  else quantize_kernel<Payload::kNvfp4><<<grid, 128, 0, s>>>(p, cs);
  return cudaGetLastError();
}

cudaError_t launch_dispatch(const Params& p, const Ctxs& cs, int ranks, int ctas, cudaStream_t s) {
  return cooperative(reinterpret_cast<const void*>(&dispatch_kernel), dim3(unsigned(ctas), unsigned(ranks)),
                     dispatch_smem(p.shape), s, p, cs);
}

cudaError_t launch_dequant(const Params& p, const Ctxs& cs, int ranks, cudaStream_t s) {
  if (p.shape.payload == Payload::kBf16 || ranks == 0) return cudaSuccess;
  const dim3 grid(unsigned(std::min<int64_t>(p.shape.rows(), kDequantMaxCtas)), unsigned(ranks));
  if (p.shape.payload == Payload::kMxfp8) dequant_kernel<Payload::kMxfp8><<<grid, 128, 0, s>>>(p, cs);
  else dequant_kernel<Payload::kNvfp4><<<grid, 128, 0, s>>>(p, cs);
  return cudaGetLastError();
}

cudaError_t launch_combine(const Params& p, const Ctxs& cs, int ranks, int ctas, cudaStream_t s) {
  const dim3 grid{unsigned(ctas), unsigned(ranks)};
  const bool wide = combine_wide(p.shape, cs, ranks);
  const void* k = p.shape.combine == CombineRows::kF32 ? reinterpret_cast<const void*>(&combine_kernel<false, 4>)
                  : p.shape.combine == CombineRows::kBf16Sum
                      ? (wide ? reinterpret_cast<const void*>(&combine_sum_kernel<8>)
                              : reinterpret_cast<const void*>(&combine_sum_kernel<4>))
                  : wide ? reinterpret_cast<const void*>(&combine_kernel<true, 8>)
                         : reinterpret_cast<const void*>(&combine_kernel<true, 4>);
  return cooperative(k, grid, 0, s, p, cs);
}

}  // namespace moekit::ep
