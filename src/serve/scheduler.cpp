// Continuous batching over one Engine: admission by free pages, chunked prefill mixed with decode
// under a token budget, preemption by recompute, per-request sampling, cancellation.
#include "kvq/serve/scheduler.h"

#include <algorithm>
#include <unordered_map>

#include "kvq/model/model.h"

namespace kvq::serve {
namespace {

using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
int ceil_div(int a, int b) { return (a + b - 1) / b; }

struct Pages {
  int main = 0, sink = 0;
};

}  // namespace

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::kNone: return "";
    case Finish::kStop: return "stop";
    case Finish::kLength: return "length";
    case Finish::kCancelled: return "cancelled";
    case Finish::kError: return "error";
  }
  return "";
}

struct Request {
  RequestId id = 0;
  std::vector<int32_t> tokens;  // prompt, then the generated tokens
  int prompt_len = 0;
  SamplingParams p;
  EventFn fn;
  uint64_t rng = 0;
  cache::SeqId seq = -1;
  int computed = 0;   // tokens held in the cache
  int generated = 0;
  Clock::time_point t_submit, t_first, t_last;
};

struct Scheduler::Impl {
  model::Engine* engine = nullptr;
  SchedulerOptions opts;
  Metrics metrics;
  int chunk = 128, bs = 16, sink_cap = 0, ctx = 0, eos = -1;

  // Shared with submitting threads.
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Request>> incoming;
  std::unordered_set<RequestId> cancels;
  RequestId next_id = 1;
  bool accepting = true;
  std::atomic<int> active{0};  // submitted and not yet done
  SchedulerCounters counters;  // guarded by mu

  // Engine thread only.
  std::deque<std::unique_ptr<Request>> waiting;
  std::vector<std::unique_ptr<Request>> running;  // admission order
  // Finished prompts kept for sharing (SchedulerOptions::prefix_cache_seqs): a sequence truncated to
  // whole chunks of its prompt, and those tokens. Front = least recently used.
  struct Held {
    cache::SeqId seq = -1;
    std::vector<int32_t> tokens;
  };
  std::deque<Held> held;

