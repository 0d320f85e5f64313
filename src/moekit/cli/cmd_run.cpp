// `moekit run`, `moekit backends` and `moekit demo`: clients of the public API (moekit.hpp,
// through api/host_runner.h for host data).
#include <algorithm>
#include <climits>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>

#include "moekit/cli/args.h"
#include "moekit/cli/commands.h"
#include "moekit/cli/progress.h"
#include "moekit/api/host_runner.h"
#include "moekit/common/bf16.h"
#include "moekit/common/error.h"
#include "moekit/experts/reference.h"
#include "moekit/io/files.h"
#include "moekit/model/convert.h"
#include "moekit/model/layer_io.h"
#include "moekit/model/synthetic.h"
#include "moekit/moekit.hpp"
#include "moekit/oracle/layer_checks.h"
#include "moekit/oracle/oracle.h"
#include "moekit/oracle/tuning.h"

namespace moekit::cli {

namespace {

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// The model's shared expert (MoeModel::shared_expert) on the input's rows, on the oracle's
// backend for it (FP8 weights with fp32 block scales run on the CPU): its bf16 output, which the
// routed layer adds before its own rounding (api/host_runner.h run_shared_expert).
struct SharedExpert {
  std::unique_ptr<HostRunner> runner;
  std::vector<uint16_t> y;
  const uint16_t* run(const MoeModel& m, const LayerInputData& in) {
    if (!m.has_shared_expert() || in.tokens == 0) return nullptr;
    if (!runner) runner = std::make_unique<HostRunner>(m.shared_expert, "");
    y = run_shared_expert(*runner, in.x.data(), in.tokens);
    return y.data();
  }
};

// --activations / --activation-scale on the layer and its shared expert (DeepSeek's reference
// quantizes the shared expert's inputs as the routed experts').
void set_activations(const ActivationArgs& a, MoeModel* m) {
  apply_activation_options(a, &m->cfg);
  if (m->has_shared_expert()) apply_activation_options(a, &m->shared_expert.cfg);
}

// Which layer of which checkpoint, and what it leaves out (Hugging Face checkpoints).
void print_source(const MoeModel& m) {
  if (m.source.empty()) return;
  std::printf("model: %s\nlayer: %s\n", m.source.c_str(), describe_spec(m.cfg).c_str());
  for (const std::string& n : m.notes) std::printf("note: %s\n", n.c_str());
}

}  // namespace

Command make_run_command() {
  struct Args {
    std::string model, input, output, backend, convert, rule = "floor";
    int64_t layer = -1;
    bool explain = false;
    ActivationArgs act;
  };
  auto a = std::make_shared<Args>();
  Command c;
  c.setup = [a](CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "run",
        "Run one MoE layer: a model directory (config.json + experts.safetensors, or a Hugging\n"
        "Face checkpoint directory and --layer) and an input file (hidden_states + router_logits,\n"
        "or topk_ids + topk_weights; hidden_states alone with a checkpoint's router; input_ids for\n"
        "a hash-routed layer) -> y, topk_ids, topk_weights. A DeepSeek-V4 layer's shared expert is\n"
        "run too and added to y. The backend is the oracle's choice unless --backend / MOEKIT_BACKEND.");
    sub->add_option("--model", a->model, "layer directory, or Hugging Face checkpoint directory")->required();
    sub->add_option("--layer", a->layer, "MoE layer of a checkpoint directory (default: the first)")
        ->check(whole_int(0, INT_MAX));
    sub->add_option("--input", a->input, "input .safetensors")->required();
    sub->add_option("--output", a->output, "output .safetensors (written atomically)")->required();
    sub->add_option("--backend", a->backend, "backend name (see `moekit backends`)");
    sub->add_flag("--explain", a->explain, "print the backend decision and every rejection");
    sub->add_option("--convert", a->convert,
                    "convert the experts first (e.g. fp8 checkpoints for SM90): the rel. L2 error of the\n"
                    "new weights is printed")
        ->check(CLI::IsMember({"mxfp4", "nvfp4", "mxfp8", "bf16"}));
    sub->add_option("--scale-rule", a->rule, "MX shared-exponent rule of --convert mxfp4|mxfp8: floor | rceil")
        ->check(CLI::IsMember({"floor", "rceil"}));
    add_activation_options(sub, a->act, true);
    return sub;
  };
  c.run = [a]() {
    // Before any work: the output must not be one of the inputs nor a device, FIFO or directory.
    std::vector<std::string> inputs = model_files(a->model);
    inputs.push_back(a->input);
    check_output_path(a->output, inputs);
    MoeModel m = MoeModel::load(a->model, int(a->layer));
    set_activations(a->act, &m);
    print_source(m);
    if (!a->convert.empty()) {  // explicit, and its error printed: never silently lossy
      ConvertReport rep;
      {
        ProgressBar bar("convert");
        m = convert_layer(m, parse_format(a->convert), parse_scale_rule(a->rule), &rep, std::ref(bar));
      }
      std::printf("convert: %s\n", rep.describe().c_str());
    }
    const LayerInputData in = load_layer_input(a->input, m.cfg, &m.router);
    HostRunner runner(m, a->backend);
    if (a->explain) std::printf("%s", runner.explain(in.tokens).c_str());
    runner.prepare(in.tokens, in.bypass ? in.k : m.cfg.top_k);  // packing is not the run
    LayerOutput out;
    LayerInput view = in.view();
    view.check_values = true;  // a non-finite y is an error, not an output
    SharedExpert shared;
    const double t0 = now_ms();
    view.shared = shared.run(m, in);
    runner.run(view, &out);
    const double t1 = now_ms();
    write_layer_output(a->output, out, in.tokens, m.cfg.hidden, in.k);
    std::printf("moekit run: backend %s, %lld tokens, %.2f ms%s\n", runner.backend().c_str(), (long long)in.tokens,
                t1 - t0, shared.runner ? (" (the shared expert on " + shared.runner->backend() + ")").c_str() : "");
    return 0;
  };
  return c;
}

