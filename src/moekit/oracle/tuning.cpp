#include "moekit/oracle/tuning.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moekit/common/error.h"
#include "moekit/oracle/kernel_choice.h"

namespace moekit {

void crossover_band(int64_t prefill_from, int64_t* from, int64_t* to) {
  *from = *to = 0;
  if (prefill_from <= 0) return;
  *from = std::max(kBandMinTokens, (prefill_from + kBandBelow - 1) / kBandBelow);
  *to = prefill_from * kBandAbove;
}

namespace {
void points_band(const std::vector<CrossoverPoint>& points, int64_t prefill_from, int64_t* from, int64_t* to) {
  crossover_band(prefill_from, from, to);
  if (*to <= *from) return;
  for (const CrossoverPoint& p : points) {
    if (p.decode_us <= 0 || p.prefill_us <= 0) continue;
    if (p.tokens >= prefill_from && p.tokens < *to && p.decode_us >= kClearWin * p.prefill_us) *to = p.tokens;
    if (p.tokens < prefill_from && p.tokens >= *from && p.prefill_us >= kClearWin * p.decode_us) *from = p.tokens + 1;
  }
}
}  // namespace

void entry_band(const CrossoverEntry& e, int64_t* from, int64_t* to) { points_band(e.points, e.prefill_from, from, to); }

double KernelCrossover::ratio_at(int64_t T) const { return stream_ratio_at(stream_ratio, stream_ratio_slope, prefill_from, T); }

double stream_ratio_from_points(const std::vector<CrossoverPoint>& points, int64_t prefill_from, double* slope) {
  if (slope) *slope = 0;
  int64_t lo = 0, hi = 0;
  points_band(points, prefill_from, &lo, &hi);
  struct Case {
    double r, x, decode_us, prefill_us;
    bool by_tokens;  // the token-count rule's choice: the prefill kernel
  };
  std::vector<Case> cs;
  auto add = [&](int64_t tokens, int64_t streams, int64_t slabs, double d, double q) {
    if (streams > 0 && slabs > 0 && d > 0 && q > 0)
      cs.push_back({double(streams) / kStreamUnit / double(slabs), std::log2(double(tokens) / double(prefill_from)), d,
                    q, tokens >= prefill_from});
  };
  for (const CrossoverPoint& p : points) {
    if (p.tokens < lo || p.tokens >= hi) continue;
    add(p.tokens, p.streams, p.slabs, p.decode_us, p.prefill_us);
    add(p.tokens, p.zipf_streams, p.zipf_slabs, p.zipf_decode_us, p.zipf_prefill_us);
  }
  if (cs.empty()) return 0;
  // The token-count rule's worst over the same cases (no choice cost): where it is no worse than
  // the best threshold's, the device choice would only add its launches (no band).
  double by_tokens = 0;
  for (const Case& c : cs)
    by_tokens = std::max(by_tokens, (c.by_tokens ? c.prefill_us : c.decode_us) / std::min(c.decode_us, c.prefill_us) - 1);
  double best_a = 0, best_b = 0, best_worst = 1e300;
  const int steps = int(std::lround((kSlopeMax - kSlopeMin) / kSlopeStep));
  for (int i = 0; i <= steps; ++i) {
    const double b = kSlopeMin + i * kSlopeStep;
    // Candidates halfway between neighbouring cases' intercepts (and 1% beyond the ends), so that
    // the fixed point of the device (ratio_fixed, 1/1024) cannot move a measured case to the other
    // side. Intercepts are positive except for steep slopes far from the crossover (those end as 0).
    std::vector<double> v;
    for (const Case& c : cs) v.push_back(c.r - b * c.x);
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    std::vector<double> th = {v.front() - 0.01 * std::fabs(v.front())};
    for (size_t k = 1; k < v.size(); ++k) th.push_back(0.5 * (v[k - 1] + v[k]));
    th.push_back(v.back() + 0.01 * std::fabs(v.back()));
    for (double a : th) {
      double worst = 0;
      for (const Case& c : cs) {
        const double chosen = c.r >= a + b * c.x ? c.prefill_us : c.decode_us;
        worst = std::max(worst, (chosen + kChoiceCostUs) / std::min(c.decode_us, c.prefill_us) - 1);
      }
      const bool better = worst < best_worst - 1e-12;
      const bool flatter = std::fabs(worst - best_worst) <= 1e-12 && std::fabs(b) < std::fabs(best_b) - 1e-12;
      if (better || flatter) best_worst = worst, best_a = a, best_b = b;
    }
  }
  if (by_tokens <= best_worst || best_a <= 0) return 0;
  if (slope) *slope = std::fabs(best_b) < 1e-12 ? 0 : best_b;
  return best_a;
}

double crossover_worst_regret(const std::vector<CrossoverPoint>& points, int64_t prefill_from) {
  // The table entry this crossover would make: its band and, there, the device choice's threshold.
  int64_t lo = 0, hi = 0;
  points_band(points, prefill_from, &lo, &hi);
  double b = 0;
  const double a = stream_ratio_from_points(points, prefill_from, &b);
  double worst = 0;
  auto regret = [&](int64_t tokens, int64_t streams, int64_t slabs, double d, double q) {
    if (d <= 0 || q <= 0) return;
    double chosen = prefill_from >= 0 && tokens >= prefill_from ? q : d;
    if (a > 0 && tokens >= lo && tokens < hi && streams > 0 && slabs > 0) {  // chosen on the device
      ChoiceCounts c;
      c.streams = streams;
      c.slabs = slabs;
      chosen = (prefill_wins(c, ratio_fixed(stream_ratio_at(a, b, prefill_from, tokens))) ? q : d) + kChoiceCostUs;
    }
    worst = std::max(worst, chosen / std::min(d, q) - 1);
  };
  for (const CrossoverPoint& p : points) {
    regret(p.tokens, p.streams, p.slabs, p.decode_us, p.prefill_us);
    regret(p.tokens, p.zipf_streams, p.zipf_slabs, p.zipf_decode_us, p.zipf_prefill_us);
  }
  return worst;
}

int64_t crossover_from_points(const std::vector<CrossoverPoint>& points, double tolerance, double max_regret) {
  std::vector<CrossoverPoint> p = points;
  std::sort(p.begin(), p.end(), [](const auto& a, const auto& b) { return a.tokens < b.tokens; });
  int64_t from = -1;
  for (auto it = p.rbegin(); it != p.rend(); ++it) {
    if (it->prefill_us > it->decode_us * (1 + tolerance)) break;
    if (it->zipf_decode_us > 0 && it->zipf_prefill_us > it->zipf_decode_us * (1 + tolerance)) break;
    from = it->tokens;
  }
  if (max_regret <= 0) return from;
  double best = crossover_worst_regret(p, from);
  if (best <= max_regret) return from;
  std::vector<int64_t> candidates;  // ascending (the earliest of equals wins), then "never"
  for (const CrossoverPoint& c : p) candidates.push_back(c.tokens);
  candidates.push_back(-1);
  for (int64_t c : candidates) {
    const double w = crossover_worst_regret(p, c);
    if (w < best - 1e-12) best = w, from = c;
  }
  return from;
}

std::string KernelCrossover::explain(int64_t T) const {
  std::ostringstream os;
  if (device_choice(T)) {
    os << "on the device (" << T << " tokens is in the band " << band_from << ".." << band_to - 1
       << " around the crossover): the prefill kernel iff the plan's decode weight streams sum ceil(c/R) (R = the decode kernel's "
       << "chunk rows, 8, 16 or 24, weighted 1, 1.1, 1.2) >= " << ratio_at(T) << " x its 32-row slabs sum ceil(c/32); " << source;
  } else {
    os << (prefill_from >= 0 && T >= prefill_from ? "prefill" : "decode") << " kernel at " << T
       << " tokens by the token count: " << source;
  }
  return os.str();
}

TuningTable parse_tuning_table(const std::string& text, const std::string& name) {
  TuningTable t;
  t.name = name;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail(name, ": not a tuning table (", e.what(), ")");
  }
  MOEKIT_REQUIRE(j.is_object() && j.contains("entries") && j["entries"].is_array(), name,
                 ": not a tuning table (no \"entries\" array)");
  for (const auto& e : j["entries"]) {
    try {
      CrossoverEntry c;
      c.gpu = e.at("gpu").get<std::string>();
      c.label = e.value("label", "");
      c.E = e.at("E").get<int>();
      c.k = e.at("k").get<int>();
      c.H = e.at("H").get<int>();
      c.I = e.at("I").get<int>();
      c.format = parse_format(e.at("format").get<std::string>());
      c.prefill_from = e.at("prefill_from").get<int64_t>();
      c.stream_ratio = e.value("stream_ratio", 0.0);
      MOEKIT_REQUIRE(c.stream_ratio >= 0 && std::isfinite(c.stream_ratio), "stream_ratio must be >= 0");
      c.stream_ratio_slope = e.value("stream_ratio_slope", 0.0);
      MOEKIT_REQUIRE(std::isfinite(c.stream_ratio_slope), "stream_ratio_slope must be finite");
      c.kernels = e.value("kernels", "");
      c.commit = e.value("commit", "");
      c.stale = e.value("stale", "");
      MOEKIT_REQUIRE(!e.contains("stale") || !c.stale.empty(), "\"stale\" must say why");
      for (const auto& q : e.value("points", nlohmann::json::array()))
        c.points.push_back({q.at("tokens").get<int64_t>(), q.at("decode_us").get<double>(),
                            q.at("prefill_us").get<double>(), q.value("streams", int64_t(0)),
                            q.value("slabs", int64_t(0)), q.value("zipf_decode_us", 0.0),
                            q.value("zipf_prefill_us", 0.0), q.value("zipf_streams", int64_t(0)),
                            q.value("zipf_slabs", int64_t(0))});
      MOEKIT_REQUIRE(c.E > 0 && c.k > 0 && c.H > 0 && c.I > 0, "sizes must be positive");
      t.entries.push_back(std::move(c));
    } catch (const Error& err) {
      fail(name, ": bad entry: ", err.what());
    } catch (const std::exception& err) {
      fail(name, ": bad entry: ", err.what());
    }
  }
  return t;
}

