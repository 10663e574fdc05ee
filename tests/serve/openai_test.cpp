// Request parsing, chat template, streamed text with stop strings, and the load generator's
// statistics and SLA verdict (against an in-process server).
#include "kvq/serve/openai.h"

#include <gtest/gtest.h>

#include "kvq/serve/loadgen.h"
#include "kvq/serve/server.h"
#include "serve/serve_test_util.h"
#include "model/stories_data.h"

namespace kvq::serve {
namespace {

using testing::stories;

TEST(OpenAi, ParsesCompletionAndChatRequests) {
  CompletionRequest r;
  ApiError e;
  ASSERT_TRUE(parse_completion_request(
      R"({"model":"m","prompt":"hi","max_tokens":7,"temperature":0.5,"top_p":0.9,"seed":-1,"stream":true,
          "stream_options":{"include_usage":true},"stop":["\n\n","END"],"ignore_eos":true,"unknown":1})",
      false, &r, &e))
      << e.message;
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.prompt, "hi");
  EXPECT_EQ(r.params.max_tokens, 7);
  EXPECT_TRUE(r.max_tokens_given);
  EXPECT_FLOAT_EQ(r.params.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.params.top_p, 0.9f);
  EXPECT_EQ(r.params.seed, ~uint64_t{0});
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_FALSE(r.params.stop_at_eos);
  EXPECT_EQ(r.stop.size(), 2u);
  ASSERT_TRUE(parse_completion_request(R"({"prompt":[1,2,3]})", false, &r, &e));
  EXPECT_TRUE(r.has_prompt_ids);
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_FLOAT_EQ(r.params.temperature, 1.f);  // OpenAI's default
  ASSERT_TRUE(parse_completion_request(
      R"({"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],
          "max_completion_tokens":3})",
      true, &r, &e));
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[1].content, "hi");
  EXPECT_EQ(r.params.max_tokens, 3);
  EXPECT_FALSE(parse_completion_request(R"({"prompt":"x","max_tokens":0})", false, &r, &e));
  EXPECT_EQ(e.param, "max_tokens");
  EXPECT_FALSE(parse_completion_request(R"({"prompt":["a","b"]})", false, &r, &e));
  EXPECT_FALSE(parse_completion_request(R"({"prompt":"x","temperature":3})", false, &r, &e));
  EXPECT_FALSE(parse_completion_request(R"({"prompt":"x","logprobs":5})", false, &r, &e));
  EXPECT_FALSE(parse_completion_request(R"({"messages":[{"content":"x"}]})", true, &r, &e));
  const nlohmann::json body = nlohmann::json::parse(e.body());
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
}

TEST(OpenAi, ChatPromptWithoutMarkersJoinsContents) {
  KVQ_REQUIRE_STORIES260K();
  const std::vector<ChatMessage> m = {{"system", "A"}, {"user", "B"}};
  EXPECT_EQ(chat_prompt_text(stories().tokenizer(), m), "A\nB");
}

TEST(OpenAi, TextStreamHoldsBackStopPrefixesAndCutsAtStop) {
  KVQ_REQUIRE_STORIES260K();
  const model::Tokenizer& tok = stories().tokenizer();
  const std::vector<int32_t> ids = tok.encode("Once upon a time there was a cat. The cat was big.", false);
  const std::string full = tok.decode(ids);
  // Without stop strings the streamed pieces add up to the decoded text.
  TextStream plain(tok, {});
  std::string got;
  for (int32_t id : ids) got += plain.feed(id);
  got += plain.finish();
  EXPECT_EQ(got, full);
  // With one, the text ends before it, and nothing of it was ever streamed.
  TextStream s(tok, {"cat was"});
  std::string streamed;
  for (int32_t id : ids) {
    streamed += s.feed(id);
    EXPECT_EQ(streamed.find("cat w"), std::string::npos) << streamed;
  }
  streamed += s.finish();
  EXPECT_TRUE(s.stopped());
  EXPECT_EQ(streamed, full.substr(0, full.find("cat was")));
}

