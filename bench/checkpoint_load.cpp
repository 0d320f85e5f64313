// moekit_checkpoint_load — how fast one MoE layer comes out of a sharded Hugging Face checkpoint,
// and how many of the checkpoint's bytes that touches (docs/perf/notebook.md, "Checkpoints").
//
//   moekit_checkpoint_load write DIR [--shape gpt-oss-120b|gpt-oss-20b|E,k,H,I] [--layers 3] [--shards 4]
//                                    [--input FILE --tokens T]
//       a synthetic GPT-OSS checkpoint (MXFP4 experts with biases, router, stand-ins for the rest),
//       and an input of T tokens of hidden_states alone for `moekit run`
//   moekit_checkpoint_load compare A B
//       rel. L2 difference of the y of two `moekit run` outputs (and how many tokens' expert sets
//       differ)
//   moekit_checkpoint_load load DIR [--layer N] [--backend cpu] [--reps 5]
//       cold: the shards dropped from the page cache (posix_fadvise DONTNEED), the layer loaded
//             and packed once, then the page cache's resident bytes of every shard (mincore):
//             the bytes the load touched, against the layer's own bytes;
//       warm: the same load + pack `reps` times, the median: layer bytes / second;
//       --sm90-convert 1 (a CUDA build): also the SM90 backends' host conversion to their layout.
// "Load + pack" is what `moekit run` does before its first token: config.json, the index and the
// shards' headers, the views of the layer's tensors and their value checks (model/hf_checkpoint.h),
// then HostRunner::prepare: the backend's packed buffers allocated and filled.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "moekit/api/host_runner.h"
#include "moekit/bench/bench.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#ifdef MOEKIT_WITH_CUDA
#include "moekit/experts/sm90_layout.h"
#endif
#include "moekit/io/safetensors_index.h"
#include "moekit/model/hf_config.h"
#include "moekit/model/hf_synthetic.h"
#include "moekit/model/model.h"
#include "moekit/model/synthetic.h"
#include "moekit/oracle/layer_checks.h"

using namespace moekit;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

const char* arg(int argc, char** argv, const char* name, const char* dflt) {
  for (int i = 0; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return dflt;
}

int64_t layer_bytes(const MoeConfig& c) {
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  int64_t b = E * 2 * I * (format_code_bytes(c.format, H) + format_scale_bytes(c.format, H)) +
              E * H * (format_code_bytes(c.format, I) + format_scale_bytes(c.format, I));
  if (c.biases) b += E * (2 * I + H) * 2;  // bf16 in the checkpoint
  return b + int64_t(c.num_experts) * H * 2 + E * 2;  // the router (bf16)
}

// Bytes of `path` in the page cache.
int64_t resident_bytes(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return -1;
  struct stat st;
  fstat(fd, &st);
  const size_t n = size_t(st.st_size);
  void* p = n ? mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0) : nullptr;
  close(fd);
  if (p == MAP_FAILED || !p) return 0;
  const long page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> vec((n + size_t(page) - 1) / size_t(page));
  mincore(p, n, vec.data());
  munmap(p, n);
  int64_t r = 0;
  for (unsigned char v : vec) r += v & 1;
  return r * page;
}

void drop_from_cache(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  fdatasync(fd);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  close(fd);
}

