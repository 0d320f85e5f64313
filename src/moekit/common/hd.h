// moekit/common/hd.h — host/device qualifiers for code shared by the CPU path and kernels.
#pragma once

#if defined(__CUDACC__)
#define MOEKIT_HD __host__ __device__ __forceinline__
#else
#define MOEKIT_HD inline
#endif
