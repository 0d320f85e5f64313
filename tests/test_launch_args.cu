// The SM90 kernels' argument structs have no implicit padding (host only, no GPU): the layer
// compares a call's launch arguments bytewise with the ones its cached graph holds
// (pipeline/launch_sm90.cuh), and a compiler may leave any bytes in implicit padding, so a struct
// with padding would make every repeated call update the graph's nodes (tests/gpu/
// test_launch_graphs_gpu.cpp measures that on the GPU). Padding bytes are found with GCC's
// __builtin_clear_padding on a buffer of 0xff bytes.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "moekit/experts/sm90_prefill_gemm.cuh"
#include "moekit/pipeline/kernel_choice_sm90.cuh"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

namespace moekit::sm90 {
namespace {

#if defined(__has_builtin)
#if __has_builtin(__builtin_clear_padding)
#define MOEKIT_CLEAR_PADDING 1
#endif
#endif

template <class T>
std::string padding_bytes() {
  std::string out;
#ifdef MOEKIT_CLEAR_PADDING
  alignas(T) unsigned char b[sizeof(T)];
  std::memset(b, 0xff, sizeof b);
  __builtin_clear_padding(reinterpret_cast<T*>(b));
  for (size_t i = 0; i < sizeof(T); ++i)
    if (b[i] != 0xff) out += " " + std::to_string(i);
#endif
  return out;
}

TEST(LaunchArgs, NoImplicitPadding) {
#ifndef MOEKIT_CLEAR_PADDING
  GTEST_SKIP() << "the host compiler has no __builtin_clear_padding";
#endif
  EXPECT_EQ(padding_bytes<RoutingParams>(), "");
  EXPECT_EQ(padding_bytes<RouteArgs>(), "");
  EXPECT_EQ(padding_bytes<PlanBuffers>(), "");
  EXPECT_EQ(padding_bytes<PlanArgs>(), "");
  EXPECT_EQ(padding_bytes<LayoutDims>(), "");
  EXPECT_EQ(padding_bytes<GemmArgs>(), "");
  EXPECT_EQ(padding_bytes<FusedArgs>(), "");
  EXPECT_EQ(padding_bytes<ChoiceArgs>(), "");
  EXPECT_EQ(padding_bytes<prefill::PrefillArgs>(), "");
}

// A recorded launch: each argument converted to the kernel's parameter type, each launch's bytes
// from a 64-byte boundary, the list's shape (launch count, PDL launches).
__global__ void probe_kernel(int64_t a, PlanArgs p, float f) { (void)a, (void)p, (void)f; }

TEST(LaunchArgs, RecordedLaunchList) {
  LaunchList l;
  {
    RecordLaunches rec(&l);
    PlanArgs p{};
    p.T = 7;
    ASSERT_EQ(launch(probe_kernel, dim3(2), dim3(32), 0, nullptr, false, 3, p, 1.5f), cudaSuccess);
    ASSERT_EQ(launch(probe_kernel, dim3(1), dim3(64), 128, nullptr, true, int64_t(-1), p, 2.5f), cudaSuccess);
  }
  EXPECT_EQ(launch_recorder(), nullptr);
  ASSERT_EQ(l.n, 2);
  EXPECT_EQ(l.shape(), 2u | 2u << 8);
  for (int i = 0; i < 2; ++i) {
    const LaunchList::Launch& x = l.launches[i];
    EXPECT_EQ(x.arg_begin % 64, 0);
    ASSERT_EQ(x.nargs, 3);
    int64_t a;
    std::memcpy(&a, l.args + x.arg_off[0], 8);
    EXPECT_EQ(a, i == 0 ? 3 : -1);  // the int became the kernel's int64_t
    PlanArgs p;
    std::memcpy(&p, l.args + x.arg_off[1], sizeof p);
    EXPECT_EQ(p.T, 7);
    float f;
    std::memcpy(&f, l.args + x.arg_off[2], 4);
    EXPECT_EQ(f, i == 0 ? 1.5f : 2.5f);
  }
  EXPECT_EQ(l.launches[1].smem, 128u);
  EXPECT_TRUE(l.launches[1].pdl);
  // The same launch recorded again has the same bytes, wherever it sits in the list.
  EXPECT_EQ(l.launches[0].arg_end - l.launches[0].arg_begin, l.launches[1].arg_end - l.launches[1].arg_begin);
}

}  // namespace
}  // namespace moekit::sm90
