// `moekit bench --ep R` (cli/cmd_bench_ep.h).
#include "moekit/cli/cmd_bench_ep.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "moekit/bench/bench.h"
#include "moekit/bench/bench_ep.h"
#include "moekit/cli/args.h"
#include "moekit/common/error.h"
#include "moekit/comm/nccl_window.h"
#include "moekit/io/files.h"
#include "moekit/oracle/oracle.h"

extern char** environ;

namespace moekit::cli {

#ifdef MOEKIT_WITH_CUDA
namespace {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) v.push_back(x);
  return v;
}

std::string to_hex(const std::vector<uint8_t>& b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t c : b) s += d[c >> 4], s += d[c & 15];
  return s;
}

std::vector<uint8_t> from_hex(const std::string& s) {
  MOEKIT_REQUIRE(s.size() % 2 == 0, "--ep-id: not a hex string");
  std::vector<uint8_t> b;
  for (size_t i = 0; i < s.size(); i += 2) b.push_back(uint8_t(std::stoi(s.substr(i, 2), nullptr, 16)));
  return b;
}

std::string exe_path() {
  char exe[4096] = {0};
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  MOEKIT_REQUIRE(n > 0, "bench --ep: cannot find this program's path (/proc/self/exe)");
  return std::string(exe, size_t(n));
}

nlohmann::ordered_json row_json(const EpBenchRow& r) {
  return {{"ranks", r.ranks},
          {"local_gpus", r.local_gpus},
          {"tokens_per_rank", r.tokens},
          {"payload", r.payload},
          {"combine", r.combine},
          {"slots", r.slots},
          {"dispatch_us", r.dispatch_us},
          {"dispatch_all_us", r.dispatch_all_us},
          {"experts_us", r.experts_us},
          {"combine_us", r.combine_us},
          {"layer_us", r.layer_us},
          {"dispatch_steady_us", r.dispatch_steady_us},
          {"combine_steady_us", r.combine_steady_us},
          {"layer_steady_us", r.layer_steady_us},
          {"dispatch_ctas", r.dispatch_ctas},
          {"combine_ctas", r.combine_ctas},
          {"dispatch_bytes", r.dispatch_bytes},
          {"combine_bytes", r.combine_bytes},
          {"copy_tbps", r.copy_tbps},
          {"dispatch_pct_copy", r.dispatch_pct},
          {"combine_pct_copy", r.combine_pct},
          {"send_gbps_per_rank", r.send_gbps_per_rank},
          {"trace", r.trace}};
}

