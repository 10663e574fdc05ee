// End to end on stories260K (a real 260K-parameter Llama): the bf16 baseline must reproduce the
// reference NLLs published with the model (README in shared/models/stories260K, from an
// independent float64 implementation), and the eval's bookkeeping must match logits computed
// directly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "kvq/eval/eval.h"
#include "kvq/eval/gate.h"
#include "kvq/eval/metrics.h"
#include "kvq/eval/report.h"
#include "kvq/model/model.h"
#include "model/stories_data.h"

namespace kvq::eval {
namespace {

const std::string kDir = kvq::model::stories260k_dir() + "/";

class StoriesEval : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::ifstream f(kDir + "tinystories_valid_head.txt", std::ios::binary);
    if (!f) return;
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    auto m = model::Model::load(kDir + "stories260K.bin");
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    model_ = std::move(m).value().release();
    // The reference setup: the first 40,000 characters, tokenized without BOS.
    ids_ = new std::vector<int32_t>(model_->tokenizer().encode(text.substr(0, 40000), false));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete ids_;
    model_ = nullptr;
    ids_ = nullptr;
  }
  void SetUp() override {
    KVQ_REQUIRE_STORIES260K();
    ASSERT_NE(model_, nullptr) << "stories260K is in " << kDir << " but did not load";
  }
  static EvalOptions ref_options() {
    EvalOptions o;
    o.ctx = 512;  // BOS + 511 text tokens, as in the reference
    o.max_windows = 8;
    o.chunk_tokens = 96;  // not a divisor of 512: chunk boundaries must not matter
    return o;
  }
  static SpecRequest request(const std::string& label, Format f) {
    SpecRequest r;
    r.label = label;
    r.spec.format = f;
    r.spec.sink_tokens = 0;  // the windows are short; make every token quantized
    return r;
  }
  static inline model::Model* model_ = nullptr;
  static inline std::vector<int32_t>* ids_ = nullptr;
};

TEST_F(StoriesEval, BaselineMatchesReferenceNll) {
  ASSERT_TRUE(model_->config().add_bos);
  auto rep = run_eval(*model_, *ids_, {request("bf16", Format::kBf16)}, ref_options());
  ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
  const SpecResult& b = rep.value().baseline;
  ASSERT_EQ(rep.value().num_windows, 8);
  ASSERT_EQ(b.window_nll.size(), 8u);
  EXPECT_EQ(b.predictions, 8 * 511);
  // Reference values: window 0 mean NLL 1.31121, windows 0-7 1.38709 (README). The bf16 cache
  // alone moves window 0 by about +9e-4; with 96-token chunks the fp32 K/V of later chunks differ in
  // the last bits (other sgemm blocking), which flips a few bf16 roundings and moves it to +1.1e-3
  // (measured on this reference setup, identical before and after the backend seam).
  EXPECT_NEAR(b.window_nll[0], 1.31121, 1.5e-3);
  EXPECT_NEAR(b.nll, 1.38709, 1e-3);
  // bf16 requested explicitly is the baseline row, compared with itself.
  ASSERT_EQ(rep.value().results.size(), 1u);
  EXPECT_TRUE(rep.value().results[0].is_baseline);
  EXPECT_EQ(rep.value().results[0].top1, 1.0);
  EXPECT_EQ(rep.value().results[0].kl_mean, 0.0);
}

// Windows forwarded together in one engine step (the GPU default) give the same numbers as one at a
// time: a sequence's result does not depend on which others share its step.
TEST_F(StoriesEval, WindowsInFlightDoNotChangeResults) {
  EvalOptions o = ref_options();
  o.max_windows = 5;
  std::vector<SpecRequest> reqs = {request("int8", Format::kInt8), request("fp8", Format::kFp8E4m3)};
  o.windows_in_flight = 1;
  auto one = run_eval(*model_, *ids_, reqs, o);
  o.windows_in_flight = 3;  // groups of 3 and 2
  auto three = run_eval(*model_, *ids_, reqs, o);
  ASSERT_TRUE(one.is_ok() && three.is_ok());
  ASSERT_EQ(one.value().results.size(), three.value().results.size());
  for (size_t k = 0; k < one.value().results.size(); ++k) {
    const SpecResult& a = one.value().results[k];
    const SpecResult& b = three.value().results[k];
    ASSERT_EQ(a.window_nll.size(), 5u);
    ASSERT_EQ(b.window_nll.size(), 5u);
    for (size_t w = 0; w < 5; ++w) EXPECT_NEAR(a.window_nll[w], b.window_nll[w], 1e-9) << a.label << " window " << w;
    EXPECT_NEAR(a.kl_mean, b.kl_mean, 1e-9) << a.label;
    EXPECT_EQ(a.predictions, b.predictions);
  }
}

