// `kvq serve`: an OpenAI-compatible HTTP server (completions, chat, SSE streaming, metrics) over
// the continuous-batching scheduler and the quantized paged KV cache, on the CPU or CUDA engine.
// SIGINT / SIGTERM drain the requests in flight, then exit.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

#include "kvq/backend/backend.h"
#include "kvq/cache_options.h"
#include "kvq/cache/layout.h"
#include "kvq/command.h"
#ifdef KVQ_HAVE_CUDA
#include "kvq/common/cuda_device.h"
#endif
#include "kvq/model/engine.h"
#include "kvq/model/model.h"
#include "kvq/serve/capacity.h"
#include "kvq/serve/server.h"

namespace kvq::tools {
namespace {

struct ServeCli {
  std::string model = "stories260K", tokenizer, served_name;
  std::string host = "127.0.0.1";
  int port = 8000;
  CacheCliOptions cache;  // the shared cache flags (kvq/cache_options.h)
  int threads = 0;
  int max_seqs = 16, max_model_len = 0, max_batched_tokens = 0, chunk_tokens = 128;
  double kv_gib = 0, gpu_util = 0;
  bool batch_invariant = false, fast_recompute = false, no_prefix_sharing = false;
  int prefix_cache_seqs = 0;
  double max_body_mib = 1.0;
  int http_threads = 64;
};

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }

int fail(const Status& s) {
  std::fprintf(stderr, "kvq serve: %s\n", s.to_string().c_str());
  return 1;
}

// Parameters of the model's weights (for --gpu-memory-utilization's estimate of what is not KV).
[[maybe_unused]] double weight_params(const model::ModelConfig& c) {
  const double qd = double(c.n_heads) * c.head_dim, kvd = double(c.n_kv_heads) * c.head_dim;
  const double per_layer = c.dim * qd * 2 + c.dim * kvd * 2 + 3.0 * c.dim * c.hidden_dim + 2.0 * c.dim;
  return per_layer * c.n_layers + double(c.vocab_size) * c.dim * (c.tied_embeddings ? 1 : 2) + c.dim;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Sizes checked before anything loads; those that need the model are checked once it is loaded.
Status check_sizes(const ServeCli& o) {
  if (!(o.max_body_mib > 0 && o.max_body_mib <= 1024))
    return invalid_argument("--max-body-mib " + num(o.max_body_mib) + " is not valid; use (0, 1024] MiB");
  if (!(o.kv_gib >= 0 && o.kv_gib <= double(1 << 20)))
    return invalid_argument("--kv-cache-memory " + num(o.kv_gib) + " is not valid; use 0 (room for "
                            "--max-num-seqs full sequences) or a budget in GiB");
  if (o.max_model_len < 0)
    return invalid_argument("--max-model-len " + std::to_string(o.max_model_len) +
                            " is not valid; use 0 (the model's context) or a length in tokens");
  if (o.max_batched_tokens < 0)
    return invalid_argument("--max-num-batched-tokens " + std::to_string(o.max_batched_tokens) +
                            " is not valid; use 0 (two prefill chunks) or a token budget");
  return Status::ok();
}

int run_serve(const ServeCli& o) {
  if (Status st = check_sizes(o); !st.is_ok()) return fail(st);
  Result<QuantSpec> spec = invalid_argument("no spec");
  auto run = open_model_run({o.cache.backend, o.model, o.tokenizer, o.threads, o.cache.numerics}, [&](backend::BackendKind kind) {
    spec = to_quant_spec(o.cache, kind);
    return spec.status();
  });
  if (!run.is_ok()) return fail(run.status());
  const backend::BackendKind kind = run.value().kind;
  const model::Model& mod = *run.value().model;
  backend::Backend& be = *run.value().backend;
  const model::ModelConfig& c = mod.config();
  if (o.max_model_len > c.max_seq_len)
    return fail(invalid_argument("--max-model-len " + std::to_string(o.max_model_len) + " exceeds the context of " +
                                 c.name + " (" + std::to_string(c.max_seq_len) + " tokens)"));

  model::EngineOptions eo;
  eo.max_seqs = o.max_seqs;
  eo.max_tokens = o.max_model_len;
  eo.chunk_tokens = o.chunk_tokens;
  eo.batch_invariant = o.batch_invariant;
  // Rows per step: a GPU needs far more than the CPU's default of two chunks to stay busy (with 256 the
  // H200 prefilled 7k-token prompts at ~15k tokens/s; bench/results/2026-12-01-h200-merged).
  const int step_tokens =
      o.max_batched_tokens > 0 ? o.max_batched_tokens : (kind == backend::BackendKind::kCuda ? 2048 : 0);
  eo.max_step_tokens = step_tokens;  // 0: the engine's default
  const int ctx = o.max_model_len > 0 ? o.max_model_len : c.max_seq_len;
  double budget_gib = o.kv_gib;
  if (o.gpu_util > 0) {
    if (o.kv_gib > 0) return fail(invalid_argument("give --kv-cache-memory or --gpu-memory-utilization, not both"));
#ifdef KVQ_HAVE_CUDA
    if (kind != backend::BackendKind::kCuda)
      return fail(invalid_argument("--gpu-memory-utilization needs --backend cuda; use --kv-cache-memory GiB on the cpu"));
    auto dev = cuda_device_info();
    if (!dev.is_ok()) return fail(dev.status());
    // What is not KV: bf16 weights plus a reserve for activations and workspaces.
    const double other = weight_params(c) * 2 + 2.0 * (1 << 30);
    budget_gib = (o.gpu_util * double(dev.value().global_mem_bytes) - other) / double(1 << 30);
    if (budget_gib <= 0) return fail(invalid_argument("--gpu-memory-utilization leaves no room for the KV cache; raise it"));
#else
    return fail(unsupported("--gpu-memory-utilization needs a CUDA build; use --kv-cache-memory GiB"));
#endif
  }
  if (budget_gib > 0) {
    const serve::KvGeometry g{c.name, c.n_layers, c.n_kv_heads, c.head_dim, c.n_heads};
    auto pools = serve::plan_kv_pools(spec.value(), g, o.max_seqs, ctx, static_cast<size_t>(budget_gib * double(1 << 30)),
                                      o.chunk_tokens);
    if (!pools.is_ok()) return fail(pools.status());
    eo.num_pages = pools.value().num_pages;
    eo.num_sink_pages = pools.value().num_sink_pages;
    eo.num_recent_pages = pools.value().num_recent_pages;
  }
  auto engine = model::Engine::create(mod, spec.value(), be, eo);
  if (!engine.is_ok())  // name the flags that sized what the engine refused
    return fail(Status(engine.status().code(),
                       "--max-num-seqs " + std::to_string(o.max_seqs) + ", context " + std::to_string(ctx) +
                           ", --chunk-tokens " + std::to_string(o.chunk_tokens) +
                           (budget_gib > 0 ? ", a KV budget of " + num(budget_gib) + " GiB (--kv-cache-memory)" : "") +
                           ": " + engine.status().message()));
  serve::SchedulerOptions so;
  so.max_step_tokens = step_tokens;
  so.exact_recompute = !o.fast_recompute;
  so.prefix_sharing = !o.no_prefix_sharing;
  so.prefix_cache_seqs = o.prefix_cache_seqs;
  auto sched = serve::Scheduler::create(*engine.value(), so);
  if (!sched.is_ok()) return fail(sched.status());

  serve::ServerOptions sv;
  sv.host = o.host;
  sv.port = o.port;
  sv.model_id = o.served_name.empty() ? o.model : o.served_name;
  sv.aliases = {o.model, c.name};
  sv.max_body_bytes = static_cast<size_t>(o.max_body_mib * 1048576.0);
  sv.http_threads = o.http_threads;
  auto server = serve::Server::create(*sched.value(), sv);
  if (!server.is_ok()) return fail(server.status());

  const auto& book = engine.value()->book();
  const auto& geo = book.geometry();
  const double page_b = double(cache::bytes_per_page(spec.value(), geo.num_layers, geo.num_kv_heads, geo.head_dim));
  const double mib = 1048576.0;
  std::fprintf(stderr, "model %s: %d layers, %d/%d heads of %d, context %d\n", c.name.c_str(), c.n_layers, c.n_heads,
               c.n_kv_heads, c.head_dim, engine.value()->max_tokens());
  std::fprintf(stderr, "engine %s; kv cache %s, %zu bytes/token\n", be.describe().c_str(),
               spec.value().to_string().c_str(),
               cache::bytes_per_token(spec.value(), geo.num_layers, geo.num_kv_heads, geo.head_dim));
  std::fprintf(stderr, "pools: %d main pages (%.1f MiB), %d sink pages; up to %d sequences, step budget %d tokens%s\n",
               book.pool().num_pages(), book.pool().num_pages() * page_b / mib, book.sink_pool().num_pages(),
               o.max_seqs, sched.value()->options().max_step_tokens, o.batch_invariant ? ", batch-invariant" : "");
  const Status st = server.value()->start();
  if (!st.is_ok()) return fail(st);
  std::fprintf(stderr, "serving '%s' on http://%s:%d (/v1/completions, /v1/chat/completions, /v1/models, /health, "
               "/metrics); Ctrl-C drains and stops\n", server.value()->model_id().c_str(), o.host.c_str(),
               server.value()->port());

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  while (g_signal.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::fprintf(stderr, "kvq serve: signal %d: draining requests in flight...\n", g_signal.load());
  server.value()->stop();
  const serve::SchedulerCounters k = sched.value()->counters();
  std::fprintf(stderr, "kvq serve: stopped; %llu requests done, %llu cancelled, %llu failed, %llu preemptions, "
               "%llu tokens generated\n", (unsigned long long)k.finished, (unsigned long long)k.cancelled,
               (unsigned long long)k.failed, (unsigned long long)k.preemptions, (unsigned long long)k.generated_tokens);
  return 0;
}

const RegisterCommand kRegister{Command{[](CLI::App& app) -> std::function<int()> {
  auto o = std::make_shared<ServeCli>();
  CLI::App* sub = app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching over the quantized KV cache");
  sub->add_option("--model,-m", o->model, "Model file (GGUF or llama2.c), or an alias: smollm2, stories260K")->capture_default_str();
  sub->add_option("--tokenizer", o->tokenizer, "llama2.c tokenizer file (default: tok<vocab>.bin beside the model)");
  sub->add_option("--served-model-name", o->served_name, "Name clients put in \"model\" (default: the --model value)");
  sub->add_option("--host", o->host, "Address to listen on")->capture_default_str();
  sub->add_option("--port", o->port, "Port to listen on (0: any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
  add_cache_options(sub, o->cache, CacheCommand::kServe);
  sub->add_option("--threads", o->threads, "BLAS threads for the matrix products (cpu; default: the BLAS default)");
  sub->add_option("--max-num-seqs", o->max_seqs, "Sequences running at once")->capture_default_str()->check(CLI::Range(1, 4096));
  sub->add_option("--max-model-len", o->max_model_len, "Context per sequence (0: the model's)")->capture_default_str();
  sub->add_option("--kv-cache-memory", o->kv_gib, "KV budget in GiB for the page pools, sinks included (0: room for "
                  "--max-num-seqs full sequences)")->capture_default_str();
  sub->add_option("--gpu-memory-utilization", o->gpu_util, "cuda: fraction of device memory for weights + KV (the KV "
                  "budget is what the weights and a 2 GiB reserve leave)")->check(CLI::Range(0.0, 1.0));
  sub->add_option("--max-num-batched-tokens", o->max_batched_tokens, "Token budget per scheduler step (0: 2048 on cuda, 2 chunks on the cpu)")
      ->capture_default_str();
  sub->add_option("--chunk-tokens", o->chunk_tokens, "Prefill chunk per sequence")->capture_default_str()->check(CLI::Range(1, 8192));
  sub->add_flag("--batch-invariant", o->batch_invariant, "Matrix products per sequence: every result bit-identical to "
                "the request run alone (slower batched decode)");
  sub->add_flag("--fast-recompute", o->fast_recompute, "Recompute a preempted request's generated tokens as one "
                "prefill (faster; may differ by rounding from the uninterrupted run)");
  sub->add_flag("--no-prefix-sharing", o->no_prefix_sharing, "Compute every prompt in full instead of sharing the "
                "pages of a running request's identical prompt prefix (whole prefill chunks)");
  sub->add_option("--prefix-cache-seqs", o->prefix_cache_seqs, "Finished prompts whose whole-chunk prefix pages "
                  "stay for later requests to share (least recently used out; they give way to running requests)")
      ->capture_default_str()->check(CLI::Range(0, 4096));
  sub->add_option("--max-body-mib", o->max_body_mib, "Largest request body (MiB)")->capture_default_str();
  sub->add_option("--http-threads", o->http_threads, "Connections served at once (a stream holds one)")->capture_default_str();
  return [o] { return run_serve(*o); };
}}};

}  // namespace
}  // namespace kvq::tools
