// The GGUF `llama` loader, checked against the llama2.c loader: stories260K's weights are written
// into a GGUF file (read here straight from the checkpoint's documented layout, not through the
// kvq loader), and both models must produce the same logits. Broken variants must give errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>

#include "gguf_writer.h"
#include "kvq/format/bf16.h"
#include "kvq/model/gguf.h"
#include "kvq/model/model.h"
#include "model/stories_data.h"

namespace kvq::model {
namespace {

using testing::GgufWriter;

const std::string kStories = kvq::model::stories260k_dir() + "/stories260K.bin";

struct RawStories {
  std::vector<float> emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final;
};

RawStories read_raw() {
  std::ifstream f(kStories, std::ios::binary);
  std::vector<char> b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(b.size(), 1056540u);
  const float* p = reinterpret_cast<const float*>(b.data() + 28);
  RawStories r;
  auto take = [&](std::vector<float>& v, size_t n) {
    v.assign(p, p + n);
    p += n;
  };
  take(r.emb, 512 * 64);
  take(r.rms_att, 5 * 64);
  take(r.wq, 5 * 64 * 64);
  take(r.wk, 5 * 32 * 64);
  take(r.wv, 5 * 32 * 64);
  take(r.wo, 5 * 64 * 64);
  take(r.rms_ffn, 5 * 64);
  take(r.w1, 5 * 172 * 64);
  take(r.w2, 5 * 64 * 172);
  take(r.w3, 5 * 172 * 64);
  take(r.rms_final, 64);
  return r;
}

std::vector<float> slice(const std::vector<float>& v, int layer, size_t n) {
  return {v.begin() + static_cast<std::ptrdiff_t>(layer * n), v.begin() + static_cast<std::ptrdiff_t>((layer + 1) * n)};
}

// q8_0 encoding: per 32 values d = amax / 127 (as fp16), q = round(x / d).
std::vector<uint8_t> to_q8_0(const std::vector<float>& v) {
  std::vector<uint8_t> out;
  for (size_t b = 0; b < v.size(); b += 32) {
    float amax = 0;
    for (size_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[b + i]));
    uint16_t h = format::float_to_fp16(amax / 127.f);
    float d = format::fp16_to_float(h);
    out.push_back(static_cast<uint8_t>(h & 0xFF));
    out.push_back(static_cast<uint8_t>(h >> 8));
    for (size_t i = 0; i < 32; ++i) {
      int q = d > 0 ? static_cast<int>(std::lround(v[b + i] / d)) : 0;
      out.push_back(static_cast<uint8_t>(static_cast<int8_t>(std::clamp(q, -127, 127))));
    }
  }
  return out;
}

struct Options {
  bool q8 = false;
  std::string arch = "llama";
  std::string tokenizer_model = "gpt2";
  std::string skip_tensor;
  std::string wrong_shape_tensor;
  std::string q5_tensor;  // stored with a type kvq does not decode
  bool skip_embedding_length = false;
  float freq_base = 10000.f;
  // tokenizer.ggml.token_type stored as float32 with this value for token 3 (0 = not written).
  float token_type_3 = 0;
};

std::vector<uint8_t> stories_gguf(const RawStories& r, const Options& o) {
  GgufWriter w;
  w.kv_str("general.architecture", o.arch);
  w.kv_str("general.name", "stories260K-gguf");
  if (!o.skip_embedding_length) w.kv_u32("llama.embedding_length", 64);
  w.kv_u32("llama.block_count", 5);
  w.kv_u32("llama.attention.head_count", 8);
  w.kv_u32("llama.attention.head_count_kv", 4);
  w.kv_u32("llama.feed_forward_length", 172);
  w.kv_u32("llama.context_length", 512);
  w.kv_u32("llama.rope.dimension_count", 8);
  w.kv_f32("llama.rope.freq_base", o.freq_base);
  w.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.kv_str("tokenizer.ggml.model", o.tokenizer_model);
  // 256 byte-level symbols first (so any text encodes), then filler tokens up to 512.
  std::vector<std::string> toks;
  for (int b = 0; b < 256; ++b) {
    uint32_t cp = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE) ? static_cast<uint32_t>(b) : 0;
    std::string s;
    if (cp != 0) {
      if (cp < 0x80) s.push_back(static_cast<char>(cp));
      else { s.push_back(static_cast<char>(0xC0 | (cp >> 6))); s.push_back(static_cast<char>(0x80 | (cp & 0x3F))); }
    } else {
      s = "<byte" + std::to_string(b) + ">";  // placeholder for the non-printable bytes
    }
    toks.push_back(s);
  }
  for (int i = 256; i < 512; ++i) toks.push_back("tok" + std::to_string(i));
  w.kv_str_array("tokenizer.ggml.tokens", toks);
  w.kv_str_array("tokenizer.ggml.merges", {});
  if (o.token_type_3 != 0) {
    std::vector<uint8_t> a;
    GgufWriter::pod(a, uint32_t{6});  // float32 elements
    GgufWriter::pod(a, static_cast<uint64_t>(toks.size()));
    for (size_t i = 0; i < toks.size(); ++i) GgufWriter::pod(a, i == 3 ? o.token_type_3 : 1.f);
    w.kv_raw("tokenizer.ggml.token_type", 9, a);
  }
  w.kv_u32("tokenizer.ggml.bos_token_id", 1);
  w.kv_u32("tokenizer.ggml.eos_token_id", 2);
  w.kv_bool("tokenizer.ggml.add_bos_token", true);

