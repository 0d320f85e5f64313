#include "moekit/oracle/pairing.h"

#include <algorithm>

namespace moekit {

const char* input_quant_name(InputQuant q) {
  switch (q) {
    case InputQuant::kNone: return "none";
    case InputQuant::kMxfp8: return "mxfp8";
    case InputQuant::kNvfp4: return "nvfp4";
  }
  return "?";
}

Support pair_supports(const PrepareContract& pf, const BackendCaps& ex) {
  auto has = [](const std::vector<InputQuant>& v, InputQuant q) { return std::find(v.begin(), v.end(), q) != v.end(); };
  if (pf.format != ex.activation_format)
    return Support::no(pf.name + " produces the " + activation_format_name(pf.format) + " format, " + ex.name +
                       " consumes the " + activation_format_name(ex.activation_format) + " format");
  if (pf.quant == InputQuant::kNone) return Support::yes();
  const std::string q = input_quant_name(pf.quant);
  if (pf.side == QuantizeSide::kExperts) {
    if (!has(ex.quantizes_inputs, pf.quant))
      return Support::no(pf.name + " leaves the " + q + " quantization of the activations to the experts, but " +
                         ex.name + " does not quantize its inputs (quantize in prepare, before sending)");
    return Support::yes();
  }
  if (!pf.hands_bf16 && !has(ex.takes_quantized, pf.quant))
    return Support::no(pf.name + " hands " + q + " codes to the experts, but " + ex.name + " reads bf16 rows only");
  if (pf.hands_bf16 && !ex.quantizes_inputs.empty())
    return Support::no(pf.name + " quantizes the activations to " + q + " already, and " + ex.name +
                       " quantizes its inputs again");
  return Support::yes();
}

}  // namespace moekit
