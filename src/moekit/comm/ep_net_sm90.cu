#include "moekit/comm/ep_net_sm90.cuh"

#include <algorithm>

namespace moekit::ep {

namespace {

constexpr int kNetThreads = 256;

__device__ __forceinline__ void copy16(uint8_t* dst, const uint8_t* src, int64_t bytes, int tid, int nthreads) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  for (int64_t v = tid; v < bytes / 16; v += nthreads) d[v] = s[v];
}

__global__ void net_counts_kernel(const Params p, const RankCtx c, NetBuffers b) {
  const int E = p.shape.num_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) b.cnt_send[e] = c.T > 0 ? c.expert_count[e] : 0;
}

// Shared memory of pack and unpack: pre[E] (this rank's rows before e among the experts of e's
// rank) and base[E] (rows of earlier ranks for e).
__device__ void prefixes(const Params& p, const RankCtx& c, const NetBuffers& b, int* pre, int* base) {
  const Shape& s = p.shape;
  const int E = s.num_experts, El = s.local_experts(), r = c.rank;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int bsum = 0;
    for (int src = 0; src < r; ++src) bsum += b.cnt_all[src * E + e];
    base[e] = bsum;
  }
  if (threadIdx.x == 0) {
    for (int q = 0; q < s.world; ++q) {
      int run = 0;
      for (int el = 0; el < El; ++el) {
        pre[q * El + el] = run;
        run += b.cnt_all[r * E + q * El + el];
      }
    }
  }
  __syncthreads();
}

// Each slot's row and meta into its expert rank's block; slot_row as the NVLink path writes it.
__global__ void __launch_bounds__(kNetThreads) net_pack_kernel(const Params p, const RankCtx c, NetBuffers b) {
  extern __shared__ int smem[];
  const Shape& s = p.shape;
  const int E = s.num_experts, El = s.local_experts(), k = s.top_k, cap = s.capacity;
  int* pre = smem;
  int* base = smem + E;
  prefixes(p, c, b, pre, base);
  if (blockIdx.x == 0)
    for (int e = threadIdx.x; e < E; e += blockDim.x) b.pre[e] = pre[e];
  const int64_t N = c.T * k, B = net_block_rows(s), rb = net_row_bytes(s);
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t i = int64_t(blockIdx.x) * warps + warp; i < N; i += int64_t(gridDim.x) * warps) {
    const int e = c.ids[i], d = c.dest[i];
    int64_t g = -1;
    if (e >= 0 && d >= 0) {
      const int q = e / El, j = d - e * int(c.T);
      g = int64_t(e % El) * cap + base[e] + j;
      uint8_t* row = b.send + (int64_t(q) * B + pre[e] + j) * rb;
      copy16(row, c.src_rows + (i / k) * c.src_stride, s.payload_bytes(), lane, 32);
      if (lane == 0) {
        const RowMeta m{e, int32_t(c.rank << kSrcTokenBits) | int32_t(i / k), int32_t(i % k), c.weights[i]};
        *reinterpret_cast<RowMeta*>(row + s.payload_stride()) = m;
      }
    }
    if (lane == 0) c.slot_row[i] = int32_t(g);
  }
}

// src_pre[src][el]: the rows src sends this rank for its local experts before el ([R][El + 1],
// the last column the total); every thread of the CTA takes part, then a barrier.
__device__ void fill_src_pre(const Shape& s, const NetBuffers& b, int r, int* src_pre) {
  const int E = s.num_experts, El = s.local_experts();
  for (int src = threadIdx.x; src < s.world; src += blockDim.x) {
    int run = 0;
    for (int el = 0; el < El; ++el) {
      src_pre[src * (El + 1) + el] = run;
      run += b.cnt_all[src * E + r * El + el];
    }
    src_pre[src * (El + 1) + El] = run;
  }
  __syncthreads();
}

