#include "moekit/oracle/oracle.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "moekit/common/error.h"
#include "moekit/oracle/layer_checks.h"

namespace moekit {

Problem Problem::of(const MoeConfig& c, int64_t tokens) {
  Problem p;
  p.cfg = c;
  p.tokens = tokens;
  p.has_biases = c.biases;
  return p;
}
Problem Problem::of(const LayerWeights& m, int64_t tokens) {
  Problem p = of(m.cfg, tokens);
  p.has_biases = !m.b13.empty() || !m.b2.empty();
  return p;
}

std::string Problem::describe() const {
  std::ostringstream os;
  os << describe_spec(cfg) << ", " << tokens << " tokens";
  return os.str();
}

std::string DeviceInfo::describe() const {
  if (!gpu) return gpus > 0 ? "CPU" : "CPU (no CUDA device)";
  std::ostringstream os;
  os << name << " (sm_" << cc_major << cc_minor << ", " << sm_count << " SMs)";
  return os.str();
}

Support Backend::supports(const Problem& p, const DeviceInfo& d) const {
  const BackendCaps& c = caps();
  if (std::find(c.weight_formats.begin(), c.weight_formats.end(), p.cfg.format) ==
      c.weight_formats.end())
    return Support::no(std::string("no ") + format_name(p.cfg.format) + " weights" +
                       (p.cfg.format == WeightFormat::kFp8
                            ? " (convert them explicitly, with the error printed: `moekit run --convert bf16|mxfp8` "
                              "or `moekit convert --to ...`)"
                            : ""));
  if (std::find(c.activations.begin(), c.activations.end(), p.cfg.act) == c.activations.end())
    return Support::no(std::string("no ") + activation_name(p.cfg.act) + " activation");
  if (std::find(c.activation_dtypes.begin(), c.activation_dtypes.end(), p.cfg.activation_dtype) ==
      c.activation_dtypes.end()) {
    std::string runs;
    for (ActivationDtype a : c.activation_dtypes) runs += std::string(runs.empty() ? "" : ", ") + activation_dtype_name(a);
    return Support::no(std::string("no ") + activation_dtype_name(p.cfg.activation_dtype) +
                       " activations (its experts take " + runs + " inputs only" +
                       (c.activation_dtype_note.empty() ? "" : "; " + c.activation_dtype_note) + ")");
  }
  if (!c.needs_sm90 && d.gpu) return Support::no("runs on the CPU; the layer's device is a GPU");
  if (c.needs_sm90) {
    if (!d.gpu)
      return Support::no(d.gpus > 0 ? "needs an SM90 GPU (H100/H200); the layer's device is the CPU"
                                    : "needs an SM90 GPU (H100/H200); none found");
    if (d.cc_major != 9 || d.cc_minor != 0)
      return Support::no("needs SM90 (H100/H200); found sm_" + std::to_string(d.cc_major) +
                         std::to_string(d.cc_minor));
  }
  return supports_extra(p, d);
}

const Backend* find_backend(const std::string& name) {
  for (const Backend* b : all_backends())
    if (b->caps().name == name) return b;
  return nullptr;
}

Decision choose_backend(const Problem& p, const DeviceInfo& d, const std::string& requested_arg) {
  std::string requested = requested_arg;
  std::string source = "--backend";
  if (requested.empty()) {
    if (const char* env = std::getenv("MOEKIT_BACKEND"); env && *env) {
      requested = env;
      source = "MOEKIT_BACKEND";
    }
  }
  Decision dec;
  for (const Backend* b : all_backends()) dec.rows.push_back({b, b->supports(p, d)});
  if (!requested.empty()) {
    const Backend* b = find_backend(requested);
    if (!b) {
      std::string names;
      for (const Backend* x : all_backends()) names += (names.empty() ? "" : ", ") + x->caps().name;
      fail("unknown backend '", requested, "' (from ", source, "; known: ", names, ")");
    }
    const Support s = b->supports(p, d);
    MOEKIT_REQUIRE(s.ok, "backend ", requested, " (from ", source, ") cannot run ", p.describe(),
                   " on ", d.describe(), ": ", s.reason);
    dec.chosen = b;
    dec.how = "requested by " + source;
    return dec;
  }
  for (const auto& row : dec.rows)  // all_backends() is in static priority order
    if (row.support.ok) {
      dec.chosen = row.backend;
      dec.how = "static priority (no tuning table for this device)";
      break;
    }
  MOEKIT_REQUIRE(dec.chosen, "no backend can run ", p.describe(), " on ", d.describe());
  return dec;
}

std::string Decision::explain(const Problem& p, const DeviceInfo& d) const {
  std::ostringstream os;
  os << "problem: " << p.describe() << "\n";
  os << "device:  " << d.describe() << "\n";
  os << "chosen:  " << (chosen ? chosen->caps().name : "none") << " (" << how << ")\n";
  if (chosen)
    if (const std::string plan = chosen->plan(p, d); !plan.empty()) os << "plan:    " << plan << "\n";
  size_t width = 0;
  for (const auto& r : rows) width = std::max(width, r.backend->caps().name.size());
  for (const auto& r : rows) {
    const BackendCaps& c = r.backend->caps();
    os << "  " << (r.backend == chosen ? "* " : "  ");
    os.width(std::streamsize(width + 2));
    os << std::left << c.name;
    os.width(9);
    os << activation_format_name(c.activation_format);
    if (r.support.ok)
      os << (r.backend == chosen ? "chosen" : "supported, not chosen");
    else
      os << "rejected: " << r.support.reason;
    os << "\n";
  }
  return os.str();
}

}  // namespace moekit
