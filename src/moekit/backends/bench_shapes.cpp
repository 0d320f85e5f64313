// Named problem shapes of `moekit bench`.
#include <climits>
#include <sstream>
#include <vector>

#include "moekit/backends/bench.h"
#include "moekit/common/checked.h"
#include "moekit/common/error.h"

namespace moekit {

MoeConfig bench_shape(const std::string& name, WeightFormat f) {
  MoeConfig c;
  c.format = f;
  c.scoring = Scoring::kSoftmax;
  c.norm_topk_prob = true;
  if (name == "gpt-oss-120b" || name == "gpt-oss-20b") {
    c.num_experts = name == "gpt-oss-120b" ? 128 : 32;
    c.top_k = 4;
    c.hidden = c.intermediate = 2880;
    c.act = Activation::kSwigluOai;
  } else if (name == "deepseek-v3") {
    c.num_experts = 256;
    c.top_k = 8;
    c.hidden = 7168;
    c.intermediate = 2048;
    c.scoring = Scoring::kSigmoid;
    c.n_group = 8;
    c.topk_group = 4;
    c.routed_scaling_factor = 2.5f;
  } else if (name == "qwen3-30b-a3b") {
    c.num_experts = 128;
    c.top_k = 8;
    c.hidden = 2048;
    c.intermediate = 768;
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

}  // namespace moekit
