#pragma once
// Accuracy metrics of a quantized-cache run against the bf16 baseline on the same tokens.
// Everything is computed in float64 from float32 logits: a log-softmax over a 49152-entry vocabulary
// loses several digits in float32, which is the size of the effects being measured.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace kvq::eval {

// log(sum(exp(x))) over n logits, shifted by the max so it never overflows.
double log_sum_exp(const float* logits, int n);
// -log softmax(logits)[target].
double token_nll(const float* logits, int n, int32_t target);
// KL(softmax(p) || softmax(q)) in nats. Exactly 0 for identical rows.
double kl_divergence(const float* p_logits, const float* q_logits, int n);
// Index of the largest logit, the first one on ties; NaN entries never win.
int argmax(const float* logits, int n);

// What a baseline row contributes to every comparison; computed once, reused for each spec.
struct RowStats {
  double lse = 0;
  int argmax = 0;
};
RowStats row_stats(const float* logits, int n);

struct RowComparison {
  double base_nll = 0, spec_nll = 0, kl = 0;
  bool top1_agree = false;
};
RowComparison compare_rows(const float* base, const RowStats& base_stats, const float* spec, int n,
                           int32_t target);

// Running sums over compared positions (one per spec, and per window for the report).
struct Accumulator {
  int64_t count = 0;
  double base_nll_sum = 0, spec_nll_sum = 0, kl_sum = 0, kl_max = 0;
  int64_t top1_agree = 0;

  void add(const RowComparison& r);
  void merge(const Accumulator& o);
  double base_mean_nll() const;
  double spec_mean_nll() const;
  double mean_kl() const;
  double top1_rate() const;
};

// Long-context view: the same sums per position bucket, where a position is the index (BOS
// included) of the row whose next token is predicted. The buckets show where the bf16 sink (the
// first positions) and the quantized pages (later ones) set the error.
inline constexpr int kNumPositionBuckets = 4;
inline constexpr std::array<int, kNumPositionBuckets> kPositionBucketStart = {0, 256, 1024, 4096};
int position_bucket(int position);  // 0..3; negative positions go to bucket 0
std::string position_bucket_name(int bucket);  // "0-256", "256-1k", "1k-4k", "4k+"

struct BucketResult {
  std::string name;
  int begin = 0, end = -1;  // positions [begin, end); end -1: open
  int64_t predictions = 0;
  double kl_mean, kl_max, nll_delta;  // nll_delta: mean(spec NLL - bf16 NLL); NaN when empty
};

struct PositionBuckets {
  std::array<Accumulator, kNumPositionBuckets> acc;
  void add(int position, const RowComparison& r) { acc[static_cast<size_t>(position_bucket(position))].add(r); }
  void merge(const PositionBuckets& o);
  std::vector<BucketResult> results() const;  // all four, in order
};

double perplexity(double mean_nll);
// 100 * (spec / base - 1): +2.5 means the spec's perplexity is 2.5% higher.
double delta_ppl_pct(double base_ppl, double spec_ppl);

}  // namespace kvq::eval
