#include "kvq/eval/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <thread>

#include "kvq/cache/layout.h"
#include "kvq/model/engine.h"
#include "kvq/eval/gate.h"
#include "kvq/eval/metrics.h"

namespace kvq::eval {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One cache spec advancing through the windows next to the baseline: an engine holding one
// sequence per window in flight.
struct Lane {
  QuantSpec spec;
  std::unique_ptr<model::Engine> engine;
  std::vector<cache::SeqId> seqs;  // one per window slot
  std::string error;
  Accumulator total;
  std::vector<Accumulator> window;  // per window slot
  std::vector<double> window_nll;
  PositionBuckets buckets;
  int64_t tokens = 0;
  double seconds = 0;
};

// Compares rows [0, n) of a chunk on `threads` threads. Each row's result lands in its own slot
// and is summed in order afterwards, so the totals do not depend on the thread count.
void compare_chunk(const float* base, const std::vector<RowStats>& stats, const float* spec, int vocab,
                   const int32_t* targets, int n, int threads, std::vector<RowComparison>& out) {
  out.resize(static_cast<size_t>(n));
  auto work = [&](int r0, int r1) {
    for (int r = r0; r < r1; ++r)
      out[r] = compare_rows(base + static_cast<size_t>(r) * vocab, stats[r], spec + static_cast<size_t>(r) * vocab,
                            vocab, targets[r]);
  };
  threads = std::max(1, std::min(threads, n / 8));
  if (threads == 1) {
    work(0, n);
    return;
  }
  std::vector<std::thread> pool;
  const int per = (n + threads - 1) / threads;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, std::min(n, t * per), std::min(n, (t + 1) * per));
  work(0, std::min(n, per));
  for (auto& th : pool) th.join();
}

struct PassResult {
  SpecResult baseline;
  std::vector<SpecResult> specs;  // same order as the pass's spec list
};

class Evaluator {
 public:
  Evaluator(const model::Model& m, const std::vector<Window>& w, const EvalOptions& o, const ProgressFn& p)
      : model_(m), windows_(w), opts_(o), progress_(p), vocab_(m.config().vocab_size) {
    threads_ = o.threads > 0 ? o.threads
                             : std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 8);
  }

  Result<PassResult> run_pass(int pass, const std::vector<QuantSpec>& specs);
  void note(const std::string& line) {
    if (!progress_) return;
    EvalProgress e;
    e.note = line;
    e.elapsed_s = seconds_since(start_);
    progress_(e);
  }
  Clock::time_point start() const { return start_; }

 private:
  const model::Model& model_;
  const std::vector<Window>& windows_;
  EvalOptions opts_;
  const ProgressFn& progress_;
  int vocab_;
  int threads_ = 1;
  Clock::time_point start_ = Clock::now();
  std::unique_ptr<backend::Backend> cpu_;  // when the caller gave no backend
};

