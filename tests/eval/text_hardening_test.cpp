// The evaluation text reader and the logits dump against hostile inputs and outputs (issue 11):
// non-regular files refused by name, long texts read only as far as the window budget needs,
// outputs replaced atomically.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "kvq/eval/logits_dump.h"
#include "kvq/eval/text.h"

namespace kvq::eval {
namespace {

std::string tmp_path(const std::string& name) {
  return std::string(KVQ_TEST_BINARY_DIR) + "/texth_" + std::to_string(::getpid()) + "_" + name;
}

TEST(TextHardening, NonRegularFilesAreRefusedByName) {
  const std::string dir = tmp_path("dir");
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  auto d = read_text_file(dir);
  ::rmdir(dir.c_str());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("'" + dir + "' is a directory"), std::string::npos) << d.status().message();

  const std::string fifo = tmp_path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto f = read_text_file(fifo, text_bytes_for_tokens(128));  // never waits for a writer
  ::unlink(fifo.c_str());
  EXPECT_NE(f.status().message().find("FIFO"), std::string::npos) << f.status().message();

  auto z = read_text_file("/dev/zero", text_bytes_for_tokens(128));  // endless: refused, not read
  EXPECT_NE(z.status().message().find("character device"), std::string::npos) << z.status().message();
  EXPECT_EQ(read_text_file(tmp_path("missing")).status().code(), StatusCode::kNotFound);
}

TEST(TextHardening, BudgetBytes) {
  EXPECT_EQ(text_bytes_for_tokens(0), 0u);
  EXPECT_EQ(text_bytes_for_tokens(-5), 0u);
  EXPECT_EQ(text_bytes_for_tokens(128), kMinTextPrefixBytes);
  EXPECT_EQ(text_bytes_for_tokens(1000000), 64000000u);
  EXPECT_EQ(text_bytes_for_tokens(INT64_MAX), kMaxTextBytes);
}

TEST(TextHardening, LongTextIsReadOnlyAsFarAsTheBudgetNeeds) {
  // 3 MiB of two-byte characters, so a 1 MiB cut could split one.
  const std::string p = tmp_path("long.txt");
  std::string body;
  for (int i = 0; i < 3 << 19; ++i) body += i % 97 == 0 ? "\n" : "\xC3\xA9";  // é
  {
    std::ofstream f(p, std::ios::binary);
    f << "x" << body;  // the leading byte puts every é at an odd offset
  }
  auto t = read_text_file(p, text_bytes_for_tokens(128));
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  const std::string& s = t.value().text;
  EXPECT_LE(s.size(), kMinTextPrefixBytes);
  EXPECT_GE(s.size(), kMinTextPrefixBytes - 3);
  EXPECT_EQ(s.compare(0, 1000, ("x" + body).substr(0, 1000)), 0);
  const unsigned char last = static_cast<unsigned char>(s.back());
  EXPECT_TRUE(last == '\n' || last == 0xA9) << int(last);  // ends on a whole character
  EXPECT_NE(t.value().source.find("first " + std::to_string(s.size()) + " of"), std::string::npos) << t.value().source;

  // Without a budget the whole file is read, and `source` is the plain path.
  auto whole = read_text_file(p);
  ASSERT_TRUE(whole.is_ok());
  EXPECT_EQ(whole.value().text.size(), body.size() + 1);
  EXPECT_EQ(whole.value().source, p);

  // Larger than kvq reads whole (a sparse file: no disk used): refused by size before reading.
  ASSERT_EQ(::truncate(p.c_str(), static_cast<off_t>(kMaxTextBytes + 1)), 0);
  auto big = read_text_file(p);
  EXPECT_EQ(big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(big.status().message().find(std::to_string(kMaxTextBytes + 1) + " bytes"), std::string::npos)
      << big.status().message();
  ::unlink(p.c_str());
}

TEST(LogitsDumpHardening, WrittenAtomically) {
  LogitsDump d;
  d.vocab = 3;
  d.text_ids = {5, 6};
  d.tokens = {5};
  d.logits = {0.5f, 1.5f, -2.f};
  const std::string p = tmp_path("dump.bin");
  {
    std::ofstream f(p);
    f << "previous";
  }
  ASSERT_TRUE(write_logits_dump(p, d).is_ok());
  auto r = read_logits_dump(p);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r.value().logits, d.logits);
  // A failing write (no such folder) reports the path and leaves nothing behind.
  Status s = write_logits_dump(tmp_path("nodir") + "/dump.bin", d);
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("nodir"), std::string::npos) << s.message();
  // A directory in the way is refused; the old file elsewhere is unchanged.
  Status dir = write_logits_dump(std::string(KVQ_TEST_BINARY_DIR), d);
  EXPECT_NE(dir.message().find("directory"), std::string::npos) << dir.message();
  EXPECT_TRUE(read_logits_dump(p).is_ok());
  ::unlink(p.c_str());
}

}  // namespace
}  // namespace kvq::eval
