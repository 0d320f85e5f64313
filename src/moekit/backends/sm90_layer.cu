#include "moekit/backends/sm90_layer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "moekit/common/carve.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/common/small_cache.h"
#include "moekit/experts/sm90_fp8_gemm.h"
#include "moekit/experts/sm90_layout.h"
#include "moekit/experts/sm90_moe_gemm.h"
#include "moekit/experts/sm90_prefill_gemm.h"
#include "moekit/formats/kernel_pack.h"
#include "moekit/formats/synthetic_bytes.h"
#include "moekit/oracle/kernel_choice.h"
#include "moekit/oracle/layer_checks.h"
#include "moekit/experts/sm90_fp8_chain.cuh"
#include "moekit/pipeline/kernel_choice_sm90.cuh"
#include "moekit/pipeline/prepare_batched_sm90.cuh"
#include "moekit/pipeline/prepare_finalize_sm90.cuh"

#define MOEKIT_CUDA_CHECK(expr)                                                         \
  do {                                                                                  \
    const cudaError_t err_ = (expr);                                                    \
    if (err_ != cudaSuccess) ::moekit::fail("CUDA error: ", #expr, ": ", cudaGetErrorString(err_), ::moekit::trap::report_suffix()); \
  } while (0)

namespace moekit {

namespace {

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

// Device memory the layer owns (the paths without a caller: benchmarks, tests).
struct DevMem {
  void* p = nullptr;
  DevMem() = default;
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  ~DevMem() { cudaFree(p); }
  void* alloc(size_t bytes) {
    cudaFree(p);
    p = nullptr;
    // Refused with its size named, before cudaMalloc when it exceeds the device's memory.
    size_t free_b = 0, total_b = 0;
    MOEKIT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (bytes > free_b || cudaMalloc(&p, std::max<size_t>(bytes, 1)) != cudaSuccess) {
      cudaGetLastError();
      p = nullptr;
      fail("cannot allocate ", human_bytes(bytes), " of GPU memory (", human_bytes(free_b), " of ",
           human_bytes(total_b), " free)");
    }
    MOEKIT_CUDA_CHECK(cudaMemset(p, 0, std::max<size_t>(bytes, 1)));
    return p;
  }
};

// Geometry of a layer's two converted matrices.
sm90::LayoutDims dims13(const MoeConfig& c) {
  return {.format = c.format, .E = c.num_experts, .N_pad = 2 * sm90::pad_to(c.intermediate, sm90::kAlign),
          .K_pad = sm90::pad_to(c.hidden, sm90::kAlign)};
}
sm90::LayoutDims dims2(const MoeConfig& c) {
  return {.format = c.format, .E = c.num_experts, .N_pad = sm90::pad_to(c.hidden, sm90::kAlign),
          .K_pad = sm90::pad_to(c.intermediate, sm90::kAlign)};
}

// The persistent state: the GEMMs' counters and tickets (decode and prefill kernels), zero
// between launches, and the error flag of the last call. Sized for max_tokens tokens of top_k slots (kmax slots on the own path).
struct State {
  int* counters = nullptr;  // [2 * segs]: one per segment and phase
  int* done1 = nullptr;     // [E * G1]
  int* ticket = nullptr;    // route_plan's CTA ticket
  int* exit_count = nullptr;
  int* task_counter = nullptr;
  int* error = nullptr;
  int* route_error = nullptr;  // hash routing: a token id outside the table (folded into error)
  int* prefill = nullptr;   // the prefill GEMMs': per GEMM a tile counter and an exit count
  int64_t segs = 0;
  int64_t max_rows = 0;     // routed rows (tokens x k) the counters cover

  static int64_t segments(const MoeConfig& c, int64_t max_rows) {
    const int64_t chunks = c.num_experts + (max_rows + sm90::kTokens - 1) / sm90::kTokens;
    return chunks * std::max(dims13(c).groups(), dims2(c).groups());
  }
  void carve(Carve& cv, const MoeConfig& c, int64_t rows) {
    max_rows = rows;
    segs = segments(c, rows);
    counters = cv.take<int>(2 * segs);
    done1 = cv.take<int>(int64_t(c.num_experts) * dims13(c).groups());
    int* misc = cv.take<int>(9);
    ticket = misc;
    exit_count = misc + 1;
    task_counter = misc + 2;
    error = misc + 3;
    prefill = misc + 4;  // 4 ints
    route_error = misc + 8;
  }
  static int64_t bytes(const MoeConfig& c, int64_t rows) {
    Carve cv;
    State s;
    s.carve(cv, c, rows);
    return cv.off;
  }
};

// The flags the convert step finds, stored beside the weights ("meta").
struct Meta {
  uint32_t magic = 0x4d4b3930;  // "MK90"
  uint32_t single13 = 1, single2 = 1;
  uint32_t format = 0;
};
static_assert(sizeof(Meta) == 16, "meta is 16 bytes");

// Names and sizes of the packed buffers (sm90_packed_buffers), and their lookup.
struct PackedList {
  std::vector<BufferDesc> desc;
  explicit PackedList(const MoeConfig& c) {
    const sm90::LayoutDims d[2] = {dims13(c), dims2(c)};
    const char* names[2] = {"w13", "w2"};
    for (int i = 0; i < 2; ++i) {
      const std::string n = names[i];
      desc.push_back({n + ".codes", d[i].code_bytes()});
      if (d[i].scale_bytes() > 0) desc.push_back({n + ".scales", d[i].scale_bytes()});
      if (c.format == WeightFormat::kNvfp4) desc.push_back({n + ".row_scale", d[i].E * d[i].N_pad * 4});
      if (c.biases) desc.push_back({n + ".bias", d[i].E * d[i].N_pad * 4});
    }
    if (c.score_bias) desc.push_back({"score_bias", int64_t(c.num_experts) * 4});
    if (c.hash_vocab > 0) desc.push_back({"hash_table", c.hash_vocab * c.top_k * 4});
    desc.push_back({"meta", int64_t(sizeof(Meta))});
    const int64_t rows = std::max<int64_t>(c.max_tokens, 1) * c.top_k;
    desc.push_back({"state", State::bytes(c, rows)});
  }
  void* get(const std::vector<PackedBuffer>& p, const std::string& name) const {
    for (size_t i = 0; i < desc.size(); ++i)
      if (desc[i].name == name) return p.at(i).data;
    return nullptr;
  }
};

bool ends_with(const std::string& s, const char* tail) {
  const size_t n = std::strlen(tail);
  return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}

// E4M3 bytes (MXFP8 codes, NVFP4 scales) sit in the kernels' E4M3 words (formats/kernel_pack.h):
// each word packs four synthetic bytes, so the values keep synthetic_bytes.h's ranges.
__device__ uint8_t synthetic_kernel_byte(int64_t i, uint64_t seed, SyntheticKind kind) {
  if (kind != SyntheticKind::kE4M3Code && kind != SyntheticKind::kE4M3Scale) return synthetic_byte(i, seed, kind);
  uint8_t c[4];
  for (int q = 0; q < 4; ++q) c[q] = synthetic_byte((i & ~int64_t(3)) + q, seed, kind);
  return uint8_t(pack_e4m3x4(c) >> (8 * (i & 3)));
}

// Random but valid weights on the device (synthetic_bytes.h), in the kernels' layout.
__global__ void fill_synthetic(uint8_t* p, int64_t n, uint64_t seed, SyntheticKind kind) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = synthetic_kernel_byte(i, seed, kind);
}

// A valid hash-routing table (distinct experts per row), as the CPU backend synthesizes it.
__global__ void fill_hash_table(int32_t* t, int64_t n, int k, int E, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    t[i] = synthetic_hash_entry(i, k, E, seed);
}

struct Matrix {
  sm90::LayoutDims dims;
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const float* row_scale = nullptr;
  const float* bias = nullptr;
  bool single_multiply = true;

  int64_t bytes_per_expert() const {
    return dims.E ? (dims.code_bytes() + dims.scale_bytes()) / dims.E : 0;
  }
};

// The prefill GEMMs' tensor maps of activation rows, by (buffer, rows, columns, box rows).
// Encoding one is a driver call on the host, twice per prefill call; calls of one shape on one
// workspace (an engine's steps of equal size, a graph capture, a benchmark) find theirs here. A
// map is a host value (copied into the launch's parameters), so reusing one is always safe.
// Eight entries: four call shapes.
struct RowsMapKey {
  const uint16_t* base = nullptr;
  int64_t rows = 0, cols = 0;
  int box_rows = 0;
  bool operator==(const RowsMapKey& o) const {
    return base == o.base && rows == o.rows && cols == o.cols && box_rows == o.box_rows;
  }
};
using RowsMapCache = SmallCache<RowsMapKey, CUtensorMap, 16>;  // four maps a call (two sizes of box)
cudaError_t rows_map(RowsMapCache& cache, const uint16_t* base, int64_t rows, int64_t cols, int box_rows,
                     CUtensorMap* map) {
  return cache.get({base, rows, cols, box_rows}, map, [&](CUtensorMap* m) {
    return sm90::prefill::make_rows_map(m, base, rows, cols, box_rows);
  });
}

}  // namespace

std::vector<BufferDesc> sm90_packed_buffers(const MoeConfig& c) { return PackedList(c).desc; }

void sm90_pack(const LayerWeights& m, const std::vector<PackedBuffer>& packed, cudaStream_t s) {
  const PackedList L(m.cfg);
  MOEKIT_REQUIRE(packed.size() == L.desc.size(), "sm90 pack: ", packed.size(), " buffers, expected ", L.desc.size());
  // Host copies stay alive until the stream has copied them.
  std::vector<std::vector<uint8_t>> keep;
  auto put = [&](const std::string& name, const void* src, size_t bytes) {
    void* dst = L.get(packed, name);
    if (!dst) return;
    if (src) {
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
    } else {
      MOEKIT_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, s));
    }
  };
  Meta meta;
  meta.format = uint32_t(m.cfg.format);
  // The converted weights live in host memory first: refuse what cannot fit.
  uint64_t host = 0;
  for (const BufferDesc& b : L.desc) host = sat_add(host, uint64_t(b.bytes));
  require_host_memory("sm90: converting the expert weights", host);
  const sm90::ConvertedMatrix cm[2] = {sm90::convert_w13(m), sm90::convert_w2(m)};
  const char* names[2] = {"w13", "w2"};
  for (int i = 0; i < 2; ++i) {
    const std::string n = names[i];
    const sm90::ConvertedMatrix& c = cm[i];
    put(n + ".codes", c.codes.data(), c.codes.size());
    put(n + ".scales", c.scales.data(), c.scales.size());
    put(n + ".row_scale", c.row_scale.data(), c.row_scale.size() * 4);
    const size_t bias_bytes = size_t(c.dims.E * c.dims.N_pad) * 4;
    put(n + ".bias", c.bias.empty() ? nullptr : c.bias.data(), bias_bytes);
    (i == 0 ? meta.single13 : meta.single2) = c.single_multiply ? 1 : 0;
  }
  if (m.cfg.score_bias) put("score_bias", m.score_bias.data(), m.score_bias.size() * 4);
  if (m.cfg.hash_vocab > 0) {
    MOEKIT_REQUIRE(int64_t(m.hash_table.size()) == m.cfg.hash_vocab * m.cfg.top_k, "sm90 pack: the hash table has ",
                   m.hash_table.size(), " entries, expected ", m.cfg.hash_vocab * m.cfg.top_k);
    put("hash_table", m.hash_table.data(), m.hash_table.size() * 4);
  }
  put("meta", &meta, sizeof(meta));
  put("state", nullptr, size_t(L.desc.back().bytes));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
}

