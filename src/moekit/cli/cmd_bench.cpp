// `moekit bench`: time the layer on synthetic weights with uniform or Zipf-skewed random routing.
//   GPU (SM90 backends): the two GEMMs and the whole layer as CUDA-graph replays, L2 flushed
//   before each, median of --reps; bytes, TB/s and % of the device-to-device copy bandwidth
//   this command measures itself; for reference, a kernel that only reads the same bytes and an
//   empty kernel, timed the same way; and the steady state of consecutive layers (--steady).
//   TFLOP/s of the two GEMMs and % of a cuBLAS bf16 GEMM's rate measured in the same process;
//   with the crossover backends (sm90, sm90_batched) both GEMM kernels on each row and the
//   oracle's regret; --peer torch: bench/peers.py's torch peer on the same problems, its time and
//   the ratio per row; --split: the layer's time per part (routing, permute, GEMM1, GEMM2,
//   finalize) at the given token counts.
//   CPU backends: host wall time of the whole layer, median of --reps.
//   --json / --csv: the rows, each stamped with the GPU, driver, CUDA, commit and date.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moekit/api/host_runner.h"
#include "moekit/bench/bench.h"
#include "moekit/bench/bench_ep.h"
#include "moekit/cli/args.h"
#include "moekit/cli/bench_stamp.h"
#include "moekit/cli/cmd_bench_ep.h"
#include "moekit/cli/commands.h"
#include "moekit/common/error.h"
#include "moekit/io/files.h"
#include "moekit/model/synthetic.h"
#include "moekit/oracle/oracle.h"

namespace moekit::cli {

// The torch peer (bench/peers.py --peers torch: torch._grouped_mm, bf16 weights) on the same
// shape, token counts and routing distribution: its two GEMMs' time per token count, or empty
// with the reason printed. The script is looked for in the current directory's bench/ and beside
// the binary (../bench, ../../bench).
std::map<int64_t, double> run_torch_peer(const BenchOptions& o, std::string* version) {
  std::map<int64_t, double> us;
  std::string script;
  char exe[4096] = {0};
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  const std::string dir = n > 0 ? std::string(exe, size_t(n)).substr(0, std::string(exe, size_t(n)).rfind('/')) : ".";
  for (const std::string& cand :
       {std::string("bench/peers.py"), dir + "/../bench/peers.py", dir + "/../../bench/peers.py"})
    if (FILE* f = std::fopen(cand.c_str(), "r")) {
      std::fclose(f);
      script = cand;
      break;
    }
  if (script.empty()) {
    std::printf("peer torch: skipped (bench/peers.py not found)\n");
    return us;
  }
  std::string tokens;
  for (int64_t t : o.tokens) tokens += (tokens.empty() ? "" : ",") + std::to_string(t);
  char tmpl[] = "/tmp/moekit-peer-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) {
    std::printf("peer torch: skipped (no temporary file)\n");
    return us;
  }
  close(fd);
  const MoeConfig c = bench_shape(o.shape, o.format);
  const std::string dims = std::to_string(c.num_experts) + "," + std::to_string(c.top_k) + "," +
                           std::to_string(c.hidden) + "," + std::to_string(c.intermediate);
  char zipf[32];
  std::snprintf(zipf, sizeof zipf, "%g", o.zipf_s);
  const std::string cmd = "python3 " + script + " --peers torch --shape " + dims + " --tokens " + tokens +
                          " --routing " + bench_routing_name(o.routing) + " --zipf-s " + zipf + " --reps " +
                          std::to_string(o.reps) + " --json " + tmpl + " > /dev/null 2>&1";
  const int rc = std::system(cmd.c_str());
  std::string text;
  if (FILE* f = std::fopen(tmpl, "r")) {
    char buf[4096];
    size_t got;
    while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, got);
    std::fclose(f);
  }
  std::remove(tmpl);
  if (rc != 0 || text.empty()) {
    std::printf("peer torch: skipped (python3 with torch and a CUDA device is needed; the script exited %d)\n", rc);
    return us;
  }
  try {
    const auto j = nlohmann::json::parse(text);
    for (const auto& row : j.at("rows")) {
      us[row.at("tokens").get<int64_t>()] = row.at("us").get<double>();
      if (version) *version = row.value("version", "");
    }
    if (us.empty())
      for (const auto& st : j.at("status"))
        std::printf("peer torch: skipped (%s)\n", st.value("reason", std::string("no rows")).c_str());
  } catch (const std::exception& e) {
    std::printf("peer torch: skipped (unreadable output: %s)\n", e.what());
    us.clear();
  }
  return us;
}

