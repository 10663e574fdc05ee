// libFuzzer target: the llama2.c tokenizer loader. The first two bytes choose the vocabulary size
// (which comes from the checkpoint in real use); the rest is the tok*.bin file. Accepted
// tokenizers encode and decode a fixed sample and a slice of the input.
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "kvq/model/tokenizer.h"

using namespace kvq::model;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int vocab = (data[0] | (data[1] << 8)) & 0x3FFF;
  auto t = load_llama2c_tokenizer_bytes(data + 2, size - 2, vocab);
  if (!t.is_ok()) {
    KVQ_FUZZ_CHECK(!t.status().message().empty());
    return 0;
  }
  const Tokenizer& tok = *t.value();
  KVQ_FUZZ_CHECK(tok.vocab_size() == vocab);
  const std::string samples[] = {
      "Once upon a time, a café \xF0\x9F\x8E\x89 and \xFF\xFE bytes.",
      std::string(reinterpret_cast<const char*>(data), size < 128 ? size : 128),
  };
  for (const auto& s : samples) {
    auto ids = tok.encode(s, true);
    for (int32_t id : ids) KVQ_FUZZ_CHECK(id >= 0 && id < tok.vocab_size());
    (void)tok.decode(ids);
  }
  for (int32_t id = 0; id < tok.vocab_size() && id < 1024; ++id) (void)tok.piece(id);
  return 0;
}