  auto put = [&](const std::string& name, std::vector<uint64_t> dims, const std::vector<float>& v, bool matrix) {
    if (name == o.skip_tensor) return;
    if (name == o.wrong_shape_tensor) std::swap(dims[0], dims[1]);
    if (name == o.q5_tensor) {
      w.tensor(name, dims, 6, std::vector<uint8_t>(v.size() / 32 * 22));
    } else if (o.q8 && matrix) {
      w.tensor(name, dims, static_cast<uint32_t>(gguf::TensorType::kQ8_0), to_q8_0(v));
    } else {
      w.tensor_f32(name, dims, v);
    }
  };
  put("token_embd.weight", {64, 512}, r.emb, true);
  put("output_norm.weight", {64}, r.rms_final, false);
  for (int l = 0; l < 5; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    put(p + "attn_norm.weight", {64}, slice(r.rms_att, l, 64), false);
    put(p + "attn_q.weight", {64, 64}, slice(r.wq, l, 64 * 64), true);
    put(p + "attn_k.weight", {64, 32}, slice(r.wk, l, 32 * 64), true);
    put(p + "attn_v.weight", {64, 32}, slice(r.wv, l, 32 * 64), true);
    put(p + "attn_output.weight", {64, 64}, slice(r.wo, l, 64 * 64), true);
    put(p + "ffn_norm.weight", {64}, slice(r.rms_ffn, l, 64), false);
    put(p + "ffn_gate.weight", {64, 172}, slice(r.w1, l, 172 * 64), true);
    put(p + "ffn_up.weight", {64, 172}, slice(r.w3, l, 172 * 64), true);
    put(p + "ffn_down.weight", {172, 64}, slice(r.w2, l, 64 * 172), false);  // rows of 172: not whole q8 blocks
  }
  return w.bytes();
}

class TempFile {
 public:
  explicit TempFile(const std::vector<uint8_t>& bytes) {
    char tmpl[] = "/tmp/kvq_gguf_test_XXXXXX";
    int fd = mkstemp(tmpl);
    EXPECT_GE(fd, 0);
    path_ = tmpl;
    size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::close(fd);
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::vector<float> logits_of(const Model& m, const std::vector<int32_t>& ids) {
  QuantSpec spec;
  spec.format = Format::kBf16;
  spec.sink_tokens = 0;
  auto r = Runner::create(m, spec, 512);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  std::vector<float> out(ids.size() * static_cast<size_t>(m.config().vocab_size));
  Status s = r.value()->forward(ids.data(), static_cast<int>(ids.size()), out.data());
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

class GgufModel : public ::testing::Test {
 protected:
  // Skipping in SetUpTestSuite only leaves raw_ and ref_ null (this GoogleTest still runs the bodies);
  // SetUp's skip is what stops each test.
  static void SetUpTestSuite() {
    KVQ_REQUIRE_STORIES260K();
    raw_ = new RawStories(read_raw());
    auto ref = Model::load(kStories);
    ASSERT_TRUE(ref.is_ok()) << ref.status().to_string();
    ref_ = std::move(ref).value().release();
  }
  void SetUp() override { KVQ_REQUIRE_STORIES260K(); }
  static void TearDownTestSuite() {
    delete raw_;
    delete ref_;
  }
  static Status load_status(const Options& o) {
    TempFile f(stories_gguf(*raw_, o));
    return Model::load(f.path()).status();
  }
  static RawStories* raw_;
  static Model* ref_;
};
RawStories* GgufModel::raw_ = nullptr;
Model* GgufModel::ref_ = nullptr;

const std::vector<int32_t> kIds = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338,
                                   401, 396, 267, 337, 410, 408, 419, 292, 7, 100, 511, 0, 2};

TEST_F(GgufModel, F32FileMatchesLlama2cCheckpoint) {
  TempFile f(stories_gguf(*raw_, {}));
  auto m = Model::load(f.path());
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  const ModelConfig& c = m.value()->config();
  EXPECT_EQ(c.name, "stories260K-gguf");
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(c.rope_half_split);
  auto a = logits_of(*ref_, kIds), b = logits_of(*m.value(), kIds);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5f) << i;
}

TEST_F(GgufModel, Q8_0WeightsStayCloseToF32) {
  Options o;
  o.q8 = true;
  TempFile f(stories_gguf(*raw_, o));
  auto m = Model::load(f.path());
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  auto a = logits_of(*ref_, kIds), b = logits_of(*m.value(), kIds);
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += a[i] * a[i];
  }
  const double rel = std::sqrt(num / den);
  EXPECT_GT(rel, 0.0);    // the weights really went through q8_0
  EXPECT_LT(rel, 0.02);   // 8-bit weights: logits within a few percent
}