Result<PassResult> Evaluator::run_pass(int pass, const std::vector<QuantSpec>& specs) {
  int max_len = 0;
  for (const auto& w : windows_) max_len = std::max(max_len, static_cast<int>(w.tokens.size()));
  const int inflight = std::clamp(opts_.windows_in_flight, 1, std::max(1, static_cast<int>(windows_.size())));
  backend::Backend* be = opts_.backend;
  if (be == nullptr) {
    if (!cpu_) {
      auto cpu = backend::create_backend(backend::BackendKind::kCpu);
      if (!cpu.is_ok()) return cpu.status();
      cpu_ = std::move(cpu).value();
    }
    be = cpu_.get();
  }
  model::EngineOptions eo;
  eo.max_seqs = inflight;
  eo.max_tokens = max_len;
  eo.weights = opts_.runner.weights;
  eo.cuda_graphs = opts_.runner.cuda_graphs;
  // Windows forwarded together must score as they would alone: BLAS and cuBLAS may round a row
  // differently with the row count (OpenBLAS on AMD Zen does), so the products run per window.
  eo.batch_invariant = inflight > 1;
  auto make_lane = [&](Lane& l, const QuantSpec& spec) -> Status {
    l.spec = spec;
    l.window.assign(static_cast<size_t>(inflight), Accumulator{});
    auto e = model::Engine::create(model_, spec, *be, eo);
    if (!e.is_ok()) return e.status();
    l.engine = std::move(e).value();
    return Status::ok();
  };
  Lane base;
  if (Status st = make_lane(base, baseline_spec()); !st.is_ok())
    return Status(st.code(), "bf16 baseline engine: " + st.message());
  std::vector<Lane> lanes(specs.size());
  for (size_t i = 0; i < specs.size(); ++i)
    if (Status st = make_lane(lanes[i], specs[i]); !st.is_ok()) lanes[i].error = st.message();

  // A chunk longer than the longest window is never filled: clamp it, so --chunk cannot size the
  // logits buffers beyond what the text uses.
  const int chunk = std::clamp(opts_.chunk_tokens, 1, std::max(1, max_len));
  const size_t slot_floats = static_cast<size_t>(chunk) * vocab_;
  std::vector<float> base_logits(slot_floats * inflight), spec_logits(base_logits.size());
  std::vector<std::vector<RowStats>> stats(static_cast<size_t>(inflight), std::vector<RowStats>(chunk));
  std::vector<std::vector<int32_t>> targets(static_cast<size_t>(inflight), std::vector<int32_t>(chunk));
  std::vector<RowComparison> rows;

  const auto pass_start = Clock::now();
  EvalProgress prog;
  prog.pass = pass;
  prog.num_windows = static_cast<int>(windows_.size());
  int live = 1;
  for (const auto& l : lanes) live += l.error.empty() ? 1 : 0;
  for (const auto& w : windows_) prog.total += static_cast<int64_t>(w.tokens.size()) * live;

  // Fresh sequences for the windows [w0, w0 + count) of a group.
  auto reset = [&](Lane& l, int count) -> Status {
    for (cache::SeqId s : l.seqs) KVQ_RETURN_IF_ERROR(l.engine->free_sequence(s));
    l.seqs.clear();
    for (int i = 0; i < count; ++i) {
      auto s = l.engine->add_sequence();
      if (!s.is_ok()) return s.status();
      l.seqs.push_back(s.value());
      l.window[static_cast<size_t>(i)] = Accumulator{};
    }
    return Status::ok();
  };
  // One chunk of every window of the group that still has tokens at `off`, in one engine call.
  auto forward = [&](Lane& lane, size_t w0, int count, int off, float* logits) -> Status {
    std::vector<model::SeqStep> steps;
    int n_tok = 0;
    for (int i = 0; i < count; ++i) {
      const auto& tok = windows_[w0 + static_cast<size_t>(i)].tokens;
      const int n = static_cast<int>(tok.size());
      if (off >= n) continue;
      const int len = std::min(chunk, n - off);
      steps.push_back({lane.seqs[static_cast<size_t>(i)], tok.data() + off, len, model::LogitsMode::kAll,
                       logits + static_cast<size_t>(i) * slot_floats});
      n_tok += len;
    }
    auto t0 = Clock::now();
    Status st = lane.engine->forward(steps);
    lane.seconds += seconds_since(t0);
    lane.tokens += n_tok;
    prog.done += n_tok;
    return st;
  };

  for (size_t w0 = 0; w0 < windows_.size(); w0 += static_cast<size_t>(inflight)) {
    const int count = static_cast<int>(std::min<size_t>(inflight, windows_.size() - w0));
    int group_len = 0;
    for (int i = 0; i < count; ++i)
      group_len = std::max(group_len, static_cast<int>(windows_[w0 + static_cast<size_t>(i)].tokens.size()));
    KVQ_RETURN_IF_ERROR(reset(base, count));
    for (auto& l : lanes) {
      if (!l.error.empty()) continue;
      Status st = reset(l, count);
      if (!st.is_ok()) l.error = st.message();
    }
    for (int off = 0; off < group_len; off += chunk) {
      Status st = forward(base, w0, count, off, base_logits.data());
      if (!st.is_ok()) return Status(st.code(), "bf16 baseline forward: " + st.message());
      // Rows whose position has a next token; a window's last position has none.
      std::vector<int> scored(static_cast<size_t>(count), 0);
      for (int i = 0; i < count; ++i) {
        const auto& tok = windows_[w0 + static_cast<size_t>(i)].tokens;
        const int n = static_cast<int>(tok.size());
        scored[i] = std::max(0, std::min(std::min(chunk, n - off), n - 1 - off));
        for (int r = 0; r < scored[i]; ++r) {
          const float* row = base_logits.data() + static_cast<size_t>(i) * slot_floats + static_cast<size_t>(r) * vocab_;
          stats[i][r] = row_stats(row, vocab_);
          targets[i][r] = tok[off + r + 1];
          RowComparison self;
          self.base_nll = self.spec_nll = token_nll(row, vocab_, targets[i][r]);
          self.top1_agree = true;
          base.window[i].add(self);
        }
      }
      for (auto& l : lanes) {
        if (!l.error.empty()) continue;
        st = forward(l, w0, count, off, spec_logits.data());
        if (!st.is_ok()) {
          l.error = st.message();
          continue;
        }
        for (int i = 0; i < count; ++i) {
          if (scored[i] <= 0) continue;
          const size_t o = static_cast<size_t>(i) * slot_floats;
          compare_chunk(base_logits.data() + o, stats[i], spec_logits.data() + o, vocab_, targets[i].data(),
                        scored[i], threads_, rows);
          for (size_t r = 0; r < rows.size(); ++r) {
            l.window[i].add(rows[r]);
            l.buckets.add(off + static_cast<int>(r), rows[r]);
          }
        }
      }
      if (progress_) {
        prog.elapsed_s = seconds_since(start_);
        prog.pass_elapsed_s = seconds_since(pass_start);
        progress_(prog);
      }
    }
    for (int i = 0; i < count; ++i) {
      base.window_nll.push_back(base.window[i].spec_mean_nll());
      base.total.merge(base.window[i]);
      for (auto& l : lanes) {
        if (!l.error.empty()) continue;
        l.window_nll.push_back(l.window[i].spec_mean_nll());
        l.total.merge(l.window[i]);
      }
    }
    prog.window = static_cast<int>(w0) + count;
    if (progress_) {
      prog.elapsed_s = seconds_since(start_);
      prog.pass_elapsed_s = seconds_since(pass_start);
      progress_(prog);
    }
  }

  const auto& cfg = model_.config();
  const size_t bf16_bpt = cache::bytes_per_token(baseline_spec(), cfg.n_layers, cfg.n_kv_heads, cfg.head_dim);
  auto finish = [&](const Lane& l, bool is_base) {
    SpecResult r;
    r.spec = l.spec;
    r.is_baseline = is_base;
    r.error = l.error;
    r.evaluated = l.error.empty();
    r.bytes_per_token = cache::bytes_per_token(l.spec, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim);
    const double len = static_cast<double>(max_len);
    const double sink = l.spec.quantized() ? std::min<double>(std::max(0, l.spec.sink_tokens), len) : 0.0;
    // A recent window keeps bf16 copies of its last R tokens beside their codes.
    const double window = l.spec.quantized() ? std::min<double>(std::max(0, l.spec.recent_tokens), len - sink) : 0.0;
    r.bytes_per_token_at_ctx = (sink * bf16_bpt + (len - sink) * r.bytes_per_token + window * bf16_bpt) / len;
    r.saving_pct = 100.0 * (1.0 - static_cast<double>(r.bytes_per_token) / static_cast<double>(bf16_bpt));
    if (!r.evaluated) return r;
    r.predictions = l.total.count;
    r.tokens = l.tokens;
    r.nll = l.total.spec_mean_nll();
    r.ppl = perplexity(r.nll);
    r.kl_mean = l.total.mean_kl();
    r.kl_max = l.total.kl_max;
    r.top1 = l.total.top1_rate();
    r.window_nll = l.window_nll;
    if (!is_base) r.buckets = l.buckets.results();
    r.forward_seconds = l.seconds;
    r.tokens_per_s = l.seconds > 0 ? static_cast<double>(l.tokens) / l.seconds : 0;
    return r;
  };
  PassResult out;
  out.baseline = finish(base, true);
  out.baseline.delta_ppl_pct = 0;
  for (const auto& l : lanes) {
    SpecResult r = finish(l, false);
    if (r.evaluated) r.delta_ppl_pct = delta_ppl_pct(out.baseline.ppl, r.ppl);
    out.specs.push_back(std::move(r));
  }
  return out;
}

