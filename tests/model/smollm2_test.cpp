// SmolLM2-135M-Instruct (GGUF, Q4_1 weights) end to end. Skipped when the model is not in the
// cache folder (`kvq pull smollm2`; scripts/test.sh pulls it first).
//
// Independent references, obtained once and hard-coded:
//  - token ids: HF `tokenizers` 0.23.3 built from this GGUF's tokenizer.ggml.tokens/merges with
//    SmolLM2's pre-tokenizer (Sequence[Digits(individual_digits=True),
//    ByteLevel(add_prefix_space=False)]) and its special tokens;
//  - kFixedText NLL: a float64 numpy forward pass over the weights as dequantized by gguf-py 0.19.0
//    (no cache quantization): mean NLL 3.342397 (ppl 28.287) over 92 predictions, argmax of the
//    last position 198 ("\n"). kvq with a bf16 cache gives 3.34215 (validated, pinned below).
//  - the RoPE layout: adjacent pairs give ppl 7.66 on the first 2000 characters of TinyStories
//    validation text; half-split pairs give 188, so GGUF llama files are adjacent-pair.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <memory>

#include "kvq/model/model.h"

namespace kvq::model {
namespace {

const char kFixedText[] =
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press. Books that had taken scribes months to copy could now be "
    "produced in days, and their price fell sharply. Within fifty years, printing shops had opened in more than two "
    "hundred European cities. The spread of printed pamphlets helped new ideas travel quickly, from scientific "
    "discoveries to religious debates, and literacy rates slowly began to rise.";
const std::vector<int32_t> kFixedIds = {504, 1463, 282, 260, 7510, 1757, 5634, 281, 260, 35561, 2070, 28, 645, 28322, 45382, 5276, 39245, 4718, 1502, 28, 2664, 29, 2542, 12923, 284, 253, 10091, 21665, 1757, 30, 9379, 338, 761, 2473, 41131, 2704, 288, 3784, 856, 1209, 325, 3281, 281, 2009, 28, 284, 480, 4319, 6641, 22463, 30, 10043, 13869, 929, 28, 7510, 14402, 761, 6572, 281, 540, 670, 827, 3822, 3284, 4199, 30, 378, 2824, 282, 8057, 43086, 4573, 725, 2821, 2827, 3112, 28, 429, 3097, 9570, 288, 3320, 9705, 28, 284, 8053, 3400, 6351, 2585, 288, 4095, 30};
constexpr double kFixedNllBf16 = 3.34215;     // kvq, bf16 cache, no sink
constexpr double kFixedNllFloat64 = 3.342397;  // numpy float64 reference, unquantized cache

struct TokCase {
  std::string text;
  std::vector<int32_t> ids;
};
const std::vector<TokCase> kTokCases = {
    {"Hello world! The year 2024 had 366 days.",
     {19556, 905, 17, 378, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 30}},
    {"Ça va? Déjà vu, naïve café — résumé.",
     {142, 225, 81, 46316, 47, 422, 2756, 90, 16739, 386, 101, 28, 15486, 46494, 37366, 1841, 412, 2756, 5422, 2756, 30}},
    {"日本語のテキストと中文混合，还有한국어.",
     {23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 7365, 118, 28589, 29184, 177, 132, 132, 16357, 226, 12831, 18276, 242, 30746, 33085, 246, 181, 130, 251, 183, 240, 129, 30}},
    {"Emoji test: 🎉🚀 👍🏽 family: 👨‍👩‍👧",
     {10809, 33777, 1028, 42, 15107, 232, 227, 10813, 244, 218, 15107, 235, 231, 10813, 233, 138, 1564, 42, 15107, 235, 118, 321, 231, 10813, 235, 119, 321, 231, 10813, 235, 117}},
    {"def f(x):\n    return x ** 2  # square\n\n\tif x != 0: pass",
     {1604, 275, 24, 104, 727, 472, 1003, 1792, 1903, 216, 34, 216, 907, 5222, 1116, 197, 342, 1792, 6541, 216, 32, 42, 1301}},
    {"I'm sure you've seen it; they'll say we'd re-do it. DON'T SHOUT",
     {57, 5248, 2090, 346, 3543, 2269, 357, 43, 502, 3060, 1643, 392, 6737, 298, 29, 4326, 357, 30, 422, 2154, 23, 68, 334, 21953}},
    {"multiple   spaces    and trailing   ",
     {30404, 256, 5600, 333, 284, 35079, 333}},
    {"<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n",
     {1, 4093, 198, 1780, 314, 216, 33, 27, 33, 47, 2, 198, 1, 520, 9531, 198}},
    {"Numbers: 3.14159, 1,000,000 and ½ ¾ ² ٣ ७",
     {39006, 42, 216, 35, 30, 33, 36, 33, 37, 41, 28, 216, 33, 28, 32, 32, 32, 28, 32, 32, 32, 284, 216, 16738, 216, 43124, 216, 19133, 216, 164, 113, 216, 9310, 251}},
    {"Ünïcödé ẞ ß ﬁ Ωμέγα Кириллица עברית العربية",
     {142, 246, 94, 25972, 83, 7466, 84, 2756, 15822, 135, 248, 5549, 249, 40367, 5664, 119, 16674, 34075, 23098, 8998, 5470, 244, 7872, 46879, 12681, 35420, 32233, 6511, 12960, 112, 37657, 30825, 28532, 120, 27819, 34966, 20602, 31462, 23339, 43463}},
};

QuantSpec spec_of(Format f, int sink) {
  QuantSpec s;
  s.format = f;
  s.sink_tokens = sink;
  return s;
}

class SmolLM2 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = cache_dir() + "/" + kSmolLM2File;
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) return;
    auto m = Model::load(path);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    model_ = std::move(m).value().release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  void SetUp() override {
    if (model_ == nullptr)
      GTEST_SKIP() << "SmolLM2 GGUF not found in " << cache_dir() << "; run `kvq pull smollm2` to enable these tests";
  }

