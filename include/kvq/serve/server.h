#pragma once
// `kvq serve`: an OpenAI-compatible HTTP server over a Scheduler (cpp-httplib).
//
//   POST /v1/completions        prompt (text or token ids), SSE streaming with "stream": true
//   POST /v1/chat/completions   messages through the model's chat template, SSE streaming
//   GET  /v1/models             the served model
//   GET  /health                200 while serving, 503 while draining
//   GET  /metrics               Prometheus text: TTFT/TPOT/e2e histograms, KV pages used/free per
//                               pool, preemptions, requests, tokens, bytes per token of the spec
//
// Errors are OpenAI-style JSON bodies ({"error": {...}}) with a 4xx status for the client's
// mistakes (malformed JSON, wrong types, over-long requests, unknown model, oversized body) and
// 5xx for the server's. One engine thread runs the scheduler; HTTP handler threads parse, submit
// and wait or stream. stop() drains: new requests get 503, requests in flight finish.
#include <memory>
#include <string>
#include <vector>

#include "kvq/common/status.h"
#include "kvq/serve/scheduler.h"

namespace kvq::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                       // 0: an ephemeral port (see Server::port())
  std::string model_id;                  // served model name; empty: the model's own name
  std::vector<std::string> aliases;      // further names accepted in "model"
  size_t max_body_bytes = 1 << 20;       // larger bodies: 413
  int http_threads = 64;                 // concurrent connections served (streams hold one each)
  int drain_timeout_s = 60;              // stop(): longest wait for requests in flight
};

class Server {
 public:
  // The scheduler (and its engine) must outlive the server.
  static Result<std::unique_ptr<Server>> create(Scheduler& sched, const ServerOptions& opts);
  ~Server();  // stop()s if still running

  // Binds, then serves on background threads (the engine thread and the HTTP listener).
  Status start();
  int port() const;                      // the bound port, after start()
  const std::string& model_id() const;
  // Graceful shutdown: refuses new requests (503), waits until the requests in flight are done
  // (at most drain_timeout_s, then cancels them), stops the listener. Idempotent.
  void stop();
  // The Prometheus text /metrics serves.
  std::string metrics_text() const;

 private:
  Server() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq::serve
