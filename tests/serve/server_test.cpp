// `kvq serve` in process on an ephemeral loopback port: 32 concurrent streaming clients against a
// pool small enough to force preemption (0 errors, every greedy completion identical to the same
// prompt run alone), malformed requests answered 4xx with a JSON body, bounded resident memory,
// client disconnects cancelling, and graceful shutdown draining the requests in flight.
#include "kvq/serve/server.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "serve/serve_test_util.h"
#include "model/stories_data.h"

namespace kvq::serve {
namespace {

using nlohmann::json;
using testing::prompt_ids;
using testing::run_alone;
using testing::spec;
using testing::stories;

// Under AddressSanitizer freed blocks wait in its quarantine (256 MiB by default) instead of being
// reused, so resident memory grows between rounds without a leak; there LeakSanitizer
// (detect_leaks=1 in scripts/test.sh) checks for leaks at exit instead of the RSS bound below.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

double resident_mib() {
  std::ifstream f("/proc/self/statm");
  long size = 0, resident = 0;
  f >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / 1048576.0;
}

struct Stack {
  std::unique_ptr<backend::Backend> be;
  std::unique_ptr<model::Engine> engine;
  std::unique_ptr<Scheduler> sched;
  std::unique_ptr<Server> server;
  explicit Stack(const QuantSpec& s, int max_seqs, int num_pages) {
    be = std::move(backend::create_backend(backend::BackendKind::kCpu).value());
    model::EngineOptions eo;
    eo.max_seqs = max_seqs;
    eo.num_pages = num_pages;
    eo.batch_invariant = true;  // bit-identical to the same prompt run alone
    engine = std::move(model::Engine::create(stories(), s, *be, eo).value());
    sched = std::move(Scheduler::create(*engine).value());
    ServerOptions so;
    so.port = 0;
    so.aliases = {"stories260K"};
    auto sv = Server::create(*sched, so);
    EXPECT_TRUE(sv.is_ok()) << sv.status().to_string();
    server = std::move(sv).value();
    const Status st = server->start();
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", server->port());
    c.set_read_timeout(60, 0);
    c.set_write_timeout(60, 0);
    return c;
  }
};

struct Streamed {
  std::string text, finish_reason;
  bool done = false;
  int usage_completion = -1;
  std::string error;
};

Streamed parse_sse(const std::string& body, bool chat) {
  Streamed s;
  size_t at = 0;
  while (at < body.size()) {
    size_t end = body.find("\n\n", at);
    if (end == std::string::npos) end = body.size();
    const std::string ev = body.substr(at, end - at);
    at = end + 2;
    if (ev.rfind("data: ", 0) != 0) continue;
    const std::string data = ev.substr(6);
    if (data == "[DONE]") {
      s.done = true;
      continue;
    }
    json j = json::parse(data, nullptr, false);
    if (j.is_discarded()) {
      s.error = "bad event: " + data;
      continue;
    }
    if (j.contains("error")) s.error = j["error"].dump();
    if (j.contains("usage") && j["usage"].is_object()) s.usage_completion = j["usage"]["completion_tokens"].get<int>();
    if (!j.contains("choices") || j["choices"].empty()) continue;
    const json& c = j["choices"][0];
    if (chat) {
      if (c["delta"].contains("content")) s.text += c["delta"]["content"].get<std::string>();
    } else {
      s.text += c["text"].get<std::string>();
    }
    if (!c["finish_reason"].is_null()) s.finish_reason = c["finish_reason"].get<std::string>();
  }
  return s;
}

double metric(const std::string& text, const std::string& name) {
  const size_t at = text.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name.size() + 2));
}

