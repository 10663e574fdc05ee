// `kvq serve`: HTTP (cpp-httplib) in front of the scheduler.
#include "kvq/serve/server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "kvq/cache/layout.h"
#include "kvq/model/model.h"
#include "kvq/serve/openai.h"

namespace kvq::serve {

using nlohmann::json;

namespace {

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Events of one request, handed from the engine thread to its HTTP thread.
struct Channel {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Event> events;
  void push(const Event& e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      events.push_back(e);
    }
    cv.notify_all();
  }
  std::deque<Event> wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, timeout, [&] { return !events.empty(); });
    std::deque<Event> out;
    out.swap(events);
    return out;
  }
};

std::string sse(const json& j) { return "data: " + dump_json(j) + "\n\n"; }

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.http_status;
  res.set_content(e.body(), "application/json");
}

ApiError api_error(int status, const std::string& msg, const std::string& code = "", const std::string& param = "") {
  ApiError e;
  e.http_status = status;
  e.message = msg;
  e.code = code;
  e.param = param;
  e.type = status >= 500 ? "server_error" : status == 404 ? "not_found_error" : "invalid_request_error";
  return e;
}

// Everything a streamed response needs after its handler returned.
struct StreamState {
  std::shared_ptr<Channel> ch;
  TextStream text;
  RequestId rid = 0;
  std::string id, model;
  int64_t created = 0;
  bool chat = false, include_usage = false, sent_role = false, closed = false;
  int prompt_tokens = 0, completion_tokens = 0;
  StreamState(const model::Tokenizer& tok, std::vector<std::string> stop) : text(tok, std::move(stop)) {}
};

}  // namespace

struct Server::Impl {
  Scheduler* sched = nullptr;
  ServerOptions opts;
  std::string model_id;
  httplib::Server http;
  std::thread engine_thread, http_thread;
  std::atomic<int> in_flight{0};  // requests between parse and their last byte
  std::atomic<uint64_t> next_id{1};
  std::atomic<uint64_t> http_errors_4xx{0}, http_errors_5xx{0};
  std::mutex stop_mu;
  std::atomic<int> listen_fd{-1};  // the listening socket, to widen its accept backlog
  bool started = false, stopped = false;
  int port = 0;

  const model::Model& model() const { return sched->engine().model(); }
  bool known_model(const std::string& name) const {
    if (name == model_id) return true;
    for (const std::string& a : opts.aliases)
      if (name == a) return true;
    return false;
  }
  // Largest prompt + max_tokens a request may ask for.
  int max_request_tokens() const {
    const auto& book = sched->engine().book();
    const int64_t pages = int64_t{book.pool().num_pages()} * book.geometry().block_size + book.spec().sink_tokens;
    return static_cast<int>(std::min<int64_t>(sched->engine().max_tokens(), pages));
  }
  void handle_completion(const httplib::Request& req, httplib::Response& res, bool chat);
  void install_routes();
  std::string metrics_text() const;
};

