#include "kvq/quant/spec.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace kvq {
namespace {

TEST(ParseKvCacheDtype, AcceptsEveryDocumentedSpelling) {
  const std::vector<std::pair<std::string, Format>> cases = {
      {"bf16", Format::kBf16},         {"bfloat16", Format::kBf16},          {"fp16", Format::kFp16},
      {"float16", Format::kFp16},      {"fp8", Format::kFp8E4m3},            {"fp8_e4m3", Format::kFp8E4m3},
      {"fp8_fnuz", Format::kFp8E4m3Fnuz}, {"fp8_e4m3_fnuz", Format::kFp8E4m3Fnuz}, {"int8", Format::kInt8},
  };
  for (const auto& [text, want] : cases) {
    Result<Format> r = parse_kv_cache_dtype(text);
    ASSERT_TRUE(r.is_ok()) << text << ": " << r.status().to_string();
    EXPECT_EQ(r.value(), want) << text;
  }
}

TEST(ParseKvCacheDtype, RejectsUnknownNamingTheAcceptedValues) {
  for (const char* bad : {"", "FP8", "fp8e4m3", "int16", "fp32", "e4m3", " fp8", "fp8 ", "bf 16"}) {
    Result<Format> r = parse_kv_cache_dtype(bad);
    ASSERT_FALSE(r.is_ok()) << "'" << bad << "'";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("fp8_fnuz"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("int8"), std::string::npos) << r.status().message();
  }
}

TEST(ParseKvCacheDtype, Int4KiviIsAcceptedE5m2IsUnsupportedNotUnknown) {
  Result<Format> int4 = parse_kv_cache_dtype("int4");
  ASSERT_TRUE(int4.is_ok());
  EXPECT_EQ(int4.value(), Format::kInt4);
  Result<Format> r = parse_kv_cache_dtype("int4_kivi");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r.value(), Format::kInt4Kivi);
  Result<Format> e5 = parse_kv_cache_dtype("fp8_e5m2");
  ASSERT_FALSE(e5.is_ok());
  EXPECT_EQ(e5.status().code(), StatusCode::kUnsupported);
}

// int4_kivi brings its own window (KIVI's residual, 128 by default), fp16 parameters and grouping.
TEST(ParseQuantSpec, Int4KiviRules) {
  QuantOptions o;
  o.kv_cache_dtype = "int4_kivi";
  Result<QuantSpec> d = parse_quant_spec(o);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d.value().recent_tokens, kKiviDefaultRecentTokens);
  EXPECT_EQ(d.value().scale_dtype, ScaleDtype::kFp16);
  EXPECT_EQ(d.value().to_string(), "int4_kivi/b16/sink256/recent128");
  o.block_size = 32;
  o.recent_tokens = 32;
  Result<QuantSpec> edge = parse_quant_spec(o);
  ASSERT_TRUE(edge.is_ok()) << edge.status().to_string();
  EXPECT_EQ(edge.value().recent_tokens, 32);
  o.recent_tokens = 31;
  Result<QuantSpec> small = parse_quant_spec(o);
  ASSERT_FALSE(small.is_ok());
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("--kv-recent-tokens 31"), std::string::npos) << small.status().message();
  EXPECT_NE(small.status().message().find("--block-size 32"), std::string::npos) << small.status().message();
  o.recent_tokens = 0;
  o.granularity = "per_block_head";
  Result<QuantSpec> g = parse_quant_spec(o);
  ASSERT_FALSE(g.is_ok());
  EXPECT_NE(g.status().message().find("--kv-scale-granularity"), std::string::npos) << g.status().message();
  QuantSpec mix;
  mix.plane_formats = {Format::kInt8, Format::kInt4Kivi};
  EXPECT_EQ(check_plane_formats(mix, 1).code(), StatusCode::kUnsupported);
}

TEST(ParseKvCacheDtype, AutoNeedsTheSpecParser) {
  Result<Format> r = parse_kv_cache_dtype("auto");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(ParseGranularity, RoundTripsNames) {
  for (ScaleGranularity g :
       {ScaleGranularity::kPerTensor, ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead}) {
    Result<ScaleGranularity> r = parse_granularity(granularity_name(g));
    ASSERT_TRUE(r.is_ok());
    EXPECT_EQ(r.value(), g);
  }
  EXPECT_STREQ(granularity_name(ScaleGranularity::kPerBlockHead), "per_block_head");
}

TEST(ParseGranularity, RejectsUnknown) {
  for (const char* bad : {"", "per_token", "per_head", "per_block", "tensor", "PER_TENSOR", "kivi"}) {
    Result<ScaleGranularity> r = parse_granularity(bad);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("per_token_head"), std::string::npos);
    EXPECT_NE(r.status().message().find("per_block_head"), std::string::npos);
  }
}

TEST(ParseQuantSpec, DefaultsAreAutoInt8PerTokenHead) {
  Result<QuantSpec> r = parse_quant_spec(QuantOptions{});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->format, Format::kInt8);
  EXPECT_TRUE(r->from_auto);
  EXPECT_EQ(r->granularity, ScaleGranularity::kPerTokenHead);
  EXPECT_EQ(r->scale_dtype, ScaleDtype::kFp32);
  EXPECT_EQ(r->block_size, 16);
  EXPECT_EQ(r->sink_tokens, 256);
  EXPECT_EQ(r->to_string(), "int8/per_token_head/b16/sink256");
}

TEST(ParseQuantSpec, AutoResolvesToTheMachineFormat) {
  QuantOptions o;
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8, Format::kBf16, Format::kInt4}) {
    Result<QuantSpec> r = parse_quant_spec(o, f);
    ASSERT_TRUE(r.is_ok());
    EXPECT_EQ(r->format, f);
    EXPECT_TRUE(r->from_auto);
  }
}

