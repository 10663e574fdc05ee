#pragma once
// What an evaluation produces: one row per cache spec, compared with the bf16 baseline.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kvq/eval/metrics.h"
#include "kvq/quant/spec.h"

namespace kvq::eval {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct SpecResult {
  std::string label;  // as requested, e.g. "fp8:per_tensor", "auto"
  QuantSpec spec;     // for `auto`, the spec it settled on (spec.from_auto set)
  bool is_baseline = false;
  bool evaluated = false;
  std::string error;  // set when this spec could not run (the others still do)

  int64_t predictions = 0;  // scored positions, all windows
  int64_t tokens = 0;       // tokens forwarded (timing denominator)
  double nll = kNaN, ppl = kNaN, delta_ppl_pct = kNaN;
  double kl_mean = kNaN, kl_max = kNaN;  // KL(p_bf16 || p_spec), nats per position
  double top1 = kNaN;                    // fraction of positions whose argmax matches bf16's
  std::vector<double> window_nll;        // mean NLL of each window
  std::vector<BucketResult> buckets;     // KL and NLL delta by position (metrics.h), all windows

  size_t bytes_per_token = 0;         // steady state, scale metadata included (cache::bytes_per_token)
  double bytes_per_token_at_ctx = 0;  // the bf16 sink amortised over one window of ctx tokens
  double saving_pct = 0;              // 100 * (1 - bytes_per_token / bf16's)
  double forward_seconds = 0, tokens_per_s = 0;

  bool gate_pass = true;
  std::string gate_note;
};

struct EvalReport {
  std::string model_name;
  int vocab = 0;
  int ctx = 0;
  bool bos = false;
  int num_windows = 0;
  int64_t text_tokens = 0;   // tokens in the whole tokenized text
  int64_t predictions = 0;   // scored positions per spec
  double gate_pct = 0;
  SpecResult baseline;
  std::vector<SpecResult> results;  // in request order (bf16 rows repeat the baseline)
  std::vector<std::string> notes;   // auto decisions and anything else worth printing
  double total_seconds = 0;
};

}  // namespace kvq::eval