TEST(Server, ConcurrentStreamingClientsUnderPreemptionMatchAlone) {
  KVQ_REQUIRE_STORIES260K();
  const QuantSpec s = spec(Format::kInt8, 16);
  // 16 sequences may run, but 40 pages of 16 tokens hold only about 4 of these requests at once.
  Stack st(s, 16, 40);
  constexpr int kClients = 32, kNew = 40;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> expected;
  for (int i = 0; i < kClients; ++i) {
    prompts.push_back(prompt_ids(100 + i, 20 + 5 * i));
    expected.push_back(stories().tokenizer().decode(run_alone(s, prompts.back(), kNew)));
  }
  double rss_first = 0;
  for (int round = 0; round < 2; ++round) {
    std::vector<Streamed> got(kClients);
    std::vector<int> status(kClients, 0);
    std::vector<std::thread> threads;
    for (int i = 0; i < kClients; ++i)
      threads.emplace_back([&, i] {
        const auto t0 = std::chrono::steady_clock::now();
        httplib::Client c = st.client();
        json body = {{"model", "stories260K"}, {"prompt", prompts[size_t(i)]}, {"max_tokens", kNew},
                     {"temperature", 0}, {"stream", true}, {"stream_options", {{"include_usage", true}}}};
        auto r = c.Post("/v1/completions", body.dump(), "application/json");
        if (!r) {
          got[size_t(i)].text = "no response: " + httplib::to_string(r.error()) + " after " +
                                std::to_string(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()) + " s";
          return;
        }
        status[size_t(i)] = r->status;
        got[size_t(i)] = parse_sse(r->body, false);
        if (r->status != 200) got[size_t(i)].text = r->body;
      });
    for (auto& t : threads) t.join();
    for (int i = 0; i < kClients; ++i) {
      ASSERT_EQ(status[size_t(i)], 200) << "client " << i << " round " << round << ": " << got[size_t(i)].text
                                        << " (server saw " << st.sched->counters().cancelled << " cancellations)";
      EXPECT_TRUE(got[size_t(i)].done) << "client " << i;
      EXPECT_EQ(got[size_t(i)].error, "") << "client " << i;
      EXPECT_FALSE(got[size_t(i)].finish_reason.empty());
      EXPECT_GT(got[size_t(i)].usage_completion, 0);
      EXPECT_EQ(got[size_t(i)].text, expected[size_t(i)]) << "client " << i << " round " << round;
    }
    if (round == 0) rss_first = resident_mib();
  }
  const double rss_last = resident_mib();
  std::printf("resident memory after rounds 1 and 2: %.1f and %.1f MiB\n", rss_first, rss_last);
  if (!kAddressSanitizer) {
    EXPECT_LT(rss_last - rss_first, 32.0) << "resident memory grew from " << rss_first << " to " << rss_last << " MiB";
  }
  httplib::Client c = st.client();
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  EXPECT_GT(metric(m->body, "kvq_preemptions_total"), 0) << "the pool should force preemption";
  EXPECT_EQ(metric(m->body, "kvq_requests_total{outcome=\"error\"}"), 0);
  // The pool ran full: the peak is all 40 main pages (int8, 5 layers x 4 heads x 8, scales) plus sinks.
  EXPECT_GE(metric(m->body, "kvq_kv_cache_peak_bytes"), 40.0 * 16 * 5 * 2 * 4 * (8 + 4));
  EXPECT_EQ(metric(m->body, "kvq_time_to_first_token_seconds_count"), 2 * kClients);
  EXPECT_NE(m->body.find("kvq_kv_cache_pages{pool=\"sink\",state=\"free\"}"), std::string::npos);
  EXPECT_NE(m->body.find("kvq_kv_cache_bytes_per_token{spec=\"int8/per_token_head/b16/sink16\"}"), std::string::npos);
  st.server->stop();
}

