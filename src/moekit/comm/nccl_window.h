// moekit/comm/nccl_window.h — NCCL for EP: the library loaded at run time (absent: a clear
// error, nothing else breaks), a symmetric window per rank and its peer table.
//
// Pinned: the NCCL the build found (the CUDA toolkit's nccl.h, 2.28.9 with CUDA 13.0; CMake
// reports it). The peer pointers come from NCCL's device API (ncclGetPeerPointer on the
// window, in a one-off kernel), whose window struct is that version's: the library loaded
// must be the same version, or create() refuses it with both versions named.
//   create   ncclMemAlloc (VMM memory) -> ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) ->
//            peer table -> zero -> barrier (a one-int all-reduce). Collective; every rank of
//            the communicator must be in one LSA team (one NVLink domain).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moekit::ep {

// The NCCL build and run-time facts, for messages and tests.
struct NcclInfo {
  bool built = false;       // compiled against nccl.h with the device API
  int compiled_version = 0; // NCCL_VERSION_CODE of the headers
  bool loaded = false;      // libnccl.so.2 found at run time
  int runtime_version = 0;
  std::string why;          // when not usable: what is missing
};
NcclInfo nccl_info();

class NcclWindow {
 public:
  // comm: an ncclComm_t. Throws moekit::Error when NCCL is absent, of another version, or the
  // ranks are not one LSA team.
  static std::unique_ptr<NcclWindow> create(void* comm, size_t bytes, int expected_world);
  ~NcclWindow();
  int rank() const { return rank_; }
  int world() const { return world_; }
  void* local() const { return local_; }
  const std::vector<void*>& peers() const { return peers_; }
  void barrier();  // a one-int all-reduce on the communicator, synchronized

  // Tests: a communicator of all `ndev` local GPUs from one process (ncclCommInitAll);
  // destroy_comm frees it.
  static std::vector<void*> init_all(int ndev);
  // Frees a communicator: ncclCommDestroy, or ncclCommAbort once mark_failed(comm) was called (a
  // peer failed or never arrived: nothing collective may be waited for any more).
  static void destroy_comm(void* comm);
  static void mark_failed(void* comm);
  static void clear_failed(void* comm);
  static bool failed(void* comm);

  // One process per rank: an ncclUniqueId (kUniqueIdBytes) made by one rank and shared, then
  // ncclCommInitRank on the current device (collective).
  static constexpr int kUniqueIdBytes = 128;
  static std::vector<uint8_t> unique_id();
  static void* init_rank(const std::vector<uint8_t>& id, int world, int rank);
  // A one-int all-reduce enqueued on `stream` (not synchronized): every rank's stream passes it
  // at about the same time (benchmarks start their timed regions there). `scratch`: one device int.
  static void allreduce_on(void* comm, int* scratch, void* stream);
  // The host collectives of EP's network path (comm/ep_net_sm90.cuh), enqueued on `stream`.
  static void allgather_i32(void* comm, const int32_t* send, int32_t* recv, size_t count, void* stream);
  static void alltoall_bytes(void* comm, const void* send, void* recv, size_t bytes_per_peer, void* stream);
  // The ranks of the communicator's load/store team (its NVLink domain) that this rank is in.
  static int lsa_ranks(void* comm);
  // A communicator's rank and size; a one-int all-reduce, synchronized (any communicator).
  static int comm_rank(void* comm);
  static int comm_size(void* comm);
  static void comm_barrier(void* comm);

 private:
  NcclWindow() = default;
  void release(bool collective);
  void* comm_ = nullptr;
  void* win_ = nullptr;  // ncclWindow_t
  void* local_ = nullptr;
  int rank_ = 0, world_ = 0;
  std::vector<void*> peers_;
};

}  // namespace moekit::ep
