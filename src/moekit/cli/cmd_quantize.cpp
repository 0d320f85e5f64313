// `moekit quantize` and `moekit dequantize` (SPEC section 7).
#include <memory>
#include <string>

#include "moekit/cli/commands.h"
#include "moekit/io/quantize_file.h"

namespace moekit::cli {

Command make_quantize_command() {
  struct Args {
    std::string format, rule = "floor", in, out;
  };
  auto a = std::make_shared<Args>();
  Command c;
  c.setup = [a](CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "quantize",
        "Quantize every F32/BF16 tensor of a safetensors file along its last axis.\n"
        "  mxfp4: NAME_blocks U8 [..., K/32, 16] + NAME_scales U8 [..., K/32]\n"
        "  mxfp8: NAME F8_E4M3 [..., K] + NAME_scale U8 [..., K/32]\n"
        "  nvfp4: NAME U8 [..., K/2] + NAME_scale F8_E4M3 [..., K/16] + NAME_scale_2 F32 []\n"
        "Other tensors are copied unchanged.");
    sub->add_option("--format", a->format, "mxfp4 | mxfp8 | nvfp4")
        ->required()
        ->check(CLI::IsMember({"mxfp4", "mxfp8", "nvfp4"}));
    sub->add_option("--scale-rule", a->rule, "MX shared-exponent rule: floor (OCP) | rceil")
        ->check(CLI::IsMember({"floor", "rceil"}));
    sub->add_option("IN", a->in, "input .safetensors")->required();
    sub->add_option("OUT", a->out, "output .safetensors (written atomically)")->required();
    return sub;
  };
  c.run = [a]() {
    quantize_file(a->in, a->out, parse_format(a->format), parse_scale_rule(a->rule));
    return 0;
  };
  return c;
}

Command make_dequantize_command() {
  struct Args {
    std::string in, out;
  };
  auto a = std::make_shared<Args>();
  Command c;
  c.setup = [a](CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "dequantize",
        "Dequantize the mxfp4 / mxfp8 / nvfp4 tensors of a safetensors file (the layouts that\n"
        "`quantize` writes) to F32 tensors NAME; other tensors are copied unchanged.");
    sub->add_option("IN", a->in, "input .safetensors")->required();
    sub->add_option("OUT", a->out, "output .safetensors (written atomically)")->required();
    return sub;
  };
  c.run = [a]() {
    dequantize_file(a->in, a->out);
    return 0;
  };
  return c;
}

std::vector<Command> all_commands() {
  return {make_quantize_command(), make_dequantize_command(), make_run_command(),
          make_backends_command(), make_demo_command(), make_bench_command(), make_tune_command(),
          make_convert_command()};
}

}  // namespace moekit::cli
