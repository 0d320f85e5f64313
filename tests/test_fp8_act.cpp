// FP8 activations (LayerSpec::activation_dtype = fp8, formats/fp8_act.h) on the CPU:
//   - the quantizer, hand-checked (zero groups, subnormals, values that round to 448, ties, the
//     partial last group, ue8m0 scales at and next to powers of two, NaN/Inf groups) and against
//     an independent nearest-value search over the E4M3 decode table of ../shared/testdata;
//   - the layer: every preset's H, I, k and activation (E cut to 16) x weight format, the cpu
//     backend against reference_layer on the same quantized inputs, and the fp8 error next to the
//     bf16-activation error against the bf16-activation reference on the same data;
//   - awkward sizes (T = 0, 1, 3, -1 ids, experts without tokens, every token on one expert),
//     cpu and cpu_batched bit-identical, the same bits at 1, 2 and 3 threads;
//   - the description: validation, config.json, the oracle serving fp8 on SM90 for MXFP4 / MXFP8
//     weights and refusing the others with its reason,
//     the CLI flags, DeepSeek checkpoints (FP8 V3 and the V4 golden) with fp8 activations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "dsv4_testutil.h"
#include "hf_testutil.h"
#include "moe_testutil.h"
#include "moekit/api/host_runner.h"
#include "moekit/backends/cpu_backend.h"
#include "moekit/bench/bench.h"
#include "moekit/common/error.h"
#include "moekit/experts/reference.h"
#include "moekit/formats/fp8_act.h"
#include "moekit/formats/quantize.h"
#include "moekit/io/safetensors.h"
#include "moekit/model/config.h"
#include "moekit/model/layer_io.h"
#include "moekit/model/model.h"
#include "moekit/model/synthetic.h"
#include "moekit/moekit.hpp"
#include "moekit/oracle/layer_checks.h"
#include "moekit/oracle/oracle.h"
#include "testutil.h"