TEST_F(StoriesEval, QuantizedSpecsAgainstDirectLogits) {
  EvalOptions o = ref_options();
  o.max_windows = 2;
  std::vector<SpecRequest> reqs = {request("fp8", Format::kFp8E4m3), request("int8", Format::kInt8)};
  auto rep = run_eval(*model_, *ids_, reqs, o);
  ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
  const auto& rows = rep.value().results;
  ASSERT_EQ(rows.size(), 3u);  // baseline first, then the requests in order

  auto windows = eval_windows(*model_, *ids_, o);
  ASSERT_TRUE(windows.is_ok());
  const int vocab = model_->config().vocab_size;
  for (size_t k = 1; k < rows.size(); ++k) {
    const SpecResult& r = rows[k];
    ASSERT_TRUE(r.error.empty()) << r.error;
    // Recompute the metrics from whole-window logits (one forward call, no chunking).
    Accumulator acc;
    PositionBuckets buckets;
    for (const auto& w : windows.value()) {
      // Same chunking as the eval, so the logits are the same bits and the tolerances can be tight.
      auto base = compute_logits(*model_, baseline_spec(), w.tokens, o.chunk_tokens);
      auto spec = compute_logits(*model_, r.spec, w.tokens, o.chunk_tokens);
      ASSERT_TRUE(base.is_ok() && spec.is_ok());
      for (int p = 0; p + 1 < static_cast<int>(w.tokens.size()); ++p) {
        const float* b = base.value().data() + static_cast<size_t>(p) * vocab;
        const float* s = spec.value().data() + static_cast<size_t>(p) * vocab;
        RowComparison c;
        c.base_nll = token_nll(b, vocab, w.tokens[p + 1]);
        c.spec_nll = token_nll(s, vocab, w.tokens[p + 1]);
        c.kl = kl_divergence(b, s, vocab);
        c.top1_agree = argmax(b, vocab) == argmax(s, vocab);
        acc.add(c);
        buckets.add(p, c);
      }
    }
    EXPECT_EQ(r.predictions, acc.count);
    EXPECT_NEAR(r.nll, acc.spec_mean_nll(), 1e-12) << r.label;
    EXPECT_NEAR(rep.value().baseline.nll, acc.base_mean_nll(), 1e-12);
    EXPECT_NEAR(r.kl_mean, acc.mean_kl(), 1e-14) << r.label;
    EXPECT_EQ(r.top1, acc.top1_rate()) << r.label;
    // 512-token windows reach the first two position buckets only.
    const auto want_buckets = buckets.results();
    ASSERT_EQ(r.buckets.size(), want_buckets.size());
    for (size_t b = 0; b < want_buckets.size(); ++b) {
      EXPECT_EQ(r.buckets[b].predictions, want_buckets[b].predictions) << want_buckets[b].name;
      if (want_buckets[b].predictions == 0) continue;
      EXPECT_NEAR(r.buckets[b].kl_mean, want_buckets[b].kl_mean, 1e-14) << want_buckets[b].name;
      EXPECT_NEAR(r.buckets[b].nll_delta, want_buckets[b].nll_delta, 1e-12) << want_buckets[b].name;
    }
    EXPECT_EQ(r.buckets[0].predictions, 2 * 256);
    EXPECT_EQ(r.buckets[1].predictions, 2 * 255);
    // A quantized cache changes the distributions, but only a little.
    EXPECT_GT(r.kl_mean, 0.0) << r.label;
    EXPECT_LT(r.kl_mean, 0.1) << r.label;
    EXPECT_GT(r.top1, 0.8) << r.label;
    EXPECT_NEAR(r.delta_ppl_pct, 100.0 * (std::exp(r.nll - rep.value().baseline.nll) - 1.0), 1e-9);
    EXPECT_LT(r.bytes_per_token, rep.value().baseline.bytes_per_token);
    EXPECT_GT(r.saving_pct, 0.0);
    EXPECT_GT(r.tokens_per_s, 0.0);
  }
  // Fixed-width and Markdown tables carry every row.
  for (bool md : {false, true}) {
    std::string t = format_table(rep.value(), md);
    EXPECT_NE(t.find("bf16 (baseline)"), std::string::npos);
    EXPECT_NE(t.find("fp8_e4m3"), std::string::npos);
    EXPECT_NE(t.find("int8"), std::string::npos);
  }
  EXPECT_NE(report_json(rep.value(), ReportContext{}).find("\"window_nll\""), std::string::npos);
  EXPECT_NE(report_json(rep.value(), ReportContext{}).find("\"position_buckets\""), std::string::npos);
  EXPECT_NE(format_table(rep.value(), false).find("KL 256-1k"), std::string::npos);
}

