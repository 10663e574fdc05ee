#pragma once
// The OpenAI-compatible request and response bodies of `kvq serve` (/v1/completions,
// /v1/chat/completions), parsed and built without any network code so they can be tested alone.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvq/model/tokenizer.h"
#include "kvq/serve/scheduler.h"

namespace kvq::serve {

// An OpenAI-style error: HTTP status and the body {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field, empty when none
  std::string code;   // e.g. "model_not_found", "context_length_exceeded"
  std::string body() const;
};

struct ChatMessage {
  std::string role, content;
};

struct CompletionRequest {
  bool chat = false;
  std::string model;                 // empty: the served model
  std::string prompt;                // completions: text prompt
  std::vector<int32_t> prompt_ids;   // completions: prompt given as token ids
  bool has_prompt_ids = false;
  std::vector<ChatMessage> messages;  // chat
  SamplingParams params;
  bool max_tokens_given = false;
  bool seed_given = false;            // without one the server draws a fresh seed per request
  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage
  std::vector<std::string> stop;      // stop strings (text is cut before the first match)
};

// Parses and type-checks a request body. Unknown fields are ignored (as OpenAI clients send many);
// n other than 1, logprobs and best_of are refused.
bool parse_completion_request(const std::string& body, bool chat, CompletionRequest* out, ApiError* err);

// The text a chat request becomes: the tokenizer's chat template (ChatML for SmolLM2-Instruct,
// with its default system turn when the messages have none), or the contents joined by newlines
// for a model without chat markers.
std::string chat_prompt_text(const model::Tokenizer& tok, const std::vector<ChatMessage>& messages);

// The token ids a parsed request asks the model to continue, checked against the context of `ctx`
// tokens: the chat template's text or the prompt text encoded (with BOS when `add_bos`), or the
// client's own ids; a lone BOS for an empty text. Refuses (400, context_length_exceeded) a prompt
// that leaves no room for a completion. The ids are not checked against the vocabulary here (the
// scheduler's validate() does).
bool request_prompt_ids(const CompletionRequest& req, const model::Tokenizer& tok, bool add_bos, int ctx,
                        std::vector<int32_t>* ids, ApiError* err);

// A response body as text. Generated text may hold invalid UTF-8 (a byte token cut from its
// character, a model emitting stray bytes): those bytes become U+FFFD rather than an exception.
std::string dump_json(const nlohmann::json& j);

// Response bodies. `id` like "cmpl-7", `created` in Unix seconds.
nlohmann::json completion_response(bool chat, const std::string& id, int64_t created, const std::string& model,
                                   const std::string& text, const std::string& finish_reason, int prompt_tokens,
                                   int completion_tokens);
// One streamed chunk: `delta` text (chat: {"content": delta}, or {"role": "assistant"} when
// `role_only`), finish_reason null unless given.
nlohmann::json stream_chunk(bool chat, const std::string& id, int64_t created, const std::string& model,
                            const std::string& delta, const std::string& finish_reason, bool role_only = false);
nlohmann::json usage_chunk(bool chat, const std::string& id, int64_t created, const std::string& model,
                           int prompt_tokens, int completion_tokens);

// Incremental text of a growing token list: feed() returns the new text that is final (complete
// UTF-8, and not a possible beginning of a stop string); finish() the rest. A stop string ends the
// text before it (stopped() becomes true).
class TextStream {
 public:
  TextStream(const model::Tokenizer& tok, std::vector<std::string> stop);
  std::string feed(int32_t token);
  std::string finish();
  bool stopped() const { return stopped_; }
  const std::string& text() const { return emitted_; }

 private:
  std::string take(bool final);
  const model::Tokenizer& tok_;
  std::vector<std::string> stop_;
  std::vector<int32_t> ids_;
  std::string emitted_;
  bool stopped_ = false;
};

}  // namespace kvq::serve
