// moekit/comm/ep_net_sm90.cuh — EP over NCCL's host collectives, for peers whose memory this GPU
// cannot load and store (another node, or a group told to use it: EpGroup's transport "host"):
// the same rows in the same places as the NVLink path (ep_kernels_sm90.cuh), so the layer's
// output is the same bit for bit; only how bytes travel differs.
//
//   dispatch  1. net_counts: this rank's rows per expert [E] (0 for a rank with no tokens)
//             2. ncclAllGather of the counts: every rank holds all R x E
//             3. net_pack: each slot's payload row and its 16-byte meta into the send block of
//                its expert's rank, in (expert, slot rank) order: block q of B = max_tokens x
//                min(k, E_l) rows (the most a rank can send one peer), fixed so that the call
//                needs no count on the host (graph-capturable)
//             4. ncclAlltoAll of the blocks
//             5. net_unpack: every received row to its place in the experts' batched layout
//                (base(e, src) + its rank, as the NVLink path), the work list, the counts, the
//                empty rows' meta; a total past the capacity fails the round on every rank alike
//   combine   1. net_pack_back: each received row's expert output back into its source's block,
//                in the order it came
//             2. ncclAlltoAll
//             3. the combine kernel reading each slot's row from the returned blocks
// Costs: every rank moves R x B rows each way whatever the routing (bytes, not latency, are
// what this path gives up), and NCCL's collectives wait without a bound: a peer that dies is
// the job's watchdog's to handle (NCCL_TIMEOUT / ncclCommAbort), not this path's.
#pragma once

#include <cuda_runtime.h>

#include "moekit/comm/ep_kernels_sm90.cuh"

namespace moekit::ep {

// The rows of one peer's block (B).
MOEKIT_HD int64_t net_block_rows(const Shape& s) {
  const int El = s.local_experts();
  return int64_t(s.max_tokens > 1 ? s.max_tokens : 1) * (s.top_k < El ? s.top_k : El);
}
// Bytes of one dispatched row in a block: the payload, then its meta.
MOEKIT_HD int64_t net_row_bytes(const Shape& s) { return s.payload_stride() + int64_t(sizeof(RowMeta)); }

// The network path's buffers of a rank (its scratch).
struct NetBuffers {
  int32_t* cnt_send = nullptr;  // [E]
  int32_t* cnt_all = nullptr;   // [R][E]
  int32_t* pre = nullptr;       // [E] rows of this rank for experts of the same rank before e
  uint8_t* send = nullptr;      // [R][B][net_row_bytes]
  uint8_t* recv = nullptr;      // [R][B][net_row_bytes]
  uint8_t* back_send = nullptr; // [R][B][y_row_bytes]
  uint8_t* back_recv = nullptr; // [R][B][y_row_bytes]
};

cudaError_t launch_net_counts(const Params& p, const RankCtx& c, const NetBuffers& b, cudaStream_t s);
cudaError_t launch_net_pack(const Params& p, const RankCtx& c, const NetBuffers& b, cudaStream_t s);
cudaError_t launch_net_unpack(const Params& p, const RankCtx& c, const NetBuffers& b, cudaStream_t s);
cudaError_t launch_net_pack_back(const Params& p, const RankCtx& c, const NetBuffers& b, cudaStream_t s);

}  // namespace moekit::ep