// The Hadamard rotation is orthogonal: with a bf16 cache it changes the logits only by rounding,
// while an int8 cache with rotation still runs end to end and stays close to the baseline.
TEST_F(StoriesEval, HadamardRotationKeepsAttention) {
  EvalOptions o = ref_options();
  o.max_windows = 1;
  SpecRequest bf = request("bf16:hadamard", Format::kBf16), i8 = request("int8:hadamard", Format::kInt8);
  bf.spec.rotation = i8.spec.rotation = KvRotation::kHadamard;
  auto rep = run_eval(*model_, *ids_, {bf, i8}, o);
  ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
  const auto& rows = rep.value().results;
  ASSERT_EQ(rows.size(), 3u);
  ASSERT_TRUE(rows[1].error.empty()) << rows[1].error;
  ASSERT_TRUE(rows[2].error.empty()) << rows[2].error;
  EXPECT_FALSE(rows[1].is_baseline);  // a rotated bf16 cache is a different cache
  EXPECT_GT(rows[1].kl_mean, 0.0);
  // Measured 3.0e-4 / -0.06% (head size 8: bf16 rounds the rotated K differently); a rotation of
  // K without the matching one of Q scrambles the scores and costs orders of magnitude more.
  EXPECT_LT(rows[1].kl_mean, 2e-3);
  EXPECT_LT(std::fabs(rows[1].delta_ppl_pct), 0.5);
  EXPECT_LT(rows[2].kl_mean, 0.05);
  EXPECT_NE(rows[2].spec.to_string().find("/hadamard"), std::string::npos);
}

// int4 (two codes per byte) runs end to end through the engine, with and without the rotation,
// and so does int4_outlier: finite, clearly worse than int8 (so the cache really is 4-bit) and
// still bounded; the outlier planes do not make int4 worse.
TEST_F(StoriesEval, Int4RunsEndToEnd) {
  EvalOptions o = ref_options();
  o.max_windows = 1;
  SpecRequest i8 = request("int8", Format::kInt8), i4 = request("int4", Format::kInt4),
              i4h = request("int4:hadamard", Format::kInt4), i4o = request("int4_outlier", Format::kInt4);
  i4h.spec.rotation = KvRotation::kHadamard;
  i4o.spec.outliers = true;
  auto rep = run_eval(*model_, *ids_, {i8, i4, i4h, i4o}, o);
  ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
  const auto& rows = rep.value().results;
  ASSERT_EQ(rows.size(), 5u);
  for (size_t i = 1; i < rows.size(); ++i) {
    ASSERT_TRUE(rows[i].error.empty()) << rows[i].error;
    EXPECT_TRUE(std::isfinite(rows[i].delta_ppl_pct)) << rows[i].label;
    EXPECT_TRUE(std::isfinite(rows[i].kl_mean)) << rows[i].label;
    std::printf("%-14s dPPL %+.3f%%  KL %.3e\n", rows[i].label.c_str(), rows[i].delta_ppl_pct, rows[i].kl_mean);
  }
  EXPECT_GT(rows[2].kl_mean, 4 * rows[1].kl_mean);  // 4 bits cost more than 8
  // Head size 8 leaves a per-token int4 scale 8 values to serve: measured +161% / KL 0.94 (int4),
  // +60% / 0.46 (with the rotation), +72% / 0.47 (int4_outlier, per-channel K); int8 +0.3% / 1.7e-3.
  for (size_t i = 2; i < rows.size(); ++i) {
    EXPECT_LT(std::fabs(rows[i].delta_ppl_pct), 300.0) << rows[i].label;
    EXPECT_LT(rows[i].kl_mean, 1.5) << rows[i].label;
  }
  EXPECT_LT(rows[3].kl_mean, 0.75 * rows[2].kl_mean) << "the rotation spreads the outlier channels";
  EXPECT_LE(rows[4].kl_mean, rows[2].kl_mean) << "the outlier planes never make int4 worse";
}

