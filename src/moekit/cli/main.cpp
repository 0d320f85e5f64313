// moekit — command-line entry. Each subcommand lives in its own cmd_*.cpp; this file wires
// them into CLI11 and turns every error into one line on stderr: exit code 2 for usage errors
// (CLI11's parse errors), 1 for everything else (cli/args.h), std::bad_alloc included.
#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <exception>
#include <new>
#include <stdexcept>
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
  // CLI11 would only say that a subcommand is required: name the word it did not know.
  if (argc > 1 && argv[1][0] != '-') {
    bool known = false;
    std::string names;
    for (const CLI::App* s : subs) {
      known = known || s->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + s->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "moekit: error: unknown subcommand '%s' (known: %s; see --help)\n", argv[1], names.c_str());
      return moekit::cli::kExitUsage;
    }
  }
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
  } catch (const std::length_error&) {  // a container asked for more than it can index
    std::fprintf(stderr, "moekit: error: out of host memory (an allocation failed)\n");
    return moekit::cli::kExitBadInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moekit: error: %s\n", e.what());
    return moekit::cli::kExitBadInput;
  }
  return 0;
}
