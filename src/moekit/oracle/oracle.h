// moekit/oracle/oracle.h — the registry of backends and the choice among them.
//
// Selection: an explicit choice (--backend / $MOEKIT_BACKEND) if that backend supports the
// problem (else an error that says why); otherwise the best supported backend for this problem,
// device and token count from a tuning table (none measured yet: `moekit tune` will write them);
// otherwise the static priority in BackendCaps. Every decision can be printed with the reason
// each other backend was rejected.
#pragma once

#include <string>
#include <vector>

#include "moekit/oracle/backend.h"

namespace moekit {

// Every backend built into this binary, highest static priority first.
const std::vector<const Backend*>& all_backends();
const Backend* find_backend(const std::string& name);

struct Decision {
  const Backend* chosen = nullptr;
  std::string how;  // "requested by --backend", "static priority", ...
  struct Row {
    const Backend* backend;
    Support support;
  };
  std::vector<Row> rows;
  std::string explain(const Problem& p, const DeviceInfo& d) const;
};

// requested: a backend name or "" (then $MOEKIT_BACKEND, if set, is the request).
Decision choose_backend(const Problem& p, const DeviceInfo& d, const std::string& requested);

}  // namespace moekit