// Row i of src's block, where the NVLink path puts it: e_l * capacity + (rows of lower ranks for
// the expert) + its rank among src's rows for the expert.
__device__ int64_t net_place(const Shape& s, const NetBuffers& b, const int* src_pre, int r, int src, int64_t i) {
  const int E = s.num_experts, El = s.local_experts();
  int el = 0;
  while (src_pre[src * (El + 1) + el + 1] <= i) ++el;
  const int e = r * El + el, j = int(i) - src_pre[src * (El + 1) + el];
  int base = 0;
  for (int s2 = 0; s2 < src; ++s2) base += b.cnt_all[s2 * E + e];
  return int64_t(el) * s.capacity + base + j;
}

// The received blocks into the experts' layout; CTA 0 also the work list, the counts, the epoch.
__global__ void __launch_bounds__(kNetThreads) net_unpack_kernel(const Params p, const RankCtx c, NetBuffers b) {
  extern __shared__ int smem[];
  const Shape& s = p.shape;
  const int R = s.world, E = s.num_experts, El = s.local_experts(), cap = s.capacity, r = c.rank;
  int* total = smem;            // [El] rows for each local expert
  int* over = smem + El;        // [1] the first expert past its capacity, or E
  int* src_pre = smem + El + 1;  // [R][El + 1] rows of src for local experts before el
  uint64_t* ctrl = reinterpret_cast<uint64_t*>(c.window);
  const uint64_t n = *reinterpret_cast<volatile uint64_t*>(ctrl + kEpoch) + 1;
  if (threadIdx.x == 0) *over = E;
  __syncthreads();
  for (int el = threadIdx.x; el < El; el += blockDim.x) {
    int t = 0;
    for (int src = 0; src < R; ++src) t += b.cnt_all[src * E + r * El + el];
    total[el] = t;
    if (t > cap) atomicMin(over, r * El + el);
  }
  // Capacity is checked over every expert (every rank decides alike from the same counts).
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int t = 0;
    for (int src = 0; src < R; ++src) t += b.cnt_all[src * E + e];
    if (t > cap) atomicMin(over, e);
  }
  fill_src_pre(s, b, r, src_pre);
  RowMeta* meta = reinterpret_cast<RowMeta*>(c.window + p.win.meta);
  if (*over < E) {
    if (blockIdx.x == 0) {
      for (int el = threadIdx.x; el < El; el += blockDim.x) c.expert_rows[el] = 0;
      if (threadIdx.x == 0) {
        int tot = 0;
        for (int src = 0; src < R; ++src) tot += b.cnt_all[src * E + *over];
        const RankCtx& cc = c;
        // write_record's equivalent (the first writer wins)
        if (atomicCAS(cc.recorded, 0, 1) == 0) {
          volatile ErrorRecord* dst = cc.error;
          dst->rank = cc.rank;
          dst->layer = cc.layer;
          dst->peer = *over;
          dst->expected = uint64_t(cap);
          dst->seen = uint64_t(tot);
          dst->round = n;
          __threadfence_system();
          dst->phase = int32_t(Phase::kCapacity);
          __threadfence_system();
        }
        *c.num_active = 0;
        c.chunk_prefix[0] = 0;
        ctrl[kFailed] = n;
        ctrl[kEpoch] = n;
      }
    }
    return;
  }
  if (blockIdx.x == 0) {
    for (int el = threadIdx.x; el < El; el += blockDim.x) c.expert_rows[el] = total[el];
    if (threadIdx.x == 0) {
      int active = 0, chunks = 0;
      c.chunk_prefix[0] = 0;
      for (int el = 0; el < El; ++el) {
        if (total[el] == 0) continue;
        c.expert[active] = el;
        c.count[active] = total[el];
        c.row_start[active] = el * cap;
        chunks += (total[el] + p.chunk_rows - 1) / p.chunk_rows;
        c.chunk_prefix[++active] = chunks;
      }
      *c.num_active = active;
      ctrl[kEpoch] = n;  // read by combine (a later launch on the stream)
    }
  }
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < int64_t(El) * cap;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int el = int(i / cap), row = int(i % cap);
    if (row >= total[el]) meta[i] = RowMeta{-1, 0, 0, 0.0f};
  }
  const int64_t B = net_block_rows(s), rb = net_row_bytes(s), stride = s.payload_stride();
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int src = 0; src < R; ++src) {
    const int rows = src_pre[src * (El + 1) + El];
    for (int64_t i = int64_t(blockIdx.x) * warps + warp; i < rows; i += int64_t(gridDim.x) * warps) {
      const int64_t g = net_place(s, b, src_pre, r, src, i);
      const uint8_t* row = b.recv + (int64_t(src) * B + i) * rb;
      copy16(c.window + p.win.payload + g * stride, row, s.payload_bytes(), lane, 32);
      if (lane == 0) meta[g] = *reinterpret_cast<const RowMeta*>(row + stride);
    }
  }
}

