#pragma once
// Each `kvq <subcommand>` lives in its own cmd_*.cpp and registers itself here, so adding a
// command touches no shared file. Only tools/ may exit; commands return the process exit code.
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace kvq::tools {

struct Command {
  // Adds the subcommand to `app`; returns the function to run when it was selected.
  std::function<std::function<int()>(CLI::App& app)> setup;
  // Non-empty: `app` is this top-level command instead (e.g. "bench" for `kvq bench serve`); the
  // most specific parsed command runs.
  std::string parent = {};
};

std::vector<Command>& command_registry();

struct RegisterCommand {
  explicit RegisterCommand(Command c) { command_registry().push_back(std::move(c)); }
};

}  // namespace kvq::tools
