// The load generator of `kvq bench serve`.
#include "kvq/serve/loadgen.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <ctime>
#include <mutex>
#include <random>
#include <thread>

namespace kvq::serve {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string base_url(std::string url) {
  while (!url.empty() && url.back() == '/') url.pop_back();
  if (url.size() >= 3 && url.compare(url.size() - 3, 3, "/v1") == 0) url.resize(url.size() - 3);
  return url;
}

// A sample of a Prometheus text body: the first line that starts with `name` followed by a space
// or '{', summed over its label sets. -1 when absent.
double scrape(const std::string& text, const std::string& name) {
  double sum = -1;
  size_t at = 0;
  while ((at = text.find(name, at)) != std::string::npos) {
    const bool line_start = at == 0 || text[at - 1] == '\n';
    const size_t after = at + name.size();
    if (line_start && after < text.size() && (text[after] == ' ' || text[after] == '{')) {
      const size_t sp = text.find(' ', text[after] == '{' ? text.find('}', after) : after);
      if (sp != std::string::npos) sum = std::max(sum, 0.0) + std::atof(text.c_str() + sp + 1);
    }
    at = after;
  }
  return sum;
}

std::string spec_label(const std::string& metrics) {
  const std::string key = "kvq_kv_cache_bytes_per_token{spec=\"";
  const size_t at = metrics.find(key);
  if (at == std::string::npos) return "";
  const size_t end = metrics.find('"', at + key.size());
  return end == std::string::npos ? "" : metrics.substr(at + key.size(), end - at - key.size());
}

RequestResult one_request(const LoadOptions& o, const std::string& url, const std::string& model,
                          const std::string& prompt, int tier, int index, Clock::time_point tier_start) {
  RequestResult r;
  r.tier = tier;
  r.index = index;
  r.start_s = since(tier_start);
  httplib::Client c(url);
  const auto to = static_cast<time_t>(o.request_timeout_s);
  c.set_connection_timeout(30, 0);
  c.set_read_timeout(to, 0);
  c.set_write_timeout(to, 0);
  json body = {{"model", model}, {"prompt", prompt}, {"max_tokens", o.max_tokens}, {"temperature", 0},
               {"stream", true}, {"ignore_eos", true}, {"stream_options", {{"include_usage", true}}}};
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  std::string buf, raw;
  const Clock::time_point t0 = Clock::now();
  double first = -1;
  int chunks = 0;
  bool done = false;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buf.append(data, n);
    if (raw.size() < 4096) raw.append(data, std::min<size_t>(n, 4096 - raw.size()));
    size_t end;
    while ((end = buf.find("\n\n")) != std::string::npos) {
      const std::string ev = buf.substr(0, end);
      buf.erase(0, end + 2);
      if (ev.rfind("data: ", 0) != 0) continue;
      const std::string d = ev.substr(6);
      if (d == "[DONE]") {
        done = true;
        continue;
      }
      json j = json::parse(d, nullptr, false);
      if (j.is_discarded() || !j.is_object()) continue;
      if (j.contains("error")) r.error = j["error"].dump();
      if (j.contains("usage") && j["usage"].is_object()) {
        r.prompt_tokens = j["usage"].value("prompt_tokens", 0);
        r.completion_tokens = j["usage"].value("completion_tokens", 0);
      }
      if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
        const json& ch = j["choices"][0];
        const bool text = (ch.contains("text") && ch["text"].is_string() && !ch["text"].get<std::string>().empty()) ||
                          (ch.contains("delta") && ch["delta"].contains("content"));
        if (text) {
          ++chunks;
          if (first < 0) first = since(t0);
        }
      }
    }
    return true;
  };
  auto res = c.send(req);
  r.e2e_s = since(t0);
  if (!res) {
    r.error = "no response (" + httplib::to_string(res.error()) + ")";
    return r;
  }
  if (res->status != 200) {
    r.error = "HTTP " + std::to_string(res->status) + ": " + raw.substr(0, 300);
    return r;
  }
  if (!done && r.error.empty()) r.error = "stream ended without [DONE]";
  if (r.completion_tokens == 0) r.completion_tokens = chunks;  // a server without usage chunks
  r.ttft_s = first >= 0 ? first : r.e2e_s;
  if (r.completion_tokens > 1) r.tpot_s = (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1);
  r.ok = r.error.empty() && r.completion_tokens > 0;
  return r;
}

}  // namespace

