// moekit/bench/bench_ep.h — `moekit bench --ep R`: an expert-parallel layer (synthetic weights,
// uniform random routing) on R virtual ranks of one GPU, on R GPUs of this machine driven by one
// thread each (one NCCL communicator), or as one rank of R processes (bench_ep_rank; the CLI
// spawns one process per GPU, as engines run): dispatch (the exchange kernel, and with the plan,
// quantization and dequantization), the experts, combine and the whole layer timed apart, with
// the bytes each exchange kernel moves and its share of the copy bandwidth.
// Timing: median over reps; before each rep the L2 is flushed and, on GPUs of their own, the
// ranks meet at a host barrier and then at a one-int NCCL all-reduce on the timed stream, so
// that every rank's timed region starts at about the same moment (an engine's ranks arrive in
// step from the layers before); a row's figure is the slowest rank's median.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/common/spec.h"

namespace moekit {

struct EpBenchOptions {
  std::string shape = "deepseek-v3";
  WeightFormat format = WeightFormat::kNvfp4;
  int ranks = 8;
  bool local_gpus = false;              // ranks on GPUs 0..ranks-1 (else virtual ranks on GPU 0)
  std::vector<int64_t> tokens = {128};  // per rank
  std::vector<std::string> payloads = {"bf16"};  // bf16 | mxfp8 | nvfp4
  std::string combine = "fp32";         // fp32 | bf16 rows
  int reps = 50;
  uint64_t seed = 1;
  bool trace = false;                   // per-CTA phase stamps of one dispatch and combine
};

struct EpBenchRow {
  int ranks = 0;
  bool local_gpus = false;
  int64_t tokens = 0;         // per rank
  std::string payload, combine;
  int64_t slots = 0;          // valid (token, expert) slots over all ranks
  double dispatch_us = 0;     // the exchange kernel (all ranks, one launch)
  double dispatch_all_us = 0; // plan + quantize + exchange + dequantize
  double experts_us = 0;      // virtual: every rank's two GEMMs one after the other; GPUs: one rank's
  double combine_us = 0;
  double layer_us = 0;        // dispatch + experts + combine, timed as one
  // The steady state: 10 dispatches (or combines; 5 layers) back to back in one timed region, per
  // call: the ranks in step as consecutive layers keep them (no arrival skew in the figure).
  double dispatch_steady_us = 0, combine_steady_us = 0, layer_steady_us = 0;
  int dispatch_ctas = 0, combine_ctas = 0;  // CTAs per rank of the two exchange kernels
  double dispatch_bytes = 0;  // read + written: each slot's row read and stored, plus its meta
  double combine_bytes = 0;   // each slot's row read (fp32 or bf16), each token's bf16 row written
  double copy_tbps = 0;
  double dispatch_pct = 0, combine_pct = 0;  // of copy_tbps x the GPUs (1 virtual, R local)
  double send_gbps_per_rank = 0;              // one rank's payload rows sent / dispatch_us
  std::vector<std::string> trace;             // with trace: a line per rank (its phases)
};

// Virtual ranks, or R GPUs driven by threads. Throws when no GPU is present or CUDA was not built.
std::vector<EpBenchRow> bench_ep(const EpBenchOptions& o);
// One rank of o.ranks processes (the calling process's current device; nccl_comm: an ncclComm_t
// of the R processes); every rank calls it with the same options. The rows are this rank's
// medians (the caller takes the slowest rank's).
std::vector<EpBenchRow> bench_ep_rank(const EpBenchOptions& o, void* nccl_comm);
// The whole of one rank's process: device `rank`, a communicator from the unique id (an
// ncclUniqueId of kUniqueIdBytes, comm/nccl_window.h), bench_ep_rank, the communicator freed.
std::vector<EpBenchRow> bench_ep_process(const EpBenchOptions& o, const std::vector<uint8_t>& unique_id, int rank);

}  // namespace moekit
