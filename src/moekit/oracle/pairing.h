// moekit/oracle/pairing.h — the contract between a prepare/finalize and an experts backend on
// the activations' quantization: which quantization the layer's activations carry, and which
// side applies it. SPEC section 6: moving input quantization from the experts to prepare broke
// pairs that assumed the other side did it; here it is a declared property that the oracle
// checks when it pairs the two halves (pair_supports), never a convention.
#pragma once

#include <string>
#include <vector>

#include "moekit/oracle/backend.h"

namespace moekit {

// What a prepare/finalize hands to the experts.
struct PrepareContract {
  std::string name;
  ActivationFormat format = ActivationFormat::kStandard;
  InputQuant quant = InputQuant::kNone;      // the quantization the activations carry
  QuantizeSide side = QuantizeSide::kPrepare;  // who applies it
  // kPrepare: the rows reach the experts as bf16 (the exact dequantization of what was sent),
  // or as codes + scales (the experts must read that quantization).
  bool hands_bf16 = true;
};

const char* input_quant_name(InputQuant q);

// ok, or why the two halves cannot run together: formats differ; the experts cannot read the
// codes prepare hands them; the experts would quantize rows prepare already quantized; or the
// quantization was left to experts that do not apply it.
Support pair_supports(const PrepareContract& pf, const BackendCaps& experts);

}  // namespace moekit
