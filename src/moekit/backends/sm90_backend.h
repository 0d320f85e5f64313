// moekit/backends/sm90_backend.h — the SM90 backends (grouped W4A16 / W8A16 GEMMs), each on the
// standard activation format and on the batched one (`_batched`): `sm90` runs the decode or the
// prefill kernel per call from the crossover (oracle/tuning.h), `sm90_decode` and `sm90_prefill`
// one kernel at every size. All read the same converted weights.
#pragma once

#include <vector>

#include "moekit/oracle/backend.h"

namespace moekit {

std::vector<const Backend*> sm90_backends();

}  // namespace moekit