namespace {

std::vector<BenchRow> bench_cpu(const BenchOptions& o, const std::string& backend) {
  const MoeConfig cfg = bench_config(o);
  SyntheticOptions so;
  so.seed = o.seed;
  so.biases = cfg.act == Activation::kSwigluOai;
  const MoeModel m = make_synthetic_model(cfg, so);
  HostRunner runner(m, backend);
  std::vector<BenchRow> rows;
  for (int64_t T : o.tokens) {
    LayerInputData in = make_synthetic_input(cfg, T, o.seed + uint64_t(T));
    if (o.routing != BenchRouting::kUniform) in.logits = bench_router_logits(cfg, T, o.routing, o.zipf_s, o.seed);
    LayerOutput out;
    runner.run(in.view(), &out);  // warm-up
    std::vector<double> t;
    const int reps = std::max(1, std::min(o.reps, 5));
    for (int i = 0; i < reps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      runner.run(in.view(), &out);
      t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    BenchRow r;
    r.backend = backend;
    r.shape = o.shape;
    r.format = format_name(o.format);
    r.tokens = T;
    std::vector<int> rows_of(size_t(cfg.num_experts), 0);
    for (int32_t id : out.ids)
      if (id >= 0) r.max_expert_rows = std::max(r.max_expert_rows, ++rows_of[size_t(id)]);
    r.active_experts = int(cfg.num_experts - std::count(rows_of.begin(), rows_of.end(), 0));
    r.layer_us = t[t.size() / 2];
    rows.push_back(r);
  }
  return rows;
}

// One row as JSON (the --json array's items and the --csv columns, in this order).
nlohmann::ordered_json row_json(const BenchRow& r, const MoeConfig& c, const BenchOptions& o, const BenchStamp& st) {
  nlohmann::ordered_json j = {
      {"backend", r.backend}, {"shape", r.shape}, {"format", r.format},
      {"activation_dtype", activation_dtype_name(c.activation_dtype)},
      {"activation_scale", activation_scale_name(c.activation_scale)}, {"E", c.num_experts}, {"k", c.top_k},
      {"H", c.hidden}, {"I", c.intermediate}, {"routing", bench_routing_name(o.routing)},
      {"router", o.hash_layer ? "hash" : "score"},
      {"zipf_s", o.routing == BenchRouting::kZipf ? nlohmann::ordered_json(o.zipf_s) : nlohmann::ordered_json()},
      {"tokens", r.tokens}, {"active_experts", r.active_experts}, {"max_expert_rows", r.max_expert_rows},
      {"gemm_us", r.gemm_us}, {"layer_us", r.layer_us}, {"gemm_bytes", r.gemm_bytes}, {"tbps", r.tbps},
      {"copy_tbps", r.copy_tbps}, {"pct_copy", r.pct_copy}, {"layer_over_gemm", r.layer_over_gemm},
      {"read_us", r.read_us}, {"floor_us", r.floor_us}, {"steady_layers", r.steady_layers},
      {"steady_gemm_us", r.steady_gemm_us}, {"steady_layer_us", r.steady_layer_us},
      {"gemm_cta_shape", r.gemm_shape}, {"kernel", r.kernel}, {"kernel_choice", r.kernel_choice}, {"prefill_from", r.prefill_from},
      {"decode_us", r.decode_us}, {"prefill_us", r.prefill_us}, {"flops", r.flops}, {"tflops", r.tflops},
      {"bf16_tflops", r.bf16_tflops}, {"peer_us", r.peer_us}};
  for (int p = 0; p < kLayerParts; ++p)
    j[std::string(kLayerPartNames[p]) + "_us"] =
        r.split_us[0] >= 0 ? nlohmann::ordered_json(r.split_us[p]) : nlohmann::ordered_json();
  j["finalize_alone_us"] = r.finalize_alone_us >= 0 ? nlohmann::ordered_json(r.finalize_alone_us) : nlohmann::ordered_json();
  j["device"] = st.gpu;
  j["driver"] = st.driver;
  j["cuda"] = st.cuda;
  j["commit"] = st.commit;
  j["date"] = st.date;
  return j;
}

// The rows as CSV: a header of the JSON keys, one line per row (null: an empty cell).
std::string rows_csv(const std::vector<nlohmann::ordered_json>& rows) {
  std::string out;
  if (rows.empty()) return out;
  auto cell = [](const nlohmann::ordered_json& v) -> std::string {
    if (v.is_null()) return "";
    if (!v.is_string()) return v.dump();
    const std::string t = v.get<std::string>();
    if (t.find_first_of(",\"\n") == std::string::npos) return t;
    std::string q = "\"";
    for (char ch : t) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
    return q + "\"";
  };
  for (auto it = rows[0].begin(); it != rows[0].end(); ++it) {
    if (it != rows[0].begin()) out += ',';
    out += it.key();
  }
  out += '\n';
  for (const auto& r : rows) {
    for (auto it = r.begin(); it != r.end(); ++it) {
      if (it != r.begin()) out += ',';
      out += cell(it.value());
    }
    out += '\n';
  }
  return out;
}

}  // namespace

Command make_bench_command() {
  struct Args {
    std::string shape = "gpt-oss-120b", format = "mxfp4", tokens = "1,8,32,64", backend, json, csv, trace_file, peer;
    std::string routing = "uniform", split;
    double zipf_s = 1.0, budget_ms = 0;
    int reps = 50;
    uint64_t seed = 1;
    bool trace = false, progress = false, list_shapes = false, expert_counts = false, hash = false;
    int steady = 0;
    bool compare = false;
    int ep = 0;
    EpBenchArgs ep_args;
    ActivationArgs act;
  };
  auto a = std::make_shared<Args>();
  Command c;
  c.setup = [a](CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "bench",
        "Time the layer on synthetic weights with uniform or Zipf-skewed random routing. On an SM90\n"
        "GPU: the two GEMMs and the whole layer as CUDA-graph replays (L2 flushed before each,\n"
        "median), active experts, weight bytes, TB/s and % of the measured copy bandwidth.");
    sub->add_option("--shape", a->shape, bench_shape_help())->check(shape_spec());
    sub->add_option("--format", a->format, "mxfp4 | nvfp4 | mxfp8 | bf16")
        ->check(CLI::IsMember({"mxfp4", "nvfp4", "mxfp8", "bf16"}));
    add_activation_options(sub, a->act, false);
    sub->add_option("--tokens", a->tokens, "comma-separated token counts (default 1,8,32,64)")
        ->check(int_list(0, INT64_MAX));
    sub->add_option("--backend", a->backend, "backend (default: the oracle's choice)");
    sub->add_option("--routing", a->routing,
                    "uniform (every expert equally likely; default) | zipf (the expert of rank r drawn with\n"
                    "probability ~ 1/r^s, k distinct per token; the same experts hot at every token count) |\n"
                    "uniform,zipf (both, one after the other, on the same weights)")
        ->check(CLI::IsMember({"uniform", "zipf", "uniform,zipf", "zipf,uniform"}));
    sub->add_option("--zipf-s", a->zipf_s, "the Zipf exponent s of --routing zipf (default 1.0)")
        ->check(CLI::Range(0.0, 8.0));
    sub->add_option("--json", a->json,
                    "also write the rows to this JSON file (stamped: GPU, driver, CUDA, commit, date)");
    sub->add_option("--csv", a->csv, "also write the rows to this CSV file (the JSON's columns)");
    sub->add_option("--reps", a->reps, "timed replays per row (default 50)")->check(whole_int(1, INT_MAX));
    sub->add_option("--budget-ms", a->budget_ms,
                    "stop timing a quantity after this many ms of replays once it has 3 (long sweeps; default\n"
                    "0: always --reps); the other kernel of a comparison then stops after one replay over 1.5x")
        ->check(CLI::Range(0.0, 1e9));
    sub->add_option("--split", a->split,
                    "token counts (comma-separated) at which to also time the layer's parts: routing, permute,\n"
                    "GEMM1, GEMM2, finalize (the layer cut after each part; a part's time is the difference)")
        ->check(int_list(0, INT64_MAX));
    sub->add_flag("--list-shapes", a->list_shapes, "print the named shapes (name E k H I activation scoring) and exit");
    sub->add_flag("--hash", a->hash,
                  "route as DeepSeek-V4's hash layers: experts from a random tid2eid [129280, k] table by\n"
                  "random token ids, weighted by their scores (--routing does not apply; time the router\n"
                  "with --split)");
    // Offline studies (bench/regret_study.py): no GPU, not in --help.
    sub->add_flag("--expert-counts", a->expert_counts,
                  "print the rows per expert that each token count and routing gives (CPU) as JSON lines")
        ->group("");
    sub->add_flag("--progress", a->progress,
                  "a line per token count on stderr (on by default when stderr is a terminal)");
    sub->add_option("--seed", a->seed, "weights and routing seed")->check(whole_int(0, INT64_MAX));
    sub->add_flag("--trace", a->trace, "also print per-CTA phase timings of the GEMM kernel");
    sub->add_option("--steady", a->steady,
                    "also time N layers with weights of their own back to back in one graph and report the\n"
                    "per-layer time (fewer when memory is short; default 0: off)")
        ->check(whole_int(0, INT_MAX));
    sub->add_flag("--compare-kernels", a->compare,
                  "also time the other SM90 GEMM kernel (decode / prefill) on every row (on by default for the\n"
                  "crossover backends sm90 and sm90_batched: the oracle's regret per row)");
    sub->add_option("--peer", a->peer,
                    "torch: also run bench/peers.py --peers torch (torch._grouped_mm) on the same problems")
        ->check(CLI::IsMember({"torch"}));
    sub->add_option("--ep", a->ep,
                    "expert parallelism on R virtual ranks of this GPU: dispatch, experts, combine and the\n"
                    "whole layer timed apart (--tokens per rank, default 128)")
        ->check(whole_int(1, 64));
    sub->add_flag("--ep-gpus", a->ep_args.gpus,
                  "with --ep R: the ranks on GPUs 0..R-1 of this machine, one process each (as engines\n"
                  "run; an NCCL communicator from a unique id), each row set against the single-GPU layer\n"
                  "on one rank's share; with --peer torch also torch's all_to_all_single on the same GPUs");
    sub->add_flag("--ep-threads", a->ep_args.threads,
                  "with --ep-gpus: one process, a thread per GPU (one NCCL communicator of all of them)");
    sub->add_option("--ep-payload", a->ep_args.payloads, "with --ep: bf16 | mxfp8 | nvfp4, or a comma-separated list")
        ->check(CLI::Validator(
            [](std::string& v) -> std::string {
              std::stringstream ss(v);
              for (std::string x; std::getline(ss, x, ',');)
                if (x != "bf16" && x != "mxfp8" && x != "nvfp4") return "'" + x + "' is not bf16, mxfp8 or nvfp4";
              return "";
            },
            "PAYLOADS"));
    sub->add_option("--ep-combine", a->ep_args.combine,
                    "with --ep: the rows combine pulls, fp32 (bit-identical to one GPU; default) | bf16 | bf16_sum\n"
                    "(bf16 rows summed on their experts' rank first: one partial per token and rank)")
        ->check(CLI::IsMember({"fp32", "bf16", "bf16_sum"}));
    // A rank process of --ep-gpus (spawned by it; not in --help).
    sub->add_option("--ep-rank", a->ep_args.rank, "")->group("");
    sub->add_option("--ep-id", a->ep_args.unique_id, "")->group("");
    sub->add_option("--ep-out", a->ep_args.out, "")->group("");
    sub->add_option("--trace-file", a->trace_file,
                    "with --trace: write each CTA's first tasks (phase, index; first stage issued, in shared\n"
                    "memory, stored, in us) to FILE.T.csv");
    return sub;
  };
  c.run = [a]() {
    if (a->list_shapes) {
      for (const std::string& n : bench_shape_names()) {
        const MoeConfig s = bench_shape(n, WeightFormat::kBf16);
        std::printf("%s %d %d %d %d %s %s\n", n.c_str(), s.num_experts, s.top_k, s.hidden, s.intermediate,
                    activation_name(s.act), scoring_name(s.scoring));
      }
      return 0;
    }
    if (a->expert_counts) {
      // One line per (routing, tokens): the counts the bench's router logits give on this shape.
      const MoeConfig cfg = bench_shape(a->shape, parse_format(a->format));
      for (const std::string r : {"uniform", "zipf"}) {
        if (a->routing.find(r) == std::string::npos) continue;
        const BenchRouting br = r == "zipf" ? BenchRouting::kZipf : BenchRouting::kUniform;
        for (int64_t T : parse_int_list(a->tokens, 0, INT64_MAX, "--tokens: ")) {
          nlohmann::ordered_json j;
          j["shape"] = a->shape;
          j["routing"] = r;
          j["tokens"] = T;
          j["counts"] = bench_expert_counts(cfg, T, br, a->zipf_s, a->seed);
          std::printf("%s\n", j.dump().c_str());
        }
      }
      return 0;
    }
    LayerSpec act;  // --activations, --activation-scale
    apply_activation_options(a->act, &act);
    if (a->ep > 0) {
      MOEKIT_REQUIRE(act.activation_dtype == ActivationDtype::kBf16,
                     "--ep: the EP layer takes bf16 activations only (no --activations fp8)");
      EpBenchArgs e = a->ep_args;
      e.shape = a->shape;
      e.format = a->format;
      e.tokens = a->tokens == "1,8,32,64" ? "128" : a->tokens;
      e.ranks = a->ep;
      e.reps = a->reps;
      e.seed = a->seed;
      e.trace = a->trace;
      e.peer = a->peer;
      e.json = a->json;
      return run_ep_bench(e);
    }
    BenchOptions o;
    o.shape = a->shape;
    o.format = parse_format(a->format);
    o.tokens = parse_int_list(a->tokens, 0, INT64_MAX, "--tokens: ");
    o.reps = a->reps;
    o.seed = a->seed;
    o.trace = a->trace;
    o.steady_layers = a->steady;
    o.trace_file = a->trace_file;
    std::vector<BenchRouting> routings;
    for (const std::string r : {"uniform", "zipf"})
      if (a->routing.find(r) != std::string::npos)
        routings.push_back(r == "zipf" ? BenchRouting::kZipf : BenchRouting::kUniform);
    if (a->routing.rfind("zipf", 0) == 0) std::reverse(routings.begin(), routings.end());
    o.zipf_s = a->zipf_s;
    if (!a->split.empty()) o.split = parse_int_list(a->split, 0, INT64_MAX, "--split: ");
    o.budget_ms = a->budget_ms;
    o.progress = a->progress || isatty(STDERR_FILENO);
    o.hash_layer = a->hash;
    o.activation_dtype = act.activation_dtype;
    o.activation_scale = act.activation_scale;
    if (o.hash_layer && routings.size() > 1) routings.resize(1);  // the table decides the experts
    const MoeConfig cfg = bench_config(o);
    const DeviceInfo dev = DeviceInfo::detect();
    Problem p;
    p.cfg = cfg;
    p.tokens = *std::max_element(o.tokens.begin(), o.tokens.end());
    require_synthetic_memory(cfg, p.tokens);               // sizes refused before any allocation
    if (!a->json.empty()) check_output_path(a->json, {});  // before the run, not after it
    if (!a->csv.empty()) check_output_path(a->csv, {});
    const Decision d = choose_backend(p, dev, a->backend);
    const std::string name = d.chosen->caps().name;
    const bool crossover = name == "sm90" || name == "sm90_batched";
    o.compare_kernels = a->compare || crossover;
    std::string bf16_why;
    double bf16 = -1;
    std::vector<nlohmann::ordered_json> js;
    const BenchStamp st = bench_stamp(dev);
    for (BenchRouting routing : routings) {
      o.routing = routing;
      std::vector<BenchRow> rows;
      if (d.chosen->caps().needs_sm90) {
#ifdef MOEKIT_WITH_CUDA
        rows = bench_gpu(o, name);
        if (bf16 < 0) bf16 = measure_bf16_tflops(&bf16_why);
#else
        fail("bench: this binary was built without CUDA");
#endif
      } else {
        rows = bench_cpu(o, name);
        bf16 = 0;
      }
      std::string peer_version;
      if (a->peer == "torch") {
        const auto peer = run_torch_peer(o, &peer_version);
        for (auto& r : rows)
          if (auto it = peer.find(r.tokens); it != peer.end()) r.peer_us = it->second;
      }
      for (auto& r : rows) r.bf16_tflops = bf16;
      char zipf[32] = "";
      if (o.routing == BenchRouting::kZipf) std::snprintf(zipf, sizeof zipf, " (s = %g)", o.zipf_s);
      std::printf("moekit bench: %s, %s%s, %s routing%s, device %s\n", o.shape.c_str(), a->format.c_str(),
                  o.activation_dtype == ActivationDtype::kBf16 ? "" : (", " + describe_activations(cfg) + " activations").c_str(),
                  o.hash_layer ? "hash (tid2eid)" : bench_routing_name(o.routing), o.hash_layer ? "" : zipf,
                  dev.describe().c_str());
      const bool gpu = d.chosen->caps().needs_sm90;
      const bool steady = gpu && !rows.empty() && rows[0].steady_layers > 1;
      const bool compared = gpu && o.compare_kernels && !rows.empty() && rows[0].decode_us > 0 && rows[0].prefill_us > 0;
      const bool peered = gpu && !rows.empty() && rows[0].peer_us > 0;
      if (gpu)
        std::printf("%-20s %6s %7s %10s %10s %9s %8s %8s %8s %8s %7s %8s %6s%s%s%s\n", "backend", "tokens", "experts",
                    "gemm_us", "layer_us", "MB", "TB/s", "%copy", "layer/g", "read_us", "%read", "TFLOP/s", "%bf16",
                    compared ? "     dec_us     pre_us regret%" : "", peered ? "    peer_us  x_peer" : "",
                    steady ? " s_gemm_us  s_%copy s_layer_us  cta" : "  cta");
      else
        std::printf("%-20s %6s %7s %12s   (host wall time of the whole layer, median)\n", "backend", "tokens",
                    "experts", "layer_ms");
      for (const auto& r : rows) {
        if (gpu) {
          std::printf("%-20s %6lld %7d %10.1f %10.1f %9.1f %8.3f %8.1f %8.2f %8.1f %7.1f %8.1f %6.1f", r.backend.c_str(),
                      (long long)r.tokens, r.active_experts, r.gemm_us, r.layer_us, r.gemm_bytes / 1e6, r.tbps,
                      r.pct_copy, r.layer_over_gemm, r.read_us, 100.0 * r.read_us / r.gemm_us, r.tflops,
                      r.bf16_tflops > 0 ? 100.0 * r.tflops / r.bf16_tflops : 0.0);
          if (compared)
            std::printf(" %10.1f %10.1f %7.1f", r.decode_us, r.prefill_us,
                        100.0 * (r.gemm_us / std::min(r.decode_us, r.prefill_us) - 1.0));
          if (peered) std::printf(" %10.1f %7.2f", r.peer_us, r.peer_us / r.gemm_us);
          if (steady)
            std::printf(" %9.1f %8.1f %10.1f", r.steady_gemm_us,
                        100.0 * r.gemm_bytes / (r.steady_gemm_us * 1e-6) / 1e12 / r.copy_tbps, r.steady_layer_us);
          std::printf("  %s%s\n", r.gemm_shape.c_str(), r.kernel_choice == "device" ? " (device)" : "");
        } else {
          std::printf("%-20s %6lld %7d %12.2f\n", r.backend.c_str(), (long long)r.tokens, r.active_experts,
                      r.layer_us / 1e3);
        }
      }
      if (!rows.empty() && rows[0].copy_tbps > 0) {
        std::printf("device-to-device copy bandwidth (read + write): %.3f TB/s\n", rows[0].copy_tbps);
        std::printf("read_us: one kernel that only reads the same bytes, timed the same way; %%read = read_us / gemm_us\n");
        std::printf("timing floor (a graph of one empty kernel, timed the same way): %.1f us\n", rows[0].floor_us);
        std::printf("cta: the decode kernel's CTAs per SM x ring stages (experts/sm90_shape.h), or prefill; (device):\n"
                    "     chosen on the device from the plan's counts, both kernels launched (oracle/kernel_choice.h)\n");
        if (bf16 > 0)
          std::printf("TFLOP/s: 2 x tokens x k x 3 x H x I / gemm_us; %%bf16: of a cuBLAS bf16 8192^3 GEMM here, %.1f TFLOP/s\n",
                      bf16);
        else
          std::printf("TFLOP/s: 2 x tokens x k x 3 x H x I / gemm_us; %%bf16: not measured (%s)\n", bf16_why.c_str());
        if (compared)
          std::printf("dec_us / pre_us: the decode / prefill GEMM kernel on the same routing; regret: gemm_us over the faster\n");
        if (peered)
          std::printf("peer_us: torch._grouped_mm with bf16 weights (%s), the two GEMMs; x_peer = peer_us / gemm_us\n",
                      peer_version.c_str());
        if (steady)
          std::printf("s_*: per layer, %d layers with weights of their own back to back in one graph (L2 flushed before it)\n",
                      rows[0].steady_layers);
      }
      if (gpu && !rows.empty())
        for (const auto& r : rows) {
          if (r.split_us[0] < 0) continue;
          std::printf("split T=%lld (us):", (long long)r.tokens);
          for (int p = 0; p < kLayerParts; ++p) std::printf(" %s %.1f", kLayerPartNames[p], r.split_us[p]);
          if (r.finalize_alone_us >= 0) std::printf(" (finalize alone %.1f)", r.finalize_alone_us);
          std::printf("  (the layer cut after each part; differences, so they add up to layer_us)\n");
        }
      for (const auto& r : rows) js.push_back(row_json(r, cfg, o, st));
    }
    if (!a->json.empty()) write_file_atomic(a->json, nlohmann::ordered_json(js).dump(1) + "\n");
    if (!a->csv.empty()) write_file_atomic(a->csv, rows_csv(js));
    return 0;
  };
  return c;
}

}  // namespace moekit::cli