std::string tuning_table_json(const TuningTable& t) {
  nlohmann::json j;
  j["entries"] = nlohmann::json::array();
  for (const auto& c : t.entries) {
    nlohmann::json e = {{"gpu", c.gpu}, {"label", c.label}, {"E", c.E}, {"k", c.k}, {"H", c.H}, {"I", c.I},
                        {"format", format_name(c.format)}, {"prefill_from", c.prefill_from}};
    if (c.stream_ratio > 0) e["stream_ratio"] = c.stream_ratio;
    if (c.stream_ratio_slope != 0) e["stream_ratio_slope"] = c.stream_ratio_slope;
    if (!c.kernels.empty()) e["kernels"] = c.kernels;
    if (!c.commit.empty()) e["commit"] = c.commit;
    if (!c.stale.empty()) e["stale"] = c.stale;
    e["points"] = nlohmann::json::array();
    for (const auto& p : c.points) {
      nlohmann::json q = {{"tokens", p.tokens}, {"decode_us", p.decode_us}, {"prefill_us", p.prefill_us}};
      if (p.streams > 0) q["streams"] = p.streams, q["slabs"] = p.slabs;
      if (p.zipf_decode_us > 0) q["zipf_decode_us"] = p.zipf_decode_us, q["zipf_prefill_us"] = p.zipf_prefill_us;
      if (p.zipf_streams > 0) q["zipf_streams"] = p.zipf_streams, q["zipf_slabs"] = p.zipf_slabs;
      e["points"].push_back(q);
    }
    j["entries"].push_back(e);
  }
  return j.dump(1) + "\n";
}