void sm90_synthesize(const MoeConfig& c, const std::vector<PackedBuffer>& packed, uint64_t seed, cudaStream_t s) {
  const PackedList L(c);
  MOEKIT_REQUIRE(packed.size() == L.desc.size(), "sm90 synthesize: ", packed.size(), " buffers, expected ",
                 L.desc.size());
  std::vector<float> row_scale;
  for (size_t i = 0; i < L.desc.size(); ++i) {
    const std::string& n = L.desc[i].name;
    uint8_t* p = static_cast<uint8_t*>(packed[i].data);
    const int64_t bytes = L.desc[i].bytes;
    const uint64_t sd = seed + (n.rfind("w2", 0) == 0 ? 7 : 0);
    if (ends_with(n, ".codes")) {
      fill_synthetic<<<1024, 256, 0, s>>>(p, bytes, sd, synthetic_code_kind(c.format));
    } else if (ends_with(n, ".scales")) {
      fill_synthetic<<<1024, 256, 0, s>>>(p, bytes, sd + 1, synthetic_scale_kind(c.format));
    } else if (ends_with(n, ".row_scale")) {
      // The kernel's epilogue scale: 128 * scale_2 (sm90_convert.cpp).
      row_scale.assign(size_t(bytes / 4), 128.0f * kSyntheticScale2);
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(p, row_scale.data(), size_t(bytes), cudaMemcpyHostToDevice, s));
      MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
    } else if (n == "hash_table") {
      fill_hash_table<<<256, 256, 0, s>>>(reinterpret_cast<int32_t*>(p), bytes / 4, c.top_k, c.num_experts, seed);
    } else if (n == "meta") {
      Meta meta;
      meta.format = uint32_t(c.format);
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(p, &meta, sizeof(meta), cudaMemcpyHostToDevice, s));
      MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
    } else {
      MOEKIT_CUDA_CHECK(cudaMemsetAsync(p, 0, size_t(bytes), s));  // biases, score bias, state
    }
    MOEKIT_CUDA_CHECK(cudaGetLastError());
  }
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
}