TEST_F(GgufModel, BrokenFilesGiveErrors) {
  struct Case {
    std::function<void(Options&)> edit;
    StatusCode code;
    std::string needle;
  };
  std::vector<Case> cases = {
      {[](Options& o) { o.arch = "gpt2"; }, StatusCode::kUnsupported, "architecture 'gpt2'"},
      {[](Options& o) { o.tokenizer_model = "bert"; }, StatusCode::kUnsupported, "tokenizer model 'bert'"},
      {[](Options& o) { o.skip_tensor = "blk.3.ffn_up.weight"; }, StatusCode::kCorruptInput, "blk.3.ffn_up.weight"},
      {[](Options& o) { o.wrong_shape_tensor = "blk.1.attn_k.weight"; }, StatusCode::kCorruptInput, "expected [64, 32]"},
      {[](Options& o) { o.q5_tensor = "blk.2.attn_q.weight"; }, StatusCode::kUnsupported, "q5_0"},
      {[](Options& o) { o.skip_embedding_length = true; }, StatusCode::kCorruptInput, "llama.embedding_length"},
      // Values read from the file as floats are checked before any narrowing or float-to-int conversion.
      {[](Options& o) { o.freq_base = NAN; }, StatusCode::kCorruptInput, "freq_base"},
      {[](Options& o) { o.freq_base = INFINITY; }, StatusCode::kCorruptInput, "freq_base"},
      {[](Options& o) { o.token_type_3 = NAN; }, StatusCode::kCorruptInput, "token_type[3]"},
      {[](Options& o) { o.token_type_3 = 3e9f; }, StatusCode::kCorruptInput, "token_type[3]"},
      {[](Options& o) { o.token_type_3 = 1.5f; }, StatusCode::kCorruptInput, "token_type[3]"},
  };
  for (const auto& c : cases) {
    Options o;
    c.edit(o);
    Status s = load_status(o);
    EXPECT_EQ(s.code(), c.code) << s.to_string();
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << s.to_string();
  }
  EXPECT_EQ(Model::load("/nonexistent/model.gguf").status().code(), StatusCode::kNotFound);
}

TEST(Llama2cLoader, RejectsBrokenCheckpoints) {
  KVQ_REQUIRE_STORIES260K();
  std::ifstream f(kStories, std::ios::binary);
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ASSERT_EQ(b.size(), 1056540u);
  // The loader looks for tok512.bin beside the checkpoint; these fail before reaching it.
  auto status_of = [](const std::vector<uint8_t>& bytes) {
    TempFile t(bytes);
    return Model::load(t.path()).status();
  };
  std::vector<uint8_t> truncated(b.begin(), b.end() - 100);
  Status s = status_of(truncated);
  EXPECT_EQ(s.code(), StatusCode::kCorruptInput);
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.to_string();
  EXPECT_EQ(status_of({1, 2, 3}).code(), StatusCode::kCorruptInput);
  auto with_header = [&](int idx, int32_t v) {
    std::vector<uint8_t> c = b;
    std::memcpy(c.data() + 4 * idx, &v, 4);
    return status_of(c);
  };
  EXPECT_EQ(with_header(3, 7).code(), StatusCode::kCorruptInput);           // 8 KV heads > 7 heads
  EXPECT_EQ(with_header(0, 0x7fffffff).code(), StatusCode::kCorruptInput);  // absurd dim
  EXPECT_EQ(with_header(2, 1000000).code(), StatusCode::kCorruptInput);     // absurd layer count
  EXPECT_EQ(with_header(5, -512).code(), StatusCode::kCorruptInput);        // untied: file too short
  EXPECT_EQ(with_header(6, -1).code(), StatusCode::kCorruptInput);          // negative context
  std::vector<uint8_t> v1 = b;
  std::memcpy(v1.data(), "24ka", 4);  // magic 0x616b3432 of the newer llama2.c export versions
  Status sv = status_of(v1);
  EXPECT_EQ(sv.code(), StatusCode::kUnsupported) << sv.to_string();
}

}  // namespace
}  // namespace kvq::model
