// The model file kvq fetches itself is verified when resolved (issue 11): its pinned size and
// sha256 match the fetch script's, and a wrong file in the cache folder is refused by name.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>

#include "kvq/model/model.h"
#include "kvq/model/pinned.h"

namespace kvq::model {
namespace {

TEST(PinnedModel, MatchesTheFetchScript) {
  std::ifstream f(std::string(KVQ_SOURCE_DIR) + "/scripts/pull_smollm2.py");
  const std::string py((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::smatch m;
  ASSERT_TRUE(std::regex_search(py, m, std::regex("SHA256 = \"([0-9a-f]{64})\"")));
  EXPECT_EQ(m[1].str(), kSmolLM2Sha256);
  ASSERT_TRUE(std::regex_search(py, m, std::regex("\\(([0-9,]+) bytes\\)")));
  std::string digits = std::regex_replace(m[1].str(), std::regex(","), "");
  EXPECT_EQ(std::stoull(digits), kSmolLM2Bytes);
}

// A cache folder (KVQ_CACHE_DIR) whose SmolLM2 file is the wrong one: refused before loading.
class WrongCachedModel : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::string(KVQ_TEST_BINARY_DIR) + "/pinned_" + std::to_string(::getpid());
    ASSERT_EQ(std::system(("mkdir -p '" + dir_ + "'").c_str()), 0);
    const char* old = std::getenv("KVQ_CACHE_DIR");
    had_ = old != nullptr;
    if (had_) old_ = old;
    ::setenv("KVQ_CACHE_DIR", dir_.c_str(), 1);
  }
  void TearDown() override {
    if (had_) ::setenv("KVQ_CACHE_DIR", old_.c_str(), 1);
    else ::unsetenv("KVQ_CACHE_DIR");
    (void)std::system(("rm -rf '" + dir_ + "'").c_str());
  }
  std::string file() const { return dir_ + "/" + kSmolLM2File; }
  std::string dir_, old_;
  bool had_ = false;
};

TEST_F(WrongCachedModel, TruncatedFileIsRefusedBySize) {
  std::ofstream(file()) << "GGUF and nothing else";
  auto p = resolve_model_path("smollm2");
  EXPECT_EQ(p.status().code(), StatusCode::kCorruptInput);
  EXPECT_NE(p.status().message().find("wrong size"), std::string::npos) << p.status().message();
  EXPECT_NE(p.status().message().find("kvq pull smollm2"), std::string::npos) << p.status().message();
}

TEST_F(WrongCachedModel, SameSizeOtherBytesFailTheHash) {
  {
    std::ofstream f(file(), std::ios::binary);
    f.seekp(static_cast<std::streamoff>(kSmolLM2Bytes - 1));
    f.put('x');
  }
  auto p = resolve_model_path("smollm2");
  EXPECT_EQ(p.status().code(), StatusCode::kCorruptInput);
  EXPECT_NE(p.status().message().find("sha256"), std::string::npos) << p.status().message();
  std::ifstream stamp(file() + ".verified");
  EXPECT_FALSE(stamp.good());  // nothing is stamped as verified
}

}  // namespace
}  // namespace kvq::model
