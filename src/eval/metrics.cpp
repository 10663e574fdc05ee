#include "kvq/eval/metrics.h"

#include <cmath>
#include <limits>

namespace kvq::eval {

double log_sum_exp(const float* logits, int n) {
  double m = -std::numeric_limits<double>::infinity();
  bool any_nan = false;
  for (int i = 0; i < n; ++i) {
    double x = logits[i];
    if (std::isnan(x)) any_nan = true;
    else if (x > m) m = x;
  }
  // A NaN logit poisons the distribution; say so with a NaN instead of quietly skipping it.
  if (any_nan || n <= 0) return std::numeric_limits<double>::quiet_NaN();
  if (std::isinf(m)) return m;
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(static_cast<double>(logits[i]) - m);
  return m + std::log(s);
}

double token_nll(const float* logits, int n, int32_t target) {
  if (target < 0 || target >= n) return std::numeric_limits<double>::quiet_NaN();
  return log_sum_exp(logits, n) - static_cast<double>(logits[target]);
}

double kl_divergence(const float* p_logits, const float* q_logits, int n) {
  double lse_p = log_sum_exp(p_logits, n), lse_q = log_sum_exp(q_logits, n);
  double kl = 0;
  for (int i = 0; i < n; ++i) {
    double lp = p_logits[i] - lse_p;
    double lq = q_logits[i] - lse_q;
    double p = std::exp(lp);
    // p = 0 contributes 0 even where q is -inf (0 * log 0 convention).
    if (p > 0) kl += p * (lp - lq);
  }
  return kl;
}

int argmax(const float* logits, int n) {
  int best = 0;
  float bv = -std::numeric_limits<float>::infinity();
  bool found = false;
  for (int i = 0; i < n; ++i) {
    if (std::isnan(logits[i])) continue;
    if (!found || logits[i] > bv) {
      bv = logits[i];
      best = i;
      found = true;
    }
  }
  return best;
}

RowStats row_stats(const float* logits, int n) { return {log_sum_exp(logits, n), argmax(logits, n)}; }

RowComparison compare_rows(const float* base, const RowStats& bs, const float* spec, int n, int32_t target) {
  RowComparison r;
  double lse_s = log_sum_exp(spec, n);
  double kl = 0;
  float best = -std::numeric_limits<float>::infinity();
  int best_i = 0;
  bool found = false;
  for (int i = 0; i < n; ++i) {
    double lb = base[i] - bs.lse;
    double ls = spec[i] - lse_s;
    double p = std::exp(lb);
    if (p > 0) kl += p * (lb - ls);
    if (!std::isnan(spec[i]) && (!found || spec[i] > best)) {
      best = spec[i];
      best_i = i;
      found = true;
    }
  }
  r.kl = kl;
  r.base_nll = (target >= 0 && target < n) ? bs.lse - base[target] : std::numeric_limits<double>::quiet_NaN();
  r.spec_nll = (target >= 0 && target < n) ? lse_s - spec[target] : std::numeric_limits<double>::quiet_NaN();
  r.top1_agree = best_i == bs.argmax;
  return r;
}

void Accumulator::add(const RowComparison& r) {
  ++count;
  base_nll_sum += r.base_nll;
  spec_nll_sum += r.spec_nll;
  kl_sum += r.kl;
  // NaN must stick in the max too, or a broken row would vanish from the worst case.
  if (std::isnan(r.kl) || r.kl > kl_max) kl_max = std::isnan(kl_max) ? kl_max : r.kl;
  top1_agree += r.top1_agree ? 1 : 0;
}

void Accumulator::merge(const Accumulator& o) {
  count += o.count;
  base_nll_sum += o.base_nll_sum;
  spec_nll_sum += o.spec_nll_sum;
  kl_sum += o.kl_sum;
  if (std::isnan(o.kl_max) || o.kl_max > kl_max) kl_max = std::isnan(kl_max) ? kl_max : o.kl_max;
  top1_agree += o.top1_agree;
}

static double mean(double sum, int64_t n) {
  return n > 0 ? sum / static_cast<double>(n) : std::numeric_limits<double>::quiet_NaN();
}
double Accumulator::base_mean_nll() const { return mean(base_nll_sum, count); }
double Accumulator::spec_mean_nll() const { return mean(spec_nll_sum, count); }
double Accumulator::mean_kl() const { return mean(kl_sum, count); }
double Accumulator::top1_rate() const { return mean(static_cast<double>(top1_agree), count); }

int position_bucket(int position) {
  int b = 0;
  while (b + 1 < kNumPositionBuckets && position >= kPositionBucketStart[static_cast<size_t>(b + 1)]) ++b;
  return b;
}

std::string position_bucket_name(int bucket) {
  auto label = [](int v) { return v % 1024 == 0 && v > 0 ? std::to_string(v / 1024) + "k" : std::to_string(v); };
  const size_t b = static_cast<size_t>(bucket);
  if (bucket + 1 >= kNumPositionBuckets) return label(kPositionBucketStart[b]) + "+";
  return label(kPositionBucketStart[b]) + "-" + label(kPositionBucketStart[b + 1]);
}

void PositionBuckets::merge(const PositionBuckets& o) {
  for (size_t b = 0; b < acc.size(); ++b) acc[b].merge(o.acc[b]);
}

std::vector<BucketResult> PositionBuckets::results() const {
  std::vector<BucketResult> out;
  for (int b = 0; b < kNumPositionBuckets; ++b) {
    const Accumulator& a = acc[static_cast<size_t>(b)];
    BucketResult r;
    r.name = position_bucket_name(b);
    r.begin = kPositionBucketStart[static_cast<size_t>(b)];
    r.end = b + 1 < kNumPositionBuckets ? kPositionBucketStart[static_cast<size_t>(b + 1)] : -1;
    r.predictions = a.count;
    r.kl_mean = a.mean_kl();
    r.kl_max = a.count > 0 ? a.kl_max : std::numeric_limits<double>::quiet_NaN();
    r.nll_delta = mean(a.spec_nll_sum - a.base_nll_sum, a.count);
    out.push_back(r);
  }
  return out;
}

double perplexity(double mean_nll) { return std::exp(mean_nll); }
double delta_ppl_pct(double base_ppl, double spec_ppl) { return 100.0 * (spec_ppl / base_ppl - 1.0); }

}  // namespace kvq::eval