Command make_backends_command() {
  struct Args {
    std::string model;
    int64_t tokens = 1, layer = -1;
    bool explain = false;
    ActivationArgs act;
  };
  auto a = std::make_shared<Args>();
  Command c;
  c.setup = [a](CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "backends", "List the backends, whether each supports the problem here and why not,\n"
                    "and the one the oracle picks.");
    sub->add_option("--model", a->model, "model directory (default: list capabilities only)");
    sub->add_option("--layer", a->layer, "MoE layer of a checkpoint directory (default: the first)")
        ->check(whole_int(0, INT_MAX));
    sub->add_option("--tokens", a->tokens, "tokens per step (default 1)")->check(whole_int(0, INT64_MAX));
    sub->add_flag("--explain", a->explain,
                  "also the tuning tables: this build's kernel stamp and every stale entry (oracle/tuning.h)");
    add_activation_options(sub, a->act, true);
    return sub;
  };
  c.run = [a]() {
    if (a->explain) std::printf("%s", explain_tuning_tables(tuning_tables()).c_str());
    if (a->model.empty()) {
      MOEKIT_REQUIRE(a->act.activations.empty() && a->act.scale.empty(),
                     "--activations / --activation-scale: describe a layer, so they need --model");
      std::printf("device: %s\n", device_description().c_str());
      for (const BackendInfo& b : backends()) {
        std::string fmts, acts, inputs;
        for (auto f : b.weight_formats) fmts += std::string(fmts.empty() ? "" : ",") + format_name(f);
        for (auto x : b.activations) acts += std::string(acts.empty() ? "" : ",") + activation_name(x);
        for (auto d : b.activation_dtypes) inputs += std::string(inputs.empty() ? "" : ",") + activation_dtype_name(d);
        std::printf("  %-14s %-8s %-5s weights %-24s act %-30s %s\n    %s (activations: %s)\n", b.name.c_str(),
                    activation_format_name(b.activation_format), b.gpu ? "sm90" : "cpu", fmts.c_str(),
                    acts.c_str(), b.available ? "available" : "not on this device", b.summary.c_str(), inputs.c_str());
      }
      return 0;
    }
    MoeModel m = MoeModel::load(a->model, int(a->layer));
    set_activations(a->act, &m);
    print_source(m);
    std::printf("%s", HostRunner(m, "").explain(a->tokens).c_str());
    return 0;
  };
  return c;
}