  // Mean NLL of kFixedIds; also returns the argmax after the last token.
  static double fixed_nll(const QuantSpec& spec, int32_t* last_argmax = nullptr) {
    const int V = model_->config().vocab_size, n = static_cast<int>(kFixedIds.size());
    auto r = Runner::create(*model_, spec, n);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    std::vector<float> logits(static_cast<size_t>(n) * V);
    Status s = r.value()->forward(kFixedIds.data(), n, logits.data());
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    double total = 0;
    for (int t = 0; t + 1 < n; ++t) {
      const float* l = logits.data() + static_cast<size_t>(t) * V;
      double mx = l[0];
      for (int i = 1; i < V; ++i) mx = std::max(mx, static_cast<double>(l[i]));
      double z = 0;
      for (int i = 0; i < V; ++i) z += std::exp(l[i] - mx);
      total += mx + std::log(z) - l[kFixedIds[t + 1]];
    }
    if (last_argmax) {
      const float* l = logits.data() + static_cast<size_t>(n - 1) * V;
      *last_argmax = static_cast<int32_t>(std::max_element(l, l + V) - l);
    }
    return total / (n - 1);
  }

  static Model* model_;
};
Model* SmolLM2::model_ = nullptr;

TEST_F(SmolLM2, LoadsConfigFromMetadata) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.n_layers, 30);
  EXPECT_EQ(c.dim, 576);
  EXPECT_EQ(c.hidden_dim, 1536);
  EXPECT_EQ(c.n_heads, 9);
  EXPECT_EQ(c.n_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.max_seq_len, 8192);
  EXPECT_FLOAT_EQ(c.rope_theta, 100000.f);
  EXPECT_NEAR(c.norm_eps, 1e-5f, 1e-9f);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(c.rope_half_split);
  EXPECT_FALSE(c.add_bos);
  EXPECT_EQ(model_->tokenizer().bos_id(), 1);
  EXPECT_EQ(model_->tokenizer().eos_id(), 2);
}

TEST_F(SmolLM2, TokenizerMatchesReferenceAndRoundTrips) {
  const Tokenizer& tok = model_->tokenizer();
  for (const auto& c : kTokCases) {
    EXPECT_EQ(tok.encode(c.text, false), c.ids) << c.text;
    std::string back;
    for (int32_t id : c.ids) back += tok.piece(id);
    EXPECT_EQ(back, c.text);
  }
  EXPECT_EQ(tok.encode(kFixedText, false), kFixedIds);
  EXPECT_EQ(tok.decode(kFixedIds), kFixedText);
  std::string odd = "tabs\there, CRLF\r\n, NBSP\xC2\xA0x, a lone \xC3 lead byte, 12345 and ٣٤";
  EXPECT_EQ(tok.decode(tok.encode(odd, false)), odd);
  // Byte 0xFF never occurs in UTF-8, so this vocabulary has no symbol for it: it becomes <unk>.
  EXPECT_EQ(tok.encode("\xFF", false), (std::vector<int32_t>{0}));
}

TEST_F(SmolLM2, PerplexityOfFixedTextIsPinned) {
  int32_t next = -1;
  const double nll = fixed_nll(spec_of(Format::kBf16, 0), &next);
  std::printf("SmolLM2 fixed text, bf16 cache: mean NLL %.5f, ppl %.4f\n", nll, std::exp(nll));
  EXPECT_NEAR(nll, kFixedNllBf16, 2e-3);
  EXPECT_NEAR(nll, kFixedNllFloat64, 3e-3);
  EXPECT_EQ(next, 198);
}

TEST_F(SmolLM2, QuantizedCacheDeltaIsBounded) {
  const double base = fixed_nll(spec_of(Format::kBf16, 0));
  for (Format f : {Format::kFp8E4m3, Format::kInt8}) {
    const double d = fixed_nll(spec_of(f, 0)) - base;
    std::printf("SmolLM2 fixed text, %s cache (no sink): delta NLL %+.5f (ppl %+.3f%%)\n", format_name(f), d,
                100 * (std::exp(d) - 1));
    EXPECT_GT(std::fabs(d), 0.0) << "the quantized cache must actually be used";
    EXPECT_LT(std::fabs(d), 0.03) << format_name(f);
  }
}

TEST_F(SmolLM2, GreedyChatGenerationIsDeterministic) {
  const Tokenizer& tok = model_->tokenizer();
  auto prompt = tok.encode(tok.chat_prompt("What is the capital of France?"), false);
  SamplingOptions opts;
  opts.max_new_tokens = 24;
  auto run = [&](const QuantSpec& spec) {
    auto r = Runner::create(*model_, spec, 128);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    auto out = generate(*r.value(), prompt, opts);
    EXPECT_TRUE(out.is_ok()) << out.status().to_string();
    return out.value();
  };
  // The default spec keeps this short conversation in the bf16 sink.
  auto a = run(QuantSpec{});
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a.back(), tok.eos_id()) << "expected a short answer ending in <|im_end|>";
  EXPECT_EQ(tok.decode(a), "The capital of France is Paris.");
  // Quantized cache: repeatable run to run. (The first answer token is a near tie, "The" 25.35
  // vs "L" 25.25 in bf16, so the text itself is not pinned for quantized specs.)
  auto q = spec_of(Format::kInt8, 0);
  EXPECT_EQ(run(q), run(q));
}

}  // namespace
}  // namespace kvq::model