// What the server builds from a parsed request (pinned here, fuzzed by fuzz/serve_request.cpp): an
// empty text becomes BOS, a prompt that fills the context is refused with OpenAI's code, and bytes
// of generated text that are not UTF-8 reach the client as U+FFFD; json::dump() would throw on
// them, and the server answered such a completion with a 500.
TEST(OpenAi, PromptIdsAndBodiesWithInvalidUtf8) {
  KVQ_REQUIRE_STORIES260K();
  const model::Tokenizer& tok = stories().tokenizer();
  CompletionRequest r;
  ApiError e;
  std::vector<int32_t> ids;
  ASSERT_TRUE(parse_completion_request(R"({"prompt":""})", false, &r, &e));
  ASSERT_TRUE(request_prompt_ids(r, tok, true, 512, &ids, &e));
  EXPECT_EQ(ids, std::vector<int32_t>{tok.bos_id()});
  ASSERT_TRUE(parse_completion_request(R"({"prompt":[5,6,7,8]})", false, &r, &e));
  ASSERT_TRUE(request_prompt_ids(r, tok, true, 5, &ids, &e));
  EXPECT_EQ(ids, (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_FALSE(request_prompt_ids(r, tok, true, 4, &ids, &e));
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_EQ(e.param, "prompt");
  ASSERT_TRUE(parse_completion_request(R"({"messages":[{"role":"system","content":"A"},{"role":"user","content":"B"}]})",
                                       true, &r, &e));
  ASSERT_TRUE(request_prompt_ids(r, tok, true, 512, &ids, &e));
  EXPECT_EQ(ids, tok.encode("A\nB", true));

  const std::string bad = "ok \xff\xfe end";
  EXPECT_THROW((void)nlohmann::json(bad).dump(), nlohmann::json::type_error);
  for (const nlohmann::json& body : {completion_response(false, "cmpl-1", 0, "m", bad, "stop", 1, 2),
                                     stream_chunk(true, "chatcmpl-1", 0, "m", bad, "")}) {
    const nlohmann::json back = nlohmann::json::parse(dump_json(body));
    const std::string text = back["choices"][0].contains("text") ? back["choices"][0]["text"].get<std::string>()
                                                                 : back["choices"][0]["delta"]["content"].get<std::string>();
    EXPECT_EQ(text.substr(0, 3), "ok ");
    EXPECT_NE(text.find("\xEF\xBF\xBD"), std::string::npos) << text;
    EXPECT_EQ(text.substr(text.size() - 4), " end");
  }
}

TEST(OpenAi, PercentilesAndSlaVerdict) {
  const Percentiles p = percentiles({5, 1, 4, 2, 3, 6, 7, 8, 9, 10});
  EXPECT_EQ(p.p50, 5);
  EXPECT_EQ(p.p90, 9);
  EXPECT_EQ(p.p99, 10);
  EXPECT_DOUBLE_EQ(p.mean, 5.5);
  LoadReport base, good, bad;
  base.label = "bf16/b16/sink256", good.label = "int8/x", bad.label = "fp8/x";
  TierResult t;
  t.prompt_tokens_target = 1024;
  t.ttft.p99 = 1.0, t.tpot.p99 = 0.02, t.output_tok_per_s = 100;
  base.tiers = {t};
  t.ttft.p99 = 1.4, t.tpot.p99 = 0.029;
  good.tiers = {t};
  t.ttft.p99 = 1.6;
  bad.tiers = {t};
  bool pass = false;
  compare_markdown({good, base}, 1.5, &pass);
  EXPECT_TRUE(pass);
  const std::string md = compare_markdown({base, good, bad}, 1.5, &pass);
  EXPECT_FALSE(pass);
  EXPECT_NE(md.find("| 1024 | fp8/x | 1600.0 | 1.60 |"), std::string::npos) << md;
}

TEST(OpenAi, LoadGeneratorAgainstTheServer) {
  KVQ_REQUIRE_STORIES260K();
  auto be = std::move(backend::create_backend(backend::BackendKind::kCpu).value());
  model::EngineOptions eo;
  eo.max_seqs = 8;
  auto engine = std::move(model::Engine::create(stories(), testing::spec(Format::kInt8, 16), *be, eo).value());
  auto sched = std::move(Scheduler::create(*engine).value());
  ServerOptions so;
  so.port = 0;
  auto server = std::move(Server::create(*sched, so).value());
  ASSERT_TRUE(server->start().is_ok());
  LoadOptions lo;
  lo.url = "http://127.0.0.1:" + std::to_string(server->port()) + "/v1";
  lo.tiers = {40, 120};
  lo.prompts_per_tier = 6;
  lo.max_tokens = 12;
  lo.rate = 50;
  PromptSource src;
  src.texts = {testing::stories_text()};
  src.tok = &stories().tokenizer();
  src.prepare();
  auto rep = run_load(lo, src);
  ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
  EXPECT_EQ(rep.value().label, "int8/per_token_head/b16/sink16");
  ASSERT_EQ(rep.value().tiers.size(), 2u);
  for (const TierResult& t : rep.value().tiers) {
    EXPECT_EQ(t.ok, 6);
    EXPECT_EQ(t.errors, 0);
    EXPECT_GT(t.ttft.p50, 0);
    EXPECT_GT(t.tpot.p50, 0);
    EXPECT_NEAR(t.prompt_tokens_mean, t.prompt_tokens_target, 3.0);  // re-tokenized text, BOS
    for (const RequestResult& r : t.results) EXPECT_EQ(r.completion_tokens, 12);  // ignore_eos
    EXPECT_EQ(t.preemptions, 0);
  }
  auto back = report_from_json(report_json(rep.value()));
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(back.value().tiers[1].ok, 6);
  EXPECT_NE(report_markdown(rep.value()).find("| 120 |"), std::string::npos);
  LoadOptions nowhere = lo;
  nowhere.url = "http://127.0.0.1:1";
  EXPECT_FALSE(run_load(nowhere, src).is_ok());
  server->stop();
}

}  // namespace
}  // namespace kvq::serve