void PromptSource::prepare() {
  ids_.clear();
  if (tok == nullptr) return;
  for (const std::string& t : texts) ids_.push_back(tok->encode(t, false));
}

std::string PromptSource::cut(int tokens, uint64_t seed, int index) const {
  if (texts.empty() || tokens <= 0) return "";
  const size_t which = static_cast<size_t>(index) % texts.size();
  const std::string& t = texts[which];
  const uint64_t h = mix(seed * 1000003ull + static_cast<uint64_t>(index));
  if (tok != nullptr && which < ids_.size() && !ids_[which].empty()) {
    std::vector<int32_t> ids = ids_[which];
    while (ids.size() < static_cast<size_t>(tokens) + 1) ids.insert(ids.end(), ids.begin(), ids.end());
    const size_t start = h % (ids.size() - static_cast<size_t>(tokens));
    return tok->decode(std::vector<int32_t>(ids.begin() + static_cast<long>(start),
                                            ids.begin() + static_cast<long>(start) + tokens));
  }
  std::string s = t;
  const size_t chars = static_cast<size_t>(tokens) * 4;
  while (s.size() < chars + 1) s += t;
  return s.substr(h % (s.size() - chars), chars);
}

Percentiles percentiles(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[static_cast<size_t>(std::max(0.0, std::ceil(q * double(v.size())) - 1))]; };
  p.p50 = at(0.5), p.p90 = at(0.9), p.p99 = at(0.99);
  double s = 0;
  for (double x : v) s += x;
  p.mean = s / double(v.size());
  return p;
}

Result<LoadReport> run_load(const LoadOptions& o, const PromptSource& prompts) {
  if (o.prompts_per_tier < 1 || o.max_tokens < 1 || o.max_concurrency < 1 || o.tiers.empty())
    return invalid_argument("bench serve: need at least one tier, one prompt per tier, max_tokens >= 1, concurrency >= 1");
  if (!(o.rate >= 0)) return invalid_argument("bench serve: --rate must be >= 0 (0: max throughput)");
  LoadReport rep;
  rep.opts = o;
  rep.url = base_url(o.url);
  httplib::Client probe(rep.url);
  probe.set_connection_timeout(10, 0);
  probe.set_read_timeout(30, 0);
  auto models = probe.Get("/v1/models");
  if (!models || models->status != 200)
    return invalid_argument("cannot reach an OpenAI-compatible server at " + rep.url +
                            " (GET /v1/models failed); start one (kvq serve) or pass --url");
  rep.model = o.model;
  if (rep.model.empty()) {
    json j = json::parse(models->body, nullptr, false);
    if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty())
      return invalid_argument("the server at " + rep.url + " lists no model; pass --model");
    rep.model = j["data"][0].value("id", "");
  }
  auto metrics_text = [&]() -> std::string {
    auto m = probe.Get("/metrics");
    return m && m->status == 200 ? m->body : std::string();
  };
  rep.label = o.label.empty() ? spec_label(metrics_text()) : o.label;
  if (rep.label.empty()) rep.label = rep.model;
  {
    const std::time_t now = std::time(nullptr);
    char b[64];
    std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    rep.date = b;
  }
  std::mt19937_64 rng(o.seed);
  for (size_t ti = 0; ti < o.tiers.size(); ++ti) {
    const int target = o.tiers[ti];
    TierResult tr;
    tr.prompt_tokens_target = target;
    std::vector<std::string> texts;
    for (int i = 0; i < o.prompts_per_tier; ++i)
      texts.push_back(prompts.cut(target, o.seed + ti, i));
    std::vector<double> arrivals(static_cast<size_t>(o.prompts_per_tier), 0.0);
    if (o.rate > 0) {
      std::exponential_distribution<double> gap(o.rate);
      double t = 0;
      for (double& a : arrivals) a = t += gap(rng);
    }
    const std::string m0 = metrics_text();
    const double pre0 = std::max(scrape(m0, "kvq_preemptions_total"), scrape(m0, "vllm:num_preemptions_total"));
    std::mutex mu;
    std::condition_variable cv;
    int in_flight = 0;
    std::vector<RequestResult> results(static_cast<size_t>(o.prompts_per_tier));
    std::vector<uint8_t> sent(results.size(), 0);
    std::vector<std::thread> threads;
    const Clock::time_point start = Clock::now();
    for (size_t i = 0; i < results.size(); ++i) {
      const double wait = arrivals[i] - since(start);
      if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return in_flight < o.max_concurrency; });
        if (since(start) > o.max_seconds) break;
        ++in_flight;
      }
      sent[i] = 1;
      threads.emplace_back([&, i] {
        results[i] = one_request(o, rep.url, rep.model, texts[i], target, static_cast<int>(i), start);
        std::lock_guard<std::mutex> lock(mu);
        --in_flight;
        cv.notify_all();
      });
    }
    for (auto& t : threads) t.join();
    tr.wall_s = since(start);
    const std::string m1 = metrics_text();
    const double pre1 = std::max(scrape(m1, "kvq_preemptions_total"), scrape(m1, "vllm:num_preemptions_total"));
    tr.preemptions = pre0 >= 0 && pre1 >= 0 ? pre1 - pre0 : -1;
    tr.max_running = scrape(m1, "kvq_requests_max_running");
    tr.peak_kv_bytes = scrape(m1, "kvq_kv_cache_peak_bytes");
    std::vector<double> ttft, tpot, e2e;
    double prompt_sum = 0, out_tokens = 0;
    for (size_t i = 0; i < results.size(); ++i) {
      if (!sent[i]) continue;
      const RequestResult& r = results[i];
      ++tr.requests;
      if (!r.ok) {
        ++tr.errors;
      } else {
        ++tr.ok;
        ttft.push_back(r.ttft_s);
        e2e.push_back(r.e2e_s);
        if (r.completion_tokens > 1) tpot.push_back(r.tpot_s);
        prompt_sum += r.prompt_tokens;
        out_tokens += r.completion_tokens;
      }
      tr.results.push_back(r);
    }
    tr.ttft = percentiles(ttft);
    tr.tpot = percentiles(tpot);
    tr.e2e = percentiles(e2e);
    tr.prompt_tokens_mean = tr.ok > 0 ? prompt_sum / tr.ok : 0;
    tr.output_tok_per_s = tr.wall_s > 0 ? out_tokens / tr.wall_s : 0;
    rep.tiers.push_back(std::move(tr));
  }
  return rep;
}

