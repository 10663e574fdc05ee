// `kvq generate`: runs a model on the CPU engine with the chosen KV cache format and streams the
// generated text; timing and cache memory go to stderr.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include "kvq/cache_options.h"
#include "kvq/cli_support.h"
#include "kvq/command.h"
#include "kvq/model/model.h"

namespace kvq::tools {
namespace {

struct GenerateOptions {
  std::string model = "stories260K";
  std::string tokenizer;
  std::string prompt;
  bool chat = false;
  bool no_bos = false;
  CacheCliOptions cache;  // add_cache_options sets generate's defaults
  float temperature = 0.f;
  float top_p = 1.f;
  uint64_t seed = 0;
  int max_new = 128;
  int max_tokens = 0;
  int threads = 0;
};

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int run_generate(const GenerateOptions& o) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "kvq generate: %s\n", s.to_string().c_str());
    return 1;
  };
  // Everything the flags decide is checked before the model loads.
  Status sampling = check_sampling(o.temperature, o.top_p, o.max_new);
  if (!sampling.is_ok()) return fail(sampling);
  if (o.max_tokens < 0)
    return fail(invalid_argument("--max-tokens " + std::to_string(o.max_tokens) +
                                 " is not valid; use 0 (the prompt plus -n) or a capacity in tokens"));
  Result<QuantSpec> spec = invalid_argument("no spec");
  auto run = open_model_run({o.cache.backend, o.model, o.tokenizer, o.threads, o.cache.numerics}, [&](backend::BackendKind kind) {
    // `auto` is what the backend the model runs on prefers (fp8 on sm_89+ GPUs, int8 on CPUs).
    spec = to_quant_spec(o.cache, kind);
    return spec.status();
  });
  if (!run.is_ok()) return fail(run.status());
  const model::Model& mod = *run.value().model;
  const backend::Backend& be = *run.value().backend;
  const model::ModelConfig& c = mod.config();

  const model::Tokenizer& tok = mod.tokenizer();
  std::string text = o.chat ? tok.chat_prompt(o.prompt) : o.prompt;
  bool bos = c.add_bos && !o.no_bos;
  auto prompt = tok.encode(text, bos);
  if (prompt.empty() && tok.bos_id() >= 0) prompt.push_back(tok.bos_id());
  if (prompt.empty()) return fail(invalid_argument("the prompt is empty and the model has no BOS token"));

  // The cache holds the prompt and the tokens to generate, never more than the model's context
  // (generation stops when it is full); summed in 64 bits, so a huge -n cannot wrap around.
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  if (prompt_len >= c.max_seq_len)
    return fail(invalid_argument("the prompt has " + std::to_string(prompt_len) + " tokens; the model's context of " +
                                 std::to_string(c.max_seq_len) + " leaves no room to generate"));
  if (o.max_tokens > 0 && o.max_tokens <= prompt_len)
    return fail(invalid_argument("--max-tokens " + std::to_string(o.max_tokens) + " leaves no room after the " +
                                 std::to_string(prompt_len) + "-token prompt; use at least " +
                                 std::to_string(prompt_len + 1) + " (the model's context is " +
                                 std::to_string(c.max_seq_len) + ")"));
  const int64_t wanted = o.max_tokens > 0 ? o.max_tokens : prompt_len + o.max_new;
  const int max_tokens = static_cast<int>(std::min<int64_t>(wanted, c.max_seq_len));
  // After the checks above, so that a refusal stays the one line on stderr.
  std::fprintf(stderr, "model %s: %d layers, dim %d, %d/%d heads of %d, vocab %d (loaded in %.2f s)\n", c.name.c_str(),
               c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size, run.value().load_seconds);
  auto runner = model::Runner::create(mod, spec.value(), max_tokens, run.value().backend.get());
  if (!runner.is_ok()) return fail(runner.status());
  std::fprintf(stderr, "engine %s; kv cache %s, prompt %zu tokens\n", be.describe().c_str(),
               spec.value().to_string().c_str(), prompt.size());

  model::SamplingOptions so;
  so.temperature = o.temperature;
  so.top_p = o.top_p;
  so.seed = o.seed;
  so.max_new_tokens = o.max_new;
  // Stream by decoding the whole continuation each step and printing what is new, so multi-byte
  // characters split across tokens and the dummy-prefix space come out right.
  std::vector<int32_t> out;
  // Decoded after the prompt's ids, so a continuation's leading space (which a tokenizer drops at
  // the start of a text) survives.
  std::vector<int32_t> all = prompt;
  const std::string prompt_text = tok.decode(prompt);
  std::string shown = prompt_text;
  auto t_first = Clock::now();
  double prefill_s = -1;
  auto on_token = [&](int32_t id) {
    if (prefill_s < 0) prefill_s = seconds_since(t_first);
    out.push_back(id);
    all.push_back(id);
    std::string now = tok.decode(all);
    if (now.size() > shown.size() && now.compare(0, shown.size(), shown) == 0) {
      std::fwrite(now.data() + shown.size(), 1, now.size() - shown.size(), stdout);
      std::fflush(stdout);
      shown = now;
    }
  };
  if (!o.chat) {
    std::fputs(o.prompt.c_str(), stdout);
    std::fflush(stdout);
  }
  auto gen = model::generate(*runner.value(), prompt, so, on_token);
  const double total_s = seconds_since(t_first);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (!gen.is_ok()) return fail(gen.status());
  const size_t n = gen.value().size();
  const double decode_s = total_s - std::max(0.0, prefill_s);
  std::fprintf(stderr, "prefill %zu tokens in %.3f s (%.1f tok/s); decode %zu tokens in %.3f s (%.1f tok/s)\n",
               prompt.size(), prefill_s, prompt.size() / std::max(prefill_s, 1e-9), n > 0 ? n - 1 : 0, decode_s,
               (n > 1 ? n - 1 : 0) / std::max(decode_s, 1e-9));
  const auto& book = runner.value()->cache();
  const auto mem = book.memory_report();
  const auto& g = book.geometry();
  const double mib = 1048576.0;
  double codes = 0, scales = 0;  // summed per plane: a per-layer config gives each its own format
  for (int l = 0; l < g.num_layers; ++l)
    for (int kv = 0; kv < 2; ++kv) {
      codes += double(book.layer_geometry(l).plane(kv).code_plane_bytes());
      scales += double(book.layer_geometry(l).plane(kv).scale_plane_bytes());
    }
  std::fprintf(stderr, "kv cache: %d pages + %d sink pages in use; planes %.2f MiB codes, %.2f MiB scales, %.2f MiB sink\n",
               mem.pages_used, mem.sink_pages_used, codes / mib, scales / mib,
               2.0 * g.num_layers * g.sink_plane_bytes() / mib);
  if (g.recent_tokens > 0)
    std::fprintf(stderr, "kv cache: bf16 recent window of %d tokens: %d pages in use, planes %.2f MiB\n",
                 g.recent_tokens, mem.recent_pages_used, 2.0 * g.num_layers * g.recent_plane_bytes() / mib);
  return 0;
}