struct Sm90Layer::Impl {
  MoeConfig cfg;
  ActivationFormat fmt = ActivationFormat::kStandard;
  Matrix w13, w2;
  const float* score_bias = nullptr;
  const int32_t* hash_table = nullptr;  // [hash_vocab, top_k] (hash routing)
  int64_t H_pad = 0, I_pad = 0;
  int sms = 0;
  int grid[2] = {0, 0};  // persistent grid of each GEMM shape (sm90::GemmShape)
  int max_grid = 0;
  double hbm_bytes_per_sm_cycle = 0;  // peak HBM bandwidth over SMs x SM clock (the shape rule)
  // $MOEKIT_GEMM_SHAPE = narrow | wide overrides the choice (experiments, tests).
  std::string shape_override = [] {
    const char* v = std::getenv("MOEKIT_GEMM_SHAPE");
    return std::string(v ? v : "");
  }();
  // Which GEMM kernel runs T tokens: the decode kernel below prefill_from tokens, the prefill
  // kernel from there on (set_prefill_from); -1: never the prefill kernel.
  int64_t prefill_from = -1;
  // The device choice (set_device_choice): calls of band_from <= T < band_to tokens pick the kernel
  // on the device from the plan's counts (kernel_choice_sm90.cuh); stream_ratio 0: never.
  int64_t band_from = 0, band_to = 0;
  double stream_ratio = 0, ratio_slope = 0;  // the ratio at T: stream_ratio_at (kernel_choice.h)
  bool prefill_ok = false;  // the prefill kernel can run these weights (single-multiply scales)
  // fp8 activations (cfg.activation_dtype): every call runs the FP8 chain (experts/sm90_fp8_chain.cuh):
  // quantize where the rows are permuted, FP8 GEMM1, quantize, FP8 GEMM2; neither bf16 kernel.
  bool fp8 = false;
  sm90::fp8::Fp8Chain fp8_chain;
  // Scheduling choice (sm90_moe_gemm.cuh FusedArgs, phase_tasks); $MOEKIT_SLICE_COST overrides
  // it for experiments (docs/perf/log.md).
  int slice_cost = std::max(0, env_int("MOEKIT_SLICE_COST", 4));
  // $MOEKIT_DECODE_ROWS = 8 | 16 | 24 fixes the decode GEMM's chunk rows (experiments); else the rule.
  int chunk_rows_override = env_int("MOEKIT_DECODE_ROWS", 0);
  // $MOEKIT_PREFILL_TILES = small | normal fixes the prefill kernel's variant (experiments, tests;
  // small only where the format has it); else the rule (oracle/kernel_choice.h prefill_small_tiles).
  std::string prefill_tiles_override = [] {
    const char* v = std::getenv("MOEKIT_PREFILL_TILES");
    return std::string(v ? v : "");
  }();
  int parts = 5;  // set_parts: routing, permute, GEMM1, GEMM2, finalize
  int first_part = 1;

  State state;
  size_t partial_floats = 0;  // per phase
  RowsMapCache maps;          // the prefill GEMMs' tensor maps
  // A call's launches and the graphs that replay them; $MOEKIT_LAUNCH_GRAPHS=0 launches kernel
  // by kernel (launch_sm90.cuh).
  sm90::LaunchList launches;
  sm90::LaunchGraphs graphs{env_int("MOEKIT_LAUNCH_GRAPHS", 1) != 0};

  // Bound for the call being enqueued (workspace pieces and the caller's tensors).
  struct Scratch {
    uint16_t* x_stage = nullptr;  // x rows of stride H_pad, padding columns zero
    uint16_t* act_in = nullptr;   // batched backend: the permuted rows
    uint16_t* act_mid = nullptr;  // GEMM1 output
    float* out2 = nullptr;        // GEMM2 output
    float* partials = nullptr;
    float* one = nullptr;         // batched entry: the rows' weight
    int32_t* ids = nullptr;
    float* weights = nullptr;
    int* choice = nullptr;        // [3] the device choice (kernel_choice_sm90.cuh out[])
    sm90::fp8::Fp8ChainRows fp8;  // fp8 layers: both GEMMs' quantized inputs
  } ws;
  sm90::PlanBuffers plan;
  const uint16_t* x_in = nullptr;  // x rows of stride H_pad as the kernels read them
  int64_t rows = 0;                // activation rows of the call (rows_of)
  int capacity = 0;                // batched rows per expert
  bool batched_entry = false;
  int plan_k = 0;
  int used_k = 0;  // k of the last plan
  int64_t call_T = 0;  // tokens of the last call (kBatched: rows per expert)

  // Own buffers (constructors from weights, reserve()).
  std::vector<std::unique_ptr<DevMem>> owned;
  DevMem state_mem, ws_mem, io_x, io_y, io_logits, io_ids, io_weights, io_tok;
  int64_t own_max_tokens = -1;
  int own_kmax = 0;
  int64_t own_ws_bytes = 0;
  DevMem trace_mem;
  unsigned long long* trace = nullptr;
  size_t trace_n = 0;
  bool tracing = false;

  void* own(size_t bytes) {
    owned.push_back(std::make_unique<DevMem>());
    return owned.back()->alloc(bytes);
  }

  void init_common() {
    H_pad = sm90::pad_to(cfg.hidden, sm90::kAlign);
    I_pad = sm90::pad_to(cfg.intermediate, sm90::kAlign);
    int dev = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    trap::device_record();  // before any capture: the kernels' trap records
    int sm_khz = 0, mem_khz = 0, bus_bits = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
    // Double data rate: two transfers of bus_bits per memory clock.
    if (sm_khz > 0) hbm_bytes_per_sm_cycle = 2.0 * double(mem_khz) * double(bus_bits) / 8.0 / (double(sms) * sm_khz);
    for (auto sh : {sm90::GemmShape::kNarrow, sm90::GemmShape::kWide}) {
      const auto real = sm90::gemm_shape(cfg.format, single_multiply(), sh);
      grid[int(sh)] = sms * sm90::gemm_ctas_per_sm(cfg.format, real);
    }
    max_grid = std::max(grid[0], grid[1]);
    // A sliced phase has at most kMaxSlicedWaves tasks per CTA (sm90_moe_gemm.cuh phase_tasks).
    partial_floats = size_t(max_grid) * sm90::kMaxSlicedWaves * sm90::kPartialFloats;
    prefill_ok = sm90::prefill::prefill_supports(cfg.format, single_multiply(), cfg.num_experts);
    fp8 = cfg.activation_dtype == ActivationDtype::kFp8;
    if (fp8) {
      // The backend refused other weights already (sm90_backend.cu): this is the layer's own check.
      MOEKIT_REQUIRE(sm90::fp8::fp8_supports(cfg.format, cfg.num_experts), "sm90 layer: fp8 activations run on the "
                     "FP8 GEMM, which takes mxfp4 and mxfp8 weights only, not ", format_name(cfg.format));
      prefill_ok = false;  // neither bf16 kernel: no prefill kernel, no device choice
    }
  }

