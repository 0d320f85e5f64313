#include "moekit/comm/nccl_window.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <set>

#include "moekit/common/error.h"

#ifdef MOEKIT_HAVE_NCCL
#include <nccl.h>
#include <nccl_device.h>
#endif

namespace moekit::ep {

#ifdef MOEKIT_HAVE_NCCL

namespace {

// The entry points EP uses, from libnccl.so.2 loaded at run time (the build links no NCCL).
struct Api {
  void* lib = nullptr;
  int version = 0;
  std::string why;
  decltype(&ncclGetVersion) GetVersion = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclCommCount) CommCount = nullptr;
  decltype(&ncclCommUserRank) CommUserRank = nullptr;
  decltype(&ncclMemAlloc) MemAlloc = nullptr;
  decltype(&ncclMemFree) MemFree = nullptr;
  decltype(&ncclCommWindowRegister) WindowRegister = nullptr;
  decltype(&ncclCommWindowDeregister) WindowDeregister = nullptr;
  ncclTeam_t (*TeamLsa)(ncclComm_t) = nullptr;
  decltype(&ncclAllReduce) AllReduce = nullptr;
  decltype(&ncclAllGather) AllGather = nullptr;
  decltype(&ncclAlltoAll) AlltoAll = nullptr;
  decltype(&ncclCommInitAll) CommInitAll = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRank) CommInitRank = nullptr;

  Api() {
    lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      why = "libnccl.so.2 was not found (pip install nvidia-nccl-cu13, or the CUDA toolkit's lib on LD_LIBRARY_PATH)";
      return;
    }
    bool ok = true;
    auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(lib, name));
      if (!f && ok) why = std::string("libnccl.so.2 has no ") + name, ok = false;
    };
    sym(GetVersion, "ncclGetVersion");
    sym(GetErrorString, "ncclGetErrorString");
    sym(CommCount, "ncclCommCount");
    sym(CommUserRank, "ncclCommUserRank");
    sym(MemAlloc, "ncclMemAlloc");
    sym(MemFree, "ncclMemFree");
    sym(WindowRegister, "ncclCommWindowRegister");
    sym(WindowDeregister, "ncclCommWindowDeregister");
    sym(TeamLsa, "ncclTeamLsa");
    sym(AllReduce, "ncclAllReduce");
    sym(AllGather, "ncclAllGather");
    sym(AlltoAll, "ncclAlltoAll");
    sym(CommInitAll, "ncclCommInitAll");
    sym(CommDestroy, "ncclCommDestroy");
    sym(CommAbort, "ncclCommAbort");
    sym(GetUniqueId, "ncclGetUniqueId");
    sym(CommInitRank, "ncclCommInitRank");
    if (!ok) return;
    GetVersion(&version);
    if (version != NCCL_VERSION_CODE)
      why = "libnccl.so.2 is version " + std::to_string(version) + ", but moekit's EP kernels were built against " +
            std::to_string(NCCL_VERSION_CODE) + " (the device API's window layout must match)";
  }
  bool usable() const { return lib && why.empty(); }
  void check(ncclResult_t r, const char* what) const {
    if (r != ncclSuccess) fail("EP: ", what, ": ", GetErrorString ? GetErrorString(r) : "NCCL error");
  }
};

const Api& api() {
  static const Api a;
  return a;
}

// The peer table through the device API: ncclGetPeerPointer(win, 0, peer) for every peer.
__global__ void peer_table_kernel(ncclWindow_t win, int world, void** out) {
  for (int p = threadIdx.x; p < world; p += blockDim.x) out[p] = ncclGetPeerPointer(win, 0, p);
}

}  // namespace

NcclInfo nccl_info() {
  NcclInfo i;
  i.built = true;
  i.compiled_version = NCCL_VERSION_CODE;
  i.loaded = api().lib != nullptr;
  i.runtime_version = api().version;
  i.why = api().why;
  return i;
}