namespace moekit {
namespace {

void write_text(const std::string& path, const std::string& s) { std::ofstream(path) << s; }
std::string read_text(const std::string& path) {
  std::ostringstream os;
  os << std::ifstream(path).rdbuf();
  return os.str();
}

constexpr ActivationScale kFp32 = ActivationScale::kFp32, kUe8m0 = ActivationScale::kUe8m0;

// One group's codes and scale.
struct Q {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
Q quant(const std::vector<float>& x, ActivationScale r) {
  Q q;
  q.codes.resize(x.size());
  q.scales.resize(size_t(fp8_act_groups(int64_t(x.size()))));
  quantize_row_fp8_act(x.data(), int64_t(x.size()), r, q.codes.data(), q.scales.data());
  return q;
}

TEST(Fp8Act, ZeroGroupHasTheFlooredScaleAndZeroCodes) {
  std::vector<float> x(128, 0.0f);
  x[5] = -0.0f;
  for (ActivationScale r : {kFp32, kUe8m0}) {
    const Q q = quant(x, r);
    EXPECT_EQ(q.scales[0], r == kFp32 ? 1e-4f / 448.0f : std::ldexp(1.0f, -22));  // 1e-4/448 = 2.23e-7
    for (int i = 0; i < 128; ++i) EXPECT_EQ(q.codes[size_t(i)], i == 5 ? 0x80 : 0x00) << i;
  }
  // Below the floor: the floor's scale, so small values lose bits (DeepSeek's act_quant does so).
  std::vector<float> tiny(128, 0.0f);
  tiny[0] = 5e-5f;
  EXPECT_EQ(quant(tiny, kFp32).scales[0], 1e-4f / 448.0f);
  EXPECT_EQ(quant(tiny, kFp32).codes[0], float_to_e4m3(5e-5f / (1e-4f / 448.0f)));
}

// With amax = 448 the scale is 1 (both rules) and the codes are the E4M3 rounding of x itself.
TEST(Fp8Act, RoundsToNearestEvenWithSubnormalsAndTheTop) {
  const std::vector<std::pair<float, uint8_t>> cases = {
      {448.0f, 0x7e},  {440.0f, 0x7e},  {432.0f, 0x7e},  // the midpoint of 416 and 448: even (m = 6)
      {431.0f, 0x7d},  {-448.0f, 0xfe}, {1.0f, 0x38},     {1.0625f, 0x38},  // tie 1 / 1.125: even
      {1.1875f, 0x3a},                                    // tie 1.125 / 1.25: even (m = 2)
      {0x1p-6f, 0x08},                                    // smallest normal
      {0x1p-9f, 0x01},                                    // smallest subnormal
      {0x1p-10f, 0x00},                                   // tie 0 / 2^-9: even (0)
      {0x1.000002p-10f, 0x01},  {0x3p-10f, 0x02},  // tie 1 / 2 x 2^-9: even (2)
      {0x5p-10f, 0x02},                             // tie 2 / 3 x 2^-9: even (2)
      {-0x1p-11f, 0x80},                            // rounds to -0
      {0x7p-9f, 0x07},  {0x1.ep-7f, 0x08},          // 15/16 of 2^-6 rounds up into the normals
  };
  for (ActivationScale r : {kFp32, kUe8m0}) {
    std::vector<float> x(128, 0.0f);
    x[0] = 448.0f;
    for (size_t i = 0; i < cases.size(); ++i) x[i + 1] = cases[i].first;
    const Q q = quant(x, r);
    EXPECT_EQ(q.scales[0], 1.0f);
    for (size_t i = 0; i < cases.size(); ++i)
      EXPECT_EQ(q.codes[i + 1], cases[i].second) << "x = " << cases[i].first;
  }
}

// amax / fp32(amax / 448) can exceed 448 by an ulp: the code is still 448's, never NaN.
TEST(Fp8Act, TheGroupMaximumAlwaysGetsTheTopCode) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  int over = 0;
  for (int i = 0; i < 20000; ++i) {
    const float amax = std::ldexp(mant(rng), int(rng() % 60) - 13);  // above the 1e-4 floor
    const float s = fp8_act_scale(amax, kFp32);
    over += amax / s > 448.0f;
    std::vector<float> x(7, amax * 0.25f);
    x[3] = -amax;
    const Q q = quant(x, kFp32);
    ASSERT_EQ(q.codes[3], 0xfe) << amax;
    ASSERT_EQ(q.scales[0], s);
  }
  EXPECT_GT(over, 0) << "no fp32 scale overshot: the clamp was not exercised";
}

TEST(Fp8Act, Ue8m0ScaleIsThePowerOfTwoAtOrAboveAmaxOver448) {
  for (int j = -20; j <= 100; ++j) {
    const float at = std::ldexp(448.0f, j);  // amax / 448 exactly 2^j
    EXPECT_EQ(fp8_act_scale(at, kUe8m0), std::ldexp(1.0f, j)) << j;
    EXPECT_EQ(fp8_act_scale(std::nextafter(at, INFINITY), kUe8m0), std::ldexp(1.0f, j + 1)) << j;
    EXPECT_EQ(fp8_act_scale(std::nextafter(at, 0.0f), kUe8m0), std::ldexp(1.0f, j)) << j;
  }
  // Exhaustively over positive finite bf16 amax and a sweep of fp32 ones: the smallest power of
  // two p with amax <= 448 p (in double: exact), after the 1e-4 floor.
  auto want = [](float amax) {
    const double a = std::max(double(amax), double(kFp8ActAmaxFloor));
    int e = -160;
    while (a > 448.0 * std::ldexp(1.0, e)) ++e;
    return float(std::ldexp(1.0, e));
  };
  for (uint32_t b = 1; b < 0x7f80; ++b) {
    const float a = bf16_to_float(uint16_t(b));
    ASSERT_EQ(fp8_act_scale(a, kUe8m0), want(a)) << a;
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 100000; ++i) {
    const float a = bits_to_float(uint32_t(rng() % 0x7f000000u));
    ASSERT_EQ(fp8_act_scale(a, kUe8m0), want(a)) << a;
  }
  EXPECT_EQ(fp8_act_scale(FLT_MAX, kUe8m0), std::ldexp(1.0f, 120));
}

TEST(Fp8Act, PartialLastGroupIsScaledAlone) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int64_t K : {1, 3, 64, 127, 129, 130, 200, 2880}) {
    std::vector<float> x(static_cast<size_t>(K));
    for (auto& v : x) v = n(rng);
    x[size_t(K - 1)] = 0.01f * x[size_t(K - 1)];  // a small last group would show a shared scale
    for (ActivationScale r : {kFp32, kUe8m0}) {
      const Q q = quant(x, r);
      ASSERT_EQ(q.scales.size(), size_t((K + 127) / 128));
      // Each group as its own row, the last one padded with zeros to 128: the same codes and scale.
      for (int64_t g = 0; g * 128 < K; ++g) {
        std::vector<float> grp(128, 0.0f);
        const int64_t n_in = std::min<int64_t>(128, K - g * 128);
        std::copy_n(x.begin() + g * 128, n_in, grp.begin());
        const Q p = quant(grp, r);
        EXPECT_EQ(p.scales[0], q.scales[size_t(g)]) << "K " << K << " group " << g;
        for (int64_t i = 0; i < n_in; ++i) ASSERT_EQ(p.codes[size_t(i)], q.codes[size_t(g * 128 + i)]);
      }
    }
  }
}