  bool use_prefill(int64_t T) const { return prefill_ok && prefill_from >= 0 && T >= prefill_from; }
  // The device picks the kernel for a call of T tokens on the routed paths (enqueue(); not the
  // batched entry, not the experts alone), with both kernels able to run the weights.
  bool device_choice(int64_t T) const {
    return prefill_ok && ratio_fixed(stream_ratio) > 0 && prefill_from >= 0 && T >= band_from && T < band_to;
  }
  bool choosing = false;  // the last call enqueued has the device choice

  // map, map_big: the tensor maps of the GEMM's activation rows in expert order, 16- and
  // kBigBoxRows-row boxes (make_rows_map).
  sm90::prefill::PrefillArgs prefill_args(bool second, const CUtensorMap& map,
                                          const CUtensorMap& map_big) const {
    const Matrix& w = second ? w2 : w13;
    sm90::prefill::PrefillArgs a{};  // value-initialized, as every launch argument struct here
    a.dims = w.dims;
    a.codes = w.codes;
    a.scales = w.scales;
    a.row_scale = w.row_scale;
    a.bias = w.bias;
    a.in_map = map;
    a.in_map_big = map_big;
    a.work = plan.work();
    a.gemm2 = second;
    a.act = activation_params(cfg);
    a.out_act = ws.act_mid;
    a.out_f32 = ws.out2;
    a.out_cols = cfg.hidden;
    a.row_src = plan.row_src;
    a.topk_weights = batched_entry ? ws.one : plan.weights;
    a.tile_counter = state.prefill + (second ? 2 : 0);
    a.exit_count = state.prefill + (second ? 3 : 1);
    return a;
  }

  void bind_packed(const std::vector<PackedBuffer>& packed, bool read_meta) {
    const PackedList L(cfg);
    MOEKIT_REQUIRE(packed.size() == L.desc.size(), "sm90 layer: ", packed.size(), " packed buffers, expected ",
                   L.desc.size());
    auto u8 = [&](const std::string& n) { return static_cast<const uint8_t*>(L.get(packed, n)); };
    auto f32 = [&](const std::string& n) { return static_cast<const float*>(L.get(packed, n)); };
    w13 = {dims13(cfg), u8("w13.codes"), u8("w13.scales"), f32("w13.row_scale"), f32("w13.bias")};
    w2 = {dims2(cfg), u8("w2.codes"), u8("w2.scales"), f32("w2.row_scale"), f32("w2.bias")};
    score_bias = f32("score_bias");
    hash_table = static_cast<const int32_t*>(L.get(packed, "hash_table"));
    if (read_meta) {
      Meta meta;
      MOEKIT_CUDA_CHECK(cudaMemcpy(&meta, L.get(packed, "meta"), sizeof(meta), cudaMemcpyDeviceToHost));
      MOEKIT_REQUIRE(meta.magic == Meta().magic && meta.format == uint32_t(cfg.format),
                     "sm90 layer: the packed buffers were not packed for this layer (meta)");
      w13.single_multiply = meta.single13 != 0;
      w2.single_multiply = meta.single2 != 0;
    }
    Carve cv{static_cast<uint8_t*>(L.get(packed, "state"))};
    state.carve(cv, cfg, std::max<int64_t>(cfg.max_tokens, 1) * cfg.top_k);
  }

  // Allocates packed buffers of its own; returns them.
  std::vector<PackedBuffer> own_packed() {
    std::vector<PackedBuffer> v;
    for (const BufferDesc& b : PackedList(cfg).desc) v.push_back({own(size_t(b.bytes)), b.bytes});
    return v;
  }

  // Rows of the activation buffers and of the plan for a call.
  int64_t rows_of(ForwardCall::Entry e, int64_t T, int k) const {
    if (e == ForwardCall::kBatched || fmt == ActivationFormat::kBatched) return int64_t(cfg.num_experts) * T;
    return T * k + int64_t(cfg.num_experts) * (sm90::kRowAlign - 1);
  }

  // The workspace of one call, carved from base (or only measured) into w and p.
  int64_t carve_workspace(uint8_t* base, ForwardCall::Entry e, int64_t T, int k, Scratch& w,
                          sm90::PlanBuffers& p) const {
    Carve cv{base};
    const int E = cfg.num_experts;
    const bool batched = e == ForwardCall::kBatched;
    const int64_t N = batched ? 0 : T * k;
    const int64_t rows = rows_of(e, T, k);
    w.x_stage = cv.take<uint16_t>((batched ? E * T : T) * H_pad);
    // x permuted into expert order: the batched backend's GEMMs read it, and the prefill kernel's
    // in both formats.
    const bool permuted = !batched && !fp8 && (fmt == ActivationFormat::kBatched || prefill_from >= 0);
    w.act_in = permuted ? cv.take<uint16_t>(rows * H_pad) : nullptr;
    w.act_mid = cv.take<uint16_t>(rows * I_pad);
    w.out2 = cv.take<float>(rows * cfg.hidden);
    w.partials = fp8 ? nullptr : cv.take<float>(2 * int64_t(partial_floats));  // per phase (the decode kernel's)
    w.one = cv.take<float>(1);
    w.ids = cv.take<int32_t>(N);
    w.weights = cv.take<float>(N);
    p.dest = cv.take<int32_t>(N);
    p.rank = cv.take<int32_t>(N);
    p.row_src = cv.take<int32_t>(rows);
    p.slice_rows = cv.take<int32_t>(sm90::plan_slice_ints(N, E));
    p.set_work(cv.take<int>(sm90::PlanBuffers::work_ints(E)), E);
    p.done = state.ticket;
    p.error = state.error;
    p.route_error = state.route_error;
    w.choice = cv.take<int>(3);
    w.fp8 = {};
    if (fp8) w.fp8.carve(cv, rows, H_pad, I_pad);
    return cv.off;
  }
  int64_t workspace_bytes(ForwardCall::Entry e, int64_t T, int k) const {
    Scratch w;
    sm90::PlanBuffers p;
    return carve_workspace(nullptr, e, T, k, w, p);
  }