namespace {
json pct_json(const Percentiles& p) { return {{"p50", p.p50}, {"p90", p.p90}, {"p99", p.p99}, {"mean", p.mean}}; }
Percentiles pct_from(const json& j) {
  Percentiles p;
  p.p50 = j.value("p50", 0.0), p.p90 = j.value("p90", 0.0), p.p99 = j.value("p99", 0.0), p.mean = j.value("mean", 0.0);
  return p;
}
}  // namespace

json report_json(const LoadReport& r, bool with_requests) {
  json j = {{"url", r.url}, {"model", r.model}, {"label", r.label}, {"date", r.date},
            {"options", {{"prompts_per_tier", r.opts.prompts_per_tier}, {"max_tokens", r.opts.max_tokens},
                         {"rate", r.opts.rate}, {"max_concurrency", r.opts.max_concurrency},
                         {"max_seconds", r.opts.max_seconds}, {"seed", r.opts.seed}, {"tiers", r.opts.tiers}}},
            {"tiers", json::array()}};
  for (const TierResult& t : r.tiers) {
    json tj = {{"prompt_tokens_target", t.prompt_tokens_target}, {"prompt_tokens_mean", t.prompt_tokens_mean},
               {"requests", t.requests}, {"ok", t.ok}, {"errors", t.errors}, {"ttft_s", pct_json(t.ttft)},
               {"tpot_s", pct_json(t.tpot)}, {"e2e_s", pct_json(t.e2e)}, {"wall_s", t.wall_s},
               {"output_tok_per_s", t.output_tok_per_s}, {"preemptions", t.preemptions}, {"max_running", t.max_running},
               {"peak_kv_bytes", t.peak_kv_bytes}};
    if (with_requests) {
      tj["requests_detail"] = json::array();
      for (const RequestResult& q : t.results)
        tj["requests_detail"].push_back({{"index", q.index}, {"ok", q.ok}, {"error", q.error}, {"start_s", q.start_s},
                                         {"ttft_s", q.ttft_s}, {"tpot_s", q.tpot_s}, {"e2e_s", q.e2e_s},
                                         {"prompt_tokens", q.prompt_tokens}, {"completion_tokens", q.completion_tokens}});
    }
    j["tiers"].push_back(tj);
  }
  return j;
}

