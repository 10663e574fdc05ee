// Runner: one sequence on an Engine (the single-sequence API that eval, generate and the tests use).
#include <algorithm>

#include "kvq/model/engine.h"
#include "kvq/model/model.h"

namespace kvq::model {

struct Runner::Impl {
  std::unique_ptr<backend::Backend> owned;  // when the caller gave no backend
  std::unique_ptr<Engine> engine;
  cache::SeqId seq = -1;
};

Result<std::unique_ptr<Runner>> Runner::create(const Model& model, const QuantSpec& spec, int max_tokens,
                                               backend::Backend* be, const RunnerOptions& ro) {
  const ModelConfig& c = model.config();
  if (max_tokens <= 0 || max_tokens > c.max_seq_len)
    return invalid_argument("max_tokens " + std::to_string(max_tokens) + " must be in [1, " + std::to_string(c.max_seq_len) +
                            "] (the model's context length)");
  std::unique_ptr<Runner> r(new Runner());
  r->impl_ = std::make_unique<Impl>();
  Impl& im = *r->impl_;
  if (be == nullptr) {
    auto cpu = backend::create_backend(backend::BackendKind::kCpu);
    if (!cpu.is_ok()) return cpu.status();
    im.owned = std::move(cpu).value();
    be = im.owned.get();
  }
  EngineOptions eo;
  eo.max_seqs = 1;
  eo.max_tokens = max_tokens;
  eo.weights = ro.weights;
  eo.cuda_graphs = ro.cuda_graphs;
  auto e = Engine::create(model, spec, *be, eo);
  if (!e.is_ok()) return e.status();
  im.engine = std::move(e).value();
  auto seq = im.engine->add_sequence();
  if (!seq.is_ok()) return seq.status();
  im.seq = seq.value();
  return r;
}

Runner::~Runner() = default;

Status Runner::forward(const int32_t* tokens, int n, float* logits) {
  return impl_->engine->forward({SeqStep{impl_->seq, tokens, n, logits ? LogitsMode::kAll : LogitsMode::kNone, logits}});
}

Status Runner::forward_last(const int32_t* tokens, int n, float* logits) {
  if (n <= 0) return invalid_argument("forward_last: need at least one token");
  return impl_->engine->forward({SeqStep{impl_->seq, tokens, n, logits ? LogitsMode::kLast : LogitsMode::kNone, logits}});
}

Result<int32_t> Runner::forward_sample(const int32_t* tokens, int n, const SampleParams& p) {
  if (n <= 0) return invalid_argument("forward_sample: need at least one token");
  int32_t id = -1;
  KVQ_RETURN_IF_ERROR(impl_->engine->forward_sample({SeqStep{impl_->seq, tokens, n, LogitsMode::kLast, nullptr}}, {p}, &id));
  return id;
}

Status Runner::reset() {
  Impl& im = *impl_;
  KVQ_RETURN_IF_ERROR(im.engine->free_sequence(im.seq));
  auto seq = im.engine->add_sequence();
  if (!seq.is_ok()) return seq.status();
  im.seq = seq.value();
  return Status::ok();
}

int Runner::position() const { return impl_->engine->position(impl_->seq); }
int Runner::max_tokens() const { return impl_->engine->max_tokens(); }
const Model& Runner::model() const { return impl_->engine->model(); }
const cache::PagedKvCache& Runner::cache() const { return impl_->engine->book(); }
Engine& Runner::engine() { return *impl_->engine; }
cache::SeqId Runner::sequence() const { return impl_->seq; }

void set_compute_threads(int n) { backend::set_cpu_threads(n); }
int compute_threads() { return backend::cpu_threads(); }

}  // namespace kvq::model
