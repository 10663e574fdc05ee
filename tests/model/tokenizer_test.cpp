// Tokenizers: llama2.c (tok512.bin) and GGUF gpt2 BPE on a small synthetic vocabulary whose
// expected output follows from the BPE definition by hand.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "gguf_writer.h"
#include "kvq/model/gguf.h"
#include "kvq/model/tokenizer.h"
#include "kvq/model/model.h"
#include "model/stories_data.h"

namespace kvq::model {
namespace {

using testing::GgufWriter;

const std::string kTok512 = kvq::model::stories260k_dir() + "/tok512.bin";

std::vector<uint8_t> read_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

const std::vector<std::string> kUnicodeTexts = {
    "Hello, world!",
    "Ça va? Déjà vu, naïve café — résumé.",
    "日本語のテキスト、中文和한국어",
    "Emoji: 🎉🚀 👍🏽 👨‍👩‍👧",
    "line one\nline two\n\n\tindented\r\n",
    "def f(x):\n    return x ** 2  # square\n",
    "  leading and trailing spaces  ",
    "\xC3\x28 invalid utf-8 \xFF\xFE bytes \xE2\x82",
};

TEST(Llama2cTokenizer, ByteFallbackAndDummyPrefix) {
  KVQ_REQUIRE_STORIES260K();
  auto t = load_llama2c_tokenizer(kTok512, 512);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  const Tokenizer& tok = *t.value();
  EXPECT_EQ(tok.vocab_size(), 512);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  // "\n" alone: the dummy-prefix space, then byte 0x0A as <0x0A> = id 13 (README).
  auto nl = tok.encode("\n", false);
  ASSERT_EQ(nl.size(), 2u);
  EXPECT_EQ(nl[1], 13);
  EXPECT_EQ(tok.piece(13), "\n");
  // "日" (E6 97 A5) is not a piece of this 512-token vocabulary: three byte tokens, byte + 3.
  auto e = tok.encode("日", false);
  ASSERT_EQ(e.size(), 4u);
  EXPECT_EQ(e[1], 0xE6 + 3);
  EXPECT_EQ(e[2], 0x97 + 3);
  EXPECT_EQ(e[3], 0xA5 + 3);
  // "é" is a piece of its own.
  EXPECT_EQ(tok.encode("é", false).size(), 2u);
  EXPECT_EQ(tok.encode("", true), (std::vector<int32_t>{1}));
  EXPECT_TRUE(tok.encode("", false).empty());
}

TEST(Llama2cTokenizer, RoundTripsUnicode) {
  KVQ_REQUIRE_STORIES260K();
  auto t = load_llama2c_tokenizer(kTok512, 512);
  ASSERT_TRUE(t.is_ok());
  for (const auto& s : kUnicodeTexts) {
    auto ids = t.value()->encode(s, true);
    EXPECT_EQ(ids[0], 1);
    EXPECT_EQ(t.value()->decode(ids), s);
  }
}

TEST(Llama2cTokenizer, RejectsMalformedFiles) {
  KVQ_REQUIRE_STORIES260K();
  auto good = read_bytes(kTok512);
  ASSERT_EQ(good.size(), 6227u);
  auto code = [](const std::vector<uint8_t>& b, int vocab) {
    return load_llama2c_tokenizer_bytes(b.data(), b.size(), vocab).status().code();
  };
  EXPECT_EQ(code(good, 512), StatusCode::kOk);
  EXPECT_EQ(code(std::vector<uint8_t>(good.begin(), good.end() - 10), 512), StatusCode::kCorruptInput);
  EXPECT_EQ(code({}, 512), StatusCode::kCorruptInput);
  EXPECT_EQ(code(good, 100000), StatusCode::kCorruptInput);  // fewer tokens than the model needs
  auto bad_len = good;
  int32_t len = -5;
  std::memcpy(bad_len.data() + 4 + 4, &len, 4);  // first token's length
  EXPECT_EQ(code(bad_len, 512), StatusCode::kCorruptInput);
  EXPECT_EQ(load_llama2c_tokenizer("/nonexistent/tok.bin", 512).status().code(), StatusCode::kNotFound);
}

// GPT-2 byte-level alphabet, written out independently of the library.
std::string byte_symbol(int b) {
  int cp = b;
  if (!((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))) {
    int n = 0;
    for (int x = 0; x < b; ++x)
      if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF))) ++n;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

struct MiniVocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  int32_t id(const std::string& s) const {
    for (size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] == s) return static_cast<int32_t>(i);
    return -1;
  }
};

// Byte symbols, then merged tokens and two special tokens.
MiniVocab mini_vocab() {
  MiniVocab v;
  for (int b = 0; b < 256; ++b) v.tokens.push_back(byte_symbol(b));
  for (const char* t : {"\xC4\xA0w", "or", "\xC4\xA0wor", "ld", "\xC4\xA0world", "12", "ab", "bc"}) v.tokens.push_back(t);
  v.types.assign(v.tokens.size(), 1);
  v.tokens.push_back("<|im_start|>");
  v.types.push_back(3);
  v.tokens.push_back("<tool>");
  v.types.push_back(4);
  return v;
}

