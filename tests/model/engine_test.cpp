// The multi-sequence Engine on stories260K, for every available backend. The reference is always
// the CPU: a Runner (one sequence on its own CPU engine) for the batching and chunking checks, the
// README's float64 NLLs for the end-to-end check. On the CPU backend the comparisons use
// kCpuBudget; another backend (CUDA) is compared with the CPU at kOtherBudget, the CPU reference
// then using the weight dtype that backend's engine uses (bf16).
#include <gtest/gtest.h>

#include "model/stories_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend_testing.h"
#include "kvq/backend/backend.h"
#include "kvq/model/engine.h"
#include "kvq/model/model.h"

namespace kvq::model {
namespace {

using backend::BackendKind;
using cache::SeqId;

// Batched (or chunked) vs alone: every op is row-wise except the GEMMs (and prefill attention's
// blocks of queries), and OpenBLAS does not promise the same bits for a row whatever the row
// count: a 1-row product goes through sgemv (partial sums over k), a multi-row one through sgemm,
// whose kernels and thread split depend on the row count. Bitwise equality is therefore not a
// property of this engine, and neither is 1e-6: a 1-ulp difference in K or V occasionally sits
// on a rounding boundary of the cache format, and that element then takes the neighbouring code
// (bf16: 2^-8 relative; int8: amax/127), which with head_dim 8 moves later logits by up to ~1e-2
// of their scale. Measured on the CPU (2 threads or 1): without such a flip max |diff| is ~1e-6
// of max |logit|; with one, up to 8e-3 (max) and 3.5e-4 (relative L2 over all rows). The budgets:
struct Budget {
  double rel_l2;   // over every compared logit
  double max_rel;  // worst row: max |diff| / max |logit|
  double top1;     // fraction of rows whose greedy token differs (rows with a top-2 gap > 1e-2 only)
};
// CPU vs CPU: ~4-10x the worst flip measured. A sequence mix-up, a wrong position or a chunk that
// misses its own tokens moves logits by O(1) and changes the greedy token on most rows.
constexpr Budget kCpuBudget{3e-3, 3e-2, 0.0};
// Another backend vs the CPU with the same (bf16) weights: both multiply bf16 operands with fp32
// accumulation, in different orders, and may differ in rounding x to bf16 (~1e-3 per GEMM,
// compounding over 5 layers and through the cache's rounding).
constexpr Budget kOtherBudget{3e-2, 0.15, 0.02};

// Accumulates the agreement of logits rows with a reference.
struct Agreement {
  double num = 0, den = 0, max_rel = 0;
  long rows = 0, top1_diff = 0;
  void add(const float* got, const float* want, size_t n_rows, int vocab) {
    for (size_t r = 0; r < n_rows; ++r) {
      const float* g = got + r * vocab;
      const float* w = want + r * vocab;
      double d = 0, m = 0;
      int gb = 0, wb = 0;
      for (int i = 0; i < vocab; ++i) {
        const double e = double(g[i]) - w[i];
        num += e * e, den += double(w[i]) * w[i];
        d = std::max(d, std::fabs(e)), m = std::max(m, std::fabs(double(w[i])));
        if (std::isnan(g[i])) d = INFINITY;
        if (g[i] > g[gb]) gb = i;
        if (w[i] > w[wb]) wb = i;
      }
      float second = -INFINITY;
      for (int i = 0; i < vocab; ++i)
        if (i != wb) second = std::max(second, w[i]);
      if (gb != wb && w[wb] - second > 1e-2f) ++top1_diff;
      max_rel = std::max(max_rel, d / std::max(m, 1e-30));
      ++rows;
    }
  }
  double rel_l2() const { return std::sqrt(num / std::max(den, 1e-300)); }
  ::testing::AssertionResult within(const Budget& b) const {
    if (rows > 0 && rel_l2() <= b.rel_l2 && max_rel <= b.max_rel && top1_diff <= b.top1 * rows)
      return ::testing::AssertionSuccess() << describe();
    return ::testing::AssertionFailure() << describe() << " beyond the budget (rel L2 " << b.rel_l2 << ", max "
                                         << b.max_rel << ", top-1 " << b.top1 << ")";
  }
  std::string describe() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%ld rows: rel L2 %.3g, max |diff|/max |logit| %.3g, top-1 differs on %ld", rows,
                  rel_l2(), max_rel, top1_diff);
    return buf;
  }
};

using testing::stories_dir;

QuantSpec spec_of(Format f, int sink = 0, ScaleGranularity g = ScaleGranularity::kPerTokenHead) {
  QuantSpec s;
  s.format = f, s.granularity = g, s.sink_tokens = sink, s.block_size = 16;
  return s;
}

int32_t argmax(const float* x, int n) {
  int32_t b = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[b]) b = i;
  return b;
}

class EngineTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  static void SetUpTestSuite() {
    KVQ_REQUIRE_STORIES260K();  // else the suite's setup fails the binary (SetUp skips each test)
    auto m = Model::load(stories_dir() + "/stories260K.bin");
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    model_ = std::move(m).value().release();
    ids_ = new std::vector<int32_t>(testing::stories_text_ids(*model_));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete ids_;
  }
  void SetUp() override {
    KVQ_REQUIRE_STORIES260K();
    ASSERT_NE(model_, nullptr) << "stories260K did not load";
    be_ = backend::testing::shared_backend(GetParam());
    ASSERT_NE(be_, nullptr);
    cpu_ = backend::testing::shared_backend(BackendKind::kCpu);
    ASSERT_NE(cpu_, nullptr);
  }
  bool is_cpu() const { return be_->kind() == BackendKind::kCpu; }
  const Budget& budget() const { return is_cpu() ? kCpuBudget : kOtherBudget; }
  int vocab() const { return model_->config().vocab_size; }

  std::unique_ptr<Engine> engine(const QuantSpec& spec, EngineOptions o) {
    auto e = Engine::create(*model_, spec, *be_, o);
    EXPECT_TRUE(e.is_ok()) << e.status().to_string();
    return e.is_ok() ? std::move(e).value() : nullptr;
  }
  // The reference for one sequence: a Runner on the CPU (weights as the tested engine has them).
  std::unique_ptr<Runner> reference(const QuantSpec& spec, int max_tokens = 512) {
    RunnerOptions ro;
    ro.weights = is_cpu() ? WeightsDType::kAuto : WeightsDType::kBf16;
    auto r = Runner::create(*model_, spec, max_tokens, cpu_, ro);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    return r.is_ok() ? std::move(r).value() : nullptr;
  }
  // Window w of the README's setup: BOS + ids [511 w, 511 (w + 1)).
  static std::vector<int32_t> window(int w) { return testing::stories_window(*ids_, w); }
  static double nll_sum(const float* logits, const std::vector<int32_t>& toks, int vocab, long* count) {
    double total = 0;
    for (size_t t = 0; t + 1 < toks.size(); ++t) {
      const float* l = logits + t * vocab;
      double mx = l[0], s = 0;
      for (int i = 1; i < vocab; ++i) mx = std::max(mx, double(l[i]));
      for (int i = 0; i < vocab; ++i) s += std::exp(l[i] - mx);
      total += mx + std::log(s) - l[toks[t + 1]];
      ++*count;
    }
    return total;
  }

  backend::Backend* be_ = nullptr;
  backend::Backend* cpu_ = nullptr;
  static Model* model_;
  static std::vector<int32_t>* ids_;
};
Model* EngineTest::model_ = nullptr;
std::vector<int32_t>* EngineTest::ids_ = nullptr;

// (a) Four sequences forwarded together, in steps mixing prefill and decode pieces of different
// lengths (one prompt longer than a chunk, a step whose rows exceed the row budget, an empty
// step, pure decode steps that a graph-capable backend captures and replays), give the logits of
// each sequence run alone through a Runner with the same calls.
TEST_P(EngineTest, BatchedSequencesMatchEachAlone) {
  // Chunking: the default 128-token chunks with a 200-row budget (150 + 140 rows: two sub-steps),
  // and 16-token chunks with a 40-row budget (many sub-steps, pieces deferred, A's 33 tokens end
  // with a 1-token piece that takes the decode path). bf16 and per_token_head do not depend on
  // the chunking (ChunkedPromptMatchesOneCall), so both compare with the default-chunk Runner.
  struct Plan {
    int chunk, max_step;
  };
  for (const Plan plan : {Plan{128, 200}, Plan{16, 40}})
  for (const QuantSpec& spec : {spec_of(Format::kBf16, 4), spec_of(Format::kInt8, 20)}) {
    SCOPED_TRACE(spec.to_string() + " chunk " + std::to_string(plan.chunk));
    EngineOptions o;
    o.max_seqs = 4, o.max_tokens = 512, o.chunk_tokens = plan.chunk, o.max_step_tokens = plan.max_step;
    auto e = engine(spec, o);
    ASSERT_TRUE(e);
    const int V = vocab();
    // steps[s][i]: tokens of sequence s in call i (kLast for B's middle call, kAll otherwise).
    const std::vector<std::vector<int>> lens = {
        {33, 1, 1, 1, 1}, {150, 5, 1, 1, 1}, {1, 140, 1, 1, 1}, {0, 1, 1, 1, 1}};
    std::vector<SeqId> ids;
    for (int s = 0; s < 4; ++s) {
      auto id = e->add_sequence();
      ASSERT_TRUE(id.is_ok()) << id.status().to_string();
      ids.push_back(id.value());
    }
    std::vector<std::vector<int32_t>> toks(4);
    std::vector<std::vector<std::vector<float>>> got(4);  // [seq][call] logits
    std::vector<int> pos(4, 0);
    for (int s = 0; s < 4; ++s) {
      int total = 0;
      for (int n : lens[s]) total += n;
      toks[s].assign(ids_->begin() + 600 * s + 7, ids_->begin() + 600 * s + 7 + total);
    }
    for (size_t call = 0; call < lens[0].size(); ++call) {
      std::vector<SeqStep> steps;
      for (int s = 0; s < 4; ++s) {
        const int n = lens[s][call];
        const LogitsMode mode =
            n == 0 ? LogitsMode::kNone : (s == 1 && call == 1 ? LogitsMode::kLast : LogitsMode::kAll);
        got[s].emplace_back(size_t(mode == LogitsMode::kAll ? n : 1) * V, NAN);
        steps.push_back({ids[s], toks[s].data() + pos[s], n, mode, got[s].back().data()});
        pos[s] += n;
      }
      std::rotate(steps.begin(), steps.begin() + (call % 4), steps.end());  // order must not matter
      const Status st = e->forward(steps);
      ASSERT_TRUE(st.is_ok()) << "call " << call << ": " << st.to_string();
    }
    for (int s = 0; s < 4; ++s) EXPECT_EQ(e->position(ids[s]), pos[s]);

    Agreement agree;
    for (int s = 0; s < 4; ++s) {
      auto r = reference(spec);
      ASSERT_TRUE(r);
      int p = 0;
      for (size_t call = 0; call < lens[s].size(); ++call) {
        const int n = lens[s][call];
        if (n == 0) continue;
        std::vector<float> want(got[s][call].size());
        const bool last = s == 1 && call == 1;
        const Status st = last ? r->forward_last(toks[s].data() + p, n, want.data())
                               : r->forward(toks[s].data() + p, n, want.data());
        ASSERT_TRUE(st.is_ok()) << st.to_string();
        Agreement one;
        one.add(got[s][call].data(), want.data(), want.size() / V, V);
        EXPECT_TRUE(one.within(budget())) << "sequence " << s << " call " << call;
        agree.add(got[s][call].data(), want.data(), want.size() / V, V);
        p += n;
      }
    }
    std::printf("[%s %s chunk %d] batched vs alone: %s\n", backend::backend_name(GetParam()),
                spec.to_string().c_str(), plan.chunk, agree.describe().c_str());
  }
}

