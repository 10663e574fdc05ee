// The cache options of every command that builds a cache, parsed once here: each command's option
// set is built as the CLI builds it (add_cache_options with the command's flag set, then
// refuse_empty_numbers as main.cpp does), the same argument vectors go to every command, and the
// resulting QuantSpecs, refusals and messages must be the same.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kvq/cache_options.h"
#include "kvq/cli_support.h"
#include "kvq/common/file_io.h"
#include "kvq/model/model.h"
#include "model/stories_data.h"

namespace kvq::tools {
namespace {

std::vector<std::string> words_of(CacheCommand cmd) {
  switch (cmd) {
    case CacheCommand::kEval: return {"eval"};
    case CacheCommand::kGenerate: return {"generate"};
    case CacheCommand::kBenchDecode: return {"bench", "decode"};
    case CacheCommand::kBenchWrite: return {"bench", "write"};
    case CacheCommand::kReport: return {"report"};
    case CacheCommand::kServe: return {"serve"};
  }
  return {};
}

std::string name_of(CacheCommand cmd) { return cache_flag_set(cmd).command; }

bool has_flag(CacheCommand cmd, const std::string& flag) {
  const CacheFlagSet& s = cache_flag_set(cmd);
  if (flag == "--kv-cache-dtype") return s.dtype;
  if (flag == "--kv-scale-granularity") return s.granularity;
  if (flag == "--kv-scale-dtype") return s.scale_dtype;
  if (flag == "--block-size") return s.block_size;
  if (flag == "--kv-sink-tokens") return s.sink;
  if (flag == "--backend") return s.backend;
  for (const auto& a : s.aliases)
    if (flag == a.old_name) return true;
  return false;
}

// What a command makes of its cache options, as a list of specs. `error` is the refusal without
// the "kvq <command>: " prefix, whether CLI11 or the spec functions refused.
struct Outcome {
  bool parsed = false;
  std::string error;
  CacheCliOptions opts;
  std::vector<QuantSpec> specs;
};

// One argument: a flag and its value, or a single word when `value` is null ("--block-size=").
struct Arg {
  std::string flag;
  const char* value;
};

Outcome run(CacheCommand cmd, const std::vector<Arg>& args) {
  Outcome out;
  CLI::App app{"test", "kvq"};
  app.require_subcommand(1);
  CLI::App* sub = &app;
  for (const std::string& w : words_of(cmd)) sub = sub->add_subcommand(w, w);
  add_cache_options(sub, out.opts, cmd);
  refuse_empty_numbers(app);

  std::vector<std::string> argv{"kvq"};
  for (const std::string& w : words_of(cmd)) argv.push_back(w);
  for (const Arg& a : args) {
    argv.push_back(a.flag);
    if (a.value != nullptr) argv.push_back(a.value);
  }
  std::vector<const char*> cargs;
  for (const std::string& s : argv) cargs.push_back(s.c_str());
  const std::string prefix = "kvq " + name_of(cmd) + ": ";
  try {
    app.parse(static_cast<int>(cargs.size()), cargs.data());
  } catch (const CLI::ParseError& e) {
    out.error = parse_error_line(app, e);
    EXPECT_EQ(out.error.rfind(prefix, 0), 0u) << out.error;
    out.error = out.error.substr(std::min(out.error.size(), prefix.size()));
    return out;
  }
  out.parsed = true;

  Status st;
  switch (cmd) {
    case CacheCommand::kEval: {
      auto r = to_spec_requests(out.opts, Format::kFp8E4m3);
      if (!r.is_ok()) st = r.status();
      else
        for (const auto& req : r.value()) out.specs.push_back(req.spec);
      break;
    }
    case CacheCommand::kGenerate:
    case CacheCommand::kServe: {
      auto r = to_quant_spec(out.opts, Format::kInt8);
      if (!r.is_ok()) st = r.status();
      else out.specs.push_back(r.value());
      break;
    }
    case CacheCommand::kBenchDecode:
    case CacheCommand::kBenchWrite: {
      auto r = to_cache_grid(out.opts, cmd);
      if (!r.is_ok()) {
        st = r.status();
        break;
      }
      const CacheGrid& g = r.value();
      for (Format f : g.formats) {
        for (ScaleGranularity gran : g.granularities) {
          QuantSpec s;
          s.format = f, s.granularity = gran, s.block_size = g.block_size, s.sink_tokens = g.sink_tokens;
          out.specs.push_back(s);
          if (!s.quantized()) break;
        }
      }
      break;
    }
    case CacheCommand::kReport: {
      auto r = to_geometry(out.opts);
      if (!r.is_ok()) st = r.status();
      else out.specs.push_back(r.value());
      break;
    }
  }
  out.error = st.message();
  return out;
}

// Only the flags `cmd` has.
std::vector<Arg> for_command(CacheCommand cmd, const std::vector<Arg>& args) {
  std::vector<Arg> out;
  for (const Arg& a : args) {
    std::string flag = a.flag.substr(0, a.flag.find('='));
    if (has_flag(cmd, flag)) out.push_back(a);
  }
  return out;
}

// Compares what both commands decide (a command without a flag keeps its own default there).
void expect_same_spec(const QuantSpec& got, const QuantSpec& want, CacheCommand cmd, const std::string& what) {
  const CacheFlagSet& s = cache_flag_set(cmd);
  SCOPED_TRACE(name_of(cmd) + ": " + what);
  if (s.dtype) {
    EXPECT_EQ(format_name(got.format), std::string(format_name(want.format)));
  }
  if (s.granularity && want.quantized()) {
    EXPECT_EQ(granularity_name(got.granularity), std::string(granularity_name(want.granularity)));
  }
  EXPECT_TRUE(got.scale_dtype == ScaleDtype::kFp32);
  EXPECT_EQ(got.block_size, want.block_size);
  if (s.sink) {
    EXPECT_EQ(got.sink_tokens, want.sink_tokens);
  }
  EXPECT_FALSE(got.from_auto);
}

TEST(CacheOptions, SameArgumentsGiveTheSameSpecInEveryCommand) {
  struct Case {
    std::vector<Arg> args;
    QuantSpec want;
  };
  auto spec = [](Format f, ScaleGranularity g, int block, int sink) {
    QuantSpec s;
    s.format = f, s.granularity = g, s.block_size = block, s.sink_tokens = sink;
    return s;
  };
  const std::vector<Case> cases = {
      {{{"--kv-cache-dtype", "int8"}, {"--kv-scale-granularity", "per_block_head"}, {"--block-size", "32"},
        {"--kv-sink-tokens", "8"}},
       spec(Format::kInt8, ScaleGranularity::kPerBlockHead, 32, 8)},
      {{{"--kv-cache-dtype", "fp8_fnuz"}, {"--kv-scale-granularity", "per_tensor"}, {"--kv-sink-tokens", "0"},
        {"--kv-scale-dtype", "fp32"}, {"--backend", "cpu"}},
       spec(Format::kFp8E4m3Fnuz, ScaleGranularity::kPerTensor, 16, 0)},
      {{{"--kv-cache-dtype=fp8", nullptr}, {"--kv-scale-granularity=per_token_head", nullptr}, {"--block-size=16", nullptr},
        {"--kv-sink-tokens=300", nullptr}},
       spec(Format::kFp8E4m3, ScaleGranularity::kPerTokenHead, 16, 300)},
      {{{"--kv-cache-dtype", "bf16"}, {"--block-size", "32"}, {"--kv-sink-tokens", "16"}, {"--backend", "cuda"}},
       spec(Format::kBf16, ScaleGranularity::kPerTokenHead, 32, 16)},
  };
  for (const Case& c : cases) {
    for (CacheCommand cmd : kAllCacheCommands) {
      const Outcome o = run(cmd, for_command(cmd, c.args));
      ASSERT_TRUE(o.parsed) << name_of(cmd) << ": " << o.error;
      ASSERT_EQ(o.error, "") << name_of(cmd);
      ASSERT_EQ(o.specs.size(), 1u) << name_of(cmd);
      expect_same_spec(o.specs[0], c.want, cmd, c.want.to_string());
    }
  }
}

TEST(CacheOptions, RotationReachesTheSpecOfEveryEngineCommand) {
  for (CacheCommand cmd : kAllCacheCommands) {
    if (!cache_flag_set(cmd).rotate) continue;
    const Outcome o = run(cmd, {{"--kv-cache-dtype", "int8"}, {"--kv-rotate", "hadamard"}});
    ASSERT_TRUE(o.parsed) << name_of(cmd) << ": " << o.error;
    ASSERT_EQ(o.specs.size(), 1u) << name_of(cmd);
    EXPECT_EQ(o.specs[0].rotation, KvRotation::kHadamard) << name_of(cmd);
    EXPECT_FALSE(run(cmd, {{"--kv-rotate", "givens"}}).parsed) << name_of(cmd);
  }
  for (CacheCommand cmd : {CacheCommand::kEval, CacheCommand::kGenerate, CacheCommand::kServe})
    EXPECT_TRUE(cache_flag_set(cmd).rotate) << name_of(cmd);
}

// --kv-config: eval adds the file's mix to its list, generate and serve use it in place of the
// dtype; both keep the global settings of the flags; a bad file is refused naming the flag.
TEST(CacheOptions, KvConfigReachesTheSpecOfEveryEngineCommand) {
  const std::string good = std::string(KVQ_TEST_BINARY_DIR) + "/kv_config_ok.json";
  const std::string bad = std::string(KVQ_TEST_BINARY_DIR) + "/kv_config_bad.json";
  ASSERT_TRUE(write_file_atomic(good, R"({"layers": [{"k": "int8", "v": "fp8"}, {"k": "bf16", "v": "int8"}]})",
                                "test").is_ok());
  ASSERT_TRUE(write_file_atomic(bad, R"({"layers": [{"k": "int8", "v": "fp9"}]})", "test").is_ok());
  const std::vector<Format> want = {Format::kInt8, Format::kFp8E4m3, Format::kBf16, Format::kInt8};
  for (CacheCommand cmd : kAllCacheCommands) {
    if (!cache_flag_set(cmd).kv_config) {
      EXPECT_FALSE(run(cmd, {{"--kv-config", good.c_str()}}).parsed) << name_of(cmd);
      continue;
    }
    const Outcome o = run(cmd, {{"--kv-cache-dtype", "int8"}, {"--kv-sink-tokens", "32"},
                                {"--kv-scale-granularity", "per_block_head"}, {"--kv-config", good.c_str()}});
    ASSERT_TRUE(o.parsed) << name_of(cmd) << ": " << o.error;
    ASSERT_EQ(o.specs.size(), cmd == CacheCommand::kEval ? 2u : 1u) << name_of(cmd);
    const QuantSpec& s = o.specs.back();
    EXPECT_EQ(s.plane_formats, want) << name_of(cmd);
    EXPECT_EQ(s.sink_tokens, 32) << name_of(cmd);
    EXPECT_EQ(s.granularity, ScaleGranularity::kPerBlockHead) << name_of(cmd);
    const Outcome b = run(cmd, {{"--kv-config", bad.c_str()}});
    EXPECT_NE(b.error.find("--kv-config: "), std::string::npos) << name_of(cmd) << ": " << b.error;
    EXPECT_NE(b.error.find("layers[0].v"), std::string::npos) << name_of(cmd) << ": " << b.error;
  }
  for (CacheCommand cmd : {CacheCommand::kEval, CacheCommand::kGenerate, CacheCommand::kServe})
    EXPECT_TRUE(cache_flag_set(cmd).kv_config) << name_of(cmd);
}

TEST(CacheOptions, RecentWindowReachesTheSpecOfEveryEngineCommand) {
  for (CacheCommand cmd : kAllCacheCommands) {
    if (!cache_flag_set(cmd).recent) {
      EXPECT_FALSE(run(cmd, {{"--kv-recent-tokens", "128"}}).parsed) << name_of(cmd);
      continue;
    }
    const Outcome o = run(cmd, {{"--kv-cache-dtype", "fp8"}, {"--kv-recent-tokens", "128"}});
    ASSERT_TRUE(o.parsed) << name_of(cmd) << ": " << o.error;
    ASSERT_EQ(o.error, "") << name_of(cmd);
    EXPECT_EQ(o.specs[0].to_string(), "fp8_e4m3/per_token_head/b16/sink256/recent128") << name_of(cmd);
    EXPECT_NE(run(cmd, {{"--kv-recent-tokens", "-1"}}).error.find("--kv-recent-tokens"), std::string::npos);
  }
  for (CacheCommand cmd : {CacheCommand::kEval, CacheCommand::kGenerate, CacheCommand::kServe})
    EXPECT_TRUE(cache_flag_set(cmd).recent) << name_of(cmd);
  // eval: a per-entry window beside the flag's (none here), so one run compares both.
  const Outcome e = run(CacheCommand::kEval, {{"--kv-cache-dtype", "fp8,fp8:recent64"}});
  ASSERT_EQ(e.error, "");
  ASSERT_EQ(e.specs.size(), 2u);
  EXPECT_EQ(e.specs[0].recent_tokens, 0);
  EXPECT_EQ(e.specs[1].recent_tokens, 64);
  // The benchmarks time the kernels alone: a per-entry window is refused, not ignored.
  EXPECT_NE(run(CacheCommand::kBenchDecode, {{"--kv-cache-dtype", "fp8:recent64"}}).error.find("per-entry"),
            std::string::npos);
}

TEST(CacheOptions, BackendIsValidatedAndStored) {
  for (CacheCommand cmd : kAllCacheCommands) {
    if (!cache_flag_set(cmd).backend) continue;
    EXPECT_EQ(run(cmd, {}).opts.backend, "auto") << name_of(cmd);
    for (const char* b : kBackendChoices) EXPECT_EQ(run(cmd, {{"--backend", b}}).opts.backend, b) << name_of(cmd);
    const Outcome bad = run(cmd, {{"--backend", "gpu"}});
    EXPECT_FALSE(bad.parsed) << name_of(cmd);
    EXPECT_NE(bad.error.find("--backend"), std::string::npos) << bad.error;
  }
}

struct Refusal {
  std::vector<Arg> args;
  std::string flag;  // the flag the message must name
};

const std::vector<Refusal>& refusals() {
  static const std::vector<Refusal> r = {
      {{{"--kv-cache-dtype", "fp9"}}, "--kv-cache-dtype"},
      {{{"--kv-cache-dtype", "fp8_e5m2"}}, "--kv-cache-dtype"},
      {{{"--kv-cache-dtype", ""}}, "--kv-cache-dtype"},
      {{{"--kv-scale-granularity", "per_galaxy"}}, "--kv-scale-granularity"},
      {{{"--kv-scale-dtype", "bf16"}}, "--kv-scale-dtype"},
      {{{"--block-size", "24"}}, "--block-size"},
      {{{"--block-size", "0"}}, "--block-size"},
      {{{"--block-size", ""}}, "--block-size"},
      {{{"--block-size=", nullptr}}, "--block-size"},
      {{{"--block-size", "16x"}}, "--block-size"},
      {{{"--kv-sink-tokens", "-1"}}, "--kv-sink-tokens"},
      {{{"--kv-sink-tokens", "99999999"}}, "--kv-sink-tokens"},
      {{{"--kv-sink-tokens", ""}}, "--kv-sink-tokens"},
      {{{"--kv-sink-tokens=", nullptr}}, "--kv-sink-tokens"},
      {{{"--kv-sink-tokens", "many"}}, "--kv-sink-tokens"},
      {{{"--backend", ""}}, "--backend"},
  };
  return r;
}

TEST(CacheOptions, EveryCommandRefusesTheSameWayNamingTheFlag) {
  for (const Refusal& r : refusals()) {
    std::string first_msg, first_cmd;
    int commands = 0;
    for (CacheCommand cmd : kAllCacheCommands) {
      if (!has_flag(cmd, r.flag)) continue;
      ++commands;
      const Outcome o = run(cmd, r.args);
      const std::string what = r.flag + " '" + (r.args[0].value ? r.args[0].value : "(no value)") + "' in " + name_of(cmd);
      EXPECT_FALSE(o.parsed && o.error.empty()) << what << " was accepted";
      EXPECT_NE(o.error.find(r.flag), std::string::npos) << what << ": " << o.error;
      EXPECT_EQ(o.error.find('\n'), std::string::npos) << what << ": not one line: " << o.error;
      if (first_cmd.empty()) {
        first_msg = o.error, first_cmd = name_of(cmd);
      } else {
        EXPECT_EQ(o.error, first_msg) << what << " vs " << first_cmd;
      }
    }
    EXPECT_GE(commands, 2) << r.flag;
  }
}

TEST(CacheOptions, EmptyIntegerValuesAreRefusedNotZero) {
  for (CacheCommand cmd : kAllCacheCommands) {
    for (const char* flag : {"--block-size", "--kv-sink-tokens"}) {
      if (!has_flag(cmd, flag)) continue;
      for (const std::vector<Arg>& args : {std::vector<Arg>{{flag, ""}}, std::vector<Arg>{{std::string(flag) + "=", nullptr}}}) {
        const Outcome o = run(cmd, args);
        EXPECT_FALSE(o.parsed) << name_of(cmd) << " " << flag << " accepted an empty value";
        EXPECT_NE(o.error.find(flag), std::string::npos) << o.error;
        EXPECT_NE(o.error.find("needs"), std::string::npos) << o.error;
      }
    }
  }
}

TEST(CacheOptions, DeprecatedSpellingsMeanTheSameAndSaySo) {
  auto value_for = [](const std::string& new_name) -> const char* {
    if (new_name == "--kv-cache-dtype") return "int8,fp8";
    if (new_name == "--kv-scale-granularity") return "per_block_head";
    if (new_name == "--block-size") return "32";
    return "12";
  };
  int aliases = 0;
  for (CacheCommand cmd : kAllCacheCommands) {
    for (const CacheFlagSet::Alias& a : cache_flag_set(cmd).aliases) {
      ++aliases;
      const char* v = value_for(a.new_name);
      ::testing::internal::CaptureStderr();
      const Outcome old_way = run(cmd, {{a.old_name, v}});
      const std::string notice = ::testing::internal::GetCapturedStderr();
      const Outcome new_way = run(cmd, {{a.new_name, v}});
      ASSERT_TRUE(old_way.parsed) << a.old_name << ": " << old_way.error;
      EXPECT_EQ(old_way.error, new_way.error);
      EXPECT_EQ(old_way.opts.kv_cache_dtype, new_way.opts.kv_cache_dtype);
      EXPECT_EQ(old_way.opts.kv_scale_granularity, new_way.opts.kv_scale_granularity);
      EXPECT_EQ(old_way.opts.block_size, new_way.opts.block_size);
      EXPECT_EQ(old_way.opts.sink_tokens, new_way.opts.sink_tokens);
      EXPECT_NE(notice.find(std::string(a.old_name) + " is deprecated; use " + a.new_name), std::string::npos) << notice;
      // An empty value through the old spelling is refused too, naming the old spelling.
      if (std::string(a.new_name) == "--block-size" || std::string(a.new_name) == "--kv-sink-tokens") {
        ::testing::internal::CaptureStderr();
        const Outcome empty = run(cmd, {{a.old_name, ""}});
        ::testing::internal::GetCapturedStderr();
        EXPECT_FALSE(empty.parsed) << a.old_name;
        EXPECT_EQ(empty.error.rfind(std::string(a.old_name) + ": needs", 0), 0u) << empty.error;
      }
    }
  }
  EXPECT_EQ(aliases, 7);  // generate --kv-block-size; bench --formats x2, --granularity, --granularities, --sink; report --sink
}

TEST(CacheOptions, ListsWhereACommandComparesSeveral) {
  const std::vector<Arg> list = {{"--kv-cache-dtype", "bf16,fp8,int8"},
                                 {"--kv-scale-granularity", "per_token_head,per_block_head"}};
  const Outcome eval = run(CacheCommand::kEval, list);
  const Outcome write = run(CacheCommand::kBenchWrite, list);
  ASSERT_EQ(eval.error, "");
  ASSERT_EQ(write.error, "");
  ASSERT_EQ(eval.specs.size(), 5u);  // bf16 once, fp8 and int8 with each granularity
  ASSERT_EQ(write.specs.size(), eval.specs.size());
  for (const QuantSpec& s : eval.specs) {
    const bool found = std::any_of(write.specs.begin(), write.specs.end(), [&](const QuantSpec& w) {
      return w.format == s.format && (!s.quantized() || w.granularity == s.granularity) && w.block_size == s.block_size;
    });
    EXPECT_TRUE(found) << s.to_string();
  }
  // Commands that take one value say so, naming the flag.
  const Outcome gen = run(CacheCommand::kGenerate, {{"--kv-cache-dtype", "fp8,int8"}});
  EXPECT_NE(gen.error.find("--kv-cache-dtype takes one"), std::string::npos) << gen.error;
  const Outcome gen2 = run(CacheCommand::kGenerate, {{"--kv-cache-dtype", "fp8"}, {"--kv-scale-granularity", "per_tensor,per_token_head"}});
  EXPECT_NE(gen2.error.find("--kv-scale-granularity takes one"), std::string::npos) << gen2.error;
  const Outcome dec = run(CacheCommand::kBenchDecode, list);
  EXPECT_NE(dec.error.find("--kv-scale-granularity takes one"), std::string::npos) << dec.error;
}

TEST(CacheOptions, AutoAndPerEntryOptions) {
  // generate: auto is this machine's format, with the flags' settings.
  const Outcome gen = run(CacheCommand::kGenerate, {{"--kv-scale-granularity", "per_block_head"}, {"--kv-sink-tokens", "4"}});
  ASSERT_EQ(gen.error, "");
  EXPECT_EQ(gen.specs[0].format, Format::kInt8);
  EXPECT_TRUE(gen.specs[0].from_auto);
  EXPECT_EQ(gen.specs[0].granularity, ScaleGranularity::kPerBlockHead);
  EXPECT_EQ(gen.specs[0].sink_tokens, 4);
  // Per-entry options mean the same in generate and eval.
  const std::vector<Arg> entry = {{"--kv-cache-dtype", "int8:per_tensor:sink0:b32"}};
  const Outcome g = run(CacheCommand::kGenerate, entry), e = run(CacheCommand::kEval, entry);
  ASSERT_EQ(g.error, "");
  ASSERT_EQ(e.error, "");
  ASSERT_EQ(e.specs.size(), 1u);
  EXPECT_EQ(g.specs[0].to_string(), e.specs[0].to_string());
  EXPECT_EQ(g.specs[0].to_string(), "int8/per_tensor/b32/sink0");
  // The benchmarks time named dtypes on one grid.
  for (CacheCommand cmd : {CacheCommand::kBenchDecode, CacheCommand::kBenchWrite}) {
    EXPECT_NE(run(cmd, {{"--kv-cache-dtype", "auto"}}).error.find("--kv-cache-dtype auto"), std::string::npos);
    EXPECT_NE(run(cmd, entry).error.find("per-entry"), std::string::npos) << name_of(cmd);
    EXPECT_NE(run(cmd, {{"--kv-cache-dtype", "fp8:per_tensor,int8"}}).error.find("per-entry"), std::string::npos);
  }
}

TEST(CliSupport, SamplingChecksNameTheFlag) {
  EXPECT_TRUE(check_sampling(0.f, 1.f, 1).is_ok());
  EXPECT_TRUE(check_sampling(0.7f, 0.9f, 128).is_ok());
  const struct {
    float t, p;
    int n;
    const char* flag;
  } bad[] = {{-1.f, 1.f, 1, "--temperature"}, {NAN, 1.f, 1, "--temperature"}, {INFINITY, 1.f, 1, "--temperature"},
             {0.f, 0.f, 1, "--top-p"},       {0.f, 1.5f, 1, "--top-p"},     {0.f, NAN, 1, "--top-p"},
             {0.f, 1.f, 0, "--max-new-tokens"}, {0.f, 1.f, -5, "--max-new-tokens"}};
  for (const auto& b : bad) {
    Status s = check_sampling(b.t, b.p, b.n);
    EXPECT_FALSE(s.is_ok()) << b.flag;
    EXPECT_EQ(s.message().rfind(b.flag, 0), 0u) << s.message();
  }
}

TEST(CliSupport, MistypedCommandsAreNamed) {
  CLI::App app{"test", "kvq"};
  app.require_subcommand(1);
  CLI::App* bench = app.add_subcommand("bench", "b");
  bench->require_subcommand(1);
  bench->add_subcommand("decode", "d");
  app.add_subcommand("eval", "e");
  EXPECT_EQ(check_command_words(app, {"eval", "--model", "x"}), "");
  EXPECT_EQ(check_command_words(app, {"--version"}), "");
  EXPECT_EQ(check_command_words(app, {"bench", "decode", "--json", "x"}), "");
  const std::string evl = check_command_words(app, {"evl", "--model", "x"});
  EXPECT_NE(evl.find("unknown command 'evl'"), std::string::npos) << evl;
  EXPECT_NE(evl.find("bench, eval"), std::string::npos) << evl;
  const std::string decod = check_command_words(app, {"bench", "decod"});
  EXPECT_EQ(decod.rfind("kvq bench: unknown command 'decod'; commands: decode", 0), 0u) << decod;
  EXPECT_NE(check_command_words(app, {}).find("no command given"), std::string::npos);
  EXPECT_NE(check_command_words(app, {"bench"}).find("no command given; commands: decode"), std::string::npos);
}

TEST(CliSupport, VersionNamesCommitBuildAndCuda) {
  const std::string v = version_text();
  EXPECT_EQ(v.rfind("kvq " KVQ_VERSION " (commit ", 0), 0u) << v;
  EXPECT_NE(v.find(" build, CUDA "), std::string::npos) << v;
}

TEST(CliSupport, EveryNumericOptionRefusesAnEmptyValue) {
  CLI::App app{"test", "kvq"};
  int ctx = 7;
  float temp = 0.5f;
  uint64_t seed = 3;
  std::string text;
  app.add_option("--ctx", ctx);
  app.add_option("--temperature", temp);
  app.add_option("--seed", seed);
  app.add_option("--text", text);
  refuse_empty_numbers(app);
  refuse_empty_numbers(app);  // idempotent
  for (const char* flag : {"--ctx", "--temperature", "--seed"}) {
    const char* argv[] = {"kvq", flag, ""};
    try {
      app.parse(3, argv);
      ADD_FAILURE() << flag << " accepted an empty value";
    } catch (const CLI::ParseError& e) {
      EXPECT_EQ(parse_error_line(app, e).rfind(std::string("kvq: ") + flag + ": needs", 0), 0u) << e.what();
    }
  }
  const char* argv[] = {"kvq", "--text", ""};
  EXPECT_NO_THROW(app.parse(3, argv));  // an empty text is a value
  EXPECT_EQ(ctx, 7);
  for (const auto& [flag, value] : std::vector<std::pair<const char*, const char*>>{
           {"--seed", "-5"}, {"--ctx", "12abc"}, {"--ctx", " 3"}, {"--temperature", "0.5x"}}) {
    const char* bad[] = {"kvq", flag, value};
    try {
      app.parse(3, bad);
      ADD_FAILURE() << flag << " accepted '" << value << "'";
    } catch (const CLI::ParseError& e) {
      EXPECT_EQ(parse_error_line(app, e).rfind(std::string("kvq: ") + flag + ": needs", 0), 0u) << e.what();
    }
  }
  const char* big[] = {"kvq", "--seed", "18446744073709551615", "--ctx", "-3", "--temperature", "1e-3"};
  ASSERT_NO_THROW(app.parse(7, big));
  EXPECT_EQ(seed, 18446744073709551615ull);
  EXPECT_EQ(ctx, -3);  // the range is the command's to check
  EXPECT_FLOAT_EQ(temp, 1e-3f);
}
// --numerics: on the commands that run the model, validated, stored, and reaching the backend
// open_model_run creates; absent from the benchmarks (they time the fast kernels) and report.
TEST(CacheOptions, NumericsIsValidatedAndReachesTheBackend) {
  for (CacheCommand cmd : kAllCacheCommands) {
    if (!cache_flag_set(cmd).numerics) {
      EXPECT_FALSE(run(cmd, {{"--numerics", "reproducible"}}).parsed) << name_of(cmd);
      continue;
    }
    EXPECT_EQ(run(cmd, {}).opts.numerics, "fast") << name_of(cmd);
    EXPECT_EQ(run(cmd, {{"--numerics", "reproducible"}}).opts.numerics, "reproducible") << name_of(cmd);
    const Outcome bad = run(cmd, {{"--numerics", "exact"}});
    EXPECT_FALSE(bad.parsed) << name_of(cmd);
    EXPECT_NE(bad.error.find("--numerics"), std::string::npos) << bad.error;
  }
  for (CacheCommand cmd : {CacheCommand::kEval, CacheCommand::kGenerate, CacheCommand::kServe})
    EXPECT_TRUE(cache_flag_set(cmd).numerics) << name_of(cmd);
  KVQ_REQUIRE_STORIES260K();  // open_model_run looks the model up before it reads --numerics
  ModelRunFlags f;
  f.backend = "cpu";
  f.numerics = "exact";
  f.model = kvq::model::stories260k_dir() + "/stories260K.bin";
  auto bad = open_model_run(f, nullptr);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().message().rfind("--numerics: ", 0), 0u) << bad.status().to_string();
  f.numerics = "reproducible";
  auto ok = open_model_run(f, nullptr);
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok.value().backend->numerics(), backend::Numerics::kReproducible);
}

