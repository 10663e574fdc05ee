// The CLI's refusals of malformed input (issue 11): for every class of bad model, tokenizer, text
// and output path, `kvq` exits non-zero (not by a signal, not by hanging), and says so in exactly
// one line on stderr that names the input and the problem, never in std::bad_alloc or terminate
// text.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>
#include "kvq/model/model.h"
#include "model/stories_data.h"

namespace {

const std::string kShared = kvq::model::stories260k_dir() + "/";

std::string tmp_path(const std::string& name) {
  return std::string(KVQ_TEST_BINARY_DIR) + "/cli_" + std::to_string(::getpid()) + "_" + name;
}

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& p, const std::string& b) {
  std::ofstream f(p, std::ios::binary);
  f << b;
}

struct CliRun {
  int code = -1;  // exit status; 124 = timed out; >= 128 = killed by a signal
  std::string err;
  double seconds = 0;
};

CliRun kvq(const std::string& args) {
  const std::string err = tmp_path("stderr"), out = tmp_path("stdout");
  const std::string cmd = "timeout 120 '" + std::string(KVQ_CLI) + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const auto t0 = std::chrono::steady_clock::now();
  int rc = std::system(cmd.c_str());
  CliRun r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.code = WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + (WIFSIGNALED(rc) ? WTERMSIG(rc) : 0);
  r.err = slurp(err);
  ::unlink(err.c_str());
  ::unlink(out.c_str());
  return r;
}

