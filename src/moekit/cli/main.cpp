// moekit — command-line entry. Each subcommand lives in its own cmd_*.cpp; this file wires
// them into CLI11 and turns every moekit::Error into one line on stderr and exit code 1.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <string>

#include "moekit/cli/commands.h"
#include "moekit/common/error.h"

int main(int argc, char** argv) {
  CLI::App app{"moekit: Mixture-of-Experts expert layers with low-precision weights"};
  app.require_subcommand(1);
  // Usage errors are one line too.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("moekit: error: ") + e.what() + " (see --help)\n";
  });
  app.set_version_flag("--version", "moekit 0.1.0");
  std::vector<moekit::cli::Command> commands = moekit::cli::all_commands();
  std::vector<CLI::App*> subs;
  for (auto& c : commands) subs.push_back(c.setup(app));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (size_t i = 0; i < commands.size(); ++i)
      if (subs[i]->parsed()) return commands[i].run();
  } catch (const moekit::Error& e) {
    std::fprintf(stderr, "moekit: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moekit: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