// int4_kivi runs end to end with a window of one page (so nearly every key is read from codes):
// finite, bounded, and far better than per-token int4 at head size 8, since a per-channel K
// scale and zero point follow each channel's own range. Measured (2 windows, this machine):
// int4 +38% / KL 0.99, int4_kivi:b16:recent16 -0.5% / KL 3.2e-3.
TEST_F(StoriesEval, Int4KiviRunsEndToEnd) {
  EvalOptions o = ref_options();
  o.max_windows = 1;
  SpecRequest i4 = request("int4", Format::kInt4), kivi = request("int4_kivi:recent16", Format::kInt4Kivi);
  kivi.spec.scale_dtype = ScaleDtype::kFp16;
  kivi.spec.recent_tokens = 16;
  auto rep = run_eval(*model_, *ids_, {i4, kivi}, o);
  ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
  const auto& rows = rep.value().results;
  ASSERT_EQ(rows.size(), 3u);
  for (size_t i = 1; i < rows.size(); ++i) {
    ASSERT_TRUE(rows[i].error.empty()) << rows[i].error;
    EXPECT_TRUE(std::isfinite(rows[i].delta_ppl_pct)) << rows[i].label;
    std::printf("%-20s dPPL %+.3f%%  KL %.3e\n", rows[i].label.c_str(), rows[i].delta_ppl_pct, rows[i].kl_mean);
  }
  EXPECT_LT(std::fabs(rows[2].delta_ppl_pct), 5.0);
  EXPECT_GT(rows[2].kl_mean, 0.0) << "the codes were read";
  EXPECT_LT(rows[2].kl_mean, 0.1 * rows[1].kl_mean);
}

TEST_F(StoriesEval, AutoFollowsTheGate) {
  EvalOptions o = ref_options();
  o.max_windows = 1;
  o.gate_pct = 0.0;  // the strictest gate: a candidate passes only if it does not raise perplexity
  SpecRequest a;
  a.label = "auto";
  a.is_auto = true;
  a.spec.sink_tokens = 0;
  a.auto_chain = auto_fallback_chain(a.spec);
  // int8 is not requested: when fp8 fails, auto must evaluate it in a pass of its own.
  std::vector<EvalProgress> events;
  auto rep = run_eval(*model_, *ids_, {a, request("fp8", Format::kFp8E4m3)}, o,
                      [&](const EvalProgress& e) { events.push_back(e); });
  ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
  auto int8 = run_eval(*model_, *ids_, {request("int8", Format::kInt8)}, o);
  ASSERT_TRUE(int8.is_ok());
  const auto& rows = rep.value().results;
  ASSERT_EQ(rows.size(), 3u);
  const double fp8_d = rows[2].delta_ppl_pct, int8_d = int8.value().results[1].delta_ppl_pct;
  const Format want = fp8_d <= 0 ? Format::kFp8E4m3 : int8_d <= 0 ? Format::kInt8 : Format::kBf16;
  EXPECT_EQ(rows[1].spec.format, want);
  EXPECT_TRUE(rows[1].spec.from_auto);
  EXPECT_TRUE(rows[1].gate_pass);
  EXPECT_EQ(rows[1].label, "auto");
  if (want == Format::kInt8) {
    EXPECT_DOUBLE_EQ(rows[1].delta_ppl_pct, int8_d);  // same windows, same result
  }
  ASSERT_FALSE(rep.value().notes.empty());
  EXPECT_NE(rep.value().notes.back().find("chose"), std::string::npos);
  bool second_pass = false;
  for (const auto& e : events) second_pass = second_pass || e.pass == 2;
  EXPECT_EQ(second_pass, fp8_d > 0);
  if (fp8_d > 0) {
    EXPECT_NE(rep.value().notes.front().find("falling back to int8"), std::string::npos);
  }
}

// Auto's later passes recompute the baseline and compare against the first pass's numbers; that
// needs a forward pass that gives the same bits every time.
TEST_F(StoriesEval, ForwardIsDeterministic) {
  auto windows = eval_windows(*model_, *ids_, ref_options());
  ASSERT_TRUE(windows.is_ok());
  const auto& tok = windows.value()[1].tokens;
  QuantSpec fp8;
  fp8.format = Format::kFp8E4m3;
  for (const QuantSpec& s : {baseline_spec(), fp8}) {
    auto a = compute_logits(*model_, s, tok, 96);
    auto b = compute_logits(*model_, s, tok, 96);
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    EXPECT_EQ(a.value(), b.value()) << s.to_string();
  }
}

TEST_F(StoriesEval, BadOptionsAreErrors) {
  EvalOptions o = ref_options();
  o.ctx = 4096;  // beyond the model's 512
  auto rep = run_eval(*model_, *ids_, {request("fp8", Format::kFp8E4m3)}, o);
  EXPECT_EQ(rep.status().code(), StatusCode::kInvalidArgument);
  o = ref_options();
  EXPECT_EQ(run_eval(*model_, *ids_, {}, o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvq::eval
