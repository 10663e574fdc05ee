// Reproducible numerics (backend.h, Numerics::kReproducible; docs/ARCHITECTURE.md §8):
//   - the arithmetic: rp::exp against std::exp in double, special values;
//   - the CPU engine in this mode still computes the model: stories260K's float64 reference NLLs;
//   - the order does not depend on threads or batching (bitwise, on the CPU, in CI);
//   - every other available backend (CUDA on the device) gives the CPU's logits and the CPU's K/V
//     codes, scales, sink and side planes bit for bit, layer by layer, over chunked prefill and
//     decode, for every cache format (skipped where the CPU is the only backend).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvq/backend/backend.h"
#include "kvq/common/reproducible_math.h"
#include "kvq/format/bf16.h"
#include "kvq/model/engine.h"
#include "kvq/model/model.h"
#include "kvq/quant/spec.h"
#include "model/stories_data.h"

namespace kvq::backend {
namespace {

// ---- the arithmetic --------------------------------------------------------------------------------

double ulp_distance(float got, double want) {
  const float w = static_cast<float>(want);
  if (std::isinf(w)) return got == w ? 0 : std::numeric_limits<double>::infinity();
  const float ulp = std::nextafter(std::fabs(w), std::numeric_limits<float>::infinity()) - std::fabs(w);
  return std::fabs(static_cast<double>(got) - want) / ulp;
}

TEST(ReproducibleMath, ExpWithinTwoUlpOverTheRange) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(-103.9f, 88.7f), near0(-1.f, 1.f);
  double worst = 0;
  float worst_x = 0;
  for (int i = 0; i < 200000; ++i) {
    const float x = i % 2 ? wide(rng) : near0(rng);
    const double want = std::exp(static_cast<double>(x));
    if (want < std::numeric_limits<float>::min()) continue;  // subnormal results: checked below
    const double u = ulp_distance(rp::exp(x), want);
    if (u > worst) worst = u, worst_x = x;
  }
  std::printf("rp::exp: worst error %.3f ulp at x = %.9g\n", worst, worst_x);
  EXPECT_LE(worst, 2.0) << "at x = " << worst_x;
}

TEST(ReproducibleMath, ExpSpecialValues) {
  EXPECT_EQ(rp::exp(0.f), 1.f);
  EXPECT_EQ(rp::exp(-0.f), 1.f);
  EXPECT_EQ(rp::exp(-std::numeric_limits<float>::infinity()), 0.f);
  EXPECT_EQ(rp::exp(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::infinity());
  EXPECT_EQ(rp::exp(89.f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(rp::exp(-104.f), 0.f);
  EXPECT_TRUE(std::isnan(rp::exp(std::numeric_limits<float>::quiet_NaN())));
  // Subnormal results stay within one subnormal step of the true value.
  for (float x : {-88.f, -90.f, -95.f, -100.f, -103.f}) {
    const double want = std::exp(static_cast<double>(x)), step = std::ldexp(1.0, -149);
    EXPECT_LE(std::fabs(rp::exp(x) - want), 2 * step + want * 3e-7) << x;
  }
  // silu(g) * u follows its definition.
  for (float g : {-20.f, -1.5f, 0.f, 0.25f, 3.f, 30.f})
    EXPECT_NEAR(rp::silu_mul(g, 1.5f), g / (1 + std::exp(-double(g))) * 1.5, 1e-6 * (1 + std::fabs(g)));
}

// ---- the forward pass on stories260K -----------------------------------------------------------------

class ReproducibleStories : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    KVQ_REQUIRE_STORIES260K();  // else the suite's setup fails the binary (SetUp skips each test)
    auto m = model::Model::load(model::testing::stories_dir() + "/stories260K.bin");
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    model_ = std::move(m).value().release();
    ids_ = new std::vector<int32_t>(model::testing::stories_text_ids(*model_));
  }
  void SetUp() override { KVQ_REQUIRE_STORIES260K(); }
  static void TearDownTestSuite() {
    delete model_;
    delete ids_;
  }
  // Window w of the README setup: BOS, then 511 ids.
  static std::vector<int32_t> window(int w) { return model::testing::stories_window(*ids_, w); }
  static std::unique_ptr<Backend> make(BackendKind kind, int threads = 0) {
    BackendOptions o;
    o.numerics = Numerics::kReproducible;
    o.cpu_threads = threads;
    auto b = create_backend(kind, o);
    EXPECT_TRUE(b.is_ok()) << b.status().to_string();
    return b.is_ok() ? std::move(b).value() : nullptr;
  }
  static QuantSpec spec(const std::string& dtype, const std::string& gran = "per_token_head", int sink = 32,
                        int recent = 0, const std::string& rotate = "none") {
    QuantOptions q;
    q.kv_cache_dtype = dtype;
    q.granularity = gran;
    q.sink_tokens = sink;
    q.recent_tokens = recent;
    q.rotate = rotate;
    auto s = parse_quant_spec(q);
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    return s.value();
  }

  // Logits [n][vocab] of `windows` run together through one engine: the first `prefill` tokens of
  // each in chunks of `chunk`, the rest one token a step (batched decode across the windows).
  static std::vector<std::vector<float>> run(Backend& be, const QuantSpec& s, const std::vector<std::vector<int32_t>>& wins,
                                             int prefill, int chunk, std::unique_ptr<model::Engine>* keep = nullptr) {
    model::EngineOptions eo;
    eo.max_seqs = static_cast<int>(wins.size());
    eo.max_tokens = 512;
    eo.chunk_tokens = chunk;
    auto e = model::Engine::create(*model_, s, be, eo);
    EXPECT_TRUE(e.is_ok()) << e.status().to_string();
    if (!e.is_ok()) return {};
    const size_t V = static_cast<size_t>(model_->config().vocab_size);
    std::vector<std::vector<float>> logits(wins.size());
    std::vector<cache::SeqId> seqs;
    for (size_t i = 0; i < wins.size(); ++i) {
      logits[i].assign(wins[i].size() * V, 0.f);
      auto id = e.value()->add_sequence();
      EXPECT_TRUE(id.is_ok());
      seqs.push_back(id.value());
    }
    std::vector<model::SeqStep> steps;
    for (size_t i = 0; i < wins.size(); ++i)
      steps.push_back({seqs[i], wins[i].data(), prefill, model::LogitsMode::kAll, logits[i].data()});
    EXPECT_TRUE(e.value()->forward(steps).is_ok());
    for (int t = prefill; t < static_cast<int>(wins[0].size()); ++t) {
      steps.clear();
      for (size_t i = 0; i < wins.size(); ++i)
        steps.push_back({seqs[i], wins[i].data() + t, 1, model::LogitsMode::kAll, logits[i].data() + t * V});
      const Status st = e.value()->forward(steps);
      EXPECT_TRUE(st.is_ok()) << st.to_string();
    }
    if (keep != nullptr) *keep = std::move(e).value();
    return logits;
  }

  static double mean_nll(const std::vector<float>& logits, const std::vector<int32_t>& win) {
    const int V = model_->config().vocab_size;
    double total = 0;
    for (size_t t = 0; t + 1 < win.size(); ++t) {
      const float* l = logits.data() + t * V;
      double mx = l[0], s = 0;
      for (int i = 1; i < V; ++i) mx = std::max(mx, double(l[i]));
      for (int i = 0; i < V; ++i) s += std::exp(l[i] - mx);
      total += mx + std::log(s) - l[win[t + 1]];
    }
    return total / double(win.size() - 1);
  }

  static model::Model* model_;
  static std::vector<int32_t>* ids_;
};
model::Model* ReproducibleStories::model_ = nullptr;
std::vector<int32_t>* ReproducibleStories::ids_ = nullptr;

// The mode computes the same model: the float64 reference of shared/models/stories260K/README.md.
TEST_F(ReproducibleStories, CpuMatchesTheFloat64ReferenceNll) {
  auto be = make(BackendKind::kCpu);
  ASSERT_NE(be, nullptr);
  EXPECT_EQ(be->numerics(), Numerics::kReproducible);
  const auto win = window(0);
  const double bf16 = mean_nll(run(*be, spec("bf16", "per_token_head", 0), {win}, 472, 128)[0], win);
  const double fp16 = mean_nll(run(*be, spec("fp16", "per_token_head", 0), {win}, 511, 128)[0], win);
  std::printf("stories260K window 0, reproducible cpu: bf16 cache %.5f, fp16 cache %.5f (reference 1.31121)\n", bf16,
              fp16);
  EXPECT_NEAR(bf16, 1.31121, 1e-3);
  EXPECT_NEAR(fp16, 1.31121, 2e-4);
}

// Same size and the same bytes; *first is the first differing element otherwise.
template <class V>
bool same_bits(const V& a, const V& b, size_t* first) {
  if (a.size() != b.size()) return *first = 0, false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(a[i])) != 0) return *first = i, false;
  return true;
}