// The refusal contract; `needles` must all appear in the one line.
void expect_refusal(const CliRun& r, const std::vector<std::string>& needles) {
  EXPECT_GE(r.code, 1) << r.err;
  EXPECT_LT(r.code, 124) << "timed out or killed by a signal: " << r.err;
  ASSERT_FALSE(r.err.empty());
  EXPECT_EQ(r.err.back(), '\n') << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "more than one line:\n" << r.err;
  for (const char* bad : {"bad_alloc", "terminate", "what()", "Aborted", "Segmentation"})
    EXPECT_EQ(r.err.find(bad), std::string::npos) << r.err;
  EXPECT_FALSE(std::regex_search(r.err, std::regex(" -[0-9]{3,}"))) << "negative size: " << r.err;
  for (const auto& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << "missing '" << n << "' in: " << r.err;
}

class CliRefusal : public ::testing::Test {
 protected:
  void SetUp() override { KVQ_REQUIRE_STORIES260K(); }
};

TEST_F(CliRefusal, MalformedModelFiles) {
  const std::string gguf = tmp_path("bad.gguf");
  write_bytes(gguf, std::string("GGUF\3\0\0\0", 8) + std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + std::string(8, '\0') + "junk");
  expect_refusal(kvq("eval --model '" + gguf + "' --text '" + kShared + "tinystories_valid_head.txt'"), {gguf, "tensor count"});
  ::unlink(gguf.c_str());

  // A llama2.c header at every size limit: the implied size is named, positive.
  const std::string huge = tmp_path("huge.bin");
  const int32_t h[7] = {1 << 16, 1 << 18, 1024, 1024, 1024, 1 << 22, 1 << 20};
  write_bytes(huge, std::string(reinterpret_cast<const char*>(h), sizeof h) + std::string(64, '\0'));
  expect_refusal(kvq("generate --model '" + huge + "' -n 1"), {huge, "implies"});
  ::unlink(huge.c_str());

  expect_refusal(kvq("generate --model '" + std::string(KVQ_TEST_BINARY_DIR) + "' -n 1"), {"is a directory"});
  expect_refusal(kvq("generate --model /dev/zero -n 1"), {"/dev/zero", "character device"});
  const std::string fifo = tmp_path("model.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_refusal(kvq("generate --model '" + fifo + "' -n 1"), {fifo, "FIFO"});
  ::unlink(fifo.c_str());
}

TEST_F(CliRefusal, MalformedTokenizerFiles) {
  // tok512.bin cut short, and tok512.bin with its first piece's length forged negative.
  std::string tok = slurp(kShared + "tok512.bin");
  ASSERT_GT(tok.size(), 100u);
  const std::string cut = tmp_path("cut_tok.bin");
  write_bytes(cut, tok.substr(0, tok.size() / 2));
  expect_refusal(kvq("generate --model stories260K --tokenizer '" + cut + "' -n 1"), {cut, "tokenizer"});
  int32_t neg = -7;
  std::memcpy(tok.data() + 8, &neg, 4);
  write_bytes(cut, tok);
  expect_refusal(kvq("generate --model stories260K --tokenizer '" + cut + "' -n 1"), {cut, "bad length"});
  ::unlink(cut.c_str());
  expect_refusal(kvq("generate --model stories260K --tokenizer /dev/zero -n 1"), {"/dev/zero", "character device"});
}

TEST_F(CliRefusal, MalformedTextFiles) {
  const std::string fifo = tmp_path("text.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_refusal(kvq("eval --model stories260K --quiet --text '" + fifo + "'"), {fifo, "FIFO"});
  ::unlink(fifo.c_str());
  expect_refusal(kvq("eval --model stories260K --quiet --text /dev/zero"), {"/dev/zero", "character device"});
  expect_refusal(kvq("eval --model stories260K --quiet --text '" + std::string(KVQ_TEST_BINARY_DIR) + "'"),
                 {"is a directory"});
  const std::string empty = tmp_path("empty.txt");
  write_bytes(empty, "");
  expect_refusal(kvq("eval --model stories260K --quiet --text '" + empty + "'"), {empty, "empty"});
  ::unlink(empty.c_str());
}

TEST_F(CliRefusal, UnwritableOutputIsRefusedBeforeTheRun) {
  const std::string out = tmp_path("no_such_dir") + "/report.json";
  CliRun r = kvq("eval --model stories260K --quiet --text '" + kShared + "tinystories_valid_head.txt' --json '" + out + "'");
  expect_refusal(r, {out, "--json"});
  // Refused up front: no model was loaded, no window evaluated (that takes seconds).
  EXPECT_LT(r.seconds, 5.0);
  CliRun d = kvq("eval --model stories260K --quiet --dump-logits '" + std::string(KVQ_TEST_BINARY_DIR) + "'");
  expect_refusal(d, {"--dump-logits", "directory"});
}

// Sizes taken from flags are bounded by the model and the input: clamped where a larger value could
// only waste memory (a chunk past the window, a sink past the context, a capacity past the
// model's), refused in one line naming the flag and the limit where the run cannot do what was
// asked. Each refusal comes before the server listens (else the test would time out).
TEST_F(CliRefusal, SizeFlagsAreBoundedByTheModelAndTheInput) {
  const std::string text = " --text '" + kShared + "tinystories_valid_head.txt'";
  const std::string eval = "eval --model stories260K --quiet --kv-cache-dtype int8 --ctx 64 --max-windows 1" + text;
  for (const char* clamped : {" --chunk 1000000000", " --kv-sink-tokens 16777216", " --chunk 100000 --max-tokens 9000000000000000000"}) {
    CliRun r = kvq(eval + clamped);
    EXPECT_EQ(r.code, 0) << clamped << ": " << r.err;
    EXPECT_LT(r.seconds, 60.0) << clamped;
  }
  expect_refusal(kvq(eval + " --chunk 0"), {"--chunk 0"});
  expect_refusal(kvq("eval --model stories260K --quiet --ctx 100000" + text), {"--ctx 100000", "512"});

  // -n near INT_MAX: the capacity is the model's context, not a wrapped-around negative number.
  CliRun g = kvq("generate --model stories260K -p 'Once' -n 2147483647 --temperature 0");
  EXPECT_EQ(g.code, 0) << g.err;
  EXPECT_FALSE(std::regex_search(g.err, std::regex(" -[0-9]{3,}"))) << g.err;
  EXPECT_EQ(kvq("generate --model stories260K -p 'Once' -n 4 --max-tokens 100000").code, 0);
  expect_refusal(kvq("generate --model stories260K -p 'Once upon a time' -n 4 --max-tokens 2"), {"--max-tokens 2", "prompt"});
  expect_refusal(kvq("generate --model stories260K -n 4 --max-tokens -5"), {"--max-tokens -5"});

  const std::string serve = "serve --model stories260K --backend cpu --port 0";
  expect_refusal(kvq(serve + " --max-model-len 100000"), {"--max-model-len 100000", "512"});
  expect_refusal(kvq(serve + " --max-body-mib 1e30"), {"--max-body-mib"});
  expect_refusal(kvq(serve + " --kv-cache-memory nan"), {"--kv-cache-memory"});
  expect_refusal(kvq(serve + " --max-num-batched-tokens -1"), {"--max-num-batched-tokens -1"});
  // 1 PiB of pages for a 260K-parameter model: refused from the machine's memory, by name.
  expect_refusal(kvq(serve + " --kv-cache-memory 1048576"), {"--kv-cache-memory"});
  // 4 TiB: few enough pages to plan, more than this machine's memory (of any machine CI runs on).
  expect_refusal(kvq(serve + " --kv-cache-memory 4096"), {"--kv-cache-memory", "more than this machine"});
}

TEST_F(CliRefusal, JsonReportIsWrittenWhole) {
  const std::string out = tmp_path("report.json");
  write_bytes(out, "stale");
  CliRun r = kvq("eval --model stories260K --quiet --kv-cache-dtype bf16,int8 --ctx 64 --max-windows 1 --text '" + kShared +
              "tinystories_valid_head.txt' --json '" + out + "'");
  EXPECT_EQ(r.code, 0) << r.err;
  const std::string j = slurp(out);
  ASSERT_FALSE(j.empty());
  EXPECT_EQ(j.front(), '{');
  EXPECT_EQ(j.substr(j.size() - 2), "}\n");
  ::unlink(out.c_str());
}

}  // namespace