// (b) forward_sample picks on the backend what the host picks from forward_last's logits: greedy
// = argmax (ties to the lower id), and with temperature / top-p = sample_with_uniform with the
// same uniform. Three sequences per call: prefill, decode, then both mixed.
TEST_P(EngineTest, ForwardSampleMatchesForwardLastLogits) {
  const QuantSpec spec = spec_of(Format::kFp8E4m3, 8);
  EngineOptions o;
  o.max_seqs = 6, o.max_tokens = 256;
  auto e = engine(spec, o);
  ASSERT_TRUE(e);
  const int V = vocab();
  std::vector<SeqId> a, b;  // a: logits, b: sampled; same tokens
  for (int s = 0; s < 3; ++s) {
    a.push_back(e->add_sequence().value());
    b.push_back(e->add_sequence().value());
  }
  const std::vector<SampleParams> params = {{0.f, 1.f, 0.3}, {0.8f, 0.9f, 0.61}, {1.2f, 1.f, 0.05}};
  // Round 0 prefill (200: two chunks, sampled from the second), round 1 decode, round 2 mixed.
  const int lens[3][3] = {{50, 9, 200}, {1, 1, 1}, {1, 30, 1}};
  std::vector<int> pos(3, 0);
  for (int round = 0; round < 3; ++round) {
    std::vector<std::vector<float>> logits(3, std::vector<float>(V));
    std::vector<SeqStep> sa, sb;
    for (int s = 0; s < 3; ++s) {
      const int32_t* t = ids_->data() + 1000 * s + pos[s];
      sa.push_back({a[s], t, lens[round][s], LogitsMode::kLast, logits[s].data()});
      sb.push_back({b[s], t, lens[round][s], LogitsMode::kLast, nullptr});
      pos[s] += lens[round][s];
    }
    ASSERT_TRUE(e->forward(sa).is_ok());
    std::vector<int32_t> out(3, -1);
    const Status st = e->forward_sample(sb, params, out.data());
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    for (int s = 0; s < 3; ++s) {
      const float* l = logits[s].data();
      const int32_t want = params[s].temperature == 0.f
                               ? argmax(l, V)
                               : sample_with_uniform(l, V, params[s].temperature, params[s].top_p, params[s].uniform);
      if (is_cpu()) {
        EXPECT_EQ(out[s], want) << "round " << round << " sequence " << s;
      } else if (out[s] != want) {  // another backend: the same logits up to rounding, so only a near-tie may differ
        EXPECT_NEAR(l[out[s]], l[want], 1e-3 * (1 + std::fabs(l[want]))) << "round " << round << " sequence " << s;
      }
    }
    // Greedy through the Runner API too (the single-sequence path).
    if (round == 0) {
      auto r = reference(spec, 256);
      ASSERT_TRUE(r);
      auto id = r->forward_sample(ids_->data(), 50, SampleParams{});
      ASSERT_TRUE(id.is_ok());
      if (is_cpu()) {
        EXPECT_EQ(id.value(), argmax(logits[0].data(), V));
      }
    }
  }
  std::vector<int32_t> out(1);
  EXPECT_EQ(e->forward_sample({SeqStep{a[0], ids_->data(), 1, LogitsMode::kLast, nullptr}}, {}, out.data()).code(),
            StatusCode::kInvalidArgument);  // one SampleParams per step
}