Result<LoadReport> report_from_json(const json& j) {
  if (!j.is_object() || !j.contains("tiers") || !j["tiers"].is_array())
    return invalid_argument("not a `kvq bench serve` result (no \"tiers\" array)");
  LoadReport r;
  r.url = j.value("url", ""), r.model = j.value("model", ""), r.label = j.value("label", ""), r.date = j.value("date", "");
  for (const json& t : j["tiers"]) {
    TierResult tr;
    tr.prompt_tokens_target = t.value("prompt_tokens_target", 0);
    tr.prompt_tokens_mean = t.value("prompt_tokens_mean", 0.0);
    tr.requests = t.value("requests", 0), tr.ok = t.value("ok", 0), tr.errors = t.value("errors", 0);
    tr.ttft = pct_from(t.value("ttft_s", json::object()));
    tr.tpot = pct_from(t.value("tpot_s", json::object()));
    tr.e2e = pct_from(t.value("e2e_s", json::object()));
    tr.wall_s = t.value("wall_s", 0.0), tr.output_tok_per_s = t.value("output_tok_per_s", 0.0);
    tr.preemptions = t.value("preemptions", -1.0), tr.max_running = t.value("max_running", -1.0);
    tr.peak_kv_bytes = t.value("peak_kv_bytes", -1.0);
    r.tiers.push_back(tr);
  }
  return r;
}

std::string report_markdown(const LoadReport& r) {
  std::string o = "`kvq bench serve` against " + r.url + " (model " + r.model + ", " + r.label + "), " + r.date + "\n\n";
  o += "| tier | prompt tok | ok/err | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | e2e p50 (s) | out tok/s | "
       "preemptions | max running | peak KV MB |\n";
  o += "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const TierResult& t : r.tiers) {
    char b[512];
    std::snprintf(b, sizeof b, "| %d | %.0f | %d/%d | %.1f / %.1f / %.1f | %.2f / %.2f / %.2f | %.2f | %.1f | %s | %.0f | %.2f |\n",
                  t.prompt_tokens_target, t.prompt_tokens_mean, t.ok, t.errors, t.ttft.p50 * 1e3, t.ttft.p90 * 1e3,
                  t.ttft.p99 * 1e3, t.tpot.p50 * 1e3, t.tpot.p90 * 1e3, t.tpot.p99 * 1e3, t.e2e.p50, t.output_tok_per_s,
                  t.preemptions < 0 ? "n/a" : std::to_string(static_cast<long long>(t.preemptions)).c_str(), t.max_running,
                  t.peak_kv_bytes / 1e6);
    o += b;
  }
  return o;
}

std::string compare_markdown(const std::vector<LoadReport>& runs, double factor, bool* all_pass) {
  *all_pass = true;
  if (runs.empty()) return "";
  size_t base = 0;
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].label.rfind("bf16", 0) == 0) {
      base = i;
      break;
    }
  char b[640];
  std::snprintf(b, sizeof b, "SLA: P99 TTFT and P99 TPOT of each spec at most %.2fx the baseline (%s), per tier.\n\n",
                factor, runs[base].label.c_str());
  std::string o = b;
  o += "| tier | spec | TTFT p99 (ms) | x base | TPOT p99 (ms) | x base | out tok/s | x base | preemptions | verdict |\n";
  o += "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|\n";
  for (size_t t = 0; t < runs[base].tiers.size(); ++t) {
    const TierResult& bt = runs[base].tiers[t];
    for (const LoadReport& r : runs) {
      if (t >= r.tiers.size()) continue;
      const TierResult& x = r.tiers[t];
      const double rt = bt.ttft.p99 > 0 ? x.ttft.p99 / bt.ttft.p99 : 0;
      const double rp = bt.tpot.p99 > 0 ? x.tpot.p99 / bt.tpot.p99 : 0;
      const double rq = bt.output_tok_per_s > 0 ? x.output_tok_per_s / bt.output_tok_per_s : 0;
      const bool pass = x.errors == 0 && rt <= factor && rp <= factor;
      *all_pass = *all_pass && pass;
      std::snprintf(b, sizeof b, "| %d | %s | %.1f | %.2f | %.2f | %.2f | %.1f | %.2f | %.0f | %s |\n", bt.prompt_tokens_target,
                    r.label.c_str(), x.ttft.p99 * 1e3, rt, x.tpot.p99 * 1e3, rp, x.output_tok_per_s, rq, x.preemptions,
                    pass ? "PASS" : (x.errors ? "FAIL (errors)" : "FAIL"));
      o += b;
    }
  }
  return o;
}

}  // namespace kvq::serve