  // Pages a sequence of `len` tokens holds in each pool.
  Pages pages_for(int len) const {
    const int s = std::min(len, sink_cap), m = std::max(0, len - sink_cap);
    return Pages{ceil_div(m, bs), ceil_div(s, bs)};
  }
  Pages delta(int from, int to) const {
    const Pages a = pages_for(from), b = pages_for(to);
    return Pages{b.main - a.main, b.sink - a.sink};
  }
  // Tokens of the next piece of r within `budget` rows (0: none fits).
  int next_piece(const Request& r, int budget) const {
    const int total = static_cast<int>(r.tokens.size());
    const int pf_end = opts.exact_recompute ? r.prompt_len : total;
    if (r.computed >= pf_end) return budget >= 1 ? 1 : 0;  // decode (or replay of a generated token)
    const int left = pf_end - r.computed;
    if (left <= budget) return left;
    return budget / chunk * chunk;  // whole chunks, so the engine cuts the pieces it cuts alone
  }
  void emit(Request& r, Event e) {
    e.prompt_tokens = r.prompt_len;
    e.completion_tokens = r.generated;
    if (r.fn) r.fn(e);
  }
  // Whole chunks of tokens[0, lim) that close whole pages: what may be shared of them.
  int shareable(int lim) const {
    int l = lim / chunk * chunk;
    while (l > 0 && !cache::PagedKvCache::prefix_pages_closed(l, sink_cap, bs)) l -= chunk;
    return l;
  }
  // Keeps a finished request's prompt pages for later requests (or frees its sequence).
  void release(Request& r, bool keep) {
    if (r.seq < 0) return;
    const int l = keep && opts.prefix_sharing && opts.prefix_cache_seqs > 0
                      ? shareable(std::min(r.prompt_len, r.computed)) : 0;
    bool covered = false;  // an equal or longer prompt prefix is already held
    for (const Held& h : held)
      covered = covered || (static_cast<int>(h.tokens.size()) >= l &&
                            std::equal(r.tokens.begin(), r.tokens.begin() + l, h.tokens.begin()));
    if (l >= chunk && !covered && engine->truncate_sequence(r.seq, l).is_ok()) {
      held.push_back(Held{r.seq, std::vector<int32_t>(r.tokens.begin(), r.tokens.begin() + l)});
      while (static_cast<int>(held.size()) > opts.prefix_cache_seqs) evict_one();
    } else {
      (void)engine->free_sequence(r.seq);
    }
    r.seq = -1;
  }
  bool evict_one() {
    if (held.empty()) return false;
    (void)engine->free_sequence(held.front().seq);
    held.pop_front();
    return true;
  }
  void finish(std::unique_ptr<Request> r, Finish f, const std::string& error, bool with_token, int32_t token) {
    release(*r, f == Finish::kStop || f == Finish::kLength);
    r->seq = -1;
    const Clock::time_point now = Clock::now();
    if (f == Finish::kStop || f == Finish::kLength) {
      metrics.e2e.observe(secs(r->t_submit, now));
      if (r->generated > 1) metrics.tpot.observe(secs(r->t_first, r->t_last) / (r->generated - 1));
    }
    Event e;
    e.token = with_token ? token : -1;
    e.done = true;
    e.finish = f;
    e.error = error;
    emit(*r, e);
    {
      std::lock_guard<std::mutex> lock(mu);
      if (f == Finish::kCancelled) ++counters.cancelled;
      else if (f == Finish::kError) ++counters.failed;
      else ++counters.finished;
    }
    active.fetch_sub(1);
  }
  void preempt(std::unique_ptr<Request> r) {
    (void)engine->free_sequence(r->seq);
    r->seq = -1;
    {
      std::lock_guard<std::mutex> lock(mu);
      ++counters.preemptions;
      counters.recomputed_tokens += static_cast<uint64_t>(r->computed);
    }
    r->computed = 0;
    waiting.push_front(std::move(r));
  }
  void take_incoming_and_cancels() {
    std::unordered_set<RequestId> cancel_now;
    {
      std::lock_guard<std::mutex> lock(mu);
      while (!incoming.empty()) {
        waiting.push_back(std::move(incoming.front()));
        incoming.pop_front();
      }
      cancel_now.swap(cancels);
    }
    if (cancel_now.empty()) return;
    auto drop = [&](auto& list) {
      for (auto it = list.begin(); it != list.end();) {
        if (cancel_now.count((*it)->id)) {
          auto r = std::move(*it);
          it = list.erase(it);
          finish(std::move(r), Finish::kCancelled, "", false, -1);
        } else {
          ++it;
        }
      }
    };
    drop(waiting);
    drop(running);
  }
  // Prefix sharing for a request about to be admitted: the running request whose prompt shares the
  // longest prefix with r's, and how many tokens of it r may take (whole chunks, whole pages, at most
  // r's prompt less one token, which must run to give the first logits). `ready` is false while the
  // donor has not yet computed them (r then waits for it).
  // A held prompt (held_index >= 0) is always ready.
  struct Share {
    cache::SeqId seq = -1;
    int tokens = 0;
    bool ready = false;
    int held_index = -1;
  };
  Share find_share(const Request& r) const {
    Share best;
    if (!opts.prefix_sharing || r.prompt_len <= chunk) return best;
    auto common = [&](const std::vector<int32_t>& t, int lim) {
      lim = std::min({lim, r.prompt_len - 1, static_cast<int>(t.size())});
      int l = 0;
      while (l < lim && r.tokens[static_cast<size_t>(l)] == t[static_cast<size_t>(l)]) ++l;
      return shareable(l);
    };
    for (const auto& d : running) {
      if (d->seq < 0) continue;
      const int l = common(d->tokens, d->prompt_len);
      if (l > best.tokens) best = Share{d->seq, l, d->computed >= l, -1};
    }
    for (size_t i = 0; i < held.size(); ++i) {
      const int l = common(held[i].tokens, static_cast<int>(held[i].tokens.size()));
      if (l > best.tokens || (l == best.tokens && l > 0 && !best.ready)) best = Share{held[i].seq, l, true, static_cast<int>(i)};
    }
    return best;
  }
  // Occupancy for other threads (counters()), taken on the engine thread.
  void publish() {
    const auto& book = engine->book();
    std::lock_guard<std::mutex> lock(mu);
    counters.pages_free = book.pool().num_free();
    counters.sink_pages_free = book.sink_pool().num_free();
    counters.peak_pages_used = std::max(counters.peak_pages_used, counters.pages_total - counters.pages_free);
    counters.peak_sink_pages_used =
        std::max(counters.peak_sink_pages_used, counters.sink_pages_total - counters.sink_pages_free);
    counters.running = static_cast<int>(running.size());
    counters.prefix_cached = static_cast<int>(held.size());
    counters.waiting = static_cast<int>(waiting.size());
  }
  Result<bool> step();
};

