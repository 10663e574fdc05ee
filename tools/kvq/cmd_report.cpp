// `kvq report`: the synthetic accuracy/memory table of every format x scale granularity
// (kvq/eval/synthetic_report.h). Needs no model; runs in seconds.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "kvq/command.h"
#include "kvq/eval/synthetic_report.h"

namespace kvq::tools {
namespace {

struct ReportCli {
  std::string json_out;
  eval::SyntheticReportOptions opts;
};

int run_report(const ReportCli& cli) {
  auto r = eval::run_synthetic_report(cli.opts);
  if (!r.is_ok()) {
    std::fprintf(stderr, "kvq report: %s\n", r.status().to_string().c_str());
    return 1;
  }
  std::fputs(eval::format_synthetic_report(r.value()).c_str(), stdout);
  if (!cli.json_out.empty()) {
    std::ofstream f(cli.json_out);
    f << eval::synthetic_report_json(r.value());
    if (!f) {
      std::fprintf(stderr, "kvq report: cannot write %s\n", cli.json_out.c_str());
      return 1;
    }
  }
  return 0;
}

const RegisterCommand kRegister{Command{[](CLI::App& app) -> std::function<int()> {
  auto cli = std::make_shared<ReportCli>();
  CLI::App* sub = app.add_subcommand(
      "report", "Synthetic accuracy report: K/V and decode-attention error of every format x scale granularity "
                "on heavy-tailed KV, vs float64, with bytes per token");
  sub->add_option("--json", cli->json_out, "Also write the report as JSON to FILE");
  sub->add_option("--seed", cli->opts.seed, "Random seed of the synthetic data")->capture_default_str();
  sub->add_option("--sink", cli->opts.sink_tokens, "Tokens per sequence kept in the bf16 sink")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  sub->add_option("--block-size", cli->opts.block_size, "Tokens per page")
      ->capture_default_str()
      ->check(CLI::IsMember({16, 32}));
  sub->add_option("--queries", cli->opts.queries_per_seq, "Decode queries per sequence")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  return [cli] { return run_report(*cli); };
}}};

}  // namespace
}  // namespace kvq::tools
