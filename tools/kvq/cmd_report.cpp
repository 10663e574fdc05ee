// `kvq report`: the synthetic accuracy/memory table of every format x scale granularity
// (kvq/eval/synthetic_report.h). Needs no model; runs in seconds.
#include <cstdio>
#include <memory>
#include <string>

#include "kvq/cache_options.h"
#include "kvq/cli_support.h"
#include "kvq/command.h"
#include "kvq/common/file_io.h"
#include "kvq/eval/synthetic_report.h"

namespace kvq::tools {
namespace {

struct ReportCli {
  std::string json_out;
  CacheCliOptions cache;  // block size and sink only; add_cache_options sets report's defaults
  eval::SyntheticReportOptions opts;
};

// The synthetic sequences are at most 4096 tokens long, so a larger sink would only cost memory.
constexpr int kMaxReportSink = 4096;

int run_report(ReportCli cli) {
  auto geometry = to_geometry(cli.cache);
  if (!geometry.is_ok()) {
    std::fprintf(stderr, "kvq report: %s\n", geometry.status().message().c_str());
    return 2;
  }
  if (geometry.value().sink_tokens > kMaxReportSink) {
    std::fprintf(stderr, "kvq report: --kv-sink-tokens %d is more than the report's longest sequence; use 0 to %d\n",
                 geometry.value().sink_tokens, kMaxReportSink);
    return 2;
  }
  if (!cli.json_out.empty())
    if (Status st = check_writable(cli.json_out, "--json output"); !st.is_ok()) {
      std::fprintf(stderr, "kvq report: --json: %s\n", st.message().c_str());
      return 2;
    }
  cli.opts.block_size = geometry.value().block_size;
  cli.opts.sink_tokens = geometry.value().sink_tokens;
  auto r = eval::run_synthetic_report(cli.opts);
  if (!r.is_ok()) {
    std::fprintf(stderr, "kvq report: %s\n", r.status().to_string().c_str());
    return 1;
  }
  std::fputs(eval::format_synthetic_report(r.value()).c_str(), stdout);
  if (!cli.json_out.empty())
    if (Status st = write_file_atomic(cli.json_out, eval::synthetic_report_json(r.value()), "--json output");
        !st.is_ok()) {
      std::fprintf(stderr, "kvq report: --json: %s\n", st.message().c_str());
      return 1;
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
  add_cache_options(sub, cli->cache, CacheCommand::kReport);
  CLI::Option* queries = sub->add_option("--queries", cli->opts.queries_per_seq, "Decode queries per sequence");
  refuse_empty_number(queries);  // before the range check, so an empty value is named as such
  queries->capture_default_str()->check(CLI::Range(1, 64));
  return [cli] { return run_report(*cli); };
}}};

}  // namespace
}  // namespace kvq::tools
