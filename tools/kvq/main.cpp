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
  for (auto& cmd : kvq::tools::command_registry()) {
    size_t before = app.get_subcommands({}).size();
    auto run = cmd.setup(app);
    auto subs = app.get_subcommands({});
    if (subs.size() > before) runs.emplace_back(subs.back(), std::move(run));
  }
  CLI11_PARSE(app, argc, argv);
  try {
    for (auto& [sub, run] : runs)
      if (sub->parsed()) return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