Result<std::unique_ptr<Scheduler>> Scheduler::create(model::Engine& engine, const SchedulerOptions& opts) {
  std::unique_ptr<Scheduler> s(new Scheduler());
  s->impl_ = std::make_unique<Impl>();
  Impl& im = *s->impl_;
  im.engine = &engine;
  im.opts = opts;
  im.chunk = engine.options().chunk_tokens;
  im.bs = engine.book().geometry().block_size;
  im.sink_cap = engine.book().spec().sink_tokens;
  // A bf16 recent window keeps private twins of a sequence's last pages, which a shared prefix
  // cannot carry (cache::PagedKvCache::share_prefix refuses): prefix sharing is off with a window.
  if (engine.book().geometry().recent_tokens > 0) im.opts.prefix_sharing = false;
  im.ctx = engine.max_tokens();
  im.eos = engine.model().tokenizer().eos_id();
  if (im.opts.max_step_tokens < 0) return invalid_argument("scheduler: max_step_tokens must be >= 0");
  if (im.opts.max_step_tokens == 0) im.opts.max_step_tokens = 2 * im.chunk;
  // One chunk of prefill must fit beside a decode row of every running sequence.
  im.opts.max_step_tokens = std::max(im.opts.max_step_tokens, im.chunk + engine.max_seqs());
  im.counters.pages_total = engine.book().pool().num_pages();
  im.counters.sink_pages_total = engine.book().sink_pool().num_pages();
  im.publish();
  return s;
}

Scheduler::~Scheduler() = default;

Status Scheduler::validate(const std::vector<int32_t>& prompt, const SamplingParams& p) const {
  const Impl& im = *impl_;
  if (prompt.empty()) return invalid_argument("the prompt is empty; send at least one token of text");
  const int vocab = im.engine->model().config().vocab_size;
  for (int32_t t : prompt)
    if (t < 0 || t >= vocab)
      return invalid_argument("prompt token id " + std::to_string(t) + " is outside the vocabulary of " +
                              std::to_string(vocab));
  if (p.max_tokens < 1) return invalid_argument("max_tokens must be at least 1 (got " + std::to_string(p.max_tokens) + ")");
  if (!(p.temperature >= 0.f) || p.temperature > 100.f)
    return invalid_argument("temperature must be in [0, 100]");
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) return invalid_argument("top_p must be in (0, 1]");
  const int64_t total = static_cast<int64_t>(prompt.size()) + p.max_tokens;
  if (total > im.ctx)
    return invalid_argument("the prompt (" + std::to_string(prompt.size()) + " tokens) plus max_tokens (" +
                            std::to_string(p.max_tokens) + ") exceed the context of " + std::to_string(im.ctx) +
                            " tokens; shorten the prompt or lower max_tokens");
  const Pages need = im.pages_for(static_cast<int>(total));
  const auto& book = im.engine->book();
  if (need.main > book.pool().num_pages() || need.sink > book.sink_pool().num_pages())
    return invalid_argument("the prompt plus max_tokens (" + std::to_string(total) +
                            " tokens) need more KV pages than the server's whole cache holds; lower max_tokens or "
                            "start the server with more KV memory");
  return Status::ok();
}

Result<RequestId> Scheduler::submit(std::vector<int32_t> prompt, const SamplingParams& p, EventFn on_event) {
  KVQ_RETURN_IF_ERROR(validate(prompt, p));
  Impl& im = *impl_;
  auto r = std::make_unique<Request>();
  r->prompt_len = static_cast<int>(prompt.size());
  r->tokens = std::move(prompt);
  r->tokens.reserve(r->tokens.size() + static_cast<size_t>(p.max_tokens));
  r->p = p;
  r->rng = p.seed;
  r->fn = std::move(on_event);
  r->t_submit = Clock::now();
  RequestId id;
  {
    std::lock_guard<std::mutex> lock(im.mu);
    if (!im.accepting) return unsupported("the server is shutting down and takes no new requests");
    id = r->id = im.next_id++;
    im.incoming.push_back(std::move(r));
    im.active.fetch_add(1);
  }
  im.cv.notify_all();
  return id;
}

