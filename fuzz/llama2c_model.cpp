// libFuzzer target: Model::load on a file holding the input: the llama2.c checkpoint loader
// (header, size arithmetic, weights), or the GGUF `llama` loader when the input starts with
// "GGUF". The checkpoint's tokenizer is a fixed valid 600-token file written once.
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "kvq/model/model.h"

using namespace kvq;

namespace {

std::string tokenizer_file() {
  static const std::string path = [] {
    std::string p = fuzz::scratch_path("tok");
    std::vector<uint8_t> b;
    auto put32 = [&](uint32_t v) {
      for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
    };
    put32(8);  // max_token_length
    for (int i = 0; i < 600; ++i) {
      std::string piece = i < 3 ? std::string("<s>") : i < 259 ? "<0x" + std::string(1, "0123456789ABCDEF"[(i - 3) >> 4]) +
                                                                  std::string(1, "0123456789ABCDEF"[(i - 3) & 15]) + ">"
                                                               : "t" + std::to_string(i);
      float score = static_cast<float>(-i);
      uint32_t bits;
      static_assert(sizeof bits == sizeof score);
      __builtin_memcpy(&bits, &score, 4);
      put32(bits);
      put32(static_cast<uint32_t>(piece.size()));
      b.insert(b.end(), piece.begin(), piece.end());
    }
    fuzz::write_scratch(p, b.data(), b.size());
    return p;
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = fuzz::scratch_path("model");
  if (!fuzz::write_scratch(path, data, size)) return 0;
  auto m = model::Model::load(path, tokenizer_file());
  if (!m.is_ok()) {
    KVQ_FUZZ_CHECK(!m.status().message().empty());
    return 0;
  }
  const model::ModelConfig& c = m.value()->config();
  KVQ_FUZZ_CHECK(c.dim > 0 && c.n_layers > 0 && c.vocab_size > 0);
  auto ids = m.value()->tokenizer().encode("hello", true);
  for (int32_t id : ids) KVQ_FUZZ_CHECK(id >= 0 && id < m.value()->tokenizer().vocab_size());
  return 0;
}
