// kvq eval: accuracy, memory and speed of each KV cache spec against the bf16 cache.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "kvq/cache_options.h"
#include "kvq/command.h"
#include "kvq/backend/backend.h"
#include "kvq/common/file_io.h"
#include "kvq/eval/eval.h"
#include "kvq/eval/gate.h"
#include "kvq/eval/logits_dump.h"
#include "kvq/eval/report.h"
#include "kvq/eval/search.h"
#include "kvq/eval/specs.h"
#include "kvq/eval/text.h"
#include "kvq/model/model.h"
#include "kvq/quant/layer_config.h"

namespace kvq::tools {
namespace {

struct EvalCli {
  std::string model, tokenizer, text, python = "python3";
  CacheCliOptions cache;  // add_cache_options sets eval's defaults
  std::string auto_start = "fp8";
  int ctx = 0;  // 0 = min(2048, the model's context)
  int max_windows = 0;
  int64_t max_tokens = 4096;  // two SmolLM2 windows at 2048: a few minutes on 2 cores
  int chunk = 256;
  int threads = 0;
  std::string gate = "3%";
  std::string bos = "auto";
  std::string json_out;
  bool markdown = false;
  bool quiet = false;
  bool fail_on_gate = false;
  std::string dump_logits;
  int dump_tokens = 512;
  std::string command_line;
  std::string weights = "fp32";
  int windows_in_flight = 0;
  // --search
  bool search = false;
  double budget_kl = 2e-3;
  std::string search_formats;  // "" = eval::default_search_formats()
  int search_ctx = 512, search_windows = 1, search_rounds = 3;
  std::string search_out;  // "" = bench/results/kv-config-<model>-kl<budget>.json
};

// The command as typed, for the JSON report (Linux: /proc/self/cmdline, NUL-separated).
std::string command_line() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>()), out;
  for (char ch : all) out += ch == '\0' ? ' ' : ch;
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

// "smollm2" -> "smollm2", "/x/stories260K.bin" -> "stories260K".
std::string file_stem(const std::string& path) {
  std::string s = path.substr(path.find_last_of('/') + 1);
  return s.substr(0, s.find('.'));
}

int fail(const std::string& what, const Status& st) {
  if (what.empty()) std::fprintf(stderr, "kvq eval: %s\n", st.message().c_str());
  else std::fprintf(stderr, "kvq eval: %s: %s\n", what.c_str(), st.message().c_str());
  return 1;
}

// A bar that redraws itself on a terminal; a line per window otherwise (logs, CI).
class Progress {
 public:
  explicit Progress(bool quiet) : quiet_(quiet), tty_(isatty(STDERR_FILENO) == 1) {}
  void operator()(const eval::EvalProgress& p) {
    if (quiet_) return;
    if (!p.note.empty()) {
      clear();
      std::fprintf(stderr, "%s\n", p.note.c_str());
      return;
    }
    const double frac = p.total > 0 ? static_cast<double>(p.done) / static_cast<double>(p.total) : 0.0;
    if (p.pass != pass_) {
      pass_ = p.pass;
      last_window_ = -1;
    }
    const double eta = frac > 0 ? p.pass_elapsed_s * (1 - frac) / frac : 0;
    if (tty_) {
      const int width = 30, fill = static_cast<int>(frac * width);
      std::fprintf(stderr, "\r[%s%s] pass %d  window %d/%d  %3.0f%%  %.0fs elapsed, ~%.0fs left ",
                   std::string(fill, '#').c_str(), std::string(width - fill, '.').c_str(), p.pass,
                   std::min(p.window + 1, p.num_windows), p.num_windows, 100 * frac, p.elapsed_s, eta);
      std::fflush(stderr);
      drawn_ = true;
    } else if (p.window != last_window_ || p.elapsed_s - last_line_s_ >= 30) {
      last_window_ = p.window;
      last_line_s_ = p.elapsed_s;
      std::fprintf(stderr, "eval: pass %d: %d/%d windows done (%.0f%%), %.0f s elapsed, ~%.0f s left\n", p.pass,
                   p.window, p.num_windows, 100 * frac, p.elapsed_s, eta);
    }
  }
  void clear() {
    if (drawn_) std::fprintf(stderr, "\r%100s\r", "");
    drawn_ = false;
  }