void Scheduler::cancel(RequestId id) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->cancels.insert(id);
  }
  impl_->cv.notify_all();
}

Result<bool> Scheduler::step() { return impl_->step(); }

Result<bool> Scheduler::Impl::step() {
  take_incoming_and_cancels();
  // Cancellations of requests that already finished are stale: forget them.
  {
    std::lock_guard<std::mutex> lock(mu);
    if (active.load() == 0) cancels.clear();
  }
  if (waiting.empty() && running.empty()) {
    publish();
    return false;
  }
  const auto& book = engine->book();
  int budget = opts.max_step_tokens;
  int reserved_main = 0, reserved_sink = 0;
  auto free_main = [&] { return book.pool().num_free() - reserved_main; };
  auto free_sink = [&] { return book.sink_pool().num_free() - reserved_sink; };
  struct Planned {
    Request* r;
    int n;
  };
  std::vector<Planned> plan;
  bool preempted = false;

  // Running requests, oldest first; preempt from the newest end when pages run short.
  for (size_t i = 0; i < running.size();) {
    Request& r = *running[i];
    const int n = next_piece(r, budget);
    if (n == 0) {
      ++i;
      continue;
    }
    const Pages need = delta(r.computed, r.computed + n);
    bool self = false;
    while (need.main > free_main() || need.sink > free_sink()) {
      if (evict_one()) continue;  // held prompts give way first
      self = running.size() - 1 == i;
      auto victim = std::move(running.back());
      running.pop_back();
      preempt(std::move(victim));
      preempted = true;
      if (self) break;
    }
    if (self) break;
    reserved_main += need.main, reserved_sink += need.sink;
    budget -= n;
    plan.push_back({&r, n});
    ++i;
  }

  // Admission (FIFO), not in a step that had to preempt. A request waiting for a running request to
  // finish prefilling the prefix it will share is passed over (it keeps its place in the queue).
  for (size_t w = 0; !preempted && w < waiting.size() && static_cast<int>(running.size()) < engine->max_seqs() &&
                     budget > 0;) {
    Request& r = *waiting[w];
    Share share = find_share(r);
    if (share.seq >= 0 && !share.ready) {
      ++w;
      continue;
    }
    if (share.held_index >= 0) {  // most recently used goes last (evicted last)
      std::rotate(held.begin() + share.held_index, held.begin() + share.held_index + 1, held.end());
      share.held_index = static_cast<int>(held.size()) - 1;
    }
    r.computed = share.tokens;  // 0 without a donor
    const int n = next_piece(r, budget);
    if (n == 0) {
      r.computed = 0;
      break;
    }
    const int known = std::min(static_cast<int>(r.tokens.size()) + 1, ctx);
    const Pages whole = delta(share.tokens, known), first = delta(share.tokens, share.tokens + n);
    const bool fits = whole.main <= free_main() && whole.sink <= free_sink();
    auto seq = !fits ? Result<cache::SeqId>(out_of_memory("pages"))
                     : (share.seq >= 0 ? engine->add_sequence_sharing(share.seq, share.tokens) : engine->add_sequence());
    if (!seq.is_ok()) {
      // Pages short or the engine's sequence slots full: a held prompt other than the one to share
      // (that one was just moved to the back, so the front is another) gives way, else admission
      // stops (FIFO).
      r.computed = 0;
      if (held.size() > (share.held_index >= 0 ? 1u : 0u)) {
        evict_one();
        continue;
      }
      break;
    }
    auto owned = std::move(waiting[w]);
    waiting.erase(waiting.begin() + static_cast<long>(w));
    owned->seq = seq.value();
    reserved_main += first.main, reserved_sink += first.sink;
    budget -= n;
    plan.push_back({owned.get(), n});
    running.push_back(std::move(owned));
    std::lock_guard<std::mutex> lock(mu);
    ++counters.admitted;
    if (share.seq >= 0) {
      ++counters.prefix_hits;
      counters.prefix_shared_tokens += static_cast<uint64_t>(share.tokens);
    }
    counters.max_running = std::max(counters.max_running, static_cast<int>(running.size()));
  }
  if (plan.empty()) {
    publish();
    return false;
  }

  // Pieces that end at a request's last known token sample its next token; the others only fill
  // the cache.
  std::vector<model::SeqStep> fill, last;
  std::vector<Request*> fill_r, last_r;
  std::vector<model::SampleParams> params;
  for (const Planned& pl : plan) {
    Request& r = *pl.r;
    model::SeqStep s{r.seq, r.tokens.data() + r.computed, pl.n, model::LogitsMode::kNone, nullptr};
    if (r.computed + pl.n == static_cast<int>(r.tokens.size())) {
      s.mode = model::LogitsMode::kLast;
      last.push_back(s);
      last_r.push_back(&r);
      model::SampleParams sp;
      sp.temperature = r.p.temperature;
      sp.top_p = r.p.top_p;
      sp.uniform = r.p.temperature > 0.f ? model::next_uniform(&r.rng) : 0.0;
      params.push_back(sp);
    } else {
      fill.push_back(s);
      fill_r.push_back(&r);
    }
  }
  auto fail_all = [&](const std::vector<Request*>& rs, const Status& st) {
    for (Request* p : rs) {
      auto it = std::find_if(running.begin(), running.end(), [&](auto& u) { return u.get() == p; });
      if (it == running.end()) continue;
      auto r = std::move(*it);
      running.erase(it);
      finish(std::move(r), Finish::kError, "the engine failed: " + st.message(), false, -1);
    }
  };
  uint64_t prompt_rows = 0;
  if (!fill.empty()) {
    const Status st = engine->forward(fill);
    if (!st.is_ok()) {
      fail_all(fill_r, st);
    } else {
      for (size_t j = 0; j < fill.size(); ++j) fill_r[j]->computed += fill[j].n;
    }
  }
  std::vector<int32_t> out(last.size(), -1);
  if (!last.empty()) {
    const Status st = engine->forward_sample(last, params, out.data());
    if (!st.is_ok()) {
      fail_all(last_r, st);
      last_r.clear();
    }
  }
  const Clock::time_point now = Clock::now();
  uint64_t new_tokens = 0;
  for (size_t j = 0; j < last_r.size(); ++j) {
    Request& r = *last_r[j];
    r.computed += last[j].n;
    if (r.generated == 0) prompt_rows += static_cast<uint64_t>(r.prompt_len);
    const int32_t tok = out[j];
    r.tokens.push_back(tok);
    ++r.generated;
    ++new_tokens;
    if (r.generated == 1) {
      r.t_first = now;
      metrics.ttft.observe(secs(r.t_submit, now));
    }
    r.t_last = now;
    Finish f = Finish::kNone;
    if (r.p.stop_at_eos && tok == eos) f = Finish::kStop;
    else if (r.generated >= r.p.max_tokens || static_cast<int>(r.tokens.size()) >= ctx) f = Finish::kLength;
    if (f == Finish::kNone) {
      Event e;
      e.token = tok;
      emit(r, e);
      continue;
    }
    auto it = std::find_if(running.begin(), running.end(), [&](auto& u) { return u.get() == &r; });
    auto owned = std::move(*it);
    running.erase(it);
    finish(std::move(owned), f, "", true, tok);
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    ++counters.steps;
    counters.generated_tokens += new_tokens;
    counters.prompt_tokens += prompt_rows;
  }
  publish();
  return true;
}

