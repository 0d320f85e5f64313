// `moekit tune`: time both SM90 GEMM kernels (decode, prefill) over token counts on this GPU
// and write the crossover as an entry of a tuning table (oracle/tuning.h), one JSON file per GPU
// model: the entry of the same GPU, shape and format is replaced, the others are kept. The
// committed tables (data/tuning/) are compiled into the binary; $MOEKIT_TUNING points the oracle
// at another file.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <unistd.h>

#include "moekit/bench/bench.h"
#include "moekit/cli/args.h"
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

}  // namespace

Command make_tune_command() {
  struct Args {
    std::string shape = "gpt-oss-120b", format = "mxfp4", out;
    std::string tokens = "1,2,4,8,16,32,64,96,128,192,256,384,512,768,1024,2048,4096,8192,16384";
    int reps = 10;
    double budget_ms = 0;
    bool progress = false;
    std::string recount;
  };
  auto a = std::make_shared<Args>();
  Command c;
  c.setup = [a](CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "tune",
        "Time the SM90 decode and prefill GEMM kernels over token counts on this GPU, under uniform and\n"
        "Zipf routing, and write the crossover (from how many tokens the prefill kernel is faster under\n"
        "both) into a tuning table.");
    sub->add_option("--shape", a->shape, bench_shape_help())->check(shape_spec());
    sub->add_option("--format", a->format, "mxfp4 | nvfp4 | mxfp8 | bf16")
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
    return sub;
  };
  c.run = [a]() -> int {
    if (!a->recount.empty()) {
      std::ifstream in(a->recount);
      MOEKIT_REQUIRE(in.good(), "tune --recount: cannot read ", a->recount);
      std::stringstream ss;
      ss << in.rdbuf();
      TuningTable t = parse_tuning_table(ss.str(), a->recount);
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
    std::printf("moekit tune: %s, %s, %s\n%8s %12s %12s  faster  %12s %12s  faster (Zipf)\n", o.shape.c_str(),
                a->format.c_str(), dev.describe().c_str(), "tokens", "decode_us", "prefill_us", "decode_us",
                "prefill_us");
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
