#include "moekit/io/quantize_file.h"

#include <set>

#include "moekit/common/checked.h"
#include "moekit/common/error.h"
#include "moekit/io/files.h"
#include "moekit/io/safetensors.h"

namespace moekit {

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
std::vector<int64_t> with_last(std::vector<int64_t> shape, std::vector<int64_t> last) {
  shape.pop_back();
  shape.insert(shape.end(), last.begin(), last.end());
  return shape;
}
}  // namespace

void quantize_file(const std::string& in, const std::string& out, WeightFormat f,
                   ScaleRule rule) {
  MOEKIT_REQUIRE(f != WeightFormat::kBf16, "quantize: --format must be mxfp4, mxfp8 or nvfp4");
  check_output_path(out, {in});
  const SafetensorsFile file = SafetensorsFile::open(in);
  SafetensorsWriter w;
  std::set<std::string> names;
  auto claim = [&](const std::string& name, const std::string& from) {
    MOEKIT_REQUIRE(names.insert(name).second, in, ": tensor ", from, ": output name ", name,
                   " collides with another tensor");
  };
  for (const TensorView& t : file.tensors()) {
    if (t.dtype != DType::kF32 && t.dtype != DType::kBF16) {
      claim(t.name, t.name);
      w.add(t.name, t.dtype, t.shape, t.data, t.nbytes);
      continue;
    }
    const std::string what = in + ": tensor " + t.name;
    MOEKIT_REQUIRE(!t.shape.empty(), what, ": a scalar has no axis to quantize along");
    const int64_t K = t.shape.back();
    const int64_t rows = K > 0 ? t.numel() / K : 0;
    const std::vector<float> x = to_float(t, in);
    const QuantizedTensor q = quantize_tensor(x.data(), rows, K, f, rule, what);
    switch (f) {
      case WeightFormat::kMxfp4:
        claim(t.name + "_blocks", t.name);
        claim(t.name + "_scales", t.name);
        w.add(t.name + "_blocks", DType::kU8, with_last(t.shape, {K / 32, 16}), q.codes);
        w.add(t.name + "_scales", DType::kU8, with_last(t.shape, {K / 32}), q.scales);
        break;
      case WeightFormat::kMxfp8:
        claim(t.name, t.name);
        claim(t.name + "_scale", t.name);
        w.add(t.name, DType::kF8E4M3, t.shape, q.codes);
        w.add(t.name + "_scale", DType::kU8, with_last(t.shape, {K / 32}), q.scales);
        break;
      case WeightFormat::kNvfp4:
        claim(t.name, t.name);
        claim(t.name + "_scale", t.name);
        claim(t.name + "_scale_2", t.name);
        w.add(t.name, DType::kU8, with_last(t.shape, {K / 2}), q.codes);
        w.add(t.name + "_scale", DType::kF8E4M3, with_last(t.shape, {K / 16}), q.scales);
        w.add(t.name + "_scale_2", DType::kF32, {}, &q.scale_2, 4);
        break;
      case WeightFormat::kBf16:
      case WeightFormat::kFp8: break;
    }
  }
  w.set_metadata("format", format_name(f));
  if (f != WeightFormat::kNvfp4) w.set_metadata("scale_rule", scale_rule_name(rule));
  w.write(out);
}