Result<std::unique_ptr<Tokenizer>> mini_tokenizer(const std::string& pre, const std::vector<std::string>& merges) {
  MiniVocab v = mini_vocab();
  GgufWriter w;
  w.kv_str("tokenizer.ggml.model", "gpt2");
  w.kv_str("tokenizer.ggml.pre", pre);
  w.kv_str_array("tokenizer.ggml.tokens", v.tokens);
  w.kv_i32_array("tokenizer.ggml.token_type", v.types);
  w.kv_str_array("tokenizer.ggml.merges", merges);
  w.kv_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(v.id("<|im_start|>")));
  w.kv_bool("tokenizer.ggml.add_bos_token", false);
  auto bytes = w.bytes();
  auto f = gguf::File::parse(bytes.data(), bytes.size());
  if (!f.is_ok()) return f.status();
  return load_gguf_tokenizer(*f.value());
}

const std::vector<std::string> kMerges = {"\xC4\xA0 w", "o r", "\xC4\xA0w or", "l d", "\xC4\xA0wor ld", "1 2", "b c", "a b"};

TEST(BpeTokenizer, MergesByRankAndSplitsDigits) {
  MiniVocab v = mini_vocab();
  auto t = mini_tokenizer("smollm", kMerges);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  const Tokenizer& tok = *t.value();
  EXPECT_FALSE(tok.add_bos_by_default());
  EXPECT_EQ(tok.encode(" world", false), (std::vector<int32_t>{v.id("\xC4\xA0world")}));
  // "b c" outranks "a b", so "abc" is a + bc.
  EXPECT_EQ(tok.encode("abc", false), (std::vector<int32_t>{v.id("a"), v.id("bc")}));
  // smollm isolates digits: "12" never merges.
  EXPECT_EQ(tok.encode("12", false), (std::vector<int32_t>{v.id("1"), v.id("2")}));
  // The pre-tokenizer keeps " world" apart from "x": "x world" = x, Ġworld.
  EXPECT_EQ(tok.encode("x world", false), (std::vector<int32_t>{v.id("x"), v.id("\xC4\xA0world")}));

  auto g = mini_tokenizer("gpt2", {"a b", "b c", "1 2"});
  ASSERT_TRUE(g.is_ok());
  EXPECT_EQ(g.value()->encode("abc", false), (std::vector<int32_t>{v.id("ab"), v.id("c")}));
  EXPECT_EQ(g.value()->encode("12", false), (std::vector<int32_t>{v.id("12")}));
  // A space before a space-separated word stays alone: "a  b" = a, Ġ, Ġb (Ġb is not a token: Ġ, b).
  EXPECT_EQ(g.value()->encode("a  b", false),
            (std::vector<int32_t>{v.id("a"), v.id("\xC4\xA0"), v.id("\xC4\xA0"), v.id("b")}));
}

TEST(BpeTokenizer, SpecialTokensAndDecoding) {
  MiniVocab v = mini_vocab();
  auto t = mini_tokenizer("smollm", kMerges);
  ASSERT_TRUE(t.is_ok());
  const Tokenizer& tok = *t.value();
  const int32_t im = v.id("<|im_start|>"), tool = v.id("<tool>");
  EXPECT_EQ(tok.bos_id(), im);
  EXPECT_EQ(tok.encode("a<|im_start|>b<tool>", false), (std::vector<int32_t>{v.id("a"), im, v.id("b"), tool}));
  EXPECT_EQ(tok.encode("x", true), (std::vector<int32_t>{im, v.id("x")}));
  // decode drops control tokens, keeps user-defined ones; piece gives both literally.
  EXPECT_EQ(tok.decode({v.id("a"), im, v.id("b"), tool}), "ab<tool>");
  EXPECT_EQ(tok.piece(im), "<|im_start|>");
  EXPECT_EQ(tok.piece(v.id("\xC4\xA0world")), " world");
  EXPECT_EQ(tok.chat_prompt("hi").find("<|im_start|>user\nhi"), std::string::npos);  // no <|im_end|>: plain text
}

TEST(BpeTokenizer, RoundTripsAnyBytes) {
  auto t = mini_tokenizer("smollm", kMerges);
  ASSERT_TRUE(t.is_ok());
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  std::vector<std::string> texts = kUnicodeTexts;
  texts.push_back(all);
  for (const auto& s : texts) EXPECT_EQ(t.value()->decode(t.value()->encode(s, false)), s);
}

TEST(BpeTokenizer, RejectsBadMetadata) {
  EXPECT_EQ(mini_tokenizer("llama3", kMerges).status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(mini_tokenizer("smollm", {"nospace"}).status().code(), StatusCode::kCorruptInput);
  GgufWriter w;
  w.kv_str("tokenizer.ggml.model", "gpt2");
  w.kv_u32("tokenizer.ggml.tokens", 3);
  auto b = w.bytes();
  auto f = gguf::File::parse(b.data(), b.size());
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(load_gguf_tokenizer(*f.value()).status().code(), StatusCode::kCorruptInput);
  GgufWriter none;
  auto nb = none.bytes();
  auto nf = gguf::File::parse(nb.data(), nb.size());
  ASSERT_TRUE(nf.is_ok());
  EXPECT_EQ(load_gguf_tokenizer(*nf.value()).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvq::model
