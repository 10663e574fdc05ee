// The real `kvq` binary: each command is wired to the shared cache options and refuses bad values
// before it loads a model or looks for a GPU, with one line on stderr naming the flag.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
#include "kvq/model/model.h"
#include "model/stories_data.h"

namespace {

struct Ran {
  int rc = -1;
  std::string out, err;
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  return s;
}

Ran kvq(const std::vector<std::string>& args) {
  const std::string base = std::string(KVQ_TEST_BINARY_DIR) + "/kvq_cli_" + std::to_string(getpid());
  // Appended piece by piece: GCC 12 at -O3 warns (-Wrestrict, a false positive) on "literal" + string&&.
  std::string cmd = quote(KVQ_CLI_BINARY);
  for (const std::string& a : args) {
    cmd += ' ';
    cmd += quote(a);
  }
  cmd += " >";
  cmd += quote(base + ".out");
  cmd += " 2>";
  cmd += quote(base + ".err");
  cmd += " </dev/null";
  Ran r;
  const int st = std::system(cmd.c_str());
  r.rc = st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = slurp(base + ".out");
  r.err = slurp(base + ".err");
  return r;
}

int lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

// Each command as typed, with what it needs to get as far as its options (a model path that does
// not exist: a cache option must be refused before the model is looked for).
const std::vector<std::vector<std::string>>& commands() {
  static const std::vector<std::vector<std::string>> c = {{"eval", "--model", "/nonexistent/model.gguf"},
                                                          {"generate", "--model", "/nonexistent/model.gguf"},
                                                          {"bench", "decode"},
                                                          {"bench", "write"},
                                                          {"report"},
                                                          {"serve", "--model", "/nonexistent/model.gguf"}};
  return c;
}

std::vector<std::string> with(std::vector<std::string> cmd, const std::vector<std::string>& more) {
  cmd.insert(cmd.end(), more.begin(), more.end());
  return cmd;
}

TEST(KvqBinary, Version) {
  const Ran r = kvq({"--version"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.rfind("kvq " KVQ_VERSION " (commit ", 0), 0u) << r.out;
  EXPECT_NE(r.out.find(" build, CUDA o"), std::string::npos) << r.out;
  EXPECT_EQ(lines(r.out), 1) << r.out;
}

TEST(KvqBinary, MistypedCommand) {
  const Ran r = kvq({"evl", "--model", "x"});
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err.rfind("kvq: unknown command 'evl'; commands: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("eval"), std::string::npos) << r.err;
  EXPECT_EQ(lines(r.err), 1) << r.err;
  const Ran b = kvq({"bench", "decod"});
  EXPECT_NE(b.rc, 0);
  EXPECT_EQ(b.err.rfind("kvq bench: unknown command 'decod'; commands: decode, write", 0), 0u) << b.err;
  const Ran none = kvq({});
  EXPECT_NE(none.rc, 0);
  EXPECT_NE(none.err.find("no command given"), std::string::npos) << none.err;
}

TEST(KvqBinary, EveryCommandRefusesAnEmptyBlockSize) {
  for (const auto& cmd : commands()) {
    for (const std::vector<std::string>& bad : {std::vector<std::string>{"--block-size", ""},
                                                std::vector<std::string>{"--block-size="}}) {
      const Ran r = kvq(with(cmd, bad));
      EXPECT_NE(r.rc, 0) << cmd[0];
      EXPECT_NE(r.err.find("--block-size: needs an integer value (got an empty one)"), std::string::npos)
          << cmd[0] << ": " << r.err;
      EXPECT_EQ(lines(r.err), 1) << r.err;
    }
  }
}

TEST(KvqBinary, EveryCommandRefusesBlockSize24TheSameWay) {
  for (const auto& cmd : commands()) {
    const Ran r = kvq(with(cmd, {"--block-size", "24"}));
    EXPECT_NE(r.rc, 0) << cmd[0];
    EXPECT_NE(r.err.find("--block-size 24 is not supported; accepted: 16, 32"), std::string::npos)
        << cmd[0] << ": " << r.err;
    EXPECT_EQ(lines(r.err), 1) << r.err;
    EXPECT_EQ(r.out, "") << cmd[0];
  }
}

TEST(KvqBinary, BenchDecodeChecksBlockSizesBeforeTheDevice) {
  const Ran r = kvq({"bench", "decode", "--kv-cache-dtype", "bf16,int4", "--block-sizes", "16,64"});
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--block-sizes '16,64': each entry must be 16 or 32 (got '64')"), std::string::npos) << r.err;
  EXPECT_EQ(lines(r.err), 1) << r.err;
}

// A range-checked option names a value that is no number as such, and a number out of range with the range
// (CLI11's own words were "Value abc not in range 1 to 1000" and "0.000000 to 10000.000000").
TEST(KvqBinary, RangeChecksNameTheValueAndTheRange) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"bench", "decode", "--timeline-runs", "0"}, "kvq bench decode: --timeline-runs 0 is out of range; accepted: 1 to 1000"},
      {{"bench", "decode", "--timeline-runs", "abc"}, "kvq bench decode: --timeline-runs: needs an integer (got 'abc')"},
      {{"bench", "decode", "--warmup-ms", "-5"}, "kvq bench decode: --warmup-ms -5 is out of range; accepted: 0 to 10000"},
      {{"bench", "decode", "--warmup-ms", "x1"}, "kvq bench decode: --warmup-ms: needs a number (got 'x1')"},
      {{"capacity", "--tokens", "abc"}, "kvq capacity: --tokens: needs an integer (got 'abc')"},
  };
  for (const Case& c : cases) {
    const Ran r = kvq(c.args);
    EXPECT_NE(r.rc, 0) << c.message;
    EXPECT_EQ(r.err, c.message + "\n");
    EXPECT_EQ(r.out, "") << c.message;
  }
}