void Server::Impl::handle_completion(const httplib::Request& req, httplib::Response& res, bool chat) {
  if (!sched->accepting()) return send_error(res, api_error(503, "the server is shutting down; retry on another instance"));
  CompletionRequest cr;
  ApiError err;
  if (!parse_completion_request(req.body, chat, &cr, &err)) return send_error(res, err);
  if (!cr.model.empty() && !known_model(cr.model))
    return send_error(res, api_error(404, "the model '" + cr.model + "' is not served here (this server serves '" +
                                              model_id + "'; GET /v1/models lists it)",
                                     "model_not_found", "model"));
  const model::Tokenizer& tok = model().tokenizer();
  std::vector<int32_t> ids;
  if (!request_prompt_ids(cr, tok, model().config().add_bos, sched->engine().max_tokens(), &ids, &err))
    return send_error(res, err);
  if (!cr.max_tokens_given)
    cr.params.max_tokens = chat ? std::max(1, max_request_tokens() - static_cast<int>(ids.size())) : 16;
  if (Status v = sched->validate(ids, cr.params); !v.is_ok()) {
    const bool too_long = static_cast<int64_t>(ids.size()) + cr.params.max_tokens > max_request_tokens();
    return send_error(res, api_error(400, v.message(), too_long ? "context_length_exceeded" : "",
                                     too_long ? "max_tokens" : ""));
  }
  if (!cr.seed_given)  // a fresh stream per request, as OpenAI-compatible servers do without a seed
    cr.params.seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull +
                     next_id.load();
  auto ch = std::make_shared<Channel>();
  auto rid = sched->submit(ids, cr.params, [ch](const Event& e) { ch->push(e); });
  if (!rid.is_ok()) return send_error(res, api_error(503, rid.status().message()));
  const std::string id = std::string(chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id.fetch_add(1));
  const int64_t created = unix_now();

  if (!cr.stream) {
    TextStream text(tok, cr.stop);
    int completion = 0;
    for (;;) {
      bool done = false;
      Event last;
      for (const Event& e : ch->wait(std::chrono::milliseconds(200))) {
        if (e.token >= 0) {
          ++completion;
          if (!text.stopped()) {
            text.feed(e.token);
            if (text.stopped()) sched->cancel(rid.value());
          }
        }
        if (e.done) done = true, last = e;
      }
      if (!done) continue;
      if (last.finish == Finish::kError) return send_error(res, api_error(500, last.error));
      if (last.finish == Finish::kCancelled && !text.stopped())
        return send_error(res, api_error(503, "the request was cancelled (server shutting down)"));
      text.finish();
      const std::string reason = text.stopped() || last.finish == Finish::kStop ? "stop" : "length";
      res.set_content(dump_json(completion_response(chat, id, created, model_id, text.text(), reason,
                                          static_cast<int>(ids.size()), completion)),
                      "application/json");
      return;
    }
  }

  auto st = std::make_shared<StreamState>(tok, cr.stop);
  st->ch = ch;
  st->rid = rid.value();
  st->id = id;
  st->model = model_id;
  st->created = created;
  st->chat = chat;
  st->include_usage = cr.include_usage;
  st->prompt_tokens = static_cast<int>(ids.size());
  in_flight.fetch_add(1);  // until the stream's releaser runs
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, st](size_t, httplib::DataSink& sink) -> bool {
        std::deque<Event> evs = st->ch->wait(std::chrono::milliseconds(100));
        std::string out;
        if (st->chat && !st->sent_role) {
          out += sse(stream_chunk(true, st->id, st->created, st->model, "", "", true));
          st->sent_role = true;
        }
        for (const Event& e : evs) {
          if (st->closed) break;
          if (e.token >= 0) {
            ++st->completion_tokens;
            if (!st->text.stopped()) {
              const std::string d = st->text.feed(e.token);
              if (!d.empty()) out += sse(stream_chunk(st->chat, st->id, st->created, st->model, d, ""));
              if (st->text.stopped()) sched->cancel(st->rid);
            }
          }
          if (!e.done) continue;
          if (e.finish == Finish::kError) {
            out += sse(json::parse(api_error(500, e.error).body()));
          } else {
            const std::string tail = st->text.finish();
            if (!tail.empty()) out += sse(stream_chunk(st->chat, st->id, st->created, st->model, tail, ""));
            const std::string reason = st->text.stopped() || e.finish != Finish::kLength ? "stop" : "length";
            out += sse(stream_chunk(st->chat, st->id, st->created, st->model, "", reason));
            if (st->include_usage)
              out += sse(usage_chunk(st->chat, st->id, st->created, st->model, st->prompt_tokens, st->completion_tokens));
          }
          out += "data: [DONE]\n\n";
          st->closed = true;
        }
        if (out.empty()) {
          if (sink.is_writable()) return true;
          sched->cancel(st->rid);  // the client went away
          return false;
        }
        if (!sink.write(out.data(), out.size())) {
          if (!st->closed) sched->cancel(st->rid);
          return false;
        }
        if (st->closed) sink.done();
        return true;
      },
      [this, st](bool) {
        if (!st->closed) sched->cancel(st->rid);
        in_flight.fetch_sub(1);
      });
}

