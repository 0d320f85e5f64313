// moekit/cli/commands.h — the subcommands of the `moekit` binary.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <vector>

namespace moekit::cli {

struct Command {
  std::function<CLI::App*(CLI::App&)> setup;  // adds the subcommand and its options
  std::function<int()> run;                   // runs it once parsed; returns the exit code
};

// Every subcommand; each cmd_*.cpp contributes one factory.
std::vector<Command> all_commands();

Command make_quantize_command();
Command make_dequantize_command();
Command make_run_command();
Command make_backends_command();
Command make_demo_command();
Command make_bench_command();
Command make_tune_command();
Command make_convert_command();

}  // namespace moekit::cli