// (c) A 300-token prompt in one call (chunks 128 + 128 + 44) and the same prompt in two calls give
// the same logits when the split changes nothing but GEMM row counts: every chunk attends over the
// cache as stored. That holds for bf16 and per_token_head at any split, for per_block_head when
// the split falls on a page boundary, and for per_tensor when the first call covers the same first
// write (128 tokens). Two splits legitimately differ, by design: per_tensor scales are fixed by the
// first write reaching the quantized pages (10 tokens instead of 128: later values clip), and
// per_block_head re-quantizes the page head that a mid-page split leaves half written when the
// next chunk brings a larger amax (one more rounding of those tokens; and the first call's last
// rows attended over that page at its smaller scale). Those are measured, printed and bounded by
// the format's accuracy (mean NLL within 0.05) instead.
TEST_P(EngineTest, ChunkedPromptMatchesOneCall) {
  const std::vector<int32_t> prompt(ids_->begin() + 3000, ids_->begin() + 3300);
  const int V = vocab();
  struct Row {
    QuantSpec spec;
    int split;
    bool exact;
  };
  const Row rows[] = {{spec_of(Format::kBf16, 0), 100, true},
                      {spec_of(Format::kInt8, 16), 100, true},
                      {spec_of(Format::kInt8, 0, ScaleGranularity::kPerTensor), 128, true},
                      {spec_of(Format::kInt8, 0, ScaleGranularity::kPerTensor), 10, false},
                      {spec_of(Format::kFp8E4m3, 0, ScaleGranularity::kPerBlockHead), 96, true},
                      {spec_of(Format::kFp8E4m3, 0, ScaleGranularity::kPerBlockHead), 100, false}};
  for (const Row& row : rows) {
    SCOPED_TRACE(row.spec.to_string() + " split " + std::to_string(row.split));
    EngineOptions o;
    o.max_seqs = 1, o.max_tokens = 512;
    // Two engines: a per_tensor scale belongs to the layer, so a second sequence of the same cache
    // would inherit the first one's.
    auto e1 = engine(row.spec, o), e2 = engine(row.spec, o);
    ASSERT_TRUE(e1 && e2);
    const SeqId one = e1->add_sequence().value(), two = e2->add_sequence().value();
    const int k = row.split;
    std::vector<float> l1(300 * size_t(V)), l2(l1.size());
    ASSERT_TRUE(e1->forward({SeqStep{one, prompt.data(), 300, LogitsMode::kAll, l1.data()}}).is_ok());
    ASSERT_TRUE(e2->forward({SeqStep{two, prompt.data(), k, LogitsMode::kAll, l2.data()}}).is_ok());
    ASSERT_TRUE(
        e2->forward({SeqStep{two, prompt.data() + k, 300 - k, LogitsMode::kAll, l2.data() + k * size_t(V)}}).is_ok());
    Agreement agree;
    agree.add(l2.data(), l1.data(), 300, V);
    long n1 = 0, n2 = 0;
    const double nll1 = nll_sum(l1.data(), prompt, V, &n1) / n1, nll2 = nll_sum(l2.data(), prompt, V, &n2) / n2;
    std::printf("[%s %s] 300 vs %d+%d: %s; mean NLL %.5f vs %.5f\n", backend::backend_name(GetParam()),
                row.spec.to_string().c_str(), k, 300 - k, agree.describe().c_str(), nll1, nll2);
    if (row.exact) {
      EXPECT_TRUE(agree.within(budget()));
      EXPECT_NEAR(nll1, nll2, 2e-4);
    } else {
      // Measured: per_tensor 10+290 moves the mean NLL by +0.026 (clipping), per_block_head
      // 100+200 by -0.003. The split does matter here (documents the design), within the formats'
      // accuracy on this model.
      EXPECT_GT(agree.rel_l2(), 1e-3);
      EXPECT_LT(std::fabs(nll1 - nll2), 0.05);
    }
  }
}