EpBenchRow row_of(const nlohmann::json& j) {
  EpBenchRow r;
  r.ranks = j.at("ranks");
  r.local_gpus = j.at("local_gpus");
  r.tokens = j.at("tokens_per_rank");
  r.payload = j.at("payload");
  r.combine = j.at("combine");
  r.slots = j.at("slots");
  r.dispatch_us = j.at("dispatch_us");
  r.dispatch_all_us = j.at("dispatch_all_us");
  r.experts_us = j.at("experts_us");
  r.combine_us = j.at("combine_us");
  r.layer_us = j.at("layer_us");
  r.dispatch_steady_us = j.at("dispatch_steady_us");
  r.combine_steady_us = j.at("combine_steady_us");
  r.layer_steady_us = j.at("layer_steady_us");
  r.dispatch_ctas = j.at("dispatch_ctas");
  r.combine_ctas = j.at("combine_ctas");
  r.dispatch_bytes = j.at("dispatch_bytes");
  r.combine_bytes = j.at("combine_bytes");
  r.copy_tbps = j.at("copy_tbps");
  r.dispatch_pct = j.at("dispatch_pct_copy");
  r.combine_pct = j.at("combine_pct_copy");
  r.send_gbps_per_rank = j.at("send_gbps_per_rank");
  r.trace = j.at("trace").get<std::vector<std::string>>();
  return r;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The rank processes: spawned with this program's own arguments plus --ep-rank r, each writing its
// rows to dir/rank_r.json and its output to dir/rank_r.log. Waits for all of them; when one fails,
// or all together run past timeout_s, the others get 30 s (their EP waits time out on their own),
// then SIGKILL. Returns the rows of every rank (the rank's list).
std::vector<std::vector<EpBenchRow>> run_rank_processes(const EpBenchArgs& a, const std::vector<std::string>& base) {
  char tmpl[] = "/tmp/moekit-ep-XXXXXX";
  MOEKIT_REQUIRE(mkdtemp(tmpl) != nullptr, "bench --ep: no temporary directory");
  const std::string dir = tmpl;
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off (nothing here uses it)
  const std::string id = to_hex(ep::NcclWindow::unique_id());
  std::vector<pid_t> pids(size_t(a.ranks), 0);
  for (int r = 0; r < a.ranks; ++r) {
    std::vector<std::string> args = base;
    for (const std::string& s : {std::string("--ep-rank"), std::to_string(r), std::string("--ep-id"), id,
                                 std::string("--ep-out"), dir + "/rank_" + std::to_string(r) + ".json"})
      args.push_back(s);
    std::vector<char*> argv;
    for (std::string& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    const std::string log = dir + "/rank_" + std::to_string(r) + ".log";
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const int rc = posix_spawn(&pids[size_t(r)], argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    MOEKIT_REQUIRE(rc == 0, "bench --ep: cannot start rank ", r, " (posix_spawn: ", rc, ")");
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  std::vector<int> status(size_t(a.ranks), -1);
  int left = a.ranks;
  double deadline = a.timeout_s;
  bool failed = false;
  while (left > 0) {
    for (int r = 0; r < a.ranks; ++r) {
      if (status[size_t(r)] != -1) continue;
      int st = 0;
      if (waitpid(pids[size_t(r)], &st, WNOHANG) == pids[size_t(r)]) {
        status[size_t(r)] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        --left;
        if (status[size_t(r)] != 0 && !failed) {
          failed = true;
          deadline = std::min(deadline, elapsed() + 30.0);
        }
      }
    }
    if (left > 0 && elapsed() > deadline) {
      for (int r = 0; r < a.ranks; ++r)
        if (status[size_t(r)] == -1) kill(pids[size_t(r)], SIGKILL);
      for (int r = 0; r < a.ranks; ++r)
        if (status[size_t(r)] == -1) {
          waitpid(pids[size_t(r)], nullptr, 0);
          status[size_t(r)] = 128 + SIGKILL;
        }
      failed = true;
      left = 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::string why;
  for (int r = 0; r < a.ranks; ++r)
    if (status[size_t(r)] != 0) {
      std::string log = read_text(dir + "/rank_" + std::to_string(r) + ".log");
      if (log.size() > 2000) log = "..." + log.substr(log.size() - 2000);
      why += "\nrank " + std::to_string(r) + " exited " + std::to_string(status[size_t(r)]) + ":\n" + log;
    }
  MOEKIT_REQUIRE(!failed, "bench --ep: a rank process failed", why);
  std::vector<std::vector<EpBenchRow>> rows(size_t(a.ranks));
  for (int r = 0; r < a.ranks; ++r) {
    const auto j = nlohmann::json::parse(read_text(dir + "/rank_" + std::to_string(r) + ".json"));
    for (const auto& x : j) rows[size_t(r)].push_back(row_of(x));
    std::remove((dir + "/rank_" + std::to_string(r) + ".json").c_str());
    std::remove((dir + "/rank_" + std::to_string(r) + ".log").c_str());
  }
  rmdir(dir.c_str());
  return rows;
}

// torch's all_to_all_single on the same R GPUs (bench/ep_all_to_all.py): per (payload, tokens)
// its dispatch and combine medians; empty with the reason printed when it cannot run.
struct PeerRow {
  double dispatch_us = 0, combine_us = 0, dispatch_steady_us = 0, combine_steady_us = 0;
};
std::map<std::pair<std::string, int64_t>, PeerRow> run_all_to_all(const EpBenchArgs& a, std::string* nccl) {
  std::map<std::pair<std::string, int64_t>, PeerRow> out;
  const std::string exe = exe_path(), dir = exe.substr(0, exe.rfind('/'));
  std::string script;
  for (const std::string& cand : {std::string("bench/ep_all_to_all.py"), dir + "/../bench/ep_all_to_all.py",
                                  dir + "/../../bench/ep_all_to_all.py"})
    if (FILE* f = std::fopen(cand.c_str(), "r")) {
      std::fclose(f);
      script = cand;
      break;
    }
  if (script.empty()) {
    std::printf("peer torch: skipped (bench/ep_all_to_all.py not found)\n");
    return out;
  }
  char tmpl[] = "/tmp/moekit-a2a-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return out;
  close(fd);
  const std::string cmd = "python3 " + script + " --world " + std::to_string(a.ranks) + " --shape " + a.shape +
                          " --tokens " + a.tokens + " --payloads " + a.payloads +
                          // bf16_sum: torch moves what the slots' bf16 rows are (one per slot)
                          " --combine " + (a.combine == "bf16_sum" ? std::string("bf16") : a.combine) +
                          " --reps " + std::to_string(a.reps) + " --json " + tmpl + " > " + tmpl + ".log 2>&1";
  const int rc = std::system(cmd.c_str());
  const std::string text = read_text(tmpl);
  const std::string log = read_text(std::string(tmpl) + ".log");
  std::remove(tmpl);
  std::remove((std::string(tmpl) + ".log").c_str());
  if (rc != 0 || text.empty()) {
    std::printf("peer torch: skipped (the script exited %d)\n%s\n", rc, log.substr(log.size() > 1500 ? log.size() - 1500 : 0).c_str());
    return out;
  }
  for (const auto& j : nlohmann::json::parse(text)) {
    PeerRow& p = out[{j.at("payload").get<std::string>(), j.at("tokens_per_rank").get<int64_t>()}];
    p.dispatch_us = j.at("dispatch_us");
    p.combine_us = j.at("combine_us");
    p.dispatch_steady_us = j.value("dispatch_steady_us", 0.0);
    p.combine_steady_us = j.value("combine_steady_us", 0.0);
    if (nccl) *nccl = j.value("nccl", "");
  }
  return out;
}

// The single-GPU layer on one rank's share (E / R experts, the same k, H, I; T tokens) on GPU 0.
std::map<int64_t, double> share_times(const EpBenchArgs& a, const std::vector<int64_t>& tokens) {
  std::map<int64_t, double> us;
  const WeightFormat f = parse_format(a.format);
  const MoeConfig full = bench_shape(a.shape, f);
  BenchOptions o;
  o.shape = std::to_string(full.num_experts / a.ranks) + "," + std::to_string(full.top_k) + "," +
            std::to_string(full.hidden) + "," + std::to_string(full.intermediate);
  o.format = f;
  o.tokens = tokens;
  o.reps = std::max(5, a.reps / 2);
  o.seed = a.seed;
  Problem p;
  p.cfg = bench_shape(o.shape, f);
  p.tokens = *std::max_element(tokens.begin(), tokens.end());
  const Decision d = choose_backend(p, DeviceInfo::detect(0), "");
  for (const BenchRow& r : bench_gpu(o, d.chosen->caps().name)) us[r.tokens] = r.layer_us;
  return us;
}

}  // namespace
#endif

int run_ep_bench(const EpBenchArgs& a) {
#ifdef MOEKIT_WITH_CUDA
  EpBenchOptions o;
  o.shape = a.shape;
  o.format = parse_format(a.format);
  o.tokens = parse_int_list(a.tokens, 1, INT64_MAX, "--tokens: ");
  o.ranks = a.ranks;
  o.local_gpus = a.gpus;
  o.payloads = split_list(a.payloads);
  for (const std::string& p : o.payloads)
    MOEKIT_REQUIRE(p == "bf16" || p == "mxfp8" || p == "nvfp4", "--ep-payload: '", p, "' (bf16, mxfp8, nvfp4)");
  MOEKIT_REQUIRE(!o.payloads.empty(), "--ep-payload: none given");
  o.combine = a.combine;
  o.reps = a.reps;
  o.seed = a.seed;
  o.trace = a.trace;
  if (a.rank >= 0) {  // a rank process
    MOEKIT_REQUIRE(a.gpus && !a.threads && !a.out.empty(), "--ep-rank: spawned by bench --ep R --ep-gpus");
    const std::vector<EpBenchRow> rows = bench_ep_process(o, from_hex(a.unique_id), a.rank);
    nlohmann::ordered_json j = nlohmann::ordered_json::array();
    for (const EpBenchRow& r : rows) j.push_back(row_json(r));
    write_file_atomic(a.out, j.dump() + "\n");
    return 0;
  }
  if (!a.json.empty()) check_output_path(a.json, {});
  std::vector<EpBenchRow> rows;
  const bool procs = a.gpus && !a.threads;
  if (procs) {
    std::vector<std::string> base = {exe_path(), "bench", "--ep", std::to_string(a.ranks), "--ep-gpus",
                                     "--shape", a.shape, "--format", a.format, "--tokens", a.tokens,
                                     "--ep-payload", a.payloads, "--ep-combine", a.combine,
                                     "--reps", std::to_string(a.reps), "--seed", std::to_string(a.seed)};
    if (a.trace) base.push_back("--trace");
    const auto per_rank = run_rank_processes(a, base);
    rows = per_rank[0];
    for (size_t r = 1; r < per_rank.size(); ++r)
      for (size_t i = 0; i < rows.size() && i < per_rank[r].size(); ++i) {
        EpBenchRow& row = rows[i];
        const EpBenchRow& q = per_rank[r][i];
        row.dispatch_us = std::max(row.dispatch_us, q.dispatch_us);
        row.dispatch_all_us = std::max(row.dispatch_all_us, q.dispatch_all_us);
        row.experts_us = std::max(row.experts_us, q.experts_us);
        row.combine_us = std::max(row.combine_us, q.combine_us);
        row.layer_us = std::max(row.layer_us, q.layer_us);
        row.dispatch_steady_us = std::max(row.dispatch_steady_us, q.dispatch_steady_us);
        row.combine_steady_us = std::max(row.combine_steady_us, q.combine_steady_us);
        row.layer_steady_us = std::max(row.layer_steady_us, q.layer_steady_us);
        row.trace.insert(row.trace.end(), q.trace.begin(), q.trace.end());
      }
    // The shares of the copy rate, from the slowest rank's times.
    for (EpBenchRow& r : rows) {
      const auto pct = [&](double b, double us) {
        return us > 0 ? 100.0 * b / (us * 1e-6) / (r.copy_tbps * 1e12 * a.ranks) : 0.0;
      };
      r.dispatch_pct = pct(r.dispatch_bytes, r.dispatch_us);
      r.combine_pct = pct(r.combine_bytes, r.combine_us);
    }
  } else {
    rows = bench_ep(o);
  }
  std::map<std::pair<std::string, int64_t>, PeerRow> peer;
  std::string nccl;
  if (a.peer == "torch" && a.gpus) peer = run_all_to_all(a, &nccl);
  std::map<int64_t, double> share;
  const char* parts = std::getenv("MOEKIT_EP_BENCH_PARTS");  // diagnostics: "dispatch" times no layer
  if (a.share && a.gpus && !(parts && std::string(parts) == "dispatch")) share = share_times(a, o.tokens);
  const char* mode = !a.gpus ? "virtual ranks of one GPU"
                     : procs ? "GPUs of this machine, one process each (NCCL communicator from a unique id)"
                             : "GPUs of this machine, one thread each (one NCCL communicator)";
  const char* variant = std::getenv("MOEKIT_EP_DISPATCH");  // read by every group (ep_group.h)
  std::printf("EP on %d %s, %s (%s weights), %s combine rows, %s dispatch; copy bandwidth %.2f TB/s (GPU 0)\n",
              a.ranks, mode, a.shape.c_str(), a.format.c_str(), a.combine.c_str(),
              variant && *variant ? variant : "auto", rows.empty() ? 0.0 : rows[0].copy_tbps);
  std::printf("%7s %8s %6s %8s %8s %8s %8s %8s %8s %8s %8s %7s %8s %8s %6s %8s %8s %6s %8s %6s\n", "payload",
              "tok/rank", "slots", "disp", "disp_st", "d_all", "experts", "comb", "comb_st", "layer", "layer_st",
              "ctas", "a2a_d", "a2a_dst", "x_a2a", "a2a_c", "a2a_cst", "x_a2a", "share", "x_shr");
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const EpBenchRow& r : rows) {
    const auto pit = peer.find({r.payload, r.tokens});
    const PeerRow pr = pit != peer.end() ? pit->second : PeerRow{};
    const auto sit = share.find(r.tokens);
    const double su = sit != share.end() ? sit->second : 0;
    std::printf("%7s %8lld %6lld %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %3d/%-3d %8.1f %8.1f %6.2f %8.1f %8.1f "
                "%6.2f %8.1f %6.3f\n",
                r.payload.c_str(), (long long)r.tokens, (long long)r.slots, r.dispatch_us, r.dispatch_steady_us,
                r.dispatch_all_us, r.experts_us, r.combine_us, r.combine_steady_us, r.layer_us, r.layer_steady_us,
                r.dispatch_ctas, r.combine_ctas, pr.dispatch_us, pr.dispatch_steady_us,
                pr.dispatch_steady_us > 0 ? pr.dispatch_steady_us / r.dispatch_steady_us : 0, pr.combine_us,
                pr.combine_steady_us, pr.combine_steady_us > 0 ? pr.combine_steady_us / r.combine_steady_us : 0, su,
                su > 0 ? r.layer_steady_us / su : 0);
    nlohmann::ordered_json j = row_json(r);
    j["shape"] = a.shape;
    j["format"] = a.format;
    j["mode"] = !a.gpus ? "virtual" : procs ? "processes" : "threads";
    j["a2a_dispatch_us"] = pr.dispatch_us;
    j["a2a_combine_us"] = pr.combine_us;
    j["a2a_dispatch_steady_us"] = pr.dispatch_steady_us;
    j["a2a_combine_steady_us"] = pr.combine_steady_us;
    j["a2a_nccl"] = nccl;
    j["share_layer_us"] = su;
    out.push_back(j);
  }
  for (const EpBenchRow& r : rows)
    for (const std::string& line : r.trace) std::printf("trace %s %lld: %s\n", r.payload.c_str(), (long long)r.tokens, line.c_str());
  std::printf("(us. disp: the exchange kernel after the ranks start together; _st: the steady state, 10 calls (layer:\n"
              " 5) back to back per timed region, per call; d_all: dispatch with the plan, quantize and dequantize;\n"
              " layer: dispatch + experts + combine; each figure the slowest rank's median. a2a: torch\n"
              " all_to_all_single moving the same bytes each way on the same GPUs (bench/ep_all_to_all.py), timed\n"
              " the same two ways; x_a2a = a2a_st / moekit _st. share: the single-GPU layer on one rank's share (E/R\n"
              " experts, the rank's tokens) on GPU 0; x_shr = layer_st / share.)\n");
  if (!a.json.empty()) write_file_atomic(a.json, out.dump(2) + "\n");
  return 0;
#else
  (void)a;
  fail("bench --ep: this binary was built without CUDA");
#endif
}

}  // namespace moekit::cli