TEST(Fp8Act, NonFiniteGroupIsNaNAndStaysInItsGroup) {
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    std::vector<float> x(300, 1.0f);
    x[130] = bad;
    const Q q = quant(x, kUe8m0);
    EXPECT_EQ(q.scales[0], 1.0f / 256.0f);  // 1/448 -> 2^-8
    EXPECT_TRUE(std::isnan(q.scales[1]));
    EXPECT_EQ(q.scales[2], 1.0f / 256.0f);
    for (int i = 128; i < 256; ++i) EXPECT_EQ(q.codes[size_t(i)], 0x7f);
    EXPECT_EQ(q.codes[0], 0x78);  // 256 = 2^8
    std::vector<float> y = x;
    round_row_fp8_act(y.data(), 300, kUe8m0);
    EXPECT_EQ(y[0], 1.0f);
    for (int i = 128; i < 256; ++i) ASSERT_TRUE(std::isnan(y[size_t(i)]));
    EXPECT_EQ(y[299], 1.0f);
  }
}

// An independent E4M3 rounding: the nearest value of the decode table made outside the project
// (NumPy + ml_dtypes), ties to the even code, then the same scale.
TEST(Fp8Act, MatchesNearestValueOfTheIndependentDecodeTable) {
  const auto f = SafetensorsFile::open(test::testdata("formats/pub_decode_tables.safetensors"));
  const auto table = test::tensor_as<float>(f, "e4m3", DType::kF32, {256});
  ASSERT_EQ(table.size(), 256u);
  auto nearest = [&](double v) {  // |v| <= 448
    const double a = std::fabs(v);
    int best = 0;
    for (int c = 1; c <= 0x7e; ++c) {
      const double d = std::fabs(table[size_t(c)] - a), db = std::fabs(table[size_t(best)] - a);
      if (d < db || (d == db && (c & 1) == 0)) best = c;
    }
    return uint8_t(std::signbit(v) ? best | 0x80 : best);
  };
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-30, 30);
  for (int row = 0; row < 400; ++row) {
    const int64_t K = 1 + int64_t(rng() % 300);
    std::vector<float> x(static_cast<size_t>(K));
    const float s = std::ldexp(1.0f, mag(rng));
    for (auto& v : x) v = round_bf16(n(rng) * s * (rng() % 8 == 0 ? 1e-3f : 1.0f));
    for (ActivationScale r : {kFp32, kUe8m0}) {
      const Q q = quant(x, r);
      for (int64_t i = 0; i < K; ++i) {
        const float sc = q.scales[size_t(i / 128)];
        const float v = std::clamp(x[size_t(i)] / sc, -448.0f, 448.0f);
        ASSERT_EQ(q.codes[size_t(i)], nearest(v)) << "x " << x[size_t(i)] << " scale " << sc;
      }
    }
  }
}

// The public entry point (and Python's moekit.quantize_activations_fp8) is this quantizer.
TEST(Fp8Act, PublicQuantizerChecksItsTensors) {
  std::vector<float> x(2 * 130);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i) - 100.0f;
  std::vector<uint8_t> codes(x.size());
  std::vector<float> scales(4);
  int64_t xs[2] = {2, 130}, ss[2] = {2, 2};
  DLTensor tx{x.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, xs, nullptr, 0};
  DLTensor tc{codes.data(), {kDLCPU, 0}, 2, {kDLUInt, 8, 1}, xs, nullptr, 0};
  DLTensor ts{scales.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, ss, nullptr, 0};
  ASSERT_TRUE(quantize_activations_fp8(tx, kUe8m0, tc, ts).ok());
  const Q q = quant(std::vector<float>(x.begin() + 130, x.end()), kUe8m0);
  EXPECT_TRUE(std::equal(q.codes.begin(), q.codes.end(), codes.begin() + 130));
  EXPECT_EQ(scales[2], q.scales[0]);
  EXPECT_EQ(scales[3], q.scales[1]);
  DLTensor bad = tc;
  bad.dtype = {kDLFloat, 32, 1};
  const Status s = quantize_activations_fp8(tx, kUe8m0, bad, ts);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message.find("codes"), std::string::npos) << s.message;
  int64_t wrong[2] = {2, 1};
  DLTensor short_scales = ts;
  short_scales.shape = wrong;
  EXPECT_FALSE(quantize_activations_fp8(tx, kFp32, tc, short_scales).ok());
}

// ---- the layer --------------------------------------------------------------------------------

MoeModel synthetic_model(MoeConfig c, uint64_t seed = 1) {
  SyntheticOptions o;
  o.seed = seed;
  o.biases = c.act == Activation::kSwigluOai;
  return make_synthetic_model(c, o);
}

LayerOutput run_on(const std::string& backend, const LayerWeights& m, const LayerInput& in) {
  HostRunner r(m, backend);
  LayerOutput out;
  r.run(in, &out);  // its y poisoned before the call (api/host_runner.cpp)
  return out;
}

MoeModel with_activations(const MoeModel& src, ActivationDtype d, ActivationScale s) {
  MoeModel m = synthetic_model(src.cfg);  // same seed: the same weights
  m.cfg.activation_dtype = d;
  m.cfg.activation_scale = s;
  return m;
}

