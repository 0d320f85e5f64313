// moekit/bench/bench_ep.h — `moekit bench --ep R`: an expert-parallel layer on R virtual ranks
// of one GPU, or with --ep-gpus on the first R GPUs of this machine (one host thread per GPU, one
// NCCL communicator; synthetic weights, uniform random routing): dispatch, the experts and combine
// timed apart (median over reps, L2 flushed before each; on GPUs of their own the ranks meet at a
// barrier before each rep and a row's figure is the slowest rank's median), with the bytes each
// exchange kernel moves and its share of the copy bandwidth.
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
  std::string payload = "bf16";         // bf16 | mxfp8 | nvfp4
  int reps = 50;
  uint64_t seed = 1;
};

struct EpBenchRow {
  int ranks = 0;
  bool local_gpus = false;
  int64_t tokens = 0;         // per rank
  std::string payload;
  int64_t slots = 0;          // valid (token, expert) slots over all ranks
  double dispatch_us = 0;     // the exchange kernel (all ranks, one launch)
  double dispatch_all_us = 0; // plan + quantize + exchange + dequantize
  double experts_us = 0;      // virtual: every rank's two GEMMs one after the other; GPUs: one rank's
  double combine_us = 0;
  double dispatch_bytes = 0;  // read + written: each slot's row read and stored, plus its meta
  double combine_bytes = 0;   // each slot's fp32 row read, each token's bf16 row written
  double copy_tbps = 0;
  double dispatch_pct = 0, combine_pct = 0;  // of copy_tbps x the GPUs (1 virtual, R local)
  double send_gbps_per_rank = 0;              // one rank's payload rows sent / dispatch_us
};

// Throws when no GPU is present or CUDA was not built.
std::vector<EpBenchRow> bench_ep(const EpBenchOptions& o);

}  // namespace moekit