  void own_reserve(int64_t T, int k) {
    if (T <= own_max_tokens && k <= own_kmax) return;
    own_max_tokens = std::max<int64_t>(T, 1);
    own_kmax = std::max(k, cfg.top_k);
    const int64_t N = own_max_tokens * own_kmax;
    // The kernel numbers tasks with int: both phases' segments plus the sliced extra.
    const int64_t chunks = cfg.num_experts + (N + sm90::kTokens - 1) / sm90::kTokens;
    MOEKIT_REQUIRE(chunks * (w13.dims.groups() + w2.dims.groups()) + 2 * int64_t(max_grid) * sm90::kMaxSlicedWaves <
                       int64_t(std::numeric_limits<int>::max()) - int64_t(max_grid),
                   "Sm90Layer: ", own_max_tokens, " tokens make too many GEMM tasks; run fewer per call");
    Carve cv{static_cast<uint8_t*>(state_mem.alloc(size_t(State::bytes(cfg, N))))};
    state.carve(cv, cfg, N);
    own_ws_bytes = workspace_bytes(ForwardCall::kLogits, own_max_tokens, own_kmax);
    ws_mem.alloc(size_t(own_ws_bytes));
    io_x.alloc(size_t(own_max_tokens * H_pad) * 2);  // rows padded to H_pad with zeros
    io_y.alloc(size_t(own_max_tokens * cfg.hidden) * 2);
    io_logits.alloc(size_t(own_max_tokens * cfg.num_experts) * 4);
    io_ids.alloc(size_t(N) * 4);
    io_weights.alloc(size_t(N) * 4);
    if (cfg.hash_vocab > 0) io_tok.alloc(size_t(own_max_tokens) * 4);  // int32 token ids
  }

  sm90::GemmArgs gemm_args(bool second, int k) const {
    const Matrix& w = second ? w2 : w13;
    sm90::GemmArgs g{};
    g.dims = w.dims;
    g.codes = w.codes;
    g.scales = w.scales;
    g.row_scale = w.row_scale;
    g.bias = w.bias;
    g.single_multiply = w.single_multiply;
    const bool gather = !second && fmt == ActivationFormat::kStandard && !batched_entry;
    g.in = second ? ws.act_mid : gather || batched_entry ? x_in : ws.act_in;
    g.gather_k = gather ? k : 0;
    g.work = plan.work();
    g.gemm2 = second;
    g.act = activation_params(cfg);
    g.out_act = ws.act_mid;
    g.out_f32 = ws.out2;
    g.out_cols = cfg.hidden;
    g.row_src = plan.row_src;
    g.topk_weights = batched_entry ? ws.one : plan.weights;
    g.partials = ws.partials + (second ? partial_floats : 0);
    g.counters = state.counters + (second ? state.segs : 0);
    return g;
  }

  // Every scale of both matrices in the one-multiply range (what the 4x4 shape requires).
  bool single_multiply() const { return w13.single_multiply && w2.single_multiply; }

  sm90::GemmShape shape_for(int64_t T) const {
    const bool single = single_multiply();
    sm90::GemmShape want;
    const int chunk_rows = chunk_rows_for(T);
    if (chunk_rows == 24) {
      want = sm90::GemmShape::kNarrow;  // the 24-row variant has the narrow shape only
    } else if (shape_override == "wide") {
      want = sm90::GemmShape::kWide;
    } else if (shape_override == "narrow") {
      want = sm90::GemmShape::kNarrow;
    } else {
      sm90::ShapeQuery q;
      q.format = cfg.format;
      q.single_multiply = single;
      q.rows = T * used_k;
      q.hbm_bytes_per_sm_cycle = hbm_bytes_per_sm_cycle;
      q.chunk_rows = chunk_rows;
      want = sm90::choose_gemm_shape(q);
    }
    return sm90::gemm_shape(cfg.format, single, want);
  }

  // Rows per token chunk of the decode GEMM for T tokens (oracle/kernel_choice.h decode_chunk_rows).
  int chunk_rows_for(int64_t T) const {
    const bool single = single_multiply();
    if (chunk_rows_override == 8 || chunk_rows_override == 16 || chunk_rows_override == 24)
      return sm90::gemm_has_chunk_rows(chunk_rows_override, cfg.format, single, cfg.num_experts) ? chunk_rows_override : 8;
    return decode_chunk_rows(cfg.num_experts, T * used_k, single);
  }

  void enqueue_gemms(cudaStream_t s, int64_t T) {
    if (fp8) {
      enqueue_fp8_gemms(s);
      return;
    }
    if (choosing) {
      // Both kernels, each on the active-expert count the device choice left it (the other one's
      // is 0: it returns at once): the decode kernel, then the prefill GEMMs.
      enqueue_decode(s, T, ws.choice);
      enqueue_prefill(s, T, ws.choice + 1);
      return;
    }
    if (use_prefill(T)) {
      enqueue_prefill(s, T, nullptr);
      return;
    }
    enqueue_decode(s, T, nullptr);
  }

  // num_active (optional): the work list's active-expert count replaced (the device choice).
  // Whether the prefill GEMMs of T tokens run the small-tile kernel.
  bool prefill_small(int64_t T) const {
    if (!sm90::prefill::prefill_has_small_tiles(cfg.format)) return false;
    if (prefill_tiles_override == "small") return true;
    if (prefill_tiles_override == "normal") return false;
    static_assert(kSmallTileGroups == sm90::prefill::kSmallGroups, "the rule's tile size is the kernel's");
    const int64_t groups = std::min<int64_t>(w13.dims.groups(), w2.dims.groups());
    return moekit::prefill_small_tiles(cfg.num_experts, T * used_k, groups, sms);
  }

  void enqueue_prefill(cudaStream_t s, int64_t T, const int* num_active) {
    // The activation rows in expert order as tensor maps of this call's buffers (a host-side
    // encoding, cached: no allocation, nothing on the stream): x permuted (or the batched
    // entry's x), GEMM1's output.
    CUtensorMap map_in{}, map_mid{}, big_in{}, big_mid{};
    const uint16_t* in = batched_entry ? x_in : ws.act_in;
    constexpr int kBig = sm90::prefill::kBigBoxRows;
    MOEKIT_CUDA_CHECK(rows_map(maps, in, rows, H_pad, 16, &map_in));
    MOEKIT_CUDA_CHECK(rows_map(maps, ws.act_mid, rows, I_pad, 16, &map_mid));
    MOEKIT_CUDA_CHECK(rows_map(maps, in, rows, H_pad, kBig, &big_in));
    MOEKIT_CUDA_CHECK(rows_map(maps, ws.act_mid, rows, I_pad, kBig, &big_mid));
    // One persistent CTA per SM for each GEMM; GEMM2 waits for GEMM1 through PDL.
    sm90::prefill::PrefillArgs a1 = prefill_args(false, map_in, big_in),
                               a2 = prefill_args(true, map_mid, big_mid);
    if (num_active) a1.work.num_active = a2.work.num_active = num_active;
    const bool small = prefill_small(T);
    MOEKIT_CUDA_CHECK(sm90::prefill::launch_prefill_gemm(a1, sms, s, true, small));
    if (parts > 3) MOEKIT_CUDA_CHECK(sm90::prefill::launch_prefill_gemm(a2, sms, s, true, small));
  }