// Each received row's expert output back into its source's block, in the order it came.
__global__ void __launch_bounds__(kNetThreads) net_pack_back_kernel(const Params p, const RankCtx c, NetBuffers b) {
  extern __shared__ int smem[];
  const Shape& s = p.shape;
  const int R = s.world, El = s.local_experts(), r = c.rank;
  int* src_pre = smem;  // [R][El + 1]
  fill_src_pre(s, b, r, src_pre);
  uint64_t* ctrl = reinterpret_cast<uint64_t*>(c.window);
  if (*reinterpret_cast<volatile uint64_t*>(ctrl + kFailed) == *reinterpret_cast<volatile uint64_t*>(ctrl + kEpoch))
    return;  // the dispatch failed: nothing to send back
  const int64_t B = net_block_rows(s), yb = s.y_row_bytes();
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int src = 0; src < R; ++src) {
    const int rows = src_pre[src * (El + 1) + El];
    for (int64_t i = int64_t(blockIdx.x) * warps + warp; i < rows; i += int64_t(gridDim.x) * warps) {
      const int64_t g = net_place(s, b, src_pre, r, src, i);
      copy16(b.back_send + (int64_t(src) * B + i) * yb, c.window + p.win.y + g * yb, yb, lane, 32);
    }
  }
}

int grid_for(int64_t work, int per_cta) {
  return int(std::clamp<int64_t>((work + per_cta - 1) / per_cta, 1, 1024));
}

}  // namespace

cudaError_t launch_net_counts(const Params& p, const RankCtx& c, const NetBuffers& b, cudaStream_t s) {
  net_counts_kernel<<<1, 256, 0, s>>>(p, c, b);
  return cudaGetLastError();
}

cudaError_t launch_net_pack(const Params& p, const RankCtx& c, const NetBuffers& b, cudaStream_t s) {
  const size_t smem = size_t(2) * p.shape.num_experts * sizeof(int);
  net_pack_kernel<<<grid_for(c.T * p.shape.top_k, kNetThreads / 32), kNetThreads, smem, s>>>(p, c, b);
  return cudaGetLastError();
}

cudaError_t launch_net_unpack(const Params& p, const RankCtx& c, const NetBuffers& b, cudaStream_t s) {
  const Shape& sh = p.shape;
  const size_t smem = (size_t(sh.local_experts()) + 1 + size_t(sh.world) * (sh.local_experts() + 1)) * sizeof(int);
  net_unpack_kernel<<<grid_for(net_block_rows(sh) * sh.world, kNetThreads / 32), kNetThreads, smem, s>>>(p, c, b);
  return cudaGetLastError();
}

cudaError_t launch_net_pack_back(const Params& p, const RankCtx& c, const NetBuffers& b, cudaStream_t s) {
  const Shape& sh = p.shape;
  const size_t smem = size_t(sh.world) * (sh.local_experts() + 1) * sizeof(int);
  net_pack_back_kernel<<<grid_for(net_block_rows(sh) * sh.world, kNetThreads / 32), kNetThreads, smem, s>>>(p, c, b);
  return cudaGetLastError();
}

}  // namespace moekit::ep
