// OpenAI-compatible request parsing and response bodies.
#include "kvq/serve/openai.h"

#include <algorithm>
#include <limits>

namespace kvq::serve {

using nlohmann::json;

std::string ApiError::body() const {
  json e = {{"message", message}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}};
  return dump_json(json{{"error", e}});
}

namespace {

bool fail(ApiError* err, const std::string& msg, const std::string& param = "", int status = 400,
          const std::string& code = "") {
  err->http_status = status;
  err->message = msg;
  err->param = param;
  err->code = code;
  err->type = status == 404 ? "not_found_error" : "invalid_request_error";
  return false;
}

// The field `key` of object j, or a null value when absent (operator[] of a const json must not
// be used on missing keys).
const json& field(const json& j, const char* key) {
  static const json null_value;
  auto it = j.find(key);
  return it == j.end() ? null_value : *it;
}

bool get_int(const json& j, const char* key, int64_t lo, int64_t hi, int64_t* out, ApiError* err) {
  const json& v = field(j, key);
  if (v.is_null()) return true;
  if (!v.is_number_integer())
    return fail(err, std::string("'") + key + "' must be an integer", key);
  const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())
                        ? std::numeric_limits<int64_t>::max()
                        : v.get<int64_t>();
  if (x < lo || x > hi)
    return fail(err, std::string("'") + key + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                         "] (got " + std::to_string(x) + ")", key);
  *out = x;
  return true;
}

bool get_number(const json& j, const char* key, double lo, double hi, bool lo_open, double* out, ApiError* err) {
  const json& v = field(j, key);
  if (v.is_null()) return true;
  if (!v.is_number()) return fail(err, std::string("'") + key + "' must be a number", key);
  const double x = v.get<double>();
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi))
    return fail(err, std::string("'") + key + "' must be in " + (lo_open ? "(" : "[") + std::to_string(lo) + ", " +
                         std::to_string(hi) + "]", key);
  *out = x;
  return true;
}

bool message_content(const json& c, std::string* out) {
  if (c.is_string()) {
    *out = c.get<std::string>();
    return true;
  }
  if (!c.is_array()) return false;
  out->clear();
  for (const json& part : c) {  // [{"type": "text", "text": "..."}]
    if (!part.is_object() || !field(part, "text").is_string()) return false;
    *out += field(part, "text").get<std::string>();
  }
  return true;
}

// Bytes at the end of `s` that start an incomplete UTF-8 character.
size_t incomplete_utf8_tail(const std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    const unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    const size_t want = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return want > back ? back : 0;
  }
  return 0;
}

}  // namespace

