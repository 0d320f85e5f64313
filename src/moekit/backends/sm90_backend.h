// moekit/backends/sm90_backend.h — the SM90 decode backends (grouped W4A16 / W8A16 GEMMs):
// `sm90_decode` consumes the standard activation format, `sm90_decode_batched` the batched one.
#pragma once

#include <vector>

#include "moekit/oracle/backend.h"

namespace moekit {

std::vector<const Backend*> sm90_backends();

}  // namespace moekit