TEST(Server, MalformedRequestsGet4xxWithJsonErrors) {
  KVQ_REQUIRE_STORIES260K();
  Stack st(spec(Format::kInt8, 16), 4, 0);
  httplib::Client c = st.client();
  std::string long_text;
  for (int i = 0; i < 400; ++i) long_text += "Once upon a time there was a cat. ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/v1/completions", "this is not json"},
      {"/v1/completions", "[1, 2, 3]"},
      {"/v1/completions", R"({"prompt": 5})"},
      {"/v1/completions", R"({"prompt": "hi", "max_tokens": -5})"},
      {"/v1/completions", R"({"prompt": "hi", "max_tokens": "ten"})"},
      {"/v1/completions", R"({"prompt": "hi", "temperature": "hot"})"},
      {"/v1/completions", R"({"prompt": "hi", "top_p": 0})"},
      {"/v1/completions", R"({"prompt": "hi", "stream": "yes"})"},
      {"/v1/completions", R"({"prompt": "hi", "model": "gpt-4"})"},
      {"/v1/completions", R"({"prompt": "hi", "model": 7})"},
      {"/v1/completions", json{{"prompt", long_text}}.dump()},
      {"/v1/completions", R"({"prompt": "hi", "max_tokens": 100000})"},
      {"/v1/completions", R"({"prompt": [1, -3]})"},
      {"/v1/completions", R"({"prompt": [1, 99999]})"},
      {"/v1/completions", R"({"prompt": "hi", "n": 3})"},
      {"/v1/chat/completions", R"({"messages": []})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "wizard", "content": "x"}]})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": 5}]})"},
      {"/v1/chat/completions", R"({"messages": "hello"})"},
      {"/v1/completions", std::string(10 << 20, 'x')},  // 10 MB body
      {"/v1/nothing", "{}"},
      {"/v1/completions", R"({"prompt": "hi", "stop": 5})"},
  };
  for (const auto& [path, body] : cases) {
    auto r = c.Post(path, body, "application/json");
    ASSERT_TRUE(r) << path << " " << body.substr(0, 80) << ": " << httplib::to_string(r.error());
    EXPECT_GE(r->status, 400) << body.substr(0, 80);
    EXPECT_LT(r->status, 500) << body.substr(0, 80);
    json j = json::parse(r->body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "not JSON: " << r->body.substr(0, 200);
    ASSERT_TRUE(j.contains("error") && j["error"]["message"].is_string()) << r->body;
    EXPECT_FALSE(j["error"]["message"].get<std::string>().empty());
  }
  // The server still serves after all that.
  auto ok = c.Post("/v1/completions", R"({"prompt": "Once upon", "max_tokens": 4})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(json::parse(ok->body)["usage"]["completion_tokens"], 4);
  st.server->stop();
}

TEST(Server, ModelsHealthChatAndStopStrings) {
  KVQ_REQUIRE_STORIES260K();
  Stack st(spec(Format::kBf16, 0), 4, 0);
  httplib::Client c = st.client();
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  json mj = json::parse(models->body);
  EXPECT_EQ(mj["data"][0]["id"], st.server->model_id());
  EXPECT_EQ(mj["data"][0]["max_model_len"], 512);
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  // Chat, non-streamed and streamed, give the same greedy text.
  json chat = {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}}, {"max_tokens", 20}, {"temperature", 0}};
  auto a = c.Post("/v1/chat/completions", chat.dump(), "application/json");
  ASSERT_TRUE(a);
  ASSERT_EQ(a->status, 200) << a->body;
  json aj = json::parse(a->body);
  EXPECT_EQ(aj["object"], "chat.completion");
  const std::string text = aj["choices"][0]["message"]["content"];
  chat["stream"] = true;
  auto b = c.Post("/v1/chat/completions", chat.dump(), "application/json");
  ASSERT_TRUE(b);
  EXPECT_EQ(parse_sse(b->body, true).text, text);
  // A stop string cuts the text before it, with finish_reason "stop".
  ASSERT_GT(text.size(), 6u);
  const std::string stop = text.substr(text.size() / 2, 3);
  chat["stop"] = stop;
  chat["stream"] = false;
  auto d = c.Post("/v1/chat/completions", chat.dump(), "application/json");
  ASSERT_TRUE(d);
  json dj = json::parse(d->body);
  EXPECT_EQ(dj["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(dj["choices"][0]["message"]["content"], text.substr(0, text.find(stop)));
  st.server->stop();
}

TEST(Server, DisconnectCancelsAndStopDrains) {
  KVQ_REQUIRE_STORIES260K();
  Stack st(spec(Format::kInt8, 16), 4, 0);
  {
    // A client that hangs up after its first chunk.
    httplib::Client c = st.client();
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = json{{"prompt", "Once upon a time"}, {"max_tokens", 400}, {"stream", true}}.dump();
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [](const char*, size_t, uint64_t, uint64_t) { return false; };
    (void)c.send(req);
  }
  for (int i = 0; i < 200 && st.sched->counters().cancelled == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(st.sched->counters().cancelled, 1u);

  // Requests in flight when stop() begins still complete in full; a new one gets 503.
  std::vector<Streamed> got(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i)
    threads.emplace_back([&, i] {
      httplib::Client c = st.client();
      json body = {{"prompt", prompt_ids(i, 20)}, {"max_tokens", 100}, {"stream", true}, {"temperature", 0},
                   {"stream_options", {{"include_usage", true}}}};
      auto r = c.Post("/v1/completions", body.dump(), "application/json");
      if (r) got[size_t(i)] = parse_sse(r->body, false);
    });
  for (int i = 0; i < 500 && st.sched->counters().running < 3; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::thread stopper([&] { st.server->stop(); });
  for (int i = 0; i < 200 && st.sched->accepting(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  httplib::Client c = st.client();
  auto late = c.Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 2})", "application/json");
  if (late) {  // the listener may already be closed when the drain was quick
    EXPECT_EQ(late->status, 503);
    EXPECT_TRUE(json::parse(late->body).contains("error"));
  }
  for (auto& t : threads) t.join();
  stopper.join();
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(got[size_t(i)].done) << i;
    EXPECT_TRUE(got[size_t(i)].usage_completion == 100 || got[size_t(i)].finish_reason == "stop") << i;
  }
}

}  // namespace
}  // namespace kvq::serve