Command make_demo_command() {
  struct Args {
    int64_t tokens = 32;
    std::string backend;
  };
  auto a = std::make_shared<Args>();
  Command c;
  c.setup = [a](CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "demo", "Build a small GPT-OSS-shaped MXFP4 layer in a temporary directory, run it on the\n"
                "oracle's backend, and check it against a double-precision reference.");
    sub->add_option("--tokens", a->tokens, "tokens (default 32)")->check(whole_int(1, INT64_MAX));
    sub->add_option("--backend", a->backend, "backend name (default: the oracle's choice)");
    return sub;
  };
  c.run = [a]() {
    MoeConfig cfg;
    cfg.num_experts = 32;
    cfg.top_k = 4;
    cfg.hidden = 640;
    cfg.intermediate = 640;
    cfg.act = Activation::kSwigluOai;
    cfg.norm_topk_prob = true;
    cfg.format = WeightFormat::kMxfp4;
    SyntheticOptions opt;
    opt.seed = 2026;
    opt.biases = true;
    std::string tmpl = (std::filesystem::temp_directory_path() / "moekit-demo-XXXXXX").string();
    MOEKIT_REQUIRE(mkdtemp(tmpl.data()), "demo: cannot create a temporary directory");
    const std::string dir = tmpl;
    struct Cleanup {
      std::string d;
      ~Cleanup() {
        std::error_code ec;
        std::filesystem::remove_all(d, ec);
      }
    } cleanup{dir};
    write_model_dir(make_synthetic_model(cfg, opt), dir + "/model");
    write_layer_input(dir + "/input.safetensors", make_synthetic_input(cfg, a->tokens, 7), cfg.hidden,
                      cfg.num_experts);

    const MoeModel m = MoeModel::load(dir + "/model");
    const LayerInputData in = load_layer_input(dir + "/input.safetensors", m.cfg);
    HostRunner runner(m, a->backend);
    std::printf("moekit demo: GPT-OSS-shaped MXFP4 layer, %s\n", Problem::of(m, in.tokens).describe().c_str());
    std::printf("%s", runner.explain(in.tokens).c_str());
    runner.prepare(in.tokens, m.cfg.top_k);
    LayerOutput out;
    std::vector<double> times;
    for (int i = 0; i < 5; ++i) {
      const double t0 = now_ms();
      runner.run(in.view(), &out);
      times.push_back(now_ms() - t0);
    }
    std::sort(times.begin(), times.end());
    const std::vector<double> ref =
        reference_layer(m, in.x.data(), in.tokens, out.ids.data(), out.weights.data(), m.cfg.top_k);
    std::vector<float> y(out.y.size());
    for (size_t i = 0; i < y.size(); ++i) y[i] = bf16_to_float(out.y[i]);
    const double err = rel_l2(y, ref);
    std::printf("backend %s: %.3f ms per layer (median of 5, host to host)\n", runner.backend().c_str(),
                times[2]);
    std::printf("rel. L2 error of y against the double-precision reference: %.2e (%s)\n", err,
                err <= 1e-2 ? "ok" : "TOO LARGE");
    return err <= 1e-2 ? 0 : 1;
  };
  return c;
}

}  // namespace moekit::cli
