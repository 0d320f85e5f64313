// `moekit convert`: MoE layers of a Hugging Face checkpoint (or a layer directory) as moekit
// layer directories, in their own format or another, with the error of every conversion printed.
#include <chrono>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "moekit/cli/args.h"
#include "moekit/cli/commands.h"
#include "moekit/cli/progress.h"
#include "moekit/common/checked.h"
#include "moekit/io/files.h"
#include "moekit/model/convert.h"
#include "moekit/model/hf_config.h"
#include "moekit/oracle/layer_checks.h"

namespace moekit::cli {

namespace {

int64_t layer_bytes(const MoeConfig& c) {
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  return E * 2 * I * (format_code_bytes(c.format, H) + format_scale_bytes(c.format, H)) +
         E * H * (format_code_bytes(c.format, I) + format_scale_bytes(c.format, I));
}

}  // namespace

Command make_convert_command() {
  struct Args {
    std::string model, out, to, rule = "floor";
    int64_t layer = -1;
    bool all = false;
  };
  auto a = std::make_shared<Args>();
  Command c;
  c.setup = [a](CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "convert",
        "Write MoE layers of a Hugging Face checkpoint directory (or a layer directory) as moekit\n"
        "layer directories (config.json + experts.safetensors, the router included; a hash-routed\n"
        "layer's tid2eid; a DeepSeek-V4 shared expert in OUT/shared_expert): one layer into OUT, or\n"
        "with --all every MoE layer into OUT/layer_N. --to quantizes or converts the routed experts\n"
        "(the rel. L2 error of the new weights against the exact old ones is printed); without it\n"
        "the checkpoint's own format is kept, bytes unchanged.");
    sub->add_option("--model", a->model, "Hugging Face checkpoint directory, or a layer directory")->required();
    CLI::Option* layer = sub->add_option("--layer", a->layer, "MoE layer (default: the first)")->check(whole_int(0, INT_MAX));
    CLI::Option* all = sub->add_flag("--all", a->all, "every MoE layer, into OUT/layer_N");
    layer->excludes(all);
    sub->add_option("--to", a->to, "target weight format (default: keep the checkpoint's)")
        ->check(CLI::IsMember({"mxfp4", "nvfp4", "mxfp8", "bf16"}));
    sub->add_option("--scale-rule", a->rule, "MX shared-exponent rule of --to mxfp4|mxfp8: floor (OCP) | rceil")
        ->check(CLI::IsMember({"floor", "rceil"}));
    sub->add_option("--out", a->out, "output directory")->required();
    return sub;
  };
  c.run = [a]() {
    std::vector<int> layers = {int(a->layer)};
    if (a->all) {
      MOEKIT_REQUIRE(is_hf_checkpoint(a->model), a->model,
                     ": --all converts the MoE layers of a Hugging Face checkpoint directory; this is a layer directory");
      const std::vector<int> moe = load_hf_config(a->model).moe_layers;
      layers.assign(moe.begin(), moe.end());
    }
    const std::vector<std::string> inputs = model_files(a->model);
    auto out_dir = [&](int layer) { return a->all ? a->out + "/layer_" + std::to_string(layer) : a->out; };
    // Before any work: no output may replace an input (a checkpoint converted into itself).
    for (int layer : layers)
      for (const char* f : {"/config.json", "/experts.safetensors", "/shared_expert/config.json",
                            "/shared_expert/experts.safetensors"}) {
        const std::string p = out_dir(layer) + f;
        if (!std::filesystem::exists(std::filesystem::path(p).parent_path())) continue;  // created later
        check_output_path(p, inputs);
      }
    const auto t_all = std::chrono::steady_clock::now();
    for (int layer : layers) {
      const auto t0 = std::chrono::steady_clock::now();
      const MoeModel src = MoeModel::load(a->model, layer);
      const WeightFormat to = a->to.empty() ? src.cfg.format : parse_format(a->to);
      ConvertReport rep;
      const std::string name = src.layer >= 0 ? "layer " + std::to_string(src.layer) : a->model;
      MoeModel dst;
      {
        ProgressBar bar("convert " + name);
        dst = convert_layer(src, to, parse_scale_rule(a->rule), &rep, std::ref(bar));
      }
      const std::string dir = out_dir(src.layer);
      std::vector<std::pair<std::string, std::string>> meta = {{"conversion", rep.describe()}};
      if (!src.source.empty()) meta.push_back({"source", src.source});
      write_layer_dir(dst, dir, meta);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%s: %s; %s -> %s (%s, %.1f s)\n", name.c_str(), describe_spec(src.cfg).c_str(), rep.describe().c_str(),
                  dir.c_str(), human_bytes(uint64_t(layer_bytes(dst.cfg))).c_str(), s);
      for (const std::string& n : src.notes) std::printf("  note: %s\n", n.c_str());
    }
    if (layers.size() > 1)
      std::printf("moekit convert: %zu layers in %.1f s\n", layers.size(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t_all).count());
    return 0;
  };
  return c;
}

}  // namespace moekit::cli