// (c2) A sequence that shares a donor's prompt prefix by reference (whole chunks, whole pages) gives
// the logits of a fresh sequence that computes the same prompt in full, allocating no page for the
// shared part; the shared pages outlive the donor.
TEST_P(EngineTest, SharedPrefixMatchesAFreshSequence) {
  const int V = vocab();
  std::vector<int32_t> prompt(ids_->begin() + 1000, ids_->begin() + 1256);  // the shared 256 tokens
  std::vector<int32_t> mine = prompt, donors = prompt;
  mine.insert(mine.end(), ids_->begin() + 5000, ids_->begin() + 5050);
  donors.insert(donors.end(), ids_->begin() + 7000, ids_->begin() + 7030);
  for (const QuantSpec& spec : {spec_of(Format::kBf16, 0), spec_of(Format::kInt8, 16),
                                spec_of(Format::kFp8E4m3, 32, ScaleGranularity::kPerBlockHead)}) {
    SCOPED_TRACE(spec.to_string());
    EngineOptions o;
    o.max_seqs = 3, o.max_tokens = 512;
    auto e = engine(spec, o);
    ASSERT_TRUE(e);
    const SeqId donor = e->add_sequence().value();
    ASSERT_TRUE(e->forward({SeqStep{donor, donors.data(), 286, LogitsMode::kNone, nullptr}}).is_ok());
    const int free0 = e->book().pool().num_free();
    const SeqId sharer = e->add_sequence_sharing(donor, 256).value();
    EXPECT_EQ(e->position(sharer), 256);
    EXPECT_EQ(e->book().pool().num_free(), free0) << "sharing allocates no page";
    ASSERT_TRUE(e->free_sequence(donor).is_ok());  // the shared pages stay with the sharer
    std::vector<float> got(50 * size_t(V)), want(got.size());
    ASSERT_TRUE(e->forward({SeqStep{sharer, mine.data() + 256, 50, LogitsMode::kAll, got.data()}}).is_ok());
    const SeqId fresh = e->add_sequence().value();
    std::vector<float> all(306 * size_t(V));
    ASSERT_TRUE(e->forward({SeqStep{fresh, mine.data(), 306, LogitsMode::kAll, all.data()}}).is_ok());
    std::copy(all.begin() + 256 * V, all.end(), want.begin());
    if (is_cpu()) {
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << "bit-identical on the CPU";
    } else {
      Agreement agree;
      agree.add(got.data(), want.data(), 50, V);
      EXPECT_TRUE(agree.within(budget())) << agree.describe();
    }
    // Sharing needs whole pages, a live donor and a length within it.
    EXPECT_EQ(e->add_sequence_sharing(fresh, 100).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(e->add_sequence_sharing(fresh, 400).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(e->add_sequence_sharing(99, 128).status().code(), StatusCode::kInvalidArgument);
  }
}

// (d) Bad requests are refused with a clear status before anything changes, and the engine keeps
// working: the sequences continue exactly as if the bad calls had not been made.
TEST_P(EngineTest, BadRequestsAreRefusedAndEngineStaysUsable) {
  const QuantSpec spec = spec_of(Format::kInt8, 16);
  EngineOptions o;
  o.max_seqs = 2, o.max_tokens = 64;
  auto e = engine(spec, o);
  ASSERT_TRUE(e);
  const int V = vocab();
  const SeqId s0 = e->add_sequence().value(), s1 = e->add_sequence().value();
  const int32_t* t = ids_->data() + 50;
  ASSERT_TRUE(e->forward({SeqStep{s0, t, 10, LogitsMode::kNone, nullptr}}).is_ok());
  auto expect = [&](const Status& st, StatusCode code, const std::string& words) {
    EXPECT_EQ(st.code(), code) << st.to_string();
    EXPECT_NE(st.message().find(words), std::string::npos) << st.to_string();
    EXPECT_EQ(e->position(s0), 10);
    EXPECT_EQ(e->position(s1), 0);
  };
  const int32_t bad_hi = V, bad_lo = -1;
  std::vector<float> sink(size_t(V) * 64);
  expect(e->forward({SeqStep{7, t, 1, LogitsMode::kNone, nullptr}}), StatusCode::kInvalidArgument, "unknown sequence");
  expect(e->forward({SeqStep{s1, t, 3, LogitsMode::kNone, nullptr}, SeqStep{s0, t, 1, LogitsMode::kNone, nullptr},
                     SeqStep{s1, t, 1, LogitsMode::kNone, nullptr}}),
         StatusCode::kInvalidArgument, "twice");
  expect(e->forward({SeqStep{s1, t, 5, LogitsMode::kAll, sink.data()}, SeqStep{s0, t, 55, LogitsMode::kNone, nullptr}}),
         StatusCode::kInvalidArgument, "capacity");
  expect(e->forward({SeqStep{s1, &bad_hi, 1, LogitsMode::kNone, nullptr}}), StatusCode::kInvalidArgument, "vocabulary");
  expect(e->forward(
             {SeqStep{s0, t, 2, LogitsMode::kNone, nullptr}, SeqStep{s1, &bad_lo, 1, LogitsMode::kNone, nullptr}}),
         StatusCode::kInvalidArgument, "vocabulary");
  expect(e->forward({SeqStep{s0, nullptr, 2, LogitsMode::kNone, nullptr}}), StatusCode::kInvalidArgument, "n >= 0");
  expect(e->add_sequence().status(), StatusCode::kOutOfMemory, "maximum of 2");
  EXPECT_FALSE(e->free_sequence(9).is_ok());

  // Still usable: continuing both sequences gives the reference's logits.
  std::vector<float> got0(size_t(V) * 5), got1(size_t(V) * 54);
  ASSERT_TRUE(e->forward({SeqStep{s0, t + 10, 5, LogitsMode::kAll, got0.data()},
                          SeqStep{s1, t, 54, LogitsMode::kAll, got1.data()}})
                  .is_ok());
  auto r = reference(spec, 64);
  ASSERT_TRUE(r);
  std::vector<float> want(size_t(V) * 64);
  ASSERT_TRUE(r->forward(t, 10, want.data()).is_ok());
  ASSERT_TRUE(r->forward(t + 10, 5, want.data()).is_ok());
  Agreement a0, a1;
  a0.add(got0.data(), want.data(), 5, V);
  EXPECT_TRUE(a0.within(budget()));
  ASSERT_TRUE(r->reset().is_ok());
  ASSERT_TRUE(r->forward(t, 54, want.data()).is_ok());
  a1.add(got1.data(), want.data(), 54, V);
  EXPECT_TRUE(a1.within(budget()));
  // A freed id is unknown; after add_sequence it starts empty.
  ASSERT_TRUE(e->free_sequence(s0).is_ok());
  EXPECT_EQ(e->forward({SeqStep{s0, t, 1, LogitsMode::kNone, nullptr}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->position(s0), -1);
  auto again = e->add_sequence();
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(e->position(again.value()), 0);
}

// Sizes from flags (issue 11): a chunk longer than the context is clamped to it (it could never be
// filled, and it sizes the scratch), and on the CPU a pool larger than this machine's memory is
// refused before anything is allocated, with the sizes named (never std::bad_alloc).
TEST_P(EngineTest, OversizedSizesAreClampedOrRefusedUpFront) {
  const QuantSpec spec = spec_of(Format::kInt8, 16);
  EngineOptions o;
  o.max_seqs = 2, o.max_tokens = 64, o.chunk_tokens = 65536;
  auto e = engine(spec, o);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->options().chunk_tokens, 64);
  EXPECT_LE(e->options().max_step_tokens, 2 * 64);
  const SeqId s0 = e->add_sequence().value();
  std::vector<float> got(size_t(vocab()) * 64);
  ASSERT_TRUE(e->forward({SeqStep{s0, ids_->data(), 64, LogitsMode::kAll, got.data()}}).is_ok());
  auto r = reference(spec, 64);
  ASSERT_TRUE(r);
  std::vector<float> want(got.size());
  ASSERT_TRUE(r->forward(ids_->data(), 64, want.data()).is_ok());
  Agreement a;
  a.add(got.data(), want.data(), 64, vocab());
  EXPECT_TRUE(a.within(budget()));

  if (!is_cpu()) GTEST_SKIP() << "the up-front memory check is the CPU backend's";
  EngineOptions big;
  big.max_seqs = 1, big.max_tokens = 64, big.num_pages = (1 << 30) - 1;  // ~8 TB of int8 pages
  auto refused = Engine::create(*model_, spec, *be_, big);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
  for (const char* words : {"1073741823 pages", "GiB", "more than this machine"})
    EXPECT_NE(refused.status().message().find(words), std::string::npos) << refused.status().to_string();
}

// A pool too small for the request fails mid-step with kOutOfMemory: the sequences of that call
// are marked broken (documented), the others are untouched, and freeing the broken one recovers.
TEST_P(EngineTest, PoolExhaustionBreaksOnlyThatCall) {
  const QuantSpec spec = spec_of(Format::kBf16, 0);
  EngineOptions o;
  o.max_seqs = 2, o.max_tokens = 256, o.num_pages = 6;  // 96 tokens of main pool for both
  auto e = engine(spec, o);
  ASSERT_TRUE(e);
  const SeqId a = e->add_sequence().value(), b = e->add_sequence().value();
  const int32_t* t = ids_->data() + 10;
  ASSERT_TRUE(e->forward({SeqStep{a, t, 40, LogitsMode::kNone, nullptr}}).is_ok());
  const Status st = e->forward({SeqStep{b, t, 90, LogitsMode::kNone, nullptr}});
  EXPECT_EQ(st.code(), StatusCode::kOutOfMemory) << st.to_string();
  EXPECT_EQ(e->forward({SeqStep{b, t, 1, LogitsMode::kNone, nullptr}}).code(), StatusCode::kInternal);
  std::vector<float> got(vocab());
  ASSERT_TRUE(e->forward({SeqStep{a, t + 40, 1, LogitsMode::kLast, got.data()}}).is_ok());
  auto r = reference(spec, 256);
  ASSERT_TRUE(r);
  std::vector<float> want(vocab());
  ASSERT_TRUE(r->forward(t, 40, nullptr).is_ok());
  ASSERT_TRUE(r->forward_last(t + 40, 1, want.data()).is_ok());
  Agreement agree;
  agree.add(got.data(), want.data(), 1, vocab());
  EXPECT_TRUE(agree.within(budget()));
  ASSERT_TRUE(e->free_sequence(b).is_ok());
  const SeqId c = e->add_sequence().value();
  EXPECT_TRUE(e->forward({SeqStep{c, t, 40, LogitsMode::kNone, nullptr}}).is_ok());
}

// (e) The README's reference NLLs through the Engine, four windows per batch: windows 0-3 as four
// 512-token prefills in one call; windows 4-7 as 400-token prefills in one call, then the last
// 112 tokens as batched decode steps of four sequences.
TEST_P(EngineTest, ReferenceNllWithFourSequencesBatched) {
  const int V = vocab();
  EngineOptions o;
  o.max_seqs = 4, o.max_tokens = 512;
  auto e = engine(spec_of(Format::kBf16), o);
  ASSERT_TRUE(e);
  double total = 0, total0 = 0;
  long count = 0, count0 = 0;
  for (int batch = 0; batch < 2; ++batch) {
    std::vector<SeqId> ids;
    std::vector<std::vector<int32_t>> win;
    std::vector<std::vector<float>> logits;
    for (int s = 0; s < 4; ++s) {
      ids.push_back(e->add_sequence().value());
      win.push_back(window(4 * batch + s));
      logits.emplace_back(win.back().size() * size_t(V));
    }
    const int head = batch == 0 ? 512 : 400;
    std::vector<SeqStep> steps;
    for (int s = 0; s < 4; ++s) steps.push_back({ids[s], win[s].data(), head, LogitsMode::kAll, logits[s].data()});
    ASSERT_TRUE(e->forward(steps).is_ok());
    for (int t = head; t < 512; ++t) {
      steps.clear();
      for (int s = 0; s < 4; ++s)
        steps.push_back({ids[s], win[s].data() + t, 1, LogitsMode::kAll, logits[s].data() + size_t(t) * V});
      ASSERT_TRUE(e->forward(steps).is_ok()) << "decode position " << t;
    }
    for (int s = 0; s < 4; ++s) {
      total += nll_sum(logits[s].data(), win[s], V, &count);
      if (batch == 0 && s == 0) total0 = nll_sum(logits[s].data(), win[s], V, &count0);
      ASSERT_TRUE(e->free_sequence(ids[s]).is_ok());
    }
  }
  const double nll = total / count, nll0 = total0 / count0;
  std::printf("[%s] stories260K through the engine, bf16 cache: window 0 NLL %.5f (ref 1.31121), windows 0-7 %.5f "
              "(ref 1.38709)\n",
              backend::backend_name(GetParam()), nll0, nll);
  // CPU: 1e-3 as in stories_test (bf16 rounding of K/V moves window 0 by ~9e-4 vs the float64
  // reference). Another backend with bf16 weights: the acceptance, perplexity within 0.2%
  // of the CPU engine's (|delta NLL| <= 2e-3), on top of that.
  const double slack = is_cpu() ? 1e-3 : 3e-3;
  EXPECT_NEAR(nll0, 1.31121, slack);
  EXPECT_NEAR(nll, 1.38709, slack);
}

// The CPU engine can also run with bf16 weights (the CUDA engine's default, and the CPU reference
// the CUDA engine is compared with): window 0 stays close to the float64 reference and differs
// from the fp32-weight engine (the bf16 path is really taken).
TEST_P(EngineTest, Bf16WeightsStayClose) {
  if (!is_cpu()) GTEST_SKIP() << "a CPU-only check";
  const auto w = window(0);
  double nll[2];
  for (int bf16 = 0; bf16 < 2; ++bf16) {
    EngineOptions o;
    o.max_seqs = 1, o.max_tokens = 512, o.weights = bf16 ? WeightsDType::kBf16 : WeightsDType::kF32;
    auto e = engine(spec_of(Format::kBf16), o);
    ASSERT_TRUE(e);
    std::vector<float> logits(w.size() * size_t(vocab()));
    const SeqId s = e->add_sequence().value();
    ASSERT_TRUE(e->forward({SeqStep{s, w.data(), 512, LogitsMode::kAll, logits.data()}}).is_ok());
    long n = 0;
    nll[bf16] = nll_sum(logits.data(), w, vocab(), &n) / n;
  }
  std::printf("[cpu] window 0, bf16 cache: NLL %.5f with fp32 weights, %.5f with bf16 weights (reference 1.31121)\n",
              nll[0], nll[1]);
  EXPECT_NEAR(nll[1], 1.31121, 5e-3);
  EXPECT_GT(std::fabs(nll[1] - nll[0]), 1e-5) << "bf16 weights had no effect: were they used?";
}

// (g) The bf16 recent window (QuantSpec::recent_tokens) is a per-query rule, so chunked prefill
// (chunks of 7 and 64, through the prefill op) gives the logits of token-by-token decode (chunk 1,
// through the decode op), and a window covering the whole context reads every main token in bf16:
// the bf16 cache's attention. The window must also change the logits of a quantized cache.
TEST_P(EngineTest, RecentWindowChunkingMatchesTokenByToken) {
  const std::vector<int32_t> prompt(ids_->begin() + 5000, ids_->begin() + 5200);
  const int V = vocab(), n = static_cast<int>(prompt.size());
  auto run = [&](QuantSpec spec, int recent, int chunk, std::vector<float>& logits) {
    spec.recent_tokens = recent;
    EngineOptions o;
    o.max_seqs = 1, o.max_tokens = 256, o.chunk_tokens = chunk;
    auto e = engine(spec, o);
    ASSERT_TRUE(e);
    const SeqId s = e->add_sequence().value();
    logits.assign(size_t(n) * V, NAN);
    ASSERT_TRUE(e->forward({SeqStep{s, prompt.data(), n, LogitsMode::kAll, logits.data()}}).is_ok());
  };
  // per_token_head only: per_block_head growth and the per_tensor first write make the codes
  // themselves depend on the chunking (ChunkedPromptMatchesOneCall), with or without a window.
  // int4_kivi (fp16 parameters, as parse_quant_spec sets them): its pages are quantized from the
  // twins as they leave the window, so its codes do not depend on the chunking either.
  QuantSpec kivi = spec_of(Format::kInt4Kivi, 16);
  kivi.scale_dtype = ScaleDtype::kFp16;
  const QuantSpec specs[] = {spec_of(Format::kFp8E4m3, 16), spec_of(Format::kInt8, 0), kivi};
  for (const QuantSpec& spec : specs) {
    SCOPED_TRACE(spec.to_string());
    std::vector<float> by_token, chunked, off;
    ASSERT_NO_FATAL_FAILURE(run(spec, 40, 1, by_token));
    for (int chunk : {7, 64}) {
      ASSERT_NO_FATAL_FAILURE(run(spec, 40, chunk, chunked));
      Agreement agree;
      agree.add(chunked.data(), by_token.data(), size_t(n), V);
      std::printf("[%s %s] recent 40, chunk %d vs 1: %s\n", backend::backend_name(GetParam()), spec.to_string().c_str(),
                  chunk, agree.describe().c_str());
      EXPECT_TRUE(agree.within(budget())) << "chunk " << chunk;
    }
    if (spec.format == Format::kInt4Kivi) continue;  // its window cannot be off
    ASSERT_NO_FATAL_FAILURE(run(spec, 0, 64, off));
    Agreement moved;
    moved.add(off.data(), by_token.data(), size_t(n), V);
    std::printf("[%s %s] recent 0 vs 40: %s\n", backend::backend_name(GetParam()), spec.to_string().c_str(),
                moved.describe().c_str());
    EXPECT_GT(moved.rel_l2(), 1e-4) << "the window changed nothing";
  }
  std::vector<float> whole, bf16;
  ASSERT_NO_FATAL_FAILURE(run(spec_of(Format::kFp8E4m3, 16), 256, 64, whole));
  ASSERT_NO_FATAL_FAILURE(run(spec_of(Format::kBf16, 16), 0, 64, bf16));
  Agreement same;
  same.add(whole.data(), bf16.data(), size_t(n), V);
  std::printf("[%s] fp8 recent 256 vs bf16: %s\n", backend::backend_name(GetParam()), same.describe().c_str());
  EXPECT_TRUE(same.within(budget()));
  // Measured on the CPU: identical bits (the codes part is empty, the twins hold bf16(K), bf16(V)).
  EXPECT_LT(same.rel_l2(), 1e-4) << "a window over the whole context is the bf16 cache, up to float rounding";
}

INSTANTIATE_TEST_SUITE_P(AllBackends, EngineTest, ::testing::ValuesIn(backend::available_backends()),
                         [](const ::testing::TestParamInfo<BackendKind>& info) {
                           return std::string(backend::backend_name(info.param));
                         });

// Without a GPU (or without CUDA in the build) the CUDA backend is refused with the reason, and
// the suite above simply has no cuda instance.
TEST(EngineBackends, CudaAbsentIsExplained) {
  const auto kinds = backend::available_backends();
  ASSERT_FALSE(kinds.empty());
  EXPECT_EQ(kinds[0], BackendKind::kCpu);
  if (std::find(kinds.begin(), kinds.end(), BackendKind::kCuda) != kinds.end()) GTEST_SKIP() << "CUDA is available";
  auto b = backend::create_backend(BackendKind::kCuda);
  EXPECT_EQ(b.status().code(), StatusCode::kUnsupported);
  EXPECT_FALSE(b.status().message().empty());
  auto r = backend::resolve_backend("auto");
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r.value(), BackendKind::kCpu);
}

}  // namespace
}  // namespace kvq::model
