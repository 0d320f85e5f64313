// `moekit demo` — the README's main command.
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>

#include "moekit/cli/commands.h"
#include "moekit/formats/quantize.h"

namespace moekit::cli {

Command make_demo_command() {
  Command c;
  c.setup = [](CLI::App& app) {
    return app.add_subcommand("demo", "Quantize and dequantize a random tensor; print errors");
  };
  c.run = []() {
    const int64_t rows = 64, K = 2880;
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x(size_t(rows * K));
    for (float& v : x) v = nd(rng);
    for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kNvfp4, WeightFormat::kMxfp8}) {
      const QuantizedTensor q = quantize_tensor(x.data(), rows, K, f, ScaleRule::kFloor, "demo");
      std::vector<float> y(x.size());
      dequantize_tensor(f, q.codes.data(), q.scales.data(), q.scale_2, rows, K, y.data());
      double num = 0, den = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        num += double(y[i] - x[i]) * (y[i] - x[i]);
        den += double(x[i]) * x[i];
      }
      std::printf("%-6s [%lld x %lld] rel. L2 error %.4f\n", format_name(f), (long long)rows,
                  (long long)K, std::sqrt(num / den));
    }
    return 0;
  };
  return c;
}

std::vector<Command> all_commands() {
  return {make_quantize_command(), make_dequantize_command(), make_demo_command()};
}

}  // namespace moekit::cli