std::unique_ptr<NcclWindow> NcclWindow::create(void* comm_v, size_t bytes, int expected_world) {
  const Api& a = api();
  MOEKIT_REQUIRE(a.usable(), "EP over NCCL: ", a.why);
  ncclComm_t comm = static_cast<ncclComm_t>(comm_v);
  std::unique_ptr<NcclWindow> w(new NcclWindow);
  w->comm_ = comm;
  a.check(a.CommCount(comm, &w->world_), "ncclCommCount");
  a.check(a.CommUserRank(comm, &w->rank_), "ncclCommUserRank");
  MOEKIT_REQUIRE(w->world_ == expected_world, "EP over NCCL: the communicator has ", w->world_, " ranks, the group ",
                 expected_world);
  const ncclTeam_t lsa = a.TeamLsa(comm);
  MOEKIT_REQUIRE(lsa.nRanks == w->world_, "EP over NCCL: ", lsa.nRanks, " of ", w->world_,
                 " ranks share load/store access (one NVLink domain is required)");
  a.check(a.MemAlloc(&w->local_, bytes), "ncclMemAlloc");
  ncclWindow_t win = nullptr;
  a.check(a.WindowRegister(comm, w->local_, bytes, &win, NCCL_WIN_COLL_SYMMETRIC), "ncclCommWindowRegister");
  w->win_ = win;
  void** table = nullptr;
  if (cudaMalloc(&table, sizeof(void*) * size_t(w->world_)) != cudaSuccess) fail("EP: cannot allocate the peer table");
  peer_table_kernel<<<1, 64>>>(win, w->world_, table);
  w->peers_.assign(size_t(w->world_), nullptr);
  const cudaError_t e = cudaMemcpy(w->peers_.data(), table, sizeof(void*) * size_t(w->world_), cudaMemcpyDeviceToHost);
  cudaFree(table);
  if (e != cudaSuccess) fail("EP: reading the NCCL peer table: ", cudaGetErrorString(e));
  if (cudaMemset(w->local_, 0, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    fail("EP: zeroing the NCCL window");
  w->barrier();
  return w;
}

// The communicators a failure reached (mark_failed): their windows are let go without the
// collective deregistration, and they are aborted, not destroyed.
static std::mutex g_failed_mu;
static std::set<void*> g_failed;

NcclWindow::~NcclWindow() { release(!failed(comm_)); }

void NcclWindow::release(bool collective) {
  const Api& a = api();
  if (!a.usable()) return;
  if (win_ && collective) {
    barrier();
    a.WindowDeregister(static_cast<ncclComm_t>(comm_), static_cast<ncclWindow_t>(win_));
  }
  win_ = nullptr;
  // A window's memory is freed only after its deregistration; a failed communicator's abort
  // releases what it registered, and its memory goes with the process.
  if (local_ && collective) a.MemFree(local_);
  local_ = nullptr;
}

void NcclWindow::mark_failed(void* comm) {
  std::lock_guard<std::mutex> g(g_failed_mu);
  g_failed.insert(comm);
}

void NcclWindow::clear_failed(void* comm) {
  std::lock_guard<std::mutex> g(g_failed_mu);
  g_failed.erase(comm);
}

bool NcclWindow::failed(void* comm) {
  std::lock_guard<std::mutex> g(g_failed_mu);
  return g_failed.count(comm) != 0;
}

void NcclWindow::barrier() { comm_barrier(comm_); }

void NcclWindow::comm_barrier(void* comm) {
  const Api& a = api();
  MOEKIT_REQUIRE(a.usable(), "EP over NCCL: ", a.why);
  int* one = nullptr;
  if (cudaMalloc(&one, sizeof(int)) != cudaSuccess) fail("EP: barrier buffer");
  cudaMemset(one, 0, sizeof(int));
  a.check(a.AllReduce(one, one, 1, ncclInt32, ncclSum, static_cast<ncclComm_t>(comm), nullptr), "ncclAllReduce");
  const cudaError_t e = cudaStreamSynchronize(nullptr);
  cudaFree(one);
  if (e != cudaSuccess) fail("EP: barrier: ", cudaGetErrorString(e));
}

std::vector<uint8_t> NcclWindow::unique_id() {
  const Api& a = api();
  MOEKIT_REQUIRE(a.usable(), "EP over NCCL: ", a.why);
  static_assert(sizeof(ncclUniqueId) == kUniqueIdBytes, "NCCL's unique id");
  ncclUniqueId id;
  a.check(a.GetUniqueId(&id), "ncclGetUniqueId");
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&id);
  return std::vector<uint8_t>(b, b + sizeof(id));
}

void* NcclWindow::init_rank(const std::vector<uint8_t>& id, int world, int rank) {
  const Api& a = api();
  MOEKIT_REQUIRE(a.usable(), "EP over NCCL: ", a.why);
  MOEKIT_REQUIRE(id.size() == sizeof(ncclUniqueId), "EP: an NCCL unique id has ", sizeof(ncclUniqueId),
                 " bytes, got ", id.size());
  MOEKIT_REQUIRE(world >= 1 && rank >= 0 && rank < world, "EP: rank ", rank, " of ", world);
  ncclUniqueId u;
  std::memcpy(&u, id.data(), sizeof(u));
  ncclComm_t comm = nullptr;
  a.check(a.CommInitRank(&comm, world, u, rank), "ncclCommInitRank");
  return comm;
}

void NcclWindow::allreduce_on(void* comm, int* scratch, void* stream) {
  const Api& a = api();
  a.check(a.AllReduce(scratch, scratch, 1, ncclInt32, ncclSum, static_cast<ncclComm_t>(comm),
                      static_cast<cudaStream_t>(stream)),
          "ncclAllReduce");
}

void NcclWindow::allgather_i32(void* comm, const int32_t* send, int32_t* recv, size_t count, void* stream) {
  const Api& a = api();
  a.check(a.AllGather(send, recv, count, ncclInt32, static_cast<ncclComm_t>(comm), static_cast<cudaStream_t>(stream)),
          "ncclAllGather");
}

void NcclWindow::alltoall_bytes(void* comm, const void* send, void* recv, size_t bytes_per_peer, void* stream) {
  const Api& a = api();
  a.check(a.AlltoAll(send, recv, bytes_per_peer, ncclUint8, static_cast<ncclComm_t>(comm),
                     static_cast<cudaStream_t>(stream)),
          "ncclAlltoAll");
}

int NcclWindow::lsa_ranks(void* comm) {
  const Api& a = api();
  MOEKIT_REQUIRE(a.usable(), "EP over NCCL: ", a.why);
  return a.TeamLsa(static_cast<ncclComm_t>(comm)).nRanks;
}

int NcclWindow::comm_rank(void* comm) {
  const Api& a = api();
  MOEKIT_REQUIRE(a.usable(), "EP over NCCL: ", a.why);
  int r = 0;
  a.check(a.CommUserRank(static_cast<ncclComm_t>(comm), &r), "ncclCommUserRank");
  return r;
}

int NcclWindow::comm_size(void* comm) {
  const Api& a = api();
  MOEKIT_REQUIRE(a.usable(), "EP over NCCL: ", a.why);
  int n = 0;
  a.check(a.CommCount(static_cast<ncclComm_t>(comm), &n), "ncclCommCount");
  return n;
}

std::vector<void*> NcclWindow::init_all(int ndev) {
  const Api& a = api();
  MOEKIT_REQUIRE(a.usable(), "EP over NCCL: ", a.why);
  std::vector<ncclComm_t> comms(static_cast<size_t>(ndev));
  std::vector<int> devs(static_cast<size_t>(ndev));
  for (int i = 0; i < ndev; ++i) devs[size_t(i)] = i;
  a.check(a.CommInitAll(comms.data(), ndev, devs.data()), "ncclCommInitAll");
  return std::vector<void*>(comms.begin(), comms.end());
}

void NcclWindow::destroy_comm(void* comm) {
  if (!api().usable() || !comm) return;
  if (failed(comm)) {
    api().CommAbort(static_cast<ncclComm_t>(comm));
    std::lock_guard<std::mutex> g(g_failed_mu);
    g_failed.erase(comm);
  } else {
    api().CommDestroy(static_cast<ncclComm_t>(comm));
  }
}

#else  // built without nccl.h

NcclInfo nccl_info() {
  NcclInfo i;
  i.why = "moekit was built without NCCL's headers (nccl.h with the device API, NCCL >= 2.28)";
  return i;
}
std::unique_ptr<NcclWindow> NcclWindow::create(void*, size_t, int) { fail("EP over NCCL: ", nccl_info().why); }
NcclWindow::~NcclWindow() = default;
void NcclWindow::barrier() {}
std::vector<void*> NcclWindow::init_all(int) { fail("EP over NCCL: ", nccl_info().why); }
void NcclWindow::destroy_comm(void*) {}
void NcclWindow::mark_failed(void*) {}
void NcclWindow::clear_failed(void*) {}
bool NcclWindow::failed(void*) { return false; }
void NcclWindow::release(bool) {}
std::vector<uint8_t> NcclWindow::unique_id() { fail("EP over NCCL: ", nccl_info().why); }
void* NcclWindow::init_rank(const std::vector<uint8_t>&, int, int) { fail("EP over NCCL: ", nccl_info().why); }
void NcclWindow::allreduce_on(void*, int*, void*) { fail("EP over NCCL: ", nccl_info().why); }
int NcclWindow::comm_rank(void*) { fail("EP over NCCL: ", nccl_info().why); }
void NcclWindow::allgather_i32(void*, const int32_t*, int32_t*, size_t, void*) { fail("EP over NCCL: ", nccl_info().why); }
void NcclWindow::alltoall_bytes(void*, const void*, void*, size_t, void*) { fail("EP over NCCL: ", nccl_info().why); }
int NcclWindow::lsa_ranks(void*) { fail("EP over NCCL: ", nccl_info().why); }
int NcclWindow::comm_size(void*) { fail("EP over NCCL: ", nccl_info().why); }
void NcclWindow::comm_barrier(void*) { fail("EP over NCCL: ", nccl_info().why); }

#endif

}  // namespace moekit::ep