bool parse_completion_request(const std::string& body, bool chat, CompletionRequest* out, ApiError* err) {
  *out = CompletionRequest{};
  out->chat = chat;
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return fail(err, "the request body is not valid JSON");
  if (!j.is_object()) return fail(err, "the request body must be a JSON object");
  if (j.contains("model")) {
    if (!field(j, "model").is_string()) return fail(err, "'model' must be a string", "model");
    out->model = field(j, "model").get<std::string>();
  }
  if (chat) {
    const json& m = field(j, "messages");
    if (!m.is_array() || m.empty()) return fail(err, "'messages' must be a non-empty array", "messages");
    for (const json& x : m) {
      if (!x.is_object() || !field(x, "role").is_string())
        return fail(err, "each message needs a string 'role' and a 'content'", "messages");
      ChatMessage cm;
      cm.role = field(x, "role").get<std::string>();
      if (cm.role != "system" && cm.role != "user" && cm.role != "assistant" && cm.role != "developer")
        return fail(err, "message role '" + cm.role + "' is not one of system, developer, user, assistant", "messages");
      if (!message_content(field(x, "content"), &cm.content))
        return fail(err, "message 'content' must be a string or an array of text parts", "messages");
      out->messages.push_back(std::move(cm));
    }
  } else {
    const json& p = field(j, "prompt");
    if (p.is_string()) {
      out->prompt = p.get<std::string>();
    } else if (p.is_array() && !p.empty() && std::all_of(p.begin(), p.end(), [](const json& x) { return x.is_number_integer(); })) {
      for (const json& x : p) {
        const int64_t v = x.get<int64_t>();
        if (v < 0 || v > std::numeric_limits<int32_t>::max()) return fail(err, "prompt token ids must be >= 0", "prompt");
        out->prompt_ids.push_back(static_cast<int32_t>(v));
      }
      out->has_prompt_ids = true;
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      out->prompt = p[0].get<std::string>();
    } else if (p.is_array() && p.size() > 1) {
      return fail(err, "batched prompts are not supported; send one request per prompt", "prompt");
    } else {
      return fail(err, "'prompt' must be a string or an array of token ids", "prompt");
    }
  }
  int64_t n = 1;
  if (!get_int(j, "n", 1, 1, &n, err)) return false;
  if (j.contains("best_of") && !field(j, "best_of").is_null() && field(j, "best_of") != 1)
    return fail(err, "'best_of' other than 1 is not supported", "best_of");
  if (j.contains("logprobs") && !field(j, "logprobs").is_null() && field(j, "logprobs") != false)
    return fail(err, "'logprobs' is not supported", "logprobs");
  int64_t max_tokens = -1;
  const char* mt_key = j.contains("max_completion_tokens") && !field(j, "max_completion_tokens").is_null()
                           ? "max_completion_tokens" : "max_tokens";
  if (!get_int(j, mt_key, 1, std::numeric_limits<int32_t>::max(), &max_tokens, err)) return false;
  if (max_tokens > 0) {
    out->params.max_tokens = static_cast<int>(max_tokens);
    out->max_tokens_given = true;
  }
  double t = 1.0, tp = 1.0;  // OpenAI's defaults
  if (!get_number(j, "temperature", 0.0, 2.0, false, &t, err)) return false;
  if (!get_number(j, "top_p", 0.0, 1.0, true, &tp, err)) return false;
  out->params.temperature = static_cast<float>(t);
  out->params.top_p = static_cast<float>(tp);
  if (j.contains("seed") && !field(j, "seed").is_null()) {
    if (!field(j, "seed").is_number_integer()) return fail(err, "'seed' must be an integer", "seed");
    out->seed_given = true;
    out->params.seed = field(j, "seed").is_number_unsigned() ? field(j, "seed").get<uint64_t>()
                                                       : static_cast<uint64_t>(field(j, "seed").get<int64_t>());
  }
  if (j.contains("stream") && !field(j, "stream").is_null()) {
    if (!field(j, "stream").is_boolean()) return fail(err, "'stream' must be a boolean", "stream");
    out->stream = field(j, "stream").get<bool>();
  }
  if (field(j, "ignore_eos").is_boolean()) out->params.stop_at_eos = !field(j, "ignore_eos").get<bool>();  // vLLM's
  if (j.contains("stream_options") && field(j, "stream_options").is_object()) {
    const json& so = field(j, "stream_options");
    if (field(so, "include_usage").is_boolean()) out->include_usage = field(so, "include_usage").get<bool>();
  }
  if (j.contains("stop") && !field(j, "stop").is_null()) {
    const json& s = field(j, "stop");
    if (s.is_string()) {
      out->stop.push_back(s.get<std::string>());
    } else if (s.is_array() && s.size() <= 4 && std::all_of(s.begin(), s.end(), [](const json& x) { return x.is_string(); })) {
      for (const json& x : s) out->stop.push_back(x.get<std::string>());
    } else {
      return fail(err, "'stop' must be a string or an array of at most 4 strings", "stop");
    }
    out->stop.erase(std::remove(out->stop.begin(), out->stop.end(), std::string()), out->stop.end());
  }
  return true;
}

bool request_prompt_ids(const CompletionRequest& req, const model::Tokenizer& tok, bool add_bos, int ctx,
                        std::vector<int32_t>* ids, ApiError* err) {
  if (req.chat) {
    *ids = tok.encode(chat_prompt_text(tok, req.messages), add_bos);
  } else if (req.has_prompt_ids) {
    *ids = req.prompt_ids;
  } else {
    *ids = tok.encode(req.prompt, add_bos);
  }
  if (ids->empty() && tok.bos_id() >= 0) ids->push_back(tok.bos_id());
  if (static_cast<int64_t>(ids->size()) >= ctx)
    return fail(err, "the prompt has " + std::to_string(ids->size()) + " tokens; the context holds " +
                         std::to_string(ctx) + " including the completion; shorten the prompt",
                req.chat ? "messages" : "prompt", 400, "context_length_exceeded");
  return true;
}

