#include <cstdio>
#include <exception>

#include "kvq/command.h"

namespace kvq::tools {
std::vector<Command>& command_registry() {
  static std::vector<Command> registry;
  return registry;
}
}  // namespace kvq::tools

int main(int argc, char** argv) {
  CLI::App app{"kvq: quantized paged KV cache for LLM inference"};
  app.require_subcommand(1);
  std::vector<std::pair<CLI::App*, std::function<int()>>> runs;
  // Top-level commands first, then those that add a subcommand under one of them (`bench serve`).
  for (int nested = 0; nested < 2; ++nested)
    for (auto& cmd : kvq::tools::command_registry()) {
      if (cmd.parent.empty() == (nested == 1)) continue;
      CLI::App* parent = nested ? app.get_subcommand(cmd.parent) : &app;
      size_t before = parent->get_subcommands({}).size();
      auto run = cmd.setup(*parent);
      auto subs = parent->get_subcommands({});
      if (subs.size() > before) runs.emplace_back(subs.back(), std::move(run));
    }
  CLI11_PARSE(app, argc, argv);
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