bool is_baseline_equivalent(const QuantSpec& s) { return same_cache(s, baseline_spec()); }

}  // namespace

QuantSpec baseline_spec() {
  QuantSpec s;
  s.format = Format::kBf16;
  s.sink_tokens = 0;
  return s;
}

Result<std::vector<Window>> eval_windows(const model::Model& model, const std::vector<int32_t>& text_ids,
                                         const EvalOptions& opts) {
  const auto& cfg = model.config();
  if (cfg.max_seq_len > 0 && opts.ctx > cfg.max_seq_len)
    return invalid_argument("--ctx " + std::to_string(opts.ctx) + " exceeds " + cfg.name + "'s context length " +
                            std::to_string(cfg.max_seq_len) + " (positions it was trained for); use --ctx " +
                            std::to_string(cfg.max_seq_len) + " or less");
  WindowOptions wo;
  wo.ctx = opts.ctx;
  wo.add_bos = opts.bos < 0 ? cfg.add_bos : opts.bos > 0;
  wo.bos_id = model.tokenizer().bos_id();
  wo.max_windows = opts.max_windows;
  wo.max_tokens = opts.max_tokens;
  return split_windows(text_ids, wo);
}

Result<EvalReport> run_eval(const model::Model& model, const std::vector<int32_t>& text_ids,
                            const std::vector<SpecRequest>& requests, const EvalOptions& opts,
                            const ProgressFn& progress) {
  if (requests.empty()) return invalid_argument("no cache spec to evaluate");
  if (opts.chunk_tokens < 1)
    return invalid_argument("--chunk " + std::to_string(opts.chunk_tokens) + " is not valid; use 1 or more tokens");
  if (!(opts.gate_pct >= 0)) return invalid_argument("the gate must be a non-negative percentage");
  auto windows = eval_windows(model, text_ids, opts);
  if (!windows.is_ok()) return windows.status();
  Evaluator ev(model, windows.value(), opts, progress);

  // Pass 1: every explicit spec, plus each auto's first candidate (always needed).
  std::vector<QuantSpec> pass_specs;
  auto want = [&](const QuantSpec& s) {
    if (is_baseline_equivalent(s)) return;
    for (const auto& p : pass_specs)
      if (same_cache(p, s)) return;
    pass_specs.push_back(s);
  };
  for (const auto& r : requests) {
    if (r.is_auto && !r.auto_chain.empty()) want(r.auto_chain.front());
    else if (!r.is_auto) want(r.spec);
  }
  auto first = ev.run_pass(1, pass_specs);
  if (!first.is_ok()) return first.status();

  EvalReport rep;
  rep.model_name = model.config().name;
  rep.vocab = model.config().vocab_size;
  rep.ctx = static_cast<int>(windows.value().front().tokens.size());
  rep.bos = opts.bos < 0 ? model.config().add_bos : opts.bos > 0;
  rep.num_windows = static_cast<int>(windows.value().size());
  rep.text_tokens = static_cast<int64_t>(text_ids.size());
  rep.gate_pct = opts.gate_pct;
  rep.baseline = first.value().baseline;
  rep.baseline.label = "bf16 (baseline)";
  rep.baseline.gate_note = "baseline";
  rep.predictions = rep.baseline.predictions;
  std::vector<SpecResult> evaluated = std::move(first.value().specs);

  auto find = [&](const QuantSpec& s) -> const SpecResult* {
    if (is_baseline_equivalent(s)) return &rep.baseline;
    for (const auto& r : evaluated)
      if (same_cache(r.spec, s)) return &r;
    return nullptr;
  };

  // Later passes: auto fallbacks, all autos' next candidates together.
  for (int pass = 2;; ++pass) {
    std::vector<QuantSpec> need;
    for (const auto& r : requests) {
      if (!r.is_auto) continue;
      AutoStep st = auto_step(r.auto_chain, find, opts.gate_pct);
      if (st.decided) continue;
      if (!st.notes.empty()) ev.note(st.notes.back());  // why the previous candidate was passed over
      bool dup = false;
      for (const auto& q : need) dup = dup || same_cache(q, r.auto_chain[st.index]);
      if (!dup) need.push_back(r.auto_chain[st.index]);
    }
    if (need.empty()) break;
    for (const auto& q : need)
      ev.note("auto: evaluating fallback " + q.to_string() + " (pass " + std::to_string(pass) + ")");
    auto more = ev.run_pass(pass, need);
    if (!more.is_ok()) return more.status();
    const double a = more.value().baseline.nll, b = rep.baseline.nll;
    if (std::fabs(a - b) > 1e-9 * std::max(1.0, std::fabs(b)))
      rep.notes.push_back("warning: the bf16 baseline NLL changed between passes (" + std::to_string(b) + " vs " +
                          std::to_string(a) + "): the forward pass is not deterministic");
    for (auto& r : more.value().specs) evaluated.push_back(std::move(r));
  }

  rep.results.push_back(rep.baseline);
  for (const auto& req : requests) {
    if (!req.is_auto && is_baseline_equivalent(req.spec)) continue;  // the baseline row stands for it
    SpecResult row;
    if (req.is_auto) {
      AutoStep st = auto_step(req.auto_chain, find, opts.gate_pct);
      rep.notes.insert(rep.notes.end(), st.notes.begin(), st.notes.end());
      if (!st.notes.empty()) ev.note(st.notes.back());  // the earlier ones were shown as they happened
      const SpecResult* chosen = st.decided && !req.auto_chain.empty() ? find(req.auto_chain[st.index]) : nullptr;
      if (!chosen) continue;
      row = *chosen;
      row.is_baseline = false;
      row.spec = req.auto_chain[st.index];
      row.spec.from_auto = true;
    } else {
      const SpecResult* r = find(req.spec);
      if (!r) return internal_error("eval lost the result of " + req.spec.to_string());
      row = *r;
    }
    row.label = req.label;
    rep.results.push_back(std::move(row));
  }
  apply_gate(rep.results, opts.gate_pct);
  rep.total_seconds = seconds_since(ev.start());
  return rep;
}

Result<std::vector<float>> compute_logits(const model::Model& model, const QuantSpec& spec,
                                          const std::vector<int32_t>& tokens, int chunk_tokens,
                                          backend::Backend* backend) {
  if (tokens.empty()) return invalid_argument("no tokens to compute logits for");
  if (chunk_tokens < 1) return invalid_argument("the chunk size must be at least 1 token");
  auto runner = model::Runner::create(model, spec, static_cast<int>(tokens.size()), backend);
  if (!runner.is_ok()) return runner.status();
  const size_t vocab = static_cast<size_t>(model.config().vocab_size);
  std::vector<float> logits(tokens.size() * vocab);
  const int n = static_cast<int>(tokens.size());
  for (int off = 0; off < n; off += chunk_tokens) {
    const int len = std::min(chunk_tokens, n - off);
    KVQ_RETURN_IF_ERROR(runner.value()->forward(tokens.data() + off, len, logits.data() + off * vocab));
  }
  return logits;
}

}  // namespace kvq::eval
