// Text acquisition (pydoc topics, files) and the logits dump format.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>

#include "kvq/eval/logits_dump.h"
#include "kvq/eval/text.h"

namespace kvq::eval {
namespace {

std::string tmp_path(const std::string& name) {
  return std::string(KVQ_TEST_BINARY_DIR) + "/eval_" + std::to_string(getpid()) + "_" + name;
}

// Runs python and returns its stdout (the test's own route to the same module).
std::string python_out(const std::string& code) {
  std::string cmd = std::string(KVQ_PYTHON) + " -c \"" + code + "\"";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while (p && (n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  if (p) pclose(p);
  return out;
}

TEST(Text, PydocTopicsArePlainTextInSortedOrder) {
  auto t = pydoc_topics_text(KVQ_PYTHON);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  const std::string& s = t.value().text;
  EXPECT_GT(s.size(), 100000u);
  EXPECT_NE(t.value().source.find("topics.py"), std::string::npos) << t.value().source;
  EXPECT_NE(t.value().source.find("Python 3."), std::string::npos) << t.value().source;
  // Sorted key order puts 'assert' first and 'while' after 'assignment'.
  EXPECT_EQ(s.rfind("The \"assert\" statement\n", 0), 0u) << s.substr(0, 60);
  const size_t assign = s.find("Assignment statements\n"), wh = s.find("The \"while\" statement\n");
  ASSERT_NE(assign, std::string::npos);
  ASSERT_NE(wh, std::string::npos);
  EXPECT_LT(assign, wh);
  // Plain text, not Python source: no dict syntax, and real newlines rather than escapes.
  EXPECT_EQ(s.find("topics = {"), std::string::npos);
  EXPECT_EQ(s.find("statement\\n"), std::string::npos);
  EXPECT_EQ(s.back(), '\n');
  EXPECT_NE(s[s.size() - 2], '\n');

  // The bytes arrive whole: length and separator count as python computes them in its own run.
  const std::string want = python_out(
      "import pydoc_data.topics as t; nl=chr(10); "
      "b=(2*nl).join(t.topics[k].rstrip() for k in sorted(t.topics)).encode()+nl.encode(); "
      "print(len(b), b.count((2*nl).encode()))");
  size_t seps = 0;
  for (size_t p = s.find("\n\n"); p != std::string::npos; p = s.find("\n\n", p + 2)) ++seps;
  EXPECT_EQ(std::to_string(s.size()) + " " + std::to_string(seps) + "\n", want);
}

TEST(Text, PydocErrorsTellTheWayOut) {
  auto t = pydoc_topics_text("/nonexistent/python3");
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("--text"), std::string::npos) << t.status().message();
  // An interpreter without the module ("false" exits 1 like a failing python).
  auto f = pydoc_topics_text("false");
  ASSERT_FALSE(f.is_ok());
  EXPECT_NE(f.status().message().find("--text"), std::string::npos);
}

TEST(Text, ReadFile) {
  const std::string p = tmp_path("text.txt");
  { std::ofstream(p) << "héllo\nworld\n"; }
  auto t = read_text_file(p);
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(t.value().text, "héllo\nworld\n");
  EXPECT_EQ(t.value().source, p);
  { std::ofstream(p, std::ios::trunc); }
  EXPECT_EQ(read_text_file(p).status().code(), StatusCode::kInvalidArgument);
  std::remove(p.c_str());
  EXPECT_EQ(read_text_file(p).status().code(), StatusCode::kNotFound);
}

TEST(Text, Fnv1aKnownValues) {
  // Published FNV-1a 64 test vectors.
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ull);
}

TEST(LogitsDump, RoundTripAndCorruption) {
  LogitsDump d;
  d.vocab = 7;
  d.bos = true;
  d.text_ids = {5, 4, 3, 2, 1};
  d.tokens = {1, 5, 4};
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-9, 9);
  for (int i = 0; i < 21; ++i) d.logits.push_back(u(rng));
  const std::string p = tmp_path("dump.bin");
  ASSERT_TRUE(write_logits_dump(p, d).is_ok());
  auto r = read_logits_dump(p);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r.value().vocab, 7);
  EXPECT_TRUE(r.value().bos);
  EXPECT_EQ(r.value().text_ids, d.text_ids);
  EXPECT_EQ(r.value().tokens, d.tokens);
  EXPECT_EQ(r.value().logits, d.logits);

  {  // truncated by one float
    std::ifstream in(p, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 4));
  }
  EXPECT_EQ(read_logits_dump(p).status().code(), StatusCode::kCorruptInput);
  { std::ofstream(p, std::ios::binary | std::ios::trunc) << "GGUF and more bytes here"; }
  EXPECT_EQ(read_logits_dump(p).status().code(), StatusCode::kCorruptInput);
  std::remove(p.c_str());

  d.logits.pop_back();
  EXPECT_EQ(write_logits_dump(p, d).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvq::eval
