// File input/output helpers: type checks (directory, FIFO, device refused by name, a FIFO never
// waited on), size caps, atomic replacement and the early writability check.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "kvq/common/checksum.h"
#include "kvq/common/file_io.h"

namespace kvq {
namespace {

class FileIo : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::string(KVQ_TEST_BINARY_DIR) + "/fileio_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ASSERT_EQ(std::system(("rm -rf '" + dir_ + "' && mkdir -p '" + dir_ + "'").c_str()), 0);
  }
  void TearDown() override { (void)std::system(("rm -rf '" + dir_ + "'").c_str()); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  void write(const std::string& p, const std::string& bytes) {
    std::ofstream f(p, std::ios::binary);
    f << bytes;
  }
  // Entries of the folder (to see that no temporary file is left behind).
  int entries() const {
    std::string cmd = "ls -A '" + dir_ + "' | wc -l";
    FILE* p = popen(cmd.c_str(), "r");
    int n = -1;
    if (p && std::fscanf(p, "%d", &n) != 1) n = -1;
    if (p) pclose(p);
    return n;
  }
  std::string dir_;
};

TEST_F(FileIo, ReadsARegularFileWhole) {
  write(path("a"), std::string("abc\0def", 7));
  auto r = read_file(path("a"), 100, "test file");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r.value(), std::string("abc\0def", 7));
}

TEST_F(FileIo, RefusesMissingDirectoryFifoAndDevice) {
  auto missing = read_file(path("nope"), 100, "test file");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(path("nope")), std::string::npos);

  auto dir = read_file(dir_, 100, "test file");
  EXPECT_EQ(dir.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dir.status().message().find("is a directory"), std::string::npos) << dir.status().message();

  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto fifo = read_file(path("fifo"), 100, "test file");  // must not block waiting for a writer
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(fifo.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(fifo.status().message().find("FIFO"), std::string::npos) << fifo.status().message();
  EXPECT_NE(fifo.status().message().find(path("fifo")), std::string::npos);

  auto dev = read_file("/dev/zero", 100, "test file");  // endless: must be refused, not read
  EXPECT_EQ(dev.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dev.status().message().find("character device"), std::string::npos) << dev.status().message();
  EXPECT_EQ(describe_non_regular("/dev/zero"), "a character device");
  EXPECT_EQ(describe_non_regular(path("nope")), "");
}

TEST_F(FileIo, CapsTheSizeWithAClearError) {
  write(path("big"), std::string(1000, 'x'));
  auto r = read_file(path("big"), 999, "test file");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("1000 bytes"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("999"), std::string::npos);
  auto p = read_file_prefix(path("big"), 10, "test file");
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(p.value().bytes, std::string(10, 'x'));
  EXPECT_EQ(p.value().file_size, 1000u);
  EXPECT_TRUE(p.value().truncated());
}

TEST_F(FileIo, WritesAtomicallyAndLeavesNoTemporaryFile) {
  const std::string out = path("out.json");
  write(out, "old contents");
  ASSERT_TRUE(write_file_atomic(out, "new", "output").is_ok());
  auto r = read_file(out, 100, "output");
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r.value(), "new");
  EXPECT_EQ(entries(), 1);

  // A directory at the target is refused and left alone; the old file of another path is untouched.
  ASSERT_EQ(::mkdir(path("d").c_str(), 0755), 0);
  Status s = write_file_atomic(path("d"), "x", "output");
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("directory"), std::string::npos) << s.message();
  EXPECT_EQ(entries(), 2);

  Status missing_dir = write_file_atomic(path("no/such/dir/out.json"), "x", "output");
  EXPECT_EQ(missing_dir.code(), StatusCode::kNotFound);
  EXPECT_NE(missing_dir.message().find("does not exist"), std::string::npos);
}

TEST_F(FileIo, ChecksWritabilityBeforeARun) {
  EXPECT_TRUE(check_writable(path("new.json"), "output").is_ok());
  EXPECT_EQ(entries(), 0);  // the probe leaves nothing behind
  EXPECT_FALSE(check_writable(dir_, "output").is_ok());
  EXPECT_FALSE(check_writable(path("missing/x.json"), "output").is_ok());
  EXPECT_FALSE(check_writable("/proc/version", "output").is_ok());  // a folder that takes no new file
  if (::geteuid() != 0) {  // root writes anywhere
    ASSERT_EQ(::mkdir(path("ro").c_str(), 0555), 0);
    EXPECT_FALSE(check_writable(path("ro/x.json"), "output").is_ok());
  }
}

TEST_F(FileIo, Sha256AndTheVerificationStamp) {
  write(path("f"), "abc");
  auto h = sha256_file(path("f"), "test file");
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(h.value(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string stamp = path("f.verified");
  EXPECT_TRUE(verify_file_sha256(path("f"), 3, h.value(), stamp, "refetch").is_ok());
  auto st = read_file(stamp, 4096, "stamp");
  ASSERT_TRUE(st.is_ok());
  EXPECT_NE(st.value().find(h.value()), std::string::npos);
  // Wrong size: refused without hashing, naming the remedy.
  Status size = verify_file_sha256(path("f"), 4, h.value(), stamp, "refetch");
  EXPECT_EQ(size.code(), StatusCode::kCorruptInput);
  EXPECT_NE(size.message().find("refetch"), std::string::npos);
  // Same size, new contents (and so a new mtime): the stamp no longer applies, the hash is checked.
  write(path("f"), "abd");
  struct timespec later[2] = {{0, UTIME_OMIT}, {2000000000, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path("f").c_str(), later, 0), 0);
  Status bad = verify_file_sha256(path("f"), 3, h.value(), stamp, "refetch");
  EXPECT_EQ(bad.code(), StatusCode::kCorruptInput);
  EXPECT_NE(bad.message().find("sha256"), std::string::npos) << bad.message();
}

}  // namespace
}  // namespace kvq
