// The --kv-config file: round trip, every refusal names what is wrong, and the spec checks.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "kvq/cache/layout.h"
#include "kvq/quant/layer_config.h"

namespace kvq {
namespace {

TEST(KvConfig, RoundTripsRandomMixes) {
  const Format kAll[] = {Format::kBf16, Format::kFp16, Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8};
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    KvConfig c;
    c.model = trial % 2 ? "SmolLM2 \"135M\"" : "";
    const int layers = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < 2 * layers; ++i) c.plane_formats.push_back(kAll[rng() % 5]);
    const std::string text = kv_config_json(c, trial % 3 ? R"({"search": {"budget_kl": 0.002}})" : "");
    auto back = parse_kv_config(text, "f.json");
    ASSERT_TRUE(back.is_ok()) << back.status().to_string() << "\n" << text;
    EXPECT_EQ(back.value().model, c.model);
    EXPECT_EQ(back.value().plane_formats, c.plane_formats);
  }
}

TEST(KvConfig, RefusalsNameTheProblem) {
  auto msg = [](const std::string& text) {
    auto r = parse_kv_config(text, "cfg.json");
    EXPECT_FALSE(r.is_ok()) << text;
    return r.is_ok() ? std::string() : r.status().message();
  };
  EXPECT_NE(msg("{\"layers\": [").find("not valid JSON"), std::string::npos);
  EXPECT_NE(msg("[1, 2]").find("\"layers\""), std::string::npos);
  EXPECT_NE(msg("{\"layers\": []}").find("non-empty"), std::string::npos);
  EXPECT_NE(msg(R"({"layers": [{"k": "int8"}]})").find("layers[0] has no \"v\""), std::string::npos);
  const std::string bad = msg(R"({"layers": [{"k": "int8", "v": "int8"}, {"k": "int9", "v": "int8"}]})");
  EXPECT_NE(bad.find("layers[1].k"), std::string::npos) << bad;
  EXPECT_NE(bad.find("int8"), std::string::npos) << bad;  // the accepted names are listed
  EXPECT_NE(msg(R"({"layers": [{"k": "auto", "v": "int8"}]})").find("auto"), std::string::npos);
  EXPECT_NE(msg(R"({"layers": ["int8"]})").find("must be an object"), std::string::npos);
  auto missing = read_kv_config("/nonexistent/kvq.json");
  EXPECT_FALSE(missing.is_ok());
}

TEST(KvConfig, SpecChecksTheLayerCount) {
  QuantSpec s;
  s.plane_formats = {Format::kInt8, Format::kFp8E4m3, Format::kBf16, Format::kInt8};
  EXPECT_TRUE(check_plane_formats(s, 2).is_ok());
  const Status st = check_plane_formats(s, 30);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("2 layers but the model has 30"), std::string::npos) << st.message();
  EXPECT_TRUE(check_plane_formats(QuantSpec{}, 30).is_ok());  // uniform
  EXPECT_TRUE(s.quantized());
  EXPECT_EQ(s.to_string().rfind("mixed:4x", 0), 0u) << s.to_string();
  QuantSpec t = s;
  t.plane_formats[3] = Format::kFp8E4m3;
  EXPECT_NE(s.to_string(), t.to_string());
}

// Bytes per page are the sum over planes, each with its own element size and scales.
TEST(KvConfig, AccountingSumsThePlanes) {
  QuantSpec s;
  s.granularity = ScaleGranularity::kPerTokenHead;
  s.plane_formats = {Format::kInt8, Format::kBf16, Format::kFp8E4m3, Format::kInt8};
  const int heads = 3, dim = 64, bs = 16;
  const size_t q8 = static_cast<size_t>(heads) * bs * dim + static_cast<size_t>(heads) * bs * 4;
  const size_t b16 = static_cast<size_t>(heads) * bs * dim * 2;
  EXPECT_EQ(cache::bytes_per_page(s, 2, heads, dim), 3 * q8 + b16);
  EXPECT_EQ(cache::bytes_per_token(s, 2, heads, dim), (3 * q8 + b16) / bs);
  EXPECT_EQ(cache::capacity(10 * (3 * q8 + b16) + 5, s, 2, heads, dim), 10u * bs);
  EXPECT_EQ(cache::bytes_per_page(s, 3, heads, dim), 0u);  // the mix does not describe 3 layers
}

}  // namespace
}  // namespace kvq
