// Regression tests for crafted model and tokenizer files (issue 11): each class of defect that a
// hostile file once triggered, reproduced with the smallest file that shows it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "gguf_writer.h"
#include "kvq/model/gguf.h"
#include "kvq/model/model.h"
#include "kvq/model/tokenizer.h"

namespace kvq::model {
namespace {

using testing::GgufWriter;

std::string tmp_path(const std::string& name) {
  return std::string(KVQ_TEST_BINARY_DIR) + "/harden_" + std::to_string(::getpid()) + "_" + name;
}

void write_file(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// A llama2.c tokenizer file: max_token_length, then (score, length, bytes) per piece.
std::vector<uint8_t> llama2c_tokenizer(const std::vector<std::string>& pieces, const std::vector<float>& scores) {
  std::vector<uint8_t> b;
  int32_t max_len = 0;
  for (const auto& p : pieces) max_len = std::max(max_len, static_cast<int32_t>(p.size()));
  GgufWriter::pod(b, std::max(max_len, 1));
  for (size_t i = 0; i < pieces.size(); ++i) {
    GgufWriter::pod(b, scores[i]);
    GgufWriter::pod(b, static_cast<int32_t>(pieces[i].size()));
    b.insert(b.end(), pieces[i].begin(), pieces[i].end());
  }
  return b;
}

// "<0x-1>" was read by sscanf("%2x") as 0xFFFFFFFF and used as an index into a 256-entry table
// (SIGSEGV in Release). Such pieces are now ordinary pieces, not byte tokens.
TEST(Llama2cTokenizerHardening, SignedHexBytePieceIsNotAByteToken) {
  const std::vector<std::string> pieces = {"<unk>", "<s>", "</s>", "<0x-1>", "<0x+F>", "<0x41>", "<0xG1>", " ", "a"};
  const std::vector<float> scores(pieces.size(), 0.f);
  auto b = llama2c_tokenizer(pieces, scores);
  auto t = load_llama2c_tokenizer_bytes(b.data(), b.size(), static_cast<int>(pieces.size()));
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  const Tokenizer& tok = *t.value();
  EXPECT_EQ(tok.piece(3), "<0x-1>");  // not a byte token: its own text
  EXPECT_EQ(tok.piece(4), "<0x+F>");
  EXPECT_EQ(tok.piece(5), "A");       // a real byte token decodes to its byte
  EXPECT_EQ(tok.piece(6), "<0xG1>");
  // "A" is not a piece, so it falls back to its byte token <0x41>; "\xFF" has none: unk.
  auto ids = tok.encode("aA\xFF", false);
  EXPECT_EQ(ids, (std::vector<int32_t>{7, 8, 5, 0}));
}

TEST(Llama2cTokenizerHardening, NonFiniteScoresAreRefused) {
  const std::vector<std::string> pieces = {"<unk>", "<s>", "</s>", "ab"};
  for (float bad : {NAN, INFINITY}) {
    auto b = llama2c_tokenizer(pieces, {0.f, 0.f, 0.f, bad});
    auto t = load_llama2c_tokenizer_bytes(b.data(), b.size(), 4);
    EXPECT_EQ(t.status().code(), StatusCode::kCorruptInput);
    EXPECT_NE(t.status().message().find("token 3"), std::string::npos) << t.status().message();
  }
}

TEST(Llama2cTokenizerHardening, FileTypeAndSizeAreChecked) {
  const std::string dir = tmp_path("tokdir");
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  auto d = load_llama2c_tokenizer(dir, 512);
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("directory"), std::string::npos) << d.status().message();
  EXPECT_NE(d.status().message().find(dir), std::string::npos);
  ::rmdir(dir.c_str());
  const std::string fifo = tmp_path("tokfifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto f = load_llama2c_tokenizer(fifo, 512);  // returns at once: a FIFO is never waited on
  EXPECT_NE(f.status().message().find("FIFO"), std::string::npos) << f.status().message();
  ::unlink(fifo.c_str());
  auto z = load_llama2c_tokenizer("/dev/zero", 512);  // endless device: refused, not read
  EXPECT_NE(z.status().message().find("character device"), std::string::npos) << z.status().message();
}

// The duplicate-name check was quadratic: a valid 7.6 MB file of 100k tensors took ~2 minutes.
TEST(GgufHardening, HundredThousandTensorsParseInUnderTwoSeconds) {
  GgufWriter w(3, 32);
  w.kv_str("general.architecture", "llama");
  const int n = 100000;
  for (int i = 0; i < n; ++i) w.tensor_f32("t." + std::to_string(i), {1}, {static_cast<float>(i)});
  auto bytes = w.bytes();
  const auto t0 = std::chrono::steady_clock::now();
  auto f = gguf::File::parse(bytes.data(), bytes.size());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_LT(s, 2.0);
  EXPECT_EQ(f.value()->tensors().size(), static_cast<size_t>(n));
  const gguf::TensorInfo* t = f.value()->find_tensor("t.99999");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(f.value()->read_f32(*t).value(), std::vector<float>{99999.f});
  EXPECT_EQ(f.value()->find_tensor("t.100000"), nullptr);

  // The same table with one duplicate (the last name repeats the first) is refused as fast.
  GgufWriter d(3, 32);
  for (int i = 0; i < n; ++i) d.tensor_f32(i == n - 1 ? "t.0" : "t." + std::to_string(i), {1}, {0.f});
  auto dup = d.bytes();
  const auto t1 = std::chrono::steady_clock::now();
  auto g = gguf::File::parse(dup.data(), dup.size());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 2.0);
  EXPECT_EQ(g.status().code(), StatusCode::kCorruptInput);
  EXPECT_NE(g.status().message().find("'t.0' appears twice"), std::string::npos) << g.status().message();
}

// A forged tensor count within the size bound fails on the bytes actually present.
TEST(GgufHardening, ForgedCountsFailOnTheBytesPresent) {
  GgufWriter w;
  w.kv_str("general.architecture", "llama");
  w.tensor_f32("a", {1}, {1.f});
  w.forced_tensor_count = 4;  // passes the size bound (24 bytes per entry), then runs out
  auto b = w.bytes();
  auto f = gguf::File::parse(b.data(), b.size());
  EXPECT_EQ(f.status().code(), StatusCode::kCorruptInput);
  // The second entry is read from the padding and data bytes that follow the table.
  EXPECT_NE(f.status().message().find("tensor"), std::string::npos) << f.status().message();
}

TEST(GgufHardening, OpenRefusesNonRegularFilesWithoutBlocking) {
  const std::string fifo = tmp_path("gguf_fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto f = gguf::File::open(fifo);
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("FIFO"), std::string::npos) << f.status().message();
  auto m = Model::load(fifo);
  EXPECT_NE(m.status().message().find("FIFO"), std::string::npos) << m.status().message();
  ::unlink(fifo.c_str());
  auto d = Model::load("/tmp");
  EXPECT_NE(d.status().message().find("directory"), std::string::npos) << d.status().message();
  auto z = Model::load("/dev/zero");
  EXPECT_NE(z.status().message().find("character device"), std::string::npos) << z.status().message();
}

// A llama2.c header with every size at its allowed maximum: the implied file size is reported as
// a positive number (computed with checked arithmetic), never a wrapped negative one.
TEST(Llama2cLoaderHardening, HugeHeaderGivesAPositiveSizeInTheMessage) {
  const int32_t h[7] = {1 << 16, 1 << 18, 1024, 1024, 1024, 1 << 22, 1 << 20};
  std::vector<uint8_t> b(sizeof h + 64);
  std::memcpy(b.data(), h, sizeof h);
  const std::string p = tmp_path("huge.bin");
  write_file(p, b);
  auto m = Model::load(p);
  ::unlink(p.c_str());
  ASSERT_EQ(m.status().code(), StatusCode::kCorruptInput) << m.status().to_string();
  EXPECT_NE(m.status().message().find("implies"), std::string::npos) << m.status().message();
  EXPECT_FALSE(std::regex_search(m.status().message(), std::regex(" -[0-9]"))) << m.status().message();
}

}  // namespace
}  // namespace kvq::model
