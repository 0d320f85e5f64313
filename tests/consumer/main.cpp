// The README's C++ example: one MoE layer through the installed library.
#include <moekit/moekit.hpp>

#include <cstdio>
#include <vector>

int main() {
  using namespace moekit;
  const LayerSpec spec{.num_experts = 8, .top_k = 2, .hidden = 512, .intermediate = 256,
                       .format = WeightFormat::kMxfp4, .act = Activation::kSwigluOai,
                       .norm_topk_prob = true, .max_tokens = 16};
  OwnedLayer L;  // plan + packed buffers + Layer; no checkpoint given: synthetic weights
  if (Status s = make_layer(spec, {/* CPU; {kDLCUDA, 0} for an H100 */}, {}, &L); !s.ok())
    return std::fprintf(stderr, "%s\n", s.message.c_str()), 1;
  const int64_t T = 4, H = spec.hidden, E = spec.num_experts;
  std::vector<uint16_t> x(T * H, 0x3f80), y(T * H);  // bf16 1.0
  std::vector<float> logits(T * E, 0.0f);
  std::vector<uint8_t> ws(L.layer->workspace_bytes(T));
  const Status s = L.layer->forward_logits(TensorRef(x.data(), kBF16, {T, H}), TensorRef(logits.data(), kF32, {T, E}),
                                           TensorRef(y.data(), kBF16, {T, H}), TensorRef(ws.data(), kU8, {int64_t(ws.size())}),
                                           /*stream=*/nullptr);
  std::printf("moekit consumer: %s, backend %s, y[0] = 0x%04x\n", s.ok() ? "ok" : s.message.c_str(),
              L.layer->backend().c_str(), y[0]);
  return s.ok() ? 0 : 1;
}