std::vector<TuningTable> compiled_in_tuning_tables() {
  std::vector<TuningTable> v;
  for (int i = 0; i < detail::kEmbeddedTuningCount; ++i)
    v.push_back(parse_tuning_table(detail::kEmbeddedTuning[i].json, detail::kEmbeddedTuning[i].name));
  return v;
}

const std::vector<TuningTable>& tuning_tables() {
  static const std::vector<TuningTable> tables = [] {
    std::vector<TuningTable> v;
    if (const char* f = std::getenv("MOEKIT_TUNING"); f && *f) {
      std::ifstream in(f);
      MOEKIT_REQUIRE(in.good(), "MOEKIT_TUNING: cannot read ", f);
      std::stringstream ss;
      ss << in.rdbuf();
      v.push_back(parse_tuning_table(ss.str(), f));
    }
    for (TuningTable& t : compiled_in_tuning_tables()) v.push_back(std::move(t));
    return v;
  }();
  return tables;
}

std::string kernel_stamp() { return detail::kKernelStamp; }

std::vector<std::string> kernel_stamp_files() {
  std::vector<std::string> v;
  std::istringstream in(detail::kKernelFiles);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) v.push_back(line);
  return v;
}

bool entry_fresh(const CrossoverEntry& e) { return e.stale.empty() && e.kernels == detail::kKernelStamp; }

