// `moekit tune`: time both SM90 GEMM kernels (decode, prefill) over token counts on this GPU
// and write the crossover as an entry of a tuning table (oracle/tuning.h), one JSON file per GPU
// model: the entry of the same GPU, shape and format is replaced, the others are kept. The
// committed tables (data/tuning/) are compiled into the binary; $MOEKIT_TUNING points the oracle
// at another file. Every entry it writes carries this build's kernel stamp (oracle/tuning.h).
//   tune --check        times the oracle's choice again at a few points per entry of this GPU and
//                       fails with the entries whose regret is over kCheckMaxRegret
//   tune --mark-stale   marks a table's entries measured with other kernels as stale (no GPU)
//   tune --recount      recomputes a table's counts and crossovers from its points (no GPU)
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <unistd.h>

#include "moekit/bench/bench.h"
#include "moekit/cli/args.h"
#include "moekit/cli/bench_stamp.h"
#include "moekit/cli/commands.h"
#include "moekit/common/error.h"
#include "moekit/io/files.h"
#include "moekit/oracle/oracle.h"
#include "moekit/model/synthetic.h"
#include "moekit/oracle/kernel_choice.h"
#include "moekit/oracle/tuning.h"

namespace moekit::cli {

namespace {

// A point's counts (kernel_choice.h) under the bench's routing: the per-expert rows of its router
// logits routed on the CPU (the same experts as on the device), the decode kernel's chunk rows as
// the layer picks them (the bench's weights have single-multiply scales).
ChoiceCounts point_counts(const MoeConfig& cfg, int64_t tokens, BenchRouting routing, double zipf_s, uint64_t seed) {
  ChoiceCounts cc;
  const int rows = decode_chunk_rows(cfg.num_experts, tokens * cfg.top_k, true);
  for (int c : bench_expert_counts(cfg, tokens, routing, zipf_s, seed)) add_expert_rows(cc, c, rows);
  return cc;
}

// "NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3"
std::string gpu_slug(const std::string& name) {
  std::string s;
  for (char c : name) s += std::isalnum(static_cast<unsigned char>(c)) ? char(std::tolower(c)) : '_';
  return s;
}

std::string read_text(const std::string& path, const char* what) {
  std::ifstream in(path);
  MOEKIT_REQUIRE(in.good(), what, ": cannot read ", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The bench shape an entry was measured as: its label where that names a shape of its sizes, else
// its sizes ("E,k,H,I").
std::string entry_shape(const CrossoverEntry& e) {
  try {
    const MoeConfig c = bench_shape(e.label, e.format);
    if (c.num_experts == e.E && c.top_k == e.k && c.hidden == e.H && c.intermediate == e.I) return e.label;
  } catch (const Error&) {
  }
  return std::to_string(e.E) + "," + std::to_string(e.k) + "," + std::to_string(e.H) + "," + std::to_string(e.I);
}

std::string entry_name(const CrossoverEntry& e) { return (e.label.empty() ? "?" : e.label) + "/" + format_name(e.format); }

// --mark-stale: the entries of `table` that this build did not measure get `why`, or, with a shape
// or format ("" for any), every entry of that shape and format; those without a stamp or commit
// get `kernels` / `commit` where given.
int mark_stale(const std::string& table, const std::string& why, const std::string& shape, const std::string& format,
               const std::string& kernels, const std::string& commit) {
  MOEKIT_REQUIRE(!table.empty(), "tune --mark-stale: --table names the table to mark");
  MOEKIT_REQUIRE(kernels.empty() || (kernels.size() == 12 && kernels.find_first_not_of("0123456789abcdef") ==
                                                                  std::string::npos),
                 "tune --kernels: '", kernels, "' is not a kernel stamp (12 hex digits)");
  TuningTable t = parse_tuning_table(read_text(table, "tune --mark-stale"), table);
  int marked = 0;
  for (CrossoverEntry& e : t.entries) {
    if (!shape.empty() && e.label != shape) continue;
    if (!format.empty() && format_name(e.format) != format) continue;
    if (shape.empty() && format.empty() && e.kernels == kernel_stamp()) continue;  // measured with this build's kernels
    if (e.kernels.empty()) e.kernels = kernels;
    if (e.commit.empty()) e.commit = commit;
    e.stale = why;
    ++marked;
    std::printf("%s: %s\n", entry_name(e).c_str(), stale_entry_note(e, table).c_str());
  }
  write_file_atomic(table, tuning_table_json(t));
  std::printf("tune --mark-stale: %d of %zu entries of %s marked stale (this build's kernels: %s)\n", marked,
              t.entries.size(), table.c_str(), kernel_stamp().c_str());
  return 0;
}

#ifdef MOEKIT_WITH_CUDA
// --check: per entry of this GPU (the first of each shape and format over the tables), both
// kernels timed as tune times them (bench_gpu, the GEMMs alone, median of `reps` replays in
// turns) at check_tokens under uniform and Zipf routing; the regret of the kernel the oracle picks
// there (sm90_crossover over the same tables, the device choice from the routing's counts). A
// point over kCheckMaxRegret is timed once more and counts as over only if it is over again.
int check_tables(const DeviceInfo& dev, const std::string& table_file, const std::string& only_shape,
                 const std::string& only_format, int points, int reps, double budget_ms, bool progress) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<TuningTable> tables;
  if (!table_file.empty())
    tables.push_back(parse_tuning_table(read_text(table_file, "tune --check"), table_file));
  else
    tables = tuning_tables();
  std::vector<const CrossoverEntry*> entries;
  for (const TuningTable& t : tables)
    for (const CrossoverEntry& e : t.entries) {
      if (e.gpu != dev.name) continue;
      if (!only_shape.empty() && e.label != only_shape) continue;
      if (!only_format.empty() && format_name(e.format) != only_format) continue;
      const bool seen = std::any_of(entries.begin(), entries.end(), [&](const CrossoverEntry* x) {
        return x->E == e.E && x->k == e.k && x->H == e.H && x->I == e.I && x->format == e.format;
      });
      if (!seen) entries.push_back(&e);
    }
  std::string names;
  for (const TuningTable& t : tables) names += (names.empty() ? "" : ", ") + t.name;
  MOEKIT_REQUIRE(!entries.empty(), "tune --check: no entry for ", dev.name,
                 only_shape.empty() && only_format.empty() ? "" : " (of that --shape / --format)", " in ", names);
  std::printf("moekit tune --check: %s; tables %s; this build's kernels %s\n%zu entries, up to %d points each, uniform "
              "and Zipf routing, median of %d replays; regret over %.0f%% fails\n",
              dev.describe().c_str(), names.c_str(), kernel_stamp().c_str(), entries.size(), points, reps,
              100 * kCheckMaxRegret);
  int stale = 0, timed = 0;
  std::vector<std::string> over;
  for (const CrossoverEntry* ep : entries) {
    const CrossoverEntry& e = *ep;
    BenchOptions o;
    o.shape = entry_shape(e);
    o.format = e.format;
    o.reps = reps;
    o.budget_ms = budget_ms;
    o.compare_kernels = true;
    o.gemms_only = true;
    o.progress = progress;
    const MoeConfig cfg = bench_shape(o.shape, o.format);
    const KernelCrossover x = sm90_crossover(cfg, dev, tables);
    if (!entry_fresh(e)) ++stale;
    o.tokens = check_tokens(e, x.prefill_from, points);
    require_synthetic_memory(cfg, *std::max_element(o.tokens.begin(), o.tokens.end()));
    std::printf("\n%s: %s\n%8s %8s %12s %12s  %-8s %8s\n", entry_name(e).c_str(), x.source.c_str(), "tokens",
                "routing", "decode_us", "prefill_us", "oracle", "regret");
    std::vector<std::string> worst;  // this entry's points over the bound
    for (const BenchRouting routing : {BenchRouting::kUniform, BenchRouting::kZipf}) {
      o.routing = routing;
      // The regret of the oracle's kernel on one row; the kernel it picks ("decode" / "prefill").
      auto regret = [&](const BenchRow& r, const char** picked) {
        const bool pre = picks_prefill(x, r.tokens, point_counts(cfg, r.tokens, routing, o.zipf_s, o.seed));
        *picked = pre ? "prefill" : "decode";
        return (pre ? r.prefill_us : r.decode_us) / std::min(r.decode_us, r.prefill_us) - 1;
      };
      const std::vector<BenchRow> rows = bench_gpu(o, "sm90_decode");
      for (const BenchRow& r : rows) {
        ++timed;
        MOEKIT_REQUIRE(r.decode_us > 0 && r.prefill_us > 0, "tune --check: ", entry_name(e), " at ", r.tokens,
                       " tokens: both kernels were not timed");
        const char* picked = "";
        const double g = regret(r, &picked);
        std::printf("%8lld %8s %12.1f %12.1f  %-8s %7.1f%%", (long long)r.tokens, bench_routing_name(routing), r.decode_us,
                    r.prefill_us, picked, 100 * g);
        if (g > kCheckMaxRegret) {  // once more, alone
          BenchOptions again = o;
          again.tokens = {r.tokens};
          const BenchRow r2 = bench_gpu(again, "sm90_decode").at(0);
          ++timed;
          const double g2 = regret(r2, &picked);
          std::printf("  again %.1f / %.1f us: %.1f%%%s", r2.decode_us, r2.prefill_us, 100 * g2,
                      g2 > kCheckMaxRegret ? "  OVER" : "");
          if (g2 > kCheckMaxRegret) {
            char buf[96];
            std::snprintf(buf, sizeof buf, "%lld %s %.1f%%", (long long)r.tokens, bench_routing_name(routing),
                          100 * std::min(g, g2));
            worst.push_back(buf);
          }
        }
        std::printf("\n");
      }
    }
    if (!worst.empty()) {
      std::string w = entry_name(e) + " (";
      for (size_t i = 0; i < worst.size(); ++i) w += (i ? ", " : "") + worst[i];
      over.push_back(w + ")");
    }
    std::fflush(stdout);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("\ntune --check: %zu entries, %d points timed in %.1f s", entries.size(), timed, secs);
  if (stale) std::printf("; %d stale (the oracle's fallback was checked for them)", stale);
  if (over.empty()) {
    std::printf("; every regret within %.0f%%\n", 100 * kCheckMaxRegret);
    return 0;
  }
  std::printf("; %zu over %.0f%%:\n", over.size(), 100 * kCheckMaxRegret);
  for (const std::string& w : over) std::printf("  %s\n", w.c_str());
  std::printf("re-measure them: moekit tune --shape S --format F --out <table> (README.md, \"Tuning tables\")\n");
  return 1;
}
#endif

}  // namespace

Command make_tune_command() {
  struct Args {
    std::string shape = "gpt-oss-120b", format = "mxfp4", out;
    std::string tokens = "1,2,4,8,16,32,64,96,128,192,256,384,512,768,1024,2048,4096,8192,16384";
    int reps = 10;
    double budget_ms = 0;
    bool progress = false;
    std::string recount;
    bool check = false;
    std::string table, mark_stale, kernels, commit;
    int points = 3;
    CLI::Option *shape_opt = nullptr, *format_opt = nullptr;  // given: --check / --mark-stale narrow to it
  };
  auto a = std::make_shared<Args>();
  Command c;
  c.setup = [a](CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "tune",
        "Time the SM90 decode and prefill GEMM kernels over token counts on this GPU, under uniform and\n"
        "Zipf routing, and write the crossover (from how many tokens the prefill kernel is faster under\n"
        "both) into a tuning table.");
    a->shape_opt = sub->add_option("--shape", a->shape, bench_shape_help())->check(shape_spec());
    a->format_opt = sub->add_option("--format", a->format, "mxfp4 | nvfp4 | mxfp8 | bf16")
                        ->check(CLI::IsMember({"mxfp4", "nvfp4", "mxfp8", "bf16"}));
    sub->add_option("--tokens", a->tokens, "comma-separated token counts")->check(int_list(1, INT64_MAX));
    sub->add_option("--reps", a->reps, "timed replays per point (default 10)")->check(whole_int(1, INT_MAX));
    sub->add_option("--out", a->out, "the table to update (default data/tuning/<gpu>.json)");
    sub->add_option("--budget-ms", a->budget_ms,
                    "stop timing a kernel after this many ms of replays once it has 3 (default 0: always\n"
                    "--reps); the slower kernel then stops after one replay over 1.5x the faster")
        ->check(CLI::Range(0.0, 1e9));
    sub->add_option("--recount", a->recount,
                    "no GPU: give TABLE's entries what the device choice needs from their measured points (each\n"
                    "point's decode streams and prefill slabs, from the bench's uniform routing on the CPU; the\n"
                    "crossover within the tolerance; the stream ratio) and write it back");
    sub->add_flag("--progress", a->progress,
                  "a line per token count on stderr (on by default when stderr is a terminal)");
    sub->add_flag("--check", a->check,
                  "time the oracle's choice again on this GPU, for every entry of this GPU in the tables (or\n"
                  "those of --shape / --format): both kernels at the crossover the lookup gives and at the\n"
                  "entry's measured counts either side, under uniform and Zipf routing, --reps replays each\n"
                  "(median, as tune); exit 1 listing the entries whose regret is over 3%");
    sub->add_option("--table", a->table,
                    "with --check: the table to check (default: $MOEKIT_TUNING, then the compiled-in tables);\n"
                    "with --mark-stale: the table to mark");
    sub->add_option("--points", a->points, "with --check: points per entry, 1-3 (default 3: crossover, below, above)")
        ->check(whole_int(1, 3));
    sub->add_option("--mark-stale", a->mark_stale,
                    "no GPU: mark the entries of --table that were not measured with this build's kernels (or\n"
                    "every entry of --shape / --format) as stale, saying WHY; the oracle does not use them")
        ->type_name("WHY");
    sub->add_option("--kernels", a->kernels,
                    "with --mark-stale: the kernel stamp the entries were measured with, for entries without one");
    sub->add_option("--commit", a->commit,
                    "with --mark-stale: the commit the entries were measured at, for entries without one");
    return sub;
  };
  c.run = [a]() -> int {
    const std::string only_shape = a->shape_opt->count() ? a->shape : "";
    const std::string only_format = a->format_opt->count() ? a->format : "";
    MOEKIT_REQUIRE(int(a->check) + int(!a->mark_stale.empty()) + int(!a->recount.empty()) <= 1,
                   "tune: --check, --mark-stale and --recount are separate runs");
    MOEKIT_REQUIRE(a->table.empty() || a->check || !a->mark_stale.empty(), "tune: --table goes with --check or --mark-stale");
    MOEKIT_REQUIRE((a->kernels.empty() && a->commit.empty()) || !a->mark_stale.empty(),
                   "tune: --kernels and --commit go with --mark-stale");
    if (!a->mark_stale.empty())
      return mark_stale(a->table, a->mark_stale, only_shape, only_format, a->kernels, a->commit);
    if (!a->recount.empty()) {
      TuningTable t = parse_tuning_table(read_text(a->recount, "tune --recount"), a->recount);
      for (CrossoverEntry& e : t.entries) {
        const MoeConfig cfg = bench_shape(e.label, e.format);
        MOEKIT_REQUIRE(cfg.num_experts == e.E && cfg.top_k == e.k && cfg.hidden == e.H && cfg.intermediate == e.I,
                       "tune --recount: entry ", e.label, " is not the bench shape of that name");
        const BenchOptions dflt;  // tune's routing: uniform, the default seed
        for (CrossoverPoint& p : e.points) {
          const ChoiceCounts cc = point_counts(cfg, p.tokens, BenchRouting::kUniform, dflt.zipf_s, dflt.seed);
          p.streams = cc.streams;
          p.slabs = cc.slabs;
          if (p.zipf_decode_us > 0) {
            const ChoiceCounts zc = point_counts(cfg, p.tokens, BenchRouting::kZipf, dflt.zipf_s, dflt.seed);
            p.zipf_streams = zc.streams;
            p.zipf_slabs = zc.slabs;
          }
        }
        e.prefill_from = crossover_from_points(e.points, kCrossoverTolerance, kCrossoverMaxRegret);
        e.stream_ratio = stream_ratio_from_points(e.points, e.prefill_from, &e.stream_ratio_slope);
        std::printf("%s/%s: prefill from %lld tokens, stream ratio %.3f, slope %.2f; worst regret on its points %.1f%%\n",
                    e.label.c_str(), format_name(e.format), (long long)e.prefill_from, e.stream_ratio,
                    e.stream_ratio_slope, 100 * crossover_worst_regret(e.points, e.prefill_from));
      }
      write_file_atomic(a->recount, tuning_table_json(t));
      return 0;
    }
#ifndef MOEKIT_WITH_CUDA
    fail("tune: this binary was built without CUDA");
#else
    const DeviceInfo dev = DeviceInfo::detect();
    MOEKIT_REQUIRE(dev.gpu && dev.cc_major == 9 && dev.cc_minor == 0, "tune: needs an SM90 GPU (H100/H200); found ",
                   dev.describe());
    if (a->check) return check_tables(dev, a->table, only_shape, only_format, a->points, a->reps, a->budget_ms, a->progress);
    BenchOptions o;
    o.shape = a->shape;
    o.format = parse_format(a->format);
    o.tokens = parse_int_list(a->tokens, 1, INT64_MAX, "--tokens: ");
    o.reps = a->reps;
    o.compare_kernels = true;
    o.gemms_only = true;
    o.budget_ms = a->budget_ms;
    o.progress = a->progress || isatty(STDERR_FILENO);
    const MoeConfig cfg = bench_shape(o.shape, o.format);
    require_synthetic_memory(cfg, *std::max_element(o.tokens.begin(), o.tokens.end()));
    const std::string out = a->out.empty() ? "data/tuning/" + gpu_slug(dev.name) + ".json" : a->out;
    check_output_path(out, {});
    const std::vector<BenchRow> rows = bench_gpu(o, "sm90_decode");
    // The same counts under Zipf routing (the report's skewed load): the crossover must hold there too.
    BenchOptions oz = o;
    oz.routing = BenchRouting::kZipf;
    const std::vector<BenchRow> zrows = bench_gpu(oz, "sm90_decode");
    CrossoverEntry e;
    e.gpu = dev.name;
    e.label = o.shape;
    e.E = cfg.num_experts;
    e.k = cfg.top_k;
    e.H = cfg.hidden;
    e.I = cfg.intermediate;
    e.format = cfg.format;
    e.kernels = kernel_stamp();
    e.commit = kBuildCommit;
    std::printf("moekit tune: %s, %s, %s, kernels %s (%s)\n%8s %12s %12s  faster  %12s %12s  faster (Zipf)\n",
                o.shape.c_str(), a->format.c_str(), dev.describe().c_str(), e.kernels.c_str(), e.commit.c_str(), "tokens",
                "decode_us", "prefill_us", "decode_us", "prefill_us");
    for (size_t i = 0; i < rows.size(); ++i) {
      const BenchRow& r = rows[i];
      const BenchRow& z = zrows[i];
      MOEKIT_REQUIRE(z.tokens == r.tokens, "tune: the Zipf rows are not the uniform rows' counts");
      // The routing's per-expert counts (the bench's uniform logits, routed on the CPU: the same
      // experts as on the device) give the point's decode streams and prefill slabs.
      const ChoiceCounts cc = point_counts(cfg, r.tokens, o.routing, o.zipf_s, o.seed);
      const ChoiceCounts zc = point_counts(cfg, r.tokens, BenchRouting::kZipf, oz.zipf_s, oz.seed);
      e.points.push_back({r.tokens, r.decode_us, r.prefill_us, cc.streams, cc.slabs, z.decode_us, z.prefill_us,
                          zc.streams, zc.slabs});
      auto faster = [](const BenchRow& b) { return b.prefill_us > 0 && b.prefill_us <= b.decode_us ? "prefill" : "decode "; };
      std::printf("%8lld %12.1f %12.1f  %s %12.1f %12.1f  %s\n", (long long)r.tokens, r.decode_us, r.prefill_us,
                  faster(r), z.decode_us, z.prefill_us, faster(z));
    }
    e.prefill_from = crossover_from_points(e.points, kCrossoverTolerance, kCrossoverMaxRegret);
    e.stream_ratio = stream_ratio_from_points(e.points, e.prefill_from, &e.stream_ratio_slope);
    TuningTable t;
    t.name = out;
    if (std::ifstream in(out); in.good()) {
      std::stringstream ss;
      ss << in.rdbuf();
      t = parse_tuning_table(ss.str(), out);
    }
    auto same = [&](const CrossoverEntry& x) {
      return x.gpu == e.gpu && x.E == e.E && x.k == e.k && x.H == e.H && x.I == e.I && x.format == e.format;
    };
    t.entries.erase(std::remove_if(t.entries.begin(), t.entries.end(), same), t.entries.end());
    t.entries.push_back(e);
    write_file_atomic(out, tuning_table_json(t));
    if (e.prefill_from < 0)
      std::printf("crossover: the decode kernel at every measured count; written to %s\n", out.c_str());
    else
      std::printf("crossover: the prefill kernel from %lld tokens (within %.1f%%; worst regret on these points "
                  "%.1f%%); stream ratio %.3f (the device\nchoice in the band around it, oracle/kernel_choice.h); "
                  "written to %s\n",
                  (long long)e.prefill_from, 100 * kCrossoverTolerance,
                  100 * crossover_worst_regret(e.points, e.prefill_from), e.stream_ratio, out.c_str());
    return 0;
#endif
  };
  return c;
}

}  // namespace moekit::cli
