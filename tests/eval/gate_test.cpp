// The gate, auto's fallback walk and the spec list, on synthetic results.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kvq/eval/gate.h"
#include "kvq/eval/specs.h"

namespace kvq::eval {
namespace {

QuantSpec make(Format f, ScaleGranularity g = ScaleGranularity::kPerTokenHead) {
  QuantSpec s;
  s.format = f;
  s.granularity = g;
  return s;
}

SpecResult result(const QuantSpec& s, double dppl) {
  SpecResult r;
  r.spec = s;
  r.evaluated = true;
  r.delta_ppl_pct = dppl;
  return r;
}

TEST(Gate, ParsePercentages) {
  EXPECT_DOUBLE_EQ(parse_gate_pct("3%").value(), 3.0);
  EXPECT_DOUBLE_EQ(parse_gate_pct("0.5").value(), 0.5);
  EXPECT_DOUBLE_EQ(parse_gate_pct("0%").value(), 0.0);
  for (const char* bad : {"", "%", "-1%", "abc", "3%%", "1e999", "nan"})
    EXPECT_EQ(parse_gate_pct(bad).status().code(), StatusCode::kInvalidArgument) << bad;
}

TEST(Gate, VerdictIsInclusiveAndNanFails) {
  EXPECT_TRUE(gate_verdict(3.0, 3.0).pass);
  EXPECT_FALSE(gate_verdict(3.0001, 3.0).pass);
  EXPECT_TRUE(gate_verdict(-2.0, 0.0).pass);
  GateVerdict v = gate_verdict(std::nan(""), 3.0);
  EXPECT_FALSE(v.pass);
  EXPECT_NE(v.note.find("NaN"), std::string::npos);
  EXPECT_NE(gate_verdict(4.126, 3.0).note.find("+4.13%"), std::string::npos);
}

TEST(Gate, ApplyMarksRows) {
  std::vector<SpecResult> rows = {result(make(Format::kBf16), 0.0), result(make(Format::kFp8E4m3), 0.8),
                                  result(make(Format::kInt8), 5.0), result(make(Format::kFp8E4m3Fnuz), 0.1)};
  rows[0].is_baseline = true;
  rows[3].error = "unsupported granularity";
  apply_gate(rows, 1.0);
  EXPECT_TRUE(rows[0].gate_pass);
  EXPECT_TRUE(rows[1].gate_pass);
  EXPECT_FALSE(rows[2].gate_pass);
  EXPECT_FALSE(rows[3].gate_pass);
  EXPECT_NE(rows[3].gate_note.find("unsupported granularity"), std::string::npos);
}

TEST(Gate, SameCache) {
  QuantSpec a = make(Format::kBf16), b = make(Format::kBf16, ScaleGranularity::kPerTensor);
  b.sink_tokens = 0;
  EXPECT_TRUE(same_cache(a, b));  // bf16 ignores scales and sink
  QuantSpec c = make(Format::kInt8), d = make(Format::kInt8);
  EXPECT_TRUE(same_cache(c, d));
  d.sink_tokens = 0;
  EXPECT_FALSE(same_cache(c, d));
  EXPECT_FALSE(same_cache(c, make(Format::kInt8, ScaleGranularity::kPerBlockHead)));
  EXPECT_FALSE(same_cache(c, make(Format::kFp8E4m3)));
}

TEST(Gate, FallbackChains) {
  QuantSpec settings = make(Format::kBf16, ScaleGranularity::kPerBlockHead);
  settings.sink_tokens = 32;
  auto chain = auto_fallback_chain(settings);
  ASSERT_EQ(chain.size(), 3u);
  EXPECT_EQ(chain[0].format, Format::kFp8E4m3);
  EXPECT_EQ(chain[1].format, Format::kInt8);
  EXPECT_EQ(chain[2].format, Format::kBf16);
  for (const auto& s : chain) {
    EXPECT_TRUE(s.from_auto);
    EXPECT_EQ(s.granularity, ScaleGranularity::kPerBlockHead);
    EXPECT_EQ(s.sink_tokens, 32);
  }
  EXPECT_EQ(auto_fallback_chain(settings, Format::kFp8E4m3Fnuz)[0].format, Format::kFp8E4m3Fnuz);
  EXPECT_EQ(auto_fallback_chain(settings, Format::kInt8).size(), 2u);
}

struct Fixture {
  std::vector<QuantSpec> chain = auto_fallback_chain(make(Format::kBf16));
  SpecResult baseline;
  std::vector<SpecResult> evaluated;
  Fixture() {
    baseline = result(make(Format::kBf16), 0.0);
    baseline.is_baseline = true;
  }
  std::function<const SpecResult*(const QuantSpec&)> find() {
    return [this](const QuantSpec& s) -> const SpecResult* {
      if (s.format == Format::kBf16) return &baseline;
      for (const auto& r : evaluated)
        if (same_cache(r.spec, s)) return &r;
      return nullptr;
    };
  }
};

TEST(Gate, AutoKeepsFp8WhenItPasses) {
  Fixture f;
  AutoStep s = auto_step(f.chain, f.find(), 3.0);
  EXPECT_FALSE(s.decided);  // nothing evaluated yet: fp8 must be run
  EXPECT_EQ(s.index, 0u);
  f.evaluated.push_back(result(f.chain[0], 1.2));
  s = auto_step(f.chain, f.find(), 3.0);
  EXPECT_TRUE(s.decided);
  EXPECT_EQ(s.index, 0u);
  ASSERT_EQ(s.notes.size(), 1u);
  EXPECT_NE(s.notes[0].find("chose fp8_e4m3"), std::string::npos) << s.notes[0];
}

TEST(Gate, AutoFallsBackToInt8ThenBf16WithReasons) {
  Fixture f;
  f.evaluated.push_back(result(f.chain[0], 4.5));
  AutoStep s = auto_step(f.chain, f.find(), 3.0);
  EXPECT_FALSE(s.decided);
  EXPECT_EQ(s.index, 1u);  // int8 must be evaluated next
  ASSERT_EQ(s.notes.size(), 1u);
  EXPECT_NE(s.notes[0].find("+4.50% > gate 3.00%"), std::string::npos) << s.notes[0];
  EXPECT_NE(s.notes[0].find("falling back to int8"), std::string::npos) << s.notes[0];

  f.evaluated.push_back(result(f.chain[1], 2.0));
  s = auto_step(f.chain, f.find(), 3.0);
  EXPECT_TRUE(s.decided);
  EXPECT_EQ(s.index, 1u);

  f.evaluated[1].delta_ppl_pct = 3.5;
  s = auto_step(f.chain, f.find(), 3.0);
  EXPECT_TRUE(s.decided);
  EXPECT_EQ(s.index, 2u);  // bf16: the baseline always passes
  ASSERT_EQ(s.notes.size(), 3u);
  EXPECT_NE(s.notes[1].find("falling back to bf16"), std::string::npos) << s.notes[1];
  EXPECT_NE(s.notes[2].find("chose bf16"), std::string::npos) << s.notes[2];
}

TEST(Gate, AutoTreatsErrorsAndNanAsFailures) {
  Fixture f;
  f.evaluated.push_back(result(f.chain[0], 0.0));
  f.evaluated[0].error = "no such kernel";
  f.evaluated.push_back(result(f.chain[1], std::nan("")));
  AutoStep s = auto_step(f.chain, f.find(), 3.0);
  EXPECT_TRUE(s.decided);
  EXPECT_EQ(s.index, 2u);
  EXPECT_NE(s.notes[0].find("no such kernel"), std::string::npos);
}

TEST(Specs, ListWithInlineGranularity) {
  SpecListOptions o;
  o.kv_cache_dtypes = "bf16,fp8,fp8_fnuz,int8,fp8:per_tensor";
  auto r = parse_spec_list(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const auto& v = r.value();
  ASSERT_EQ(v.size(), 5u);
  EXPECT_EQ(v[0].spec.format, Format::kBf16);
  EXPECT_EQ(v[1].spec.format, Format::kFp8E4m3);
  EXPECT_EQ(v[1].spec.granularity, ScaleGranularity::kPerTokenHead);
  EXPECT_EQ(v[2].spec.format, Format::kFp8E4m3Fnuz);
  EXPECT_EQ(v[3].spec.format, Format::kInt8);
  EXPECT_EQ(v[4].spec.format, Format::kFp8E4m3);
  EXPECT_EQ(v[4].spec.granularity, ScaleGranularity::kPerTensor);
  EXPECT_EQ(v[4].label, "fp8:per_tensor");
  for (const auto& s : v) EXPECT_EQ(s.spec.sink_tokens, 256);
}

TEST(Specs, GranularitiesExpandQuantizedEntriesOnly) {
  SpecListOptions o;
  o.kv_cache_dtypes = "bf16, int8 ,auto";
  o.granularities = "per_token_head,per_block_head";
  o.sink_tokens = 64;
  auto r = parse_spec_list(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const auto& v = r.value();
  ASSERT_EQ(v.size(), 5u);  // bf16, int8 x2, auto x2
  EXPECT_EQ(v[1].label, "int8:per_token_head");
  EXPECT_EQ(v[2].spec.granularity, ScaleGranularity::kPerBlockHead);
  EXPECT_TRUE(v[3].is_auto);
  ASSERT_EQ(v[4].auto_chain.size(), 3u);
  EXPECT_EQ(v[4].auto_chain[0].granularity, ScaleGranularity::kPerBlockHead);
  EXPECT_EQ(v[4].auto_chain[0].sink_tokens, 64);
}

TEST(Specs, InlineSinkBlockAndDuplicates) {
  SpecListOptions o;
  o.kv_cache_dtypes = "int8:sink0:b32,fp8,fp8_e4m3,int8:per_token_head:b32:sink0";
  auto r = parse_spec_list(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r.value().size(), 2u);
  EXPECT_EQ(r.value()[0].spec.sink_tokens, 0);
  EXPECT_EQ(r.value()[0].spec.block_size, 32);
}

TEST(Specs, BenchmarksKeepBf16AtEveryBlockSize) {
  SpecListOptions o;
  o.kv_cache_dtypes = "bf16,bf16:b32,fp8,fp8:b32,bf16";
  auto r = parse_spec_list(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r.value().size(), 3u);  // accuracy: one bf16 cache whatever its block size
  o.distinct_block_sizes = true;
  r = parse_spec_list(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r.value().size(), 4u);  // speed: bf16 and bf16:b32 are different kernels' inputs
  EXPECT_EQ(r.value()[1].label, "bf16:b32");
  EXPECT_EQ(r.value()[1].spec.block_size, 32);
  EXPECT_EQ(r.value()[3].spec.block_size, 32);
}

TEST(Specs, RotationGlobalAndPerEntry) {
  SpecListOptions o;
  o.kv_cache_dtypes = "int8,int8:hadamard,fp8:none";
  auto r = parse_spec_list(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r.value().size(), 3u);  // a rotated cache is not a duplicate of the plain one
  EXPECT_EQ(r.value()[0].spec.rotation, KvRotation::kNone);
  EXPECT_EQ(r.value()[1].spec.rotation, KvRotation::kHadamard);
  o.rotate = "hadamard";
  r = parse_spec_list(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r.value().size(), 2u);  // int8 and int8:hadamard are now the same cache
  EXPECT_EQ(r.value()[0].spec.rotation, KvRotation::kHadamard);
  EXPECT_EQ(r.value()[1].spec.rotation, KvRotation::kNone);  // fp8:none overrides --kv-rotate
  o.rotate = "givens";
  r = parse_spec_list(o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("--kv-rotate"), std::string::npos) << r.status().message();
}

TEST(Specs, ScaleDtypeGlobalAndPerEntry) {
  SpecListOptions o;
  o.kv_cache_dtypes = "int8,int8:fp16_scales,fp8:fp16_scales,int8:fp32_scales";
  auto r = parse_spec_list(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r.value().size(), 3u);  // fp16 scales make another cache; int8:fp32_scales is int8
  EXPECT_EQ(r.value()[0].spec.scale_dtype, ScaleDtype::kFp32);
  EXPECT_EQ(r.value()[1].spec.scale_dtype, ScaleDtype::kFp16);
  EXPECT_EQ(r.value()[2].spec.scale_dtype, ScaleDtype::kFp16);
  o.scale_dtype = "fp16";
  o.kv_cache_dtypes = "int8,fp8:fp32_scales";
  r = parse_spec_list(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r.value()[0].spec.scale_dtype, ScaleDtype::kFp16);
  EXPECT_EQ(r.value()[1].spec.scale_dtype, ScaleDtype::kFp32);
}

TEST(Specs, ErrorsNameTheEntry) {
  SpecListOptions o;
  for (const char* bad : {"fp9", "fp8:foo", "int8:b17", "", " , "}) {
    o.kv_cache_dtypes = bad;
    auto r = parse_spec_list(o);
    EXPECT_FALSE(r.is_ok()) << bad;
    if (std::string(bad).size() > 3) {
      EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status().message();
    }
  }
  o.kv_cache_dtypes = "int8";
  o.granularities = "per_galaxy";
  EXPECT_FALSE(parse_spec_list(o).is_ok());
}

TEST(Specs, SplitCsv) {
  EXPECT_EQ(split_csv(" a, b,,c "), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(split_csv("").empty());
}

}  // namespace
}  // namespace kvq::eval