std::string dump_json(const nlohmann::json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string chat_prompt_text(const model::Tokenizer& tok, const std::vector<ChatMessage>& messages) {
  const bool has_system = std::any_of(messages.begin(), messages.end(),
                                      [](const ChatMessage& m) { return m.role == "system" || m.role == "developer"; });
  if (messages.size() == 1 && messages[0].role == "user") return tok.chat_prompt(messages[0].content);
  const std::string probe = tok.chat_prompt("\x01");
  const size_t at = probe.find("<|im_start|>user");
  if (probe.find("<|im_start|>") == std::string::npos || at == std::string::npos) {
    std::string out;
    for (const ChatMessage& m : messages) out += (out.empty() ? "" : "\n") + m.content;
    return out;
  }
  // ChatML, with the template's default system turn when the conversation brings none.
  std::string out = has_system ? "" : probe.substr(0, at);
  for (const ChatMessage& m : messages)
    out += "<|im_start|>" + std::string(m.role == "developer" ? "system" : m.role) + "\n" + m.content + "<|im_end|>\n";
  return out + "<|im_start|>assistant\n";
}

json completion_response(bool chat, const std::string& id, int64_t created, const std::string& model,
                         const std::string& text, const std::string& finish_reason, int prompt_tokens,
                         int completion_tokens) {
  json choice = {{"index", 0}, {"finish_reason", finish_reason}};
  if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
    choice["logprobs"] = nullptr;
  }
  return {{"id", id},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array({choice})},
          {"usage",
           {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", completion_tokens},
            {"total_tokens", prompt_tokens + completion_tokens}}}};
}

json stream_chunk(bool chat, const std::string& id, int64_t created, const std::string& model, const std::string& delta,
                  const std::string& finish_reason, bool role_only) {
  json choice = {{"index", 0}, {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}};
  if (chat) {
    choice["delta"] = role_only ? json{{"role", "assistant"}, {"content", ""}}
                                : (delta.empty() ? json::object() : json{{"content", delta}});
  } else {
    choice["text"] = delta;
    choice["logprobs"] = nullptr;
  }
  return {{"id", id},
          {"object", chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array({choice})}};
}

json usage_chunk(bool chat, const std::string& id, int64_t created, const std::string& model, int prompt_tokens,
                 int completion_tokens) {
  return {{"id", id},
          {"object", chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array()},
          {"usage",
           {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", completion_tokens},
            {"total_tokens", prompt_tokens + completion_tokens}}}};
}

TextStream::TextStream(const model::Tokenizer& tok, std::vector<std::string> stop) : tok_(tok), stop_(std::move(stop)) {
  stop_.erase(std::remove(stop_.begin(), stop_.end(), std::string()), stop_.end());
}

std::string TextStream::feed(int32_t token) {
  if (stopped_) return "";
  ids_.push_back(token);
  return take(false);
}

std::string TextStream::finish() { return stopped_ ? "" : take(true); }

std::string TextStream::take(bool final) {
  const std::string full = tok_.decode(ids_);
  // Decoding is prefix-stable for these tokenizers; if a later token changed earlier text, wait.
  if (full.size() < emitted_.size() || full.compare(0, emitted_.size(), emitted_) != 0) return "";
  size_t end = full.size();
  // The earliest stop string that ends inside the new text.
  size_t cut = std::string::npos;
  for (const std::string& s : stop_) {
    const size_t from = emitted_.size() >= s.size() ? emitted_.size() - s.size() + 1 : 0;
    const size_t at = full.find(s, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    stopped_ = true;
    end = std::max(cut, emitted_.size());
  } else if (!final) {
    end -= incomplete_utf8_tail(full);
    // Hold back a tail that may still grow into a stop string.
    size_t hold = 0;
    for (const std::string& s : stop_)
      for (size_t k = std::min(s.size() - 1, end - std::min(end, emitted_.size())); k > hold; --k)
        if (full.compare(end - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    end -= hold;
  }
  if (end <= emitted_.size()) return "";
  std::string fresh = full.substr(emitted_.size(), end - emitted_.size());
  emitted_ += fresh;
  return fresh;
}

}  // namespace kvq::serve
