// moekit/common/ptx_sm90.cuh — thin wrappers over the SM90 instructions the kernels use:
// mbarriers, bulk async copies (TMA, 1-D), L2 cache policies, ldmatrix and mma.sync.
// Each wrapper is one instruction; the kernels explain why they use it.
#pragma once

#include <cstdint>
#include <cstdio>

namespace moekit::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ---------------------------------------------------------------------------------
// Barriers are named by their shared-memory address (smem_addr), computed once per kernel.
// An mbarrier is touched only by mbarrier instructions. Its state need not be in its shared-
// memory word: on an H100 an ld.shared right after mbarrier.init returned the bytes that were
// there before (docs/perf/notebook.md, eighteenth section), so a trap record reports a barrier's
// phase parity (mbar_phase_parity), never its word. A kernel keeps its barriers in 128-byte
// lines of their own (kBarrierLine: no plain load or store shares a line with one) and
// invalidates them before its CTA exits (mbar_inval), as the PTX ISA asks before their memory
// is used for anything else.
constexpr int kBarrierLine = 128;
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_inval(uint32_t bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// A CTA's end: once every thread is done with them (the CTA-wide barrier), thread 0 invalidates
// the count barriers from `first` on (8 bytes apart). Every thread of the CTA calls it.
__device__ __forceinline__ void mbar_inval_at_exit(uint32_t first, int count) {
  __syncthreads();
  if (threadIdx.x == 0)
    for (int b = 0; b < count; ++b) mbar_inval(first + 8u * uint32_t(b));
}
// The parity of the barrier's current phase (1 once the phase of parity 0 has completed, until
// the next one does): a non-blocking mbarrier read, for trap records.
__device__ __forceinline__ uint32_t mbar_phase_parity(uint32_t bar) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar)
      : "memory");
  return done;
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// try_wait may suspend the thread until the phase completes or kSuspendNs ns pass, so a waiter
// with nothing else to do stops spinning on issue slots that the other warps of its SM need.
template <uint32_t kSuspendNs>
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t phase) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2, %3;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(phase), "n"(kSuspendNs)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Waits for the phase with the given parity to complete. Bounded: past limit_ns of %globaltimer
// it calls timed_out() (which records what it waited for and traps: common/trap_record.cuh), so
// a protocol bug shows up as an error instead of a hang. No call on the way: it may sit between
// a warpgroup's wgmma issue and wait (a call there makes ptxas serialize the wgmmas, C7510).
template <uint32_t kSuspendNs, typename TimedOut>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase, uint64_t limit_ns, TimedOut&& timed_out) {
  if (mbar_try_wait<kSuspendNs>(bar, phase)) return;
  const uint64_t t0 = globaltimer_ns();
  while (!mbar_try_wait<kSuspendNs>(bar, phase))
    if (globaltimer_ns() - t0 > limit_ns) timed_out();
}

// ---- bulk async copy global -> shared, completing on an mbarrier ---------------------------
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// bytes: a multiple of 16; both addresses 16-byte aligned.
// dst and bar are shared-memory addresses.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                         uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}

// ---- cross-CTA signalling ------------------------------------------------------------------------
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Release / acquire fence at GPU scope (lighter than __threadfence's sequentially consistent one).
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// Orders this thread's earlier generic-proxy accesses (and what it acquired) before its later
// async-proxy (bulk copy) accesses of global memory.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// ---- programmatic dependent launch ------------------------------------------------------------
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;");
}

// ---- tensor cores ------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t saddr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(saddr));
}
// D = A * B + D, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4],
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7},"
      " {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A release reduction at GPU scope: the writes that happen before it (this thread's, and through
// a barrier the other participants') are visible to whoever acquires the new value. Cheaper than
// fence.acq_rel + a relaxed atomic, whose acquire half also invalidates L1.
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Shared-memory loads by shared-memory address.
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
// Predicated global stores: the value and the address are computed either way and only the
// store is skipped, so an epilogue has no branch per element (the compiler would otherwise
// branch around each element's arithmetic).
__device__ __forceinline__ void st_global_if(uint16_t* p, uint16_t v, bool pred) {
  asm volatile("{ .reg .pred q; setp.ne.b32 q, %2, 0; @q st.global.u16 [%0], %1; }" ::"l"(p), "h"(v),
               "r"(int(pred)));
}
__device__ __forceinline__ void st_global_if(float* p, float v, bool pred) {
  asm volatile("{ .reg .pred q; setp.ne.b32 q, %2, 0; @q st.global.f32 [%0], %1; }" ::"l"(p), "f"(v),
               "r"(int(pred)));
}
// The shared-memory address of the dynamic shared memory, held in a register. Computed from a
// generic pointer, the compiler re-derives it from the CTA's cluster id (an S2UR, tens of cycles)
// at every use, i.e. at every stage of every warp; the asm makes the value opaque so it is
// computed once.
__device__ __forceinline__ uint32_t smem_base(const void* p) {
  uint32_t a;
  asm volatile("mov.b32 %0, %1;" : "=r"(a) : "r"(smem_addr(p)));
  return a;
}

// Warpgroup register budgets (every warp of the warpgroup executes it; ptxas allocates the code
// that follows within the new count).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs) : "memory");
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs) : "memory");
}

// ---- warpgroup MMA (wgmma, sm_90a) -----------------------------------------------------------
// The issuing warpgroup's ordering: fence before the first wgmma that reads registers written
// since the last one (A fragments, accumulators), commit closes a group, wait_group<N> returns
// once at most N groups are pending (their accumulators and A registers are then free).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator register across a wgmma wait.
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void reg_fence(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// Shared-memory matrix descriptor of a K-major operand whose rows are 128 bytes (64 bf16) in
// the 128-byte swizzle (16-byte chunk c of row r at r * 128 + ((c ^ (r % 8)) * 16), rows in
// 1024-byte atoms of 8): start address >> 4, stride between 8-row atoms 1024 B, leading offset
// unused for swizzled K-major layouts, swizzle mode 1 (128 B) in bits 62-63. The k16 step q of a
// 64-wide row block starts 32 q bytes in, i.e. descriptor + 2 q.
__device__ __forceinline__ uint64_t smem_desc_k128(uint32_t saddr) {
  return uint64_t((saddr >> 4) & 0x3fffu) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// Named barrier among `threads` threads (a multiple of 32) of the CTA.
__device__ __forceinline__ void named_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace moekit::ptx
