// The engine with a per-layer cache config on stories260K: a config that names the same dtype for
// every plane is the uniform cache bit for bit, and a real mix runs, through prefill and decode,
// with each layer's own formats (its logits differ from every uniform cache's).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvq/model/model.h"
#include "model/stories_data.h"

namespace kvq::model {
namespace {

const std::string kDir = kvq::model::stories260k_dir() + "/";

std::vector<float> logits_of(const Model& m, const QuantSpec& spec, const std::vector<int32_t>& ids) {
  auto runner = Runner::create(m, spec, static_cast<int>(ids.size()));
  EXPECT_TRUE(runner.is_ok()) << runner.status().to_string();
  if (!runner.is_ok()) return {};
  const size_t vocab = static_cast<size_t>(m.config().vocab_size);
  std::vector<float> out(ids.size() * vocab);
  // A prefill of 100 tokens, then one token at a time: both attention paths read the planes.
  const int n = static_cast<int>(ids.size());
  EXPECT_TRUE(runner.value()->forward(ids.data(), 100, out.data()).is_ok());
  for (int t = 100; t < n; ++t) EXPECT_TRUE(runner.value()->forward(ids.data() + t, 1, out.data() + t * vocab).is_ok());
  return out;
}

TEST(EngineLayerConfig, UniformConfigIsThePlainSpecAndAMixIsItsOwn) {
  KVQ_REQUIRE_STORIES260K();
  auto m = Model::load(kDir + "stories260K.bin");
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  std::ifstream f(kDir + "tinystories_valid_head.txt", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<int32_t> ids = m.value()->tokenizer().encode(text.substr(0, 4000), false);
  ids.resize(160);
  const int layers = m.value()->config().n_layers;

  QuantSpec plain;
  plain.format = Format::kInt8;
  plain.sink_tokens = 16;
  QuantSpec uniform = plain;
  uniform.plane_formats.assign(static_cast<size_t>(2 * layers), Format::kInt8);
  const std::vector<float> a = logits_of(*m.value(), plain, ids), b = logits_of(*m.value(), uniform, ids);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));

  QuantSpec mix = plain;
  for (int l = 0; l < layers; ++l)
    mix.plane_formats.insert(mix.plane_formats.end(), {l % 2 ? Format::kFp8E4m3 : Format::kInt8,
                                                       l % 3 ? Format::kBf16 : Format::kFp8E4m3});
  const std::vector<float> c = logits_of(*m.value(), mix, ids);
  QuantSpec fp8 = plain;
  fp8.format = Format::kFp8E4m3;
  const std::vector<float> d = logits_of(*m.value(), fp8, ids);
  ASSERT_EQ(c.size(), a.size());
  EXPECT_NE(0, std::memcmp(c.data(), a.data(), a.size() * sizeof(float)));
  EXPECT_NE(0, std::memcmp(c.data(), d.data(), a.size() * sizeof(float)));
  // Every position before the sink ends is bf16 in all of them: identical logits there.
  const size_t vocab = static_cast<size_t>(m.value()->config().vocab_size);
  EXPECT_EQ(0, std::memcmp(c.data(), a.data(), 16 * vocab * sizeof(float)));

  QuantSpec wrong = plain;
  wrong.plane_formats.assign(2, Format::kInt8);
  auto r = Runner::create(*m.value(), wrong, 64);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("the model has " + std::to_string(layers)), std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace kvq::model
