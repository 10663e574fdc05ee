// libFuzzer target: what `kvq serve` does with a client's request body before it reaches the
// scheduler: JSON parsing and validation (parse_completion_request), the chat template, the
// prompt's token ids against a context (request_prompt_ids), the error body, and the response
// bodies built from text streamed through TextStream with the request's stop strings.
// HTTP framing (headers, chunking, body size limit) is cpp-httplib's and is not fuzzed here.
// The first byte chooses the endpoint (bit 0: chat), the tokenizer (bit 1: ChatML byte-level
// BPE or a llama2.c vocabulary with byte tokens) and the context (bits 2-7); the rest is the body.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "kvq/common/file_io.h"
#include "kvq/model/gguf.h"
#include "kvq/serve/openai.h"

using namespace kvq;
using namespace kvq::serve;

namespace {

// The tokenizers of the committed seed corpora, loaded once.
const model::Tokenizer& tokenizer(bool llama2c) {
  static const std::unique_ptr<model::Tokenizer> toks[2] = {
      [] {
        auto f = model::gguf::File::open(KVQ_SOURCE_DIR "/fuzz/corpus/gguf_tokenizer/smollm.gguf");
        KVQ_FUZZ_CHECK(f.is_ok());
        auto t = model::load_gguf_tokenizer(*f.value());
        KVQ_FUZZ_CHECK(t.is_ok());
        return std::move(t).value();
      }(),
      [] {
        auto bytes = read_file(KVQ_SOURCE_DIR "/fuzz/corpus/llama2c_tokenizer/bytes_and_merges.bin", 1 << 20, "tokenizer");
        KVQ_FUZZ_CHECK(bytes.is_ok() && bytes.value().size() > 2);
        const std::string& b = bytes.value();
        const int vocab = static_cast<uint8_t>(b[0]) | (static_cast<uint8_t>(b[1]) << 8);
        auto t = model::load_llama2c_tokenizer_bytes(reinterpret_cast<const uint8_t*>(b.data()) + 2, b.size() - 2, vocab);
        KVQ_FUZZ_CHECK(t.is_ok());
        return std::move(t).value();
      }(),
  };
  return *toks[llama2c ? 1 : 0];
}

void check_error(const ApiError& e) {
  KVQ_FUZZ_CHECK(!e.message.empty());
  KVQ_FUZZ_CHECK(e.http_status >= 400 && e.http_status < 600);
  const nlohmann::json body = nlohmann::json::parse(e.body(), nullptr, false);
  KVQ_FUZZ_CHECK(!body.is_discarded() && body.contains("error"));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool chat = data[0] & 1;
  const model::Tokenizer& tok = tokenizer(data[0] & 2);
  const int ctx = 1 + (data[0] >> 2) * 4;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);

  CompletionRequest req;
  ApiError err;
  if (!parse_completion_request(body, chat, &req, &err)) {
    check_error(err);
    return 0;
  }
  KVQ_FUZZ_CHECK(req.chat == chat);
  KVQ_FUZZ_CHECK(!req.max_tokens_given || req.params.max_tokens >= 1);
  KVQ_FUZZ_CHECK(req.params.temperature >= 0.f && req.params.temperature <= 2.f);
  KVQ_FUZZ_CHECK(req.params.top_p > 0.f && req.params.top_p <= 1.f);
  KVQ_FUZZ_CHECK(req.stop.size() <= 4);
  for (const std::string& s : req.stop) KVQ_FUZZ_CHECK(!s.empty());
  std::vector<int32_t> ids;
  if (!request_prompt_ids(req, tok, true, ctx, &ids, &err)) {
    check_error(err);
    return 0;
  }
  KVQ_FUZZ_CHECK(!ids.empty() && static_cast<int>(ids.size()) < ctx);
  if (!req.has_prompt_ids)
    for (int32_t id : ids) KVQ_FUZZ_CHECK(id >= 0 && id < tok.vocab_size());

  // Stream the prompt back as if generated (ids outside the vocabulary are the scheduler's to
  // refuse, so fold them in): no stop string may reach the client.
  TextStream text(tok, req.stop);
  std::string streamed;
  for (int32_t id : ids) {
    const int32_t t = static_cast<int32_t>(static_cast<uint32_t>(id) % static_cast<uint32_t>(tok.vocab_size()));
    const std::string d = text.feed(t);
    streamed += d;
    (void)dump_json(stream_chunk(chat, "cmpl-1", 0, "m", d, ""));
  }
  streamed += text.finish();
  KVQ_FUZZ_CHECK(streamed == text.text());
  for (const std::string& s : req.stop) KVQ_FUZZ_CHECK(text.text().find(s) == std::string::npos);
  const std::string out = dump_json(completion_response(chat, "cmpl-1", 0, req.model, text.text(),
                                                        text.stopped() ? "stop" : "length", 1, 1));
  KVQ_FUZZ_CHECK(!nlohmann::json::parse(out, nullptr, false).is_discarded());
  return 0;
}
