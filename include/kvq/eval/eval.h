#pragma once
// `kvq eval`: teacher-forced runs of the same windows with the bf16 baseline cache and with each
// requested cache spec, compared position by position.
//
// Memory: a window's logits are ctx x vocab floats (400 MB for SmolLM2 at 2048), so nothing keeps
// them. Every runner (baseline and each spec) advances through a window in chunks of
// `chunk_tokens`; the baseline's chunk is computed once and each spec's chunk is compared with it
// right away, so only two chunks of logits are alive at any time.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvq/common/status.h"
#include "kvq/eval/results.h"
#include "kvq/eval/specs.h"
#include "kvq/eval/windows.h"
#include "kvq/model/model.h"

namespace kvq::eval {

struct EvalOptions {
  int ctx = 2048;            // tokens per window (BOS included); at most the model's max_seq_len
  int max_windows = 0;       // 0 = no limit
  int64_t max_tokens = 0;    // window-token budget per spec; 0 = no limit
  int chunk_tokens = 256;    // tokens per forward() call; a multiple of the block size keeps pages whole
  double gate_pct = 3.0;     // dPPL above this fails a spec (and moves auto down its chain)
  int bos = -1;              // -1: as the model asks (ModelConfig::add_bos), 0: never, 1: always
  int threads = 0;           // threads comparing logits rows; 0 = hardware concurrency (max 8)
  backend::Backend* backend = nullptr;  // where the model runs; null = a CPU backend
  int windows_in_flight = 1;  // windows forwarded together per engine step (GPU: many; CPU: 1 is fastest)
  model::RunnerOptions runner;          // weights dtype, CUDA graphs
};

struct EvalProgress {
  int pass = 1;             // 1: the requested specs; 2+: auto fallbacks that needed evaluating
  int window = 0;           // windows finished in this pass
  int num_windows = 0;
  int64_t done = 0, total = 0;  // tokens forwarded by all runners of this pass, done / planned
  double elapsed_s = 0;     // since run_eval started
  double pass_elapsed_s = 0;  // since this pass started
  std::string note;         // a line worth printing (auto decisions); empty for plain progress
};
using ProgressFn = std::function<void(const EvalProgress&)>;

// The baseline every spec is compared with: bf16 pages, no separate sink.
QuantSpec baseline_spec();

// Windows as run_eval cuts them (for callers that need the token ids, e.g. logits dumps).
Result<std::vector<Window>> eval_windows(const model::Model& model, const std::vector<int32_t>& text_ids,
                                         const EvalOptions& opts);

Result<EvalReport> run_eval(const model::Model& model, const std::vector<int32_t>& text_ids,
                            const std::vector<SpecRequest>& specs, const EvalOptions& opts,
                            const ProgressFn& progress = {});

// Logits [tokens.size()][vocab] of one run from an empty cache (validation against other engines).
Result<std::vector<float>> compute_logits(const model::Model& model, const QuantSpec& spec,
                                          const std::vector<int32_t>& tokens, int chunk_tokens = 256,
                                          backend::Backend* backend = nullptr);

}  // namespace kvq::eval