// Threads split the work by output element and a step's rows never share arithmetic: one thread
// or three, one window or two in a step, the logits are the same bits.
TEST_F(ReproducibleStories, CpuIndependentOfThreadsAndBatch) {
  auto one = make(BackendKind::kCpu, 1), three = make(BackendKind::kCpu, 3);
  ASSERT_NE(one, nullptr);
  ASSERT_NE(three, nullptr);
  const QuantSpec s = spec("fp8_e4m3", "per_block_head", 32);
  std::vector<int32_t> a = window(1), b = window(2);
  a.resize(200), b.resize(200);
  const auto alone = run(*one, s, {a}, 150, 64);
  const auto both = run(*three, s, {a, b}, 150, 64);
  size_t at = 0;
  ASSERT_EQ(both.size(), 2u);
  EXPECT_TRUE(same_bits(alone[0], both[0], &at)) << "first differing logit " << at;
  const double nll = mean_nll(both[1], b);
  EXPECT_TRUE(std::isfinite(nll) && nll < 3.0) << nll;  // the other window is a real prediction too
}

// Every backend other than the CPU, against the CPU: logits and every plane of every layer.
TEST_F(ReproducibleStories, EveryBackendMatchesTheCpuBitForBit) {
  std::vector<BackendKind> others;
  for (BackendKind k : available_backends())
    if (k != BackendKind::kCpu) others.push_back(k);
  if (others.empty()) GTEST_SKIP() << "the CPU is the only backend here (the device runs this)";
  auto cpu = make(BackendKind::kCpu);
  ASSERT_NE(cpu, nullptr);
  const std::vector<std::pair<std::string, QuantSpec>> specs = {
      {"bf16", spec("bf16")},
      {"fp16 no sink", spec("fp16", "per_token_head", 0)},
      {"fp8_e4m3 per_token_head", spec("fp8_e4m3")},
      {"fp8_fnuz per_block_head", spec("fp8_fnuz", "per_block_head")},
      {"int8 per_token_head", spec("int8")},
      {"int8 per_block_head", spec("int8", "per_block_head")},
      {"int8 per_tensor", spec("int8", "per_tensor")},
      {"int4", spec("int4")},
      {"int4_outlier", spec("int4_outlier")},
      {"int4_kivi recent 32", spec("int4_kivi", "per_token_head", 32, 32)},
      {"fp8_e4m3 recent 32", spec("fp8_e4m3", "per_token_head", 32, 32)},
      {"int8 hadamard", spec("int8", "per_token_head", 32, 0, "hadamard")},
  };
  std::vector<int32_t> a = window(3), b = window(4);
  a.resize(160), b.resize(120);
  b.resize(160, 7);
  for (BackendKind k : others) {
    auto dev = make(k);
    ASSERT_NE(dev, nullptr);
    for (const auto& [name, s] : specs) {
      SCOPED_TRACE(std::string(backend_name(k)) + ", " + name);
      std::unique_ptr<model::Engine> ec, ed;
      const auto lc = run(*cpu, s, {a, b}, 130, 48, &ec);
      const auto ld = run(*dev, s, {a, b}, 130, 48, &ed);
      ASSERT_TRUE(ec && ed);
      size_t at = 0;
      for (size_t w = 0; w < lc.size(); ++w) EXPECT_TRUE(same_bits(lc[w], ld[w], &at)) << "window " << w << ", logit " << at;
      for (int l = 0; l < model_->config().n_layers; ++l) {
        cache::PagedKvCache::Planes pc, pd;
        ASSERT_TRUE(ec->storage().download(l, &pc).is_ok());
        ASSERT_TRUE(ed->storage().download(l, &pd).is_ok());
        EXPECT_TRUE(same_bits(pc.k_codes, pd.k_codes, &at)) << "layer " << l << " K code byte " << at;
        EXPECT_TRUE(same_bits(pc.v_codes, pd.v_codes, &at)) << "layer " << l << " V code byte " << at;
        EXPECT_TRUE(same_bits(pc.k_scales, pd.k_scales, &at)) << "layer " << l << " K scale " << at;
        EXPECT_TRUE(same_bits(pc.v_scales, pd.v_scales, &at)) << "layer " << l << " V scale " << at;
        EXPECT_TRUE(same_bits(pc.k_sink, pd.k_sink, &at)) << "layer " << l << " K sink " << at;
        EXPECT_TRUE(same_bits(pc.v_sink, pd.v_sink, &at)) << "layer " << l << " V sink " << at;
        EXPECT_TRUE(same_bits(pc.k_outliers, pd.k_outliers, &at)) << "layer " << l << " K outliers " << at;
        EXPECT_TRUE(same_bits(pc.v_outliers, pd.v_outliers, &at)) << "layer " << l << " V outliers " << at;
      }
    }
  }
}

}  // namespace
}  // namespace kvq::backend