  // The FP8 chain's view of this call (the plan, the workspace, the input rows).
  sm90::fp8::Fp8ChainCall fp8_call() const {
    sm90::fp8::Fp8ChainCall c;
    c.w13 = {w13.dims, w13.codes, w13.scales, w13.bias};
    c.w2 = {w2.dims, w2.codes, w2.scales, w2.bias};
    c.act = activation_params(cfg);
    c.rule = cfg.activation_scale;
    c.H = cfg.hidden;
    c.I = cfg.intermediate;
    c.work = plan.work();
    c.row_src = plan.row_src;
    c.weights = batched_entry ? ws.one : plan.weights;
    c.work_rows = batched_entry || fmt == ActivationFormat::kBatched;
    c.x = x_in;
    c.x_stride = H_pad;
    c.dest = batched_entry ? nullptr : plan.dest;
    c.T = call_T;
    c.k = used_k;
    c.q = ws.fp8;
    c.mid = ws.act_mid;
    c.out = ws.out2;
    c.counters = state.prefill;  // the prefill GEMMs' counters: an fp8 layer never runs those
    c.grid = sms;
    return c;
  }
  // GEMM1, then (parts > 3) the intermediate quantized and GEMM2, on the quantized input.
  void enqueue_fp8_gemms(cudaStream_t s) {
    const sm90::fp8::Fp8ChainCall c = fp8_call();
    MOEKIT_CUDA_CHECK(fp8_chain.gemm1(c, s, true));
    if (parts > 3) MOEKIT_CUDA_CHECK(fp8_chain.gemm2(c, s, true));
  }

  void enqueue_decode(cudaStream_t s, int64_t T, const int* num_active) {
    const sm90::GemmShape sh = shape_for(T);
    sm90::FusedArgs f{};
    f.g[0] = gemm_args(false, used_k);
    f.g[1] = gemm_args(true, used_k);
    if (num_active) f.g[0].work.num_active = f.g[1].work.num_active = num_active;
    f.nphases = parts > 3 ? 2 : 1;
    f.done1 = state.done1;
    f.exit_count = state.exit_count;
    f.trace = tracing ? trace : nullptr;
    f.task_counter = state.task_counter;
    f.slice_cost = slice_cost;
    f.chunk_rows = chunk_rows_for(T);
    MOEKIT_CUDA_CHECK(sm90::launch_moe_gemm(f, grid[int(sh)], s, true, sh));
  }

  // Where the kernels read x: in place when its rows already have the kernels' stride (and H
  // needs no padding, and bulk copies can start on it), else staged into the workspace.
  bool x_in_place(const ForwardCall& c) const {
    const bool aligned = reinterpret_cast<uintptr_t>(c.x) % 16 == 0;
    const bool rows_ok = c.x_stride == H_pad && cfg.hidden == H_pad;
    return aligned && rows_ok && (c.entry != ForwardCall::kBatched || c.x_expert_stride == c.T * H_pad);
  }

  // One call: its launches recorded, then run as a graph or one by one (launch_sm90.cuh).
  void enqueue(const ForwardCall& c) {
    {
      sm90::RecordLaunches rec(&launches);
      enqueue_launches(c);
    }
    MOEKIT_CUDA_CHECK(graphs.run(launches, static_cast<cudaStream_t>(c.stream)));
  }

  void enqueue_launches(const ForwardCall& c) {
    cudaStream_t s = static_cast<cudaStream_t>(c.stream);
    carve_workspace(static_cast<uint8_t*>(c.workspace), c.entry, c.T, c.k, ws, plan);
    rows = rows_of(c.entry, c.T, c.k);
    batched_entry = c.entry == ForwardCall::kBatched;
    call_T = c.T;
    const int64_t T = c.T;
    const int E = cfg.num_experts;
    choosing = false;
    if (T == 0) return;
    MOEKIT_REQUIRE(batched_entry || T * c.k <= state.max_rows, "Sm90Layer: ", T, " tokens x ", c.k,
                   " slots exceed the state's ", state.max_rows, " rows");
    if (x_in_place(c)) {
      x_in = c.x;
    } else {
      MOEKIT_CUDA_CHECK(sm90::launch_stage_rows(c.x, batched_entry ? E : 1, T, c.x_stride, c.x_expert_stride,
                                                cfg.hidden, H_pad, batched_entry ? c.counts : nullptr, ws.x_stage,
                                                s));
      x_in = ws.x_stage;
    }
    if (batched_entry) {
      capacity = int(T);
      used_k = 1;
      MOEKIT_CUDA_CHECK(sm90::launch_plan_counts(plan, c.counts, E, capacity, state.max_rows, ws.one, s));
      if (fp8) MOEKIT_CUDA_CHECK(fp8_chain.quantize_input(fp8_call(), s, true));  // the counted rows
      enqueue_gemms(s, T);
      MOEKIT_CUDA_CHECK(sm90::launch_store_batched(ws.out2, plan.expert_count, E, T, cfg.hidden, c.y, c.y_stride,
                                                   c.y_expert_stride, s, true));
      return;
    }
    const bool bypass = c.entry == ForwardCall::kTopk;
    plan.ids = bypass || c.routing_out ? c.ids : ws.ids;
    plan.weights = bypass || c.routing_out ? c.weights : ws.weights;
    capacity = int(T);
    sm90::PlanArgs a{};
    a.route.p = routing_params(cfg, {});
    a.route.p.score_bias = score_bias;
    if (hash_table && !bypass) {  // api/ checked that a hash layer's routed calls bring token ids
      MOEKIT_REQUIRE(c.token_ids, "Sm90Layer: a hash-routed layer needs the rows' token ids");
      a.route.p.hash_table = hash_table;
      a.route.p.hash_vocab = cfg.hash_vocab;
      a.route.token_ids = TokenIds{c.token_ids, c.token_ids_wide};
    }
    a.route.logits = c.logits;
    a.bypass = bypass;
    a.T = T;
    a.k = c.k;
    a.batched = fmt == ActivationFormat::kBatched;
    a.capacity = capacity;
    a.b = plan;
    used_k = a.k;
    choosing = device_choice(T);
    if (first_part <= 1) MOEKIT_CUDA_CHECK(sm90::launch_route_plan(a, s, false));
    if (choosing && first_part <= 1) {
      sm90::ChoiceArgs ch{};
      ch.num_active = plan.num_active;
      ch.count = plan.count;
      ch.ratio_q = ratio_fixed(stream_ratio_at(stream_ratio, ratio_slope, prefill_from, T));
      ch.decode_rows = chunk_rows_for(T);
      ch.out = ws.choice;
      MOEKIT_CUDA_CHECK(sm90::launch_kernel_choice(ch, s));
    }
    if (parts < 2) return;
    if (fp8 && first_part <= 2) MOEKIT_CUDA_CHECK(fp8_chain.quantize_input(fp8_call(), s, true));
    if (!fp8 && (fmt == ActivationFormat::kBatched || use_prefill(T) || choosing) && first_part <= 2)
      MOEKIT_CUDA_CHECK(sm90::launch_permute(x_in, T, a.k, cfg.hidden, H_pad, plan.dest, ws.act_in, s, true,
                                             choosing && fmt != ActivationFormat::kBatched ? ws.choice + 2 : nullptr));
    if (parts < 3) return;
    if (first_part <= 4) enqueue_gemms(s, T);
    if (parts < 5) return;
    MOEKIT_CUDA_CHECK(sm90::launch_finalize(ws.out2, plan.dest, T, a.k, cfg.hidden, c.y, s, true, c.y_stride,
                                            c.shared, c.shared_stride));
  }

