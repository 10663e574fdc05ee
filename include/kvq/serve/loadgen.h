#pragma once
// `kvq bench serve`: a load generator for any OpenAI-compatible server (kvq serve, vLLM,
// llama-server). Context tiers of prompts cut from real text, Poisson arrivals at a rate or all at
// once (max throughput), bounded in count and time; per tier TTFT / TPOT / end-to-end percentiles,
// output tokens per second, errors, and the server's preemptions (from its /metrics).
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvq/common/status.h"
#include "kvq/model/tokenizer.h"

namespace kvq::serve {

struct LoadOptions {
  std::string url = "http://127.0.0.1:8000";
  std::string model;              // "model" sent; empty: the first id of GET /v1/models
  std::string label;              // name of this run (e.g. the cache spec); empty: from /metrics
  std::vector<int> tiers = {1024, 4096, 7168};  // prompt tokens per tier
  int prompts_per_tier = 50;
  int max_tokens = 128;           // output tokens per request (ignore_eos: always this many on kvq/vLLM)
  double rate = 0;                // requests per second, Poisson; 0: all at once (max throughput)
  int max_concurrency = 256;      // requests in flight at most
  double max_seconds = 600;       // per tier: no new request after this; in-flight ones get the timeout
  double request_timeout_s = 600;
  uint64_t seed = 1;
};

// A prompt cut from the texts: `tokens` tokens (counted with `tok` when given, else ~4 characters
// per token) starting at a position chosen by (seed, index).
struct PromptSource {
  std::vector<std::string> texts;          // e.g. TinyStories, pydoc topics
  const model::Tokenizer* tok = nullptr;   // optional: exact token counts
  void prepare();                          // encodes the texts once (with tok)
  std::string cut(int tokens, uint64_t seed, int index) const;

 private:
  std::vector<std::vector<int32_t>> ids_;
};

struct RequestResult {
  int tier = 0, index = 0;
  bool ok = false;
  std::string error;
  double start_s = 0;   // since the tier began
  double ttft_s = 0, e2e_s = 0, tpot_s = 0;
  int prompt_tokens = 0, completion_tokens = 0;
};

struct Percentiles {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
};
Percentiles percentiles(std::vector<double> v);

struct TierResult {
  int prompt_tokens_target = 0;
  double prompt_tokens_mean = 0;
  int requests = 0, ok = 0, errors = 0;
  Percentiles ttft, tpot, e2e;
  double wall_s = 0, output_tok_per_s = 0;
  double preemptions = -1, max_running = -1;  // from the server's /metrics (-1: not reported)
  double peak_kv_bytes = -1;                  // kvq_kv_cache_peak_bytes after the tier (a running peak)
  std::vector<RequestResult> results;
};

struct LoadReport {
  std::string url, model, label, date;
  LoadOptions opts;
  std::vector<TierResult> tiers;
};

// Runs every tier in turn. Errors of single requests are counted, not returned; a server that
// cannot be reached at all is kInvalidArgument naming the URL.
Result<LoadReport> run_load(const LoadOptions& opts, const PromptSource& prompts);

nlohmann::json report_json(const LoadReport& r, bool with_requests = true);
Result<LoadReport> report_from_json(const nlohmann::json& j);
std::string report_markdown(const LoadReport& r);

// The SLA check across runs (one per cache spec): per tier, P99 TTFT and P99 TPOT of each run at
// most `factor` x the baseline's (the run whose label starts with "bf16", else the first).
std::string compare_markdown(const std::vector<LoadReport>& runs, double factor, bool* all_pass);

}  // namespace kvq::serve
