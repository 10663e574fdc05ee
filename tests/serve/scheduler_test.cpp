// Scheduler: admission by pages, preemption by recompute under a tiny pool, cancellation, and
// outputs identical to the same prompt run alone (greedy and seeded sampling).
#include "kvq/serve/scheduler.h"

#include <gtest/gtest.h>

#include <map>

#include "serve/serve_test_util.h"
#include "model/stories_data.h"

namespace kvq::serve {
namespace {

using testing::prompt_ids;
using testing::run_alone;
using testing::spec;
using testing::stories;

struct Outcome {
  std::vector<int32_t> tokens;
  Finish finish = Finish::kNone;
  int done_events = 0;
};

struct Harness {
  std::unique_ptr<backend::Backend> be;
  std::unique_ptr<model::Engine> engine;
  std::unique_ptr<Scheduler> sched;
  std::map<RequestId, Outcome> out;

  Harness(const QuantSpec& s, int max_seqs, int num_pages, int num_sink_pages = 0, SchedulerOptions so = {}) {
    be = std::move(backend::create_backend(backend::BackendKind::kCpu).value());
    model::EngineOptions eo;
    eo.max_seqs = max_seqs;
    eo.num_pages = num_pages;
    eo.batch_invariant = true;  // bit-identical to the same prompt run alone
    eo.num_sink_pages = num_sink_pages;
    auto e = model::Engine::create(stories(), s, *be, eo);
    EXPECT_TRUE(e.is_ok()) << e.status().to_string();
    engine = std::move(e).value();
    auto sc = Scheduler::create(*engine, so);
    EXPECT_TRUE(sc.is_ok()) << sc.status().to_string();
    sched = std::move(sc).value();
  }
  RequestId add(const std::vector<int32_t>& prompt, SamplingParams p) {
    auto holder = std::make_shared<RequestId>(0);
    auto id = sched->submit(prompt, p, [this, holder](const Event& e) {
      Outcome& o = out[*holder];
      if (e.token >= 0) o.tokens.push_back(e.token);
      if (e.done) {
        o.finish = e.finish;
        ++o.done_events;
      }
    });
    EXPECT_TRUE(id.is_ok()) << id.status().to_string();
    *holder = id.value();
    return id.value();
  }
  void drain(int max_steps = 100000) {
    for (int i = 0; i < max_steps && !sched->idle(); ++i) {
      auto r = sched->step();
      ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    }
    ASSERT_TRUE(sched->idle());
  }
};

TEST(Scheduler, GreedyBatchedEqualsAlone) {
  KVQ_REQUIRE_STORIES260K();
  const QuantSpec s = spec(Format::kInt8, 32);
  Harness h(s, 8, 0);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<RequestId> ids;
  for (int i = 0; i < 8; ++i) {
    prompts.push_back(prompt_ids(i, 20 + 37 * i));  // 20 .. 279 tokens: several prefill chunks
    SamplingParams p;
    p.max_tokens = 40;
    ids.push_back(h.add(prompts.back(), p));
  }
  h.drain();
  for (int i = 0; i < 8; ++i) {
    const Outcome& o = h.out[ids[size_t(i)]];
    EXPECT_EQ(o.done_events, 1);
    EXPECT_TRUE(o.finish == Finish::kLength || o.finish == Finish::kStop);
    EXPECT_EQ(o.tokens, run_alone(s, prompts[size_t(i)], 40)) << "request " << i;
  }
  EXPECT_EQ(h.sched->counters().preemptions, 0u);
  EXPECT_GT(h.sched->counters().max_running, 4);
  EXPECT_EQ(h.engine->book().pool().num_free(), h.engine->book().pool().num_pages());
  EXPECT_EQ(h.engine->book().sink_pool().num_free(), h.engine->book().sink_pool().num_pages());
}

TEST(Scheduler, SeededSamplingEqualsAlone) {
  KVQ_REQUIRE_STORIES260K();
  const QuantSpec s = spec(Format::kFp8E4m3, 16);
  Harness h(s, 4, 0);
  std::vector<RequestId> ids;
  for (int i = 0; i < 4; ++i) {
    SamplingParams p;
    p.max_tokens = 30;
    p.temperature = 0.9f;
    p.top_p = i % 2 ? 0.8f : 1.f;
    p.seed = 1000 + static_cast<uint64_t>(i);
    ids.push_back(h.add(prompt_ids(i, 50), p));
  }
  h.drain();
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(h.out[ids[size_t(i)]].tokens, run_alone(s, prompt_ids(i, 50), 30, 0.9f, i % 2 ? 0.8f : 1.f, 1000 + i));
}

TEST(Scheduler, PreemptsUnderATinyPoolAndStillMatches) {
  KVQ_REQUIRE_STORIES260K();
  // 16 sink tokens (1 sink page) and 24 main pages of 16 tokens: two long requests fit, not eight.
  const QuantSpec s = spec(Format::kInt8, 16);
  for (bool exact : {true, false}) {
    SchedulerOptions so;
    so.exact_recompute = exact;
    Harness h(s, 8, 24, 0, so);
    std::vector<RequestId> ids;
    for (int i = 0; i < 8; ++i) {
      SamplingParams p;
      p.max_tokens = 60;
      p.stop_at_eos = false;
      ids.push_back(h.add(prompt_ids(i + 20, 90 + 10 * i), p));
    }
    h.drain();
    const SchedulerCounters c = h.sched->counters();
    EXPECT_GT(c.preemptions, 0u) << "the pool should be too small for all requests at once";
    EXPECT_EQ(c.finished, 8u);
    EXPECT_EQ(c.failed, 0u);
    for (int i = 0; i < 8; ++i) {
      const Outcome& o = h.out[ids[size_t(i)]];
      EXPECT_EQ(o.finish, Finish::kLength);
      ASSERT_EQ(o.tokens.size(), 60u);
      if (exact) {
        EXPECT_EQ(o.tokens, run_alone(s, prompt_ids(i + 20, 90 + 10 * i), 60)) << "request " << i;
      }
    }
    EXPECT_EQ(h.engine->book().pool().num_free(), 24);
  }
}

// Requests with a common 256-token prompt prefix (two prefill chunks) share the first one's pages:
// they wait for them to be computed, compute only their own tails, give exactly what each gives run
// alone, and the pool holds the prefix once. Also under a pool small enough to preempt.
TEST(Scheduler, SharedPrefixIsComputedOnceAndChangesNothing) {
  KVQ_REQUIRE_STORIES260K();
  const QuantSpec s = spec(Format::kFp8E4m3, 32);
  const std::vector<int32_t> system = prompt_ids(3, 255);  // BOS + 255 tokens
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> p = system;
    const std::vector<int32_t> tail = prompt_ids(40 + i, 20 + 10 * i);
    p.insert(p.end(), tail.begin() + 1, tail.end());
    prompts.push_back(p);
  }
  auto run = [&](bool sharing, int num_pages, SchedulerCounters* counters) {
    SchedulerOptions so;
    so.prefix_sharing = sharing;
    Harness h(s, 6, num_pages, 0, so);
    std::vector<RequestId> ids;
    for (int i = 0; i < 6; ++i) {
      SamplingParams p;
      p.max_tokens = i == 0 ? 4 : 30;  // the first request (the pages' owner) finishes first
      ids.push_back(h.add(prompts[size_t(i)], p));
    }
    h.drain();
    *counters = h.sched->counters();
    std::vector<std::vector<int32_t>> out;
    for (RequestId id : ids) out.push_back(h.out[id].tokens);
    EXPECT_EQ(h.engine->book().pool().num_free(), h.engine->book().pool().num_pages()) << "every page back";
    return out;
  };
  SchedulerCounters with{}, without{}, tight{};
  const auto shared = run(true, 0, &with);
  const auto plain = run(false, 0, &without);
  for (int i = 0; i < 6; ++i) {
    const auto alone = run_alone(s, prompts[size_t(i)], i == 0 ? 4 : 30, 0.f, 1.f, 0);
    EXPECT_EQ(shared[size_t(i)], alone) << "request " << i;
    EXPECT_EQ(plain[size_t(i)], alone) << "request " << i;
  }
  EXPECT_EQ(with.prefix_hits, 5u);
  EXPECT_EQ(with.prefix_shared_tokens, 5u * 256u);
  EXPECT_EQ(without.prefix_hits, 0u);
  // 256 shared tokens = 32 sink tokens (2 sink pages) + 224 main tokens (14 pages): five requests
  // share them, held once, so at least four copies (56 pages) are saved at the peak.
  EXPECT_LE(with.peak_pages_used + 4 * 14, without.peak_pages_used + 4)
      << "peak pages " << with.peak_pages_used << " with sharing vs " << without.peak_pages_used << " without";
  EXPECT_LT(with.peak_sink_pages_used, without.peak_sink_pages_used);
  // A pool that holds about two of these requests: preemption and sharing together.
  const auto small = run(true, 60, &tight);
  EXPECT_GT(tight.preemptions + tight.prefix_hits, 0u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(small[size_t(i)], shared[size_t(i)]) << "request " << i;
}

// Finished prompts held for sharing (prefix_cache_seqs): a later request with the same system prompt
// shares the held pages; held prompts give way when a request needs their pages, without preemption.
TEST(Scheduler, HeldPromptsAreSharedLaterAndGiveWay) {
  KVQ_REQUIRE_STORIES260K();
  const QuantSpec s = spec(Format::kInt8, 16);
  const std::vector<int32_t> system = prompt_ids(5, 255);
  auto with_tail = [&](int i, int n) {
    std::vector<int32_t> p = system;
    const std::vector<int32_t> tail = prompt_ids(60 + i, n);
    p.insert(p.end(), tail.begin() + 1, tail.end());
    return p;
  };
  SchedulerOptions so;
  so.prefix_cache_seqs = 2;
  Harness h(s, 4, 40, 0, so);  // 40 pages of 16 tokens: one 300-token request holds 18
  SamplingParams p;
  p.max_tokens = 20;
  const auto a = with_tail(0, 40), b = with_tail(1, 30);
  const RequestId ia = h.add(a, p);
  h.drain();
  SchedulerCounters c = h.sched->counters();
  EXPECT_EQ(c.prefix_cached, 1);
  EXPECT_EQ(h.engine->book().pool().num_free(), 40 - 15) << "256 tokens less a 16-token sink: 15 pages held";
  const RequestId ib = h.add(b, p);
  h.drain();
  c = h.sched->counters();
  EXPECT_EQ(c.prefix_hits, 1u);
  EXPECT_EQ(c.prefix_shared_tokens, 256u);
  EXPECT_EQ(h.out[ia].tokens, run_alone(s, a, 20));
  EXPECT_EQ(h.out[ib].tokens, run_alone(s, b, 20));
  // An unrelated request that needs 30 of the 40 pages: the held prompt gives way, nothing is preempted.
  const auto big = prompt_ids(90, 470);
  const RequestId ic = h.add(big, p);
  h.drain();
  c = h.sched->counters();
  EXPECT_EQ(c.preemptions, 0u);
  EXPECT_EQ(h.out[ic].tokens, run_alone(s, big, 20));
  EXPECT_EQ(h.out[ic].finish, Finish::kLength);
  EXPECT_LE(c.prefix_cached, 2);
}

// A bf16 recent window keeps private twins of each sequence's last pages, which a shared prefix
// cannot carry: sharing and held prompts are off, and every request still gets the tokens it
// gets alone (the window's semantics do not depend on the batch).
TEST(Scheduler, RecentWindowTurnsPrefixSharingOff) {
  KVQ_REQUIRE_STORIES260K();
  QuantSpec s = spec(Format::kFp8E4m3, 32);
  s.recent_tokens = 48;
  const std::vector<int32_t> system = prompt_ids(7, 255);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> p = system;
    const std::vector<int32_t> tail = prompt_ids(70 + i, 20 + 5 * i);
    p.insert(p.end(), tail.begin() + 1, tail.end());
    prompts.push_back(p);
  }
  SchedulerOptions so;
  so.prefix_sharing = true;
  so.prefix_cache_seqs = 2;
  Harness h(s, 3, 0, 0, so);
  SamplingParams p;
  p.max_tokens = 12;
  std::vector<RequestId> ids;
  for (const auto& prompt : prompts) ids.push_back(h.add(prompt, p));
  h.drain();
  const SchedulerCounters c = h.sched->counters();
  EXPECT_EQ(c.prefix_hits, 0u);
  EXPECT_EQ(c.prefix_cached, 0);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(h.out[ids[i]].tokens, run_alone(s, prompts[i], 12)) << "request " << i;
  const cache::PagedKvCache& book = h.engine->book();
  EXPECT_EQ(book.recent_pool().num_free(), book.recent_pool().num_pages()) << "every twin back";
}

TEST(Scheduler, AdmitsOnlyWhatThePagesHold) {
  KVQ_REQUIRE_STORIES260K();
  // Each request needs ceil((1 + 100 + 1 - 16) / 16) = 6 main pages to be admitted; 13 pages hold 2.
  const QuantSpec s = spec(Format::kInt8, 16);
  Harness h(s, 8, 13);
  for (int i = 0; i < 5; ++i) {
    SamplingParams p;
    p.max_tokens = 8;
    h.add(prompt_ids(i, 100), p);
  }
  ASSERT_TRUE(h.sched->step().is_ok());
  SchedulerCounters c = h.sched->counters();
  EXPECT_EQ(c.running, 2);
  EXPECT_EQ(c.waiting, 3);
  EXPECT_EQ(c.admitted, 2u);
  h.drain();
  c = h.sched->counters();
  EXPECT_EQ(c.finished, 5u);
  EXPECT_LE(c.max_running, 2);
}

TEST(Scheduler, SinkPoolLimitsAdmission) {
  KVQ_REQUIRE_STORIES260K();
  // Sinks of 32 tokens (2 pages); a sink pool of 4 pages serves two sequences at a time.
  const QuantSpec s = spec(Format::kInt8, 32);
  Harness h(s, 8, 0, 4);
  std::vector<RequestId> ids;
  for (int i = 0; i < 4; ++i) {
    SamplingParams p;
    p.max_tokens = 10;
    ids.push_back(h.add(prompt_ids(i, 40), p));
  }
  h.drain();
  EXPECT_LE(h.sched->counters().max_running, 2);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(h.out[ids[size_t(i)]].tokens, run_alone(s, prompt_ids(i, 40), 10));
}

TEST(Scheduler, CancelsQueuedAndRunningRequests) {
  KVQ_REQUIRE_STORIES260K();
  const QuantSpec s = spec(Format::kBf16, 0);
  Harness h(s, 2, 0);
  std::vector<RequestId> ids;
  for (int i = 0; i < 4; ++i) {
    SamplingParams p;
    p.max_tokens = 50;
    p.stop_at_eos = false;
    ids.push_back(h.add(prompt_ids(i, 30), p));
  }
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(h.sched->step().is_ok());
  h.sched->cancel(ids[0]);  // running
  h.sched->cancel(ids[3]);  // waiting
  h.sched->cancel(9999);    // unknown: ignored
  h.drain();
  EXPECT_EQ(h.out[ids[0]].finish, Finish::kCancelled);
  EXPECT_EQ(h.out[ids[3]].finish, Finish::kCancelled);
  EXPECT_TRUE(h.out[ids[3]].tokens.empty());
  EXPECT_EQ(h.out[ids[1]].finish, Finish::kLength);
  EXPECT_EQ(h.out[ids[2]].finish, Finish::kLength);
  for (RequestId id : ids) EXPECT_EQ(h.out[id].done_events, 1);
  EXPECT_EQ(h.sched->counters().cancelled, 2u);
  EXPECT_EQ(h.engine->book().pool().num_free(), h.engine->book().pool().num_pages());
}

TEST(Scheduler, RejectsBadRequests) {
  KVQ_REQUIRE_STORIES260K();
  const QuantSpec s = spec(Format::kInt8, 16);
  Harness h(s, 2, 20);
  SamplingParams p;
  EXPECT_FALSE(h.sched->validate({}, p).is_ok());
  EXPECT_FALSE(h.sched->validate({1, 100000}, p).is_ok());
  p.max_tokens = 0;
  EXPECT_FALSE(h.sched->validate({1, 2}, p).is_ok());
  p.max_tokens = 600;  // beyond the 512-token context
  EXPECT_FALSE(h.sched->validate({1, 2}, p).is_ok());
  p.max_tokens = 400;  // within the context, beyond the 20-page pool
  EXPECT_FALSE(h.sched->validate({1, 2}, p).is_ok());
  p.max_tokens = 10;
  p.top_p = 0.f;
  EXPECT_FALSE(h.sched->validate({1, 2}, p).is_ok());
  p.top_p = 1.f;
  p.temperature = -1.f;
  EXPECT_FALSE(h.sched->validate({1, 2}, p).is_ok());
  p.temperature = 0.f;
  EXPECT_TRUE(h.sched->validate({1, 2}, p).is_ok());
  h.sched->shutdown();
  EXPECT_FALSE(h.sched->submit({1, 2}, p, nullptr).is_ok());
}

}  // namespace
}  // namespace kvq::serve