  // The GEMMs alone on a plan made elsewhere (Sm90Layer::ExpertsCall).
  int64_t carve_experts(uint8_t* base, int64_t rows_, uint16_t** mid = nullptr, float** partials = nullptr) const {
    Carve cv{base};
    uint16_t* m = cv.take<uint16_t>(rows_ * I_pad);
    float* p = cv.take<float>(2 * int64_t(partial_floats));
    if (mid) *mid = m, *partials = p;
    return cv.off;
  }
  void enqueue_experts(const Sm90Layer::ExpertsCall& c, cudaStream_t s) {
    MOEKIT_REQUIRE(c.routed_rows <= state.max_rows, "Sm90Layer: ", c.routed_rows, " routed rows exceed the state's ",
                   state.max_rows);
    MOEKIT_REQUIRE(fmt == ActivationFormat::kBatched, "Sm90Layer: the experts alone need the batched format");
    MOEKIT_REQUIRE(!fp8, "Sm90Layer: the experts alone (expert parallelism) take bf16 rows; no fp8 activations there "
                         "yet");
    uint16_t* mid = nullptr;
    float* partials = nullptr;
    carve_experts(static_cast<uint8_t*>(c.workspace), c.rows, &mid, &partials);
    ws = Scratch{nullptr, const_cast<uint16_t*>(c.in), mid, c.out, partials, nullptr, nullptr, nullptr};
    plan = sm90::PlanBuffers{};
    plan.num_active = const_cast<int*>(c.num_active);
    plan.expert = const_cast<int*>(c.expert);
    plan.count = const_cast<int*>(c.count);
    plan.row_start = const_cast<int*>(c.row_start);
    plan.chunk_prefix = const_cast<int*>(c.chunk_prefix);
    plan.row_src = const_cast<int32_t*>(c.row_src);
    plan.weights = const_cast<float*>(c.weights);
    x_in = c.in;
    rows = c.rows;
    batched_entry = false;
    choosing = false;
    used_k = c.tokens > 0 ? std::max(c.k, 1) : 1;
    if (c.rows > 0) enqueue_gemms(s, c.tokens > 0 ? c.tokens : std::max<int64_t>(1, c.routed_rows));
  }

  // The whole layer on the own buffers (benchmarks, tests).
  void enqueue_own(cudaStream_t s, int64_t T, bool bypass) {
    MOEKIT_REQUIRE(T <= own_max_tokens, "Sm90Layer: ", T, " tokens exceed the reserved ", own_max_tokens);
    ForwardCall c;
    c.entry = bypass ? ForwardCall::kTopk : ForwardCall::kLogits;
    c.T = T;
    c.k = bypass ? plan_k : cfg.top_k;
    c.x = static_cast<const uint16_t*>(io_x.p);
    c.x_stride = H_pad;
    c.logits = static_cast<const float*>(io_logits.p);
    c.token_ids = io_tok.p;  // int32, hash-routed layers only
    c.ids = static_cast<int32_t*>(io_ids.p);
    c.weights = static_cast<float*>(io_weights.p);
    c.routing_out = true;
    c.y = static_cast<uint16_t*>(io_y.p);
    c.y_stride = cfg.hidden;
    c.workspace = ws_mem.p;
    c.stream = s;
    enqueue(c);
  }
};

Sm90Layer::Sm90Layer(const MoeConfig& c, ActivationFormat fmt, const std::vector<PackedBuffer>& packed)
    : impl_(new Impl) {
  impl_->cfg = c;
  impl_->fmt = fmt;
  impl_->bind_packed(packed, true);
  impl_->init_common();
  impl_->plan_k = impl_->used_k = c.top_k;
}

// Allocation failures name what was being allocated (DevMem names how much).
Sm90Layer::Sm90Layer(const LayerWeights& m, ActivationFormat fmt) try : impl_(new Impl) {
  impl_->cfg = m.cfg;
  impl_->cfg.biases = !m.b13.empty() || !m.b2.empty();
  impl_->cfg.score_bias = !m.score_bias.empty();
  impl_->fmt = fmt;
  LayerWeights w = m;
  w.cfg = impl_->cfg;
  const std::vector<PackedBuffer> packed = impl_->own_packed();
  sm90_pack(w, packed, nullptr);
  impl_->bind_packed(packed, true);
  impl_->init_common();
  impl_->plan_k = impl_->used_k = m.cfg.top_k;
} catch (const Error& e) {
  fail("sm90 weights: ", e.what());
}

Sm90Layer::Sm90Layer(const MoeConfig& cfg, ActivationFormat fmt, uint64_t seed) try : impl_(new Impl) {
  validate_spec(cfg, "synthetic layer");
  impl_->cfg = cfg;
  impl_->fmt = fmt;
  const std::vector<PackedBuffer> packed = impl_->own_packed();
  sm90_synthesize(cfg, packed, seed, nullptr);
  impl_->bind_packed(packed, false);  // synthetic scales: single multiply
  impl_->init_common();
  impl_->plan_k = impl_->used_k = cfg.top_k;
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
} catch (const Error& e) {
  fail("sm90 weights: ", e.what());
}

