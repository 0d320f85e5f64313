// moekit/backends/cpu_backend.h — the CPU backends: reference numerics, multithreaded, always
// available. `cpu` consumes the standard activation format, `cpu_batched` the batched one; both
// compute the same function (tests hold them to the same bits).
#pragma once

#include "moekit/oracle/backend.h"

namespace moekit {

const Backend& cpu_backend();
const Backend& cpu_batched_backend();

// Routing on the CPU, or the bypass ids/weights copied (validate_layer_input has checked them);
// shared by every backend whose routing runs on the host.
void route_or_copy(const MoeModel& m, const LayerInput& in, LayerOutput* out);

}  // namespace moekit