void Server::Impl::install_routes() {
  http.new_task_queue = [n = opts.http_threads] { return new httplib::ThreadPool(static_cast<size_t>(n)); };
  // cpp-httplib 0.11 listens with a backlog of 5: a burst of clients overflows it and some see
  // their connection reset. Keep the socket to listen() on it again with a deeper backlog.
  http.set_socket_options([this](socket_t sock) {
    httplib::default_socket_options(sock);
    listen_fd.store(static_cast<int>(sock));
  });
  http.set_payload_max_length(opts.max_body_bytes);
  http.set_error_handler([this](const httplib::Request&, httplib::Response& res) {
    (res.status >= 500 ? http_errors_5xx : http_errors_4xx).fetch_add(1);
    if (!res.body.empty()) return;
    if (res.status == 413)
      return send_error(res, api_error(413, "the request body exceeds the server's limit of " +
                                                std::to_string(opts.max_body_bytes) + " bytes; send a shorter prompt"));
    if (res.status == 404) return send_error(res, api_error(404, "no such endpoint; see /v1/models, /v1/completions, "
                                                                 "/v1/chat/completions, /health, /metrics"));
    send_error(res, api_error(res.status, "request failed with HTTP status " + std::to_string(res.status)));
  });
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, api_error(500, "internal error: " + what));
  });
  auto guarded = [this](bool chat) {
    return [this, chat](const httplib::Request& req, httplib::Response& res) {
      in_flight.fetch_add(1);
      handle_completion(req, res, chat);
      in_flight.fetch_sub(1);
    };
  };
  http.Post("/v1/completions", guarded(false));
  http.Post("/v1/chat/completions", guarded(true));
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    json m = {{"id", model_id}, {"object", "model"}, {"created", 0}, {"owned_by", "kvq"},
              {"max_model_len", sched->engine().max_tokens()}};
    res.set_content(dump_json(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const bool ok = sched->accepting();
    res.status = ok ? 200 : 503;
    res.set_content(json{{"status", ok ? "ok" : "draining"}}.dump(), "application/json");
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(), "text/plain; version=0.0.4");
  });
}

std::string Server::metrics_text() const { return impl_->metrics_text(); }

std::string Server::Impl::metrics_text() const {
  const Impl& im = *this;
  Scheduler& s = *im.sched;
  const SchedulerCounters c = s.counters();
  const QuantSpec& spec = s.engine().spec();
  const auto& g = s.engine().book().geometry();
  std::string o;
  render_histogram(&o, "kvq_time_to_first_token_seconds", "Time from request arrival to its first token.",
                   s.metrics().ttft);
  render_histogram(&o, "kvq_time_per_output_token_seconds", "Mean time per output token after the first, per request.",
                   s.metrics().tpot);
  render_histogram(&o, "kvq_e2e_request_latency_seconds", "Time from request arrival to its last token.", s.metrics().e2e);
  const std::string pages_help = "KV cache pages by pool (main: quantized, sink: bf16) and state.";
  render_sample(&o, "kvq_kv_cache_pages", "gauge", pages_help, c.pages_total - c.pages_free, "pool=\"main\",state=\"used\"");
  render_sample(&o, "kvq_kv_cache_pages", "gauge", pages_help, c.pages_free, "pool=\"main\",state=\"free\"");
  render_sample(&o, "kvq_kv_cache_pages", "gauge", pages_help, c.sink_pages_total - c.sink_pages_free,
                "pool=\"sink\",state=\"used\"");
  render_sample(&o, "kvq_kv_cache_pages", "gauge", pages_help, c.sink_pages_free, "pool=\"sink\",state=\"free\"");
  const size_t bpt = cache::bytes_per_token(spec, g.num_layers, g.num_kv_heads, g.head_dim);
  render_sample(&o, "kvq_kv_cache_bytes_per_token", "gauge",
                "KV bytes per token of the active cache spec, all layers, K and V, scales included.",
                static_cast<double>(bpt), "spec=\"" + spec.to_string() + "\"");
  render_sample(&o, "kvq_kv_cache_page_bytes", "gauge", "Bytes of one main-pool page across all layers.",
                static_cast<double>(cache::bytes_per_page(spec, g.num_layers, g.num_kv_heads, g.head_dim)));
  const size_t sink_page_b = 2 * size_t(g.num_layers) * g.bytes_per_sink_page();
  const size_t page_b = cache::bytes_per_page(spec, g.num_layers, g.num_kv_heads, g.head_dim);
  render_sample(&o, "kvq_kv_cache_peak_bytes", "gauge",
                "Most KV bytes held at once so far (main pages with scales, plus bf16 sink pages).",
                static_cast<double>(size_t(c.peak_pages_used) * page_b + size_t(c.peak_sink_pages_used) * sink_page_b));
  render_sample(&o, "kvq_preemptions_total", "counter", "Requests preempted (recomputed) because pages ran out.",
                static_cast<double>(c.preemptions));
  render_sample(&o, "kvq_prefix_hits_total", "counter",
                "Requests admitted on a running request's pages for their shared prompt prefix.",
                static_cast<double>(c.prefix_hits));
  render_sample(&o, "kvq_prefix_shared_tokens_total", "counter",
                "Prompt tokens taken from shared prefix pages instead of being computed and stored again.",
                static_cast<double>(c.prefix_shared_tokens));
  render_sample(&o, "kvq_prefix_cached_prompts", "gauge",
                "Finished prompts whose whole-chunk prefix pages are held for sharing (--prefix-cache-seqs).",
                c.prefix_cached);
  render_sample(&o, "kvq_requests_running", "gauge", "Requests holding a sequence.", c.running);
  render_sample(&o, "kvq_requests_waiting", "gauge", "Requests queued.", c.waiting);
  render_sample(&o, "kvq_requests_max_running", "gauge", "Most requests running at once so far.", c.max_running);
  const std::string req_help = "Finished requests by outcome.";
  render_sample(&o, "kvq_requests_total", "counter", req_help, static_cast<double>(c.finished), "outcome=\"ok\"");
  render_sample(&o, "kvq_requests_total", "counter", req_help, static_cast<double>(c.cancelled), "outcome=\"cancelled\"");
  render_sample(&o, "kvq_requests_total", "counter", req_help, static_cast<double>(c.failed), "outcome=\"error\"");
  render_sample(&o, "kvq_prompt_tokens_total", "counter", "Prompt tokens of admitted requests (first pass).",
                static_cast<double>(c.prompt_tokens));
  render_sample(&o, "kvq_generation_tokens_total", "counter", "Generated tokens.", static_cast<double>(c.generated_tokens));
  render_sample(&o, "kvq_recomputed_tokens_total", "counter", "Cached tokens dropped by preemption and computed again.",
                static_cast<double>(c.recomputed_tokens));
  render_sample(&o, "kvq_engine_steps_total", "counter", "Scheduler steps run.", static_cast<double>(c.steps));
  const std::string err_help = "HTTP error responses by class.";
  render_sample(&o, "kvq_http_errors_total", "counter", err_help, static_cast<double>(im.http_errors_4xx.load()),
                "class=\"4xx\"");
  render_sample(&o, "kvq_http_errors_total", "counter", err_help, static_cast<double>(im.http_errors_5xx.load()),
                "class=\"5xx\"");
  return o;
}

