// Hugging Face checkpoint layers (model/hf_checkpoint.h) through every SM90 backend against the
// CPU backend and the double reference: every published layout, each MoE layer routed by the
// checkpoint's own router from hidden_states alone; DeepSeek FP8 layers after the explicit
// conversions (model/convert.h) the SM90 backends take; a GPT-OSS-20B-shaped layer.
#include <gtest/gtest.h>

#include "../hf_testutil.h"
#include "moekit/model/convert.h"
#include "sm90_testutil.h"

namespace moekit {
namespace {

// hidden_states alone, routed by the checkpoint's router (what `moekit run` computes).
LayerInputData routed_input(const MoeModel& m, int64_t T, uint64_t seed) {
  LayerInputData in = make_synthetic_input(m.cfg, T, seed);
  in.logits = m.router.logits(in.x.data(), T);
  return in;
}

// Every SM90 backend that takes the layer (a kernel may refuse scales off its single-multiply
// path: said, not failed) on the CPU's routing (same experts) against the CPU and the double
// reference; and their own routing picks the same experts.
void check_layer(const MoeModel& m, int64_t T, uint64_t seed) {
  const LayerInputData in = routed_input(m, T, seed);
  const LayerOutput routed = run_backend("cpu", m, in.view());
  const LayerInputData fixed = with_ids(in, routed, m.cfg.top_k);
  const std::vector<double> ref =
      reference_layer(m, in.x.data(), T, routed.ids.data(), routed.weights.data(), m.cfg.top_k);
  EXPECT_LE(rel_l2(to_f32(routed.y), ref), 1e-2);
  int ran = 0;
  for (const char* name : kGpuBackends) {
    SCOPED_TRACE(name);
    const Support s = find_backend(name)->supports(Problem::of(m, T), DeviceInfo::detect());
    if (!s.ok) {
      std::printf("  %s: %s\n", name, s.reason.c_str());
      continue;
    }
    ++ran;
    const LayerOutput gpu = run_backend(name, m, fixed.view());
    EXPECT_LE(rel_l2(to_f32(gpu.y), ref), 1e-2);
    EXPECT_LE(test::rel_l2_err(to_f32(gpu.y), to_f32(routed.y)), 1e-2);
    expect_same_id_sets(run_backend(name, m, in.view()).ids, routed.ids, T, m.cfg.top_k);
  }
  EXPECT_GE(ran, 2) << "the decode backends take every layer";
}

TEST(Checkpoints, EveryLayoutAndLayerOnEverySm90Backend) {
  for (const test::HfCase& c : test::hf_cases()) {
    SCOPED_TRACE(c.name);
    const auto ck = test::build_hf_checkpoint(c);
    for (size_t i = 0; i < ck->layers.size(); ++i) {
      const int layer = c.first_dense + int(i);
      SCOPED_TRACE("layer " + std::to_string(layer));
      const MoeModel m = MoeModel::load(ck->path(), layer);
      if (m.cfg.format == WeightFormat::kFp8) {
        // Not an SM90 format: refused, with the way out named.
        const Support s = find_backend("sm90")->supports(Problem::of(m, 8), DeviceInfo::detect());
        EXPECT_FALSE(s.ok);
        EXPECT_NE(s.reason.find("--convert"), std::string::npos) << s.reason;
        for (WeightFormat to : {WeightFormat::kBf16, WeightFormat::kMxfp8}) {
          SCOPED_TRACE(format_name(to));
          ConvertReport rep;
          const MoeModel conv = convert_layer(m, to, ScaleRule::kRceil, &rep);
          RecordProperty(std::string(c.name) + "_to_" + format_name(to), test::fmt_e(rep.err));
          check_layer(conv, 37, 3 + i);
        }
        continue;
      }
      for (int64_t T : {1, 37, 300}) check_layer(m, T, uint64_t(T) + i);
    }
  }
}

TEST(Checkpoints, GptOss20bShapedLayer) {
  const test::HfCase c{"gpt_oss_20b", "gpt_oss", WeightFormat::kMxfp4, false, 32, 4, 2880, 2880, 1, 0, 2};
  const auto ck = test::build_hf_checkpoint(c, 20);
  const MoeModel m = MoeModel::load(ck->path());
  for (int64_t T : {1, 8, 64, 512}) check_layer(m, T, uint64_t(T));
}

}  // namespace
}  // namespace moekit
