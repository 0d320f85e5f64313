// moekit — command-line entry. Each subcommand lives in its own cmd_*.cpp; this file wires
// them into CLI11 and turns every error into one line on stderr: exit code 2 for usage errors
// (CLI11's parse errors), 1 for everything else (cli/args.h), std::bad_alloc included.
#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "moekit/cli/args.h"
#include "moekit/cli/commands.h"
#include "moekit/common/error.h"

int main(int argc, char** argv) {
  // A write past the file-size limit fails with EFBIG (and the output is not replaced) instead
  // of killing the process with a temporary file left behind.
  std::signal(SIGXFSZ, SIG_IGN);
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
    // --help and --version exit 0; every other parse error (CLI11's 105-109...) is a usage error.
    return app.exit(e) == 0 ? 0 : moekit::cli::kExitUsage;
  }
  try {
    for (size_t i = 0; i < commands.size(); ++i)
      if (subs[i]->parsed()) return commands[i].run();
  } catch (const moekit::Error& e) {
    std::fprintf(stderr, "moekit: error: %s\n", e.what());
    return moekit::cli::kExitBadInput;
  } catch (const std::bad_alloc&) {
    // A last resort: sizes are checked before they are allocated, so this is a request the
    // checks let through that the allocator could not meet.
    std::fprintf(stderr, "moekit: error: out of host memory (an allocation failed)\n");
    return moekit::cli::kExitBadInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moekit: error: %s\n", e.what());
    return moekit::cli::kExitBadInput;
  }
  return 0;
}
