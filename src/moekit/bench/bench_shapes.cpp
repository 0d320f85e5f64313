// Named problem shapes of `moekit bench` and `moekit tune`: one row per model in kPresets.
#include <climits>
#include <sstream>
#include <vector>

#include "moekit/bench/bench.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/oracle/layer_checks.h"

namespace moekit {

namespace {

// The routed experts of one MoE layer of each model (its config.json): E experts, top-k, hidden
// size H, per-expert intermediate size I, the activation and the router.
struct Preset {
  const char* name;
  int E, k, H, I;
  Activation act;
  Scoring scoring;
  int n_group, topk_group;
  float routed_scaling_factor;
  float swiglu_limit = 7.0f;  // swiglu_oai, silu_clamped
};

constexpr Preset kPresets[] = {
    {"gpt-oss-120b", 128, 4, 2880, 2880, Activation::kSwigluOai, Scoring::kSoftmax, 1, 1, 1.0f},
    {"gpt-oss-20b", 32, 4, 2880, 2880, Activation::kSwigluOai, Scoring::kSoftmax, 1, 1, 1.0f},
    {"deepseek-v3", 256, 8, 7168, 2048, Activation::kSilu, Scoring::kSigmoid, 8, 4, 2.5f},
    {"qwen3-30b-a3b", 128, 8, 2048, 768, Activation::kSilu, Scoring::kSoftmax, 1, 1, 1.0f},
    {"qwen3-235b-a22b", 128, 8, 4096, 1536, Activation::kSilu, Scoring::kSoftmax, 1, 1, 1.0f},
    // Mixtral's softmax over the top-2 logits is a softmax over all experts renormalized over the two.
    {"mixtral-8x7b", 8, 2, 4096, 14336, Activation::kSilu, Scoring::kSoftmax, 1, 1, 1.0f},
    // DeepSeek-V4's learned layers (../shared/notes/deepseek_v4.md; `bench --hash` routes by a
    // tid2eid table instead, as its first layers do); silu_clamped with swiglu_limit 10.
    {"deepseek-v4-pro", 384, 6, 7168, 3072, Activation::kSiluClamped, Scoring::kSqrtSoftplus, 1, 1, 2.5f, 10.0f},
    {"deepseek-v4-flash", 256, 6, 4096, 2048, Activation::kSiluClamped, Scoring::kSqrtSoftplus, 1, 1, 1.5f, 10.0f},
    {"deepseek-v4.1-flash", 384, 6, 5120, 2304, Activation::kSiluClamped, Scoring::kSqrtSoftplus, 1, 1, 1.5f, 10.0f},
};

}  // namespace

std::vector<std::string> bench_shape_names() {
  std::vector<std::string> v;
  for (const Preset& p : kPresets) v.push_back(p.name);
  return v;
}

std::string bench_shape_help() {
  std::string s;
  for (const Preset& p : kPresets) s += std::string(p.name) + " | ";
  return s + "E,k,H,I";
}

MoeConfig bench_shape(const std::string& name, WeightFormat f) {
  MoeConfig c;
  c.format = f;
  c.scoring = Scoring::kSoftmax;
  c.norm_topk_prob = true;
  const Preset* preset = nullptr;
  for (const Preset& p : kPresets)
    if (name == p.name) preset = &p;
  if (preset) {
    c.num_experts = preset->E;
    c.top_k = preset->k;
    c.hidden = preset->H;
    c.intermediate = preset->I;
    c.act = preset->act;
    c.scoring = preset->scoring;
    c.n_group = preset->n_group;
    c.topk_group = preset->topk_group;
    c.routed_scaling_factor = preset->routed_scaling_factor;
    c.swiglu_limit = preset->swiglu_limit;
  } else {
    std::vector<int> v;
    std::stringstream ss(name + ",");  // the trailing comma keeps an empty last item
    std::string item;
    while (std::getline(ss, item, ',')) {
      int64_t x = 0;  // whole numbers only: "8.5" or "8abc" is not 8
      MOEKIT_REQUIRE(parse_whole_int(item, 1, INT_MAX, &x), "bad --shape '", name,
                     "' (expected a known name or E,k,H,I, whole numbers in [1, ", INT_MAX, "])");
      v.push_back(int(x));
    }
    MOEKIT_REQUIRE(v.size() == 4, "bad --shape '", name, "' (expected E,k,H,I)");
    c.num_experts = v[0];
    c.top_k = v[1];
    c.hidden = v[2];
    c.intermediate = v[3];
  }
  validate_spec(c, "--shape " + name);
  return c;
}

MoeConfig bench_config(const BenchOptions& o) {
  MoeConfig c = bench_shape(o.shape, o.format);
  if (o.hash_layer) c.hash_vocab = kBenchHashVocab;
  c.activation_dtype = o.activation_dtype;
  c.activation_scale = o.activation_scale;
  validate_spec(c, "--shape " + o.shape + (o.hash_layer ? " --hash" : ""));
  return c;
}

}  // namespace moekit