void dequantize_file(const std::string& in, const std::string& out) {
  check_output_path(out, {in});
  const SafetensorsFile file = SafetensorsFile::open(in);
  SafetensorsWriter w;
  std::set<std::string> used;
  auto expect_shape = [&](const TensorView& t, const std::vector<int64_t>& shape) {
    MOEKIT_REQUIRE(t.shape == shape, in, ": tensor ", t.name, ": shape ", shape_str(t.shape),
                   ", expected ", shape_str(shape));
  };
  auto emit = [&](const std::string& name, WeightFormat f, const TensorView& codes,
                  const TensorView& scales, float scale_2, std::vector<int64_t> shape) {
    const int64_t K = shape.back();
    MOEKIT_REQUIRE(K % format_block(f) == 0, in, ": tensor ", codes.name, ": K = ", K,
                   " is not a multiple of the ", format_name(f), " block");
    const int64_t rows = K > 0 ? checked_numel(shape) / K : 0;
    // The F32 result and the writer's copy of it must fit in memory.
    require_host_memory(in + ": tensor " + name + " dequantized to F32", sat_mul({rows, K, 8}));
    // Codes and scales that decode to NaN are refused, as at model load.
    if (f == WeightFormat::kMxfp8) require_finite_elements(ElementCode::kE4M3, codes.data, codes.nbytes, in, codes.name);
    require_finite_elements(f == WeightFormat::kNvfp4 ? ElementCode::kE4M3 : ElementCode::kE8M0, scales.data,
                            scales.nbytes, in, scales.name);
    std::vector<float> y(size_t(rows * K));
    dequantize_tensor(f, codes.data, scales.data, scale_2, rows, K, y.data());
    w.add(name, DType::kF32, shape, y);
  };
  for (const TensorView& t : file.tensors()) {
    // mxfp4: NAME_blocks U8 [..., K/32, 16] + NAME_scales U8 [..., K/32]
    if (t.dtype == DType::kU8 && ends_with(t.name, "_blocks")) {
      const std::string name = t.name.substr(0, t.name.size() - 7);
      const TensorView* s = file.find(name + "_scales");
      if (s && s->dtype == DType::kU8) {
        MOEKIT_REQUIRE(t.shape.size() >= 2 && t.shape.back() == 16, in, ": tensor ", t.name,
                       ": shape ", shape_str(t.shape), " is not [..., K/32, 16]");
        std::vector<int64_t> shape(t.shape.begin(), t.shape.end() - 1);
        expect_shape(*s, shape);
        shape.back() *= 32;
        emit(name, WeightFormat::kMxfp4, t, *s, 1.0f, shape);
        used.insert({t.name, s->name});
        continue;
      }
    }
    // mxfp8: NAME F8_E4M3 [..., K] + NAME_scale U8 [..., K/32]
    if (t.dtype == DType::kF8E4M3 && !t.shape.empty()) {
      const TensorView* s = file.find(t.name + "_scale");
      if (s && s->dtype == DType::kU8) {
        MOEKIT_REQUIRE(t.shape.back() % 32 == 0, in, ": tensor ", t.name, ": K = ",
                       t.shape.back(), " is not a multiple of the mxfp8 block (32)");
        expect_shape(*s, with_last(t.shape, {t.shape.back() / 32}));
        emit(t.name, WeightFormat::kMxfp8, t, *s, 1.0f, t.shape);
        used.insert({t.name, s->name});
        continue;
      }
    }
    // nvfp4: NAME U8 [..., K/2] + NAME_scale F8_E4M3 [..., K/16] + NAME_scale_2 F32 []
    if (t.dtype == DType::kU8 && !t.shape.empty()) {
      const TensorView* s = file.find(t.name + "_scale");
      const TensorView* s2 = file.find(t.name + "_scale_2");
      if (s && s->dtype == DType::kF8E4M3 && s2) {
        MOEKIT_REQUIRE(s2->dtype == DType::kF32 && s2->numel() == 1, in, ": tensor ", s2->name,
                       ": expected one F32 value");
        const std::vector<int64_t> shape = with_last(t.shape, {t.shape.back() * 2});
        MOEKIT_REQUIRE(shape.back() % 16 == 0, in, ": tensor ", t.name, ": K = ", shape.back(),
                       " is not a multiple of the nvfp4 block (16)");
        expect_shape(*s, with_last(t.shape, {shape.back() / 16}));
        const std::vector<float> scale_2 = to_float(*s2, in);
        require_positive_scales(scale_2.data(), scale_2.size(), in, s2->name);
        emit(t.name, WeightFormat::kNvfp4, t, *s, scale_2[0], shape);
        used.insert({t.name, s->name, s2->name});
        continue;
      }
    }
  }
  for (const TensorView& t : file.tensors())
    if (!used.count(t.name)) w.add(t.name, t.dtype, t.shape, t.data, t.nbytes);
  w.write(out);
}

}  // namespace moekit
