#pragma once
// Tokenizers of the two model formats kvq loads: llama2.c's tok*.bin (SentencePiece-style BPE by
// piece scores, byte fallback, dummy-prefix space) and GGUF's `gpt2` byte-level BPE (ranked
// merges after a pre-tokenizer split, e.g. SmolLM2's "smollm").
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/common/status.h"

namespace kvq::model {

namespace gguf {
class File;
}

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Special tokens written literally in `text` (e.g. "<|im_start|>" for a `gpt2` vocabulary) are
  // encoded as themselves, so chat templates can be applied by string formatting.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos) const = 0;
  // Concatenated text of the ids; BOS/EOS and other control tokens are left out.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // Bytes of one token, for streaming output (may be part of a UTF-8 character; control tokens
  // give their literal text).
  virtual std::string piece(int32_t id) const = 0;
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;  // -1 when none
  virtual int32_t vocab_size() const = 0;
  // Whether the model was trained with BOS before every text (llama2.c: yes; GGUF:
  // tokenizer.ggml.add_bos_token, false for SmolLM2).
  virtual bool add_bos_by_default() const { return true; }
  // Literal text of the chat turn markers, empty when the vocabulary has none.
  virtual std::string chat_prompt(std::string_view user_message) const { return std::string(user_message); }
};

// llama2.c tokenizer file: int32 max_token_length, then per token float32 score, int32 length,
// bytes. `vocab_size` comes from the checkpoint header.
Result<std::unique_ptr<Tokenizer>> load_llama2c_tokenizer(const std::string& path, int vocab_size);
Result<std::unique_ptr<Tokenizer>> load_llama2c_tokenizer_bytes(const uint8_t* data, size_t size, int vocab_size);

// Tokenizer described by a GGUF file's tokenizer.ggml.* metadata (model `gpt2`).
Result<std::unique_ptr<Tokenizer>> load_gguf_tokenizer(const gguf::File& file);

}  // namespace kvq::model