// One preset and weight format: the bf16-activation run and its float64 reference once, then per
// scale rule the fp8 run against float64 on the same quantized inputs and against the bf16 one.
void preset_errors(const std::string& p, WeightFormat f, bool both_cpu_backends) {
  MoeConfig c = bench_shape(p, WeightFormat::kBf16);
  c.format = f;
  // E cut to 8 (time and host memory: 3 tokens reach at most 8 experts), so no group-limited
  // routing (deepseek-v3's 8 groups): the routing does not touch the activations.
  c.num_experts = 8;
  c.n_group = c.topk_group = 1;
  const int64_t T = 3;
  MoeModel m = synthetic_model(c, 17);
  const LayerInputData in = make_synthetic_input(m.cfg, T, 117);
  const LayerOutput b = run_on("cpu", m, in.view());
  const std::vector<double> ref16 = reference_layer(m, in.x.data(), T, b.ids.data(), b.weights.data(), c.top_k);
  const double bf16_err = test::rel_l2_err(test::bf16_to_floats(b.y), ref16);
  for (ActivationScale r : {kFp32, kUe8m0}) {
    SCOPED_TRACE(p + " " + format_name(f) + " " + activation_scale_name(r));
    m.cfg.activation_dtype = ActivationDtype::kFp8;
    m.cfg.activation_scale = r;
    const LayerOutput o = run_on("cpu", m, in.view());
    if (both_cpu_backends) {
      EXPECT_EQ(run_on("cpu_batched", m, in.view()).y, o.y) << "cpu_batched differs from cpu";
    }
    EXPECT_EQ(o.ids, b.ids);
    const std::vector<double> ref8 = reference_layer(m, in.x.data(), T, o.ids.data(), o.weights.data(), c.top_k);
    const std::vector<float> y = test::bf16_to_floats(o.y);
    const double vs_ref = test::rel_l2_err(y, ref8), cost = test::rel_l2_err(y, ref16);
    // The backend computes what the reference computes, in fp32: what is left is y's bf16
    // rounding and rare flips of the intermediate's bf16 / fp8 roundings beside a boundary.
    EXPECT_LE(vs_ref, 3e-3);
    // The cost of fp8 activations: ~4-5e-2 on random data, against bf16's ~1.7e-3.
    EXPECT_LE(cost, 6e-2);
    EXPECT_GT(cost, 5 * bf16_err);
    const std::string key = p + "_" + format_name(f) + "_" + activation_scale_name(r);
    ::testing::Test::RecordProperty(key + "_fp8_vs_fp8ref", test::fmt_e(vs_ref));
    ::testing::Test::RecordProperty(key + "_fp8_vs_bf16ref", test::fmt_e(cost));
    ::testing::Test::RecordProperty(key + "_bf16_vs_bf16ref", test::fmt_e(bf16_err));
    std::printf("fp8 activations %-18s %-6s %-6s rel.L2: vs fp8 ref %.2e | vs bf16-activation ref: fp8 %.2e, bf16 %.2e\n",
                p.c_str(), format_name(f), activation_scale_name(r), vs_ref, cost, bf16_err);
  }
}