struct Io {
  int64_t read_bytes = 0, rchar = 0;
  long minflt = 0, majflt = 0;
  static Io now() {
    Io io;
    std::ifstream f("/proc/self/io");
    std::string k;
    int64_t v;
    while (f >> k >> v) {
      if (k == "read_bytes:") io.read_bytes = v;
      if (k == "rchar:") io.rchar = v;
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    io.minflt = ru.ru_minflt;
    io.majflt = ru.ru_majflt;
    return io;
  }
};

struct Times {
  double load = 0, pack = 0;
};

Times load_and_pack(const std::string& dir, int layer, const std::string& backend) {
  Times t;
  const double t0 = now_s();
  const MoeModel m = MoeModel::load(dir, layer);
  const double t1 = now_s();
  HostRunner r(m, backend);
  r.prepare(1, m.cfg.top_k);
  t.load = t1 - t0;
  t.pack = now_s() - t1;
  return t;
}

int write_cmd(int argc, char** argv) {
  const std::string dir = argv[2];
  const std::string shape = arg(argc, argv, "--shape", "gpt-oss-120b");
  const int layers = std::atoi(arg(argc, argv, "--layers", "3"));
  const int shards = std::atoi(arg(argc, argv, "--shards", "4"));
  MoeConfig cfg = bench_shape(shape, WeightFormat::kMxfp4);
  cfg.act = Activation::kSwigluOai;
  cfg.norm_topk_prob = true;
  SyntheticOptions so;
  so.biases = true;
  const double t0 = now_s();
  // One layer's weights, written as every layer: each layer's bytes are its own in the files.
  const MoeModel m = make_synthetic_model(cfg, so);
  const RouterWeights r = make_synthetic_router(cfg.num_experts, cfg.hidden, 3, true);
  HfCheckpointOptions opt;
  opt.model_type = "gpt_oss";
  opt.num_layers = layers;
  opt.shards = shards;
  write_hf_checkpoint(dir, opt, std::vector<HfLayerSource>(size_t(layers), HfLayerSource{&m, &r}));
  std::printf("wrote %s: gpt_oss, %d layers of %s (%s each), %d shards, %.1f s\n", dir.c_str(), layers,
              describe_spec(cfg).c_str(), human_bytes(uint64_t(layer_bytes(m.cfg))).c_str(), shards, now_s() - t0);
  if (const char* input = arg(argc, argv, "--input", nullptr)) {
    const int64_t T = std::atoll(arg(argc, argv, "--tokens", "8"));
    const LayerInputData in = make_synthetic_input(cfg, T, 5);
    SafetensorsWriter w;
    w.add("hidden_states", DType::kBF16, {T, int64_t(cfg.hidden)}, in.x);
    w.write(input);
    std::printf("wrote %s: hidden_states [%lld, %d]\n", input, (long long)T, cfg.hidden);
  }
  return 0;
}

int compare_cmd(int argc, char** argv) {
  const SafetensorsFile a = SafetensorsFile::open(argv[2]), b = SafetensorsFile::open(argv[3]);
  const std::vector<float> ya = to_float(a.get("y"), argv[2]), yb = to_float(b.get("y"), argv[3]);
  MOEKIT_REQUIRE(ya.size() == yb.size(), "y: ", ya.size(), " vs ", yb.size(), " values");
  double num = 0, den = 0;
  for (size_t i = 0; i < ya.size(); ++i) num += (double(ya[i]) - yb[i]) * (double(ya[i]) - yb[i]), den += double(yb[i]) * yb[i];
  const TensorView &ia = a.get("topk_ids"), &ib = b.get("topk_ids");
  const int64_t T = ia.shape[0], k = ia.shape[1];
  int64_t differ = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> x(ia.as<int32_t>() + t * k, ia.as<int32_t>() + (t + 1) * k);
    std::vector<int32_t> y(ib.as<int32_t>() + t * k, ib.as<int32_t>() + (t + 1) * k);
    std::sort(x.begin(), x.end());
    std::sort(y.begin(), y.end());
    differ += x != y;
  }
  const double rel = den > 0 ? std::sqrt(num / den) : 0.0;
  std::printf("%s vs %s: rel. L2 of y %.3e, %lld of %lld tokens with other experts\n", argv[2], argv[3], rel,
              (long long)differ, (long long)T);
  (void)argc;
  return rel <= 1e-2 && differ == 0 ? 0 : 1;
}