TEST(KvqBinary, NegativeSinkIsRefusedWhereverItIsTaken) {
  for (const auto& cmd : commands()) {
    if (cmd.size() > 1 && cmd[1] == "write") continue;  // the write benchmark has no sink
    const Ran r = kvq(with(cmd, {"--kv-sink-tokens", "-1"}));
    EXPECT_NE(r.rc, 0) << cmd[0];
    EXPECT_NE(r.err.find("--kv-sink-tokens -1 is out of range"), std::string::npos) << cmd[0] << ": " << r.err;
  }
}

TEST(KvqBinary, OldBenchSpellingsStillWorkWithANotice) {
  const Ran r = kvq({"bench", "decode", "--formats", "fp9", "--sink", "0"});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--formats is deprecated; use --kv-cache-dtype"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--sink is deprecated; use --kv-sink-tokens"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("unknown --kv-cache-dtype 'fp9'"), std::string::npos) << r.err;
}

// --max-windows N evaluates N windows even where N windows exceed the default token budget (4096);
// an explicit --max-tokens still caps them. stories260K at ctx 512: 10 windows = 5120 tokens.
TEST(KvqBinary, EvalMaxWindowsIsNotCutByTheDefaultBudget) {
  KVQ_REQUIRE_STORIES260K();
  const std::string text = kvq::model::stories260k_dir() + "/tinystories_valid_head.txt";
  const std::string json = std::string(KVQ_TEST_BINARY_DIR) + "/eval_windows_" + std::to_string(getpid()) + ".json";
  auto windows = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"eval", "--model", "stories260K", "--text", text, "--ctx", "512",
                                     "--kv-cache-dtype", "bf16", "--backend", "cpu", "--quiet", "--json", json};
    args.insert(args.end(), extra.begin(), extra.end());
    const Ran r = kvq(args);
    EXPECT_EQ(r.rc, 0) << r.err;
    const std::string report = slurp(json);
    const std::string key = "\n  \"windows\": ";  // the top-level count (specs have per-window lists)
    const size_t at = report.find(key);
    return at == std::string::npos ? -1 : std::atoi(report.c_str() + at + key.size());
  };
  EXPECT_EQ(windows({"--max-windows", "10"}), 10);
  EXPECT_EQ(windows({"--max-windows", "10", "--max-tokens", "2048"}), 4);
  EXPECT_EQ(windows({}), 8);  // the default budget: 4096 tokens
}

TEST(KvqBinary, SamplingIsCheckedBeforeTheModelLoads) {
  const Ran r = kvq({"generate", "--model", "/nonexistent/model.gguf", "--top-p", "1.5"});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--top-p 1.5 is not valid"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("nonexistent"), std::string::npos) << r.err;
  const Ran t = kvq({"generate", "--model", "/nonexistent/model.gguf", "--temperature", ""});
  EXPECT_NE(t.rc, 0);
  EXPECT_NE(t.err.find("--temperature: needs a number"), std::string::npos) << t.err;
}

}  // namespace
