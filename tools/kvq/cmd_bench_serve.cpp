// `kvq bench serve`: load generator against any OpenAI-compatible server (default: starts nothing,
// takes --url), or --compare of earlier runs (one per cache spec) with the SLA verdict vs bf16.
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/command.h"
#include "kvq/common/file_io.h"
#include "kvq/eval/text.h"
#include "kvq/model/model.h"
#include "kvq/serve/loadgen.h"

namespace kvq::tools {
namespace {

struct BenchServeCli {
  serve::LoadOptions load;
  std::string tiers = "1024,4096,7168";
  std::string tokenizer_model;  // model alias or file whose tokenizer counts prompt tokens
  std::vector<std::string> texts;
  std::string out_dir;
  std::vector<std::string> compare;
  double sla = 1.5;
};

int fail(const Status& s) {
  std::fprintf(stderr, "kvq bench serve: %s\n", s.to_string().c_str());
  return 1;
}

std::string safe(std::string s) {
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') c = '_';
  return s;
}

std::string default_dir() {
  const std::time_t now = std::time(nullptr);
  char b[64];
  std::strftime(b, sizeof b, "%Y%m%d-%H%M%S", std::gmtime(&now));
  return std::string(KVQ_SOURCE_DIR) + "/bench/results/serve-" + b;
}

bool write_file(const std::string& path, const std::string& text) {
  return write_file_atomic(path, text, "result file").is_ok();
}

int run_compare(const BenchServeCli& o) {
  std::vector<serve::LoadReport> runs;
  for (const std::string& p : o.compare) {
    std::ifstream f(p);
    if (!f) return fail(invalid_argument("cannot read " + p));
    auto j = nlohmann::json::parse(f, nullptr, false);
    if (j.is_discarded()) return fail(invalid_argument(p + " is not JSON"));
    auto r = serve::report_from_json(j);
    if (!r.is_ok()) return fail(invalid_argument(p + ": " + r.status().message()));
    runs.push_back(r.value());
  }
  bool pass = false;
  const std::string md = serve::compare_markdown(runs, o.sla, &pass);
  std::fputs(md.c_str(), stdout);
  const std::string dir = o.out_dir.empty() ? default_dir() : o.out_dir;
  std::filesystem::create_directories(dir);
  if (!write_file(dir + "/compare.md", md)) return fail(invalid_argument("cannot write " + dir + "/compare.md"));
  std::fprintf(stderr, "wrote %s/compare.md; overall %s\n", dir.c_str(), pass ? "PASS" : "FAIL");
  return pass ? 0 : 2;
}

int run_bench_serve(BenchServeCli o) {
  if (!o.compare.empty()) return run_compare(o);
  o.load.tiers.clear();
  std::stringstream ss(o.tiers);
  for (std::string item; std::getline(ss, item, ',');) {
    try {
      o.load.tiers.push_back(std::stoi(item));
    } catch (...) {
      return fail(invalid_argument("--tiers takes comma-separated token counts, e.g. 1024,4096,7168"));
    }
    if (o.load.tiers.back() < 1) return fail(invalid_argument("--tiers: token counts must be >= 1"));
  }
  serve::PromptSource src;
  if (o.texts.empty()) {
    auto stories = eval::read_text_file(model::stories260k_dir() + "/tinystories_valid_head.txt");
    if (stories.is_ok()) src.texts.push_back(stories.value().text);
    auto pydoc = eval::pydoc_topics_text();
    if (pydoc.is_ok()) src.texts.push_back(pydoc.value().text);
    if (src.texts.empty()) return fail(invalid_argument("no prompt text found; pass --text FILE"));
  } else {
    for (const std::string& p : o.texts) {
      auto t = eval::read_text_file(p);
      if (!t.is_ok()) return fail(t.status());
      src.texts.push_back(t.value().text);
    }
  }
  std::unique_ptr<model::Model> tok_model;
  if (!o.tokenizer_model.empty()) {
    auto path = model::resolve_model_path(o.tokenizer_model);
    if (!path.is_ok()) return fail(path.status());
    auto m = model::Model::load(path.value());
    if (!m.is_ok()) return fail(m.status());
    tok_model = std::move(m).value();
    src.tok = &tok_model->tokenizer();
    for (std::string& t : src.texts)
      if (t.size() > 300000) t.resize(300000);  // enough for any tier; keeps encoding quick
    src.prepare();
  }
  std::fprintf(stderr, "kvq bench serve: %s, tiers %s, %d prompts each, %d output tokens, %s\n", o.load.url.c_str(),
               o.tiers.c_str(), o.load.prompts_per_tier, o.load.max_tokens,
               o.load.rate > 0 ? ("Poisson " + std::to_string(o.load.rate) + " req/s").c_str() : "max throughput");
  auto rep = serve::run_load(o.load, src);
  if (!rep.is_ok()) return fail(rep.status());
  const std::string md = serve::report_markdown(rep.value());
  std::fputs(md.c_str(), stdout);
  const std::string dir = o.out_dir.empty() ? default_dir() : o.out_dir;
  std::filesystem::create_directories(dir);
  const std::string base = dir + "/" + safe(rep.value().label);
  if (!write_file(base + ".json", serve::report_json(rep.value()).dump(2) + "\n") || !write_file(base + ".md", md))
    return fail(invalid_argument("cannot write under " + dir));
  std::fprintf(stderr, "wrote %s.json and %s.md\n", base.c_str(), base.c_str());
  int errors = 0;
  for (const auto& t : rep.value().tiers) errors += t.errors;
  return errors == 0 ? 0 : 2;
}

const RegisterCommand kRegister{Command{[](CLI::App& bench) -> std::function<int()> {
  auto o = std::make_shared<BenchServeCli>();
  CLI::App* sub = bench.add_subcommand("serve", "Load generator for an OpenAI-compatible server: context tiers, "
                                                "Poisson or max-throughput arrivals, TTFT/TPOT percentiles; --compare "
                                                "runs for the SLA verdict vs bf16");
  sub->add_option("--url", o->load.url, "Server base URL")->capture_default_str();
  sub->add_option("--model", o->load.model, "\"model\" to request (default: the server's first)");
  sub->add_option("--label", o->load.label, "Name of this run, e.g. the cache spec (default: the server's spec from /metrics)");
  sub->add_option("--tiers", o->tiers, "Prompt lengths in tokens, comma-separated")->capture_default_str();
  sub->add_option("--prompts", o->load.prompts_per_tier, "Prompts per tier")->capture_default_str()->check(CLI::Range(1, 100000));
  sub->add_option("--max-tokens", o->load.max_tokens, "Output tokens per request")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  sub->add_option("--rate", o->load.rate, "Poisson arrivals per second (0: all at once, max throughput)")->capture_default_str();
  sub->add_option("--max-concurrency", o->load.max_concurrency, "Requests in flight at most")->capture_default_str();
  sub->add_option("--max-seconds", o->load.max_seconds, "Per tier: send nothing new after this")->capture_default_str();
  sub->add_option("--timeout", o->load.request_timeout_s, "Per request timeout (s)")->capture_default_str();
  sub->add_option("--seed", o->load.seed, "Prompt choice and arrival times")->capture_default_str();
  sub->add_option("--tokenizer-model", o->tokenizer_model, "Count prompt tokens with this model's tokenizer (smollm2, "
                  "stories260K, a file); default ~4 characters per token");
  sub->add_option("--text", o->texts, "Text files to cut prompts from (default: TinyStories + pydoc topics)");
  sub->add_option("--out-dir", o->out_dir, "Where JSON and markdown go (default: bench/results/serve-<date>)");
  sub->add_option("--compare", o->compare, "Result JSON files of earlier runs (one per spec): print the SLA table only")
      ->expected(1, -1);
  sub->add_option("--sla", o->sla, "SLA factor on P99 TTFT and TPOT vs bf16")->capture_default_str();
  return [o] { return run_bench_serve(*o); };
}, "bench"}};

}  // namespace
}  // namespace kvq::tools