Result<std::unique_ptr<Server>> Server::create(Scheduler& sched, const ServerOptions& opts) {
  if (opts.http_threads < 1 || opts.http_threads > 4096) return invalid_argument("http_threads must be in [1, 4096]");
  if (opts.max_body_bytes < 1024 || opts.max_body_bytes > (size_t{1} << 30))
    return invalid_argument("the body limit must be in [1 KiB, 1 GiB] (got " + std::to_string(opts.max_body_bytes) +
                            " bytes)");
  if (opts.port < 0 || opts.port > 65535) return invalid_argument("port must be in [0, 65535]");
  std::unique_ptr<Server> s(new Server());
  s->impl_ = std::make_unique<Impl>();
  Impl& im = *s->impl_;
  im.sched = &sched;
  im.opts = opts;
  im.model_id = opts.model_id.empty() ? sched.engine().model().config().name : opts.model_id;
  if (im.model_id.empty()) im.model_id = "kvq-model";
  im.install_routes();
  return s;
}

Server::~Server() { stop(); }

Status Server::start() {
  Impl& im = *impl_;
  std::lock_guard<std::mutex> lock(im.stop_mu);
  if (im.started) return invalid_argument("the server is already started");
  if (im.opts.port == 0) {
    im.port = im.http.bind_to_any_port(im.opts.host);
  } else {
    im.port = im.http.bind_to_port(im.opts.host, im.opts.port) ? im.opts.port : -1;
  }
  if (im.port < 0)
    return invalid_argument("cannot listen on " + im.opts.host + ":" + std::to_string(im.opts.port) +
                            " (in use or not an address of this machine); choose another --host/--port");
  if (const int fd = im.listen_fd.load(); fd >= 0) (void)::listen(fd, 1024);  // Linux: updates the backlog
  im.started = true;
  im.engine_thread = std::thread([&im] { im.sched->run(); });
  im.http_thread = std::thread([&im] { im.http.listen_after_bind(); });
  return Status::ok();
}

int Server::port() const { return impl_->port; }
const std::string& Server::model_id() const { return impl_->model_id; }

void Server::stop() {
  Impl& im = *impl_;
  std::lock_guard<std::mutex> lock(im.stop_mu);
  if (!im.started || im.stopped) return;
  im.stopped = true;
  im.sched->shutdown();  // new requests: 503; run() returns once the queue is empty
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::seconds(im.opts.drain_timeout_s);
  while ((!im.sched->idle() || im.in_flight.load() > 0) && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  im.http.stop();  // also ends streams still open after the deadline (their releasers cancel them)
  if (im.http_thread.joinable()) im.http_thread.join();
  if (im.engine_thread.joinable()) im.engine_thread.join();
}

}  // namespace kvq::serve