std::string stale_entry_note(const CrossoverEntry& e, const std::string& table) {
  std::ostringstream os;
  os << "stale table entry (measured with kernels " << (e.kernels.empty() ? "unknown" : e.kernels) << ", built "
     << detail::kKernelStamp << "): " << table << ", entry " << (e.label.empty() ? "?" : e.label) << "/"
     << format_name(e.format);
  if (!e.commit.empty()) os << ", measured at " << e.commit;
  if (e.kernels.empty()) os << ", no kernel stamp (a table from before stamps)";
  if (!e.stale.empty()) os << ", marked stale: " << e.stale;
  os << "; not used";
  return os.str();
}

std::string explain_tuning_tables(const std::vector<TuningTable>& tables) {
  std::ostringstream os;
  os << "tuning tables (this build's kernel stamp " << detail::kKernelStamp << ": cmake/kernel_manifest.txt's "
     << kernel_stamp_files().size() << " files):\n";
  if (tables.empty()) os << "  none\n";
  for (const TuningTable& t : tables) {
    std::vector<std::string> gpus;
    for (const CrossoverEntry& e : t.entries)
      if (std::find(gpus.begin(), gpus.end(), e.gpu) == gpus.end()) gpus.push_back(e.gpu);
    if (gpus.empty()) os << "  " << t.name << ": no entries\n";
    for (const std::string& g : gpus) {
      int n = 0, fresh = 0;
      for (const CrossoverEntry& e : t.entries)
        if (e.gpu == g) ++n, fresh += entry_fresh(e);
      os << "  " << t.name << ", " << g << ": " << n << " entries, " << fresh << " fresh, " << n - fresh << " stale\n";
      for (const CrossoverEntry& e : t.entries)
        if (e.gpu == g && !entry_fresh(e)) os << "    " << stale_entry_note(e, t.name) << "\n";
    }
  }
  return os.str();
}

KernelCrossover entry_crossover(const CrossoverEntry& e, const std::string& table) {
  std::ostringstream os;
  os << "tuning table " << table << ", entry " << (e.label.empty() ? "?" : e.label) << "/" << format_name(e.format)
     << ": "
     << (e.prefill_from < 0 ? "decode kernel at every measured count"
                            : "prefill kernel from " + std::to_string(e.prefill_from) + " tokens");
  KernelCrossover x{e.prefill_from, ""};
  if (e.stream_ratio > 0 && e.prefill_from > 0) {
    x.stream_ratio = e.stream_ratio;
    x.stream_ratio_slope = e.stream_ratio_slope;
    entry_band(e, &x.band_from, &x.band_to);
    os << ", stream ratio " << e.stream_ratio;
    if (e.stream_ratio_slope != 0)
      os << " " << (e.stream_ratio_slope < 0 ? "-" : "+") << " " << std::fabs(e.stream_ratio_slope) << " x log2(tokens / "
         << e.prefill_from << ")";
  } else {
    os << ", no stream ratio (a table from before the device choice: the token count alone)";
  }
  x.source = os.str();
  return x;
}

