#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "kvq/cli_support.h"
#include "kvq/command.h"

namespace kvq::tools {
std::vector<Command>& command_registry() {
  static std::vector<Command> registry;
  return registry;
}
}  // namespace kvq::tools

int main(int argc, char** argv) {
  using namespace kvq::tools;
  CLI::App app{"kvq: quantized paged KV cache for LLM inference", "kvq"};
  app.require_subcommand(1);
  app.set_version_flag("--version", version_text(), "Print version, git commit, build type and CUDA arch, then exit");
  std::vector<std::pair<CLI::App*, std::function<int()>>> runs;
  // Top-level commands first, then those that add a subcommand under one of them (`bench serve`).
  for (int nested = 0; nested < 2; ++nested)
    for (auto& cmd : command_registry()) {
      if (cmd.parent.empty() == (nested == 1)) continue;
      CLI::App* parent = nested ? app.get_subcommand(cmd.parent) : &app;
      size_t before = parent->get_subcommands({}).size();
      auto run = cmd.setup(*parent);
      auto subs = parent->get_subcommands({});
      if (subs.size() > before) runs.emplace_back(subs.back(), std::move(run));
    }
  refuse_empty_numbers(app);  // "--ctx ''" must not become 0

  const std::vector<std::string> args(argv + 1, argv + argc);
  const std::string words = check_command_words(app, args);
  if (!words.empty()) {
    std::fprintf(stderr, "%s\n", words.c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::fprintf(stderr, "%s\n", parse_error_line(app, e).c_str());
    return e.get_exit_code();
  }
  try {
    // The most specific parsed command runs (nested ones were registered last).
    for (auto it = runs.rbegin(); it != runs.rend(); ++it)
      if (it->first->parsed()) return it->second();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