// The presets' H, I, k, activation and router, E cut to 8 (host memory and time), 3 tokens; the
// formats their checkpoints come in (MXFP4 for all: the issue's W4A8; FP8 128-blocks where H and I
// allow), every format on qwen3-30b-a3b. The errors are recorded (ctest --output-junit).
class Fp8ActPreset : public ::testing::TestWithParam<const char*> {};
TEST_P(Fp8ActPreset, AgainstFloat64OnTheSameQuantizedInputs) {
  const std::string p = GetParam();
  std::vector<WeightFormat> formats = {WeightFormat::kMxfp4, WeightFormat::kFp8};
  if (p == "qwen3-30b-a3b") formats = {WeightFormat::kMxfp4, WeightFormat::kFp8, WeightFormat::kMxfp8,
                                       WeightFormat::kNvfp4, WeightFormat::kBf16};
  if (p == "gpt-oss-120b") formats = {WeightFormat::kMxfp4};  // 2880 = 22.5 x 128: no FP8 blocks
  for (WeightFormat f : formats) preset_errors(p, f, p == "qwen3-30b-a3b");
}
INSTANTIATE_TEST_SUITE_P(Presets, Fp8ActPreset,
                         ::testing::Values("gpt-oss-120b", "deepseek-v3", "deepseek-v4-flash", "qwen3-30b-a3b"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

MoeConfig small_config(WeightFormat f = WeightFormat::kMxfp4) {
  MoeConfig c;
  c.num_experts = 8;
  c.top_k = 2;
  c.hidden = 320;  // 2 full groups and a partial one of 64
  c.intermediate = 192;  // 1 full group and a partial one of 64
  c.format = f;
  c.act = Activation::kSiluClamped;
  c.swiglu_limit = 0.5f;
  c.norm_topk_prob = true;
  c.activation_dtype = ActivationDtype::kFp8;
  c.activation_scale = kUe8m0;
  return c;
}

void expect_close_to_reference(const LayerWeights& m, const LayerInputData& in, const LayerOutput& out, int k) {
  const std::vector<double> ref = reference_layer(m, in.x.data(), in.tokens, out.ids.data(), out.weights.data(), k);
  ASSERT_EQ(out.y.size(), ref.size());
  if (test::l2(ref) > 0) EXPECT_LE(test::rel_l2_err(test::bf16_to_floats(out.y), ref), 3e-3);
  else
    for (uint16_t v : out.y) EXPECT_EQ(v & 0x7fff, 0);
}

TEST(Fp8ActLayer, AwkwardSizes) {
  const MoeModel m = synthetic_model(small_config());
  const int k = m.cfg.top_k;
  for (int64_t T : {0, 1, 3}) {
    const LayerInputData in = make_synthetic_input(m.cfg, T, 9);
    const LayerOutput a = run_on("cpu", m, in.view()), b = run_on("cpu_batched", m, in.view());
    EXPECT_EQ(a.y.size(), size_t(T * m.cfg.hidden));
    EXPECT_EQ(a.y, b.y);
    expect_close_to_reference(m, in, a, k);
  }
  // Given ids: -1 slots, experts without tokens, every token on one expert.
  const int64_t T = 5;
  LayerInputData in = make_synthetic_input(m.cfg, T, 10);
  in.bypass = true;
  in.k = k;
  in.weights.assign(size_t(T * k), 0.5f);
  for (const std::vector<int32_t>& ids : {std::vector<int32_t>{3, -1, -1, -1, 3, 5, -1, 3, 5, -1},
                                          std::vector<int32_t>{6, -1, 6, -1, 6, -1, 6, -1, 6, -1},
                                          std::vector<int32_t>(10, -1)}) {
    in.ids = ids;
    const LayerOutput a = run_on("cpu", m, in.view()), b = run_on("cpu_batched", m, in.view());
    EXPECT_EQ(a.y, b.y);
    expect_close_to_reference(m, in, a, k);
    for (int64_t t = 0; t < T; ++t)
      if (ids[size_t(t * k)] < 0 && ids[size_t(t * k + 1)] < 0) {
        for (int64_t h = 0; h < m.cfg.hidden; ++h) EXPECT_EQ(a.y[size_t(t * m.cfg.hidden + h)] & 0x7fff, 0);
      }
  }
}

// The activations are what the layer says: bf16 layers keep their bits, fp8 ones differ, and the
// batched entry (the experts alone) quantizes the same way.
TEST(Fp8ActLayer, Bf16StaysBitIdenticalAndFp8IsApplied) {
  MoeConfig c = small_config();
  const MoeModel m8 = synthetic_model(c);
  c.activation_dtype = ActivationDtype::kBf16;
  c.activation_scale = kFp32;
  const MoeModel m16 = synthetic_model(c);
  const LayerInputData in = make_synthetic_input(c, 16, 12);
  const LayerOutput y16 = run_on("cpu", m16, in.view()), y8 = run_on("cpu", m8, in.view());
  EXPECT_NE(y16.y, y8.y);
  // bf16: the reference without any fp8 rounding, to the bf16 rounding.
  const std::vector<double> ref = reference_layer(m16, in.x.data(), 16, y16.ids.data(), y16.weights.data(), c.top_k);
  EXPECT_LE(test::rel_l2_err(test::bf16_to_floats(y16.y), ref), 3e-3);
  // fp32 and ue8m0 scales give different results.
  MoeModel m32 = synthetic_model(c);
  m32.cfg.activation_dtype = ActivationDtype::kFp8;
  EXPECT_NE(run_on("cpu", m32, in.view()).y, y8.y);
}

TEST(Fp8ActLayer, SameBitsAtAnyThreadCount) {
  test::TempDir tmp;
  MoeConfig c = small_config(WeightFormat::kNvfp4);
  c.num_experts = 16;
  c.top_k = 4;
  write_model_dir(synthetic_model(c), tmp / "model");
  write_layer_input(tmp / "in.safetensors", make_synthetic_input(c, 37, 4), c.hidden, c.num_experts);
  std::vector<uint8_t> first;
  for (const char* threads : {"1", "2", "3"}) {
    const test::ScopedEnv env("MOEKIT_THREADS", threads);
    const std::string out = tmp / (std::string("out") + threads + ".safetensors");
    const auto r = test::run_cli("run --model " + tmp.path() + "/model --input " + tmp.path() +
                                 "/in.safetensors --output " + out + " --backend cpu");
    ASSERT_EQ(r.code, 0) << r.out;
    const auto f = SafetensorsFile::open(out);
    const TensorView& y = f.get("y");
    std::vector<uint8_t> bytes(static_cast<const uint8_t*>(y.data), static_cast<const uint8_t*>(y.data) + y.nbytes);
    if (first.empty()) first = bytes;
    else EXPECT_EQ(bytes, first) << threads << " threads";
  }
}

// ---- the description --------------------------------------------------------------------------

TEST(Fp8ActSpec, ValidationNamesAndConfigRoundTrip) {
  MoeConfig c = small_config();
  EXPECT_NO_THROW(validate_spec(c, "spec"));
  EXPECT_NE(describe_spec(c).find("fp8 (ue8m0 scales) activations"), std::string::npos) << describe_spec(c);
  c.activation_dtype = ActivationDtype::kBf16;
  try {
    validate_spec(c, "spec");
    ADD_FAILURE() << "ue8m0 scales on bf16 activations accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("activation_scale = ue8m0 applies to fp8 activations only"), std::string::npos)
        << e.what();
  }
  test::TempDir tmp;
  for (ActivationScale r : {kFp32, kUe8m0}) {
    MoeConfig w = small_config();
    w.activation_scale = r;
    write_text(tmp / "config.json", config_json(w));
    const MoeConfig back = load_config(tmp / "config.json");
    EXPECT_EQ(back.activation_dtype, ActivationDtype::kFp8);
    EXPECT_EQ(back.activation_scale, r);
  }
  MoeConfig b16 = small_config();
  b16.activation_dtype = ActivationDtype::kBf16;
  b16.activation_scale = kFp32;
  EXPECT_EQ(config_json(b16).find("activation_dtype"), std::string::npos) << "bf16 layers' config.json changed";
  for (const char* bad : {R"("activation_dtype": "fp16")", R"("activation_scale": "e8m0")",
                          R"("activation_dtype": "bf16", "activation_scale": "ue8m0")"}) {
    std::string j = config_json(b16);
    j.insert(1, std::string(bad) + ",");
    write_text(tmp / "config.json", j);
    EXPECT_THROW(load_config(tmp / "config.json"), Error) << bad;
  }
}

// The oracle for fp8 layers on a described H200 (no GPU needed) and on the CPU. sm90 and
// sm90_batched serve MXFP4 and MXFP8 weights with either scale kind (the FP8 chain at every token
// count; the plan says so and that the decode kernel is not used); other weights are refused on
// every SM90 backend with a one-line reason naming them; the backends that pin a bf16 kernel
// refuse fp8 and say where it runs. A build without CUDA has no SM90 backends: the CPU part only.
TEST(Fp8ActSpec, OracleServesFp8OnSm90ForMxWeights) {
  DeviceInfo h200;
  h200.gpu = true;
  h200.gpus = 1;
  h200.name = "NVIDIA H200";
  h200.cc_major = 9;
  h200.sm_count = 132;
  const bool sm90_built = find_backend("sm90") != nullptr;
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kMxfp8, WeightFormat::kNvfp4, WeightFormat::kBf16,
                         WeightFormat::kFp8})
    for (ActivationScale rule : {kFp32, kUe8m0}) {
      SCOPED_TRACE(std::string(format_name(f)) + " weights, " + activation_scale_name(rule) + " scales");
      MoeConfig c = small_config(f);
      c.activation_scale = rule;
      const Problem p = Problem::of(c, 64);
      const bool runs = f == WeightFormat::kMxfp4 || f == WeightFormat::kMxfp8;
      for (const Backend* b : all_backends()) {
        const BackendCaps& caps = b->caps();
        SCOPED_TRACE(caps.name);
        const Support s = b->supports(p, caps.needs_sm90 ? h200 : DeviceInfo::cpu());
        const bool fp8 = std::count(caps.activation_dtypes.begin(), caps.activation_dtypes.end(),
                                    ActivationDtype::kFp8) > 0;
        if (!caps.needs_sm90) {
          EXPECT_TRUE(fp8);
          EXPECT_TRUE(s.ok) << s.reason;
          continue;
        }
        const bool crossover = caps.name == "sm90" || caps.name == "sm90_batched";
        EXPECT_EQ(fp8, crossover);
        EXPECT_EQ(s.ok, runs && crossover) << s.reason;
        if (s.ok) continue;
        EXPECT_EQ(s.reason.find('\n'), std::string::npos) << s.reason;
        if (f == WeightFormat::kFp8) continue;  // "no fp8 weights (convert them ...)" comes first
        EXPECT_NE(s.reason.find("no fp8 activations"), std::string::npos) << s.reason;
        const std::string want =
            crossover ? std::string(format_name(f)) + " weights" : "fp8 layers run on sm90 / sm90_batched";
        EXPECT_NE(s.reason.find(want), std::string::npos) << s.reason;
      }
      EXPECT_EQ(choose_backend(p, DeviceInfo::cpu(), "").chosen->caps().name, "cpu");
      if (!sm90_built) continue;
      if (runs) {
        const Decision d = choose_backend(p, h200, "");
        EXPECT_EQ(d.chosen->caps().name, "sm90");
        const std::string text = d.explain(p, h200);
        EXPECT_NE(text.find("the FP8 chain at every token count"), std::string::npos) << text;
        EXPECT_NE(text.find("do not run the decode kernel"), std::string::npos) << text;
        EXPECT_EQ(choose_backend(p, h200, "sm90_batched").chosen->caps().name, "sm90_batched");
        EXPECT_THROW(choose_backend(p, h200, "sm90_decode"), Error);
        EXPECT_THROW(choose_backend(p, h200, "sm90_prefill"), Error);
      } else {
        try {
          choose_backend(p, h200, "");
          ADD_FAILURE() << "an fp8 layer with these weights got a backend on an H200";
        } catch (const Error& e) {
          const std::string want = std::string("fp8 (") + activation_scale_name(rule) + " scales) activations";
          EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
        }
      }
    }
  if (!sm90_built) return;
  // bf16 layers: every SM90 backend as before.
  MoeConfig b16 = small_config();
  b16.activation_dtype = ActivationDtype::kBf16;
  b16.activation_scale = kFp32;
  for (const Backend* b : all_backends())
    if (b->caps().needs_sm90) {
      EXPECT_TRUE(b->supports(Problem::of(b16, 64), h200).ok) << b->caps().name;
    }
}

