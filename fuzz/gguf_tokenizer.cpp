// libFuzzer target: the GGUF `gpt2` tokenizer built from tokenizer.ggml.* metadata, then used to
// encode and decode text (the input's own bytes and a fixed sample with special-token text).
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "kvq/model/gguf.h"
#include "kvq/model/tokenizer.h"

using namespace kvq::model;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto f = gguf::File::parse(data, size, "fuzz");
  if (!f.is_ok()) return 0;
  auto t = load_gguf_tokenizer(*f.value());
  if (!t.is_ok()) {
    KVQ_FUZZ_CHECK(!t.status().message().empty());
    return 0;
  }
  const Tokenizer& tok = *t.value();
  const std::string samples[] = {
      "Hello, world! It's 2026: x = 42;  \n\n\t done",
      "<|im_start|>user\nCafé déjà vu 日本語 🎉<|im_end|>",
      std::string(reinterpret_cast<const char*>(data), size < 256 ? size : 256),
  };
  for (const auto& s : samples) {
    auto ids = tok.encode(s, true);
    for (int32_t id : ids) KVQ_FUZZ_CHECK(id >= 0 && id < tok.vocab_size());
    (void)tok.decode(ids);
    for (int32_t id : ids) (void)tok.piece(id);
  }
  (void)tok.chat_prompt("hi");
  return 0;
}
