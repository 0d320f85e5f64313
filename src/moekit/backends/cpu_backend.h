// moekit/backends/cpu_backend.h — the CPU backends: reference numerics, multithreaded, always
// available. `cpu` consumes the standard activation format, `cpu_batched` the batched one; both
// compute the same function (tests hold them to the same bits) from the same packed weights:
// the checkpoint's codes and scales in logical row order (gate rows, then up rows), nvfp4 tensor
// scales per (expert, half), biases in fp32.
#pragma once

#include "moekit/oracle/backend.h"

namespace moekit {

const Backend& cpu_backend();
const Backend& cpu_batched_backend();

}  // namespace moekit