TEST(Fp8ActCli, RunBackendsAndBenchTakeTheFlags) {
  test::TempDir tmp;
  MoeConfig c = small_config();
  c.activation_dtype = ActivationDtype::kBf16;
  c.activation_scale = kFp32;
  const MoeModel m = synthetic_model(c);
  write_model_dir(m, tmp / "model");
  const LayerInputData in = make_synthetic_input(c, 6, 2);
  write_layer_input(tmp / "in.safetensors", in, c.hidden, c.num_experts);
  const std::string run = "run --model " + tmp.path() + "/model --input " + tmp.path() + "/in.safetensors --output ";
  auto y_of = [](const std::string& path) {
    const auto f = SafetensorsFile::open(path);
    return test::tensor_as<uint16_t>(f, "y", DType::kBF16, {6, 320});
  };
  for (ActivationScale r : {kFp32, kUe8m0}) {
    const std::string out = tmp / (std::string("y_") + activation_scale_name(r) + ".safetensors");
    const auto res = test::run_cli(run + out + " --activations fp8 --activation-scale " + activation_scale_name(r) + " --explain");
    ASSERT_EQ(res.code, 0) << res.out;
    EXPECT_NE(res.out.find(std::string("fp8 (") + activation_scale_name(r) + " scales) activations"), std::string::npos)
        << res.out;
    MoeModel m8 = with_activations(m, ActivationDtype::kFp8, r);
    EXPECT_EQ(y_of(out), run_on("cpu", m8, in.view()).y);
  }
  const auto plain = test::run_cli(run + tmp.path() + "/y16.safetensors");
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_EQ(y_of(tmp / "y16.safetensors"), run_on("cpu", m, in.view()).y);
  // A scale without fp8: bad input (1); an unknown precision: usage (2).
  auto bad = test::run_cli(run + tmp.path() + "/bad.safetensors --activation-scale ue8m0");
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_NE(bad.out.find("--activations fp8"), std::string::npos) << bad.out;
  EXPECT_FALSE(std::filesystem::exists(tmp / "bad.safetensors"));
  EXPECT_EQ(test::run_cli(run + tmp.path() + "/bad.safetensors --activations fp16").code, 2);
  // backends: the reasons with a model; the capability list names each backend's activations.
  const auto be = test::run_cli("backends --model " + tmp.path() + "/model --activations fp8");
  ASSERT_EQ(be.code, 0) << be.out;
  EXPECT_NE(be.out.find("fp8 (fp32 scales) activations"), std::string::npos) << be.out;
  const auto caps = test::run_cli("backends");
  EXPECT_NE(caps.out.find("(activations: bf16,fp8)"), std::string::npos) << caps.out;
  EXPECT_EQ(test::run_cli("backends --activations fp8").code, 1);
  // bench on the CPU: the rows say which activations they ran.
  const auto bench = test::run_cli("bench --backend cpu --shape 8,2,256,128 --format mxfp4 --tokens 3 --reps 1 "
                                   "--activations fp8 --activation-scale ue8m0 --json " + tmp.path() + "/b.json");
  ASSERT_EQ(bench.code, 0) << bench.out;
  EXPECT_NE(bench.out.find("fp8 (ue8m0 scales) activations"), std::string::npos) << bench.out;
  const std::string json = read_text(tmp / "b.json");
  EXPECT_NE(json.find("\"activation_dtype\": \"fp8\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"activation_scale\": \"ue8m0\""), std::string::npos) << json;
}

