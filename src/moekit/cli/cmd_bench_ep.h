// moekit/cli/cmd_bench_ep.h — `moekit bench --ep R`: the EP layer on R virtual ranks of one GPU,
// on R GPUs driven by one thread each (--ep-threads), or on R GPUs as R processes, one per GPU, as
// engines run (--ep-gpus, the default there): this process spawns the R rank processes (itself,
// with --ep-rank), gathers their rows and prints the slowest rank's figures; --peer torch runs
// bench/ep_all_to_all.py (torch's all_to_all_single on the same GPUs, the same bytes) in the same
// invocation, and every row is set against the single-GPU layer on one rank's share of the work
// (E / R experts, the rank's tokens) timed on GPU 0.
#pragma once

#include <cstdint>
#include <string>

namespace moekit::cli {

struct EpBenchArgs {
  std::string shape, format, tokens;
  int ranks = 0;
  bool gpus = false;     // --ep-gpus
  bool threads = false;  // --ep-threads: one process, a thread per GPU
  std::string payloads = "bf16";
  std::string combine = "fp32";
  int reps = 50;
  uint64_t seed = 1;
  bool trace = false;
  std::string peer;      // "torch"
  bool share = true;     // time the single-GPU layer on one rank's share
  std::string json;
  // A rank process (spawned by the above): its rank, the hex unique id, the JSON file to write.
  int rank = -1;
  std::string unique_id, out;
  double timeout_s = 900;  // the rank processes', together
};

int run_ep_bench(const EpBenchArgs& a);

}  // namespace moekit::cli
