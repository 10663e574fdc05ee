#pragma once
// The engine: a Llama-family model running many sequences over one paged, quantized KV cache on any
// backend (docs/ARCHITECTURE.md §6, §8). Every heavy operation goes through backend::Backend; the
// engine itself only plans steps (which rows belong to which sequence, where each token's K/V
// goes) and keeps the host bookkeeping cache (sequences, block tables).
//
// A forward step appends tokens to several sequences at once: a sequence with one new token
// decodes (all such sequences in one batched decode call), a sequence with more is prefilled in
// chunks of `chunk_tokens`, each chunk attending over the cache *as stored* (its own quantized K/V
// plus the bf16 sink), exactly as decode will later see it. The chunking is the same on every
// backend, so backends differ only by rounding inside the ops.
#include <cstdint>
#include <memory>
#include <vector>

#include "kvq/backend/backend.h"
#include "kvq/cache/paged_cache.h"
#include "kvq/common/status.h"
#include "kvq/model/model.h"
#include "kvq/quant/spec.h"

namespace kvq::model {

struct EngineOptions {
  int max_seqs = 1;         // sequences alive at once
  int max_tokens = 0;       // tokens per sequence; 0 = the model's context; at most the model's context
  int num_pages = 0;        // main pool pages; 0 = enough for max_seqs full sequences
  int num_sink_pages = 0;   // bf16 sink pool pages; 0 = one full sink per sequence (max_seqs sinks)
  // bf16 recent-window pool pages (QuantSpec::recent_tokens > 0); 0 = one window plus one chunk per
  // sequence (cache::PagedKvCache::recent_pages_per_sequence) for max_seqs sequences.
  int num_recent_pages = 0;
  int chunk_tokens = 128;   // prefill chunk per sequence and step (bounds scratch memory)
  int max_step_tokens = 0;  // rows per step over all sequences; 0 = chunk_tokens * min(max_seqs, 8)
  WeightsDType weights = WeightsDType::kAuto;
  bool cuda_graphs = true;  // capture pure decode steps where the backend supports graphs
  // Every matrix product runs per sequence piece instead of once over the step's rows, so a
  // sequence's numbers are bit-identical to running it alone whatever shares its step (BLAS and
  // cuBLAS round a row differently depending on the row count). Costs the weight reuse of
  // batched decode; for verification and reproducible serving (`kvq serve --batch-invariant`).
  bool batch_invariant = false;
};

enum class LogitsMode : uint8_t { kNone, kLast, kAll };

// n tokens appended to `seq`. `logits` (host) receives [n][vocab] (kAll), [vocab] (kLast) or nothing.
struct SeqStep {
  cache::SeqId seq = -1;
  const int32_t* tokens = nullptr;
  int n = 0;
  LogitsMode mode = LogitsMode::kNone;
  float* logits = nullptr;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(const Model& model, const QuantSpec& spec, backend::Backend& backend,
                                                const EngineOptions& opts = {});
  ~Engine();

  // A new empty sequence (kOutOfMemory when max_seqs are alive).
  Result<cache::SeqId> add_sequence();
  // A new sequence whose first n_tokens are those of `donor` (a common prompt prefix), referencing the
  // donor's pages instead of recomputing them (cache::PagedKvCache::share_prefix: whole pages only,
  // nothing copied, any backend). The new sequence continues at position n_tokens. kOutOfMemory when
  // max_seqs are alive; kInvalidArgument when n_tokens is beyond the donor or splits a page.
  Result<cache::SeqId> add_sequence_sharing(cache::SeqId donor, int n_tokens);
  Status free_sequence(cache::SeqId seq);
  // Keeps the first n_tokens of seq (whole pages; cache::PagedKvCache::truncate).
  Status truncate_sequence(cache::SeqId seq, int n_tokens);
  int position(cache::SeqId seq) const;  // tokens in the cache, -1 for an unknown id

  // Appends every step's tokens (distinct sequences). On failure the sequences of this call are
  // left broken (free them); other sequences are untouched.
  Status forward(const std::vector<SeqStep>& steps);
  // forward() with kLast logits kept on the backend, then one token sampled per step on the
  // backend (params[i] for steps[i]); out[i] receives it. Only the ids cross to the host.
  Status forward_sample(const std::vector<SeqStep>& steps, const std::vector<SampleParams>& params, int32_t* out);

  const Model& model() const;
  const QuantSpec& spec() const;
  int max_tokens() const;
  int max_seqs() const;
  backend::Backend& backend();
  const cache::PagedKvCache& book() const;  // host bookkeeping (and, on the cpu backend, the planes)
  backend::CacheStorage& storage();         // the planes in the backend's memory
  const EngineOptions& options() const;

 private:
  Engine() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq::model