void Scheduler::run() {
  Impl& im = *impl_;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(im.mu);
      if (im.active.load() == 0 && im.incoming.empty()) {
        if (!im.accepting) return;
        im.cv.wait_for(lock, std::chrono::milliseconds(50));
        continue;
      }
    }
    auto r = im.step();
    if (!r.is_ok() || !r.value()) {
      // Nothing runnable this instant (e.g. only stale cancellations): wait for news briefly.
      std::unique_lock<std::mutex> lock(im.mu);
      im.cv.wait_for(lock, std::chrono::milliseconds(2));
    }
  }
}

void Scheduler::shutdown() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->accepting = false;
  }
  impl_->cv.notify_all();
}

bool Scheduler::accepting() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->accepting;
}

bool Scheduler::idle() const { return impl_->active.load() == 0; }

SchedulerCounters Scheduler::counters() const {
  const Impl& im = *impl_;
  std::lock_guard<std::mutex> lock(im.mu);
  SchedulerCounters c = im.counters;  // occupancy as of the last step
  c.waiting += static_cast<int>(im.incoming.size());
  return c;
}

Metrics& Scheduler::metrics() { return impl_->metrics; }
model::Engine& Scheduler::engine() { return *impl_->engine; }
const SchedulerOptions& Scheduler::options() const { return impl_->opts; }

}  // namespace kvq::serve