TEST(ParseQuantSpec, Fp16ScaleDtype) {
  for (const char* name : {"fp16", "float16"}) {
    QuantOptions o;
    o.kv_cache_dtype = "int8";
    o.scale_dtype = name;
    Result<QuantSpec> r = parse_quant_spec(o);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(r->scale_dtype, ScaleDtype::kFp16);
    EXPECT_EQ(r->to_string(), "int8/per_token_head/fp16_scales/b16/sink256");
  }
}

TEST(ParseQuantSpec, ExplicitValues) {
  QuantOptions o;
  o.kv_cache_dtype = "fp8";
  o.granularity = "per_block_head";
  o.block_size = 32;
  o.sink_tokens = 0;
  Result<QuantSpec> r = parse_quant_spec(o, Format::kInt8);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->format, Format::kFp8E4m3);
  EXPECT_FALSE(r->from_auto);
  EXPECT_EQ(r->to_string(), "fp8_e4m3/per_block_head/b32/sink0");

  o.kv_cache_dtype = "fp8_fnuz";
  o.granularity = "per_tensor";
  o.sink_tokens = 4;
  r = parse_quant_spec(o);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->format, Format::kFp8E4m3Fnuz);
  EXPECT_EQ(r->to_string(), "fp8_e4m3_fnuz/per_tensor/b32/sink4");

  o.kv_cache_dtype = "bf16";
  r = parse_quant_spec(o);
  ASSERT_TRUE(r.is_ok());
  EXPECT_FALSE(r->quantized());
  EXPECT_EQ(r->to_string(), "bf16/b32/sink4");  // granularity is meaningless without scales
}

TEST(ParseQuantSpec, BadValuesFailWithTheirOptionName) {
  struct Case {
    QuantOptions o;
    StatusCode code;
    std::string mentions;
  };
  std::vector<Case> cases;
  auto with = [](auto edit) {
    QuantOptions o;
    edit(o);
    return o;
  };
  cases.push_back({with([](QuantOptions& o) { o.kv_cache_dtype = "fp9"; }), StatusCode::kInvalidArgument, "--kv-cache-dtype"});
  cases.push_back({with([](QuantOptions& o) { o.kv_cache_dtype = "int4_kivi", o.recent_tokens = 8; }),
                   StatusCode::kInvalidArgument, "--kv-recent-tokens"});
  cases.push_back({with([](QuantOptions& o) { o.granularity = "per_channel"; }), StatusCode::kInvalidArgument, "--kv-scale-granularity"});
  cases.push_back({with([](QuantOptions& o) { o.scale_dtype = "bf16"; }), StatusCode::kInvalidArgument, "fp32"});
  cases.push_back({with([](QuantOptions& o) { o.scale_dtype = ""; }), StatusCode::kInvalidArgument, "fp32"});
  for (int bs : {0, 1, 8, 15, 17, 24, 64, -16}) {
    cases.push_back({with([bs](QuantOptions& o) { o.block_size = bs; }), StatusCode::kInvalidArgument, "16, 32"});
  }
  for (int sink : {-1, -256, kMaxSinkTokens + 1}) {
    cases.push_back({with([sink](QuantOptions& o) { o.sink_tokens = sink; }), StatusCode::kInvalidArgument, "--kv-sink-tokens"});
  }
  for (const Case& c : cases) {
    Result<QuantSpec> r = parse_quant_spec(c.o);
    ASSERT_FALSE(r.is_ok()) << c.mentions;
    EXPECT_EQ(r.status().code(), c.code) << r.status().to_string();
    EXPECT_NE(r.status().message().find(c.mentions), std::string::npos) << r.status().message();
  }
}

TEST(ParseQuantSpec, Rotation) {
  QuantOptions o;
  o.kv_cache_dtype = "int8";
  auto plain = parse_quant_spec(o);
  ASSERT_TRUE(plain.is_ok());
  EXPECT_EQ(plain.value().rotation, KvRotation::kNone);
  EXPECT_EQ(plain.value().to_string(), "int8/per_token_head/b16/sink256");
  o.rotate = "hadamard";
  auto rot = parse_quant_spec(o);
  ASSERT_TRUE(rot.is_ok());
  EXPECT_EQ(rot.value().rotation, KvRotation::kHadamard);
  EXPECT_EQ(rot.value().to_string(), "int8/per_token_head/b16/sink256/hadamard");
  o.rotate = "Hadamard";
  auto bad = parse_quant_spec(o);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("none, hadamard"), std::string::npos) << bad.status().message();
}

TEST(ParseQuantSpec, RecentWindow) {
  QuantOptions o;
  o.kv_cache_dtype = "fp8";
  o.recent_tokens = 128;
  auto s = parse_quant_spec(o);
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(s.value().recent_tokens, 128);
  EXPECT_EQ(s.value().to_string(), "fp8_e4m3/per_token_head/b16/sink256/recent128");
  o.kv_cache_dtype = "bf16";  // kept, but a no-op for unquantized pages, so not printed
  EXPECT_EQ(parse_quant_spec(o).value().to_string(), "bf16/b16/sink256");
  for (int bad : {-1, kMaxSinkTokens + 1}) {
    o.recent_tokens = bad;
    auto r = parse_quant_spec(o);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("--kv-recent-tokens"), std::string::npos) << r.status().message();
  }
}

TEST(ParseQuantSpec, SinkBounds) {
  QuantOptions o;
  o.sink_tokens = kMaxSinkTokens;
  EXPECT_TRUE(parse_quant_spec(o).is_ok());
  o.sink_tokens = 0;
  EXPECT_TRUE(parse_quant_spec(o).is_ok());
}

}  // namespace
}  // namespace kvq