 private:
  bool quiet_, tty_;
  bool drawn_ = false;
  int pass_ = 0, last_window_ = -1;
  double last_line_s_ = 0;
};

// --search: the per-plane sensitivity runs, the choice and its verification (eval/search.h), then
// the config file that --kv-config reads.
int run_search_cmd(const EvalCli& o, const model::Model& m, const std::vector<int32_t>& ids,
                   const eval::EvalOptions& eo, const QuantSpec& base, const std::string& out_path, bool quiet) {
  eval::SearchOptions so;
  so.base = base;
  so.base.plane_formats.clear();
  so.budget_kl = o.budget_kl;
  so.max_rounds = o.search_rounds;
  so.verify = eo;
  so.sensitivity = eo;
  so.sensitivity.ctx = std::min(o.search_ctx, eo.ctx);
  so.sensitivity.max_windows = o.search_windows;
  so.sensitivity.max_tokens = 0;
  if (o.search_formats.empty()) {
    so.candidates = eval::default_search_formats();
  } else {
    for (const std::string& name : eval::split_csv(o.search_formats)) {
      auto f = parse_kv_cache_dtype(name);
      if (!f.is_ok()) return fail("--search-formats", f.status());
      so.candidates.push_back(f.value());
    }
  }
  Progress progress(quiet);
  auto rep = eval::run_search(m, ids, so, [&](const eval::EvalProgress& p) { progress(p); });
  progress.clear();
  if (!rep.is_ok()) return fail("search", rep.status());
  const eval::SearchReport& r = rep.value();
  std::printf("search %zu planes x %zu formats, %.1f s\n\n", r.plane_kl.size(), r.candidates.size(), r.seconds);
  std::fputs(eval::format_search(r).c_str(), stdout);
  KvConfig cfg{m.config().name, r.chosen.plane_formats};
  if (Status st = write_file_atomic(out_path, kv_config_json(cfg, eval::search_json_extra(r)), "--search-out");
      !st.is_ok())
    return fail("--search-out", st);
  std::printf("wrote %s (use it with --kv-config)\n", out_path.c_str());
  return r.met ? 0 : 3;
}

int run_eval_cmd(const EvalCli& o) {
  auto gate = eval::parse_gate_pct(o.gate);
  if (!gate.is_ok()) return fail("--gate", gate.status());
  auto auto_first = parse_kv_cache_dtype(o.auto_start);
  if (!auto_first.is_ok()) return fail("--auto-start", auto_first.status());
  auto specs = to_spec_requests(o.cache, auto_first.value());
  if (!specs.is_ok()) return fail("", specs.status());
  std::string search_out = o.search_out;
  if (o.search) {
    // The search takes granularity, block, sink and rotation from the flags; the dtypes it tries
    // come from --search-formats, so --kv-cache-dtype is not used.
    if (!o.cache.kv_config.empty())
      return fail("--search", invalid_argument("--kv-config is what the search writes; leave it out"));
    if (search_out.empty()) {
      char b[64];
      std::snprintf(b, sizeof b, "-kl%g.json", o.budget_kl);
      search_out = std::string(KVQ_SOURCE_DIR) + "/bench/results/kv-config-" + file_stem(o.model) + b;
    }
  }
  // Outputs are checked before the long run, and written atomically after it.
  auto run = open_model_run({o.cache.backend, o.model, o.tokenizer, 0, o.cache.numerics}, [&](backend::BackendKind) {
    if (!search_out.empty())
      if (Status st = check_writable(search_out, "--search-out file"); !st.is_ok())
        return Status(st.code(), "--search-out: " + st.message());
    if (!o.json_out.empty())
      if (Status st = check_writable(o.json_out, "--json output"); !st.is_ok())
        return Status(st.code(), "--json: " + st.message());
    if (!o.dump_logits.empty())
      if (Status st = check_writable(o.dump_logits, "logits dump"); !st.is_ok())
        return Status(st.code(), "--dump-logits: " + st.message());
    return Status::ok();
  });
  if (!run.is_ok()) return fail("", run.status());
  const backend::BackendKind kind = run.value().kind;
  const std::string& model_path = run.value().model_path;
  const model::Model& m = *run.value().model;
  backend::Backend* be = run.value().backend.get();
  for (const eval::SpecRequest& r : specs.value())
    if (Status st = check_plane_formats(r.spec, m.config().n_layers); !st.is_ok()) return fail("--kv-config", st);

  // Only the start of a long text file is read: what the window budget can use (whole when 0).
  const int64_t budget = o.max_tokens > 0 ? std::max<int64_t>(o.max_tokens, o.ctx > 0 ? o.ctx : 2048) : 0;
  auto text = o.text.empty() ? eval::pydoc_topics_text(o.python)
                             : eval::read_text_file(o.text, eval::text_bytes_for_tokens(budget));
  if (!text.is_ok()) return fail("evaluation text", text.status());
  const std::vector<int32_t> ids = m.tokenizer().encode(text.value().text, false);

  eval::EvalOptions eo;
  eo.ctx = o.ctx > 0 ? o.ctx : std::min(2048, m.config().max_seq_len);
  eo.max_windows = o.max_windows;
  eo.max_tokens = o.max_tokens;
  eo.chunk_tokens = o.chunk;
  eo.gate_pct = gate.value();
  eo.threads = o.threads;
  eo.bos = o.bos == "auto" ? -1 : o.bos == "on" ? 1 : 0;
  eo.backend = be;
  // A GPU step over one 128-token chunk leaves the card mostly idle: keep several windows in flight.
  eo.windows_in_flight = o.windows_in_flight > 0 ? o.windows_in_flight
                         : kind == backend::BackendKind::kCuda ? 4 : 1;
  // fp32 weights by default on every backend: the eval measures what the *cache* costs, and bf16
  // weights would add an error of their own (on SmolLM2 they move the CUDA perplexity by +0.06% and
  // CPU/CUDA top-1 agreement from 99.76% to 99.32%; bench/results/2026-11-30-h200-engine.md).
  eo.runner.weights = o.weights == "fp32" ? model::WeightsDType::kF32
                      : o.weights == "bf16" ? model::WeightsDType::kBf16
                                            : model::WeightsDType::kAuto;

  const double load_s = run.value().load_seconds;
  std::printf("model  %s (%s; %d layers, %d kv heads x %d, vocab %d), loaded in %.1f s\n",
              m.config().name.c_str(), model_path.c_str(), m.config().n_layers, m.config().n_kv_heads,
              m.config().head_dim, m.config().vocab_size, load_s);
  std::printf("engine %s\n", be->describe().c_str());
  std::printf("text   %s: %zu bytes, %zu tokens\n", text.value().source.c_str(), text.value().text.size(),
              ids.size());

  if (o.search) return run_search_cmd(o, m, ids, eo, specs.value().front().spec, search_out, o.quiet);

  if (!o.dump_logits.empty()) {
    auto windows = eval::eval_windows(m, ids, eo);
    if (!windows.is_ok()) return fail("windows", windows.status());
    eval::LogitsDump d;
    d.vocab = m.config().vocab_size;
    d.bos = eo.bos < 0 ? m.config().add_bos : eo.bos > 0;
    d.text_ids = ids;
    const auto& w0 = windows.value().front().tokens;
    d.tokens.assign(w0.begin(), w0.begin() + std::min<size_t>(w0.size(), static_cast<size_t>(std::max(1, o.dump_tokens))));
    auto logits = eval::compute_logits(m, eval::baseline_spec(), d.tokens, eo.chunk_tokens, eo.backend);
    if (!logits.is_ok()) return fail("computing logits", logits.status());
    d.logits = std::move(logits).value();
    Status st = eval::write_logits_dump(o.dump_logits, d);
    if (!st.is_ok()) return fail("--dump-logits", st);
    std::printf("wrote bf16-cache logits of %zu tokens (window 0) to %s\n", d.tokens.size(), o.dump_logits.c_str());
    return 0;
  }

  Progress progress(o.quiet);
  auto rep = eval::run_eval(m, ids, specs.value(), eo, [&](const eval::EvalProgress& p) { progress(p); });
  progress.clear();
  if (!rep.is_ok()) return fail("evaluation", rep.status());
  const eval::EvalReport& r = rep.value();
  std::printf("run    %d window(s) x %d tokens (BOS %s), %lld scored positions per spec, gate %.2f%%, %.1f s\n\n",
              r.num_windows, r.ctx, r.bos ? "on" : "off", static_cast<long long>(r.predictions), r.gate_pct,
              r.total_seconds);
  std::fputs(eval::format_table(r, o.markdown).c_str(), stdout);
  for (const auto& n : r.notes) std::printf("%s\n", n.c_str());
  bool any_error = false, any_fail = false;
  for (const auto& row : r.results) {
    if (!row.error.empty()) {
      any_error = true;
      std::printf("error: %s: %s\n", row.label.c_str(), row.error.c_str());
    } else if (!row.gate_pass) {
      any_fail = true;
    }
  }
  if (!o.json_out.empty()) {
    eval::ReportContext ctx;
    ctx.model_path = model_path;
    ctx.text_source = text.value().source;
    ctx.text_bytes = text.value().text.size();
    ctx.text_hash = eval::fnv1a64(text.value().text);
    ctx.command = o.command_line;
    if (Status st = write_file_atomic(o.json_out, eval::report_json(r, ctx) + "\n", "--json output"); !st.is_ok())
      return fail("--json", st);
  }
  if (any_error) return 1;
  return o.fail_on_gate && any_fail ? 3 : 0;
}

const RegisterCommand kRegister{{[](CLI::App& app) -> std::function<int()> {
  auto o = std::make_shared<EvalCli>();
  auto* c = app.add_subcommand("eval", "Perplexity, KL, top-1 agreement, bytes/token and speed of each cache spec vs bf16");
  c->add_option("--model", o->model, "smollm2, stories260K or a model file (GGUF / llama2.c)")->required();
  c->add_option("--tokenizer", o->tokenizer, "tokenizer of a llama2.c checkpoint (default: tok512.bin beside it)");
  c->add_option("--text", o->text, "UTF-8 text file to evaluate on (default: CPython's pydoc topics)");
  c->add_option("--python", o->python, "python interpreter that provides pydoc_data.topics")->capture_default_str();
  add_cache_options(c, o->cache, CacheCommand::kEval);
  c->add_option("--auto-start", o->auto_start, "first format `auto` tries before falling back to int8, then bf16")
      ->capture_default_str();
  c->add_option("--ctx", o->ctx, "tokens per window, BOS included (default: 2048 or the model's context)");
  auto* max_windows = c->add_option("--max-windows", o->max_windows, "at most N windows (0: no limit)")->capture_default_str();
  auto* max_tokens = c->add_option("--max-tokens", o->max_tokens,
                                   "window-token budget per spec (0: the whole text; the default budget is dropped "
                                   "when --max-windows is given)")
                         ->capture_default_str();
  c->add_option("--chunk", o->chunk, "tokens per forward call (logits of one chunk per runner are kept)")
      ->capture_default_str();
  c->add_option("--threads", o->threads, "threads comparing logits (0: all cores, at most 8)")->capture_default_str();
  c->add_option("--gate", o->gate, "a spec whose perplexity rises by more than this fails, e.g. 3% or 0.5%")
      ->capture_default_str();
  c->add_option("--bos", o->bos, "start each window with BOS: auto (as the model asks), on, off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  c->add_option("--weights", o->weights, "weight precision on the backend: fp32 (default: the eval measures the cache alone), bf16, auto (bf16 on cuda)")
      ->check(CLI::IsMember({"auto", "fp32", "bf16"}))
      ->capture_default_str();
  c->add_option("--windows-in-flight", o->windows_in_flight,
                "windows forwarded together (0: 4 on cuda, 1 on cpu); the results do not depend on it")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  c->add_flag("--search", o->search,
              "find per-layer K/V dtypes that keep the mean KL within --budget-kl with the fewest bytes, verify "
              "them, and write a --kv-config file (exit 3 when the budget is missed)");
  c->add_option("--budget-kl", o->budget_kl, "--search: mean KL budget vs the bf16 cache, nats per position")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  c->add_option("--search-formats", o->search_formats,
                "--search: candidate dtypes, comma-separated (default: every quantized cache dtype but fp8_fnuz)");
  c->add_option("--search-ctx", o->search_ctx, "--search: tokens per sensitivity window (the verification uses --ctx)")
      ->check(CLI::Range(2, 1 << 20))
      ->capture_default_str();
  c->add_option("--search-windows", o->search_windows, "--search: sensitivity windows")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  c->add_option("--search-rounds", o->search_rounds, "--search: verification runs of the mix, at most")
      ->check(CLI::Range(1, 10))
      ->capture_default_str();
  c->add_option("--search-out", o->search_out,
                "--search: config file to write (default: bench/results/kv-config-<model>-kl<budget>.json)");
  c->add_option("--json", o->json_out, "also write the full report (per-window NLL included) as JSON");
  c->add_flag("--markdown", o->markdown, "print the table as Markdown");
  c->add_flag("--quiet", o->quiet, "no progress on stderr");
  c->add_flag("--fail-on-gate", o->fail_on_gate, "exit with status 3 when a spec fails the gate");
  // Validation only (scripts/validate_llamacpp.py): bf16-cache logits of window 0, then exit.
  c->add_option("--dump-logits", o->dump_logits)->group("");
  c->add_option("--dump-tokens", o->dump_tokens)->group("");
  return [o, max_windows, max_tokens]() {
    o->command_line = command_line();
    // An explicit window count is what the user asked for: the default token budget (two windows at
    // 2048) must not cut it short silently. An explicit --max-tokens still caps it.
    if (max_windows->count() > 0 && max_tokens->count() == 0) o->max_tokens = 0;
    return run_eval_cmd(*o);
  };
}}};

}  // namespace
}  // namespace kvq::tools
