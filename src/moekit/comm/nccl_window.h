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
  static void destroy_comm(void* comm);

 private:
  NcclWindow() = default;
  void* comm_ = nullptr;
  void* win_ = nullptr;  // ncclWindow_t
  void* local_ = nullptr;
  int rank_ = 0, world_ = 0;
  std::vector<void*> peers_;
};

}  // namespace moekit::ep