std::vector<int64_t> check_tokens(const CrossoverEntry& e, int64_t crossover, int max_points) {
  std::vector<int64_t> measured;
  for (const CrossoverPoint& p : e.points) measured.push_back(p.tokens);
  std::sort(measured.begin(), measured.end());
  measured.erase(std::unique(measured.begin(), measured.end()), measured.end());
  std::vector<int64_t> v;
  if (crossover < 0) {
    for (auto it = measured.rbegin(); it != measured.rend() && v.size() < 2; ++it) v.push_back(*it);
  } else {
    v.push_back(std::max<int64_t>(1, crossover));
    const auto above = std::upper_bound(measured.begin(), measured.end(), v[0]);
    const auto below = std::lower_bound(measured.begin(), measured.end(), v[0]);
    if (below != measured.begin()) v.push_back(*(below - 1));
    v.push_back(above != measured.end() ? *above : 2 * v[0]);
  }
  if (max_points >= 0 && v.size() > size_t(max_points)) v.resize(size_t(max_points));
  return v;
}

bool picks_prefill(const KernelCrossover& x, int64_t T, const ChoiceCounts& c) {
  if (x.device_choice(T)) return prefill_wins(c, ratio_fixed(x.ratio_at(T)));
  return x.prefill_from >= 0 && T >= x.prefill_from;
}

KernelCrossover sm90_crossover(const MoeConfig& cfg, const DeviceInfo& d) { return sm90_crossover(cfg, d, tuning_tables()); }

KernelCrossover sm90_crossover(const MoeConfig& cfg, const DeviceInfo& d, const std::vector<TuningTable>& tables) {
  const double rows_per_token = double(cfg.top_k) / double(std::max(1, cfg.num_experts));
  auto tokens_for = [&](double rows_per_expert) { return int64_t(std::ceil(rows_per_expert / rows_per_token)); };
  std::vector<double> same_gpu;  // crossovers of this GPU's other fresh entries, in rows per expert
  std::string same_gpu_table;
  std::string stale;  // this shape's first stale entry, for --explain ("" if none)
  auto with_stale = [&](KernelCrossover x) {
    if (!stale.empty()) x.source = stale + "; " + x.source;
    return x;
  };
  for (const TuningTable& t : tables)
    for (const CrossoverEntry& e : t.entries) {
      if (e.gpu != d.name) continue;
      const bool same = e.E == cfg.num_experts && e.k == cfg.top_k && e.H == cfg.hidden && e.I == cfg.intermediate &&
                        e.format == cfg.format;
      if (!entry_fresh(e)) {  // measured with other kernels: neither the entry nor the table rule
        if (same && stale.empty()) stale = stale_entry_note(e, t.name);
        continue;
      }
      if (same) return with_stale(entry_crossover(e, t.name));
      if (e.prefill_from > 0) {
        same_gpu.push_back(double(e.prefill_from) * double(e.k) / double(e.E));
        same_gpu_table = t.name;
      }
    }
  if (!same_gpu.empty()) {
    std::sort(same_gpu.begin(), same_gpu.end());
    const double r = same_gpu[same_gpu.size() / 2];
    const int64_t from = tokens_for(r);
    std::ostringstream os;
    os << "tuning table " << same_gpu_table << " has no " << (stale.empty() ? "" : "fresh ")
       << "entry for this shape; its median crossover, " << r << " rows per expert, gives the prefill kernel from "
       << from << " tokens";
    return with_stale({from, os.str()});  // no device choice without a measured ratio
  }
  const int64_t from = tokens_for(kRuleRowsPerExpert);
  std::ostringstream os;
  os << "no " << (stale.empty() ? "" : "fresh ") << "tuning table for " << d.name << "; rule: the prefill kernel from "
     << kRuleRowsPerExpert << " rows per expert, " << from << " tokens";
  return with_stale({from, os.str()});
}

}  // namespace moekit