// open_model_run, the sequence eval, generate and serve share: --backend first, then the
// command's own flag checks (given the backend kind), and only then the model is looked up, the
// backend created and the model loaded; each refusal names its flag.
TEST(CacheOptions, OpenModelRunChecksFlagsBeforeLoading) {
  using backend::BackendKind;
  ModelRunFlags f;
  f.backend = "cpu";
  f.model = "/nonexistent/kvq/model.bin";
  int calls = 0;
  BackendKind seen = BackendKind::kCuda;
  auto refused = open_model_run(f, [&](BackendKind k) {
    ++calls, seen = k;
    return invalid_argument("--json: cannot write");
  });
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, BackendKind::kCpu);
  EXPECT_EQ(refused.status().message(), "--json: cannot write");

  auto missing = open_model_run(f, nullptr);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().message().rfind("--model: ", 0), 0u) << missing.status().to_string();
  EXPECT_NE(missing.status().message().find(f.model), std::string::npos);

  f.backend = "tpu";
  calls = 0;
  auto bad_backend = open_model_run(f, [&](BackendKind) { return ++calls, Status::ok(); });
  ASSERT_FALSE(bad_backend.is_ok());
  EXPECT_EQ(calls, 0);
  EXPECT_NE(bad_backend.status().message().find("tpu"), std::string::npos) << bad_backend.status().to_string();

  KVQ_REQUIRE_STORIES260K();
  f.backend = "cpu";
  f.model = kvq::model::stories260k_dir() + "/stories260K.bin";
  auto ok = open_model_run(f, [](BackendKind) { return Status::ok(); });
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok.value().kind, BackendKind::kCpu);
  ASSERT_TRUE(ok.value().backend && ok.value().model);
  EXPECT_EQ(ok.value().model_path, f.model);
  EXPECT_EQ(ok.value().model->config().vocab_size, 512);
  // `auto` in the cache flags follows the backend the model runs on.
  CacheCliOptions c;
  c.kv_cache_dtype = "auto";
  auto spec = to_quant_spec(c, ok.value().kind);
  ASSERT_TRUE(spec.is_ok());
  EXPECT_EQ(spec.value().format, backend::auto_cache_format(BackendKind::kCpu));
}

}  // namespace
}  // namespace kvq::tools
