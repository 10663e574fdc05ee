#pragma once
// Continuous batching over one model::Engine (README, "Serving").
//
// Requests are submitted from any thread; one engine thread calls step() (or run()). Each step:
//   1. takes new requests and cancellations;
//   2. plans the running requests in admission order: a request whose cache holds everything but
//      its last token decodes (1 row), one still in its prompt prefills a chunk. Prefill pieces are
//      whole multiples of the engine's chunk_tokens starting at chunk-aligned positions (only the
//      prompt's tail is shorter), so the engine cuts exactly the pieces it cuts for the same prompt
//      run alone, and a request's numbers do not depend on the batch it shares;
//   3. reserves the pages the step needs (main pool and bf16 sink pool, counted from the cache
//      geometry). When they are short it preempts the most recently admitted request by
//      recompute: its sequence is freed and it goes back to the head of the queue with its prompt
//      and generated tokens. It is never aborted and its sink is never shortened;
//   4. admits waiting requests (FIFO) while sequences, pages for their whole known tokens and the
//      step's token budget allow, sharing the pages of a running request's identical prompt prefix
//      (SchedulerOptions::prefix_sharing);
//   5. runs the engine: forward() for pieces that do not end at the request's last token,
//      forward_sample() for those that do (one token per request, with its own temperature, top_p
//      and seeded draw), and reports tokens and completions through each request's callback.
//
// Recompute replays a preempted request's history exactly as it first ran (the prompt in the same
// chunks, the generated tokens one per step), so with the default `exact_recompute` it computes
// the same pieces as without preemption (bit-identical results when the engine runs with
// EngineOptions::batch_invariant: BLAS rounds a row differently with the number of rows per call). `exact_recompute = false` prefills prompt and generated tokens
// together (faster after long generations; results may differ by rounding).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "kvq/common/status.h"
#include "kvq/model/engine.h"
#include "kvq/serve/metrics.h"

namespace kvq::serve {

struct SamplingParams {
  int max_tokens = 16;      // generated tokens at most (>= 1)
  float temperature = 0.f;  // 0: greedy
  float top_p = 1.f;        // (0, 1]
  uint64_t seed = 0;        // the request's splitmix64 stream (model::next_uniform)
  bool stop_at_eos = true;
};

enum class Finish : uint8_t { kNone, kStop, kLength, kCancelled, kError };
const char* finish_name(Finish f);  // "", "stop", "length", "cancelled", "error"

// What a request's callback receives: one event per generated token (token >= 0), the last one
// with done = true (a done event may carry no token: cancellation, error).
struct Event {
  int32_t token = -1;
  bool done = false;
  Finish finish = Finish::kNone;
  std::string error;  // kError: what went wrong
  int prompt_tokens = 0, completion_tokens = 0;
};
// Called on the engine thread; must return quickly (hand the event to the waiting thread).
using EventFn = std::function<void(const Event&)>;

using RequestId = uint64_t;

struct SchedulerOptions {
  int max_step_tokens = 0;  // rows per step over all requests; 0: 2 * chunk_tokens (at least chunk_tokens + max_seqs)
  bool exact_recompute = true;
  // Shared prompt prefixes: a request whose prompt starts with at least one prefill chunk of a
  // running request's prompt references that request's pages (whole chunks, so whole pages) instead
  // of computing them again, and while those tokens are still being prefilled it waits for them
  // (other requests are admitted meanwhile). The pages are reference counted: they stay while any
  // sequence holds them, also after the first request finishes. The shared tokens were computed in
  // the same chunks the request would compute alone, so results do not change.
  bool prefix_sharing = true;
  // With prefix_sharing: how many finished requests keep their prompt's pages (whole chunks) for later
  // requests to share, least recently used first out. Held prompts give way before any running
  // request is preempted, and when a sequence slot is needed. 0: none kept.
  int prefix_cache_seqs = 0;
};

struct SchedulerCounters {
  uint64_t steps = 0, admitted = 0, finished = 0, cancelled = 0, failed = 0, preemptions = 0;
  uint64_t prompt_tokens = 0, generated_tokens = 0, recomputed_tokens = 0;
  uint64_t prefix_hits = 0, prefix_shared_tokens = 0;  // admissions that shared a prefix; tokens not computed
  int prefix_cached = 0;                                // finished prompts held for sharing (prefix_cache_seqs)
  int running = 0, waiting = 0;
  int pages_total = 0, pages_free = 0, sink_pages_total = 0, sink_pages_free = 0;
  int max_running = 0;  // most requests running at once so far
  int peak_pages_used = 0, peak_sink_pages_used = 0;  // most pages held at the end of a step so far
};

class Scheduler {
 public:
  // The engine must outlive the scheduler and be used by nothing else while it runs.
  static Result<std::unique_ptr<Scheduler>> create(model::Engine& engine, const SchedulerOptions& opts = {});
  ~Scheduler();

  // Checks a request against the engine (thread-safe, no side effects): a non-empty prompt of
  // valid ids, max_tokens >= 1, prompt + max_tokens within the context and within what the pools
  // can ever hold, sampling parameters in range. kInvalidArgument says what to change.
  Status validate(const std::vector<int32_t>& prompt, const SamplingParams& p) const;
  // Queues a request (thread-safe). kUnavailable after shutdown() began.
  Result<RequestId> submit(std::vector<int32_t> prompt, const SamplingParams& p, EventFn on_event);
  // Cancels a queued or running request (thread-safe; unknown or finished ids are ignored). Its
  // callback gets a done event with Finish::kCancelled from the engine thread.
  void cancel(RequestId id);

  // One scheduling step (engine thread only). Returns whether any work was done.
  Result<bool> step();
  // Steps until stop_when_idle() was called and nothing is left, sleeping while idle.
  void run();
  // Stops accepting requests; run() returns once the requests in flight are done (drain).
  void shutdown();
  bool accepting() const;
  bool idle() const;  // nothing queued or running

  SchedulerCounters counters() const;
  Metrics& metrics();
  model::Engine& engine();
  const SchedulerOptions& options() const;

 private:
  Scheduler() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq::serve