Sm90Layer::~Sm90Layer() = default;

const MoeConfig& Sm90Layer::config() const { return impl_->cfg; }
Sm90WeightStats Sm90Layer::weight_stats() const {
  return {impl_->w13.bytes_per_expert(), impl_->w2.bytes_per_expert()};
}
int64_t Sm90Layer::workspace_bytes(ForwardCall::Entry e, int64_t T, int k) const {
  return impl_->workspace_bytes(e, T, k);
}
void Sm90Layer::enqueue(const ForwardCall& c) { impl_->enqueue(c); }
Sm90Layer::LaunchStats Sm90Layer::launch_stats() const {
  const auto& g = impl_->graphs.stats();
  LaunchStats r{g.graph_launches, g.node_updates, g.builds, g.direct, g.last_updated, {}};
  static_assert(sizeof(r.first_diff) == sizeof(g.first_diff));
  std::memcpy(r.first_diff, g.first_diff, sizeof(r.first_diff));
  return r;
}
int64_t Sm90Layer::experts_workspace_bytes(int64_t rows) const { return impl_->carve_experts(nullptr, rows); }
void Sm90Layer::enqueue_experts(const ExpertsCall& c, cudaStream_t s) { impl_->enqueue_experts(c, s); }
void Sm90Layer::reserve(int64_t max_tokens, int k) {
  try {
    impl_->own_reserve(max_tokens, k);
  } catch (const Error& e) {
    fail("sm90 workspace for ", max_tokens, " tokens x ", k, " slots: ", e.what());
  }
  impl_->plan_k = k;
}
uint16_t* Sm90Layer::x() { return static_cast<uint16_t*>(impl_->io_x.p); }
int64_t Sm90Layer::x_stride() const { return impl_->H_pad; }
float* Sm90Layer::logits() { return static_cast<float*>(impl_->io_logits.p); }
int32_t* Sm90Layer::token_ids() { return static_cast<int32_t*>(impl_->io_tok.p); }
int32_t* Sm90Layer::ids() { return static_cast<int32_t*>(impl_->io_ids.p); }
float* Sm90Layer::weights() { return static_cast<float*>(impl_->io_weights.p); }
uint16_t* Sm90Layer::y() { return static_cast<uint16_t*>(impl_->io_y.p); }
void Sm90Layer::enqueue(cudaStream_t s, int64_t T, bool bypass) { impl_->enqueue_own(s, T, bypass); }
void Sm90Layer::enqueue_gemms(cudaStream_t s, int64_t T) { impl_->enqueue_gemms(s, T); }
std::string Sm90Layer::gemm_shape(int64_t T) const {
  if (impl_->fp8) return "fp8";
  // With the device choice the kernel is known after the call (chosen_kernel): the decode shape here.
  if (impl_->use_prefill(T) && !device_choice(T)) return prefill_name(T);
  return sm90::gemm_cta_name(impl_->cfg.format, impl_->shape_for(T), impl_->chunk_rows_for(T));
}
void Sm90Layer::set_parts(int parts, int first) {
  impl_->parts = std::clamp(parts, 1, 5);
  impl_->first_part = std::clamp(first, 1, impl_->parts);
}
void Sm90Layer::set_prefill_from(int64_t tokens) {
  Impl& m = *impl_;
  m.prefill_from = tokens;
  // Already reserved without the permuted copy of x that the prefill kernel reads: a workspace
  // with it.
  if (m.own_max_tokens >= 0) {
    const int64_t need = m.workspace_bytes(ForwardCall::kLogits, m.own_max_tokens, m.own_kmax);
    if (need > m.own_ws_bytes) m.ws_mem.alloc(size_t(m.own_ws_bytes = need));
  }
}
bool Sm90Layer::prefill_supported() const { return impl_->prefill_ok; }
bool Sm90Layer::fp8_activations() const { return impl_->fp8; }
void Sm90Layer::set_device_choice(int64_t band_from, int64_t band_to, double stream_ratio, double slope) {
  Impl& m = *impl_;
  m.band_from = band_from;
  m.band_to = band_to;
  m.stream_ratio = stream_ratio;
  m.ratio_slope = slope;
}
bool Sm90Layer::device_choice(int64_t T) const { return impl_->device_choice(T); }
int Sm90Layer::chosen_kernel(cudaStream_t s) {
  if (!impl_->choosing) return -1;
  int v = 0;
  MOEKIT_CUDA_CHECK(cudaMemcpyAsync(&v, impl_->ws.choice + 2, 4, cudaMemcpyDeviceToHost, s));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}
bool Sm90Layer::uses_prefill(int64_t T) const { return impl_->use_prefill(T); }
bool Sm90Layer::prefill_small_tiles(int64_t T) const { return impl_->prefill_small(T); }
std::string Sm90Layer::prefill_name(int64_t T) const { return prefill_small_tiles(T) ? "prefill/32" : "prefill"; }

void Sm90Layer::enable_trace(bool on) {
  impl_->tracing = on;
  if (on && !impl_->trace) {
    impl_->trace_n = size_t(impl_->max_grid) * sm90::kTraceStride;
    impl_->trace = static_cast<unsigned long long*>(impl_->trace_mem.alloc(impl_->trace_n * 8));
  }
  // Zeroed for each traced run: the grid depends on the shape, and CTAs that do not run leave
  // no stale stamps.
  if (on) {
    MOEKIT_CUDA_CHECK(cudaMemset(impl_->trace, 0, impl_->trace_n * sizeof(unsigned long long)));
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  }
}
std::vector<unsigned long long> Sm90Layer::trace() {
  std::vector<unsigned long long> v(impl_->trace_n);
  if (!v.empty()) MOEKIT_CUDA_CHECK(cudaMemcpy(v.data(), impl_->trace, v.size() * 8, cudaMemcpyDeviceToHost));
  return v;
}
int Sm90Layer::trace_events() const { return sm90::kTraceEvents; }
int Sm90Layer::trace_stride() const { return sm90::kTraceStride; }
int Sm90Layer::trace_tasks() const { return sm90::kTraceTasks; }
int Sm90Layer::trace_record() const { return sm90::kTraceRecord; }

int Sm90Layer::active_experts(cudaStream_t s) {
  int v = 0;
  MOEKIT_CUDA_CHECK(cudaMemcpyAsync(&v, impl_->plan.num_active, 4, cudaMemcpyDeviceToHost, s));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}
int Sm90Layer::plan_error(cudaStream_t s) {
  int v = 0;
  MOEKIT_CUDA_CHECK(cudaMemcpyAsync(&v, impl_->state.error, 4, cudaMemcpyDeviceToHost, s));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}

}  // namespace moekit