const RegisterCommand kRegister{Command{[](CLI::App& app) -> std::function<int()> {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* sub = app.add_subcommand("generate", "Generate text with a model over the quantized cache (CPU or CUDA engine)");
  sub->add_option("--model,-m", o->model, "Model file (GGUF or llama2.c), or an alias: smollm2, stories260K")
      ->capture_default_str();
  sub->add_option("--tokenizer", o->tokenizer, "llama2.c tokenizer file (default: tok<vocab>.bin beside the model)");
  sub->add_option("--prompt,-p", o->prompt, "Prompt text (empty: start from BOS)");
  sub->add_flag("--chat", o->chat, "Wrap the prompt in the model's chat template (SmolLM2-Instruct)");
  sub->add_flag("--no-bos", o->no_bos, "Do not prepend BOS even when the model expects it");
  add_cache_options(sub, o->cache, CacheCommand::kGenerate);
  sub->add_option("--temperature,-t", o->temperature, "Sampling temperature (0 = greedy)")->capture_default_str();
  sub->add_option("--top-p", o->top_p, "Nucleus sampling mass")->capture_default_str();
  sub->add_option("--seed", o->seed, "Sampling seed")->capture_default_str();
  sub->add_option("-n,--max-new-tokens", o->max_new, "Tokens to generate (>= 1)")->capture_default_str();
  sub->add_option("--max-tokens", o->max_tokens, "Cache capacity in tokens (default: prompt + n)");
  sub->add_option("--threads", o->threads, "BLAS threads for the matrix products (default: the BLAS default)");
  return [o] { return run_generate(*o); };
}}};

}  // namespace
}  // namespace kvq::tools
