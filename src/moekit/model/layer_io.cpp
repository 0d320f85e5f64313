#include "moekit/model/layer_io.h"

#include <cmath>
#include <cstring>

#include "moekit/common/bf16.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/io/safetensors.h"
#include "moekit/oracle/layer_checks.h"

namespace moekit {

LayerInput LayerInputData::view() const {
  LayerInput in;
  in.tokens = tokens;
  in.x = x.data();
  in.bypass = bypass;
  in.logits = logits.data();
  in.token_ids = token_ids.empty() ? nullptr : token_ids.data();
  in.ids = ids.data();
  in.weights = weights.data();
  in.k = k;
  return in;
}

namespace {

// router_logits F32 [T, E], finite: required for routing, checked all the same beside topk_ids.
std::vector<float> read_logits(const SafetensorsFile& f, const TensorView& lg, int64_t T, const MoeConfig& cfg) {
  const std::string& path = f.path();
  MOEKIT_REQUIRE(lg.dtype == DType::kF32, path, ": tensor router_logits: dtype ", dtype_name(lg.dtype),
                 ", expected F32");
  MOEKIT_REQUIRE(lg.shape == (std::vector<int64_t>{T, cfg.num_experts}), path, ": tensor router_logits: shape ",
                 shape_str(lg.shape), ", expected [", T, ", ", cfg.num_experts, "]");
  std::vector<float> v = to_float(lg, path);
  for (size_t i = 0; i < v.size(); ++i)
    MOEKIT_REQUIRE(std::isfinite(v[i]), path, ": tensor router_logits: non-finite value at token ",
                   int64_t(i) / cfg.num_experts, ", expert ", int64_t(i) % cfg.num_experts);
  return v;
}

}  // namespace

LayerInputData load_layer_input(const std::string& path, const MoeConfig& cfg, const RouterWeights* router) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  LayerInputData d;
  const TensorView* hs = f.find("hidden_states");
  MOEKIT_REQUIRE(hs, path, ": missing tensor hidden_states (expected [T, ", cfg.hidden, "])");
  MOEKIT_REQUIRE(hs->dtype == DType::kBF16 || hs->dtype == DType::kF32, path,
                 ": tensor hidden_states: dtype ", dtype_name(hs->dtype), ", expected BF16 or F32");
  MOEKIT_REQUIRE(hs->shape.size() == 2 && hs->shape[1] == cfg.hidden, path,
                 ": tensor hidden_states: shape ", shape_str(hs->shape), ", expected [T, ",
                 cfg.hidden, "]");
  d.tokens = hs->shape[0];
  // The input's host copies (fp32 and bf16 x, logits or top-k) and the layer's buffers.
  const int64_t T = d.tokens;
  const uint64_t input_bytes = sat_add(sat_mul({T, cfg.hidden, 4 + 2}), sat_mul({T, cfg.num_experts, 4}));
  require_host_memory(path + ": " + std::to_string(T) + " tokens",
                      sat_add(input_bytes, layer_host_bytes(cfg, T)));
  const std::vector<float> xf = to_float(*hs, path);
  d.x.resize(xf.size());
  for (size_t i = 0; i < xf.size(); ++i) {
    MOEKIT_REQUIRE(std::isfinite(xf[i]), path, ": tensor hidden_states: non-finite value at token ",
                   int64_t(i) / cfg.hidden, ", column ", int64_t(i) % cfg.hidden);
    d.x[i] = float_to_bf16(xf[i]);
    MOEKIT_REQUIRE((d.x[i] & 0x7f80) != 0x7f80, path, ": tensor hidden_states: value ", xf[i], " at token ",
                   int64_t(i) / cfg.hidden, ", column ", int64_t(i) % cfg.hidden,
                   " overflows bf16 (largest finite 3.39e38)");
  }
  if (const TensorView* ti = f.find("input_ids")) {  // token ids: the hash layers route by them
    MOEKIT_REQUIRE(ti->dtype == DType::kI32 || ti->dtype == DType::kI64, path, ": tensor input_ids: dtype ",
                   dtype_name(ti->dtype), ", expected I32 or I64");
    MOEKIT_REQUIRE(ti->shape == (std::vector<int64_t>{d.tokens}), path, ": tensor input_ids: shape ",
                   shape_str(ti->shape), ", expected [", d.tokens, "] (one per row of hidden_states)");
    d.token_ids.resize(size_t(d.tokens));
    for (int64_t t = 0; t < d.tokens; ++t) {
      if (ti->dtype == DType::kI64) {
        std::memcpy(&d.token_ids[size_t(t)], ti->data + 8 * t, 8);
      } else {
        int32_t v;
        std::memcpy(&v, ti->data + 4 * t, 4);
        d.token_ids[size_t(t)] = v;
      }
    }
  }
  const TensorView* ids = f.find("topk_ids");
  const TensorView* w = f.find("topk_weights");
  const TensorView* lg = f.find("router_logits");
  if (ids || w) {
    MOEKIT_REQUIRE(ids && w, path, ": topk_ids and topk_weights must come together");
    MOEKIT_REQUIRE(ids->dtype == DType::kI32, path, ": tensor topk_ids: dtype ",
                   dtype_name(ids->dtype), ", expected I32");
    MOEKIT_REQUIRE(w->dtype == DType::kF32, path, ": tensor topk_weights: dtype ",
                   dtype_name(w->dtype), ", expected F32");
    MOEKIT_REQUIRE(ids->shape.size() == 2 && ids->shape[0] == d.tokens && ids->shape[1] == cfg.top_k, path,
                   ": tensor topk_ids: shape ", shape_str(ids->shape), ", expected [", d.tokens, ", ",
                   cfg.top_k, "] (num_experts_per_tok = ", cfg.top_k, ")");
    MOEKIT_REQUIRE(w->shape == ids->shape, path, ": tensor topk_weights: shape ",
                   shape_str(w->shape), ", expected ", shape_str(ids->shape));
    if (lg) read_logits(f, *lg, d.tokens, cfg);  // unused, but it must be what it claims to be
    d.k = int(ids->shape[1]);
    d.bypass = true;
    d.ids.resize(size_t(ids->numel()));
    if (ids->nbytes > 0) std::memcpy(d.ids.data(), ids->data, ids->nbytes);
    d.weights = to_float(*w, path);
  } else if (!lg && router && !router->empty()) {
    d.logits = router->logits(d.x.data(), d.tokens);  // the checkpoint's router
    for (size_t i = 0; i < d.logits.size(); ++i)
      MOEKIT_REQUIRE(std::isfinite(d.logits[i]), path, ": router logits computed from hidden_states overflow at token ",
                     int64_t(i) / cfg.num_experts, ", expert ", int64_t(i) % cfg.num_experts);
    d.k = cfg.top_k;
  } else {
    MOEKIT_REQUIRE(lg, path, ": missing tensor router_logits (or topk_ids + topk_weights)");
    d.logits = read_logits(f, *lg, d.tokens, cfg);
    d.k = cfg.top_k;
  }
  if (!d.bypass && cfg.hash_vocab > 0)
    MOEKIT_REQUIRE(!d.token_ids.empty() || d.tokens == 0, path,
                   ": missing tensor input_ids (I32 or I64 [", d.tokens, "]): the layer is hash-routed, its experts "
                   "are tid2eid[token id]");
  // The checks every backend runs (duplicate ids, ids out of range, ...), named by this file.
  try {
    LayerInput v = d.view();
    v.check_values = true;
    validate_layer_input(cfg, v);
  } catch (const Error& e) {
    fail(path, ": tensor ", e.what());
  }
  return d;
}

void write_layer_input(const std::string& path, const LayerInputData& in, int64_t H, int E) {
  SafetensorsWriter w;
  w.add("hidden_states", DType::kBF16, {in.tokens, H}, in.x);
  if (!in.token_ids.empty()) w.add("input_ids", DType::kI64, {in.tokens}, in.token_ids);
  if (!in.bypass) {
    w.add("router_logits", DType::kF32, {in.tokens, int64_t(E)}, in.logits);
  } else {
    w.add("topk_ids", DType::kI32, {in.tokens, int64_t(in.k)}, in.ids);
    w.add("topk_weights", DType::kF32, {in.tokens, int64_t(in.k)}, in.weights);
  }
  w.write(path);
}

void write_layer_output(const std::string& path, const LayerOutput& out, int64_t T, int64_t H,
                        int k) {
  SafetensorsWriter w;
  w.add("y", DType::kBF16, {T, H}, out.y);
  w.add("topk_ids", DType::kI32, {T, k}, out.ids);
  w.add("topk_weights", DType::kF32, {T, k}, out.weights);
  w.write(path);
}

}  // namespace moekit