// DeepSeek-V3's FP8 checkpoint layout (128x128 fp32 block scales) with fp8 activations: the
// model's own numerics (fp8 x fp8), on the CPU, against float64 on the same quantized inputs.
TEST(Fp8ActCheckpoint, DeepSeekFp8CheckpointWithFp8Activations) {
  for (int idx : {1, 5}) {  // deepseek_v3_fp8, qwen3_moe_fp8
    const auto ck = test::build_hf_checkpoint(test::hf_cases()[size_t(idx)]);
    SCOPED_TRACE(ck->c.name);
    MoeModel m = MoeModel::load(ck->path());
    ASSERT_EQ(m.cfg.format, WeightFormat::kFp8);
    for (ActivationScale r : {kFp32, kUe8m0}) {
      m.cfg.activation_dtype = ActivationDtype::kFp8;
      m.cfg.activation_scale = r;
      const LayerInputData in = make_synthetic_input(m.cfg, 9, 21);
      const LayerOutput out = run_on("", m, in.view());
      expect_close_to_reference(m, in, out, m.cfg.top_k);
    }
  }
}

// DeepSeek-V4's checkpoint (tests/golden/dsv4_checkpoint: MXFP4 routed experts, an FP8 128x128
// shared expert) with its own numerics, ue8m0 fp8 activations before every GEMM: routed layer and
// shared expert each against float64 on the same quantized inputs; `moekit run --activations fp8
// --activation-scale ue8m0` gives the library's bits; the fp8 cost against the golden's bf16
// float64 output is recorded.
TEST(Fp8ActCheckpoint, DeepSeekV4GoldenCheckpointWithUe8m0Activations) {
  const std::string dir = test::golden("dsv4_checkpoint/ckpt"), input = test::golden("dsv4_checkpoint/input.safetensors");
  test::TempDir tmp;
  for (int l = 0; l < 2; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    MoeModel m = MoeModel::load(dir, l);
    ASSERT_TRUE(m.has_shared_expert());
    // FP8 weights with e8m0 block scales, held as bf16 exactly (FORMATS.md, DeepSeek-V4's tensors).
    EXPECT_EQ(m.shared_expert.cfg.format, WeightFormat::kBf16);
    for (LayerSpec* c : {&m.cfg, &m.shared_expert.cfg}) {
      c->activation_dtype = ActivationDtype::kFp8;
      c->activation_scale = kUe8m0;
    }
    const LayerInputData in = load_layer_input(input, m.cfg, &m.router);
    const int64_t T = in.tokens, H = m.cfg.hidden;
    // The shared expert alone: one expert, weight 1.
    const std::vector<int32_t> ids1(size_t(T), 0);
    const std::vector<float> w1(size_t(T), 1.0f);
    LayerInputData sin = in;
    sin.bypass = true;
    sin.k = 1;
    sin.ids = ids1;
    sin.weights = w1;
    sin.token_ids.clear();
    const LayerOutput shared = run_on("cpu", m.shared_expert, sin.view());
    expect_close_to_reference(m.shared_expert, sin, shared, 1);
    // The routed layer, then with the shared expert's output added, as `moekit run` does.
    const LayerOutput routed = run_on("cpu", m, in.view());
    expect_close_to_reference(m, in, routed, m.cfg.top_k);
    LayerInput v = in.view();
    v.shared = shared.y.data();
    const LayerOutput both = run_on("cpu", m, v);
    const std::string y = tmp / ("y" + std::to_string(l) + ".safetensors");
    const auto r = test::run_cli("run --model " + dir + " --layer " + std::to_string(l) + " --input " + input +
                                 " --output " + y + " --backend cpu --activations fp8 --activation-scale ue8m0");
    ASSERT_EQ(r.code, 0) << r.out;
    const auto f = SafetensorsFile::open(y);
    EXPECT_EQ(test::tensor_as<uint16_t>(f, "y", DType::kBF16, {T, H}), both.y);
    const SafetensorsFile exp = SafetensorsFile::open(test::golden("dsv4_checkpoint/expected_layer" + std::to_string(l) + ".safetensors"));
    const double cost = test::rel_l2_err(test::bf16_to_floats(both.y), test::tensor_as<float>(exp, "y_ref", DType::kF32, {T, H}));
    RecordProperty("dsv4_layer" + std::to_string(l) + "_fp8_ue8m0_vs_bf16_golden", test::fmt_e(cost));
    std::printf("DeepSeek-V4 golden layer %d, ue8m0 fp8 activations: rel. L2 %.2e from the bf16-activation golden\n", l, cost);
    EXPECT_LE(cost, 6e-2);
  }
}

}  // namespace
}  // namespace moekit