int load_cmd(int argc, char** argv) {
  const std::string dir = argv[2];
  const int layer = std::atoi(arg(argc, argv, "--layer", "-1"));
  const std::string backend = arg(argc, argv, "--backend", "cpu");
  const int reps = std::max(1, std::atoi(arg(argc, argv, "--reps", "5")));
  const SafetensorsIndex idx = SafetensorsIndex::open(dir);
  const std::vector<std::string> shards = idx.shard_paths();
  int64_t total = 0;
  for (const std::string& s : shards) {
    struct stat st;
    stat(s.c_str(), &st);
    total += st.st_size;
  }
  const MoeConfig cfg = MoeModel::load(dir, layer).cfg;
  const int64_t lb = layer_bytes(cfg);

  // Cold: what the load reads.
  for (const std::string& s : shards) drop_from_cache(s);
  int64_t before = 0;
  for (const std::string& s : shards) before += resident_bytes(s);
  const Io io0 = Io::now();
  const Times cold = load_and_pack(dir, layer, backend);
  const Io io1 = Io::now();
  int64_t touched = 0;
  for (const std::string& s : shards) touched += resident_bytes(s);
  touched -= before;
  std::printf("checkpoint %s: %zu shards, %s; layer %d: %s, %s of tensors\n", dir.c_str(), shards.size(),
              human_bytes(uint64_t(total)).c_str(), layer, describe_spec(cfg).c_str(), human_bytes(uint64_t(lb)).c_str());
  std::printf("cold: load %.3f s + pack (%s) %.3f s; page cache after the drop %s, after the load %s more = %.3fx the "
              "layer's bytes; disk reads %s; major faults %ld, minor %ld\n",
              cold.load, backend.c_str(), cold.pack, human_bytes(uint64_t(before)).c_str(),
              human_bytes(uint64_t(touched)).c_str(), double(touched) / double(lb),
              human_bytes(uint64_t(io1.read_bytes - io0.read_bytes)).c_str(), io1.majflt - io0.majflt,
              io1.minflt - io0.minflt);

  // Warm: the median of reps.
  std::vector<double> load, pack, all;
  for (int i = 0; i < reps; ++i) {
    const Times t = load_and_pack(dir, layer, backend);
    load.push_back(t.load);
    pack.push_back(t.pack);
    all.push_back(t.load + t.pack);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("warm (median of %d): load %.3f s + pack (%s) %.3f s = %.3f s: %.2f GB/s of layer bytes\n", reps,
              median(load), backend.c_str(), median(pack), median(all), double(lb) / median(all) / 1e9);
#ifdef MOEKIT_WITH_CUDA
  // The SM90 backends' host step before their copy to the GPU: the layer in the kernels' layout.
  if (std::strcmp(arg(argc, argv, "--sm90-convert", "0"), "1") == 0) {
    const MoeModel m = MoeModel::load(dir, layer);
    std::vector<double> conv;
    for (int i = 0; i < std::min(reps, 3); ++i) {
      const double t0 = now_s();
      const sm90::ConvertedMatrix a = sm90::convert_w13(m), b = sm90::convert_w2(m);
      conv.push_back(now_s() - t0);
    }
    std::printf("sm90 convert (host, the kernels' layout; median of %zu): %.3f s: %.2f GB/s of layer bytes\n",
                conv.size(), median(conv), double(lb) / median(conv) / 1e9);
  }
#endif
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc >= 3 && std::strcmp(argv[1], "write") == 0) return write_cmd(argc, argv);
    if (argc >= 3 && std::strcmp(argv[1], "load") == 0) return load_cmd(argc, argv);
    if (argc >= 4 && std::strcmp(argv[1], "compare") == 0) return compare_cmd(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moekit_checkpoint_load: error: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr,
               "usage: moekit_checkpoint_load write DIR [--shape S] [--layers N] [--shards N] [--input FILE --tokens T]\n"
               "       moekit_checkpoint_load load DIR [--layer N] [--backend cpu] [--reps N] [--sm90-convert 1]\n"
               "       moekit_checkpoint_load compare OUT_A OUT_B\n");
  return 2;
}
